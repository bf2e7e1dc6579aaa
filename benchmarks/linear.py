"""Benchmark: the training step of one linear layer (forward + dgrad + wgrad), bf16 vs FP8.

For each shape ``(M, K, N)`` (x: [M, K], weight: [N, K], y: [M, N]) it times, in one
process, a jitted step returning the gradients w.r.t. the layer and the input of
``loss = sum(y.astype(f32) * G)`` (``G`` a fixed random bf16 [M, N] projection), for:

* ``bf16``              plain ``eqx.nn.Linear`` in bf16
* ``fp8jax-delayed``    ``Fp8Config(scaling="delayed", selective=False)``
* ``fp8jax-current``    ``Fp8Config(scaling="current", selective=False)``
* ``fp8jax-selective``  ``Fp8Config()`` (size policy on; a skipped layer runs bf16)
* ``fp8jax-rowwise``    ``Fp8Config(recipe="rowwise")``: one scale per row of each operand
* ``fp8jax-blockwise``  ``Fp8Config(recipe="blockwise")``: 1x128 / 128x128 (DeepSeek-V3)
* ``flax-direct``       ``flax.linen.fp8_ops.fp8_scaled_dot_general``, delayed scaling
* ``haliax-qdq``        flax ``in_qdq`` / ``out_qdq`` around a bf16 dot (haliax's pattern)
* ``fp8jax-linen``      ``nn.Dense(dot_general_cls=fp8jax.flax.fp8_dot_general_cls(cfg))``
* ``fp8jax-nnx``        ``nnx.Linear`` through ``fp8jax.nnx.fp8_linear_layers(model, cfg)``
  (both with fp8jax-delayed's config, bf16 params; see also `benchmarks.front_doors`)
* ``torchao-bf16``, ``torchao-tensorwise``, ``torchao-rowwise``: the same step in PyTorch
  (``torch.compile``), bf16 and torchao float8, in a child process run before JAX takes
  the GPU (`benchmarks.torch_peer`); skipped with one line where torch is missing

Parameters are bf16 unless ``--param-dtype f32`` (flax's default mixed precision: f32
parameters, bf16 compute; x and G stay bf16): then ``bf16`` casts the weight to bf16 in
the step, ``fp8jax-delayed``'s layer computes in its input's dtype, ``fp8jax-linen`` and
``fp8jax-nnx`` take ``param_dtype=f32, dtype=bf16``, and the other variants (written for
bf16 weights) are skipped with one line; the records' params carry ``param_dtype: "f32"``.

``flax-direct`` and ``haliax-qdq`` reproduce the anchors of ``ANCHORS.md`` section 2
(``probe_h100.py``). A torch row's ``speedup_vs_bf16`` is over ``torchao-bf16``;
``speedup_vs_torchao`` is every row's speed over ``torchao-tensorwise``'s.

Usage (from the repository root)::

    python -m benchmarks.linear                 # default GPU shapes, appends records
    python -m benchmarks.linear --full          # + LLaMA-3 projections at M=16384, 70B FFN
    python -m benchmarks.linear --crossover     # M up to 16384, K=N to 4096: bf16 vs fp8jax-delayed
    python -m benchmarks.linear --quick         # CPU smoke run, writes nothing
    python -m benchmarks.linear --param-dtype f32   # f32 parameters, bf16 compute
    python -m benchmarks.linear --shapes 8192,8192,8192 4096,4096,4096 --iters 50

Records (GPU, not ``--quick``) go to ``benchmarks/results/linear.jsonl`` (or ``--out``),
one JSON line per (shape, variant), in the format of ``BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

import fp8jax
from benchmarks import torch_peer
from benchmarks.common import (
    META_FIELDS,
    Step,
    add_ratios,
    append_records,
    calibrate,
    error_text,
    fmt,
    gemm_check,
    markdown_rows,
    on_gpu,
    peak_mem_mb,
    print_records_written,
    results_path,
    run_meta,
    time_step,
    train_step,
)
from benchmarks.front_doors_builders import _cast_params
from benchmarks.linear_flax import (
    MissingDependency,
    build_flax_direct,
    build_haliax_qdq,
    linen_builder,
    nnx_builder,
)

BF16 = jnp.bfloat16
PARAM_DTYPES = {"bf16": BF16, "f32": jnp.float32}

VARIANTS = (
    "bf16",
    "fp8jax-delayed",
    "fp8jax-current",
    "fp8jax-selective",
    "fp8jax-rowwise",
    "fp8jax-blockwise",
    "flax-direct",
    "haliax-qdq",
    "fp8jax-linen",
    "fp8jax-nnx",
)
PEER_VARIANTS = torch_peer.VARIANTS  # run by torch in a child process
DEFAULT_VARIANTS = (*VARIANTS, *PEER_VARIANTS)
CROSSOVER_VARIANTS = ("bf16", "fp8jax-delayed")
# The variants run with --param-dtype f32 (f32 weights, bf16 compute); the others are skipped.
F32_PARAM_VARIANTS = ("bf16", "fp8jax-delayed", "fp8jax-linen", "fp8jax-nnx")

# Shapes are (M, K, N).
ANCHOR_SHAPES = [(16384, 4096, 4096), (16384, 4096, 14336), (8192, 8192, 8192), (4096, 2048, 2048)]
# (K, N) of the projections: qkv (fused), attention out, gate+up (fused), down.
LLAMA3_8B_KN = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
LLAMA3_70B_KN = [(8192, 10240), (8192, 8192), (8192, 57344), (28672, 8192)]
LLAMA3_70B_DEFAULT_KN = [(8192, 10240), (28672, 8192)]
QUICK_SHAPES = [(64, 32, 48), (128, 64, 64)]
CROSSOVER_M = (2048, 4096, 8192, 16384)
CROSSOVER_KN = (1024, 2048, 4096)

RECORD_FIELDS = (
    *META_FIELDS,
    "ms",
    "tflops",
    "speedup_vs_bf16",
    "speedup_vs_flax",
    "speedup_vs_torchao",
    "fp8_gemms",
    "peak_mem_mb",
)
ROUNDING = dict(
    ms=4, tflops=1, speedup_vs_bf16=3, speedup_vs_flax=3, speedup_vs_torchao=3, peak_mem_mb=1
)
DEFAULT_OUT = results_path("linear")
COMMAND_PREFIX = "python -m benchmarks.linear"


# ----------------------------------------------------------------------------- shapes
def _dedupe(shapes):
    """``shapes`` without repeats, first occurrence kept."""
    seen, out = set(), []
    for s in shapes:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def default_shapes(full: bool = False) -> list[tuple[int, int, int]]:
    """The ANCHORS four, LLaMA-3-8B projections and two 70B ones at M=8192; with
    ``full`` also every 70B projection and all of them again at M=16384."""
    shapes = list(ANCHOR_SHAPES)
    shapes += [(8192, k, n) for k, n in LLAMA3_8B_KN]
    shapes += [(8192, k, n) for k, n in LLAMA3_70B_DEFAULT_KN]
    if full:
        shapes += [(8192, k, n) for k, n in LLAMA3_70B_KN]
        shapes += [(16384, k, n) for k, n in LLAMA3_8B_KN + LLAMA3_70B_KN]
    return _dedupe(shapes)


def crossover_shapes() -> list[tuple[int, int, int]]:
    """Square-ish small shapes where FP8 may or may not beat bf16."""
    return [(m, kn, kn) for m in CROSSOVER_M for kn in CROSSOVER_KN]


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"M,K,N"`` -> ``(M, K, N)``."""
    try:
        m, k, n = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"shape must be M,K,N (three integers), got {text!r}"
        ) from None
    if min(m, k, n) < 1:
        raise argparse.ArgumentTypeError(f"shape dims must be positive, got {text!r}")
    return m, k, n


