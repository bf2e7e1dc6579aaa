"""Probe (GPU): where the forward+backward time of attention goes, kernel by kernel.

For each sequence length and each (level, variant) of `benchmarks.attention`, it times
the forward+backward step, records two steps under ``jax.profiler`` and prints device ms
per category and the top kernels with the HLO instruction they run. Run it with
``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` so kernels carry their HLO op.

    python -m benchmarks._probe_attention_profile --seqs 8192 16384
    python -m benchmarks._probe_attention_profile --seqs 8192 16384 32768 --bwd-limits 8 16 32
        (the core's forward+backward with cuDNN's FP8 backward split into calls of at
        most that many (batch, head) pairs, against bf16)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import jax

from benchmarks import attention, linear
from benchmarks.profile_train import (
    _instructions,
    _summary,
    device_kernel_ns,
    kernel_ms,
)
from fp8jax import _cudnn_attention

CASES = (("attention", "cudnn-bf16"), ("attention", "fp8jax-fp8_dpa"), ("mha", "cudnn-bf16"),
         ("mha", "fp8jax-fp8_dpa"), ("mha", "fp8jax-fp8_mha"))


def _step(level: str, variant: str, seq: int):
    p = attention.case_params(seq, quick=jax.devices()[0].platform != "gpu")
    module, shapes = attention.build(level, variant, p, jax.random.PRNGKey(seq), "auto")
    keys = jax.random.split(jax.random.PRNGKey(seq + 1), 3 * len(shapes) + 1)
    sets = [[jax.random.normal(keys[3 * j + i], s, attention.BF16) for j, s in enumerate(shapes)] for i in range(3)]
    g = jax.random.normal(keys[-1], shapes[0], attention.BF16)
    step = attention.make_step(module, "fwd+bwd", sets[0], g)
    return p, step, sets, g


def chunk_sweep(seq: int, limits) -> None:
    """fwd+bwd ms of the FP8 core per backward chunk limit, and of bf16."""
    _, step, sets, g = _step("attention", "cudnn-bf16", seq)
    bf16 = linear.time_step(step, sets, g, 5, 3, warmup=1)
    saved = _cudnn_attention.BWD_MAX_BATCH_HEADS
    try:
        for limit in limits:
            _cudnn_attention.BWD_MAX_BATCH_HEADS = limit
            p, step, sets, g = _step("attention", "fp8jax-fp8_dpa", seq)
            ms = linear.time_step(step, sets, g, 5, 3, warmup=1)
            print(f"chunks seq {seq} batch {p['batch']} limit {limit}: bf16 {bf16:.3f} ms, fp8 {ms:.3f} ms, "
                  f"{bf16 / ms:.3f}x", flush=True)
    finally:
        _cudnn_attention.BWD_MAX_BATCH_HEADS = saved


def profile(level: str, variant: str, seq: int, steps: int = 2, top: int = 14, dump=None) -> None:
    p, step, sets, g = _step(level, variant, seq)
    ms = linear.time_step(step, sets, g, 5, 3, warmup=1)
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{level}_{variant}_{seq}.hlo.txt").write_text(step.compiled.as_text())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for i in range(steps):
                out = step.jitted(step.params, sets[i % 3], g)
            jax.block_until_ready(out)
        kernels = device_kernel_ns(trace_dir)
    lines = _instructions(step.compiled.as_text())
    by_cat, by_op = kernel_ms(kernels, lines, steps)
    total = sum(by_cat.values())
    print(f"\n== {level} {variant} seq {seq} batch {p['batch']}: step {ms:.3f} ms, kernels {total:.3f} ms, "
          f"{sum(1 for _ in kernels) // steps} launches", flush=True)
    print("   " + ", ".join(f"{c} {v:.3f}" for c, v in by_cat.most_common()), flush=True)
    for (cat, op), v in by_op.most_common(top):
        print(f"   {v:8.3f} ms  {cat:14s} {op[:40]:40s} {_summary(lines.get(op, ''))[:110]}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--cases", nargs="+", default=[f"{lv}:{v}" for lv, v in CASES])
    ap.add_argument("--bwd-limits", type=int, nargs="+")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--dump", type=Path, help="write each compiled step's HLO here")
    args = ap.parse_args(argv)
    if args.bwd_limits:
        for seq in args.seqs:
            chunk_sweep(seq, args.bwd_limits)
        return
    for seq in args.seqs:
        for case in args.cases:
            level, variant = case.split(":")
            try:
                profile(level, variant, seq, top=args.top, dump=args.dump)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"== {case} seq {seq}: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
