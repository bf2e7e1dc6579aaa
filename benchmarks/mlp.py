"""Benchmark: the training step of an MLP block (norm -> fc1 -> activation -> fc2).

For each case ``(hidden, ffn, tokens, activation)`` it times, in one process, a jitted
step returning the loss and the gradients w.r.t. the block and the input
``x: [tokens, hidden]`` of ``loss = sum(y * G)``, for:

* ``bf16-unfused``    the block op by op in bf16 (``FusedMLP(fp8=False, fused=False)``)
* ``fp8jax-unfused``  the same block after ``fp8_linear_layers`` (FP8 GEMMs, no fusion)
* ``fp8jax-fused``    ``fp8jax.nn.FusedMLP`` (FP8, one checkpoint region)
* ``fp8jax-linen``    fp8jax-unfused's block (its weights, norm, activation and loss) as a
  flax linen module, ``nn.Dense(dot_general_cls=fp8jax.flax.fp8_dot_general_cls(cfg))``,
  differentiated w.r.t. all its variables as a ``TrainState`` step does (`benchmarks.mlp_flax`)
* ``fp8jax-nnx``      the same block as nnx modules converted by
  ``fp8jax.nnx.fp8_linear_layers``, the README's ``@nnx.jit`` step (``nnx.value_and_grad``
  with ``argnums=fp8jax.nnx.diff_state(0)``) bound by ``nnx.cached_partial``; the two flax
  variants are skipped in one line where flax is missing (`benchmarks.flax_steps`)
* ``torchao-bf16``, ``torchao-tensorwise``, ``torchao-rowwise``: the same block and step in
  PyTorch (``torch.compile``), bf16 and torchao float8, in a child process run before JAX
  takes the GPU (`benchmarks.torch_peer`); skipped with one line where torch is missing

and reports ms, TFLOP/s, speedup vs bf16, FP8 GEMM count, kernels launched per step
(top-level ops of the compiled entry computation), activation memory saved for the
backward (residuals with a token dim, from ``jax.vjp``) and peak memory (the last two
not for torch). A torch row's ``speedup_vs_bf16`` is over ``torchao-bf16``;
``speedup_vs_torchao`` is every row's speed over ``torchao-tensorwise``'s.

    python -m benchmarks.mlp            # LLaMA-3-8B MLP and a 70B TP=8 shard, tokens 16384
    python -m benchmarks.mlp --quick    # CPU smoke run, writes nothing

Records (GPU, not ``--quick``) go to ``benchmarks/results/mlp.jsonl``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp

import fp8jax
from benchmarks import common, torch_peer
from benchmarks.hlo import kernel_summary
from fp8jax.nn import FusedMLP

BF16 = jnp.bfloat16
FLAX_VARIANTS = ("fp8jax-linen", "fp8jax-nnx")
VARIANTS = ("bf16-unfused", "fp8jax-unfused", "fp8jax-fused", *FLAX_VARIANTS)
PEER_VARIANTS = torch_peer.VARIANTS  # run by torch in a child process
DEFAULT_VARIANTS = (*VARIANTS, *PEER_VARIANTS)
# (hidden, ffn, tokens, activation)
DEFAULT_CASES = [(4096, 14336, 16384, "swiglu"), (8192, 28672 // 8, 16384, "swiglu")]
QUICK_CASES = [(64, 96, 128, "swiglu"), (64, 64, 128, "gelu")]
DEFAULT_OUT = common.results_path("mlp")
COMMAND_PREFIX = "python -m benchmarks.mlp"


def parse_case(text: str):
    """``"hidden,ffn,tokens[,activation]"``."""
    parts = text.split(",")
    try:
        hidden, ffn, tokens = (int(v) for v in parts[:3])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"case must be hidden,ffn,tokens[,activation], got {text!r}"
        ) from None
    return hidden, ffn, tokens, parts[3] if len(parts) > 3 else "swiglu"


def _base(case, key) -> FusedMLP:
    """The bf16 block every variant starts from (the same weights for a key)."""
    hidden, ffn, _, activation = case
    return FusedMLP(hidden, ffn, activation=activation, fp8=False, fused=False, dtype=BF16, key=key)


def build(variant: str, case, key, config: fp8jax.Fp8Config):
    """The equinox block of ``variant`` (not a flax one: `build_step`)."""
    hidden, _, _, activation = case
    base = _base(case, key)
    if variant == "bf16-unfused":
        return base
    if variant == "fp8jax-unfused":
        return fp8jax.fp8_linear_layers(base, config)
    if variant == "fp8jax-fused":
        return FusedMLP.from_modules(
            eqx.nn.RMSNorm(hidden), base.fc1, base.fc2, activation=activation, config=config
        )
    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")


def make_step(block, x, g) -> common.Step:
    """A calibrated (one state update for FP8) `benchmarks.common.Step`."""
    step = common.train_step(block)
    return common.calibrate(step, block, x, g) if fp8jax.fp8_state(block) else step


def build_step(variant: str, case, key, config: fp8jax.Fp8Config, x, g):
    """``(step, forward)``: ``variant``'s calibrated step and its forward ``forward(x)`` (for
    the activations saved for the backward). The flax variants hold the equinox block's
    arrays (`benchmarks.mlp_flax`); without flax they raise
    `benchmarks.flax_steps.MissingDependency`."""
    if variant not in FLAX_VARIANTS:
        block = build(variant, case, key, config)
        return make_step(block, x, g), block
    from benchmarks import flax_steps, mlp_flax

    flax_steps.require_flax()
    if variant == "fp8jax-linen":
        module, variables = mlp_flax.linen_mlp(_base(case, key), config)
        step = flax_steps.linen_step(module, variables, x, g)
        return step, lambda x: module.apply(variables, x)
    model = mlp_flax.nnx_mlp(_base(case, key), config)
    return flax_steps.nnx_cached_step(model, x, g), lambda x: model(x)


def run_case(case, variants, iters, reps, meta, seed=0, config=None, peer_rows=()) -> list[dict]:
    """The JAX ``variants`` on ``case``, then the torch rows measured for it already
    (`torch_peer.run_peer`), ratios among all of them."""
    hidden, ffn, tokens, activation = case
    config = fp8jax.Fp8Config() if config is None else config
    key = jax.random.PRNGKey(seed)
    kx, kg, km = jax.random.split(key, 3)
    xs = jax.block_until_ready(
        [jax.random.normal(k, (tokens, hidden), BF16) for k in jax.random.split(kx, 3)]
    )
    g = jax.random.normal(kg, (tokens, hidden), BF16)
    gated = fp8jax.nn.ACTIVATIONS[activation][1]
    flops = 6 * tokens * (hidden * ffn * (2 if gated else 1) + ffn * hidden)
    rows = []
    variants = _without_missing_flax(variants)
    for name in variants:
        row = dict(
            meta,
            params=dict(hidden=hidden, ffn=ffn, tokens=tokens, activation=activation),
            variant=name,
        )
        try:
            t0 = time.perf_counter()
            step, forward = build_step(name, case, km, config, xs[0], g)
            row["compile_s"] = time.perf_counter() - t0  # build + compile + one calibration step
            row["ms"] = common.time_step(step, xs, g, iters, reps, warmup=1 if iters <= 2 else 2)
            n_fp8, n_gemms = common.gemm_check(step, xs[0], g)
            row.update(
                fp8_gemms=n_fp8 >= 6,
                fp8_gemm_count=n_fp8,
                gemm_count=n_gemms,
                kernels=sum(kernel_summary(step.hlo_text(xs[0], g)).values()),
                saved_act_mb=fp8jax.saved_activation_bytes(forward, xs[0], dim=tokens) / 2**20,
                peak_mem_mb=common.peak_mem_mb(step, xs[0], g),
            )
            del step
        except Exception as e:  # report and go on with the other variants
            row.update(ms=None, error=common.error_text(e))
        print(
            f"  {case} {name}: "
            + ", ".join(
                f"{k}={row[k]:.3f}" if isinstance(row[k], float) else f"{k}={row[k]}"
                for k in ("ms", "compile_s", "kernels", "error")
                if k in row
            ),
            flush=True,
        )
        rows.append(row)
    rows += torch_peer.with_meta(list(peer_rows), meta)
    speedups = {
        "speedup_vs_bf16": "bf16-unfused",
        "speedup_vs_unfused_fp8": "fp8jax-unfused",
        "speedup_vs_torchao": "torchao-tensorwise",
    }
    common.add_ratios(rows, flops, speedups)
    torch_peer.rebase_speedup(rows)
    return rows


def _without_missing_flax(variants) -> list[str]:
    """``variants`` less the flax ones where flax is missing (said in one line)."""
    asked = [v for v in variants if v in FLAX_VARIANTS]
    if not asked:
        return list(variants)
    from benchmarks.flax_steps import MissingDependency, require_flax

    try:
        require_flax()
    except MissingDependency as e:
        print(f"  {', '.join(asked)}: {e}", flush=True)
        return [v for v in variants if v not in FLAX_VARIANTS]
    return list(variants)


def markdown_table(rows) -> str:
    def case(r):
        p = r["params"]
        return f"{p['hidden']} x {p['ffn']} x {p['tokens']} ({p['activation']})"

    columns = [
        ("ms", lambda r: f"{r['ms']:.3f}"),
        ("TFLOP/s", lambda r: common.fmt(r["tflops"], ".0f")),
        ("vs bf16", lambda r: f"{common.fmt(r['speedup_vs_bf16'], '.2f')}x"),
        ("vs fp8 unfused", lambda r: f"{common.fmt(r['speedup_vs_unfused_fp8'], '.2f')}x"),
        ("vs torchao-tensorwise", lambda r: common.fmt(r.get("speedup_vs_torchao"), ".2f", "x")),
        ("FP8 GEMMs", lambda r: f"{r['fp8_gemm_count']}/{r['gemm_count']}"),
        ("kernels", lambda r: common.fmt(r.get("kernels"), "d")),
        ("saved act MiB", lambda r: common.fmt(r.get("saved_act_mb"), ".1f")),
        ("peak MiB", lambda r: common.fmt(r["peak_mem_mb"], ".0f")),
    ]
    return "\n".join(
        common.markdown_rows(rows, "hidden x ffn x tokens (act)", case, columns, error_chars=80)
    )


RECORD_FIELDS = (
    *common.META_FIELDS,
    "ms",
    "tflops",
    "speedup_vs_bf16",
    "speedup_vs_unfused_fp8",
    "speedup_vs_torchao",
    "fp8_gemms",
    "kernels",
    "saved_act_mb",
    "peak_mem_mb",
)


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog=COMMAND_PREFIX, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="tiny CPU-sized cases, 2 iters; writes no records"
    )
    p.add_argument("--cases", nargs="+", type=parse_case, metavar="H,F,T[,ACT]")
    p.add_argument(
        "--variants",
        type=lambda s: [v for v in s.split(",") if v],
        default=list(DEFAULT_VARIANTS),
        help=f"comma-separated subset of {','.join(DEFAULT_VARIANTS)} (default: all)",
    )
    p.add_argument("--iters", type=int)
    p.add_argument("--reps", type=int)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    torch_peer.add_cli(p)
    args = p.parse_args(argv)
    unknown = [v for v in args.variants if v not in DEFAULT_VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(DEFAULT_VARIANTS)}")
    cases = args.cases or (QUICK_CASES if args.quick else DEFAULT_CASES)
    iters, reps = args.iters or (2 if args.quick else 10), args.reps or (2 if args.quick else 5)
    config = fp8jax.Fp8Config(selective=False) if args.quick else fp8jax.Fp8Config()
    variants, peer_variants = torch_peer.split_variants(args.variants)
    # torch first, in its own process, before run_meta starts JAX's GPU backend (run_peer).
    peer = torch_peer.run_peer(
        "mlp", cases, peer_variants, iters, reps, args.torch_site, compile=not args.quick
    )
    meta = common.run_meta(argv, bench="mlp", prefix=COMMAND_PREFIX)
    return common.run_cases(
        cases,
        lambda case: run_case(
            case, variants, iters, reps, meta, config=config, peer_rows=peer.get(tuple(case), ())
        ),
        markdown_table,
        args.out,
        RECORD_FIELDS,
        record=not args.quick,
        optional=torch_peer.RECORD_EXTRA,
    )


if __name__ == "__main__":
    main()