# ----------------------------------------------------------------------------- steps
def _apply(model, x):
    """Run a linear layer on ``x: [M, K]`` (``eqx.nn.Linear`` takes one vector)."""
    if isinstance(model, eqx.nn.Linear):
        return jax.vmap(model)(x)
    return model(x)


def build_bf16(layer: eqx.nn.Linear, x, g) -> Step:
    """Plain bf16 ``eqx.nn.Linear``; a weight of another dtype (f32) is cast to bf16 in the
    step (mixed precision: the gradient comes back in the weight's dtype)."""
    if layer.weight.dtype == BF16:
        return train_step(layer, _apply)
    return train_step(layer, lambda model, x: _apply(_cast_params(model, BF16), x))


def fp8jax_builder(config: fp8jax.Fp8Config) -> Callable[..., Step]:
    """Builder for an fp8jax variant: convert, run one step and write its FP8 state back
    (so delayed scales are calibrated), then time the same step."""

    def build(layer: eqx.nn.Linear, x, g) -> Step:
        model, report = fp8jax.fp8_linear_layers(layer, config, return_report=True)
        note = ""
        if not report.converted:
            note = "layer skipped by policy, runs bf16: " + "; ".join(report.skipped.values())
        return calibrate(train_step(model, _apply, note), model, x, g)

    return build


