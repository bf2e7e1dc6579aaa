"""Benchmark: causal attention, forward and forward+backward, bf16 cuDNN vs FP8.

Two levels, each timed in one process and one run:

* ``attention`` (the core on BTNH q, k, v): ``cudnn-bf16`` (``jax.nn.dot_product_attention``,
  cuDNN) vs ``fp8jax-fp8_dpa`` (`fp8jax.nn.dot_product_attention`, cuDNN FP8 with
  bf16 in/out, the casts included; ``backend="cudnn"``), ``fp8jax-mgpu`` (the same module with
  ``backend="mgpu"``: fp8jax's own FP8 flash attention, forward and backward, in place of
  cuDNN's; the reference backend under ``--quick``) and ``fp8-mgpu``, forward only
  (fp8jax's own Pallas Mosaic GPU kernel, `fp8jax._kernels.flash_fp8_mgpu`, after
  per-tensor e4m3 casts of q, k, v with scales from their amax taken before timing, as
  delayed scaling has them; its "FP8 attention" cell reads "mgpu (fwd only)");
* ``mha`` (the `fp8jax.nn.MultiHeadAttention` block: QKV projection, rotary,
  attention, output projection on ``x: [batch, seq, dim]``): ``cudnn-bf16`` (mode
  bf16), ``fp8jax-fp8_dpa`` (FP8 core, bf16 projections) and ``fp8jax-fp8_mha``
  (FP8 core and FP8 projections, FP8 handed between them), both on the default backend
  (``"auto"``: fp8jax's own kernels where they can run, else cuDNN's).

head_dim 128, 16 heads, batch = 32768 // seq (a fixed token count per step). The
forward+backward loss is ``sum(out * G)`` (a fixed random projection) and is returned,
so nothing is dead code. FP8 variants are calibrated (two state updates) before
timing; inputs rotate among three sets so nothing sits in L2. Reports ms, TFLOP/s
(causal FLOPs: 4·B·N·S²·D/2 forward, x3.5 forward+backward; projections added for
``mha``), the ratio to bf16, whether the compiled program runs an FP8 attention kernel
(cuDNN's ``__cudnn$fmhaSoftmaxF8`` or fp8jax's, under its named scope), peak memory and
the activations saved for the backward.

    python -m benchmarks.attention            # seq 2048 ... 32768 (H100)
    python -m benchmarks.attention --quick    # CPU smoke run (reference backend), writes nothing

Records (GPU, not ``--quick``) go to ``benchmarks/results/attention.jsonl``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp

import fp8jax
from benchmarks import comm_profile, common
from fp8jax.nn import DotProductAttention, MultiHeadAttention

BF16 = jnp.bfloat16
F32 = jnp.float32
VARIANTS = {
    "attention": ("cudnn-bf16", "fp8jax-fp8_dpa", "fp8jax-mgpu", "fp8-mgpu"),
    "mha": ("cudnn-bf16", "fp8jax-fp8_dpa", "fp8jax-fp8_mha"),
}
MODE = {
    "cudnn-bf16": "bf16",
    "fp8jax-fp8_dpa": "fp8_dpa",
    "fp8jax-mgpu": "fp8_dpa",
    "fp8jax-fp8_mha": "fp8_mha",
}
# Variants that ask for a backend of their own (the --quick runs keep the reference): the
# attention level's fp8_dpa is cuDNN's FP8 path, whatever "auto" picks; the mha level runs
# the block as users get it ("auto": the mgpu kernels where they can run, else cuDNN).
BACKEND = {"fp8jax-mgpu": "mgpu", "fp8jax-fp8_dpa": "cudnn"}
KERNEL_MARKS = ("fmhaSoftmaxF8", "fp8jax_flash_attention")  # cuDNN's FP8 kernel, fp8jax's
DIRECTIONS = ("fwd", "fwd+bwd")
FORWARD_ONLY = ("fp8-mgpu",)  # variants without a backward: no fwd+bwd rows
TOKENS, HEADS, HEAD_DIM = 32768, 16, 128
DEFAULT_SEQS = (2048, 4096, 8192, 16384, 32768)
DEFAULT_OUT = common.results_path("attention")
COMMAND_PREFIX = "python -m benchmarks.attention"
RECORD_FIELDS = (
    *common.META_FIELDS,
    "ms",
    "tflops",
    "speedup_vs_bf16",
    "fp8_gemms",
    "saved_act_mb",
    "peak_mem_mb",
)
OPTIONAL_FIELDS = ("forward_only",)


def case_params(seq: int, quick: bool) -> dict:
    if quick:
        return dict(seq=seq, batch=2, heads=4, kv_heads=2, head_dim=32)
    return dict(
        seq=seq, batch=max(1, TOKENS // seq), heads=HEADS, kv_heads=HEADS, head_dim=HEAD_DIM
    )


def flops(p: dict, level: str, direction: str) -> float:
    b, s, n, k, d = p["batch"], p["seq"], p["heads"], p["kv_heads"], p["head_dim"]
    fwd = 4 * b * n * s * s * d / 2
    if level == "mha":
        dim = n * d
        fwd += 2 * b * s * dim * ((n + 2 * k) * d + dim)
    return fwd * (
        3.5
        if direction == "fwd+bwd" and level == "attention"
        else 3.0
        if direction == "fwd+bwd"
        else 1.0
    )


def build(level: str, variant: str, p: dict, key, backend: str):
    """The module (a `DotProductAttention` or `MultiHeadAttention`) and its inputs' shapes."""
    mode = MODE[variant]
    if level == "attention" and backend != "reference":
        backend = BACKEND.get(variant, backend)
    if level == "attention":
        module = DotProductAttention(mode, is_causal=True, backend=backend)
        shapes = [(p["batch"], p["seq"], p["heads"], p["head_dim"])] + [
            (p["batch"], p["seq"], p["kv_heads"], p["head_dim"])
        ] * 2
        return module, shapes
    dim = p["heads"] * p["head_dim"]
    module = MultiHeadAttention(
        dim,
        p["heads"],
        num_kv_heads=p["kv_heads"],
        mode=mode,
        backend=backend,
        config=fp8jax.Fp8Config(selective=False),
        dtype=BF16,
        key=key,
    )
    return module, [(p["batch"], p["seq"], dim)]