BUILDERS: dict[str, Callable[..., Step]] = {
    "bf16": build_bf16,
    "fp8jax-delayed": fp8jax_builder(fp8jax.Fp8Config(scaling="delayed", selective=False)),
    "fp8jax-current": fp8jax_builder(fp8jax.Fp8Config(scaling="current", selective=False)),
    "fp8jax-selective": fp8jax_builder(fp8jax.Fp8Config()),
    "fp8jax-rowwise": fp8jax_builder(fp8jax.Fp8Config(recipe="rowwise", selective=False)),
    "fp8jax-blockwise": fp8jax_builder(fp8jax.Fp8Config(recipe="blockwise", selective=False)),
    # Not recorded variants (for `benchmarks.linear_tuning --variant`): fast FP8
    # accumulation in all three GEMMs; XLA's casts instead of the one-pass Pallas kernel.
    "fp8jax-delayed-fastacc": fp8jax_builder(
        fp8jax.Fp8Config(scaling="delayed", selective=False, fast_accumulation="all")
    ),
    "fp8jax-delayed-xlacast": fp8jax_builder(
        fp8jax.Fp8Config(scaling="delayed", selective=False, cast_kernel=False)
    ),
    "flax-direct": build_flax_direct,
    "haliax-qdq": build_haliax_qdq,
    # fp8jax's other front doors, as their docs write them: flax linen and nnx layers.
    "fp8jax-linen": linen_builder(fp8jax.Fp8Config(scaling="delayed", selective=False)),
    "fp8jax-nnx": nnx_builder(fp8jax.Fp8Config(scaling="delayed", selective=False)),
}


# ----------------------------------------------------------------------------- measuring
def make_inputs(shape, seed: int = 0, n_inputs: int = 3, param_dtype=BF16):
    """The layer (weight [N, K] in ``param_dtype``), ``n_inputs`` different x [M, K] and
    G [M, N] (bf16)."""
    m, k, n = shape
    keys = jax.random.split(jax.random.PRNGKey(seed), n_inputs + 2)
    layer = eqx.nn.Linear(k, n, use_bias=False, dtype=param_dtype, key=keys[0])
    g = jax.random.normal(keys[1], (m, n), BF16)
    xs = [jax.random.normal(kx, (m, k), BF16) for kx in keys[2:]]
    return layer, jax.block_until_ready(xs), jax.block_until_ready(g)


def measure_variant(name: str, layer, xs, g, iters: int, reps: int) -> dict:
    """Build, calibrate and time one variant; the measured fields of its row."""
    step = BUILDERS[name](layer, xs[0], g)
    ms = time_step(step, xs, g, iters, reps, warmup=1 if iters <= 2 else 2)
    n_fp8, n_gemms = gemm_check(step, xs[0], g)
    return dict(
        ms=ms,
        fp8_gemms=n_fp8 >= 3,
        fp8_gemm_count=n_fp8,
        gemm_count=n_gemms,
        peak_mem_mb=peak_mem_mb(step, xs[0], g),
        note=step.note,
    )


def run_shape(
    shape,
    variants,
    iters: int,
    reps: int,
    meta: dict,
    seed: int = 0,
    peer_rows=(),
    param_dtype: str = "bf16",
) -> list[dict]:
    """All ``variants`` on one shape (parameters in ``param_dtype``, a key of
    `PARAM_DTYPES`), then the torch rows measured for it already (`torch_peer.run_peer`),
    ratios among all of them; a failing variant gives an error row."""
    m, k, n = shape
    layer, xs, g = make_inputs(shape, seed, param_dtype=PARAM_DTYPES[param_dtype])
    extra = {} if param_dtype == "bf16" else dict(param_dtype=param_dtype)  # bf16: unchanged
    rows = []
    for name in variants:
        row = dict(
            meta,
            params=dict(M=m, K=k, N=n, **extra),
            variant=name,
            ms=None,
            fp8_gemms=None,
            peak_mem_mb=None,
            note="",
            error=None,
        )
        try:
            row.update(measure_variant(name, layer, xs, g, iters, reps))
        except MissingDependency as e:
            row["error"] = str(e)
        except Exception as e:  # keep measuring the other variants
            traceback.print_exc(limit=4, file=sys.stderr)
            row["error"] = error_text(e, 200, first_line=True)
        rows.append(row)
    rows += torch_peer.with_meta(list(peer_rows), meta)
    speedups = {
        "speedup_vs_bf16": "bf16",
        "speedup_vs_flax": "flax-direct",
        "speedup_vs_torchao": "torchao-tensorwise",
    }
    add_ratios(rows, 6.0 * m * k * n, speedups)
    torch_peer.rebase_speedup(rows)
    return rows