def mgpu_step(p: dict, backend: str, scales) -> common.Step:
    """``fp8-mgpu``'s forward: per-tensor e4m3 casts of q, k, v with the given ``scales``
    and the causal FP8 flash-attention kernel (its plain-JAX reference with ``backend``
    "reference"), output bf16. The scales come from outside the step, as delayed scaling's
    come from its history (``fp8jax-fp8_dpa``'s forward casts with its state's scales, no
    amax pass before the cast either)."""
    from fp8jax import _quant as qt
    from fp8jax._kernels import flash_fp8_mgpu as flash

    attend = flash.flash_fp8_reference if backend == "reference" else flash.flash_fp8
    e4m3 = jnp.float8_e4m3fn

    def fn(params, inputs, g):
        q, k, v = (qt.quantize(x, s, e4m3) for x, s in zip(inputs, scales))
        return attend(q, k, v, *scales, causal=True)[0]

    return common.Step(fn, None)


def mgpu_scales(inputs) -> tuple:
    """Per-tensor e4m3 scales (amax / 448) of q, k, v: fp8jax's current scaling, computed
    once before timing."""
    from fp8jax import _quant as qt

    one, e4m3 = jnp.ones((), F32), jnp.float8_e4m3fn
    return tuple(qt.scale_from_amax(qt.amax(x), one, e4m3, 0.0) for x in inputs)


def make_step(module, direction: str, inputs, g) -> common.Step:
    """A `benchmarks.common.Step` of ``direction``: the forward output, or the loss and
    its gradients. FP8 variants are calibrated by one train step first (delayed scales
    of dO, dP, dQ, dK, dV come from the first backward)."""
    train = common.train_step(module, lambda m, inputs: m(*inputs))
    is_state = lambda x: isinstance(x, fp8jax.OverwriteWithGradient)  # noqa: E731
    if any(is_state(x) for x in jax.tree_util.tree_leaves(module, is_leaf=is_state)):
        train = common.calibrate(train, module, inputs, g)
    if direction == "fwd+bwd":
        return train
    static = eqx.partition(module, eqx.is_array)[1]
    return common.Step(lambda params, inputs, g: eqx.combine(params, static)(*inputs), train.params)


def print_kernels(step: common.Step, inputs, g, top: int) -> None:
    """The ``top`` costliest GPU kernels of one call of ``step`` (every kind: where a
    variant's time goes beside its attention kernels), from a 3-call profile."""

    def run():
        jax.block_until_ready(step.jitted(step.params, inputs, g))

    comm_profile.profile_step(run, steps=3, top=top, kind=None)