# ----------------------------------------------------------------------------- output
def _fp8_cell(row) -> str:
    if row.get("fp8_gemms") is None:
        return "-"
    return f"{'yes' if row['fp8_gemms'] else 'no'} ({row['fp8_gemm_count']}/{row['gemm_count']})"


def _shape_str(row) -> str:
    p = row["params"]
    return f"{p['M']} x {p['K']} x {p['N']}"


def format_shape_table(rows: list[dict]) -> str:
    """Human table of one shape's results."""
    head = (
        f"{'variant':<18} {'ms':>9} {'TFLOP/s':>8} {'vs bf16':>8} {'vs flax':>8} "
        f"{'vs tao-tw':>9} {'fp8 (n/all)':>12} {'peak MB':>9}"
    )
    title = f"\n=== linear train step, M x K x N = {_shape_str(rows[0])}"
    if rows[0]["params"].get("param_dtype"):
        title += f", {rows[0]['params']['param_dtype']} params, bf16 compute"
    lines = [title, head, "-" * len(head)]
    for r in rows:
        if r["ms"] is None:
            status = "SKIP" if r["error"].startswith("skipped") else "ERROR"
            lines.append(f"{r['variant']:<18} {status:>9}  {r['error']}")
            continue
        line = (
            f"{r['variant']:<18} {r['ms']:>9.3f} {fmt(r['tflops'], '8.1f')} "
            f"{fmt(r['speedup_vs_bf16'], '7.2f', 'x'):>8} "
            f"{fmt(r['speedup_vs_flax'], '7.2f', 'x'):>8} "
            f"{fmt(r['speedup_vs_torchao'], '8.2f', 'x'):>9} "
            f"{_fp8_cell(r):>12} {fmt(r['peak_mem_mb'], '9.1f'):>9}"
        )
        if r.get("note"):
            line += f"  ({r['note']})"
        lines.append(line)
    return "\n".join(lines)


def markdown_table(rows: list[dict]) -> str:
    """All results as a markdown table (for ``benchmarks/RESULTS.md``)."""
    if not rows:
        return ""
    meta = rows[0]
    columns = [
        ("ms", lambda r: f"{r['ms']:.3f}"),
        ("TFLOP/s", lambda r: fmt(r["tflops"], ".0f")),
        ("vs bf16", lambda r: fmt(r["speedup_vs_bf16"], ".2f", "x")),
        ("vs flax-direct", lambda r: fmt(r["speedup_vs_flax"], ".2f", "x")),
        ("vs torchao-tensorwise", lambda r: fmt(r["speedup_vs_torchao"], ".2f", "x")),
        ("FP8 GEMMs", _fp8_cell),
        ("peak MB", lambda r: fmt(r["peak_mem_mb"], ".0f")),
    ]
    return "\n".join(
        [
            f"`{meta['command']}` on {meta['device']}, jax {meta['jax']}, {meta['date']} "
            "(train step = fwd + dgrad + wgrad; ratios from the same run; a torchao row's "
            "vs bf16 is over torchao-bf16)",
            "",
            *markdown_rows(rows, "M x K x N", _shape_str, columns),
        ]
    )


def crossover_grid(rows: list[dict], variant: str = "fp8jax-delayed") -> str:
    """Speedup of ``variant`` over bf16 as a grid: rows M, columns K = N."""
    speed = {
        (r["params"]["M"], r["params"]["K"]): r["speedup_vs_bf16"]
        for r in rows
        if r["variant"] == variant and r["params"]["K"] == r["params"]["N"]
    }
    ms = sorted({m for m, _ in speed})
    kns = sorted({kn for _, kn in speed})
    lines = [
        f"\n=== crossover: {variant} speedup over bf16 (rows M, columns K = N)",
        f"{'M':>7} " + " ".join(f"{kn:>8}" for kn in kns),
    ]
    for m in ms:
        lines.append(
            f"{m:>7} " + " ".join(f"{fmt(speed.get((m, kn)), '7.2f', 'x'):>8}" for kn in kns)
        )
    return "\n".join(lines)