def run_case(
    seq: int, levels, iters: int, reps: int, meta: dict, quick: bool, backend: str,
    kernels: int = 0,
) -> list[dict]:  # fmt: skip
    p = case_params(seq, quick)
    rows = []
    key = jax.random.PRNGKey(seq)
    for level in levels:
        for direction in DIRECTIONS:
            for variant in VARIANTS[level]:
                if variant in FORWARD_ONLY and direction != "fwd":
                    continue
                row = dict(meta, params=dict(p, level=level, direction=direction), variant=variant)
                try:
                    if variant in FORWARD_ONLY:
                        row.update(_time_mgpu(p, key, backend, iters, reps))
                        rows.append(row)
                        continue
                    module, shapes = build(level, variant, p, key, backend)
                    keys = jax.random.split(jax.random.PRNGKey(seq + 1), 3 * len(shapes) + 1)
                    input_sets = [
                        [jax.random.normal(keys[3 * j + i], s, BF16) for j, s in enumerate(shapes)]
                        for i in range(3)
                    ]
                    g = jax.random.normal(keys[-1], shapes[0], BF16)
                    step = make_step(module, direction, input_sets[0], g)
                    row["ms"] = common.time_step(step, input_sets, g, iters, reps, warmup=1)
                    if kernels and common.on_gpu():
                        print(f"{variant} {direction}, seq {seq}:", flush=True)
                        print_kernels(step, input_sets[0], g, kernels)
                    hlo = step.hlo_text(input_sets[0], g)
                    kernel = any(mark in hlo for mark in KERNEL_MARKS)
                    row["fp8_gemms"] = kernel or ("fp8" in variant and not common.on_gpu())
                    row["fp8_attention_kernel"] = kernel
                    row["peak_mem_mb"] = common.peak_mem_mb(step, input_sets[0], g)
                    row["saved_act_mb"] = (
                        fp8jax.saved_activation_bytes(module, *input_sets[0], dim=seq) / 2**20
                    )
                except Exception as e:  # report and go on
                    row.update(ms=None, error=common.error_text(e, 400))
                rows.append(row)
    common.add_ratios(
        rows,
        lambda r: flops(r["params"], r["params"]["level"], r["params"]["direction"]),
        {"speedup_vs_bf16": "cudnn-bf16"},
        case=lambda r: repr(r["params"]),
    )
    return rows


def _time_mgpu(p: dict, key, backend: str, iters: int, reps: int) -> dict:
    """The ``fp8-mgpu`` row's measured fields (forward only; no saved activations)."""
    q_shape = (p["batch"], p["seq"], p["heads"], p["head_dim"])
    kv_shape = (p["batch"], p["seq"], p["kv_heads"], p["head_dim"])
    keys = jax.random.split(key, 9)
    input_sets = [
        [
            jax.random.normal(keys[3 * i + j], s, BF16)
            for j, s in enumerate((q_shape, kv_shape, kv_shape))
        ]
        for i in range(3)
    ]
    step = mgpu_step(p, backend, mgpu_scales(input_sets[0]))
    ms = common.time_step(step, input_sets, None, iters, reps, warmup=1)
    hlo = step.hlo_text(input_sets[0], None)
    kernel = "mosaic_gpu" in hlo
    return dict(
        ms=ms,
        fp8_gemms=kernel or not common.on_gpu(),
        fp8_attention_kernel=kernel,
        forward_only=True,
        peak_mem_mb=common.peak_mem_mb(step, input_sets[0], None),
        saved_act_mb=None,
    )


def _fp8_attention_cell(r) -> str:
    if r.get("forward_only"):
        return "mgpu (fwd only)" if r["fp8_attention_kernel"] else "reference (fwd only)"
    return "yes" if r["fp8_attention_kernel"] else "no"


def markdown_table(rows) -> str:
    def case(r):
        p = r["params"]
        return f"{p['level']} | {p['seq']} x {p['batch']} | {p['direction']}"

    columns = [
        ("ms", lambda r: f"{r['ms']:.3f}"),
        ("TFLOP/s", lambda r: common.fmt(r["tflops"], ".0f")),
        ("vs bf16", lambda r: common.fmt(r["speedup_vs_bf16"], ".2f", "x")),
        ("FP8 attention", _fp8_attention_cell),
        ("saved act MiB", lambda r: common.fmt(r["saved_act_mb"], ".0f")),
        ("peak MiB", lambda r: common.fmt(r["peak_mem_mb"], ".0f")),
    ]
    return "\n".join(
        common.markdown_rows(
            rows, "level | seq x batch | direction", case, columns, error_chars=100
        )
    )


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=COMMAND_PREFIX, description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="tiny CPU-sized cases (reference backend); no records"
    )
    ap.add_argument(
        "--seqs",
        type=lambda s: [int(v) for v in s.split(",")],
        help="comma-separated sequence lengths",
    )
    ap.add_argument(
        "--levels", type=lambda s: [v for v in s.split(",") if v], default=["attention", "mha"]
    )
    ap.add_argument("--iters", type=int)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="N",
        help="on a GPU: print each variant's N costliest kernels (a 3-call profile)",
    )
    args = ap.parse_args(argv)
    if args.kernels and not common.on_gpu():
        print("--kernels: no GPU here, so no kernels are profiled", file=sys.stderr)
    for level in args.levels:
        if level not in VARIANTS:
            ap.error(f"unknown level {level!r}; choose from {', '.join(VARIANTS)}")
    seqs = args.seqs or ([128] if args.quick else list(DEFAULT_SEQS))
    iters, reps = args.iters or (2 if args.quick else 10), args.reps or (2 if args.quick else 5)
    backend = "reference" if args.quick else "auto"
    meta = common.run_meta(argv, bench="attention", prefix=COMMAND_PREFIX)
    return common.run_cases(
        seqs,
        lambda seq: run_case(
            seq, args.levels, iters, reps, meta, args.quick, backend, args.kernels
        ),
        markdown_table,
        args.out,
        RECORD_FIELDS,
        record=not args.quick,
        optional=OPTIONAL_FIELDS,
    )


if __name__ == "__main__":
    main()