def write_records(rows: list[dict], path: Path) -> int:
    """Append the measured rows (errors left out, values rounded) to ``path``; the number
    written."""
    return append_records(rows, path, RECORD_FIELDS, ROUNDING, torch_peer.RECORD_EXTRA)


# ----------------------------------------------------------------------------- CLI
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=COMMAND_PREFIX,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny CPU-sized shapes, 2 iters; writes no records"
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="add every LLaMA-3 8B/70B projection at M=8192 and 16384",
    )
    p.add_argument(
        "--crossover",
        action="store_true",
        help="sweep M in {2048,4096,8192,16384}, K=N in {1024,2048,4096}: bf16 vs "
        "fp8jax-delayed (unless --variants)",
    )
    p.add_argument(
        "--shapes",
        nargs="+",
        type=parse_shape,
        metavar="M,K,N",
        help="shapes to run (overrides the sets)",
    )
    p.add_argument(
        "--variants",
        type=lambda s: [v.strip() for v in s.split(",") if v.strip()],
        help=f"comma-separated subset of {','.join(DEFAULT_VARIANTS)} (default: all)",
    )
    torch_peer.add_cli(p)
    p.add_argument(
        "--param-dtype",
        choices=tuple(PARAM_DTYPES),
        default="bf16",
        help="the weights' dtype (compute stays bf16); f32 runs only "
        f"{','.join(F32_PARAM_VARIANTS)} and skips the others",
    )
    p.add_argument("--iters", type=int, help="calls per timed repeat (default 20; 2 with --quick)")
    p.add_argument(
        "--reps", type=int, help="timed repeats, the median is kept (default 5; 2 with --quick)"
    )
    p.add_argument("--out", type=Path, default=None, help=f"records file (default {DEFAULT_OUT})")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.variants:
        unknown = [v for v in args.variants if v not in DEFAULT_VARIANTS]
        if unknown:
            p.error(f"unknown variants {unknown}; choose from {', '.join(DEFAULT_VARIANTS)}")
    return args


def select_shapes(args) -> list[tuple[int, int, int]]:
    if args.shapes:
        return _dedupe(args.shapes)
    if args.quick:
        return list(QUICK_SHAPES)
    if args.crossover:
        return crossover_shapes()
    return default_shapes(full=args.full)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; return one result dict per (shape, variant)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    variants = args.variants or list(CROSSOVER_VARIANTS if args.crossover else DEFAULT_VARIANTS)
    iters = args.iters or (2 if args.quick else 20)
    reps = args.reps or (2 if args.quick else 5)
    shapes = select_shapes(args)
    if args.param_dtype != "bf16":
        skipped = [v for v in variants if v not in F32_PARAM_VARIANTS]
        if skipped:
            print(
                f"skipped {', '.join(skipped)}: bf16 parameters only (not with "
                f"--param-dtype {args.param_dtype})",
                flush=True,
            )
        variants = [v for v in variants if v in F32_PARAM_VARIANTS]
    variants, peer_variants = torch_peer.split_variants(variants)
    # torch first, in its own process, before run_meta starts JAX's GPU backend (run_peer).
    peer = torch_peer.run_peer(
        "linear", shapes, peer_variants, iters, reps, args.torch_site, compile=not args.quick
    )
    meta = run_meta(argv, "linear", COMMAND_PREFIX)
    print(
        f"{meta['command']}: {len(shapes)} shapes x {len(variants)} JAX variants "
        f"(+ {len(torch_peer.measured_variants(peer))} torch, measured above) on {meta['device']} "
        f"(jax {meta['jax']}), {reps} x {iters} calls per variant",
        flush=True,
    )
    record = not args.quick and on_gpu()
    path = args.out or DEFAULT_OUT
    rows, written = [], 0
    for shape in shapes:
        shape_rows = run_shape(
            shape, variants, iters, reps, meta, args.seed, peer.get(shape, ()), args.param_dtype
        )
        print(format_shape_table(shape_rows), flush=True)
        rows += shape_rows
        if record:  # per shape, so a run cut short keeps what it measured
            written += write_records(shape_rows, path)
    if args.crossover and "fp8jax-delayed" in variants and "bf16" in variants:
        print(crossover_grid(rows), flush=True)
    print("\n" + markdown_table(rows), flush=True)
    print_records_written(record, written, path, args.quick)
    return rows


if __name__ == "__main__":
    main()
