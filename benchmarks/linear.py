"""Benchmark: the training step of one linear layer (forward + dgrad + wgrad), bf16 vs FP8.

For each shape ``(M, K, N)`` (x: [M, K], weight: [N, K], y: [M, N]) it times, in one
process, a jitted step returning the gradients w.r.t. the layer and the input of
``loss = sum(y.astype(f32) * G)`` (``G`` a fixed random bf16 [M, N] projection), for:

* ``bf16``              plain ``eqx.nn.Linear`` in bf16
* ``fp8jax-delayed``    ``Fp8Config(scaling="delayed", selective=False)``
* ``fp8jax-current``    ``Fp8Config(scaling="current", selective=False)``
* ``fp8jax-selective``  ``Fp8Config()`` (size policy on; a skipped layer runs bf16)
* ``flax-direct``       ``flax.linen.fp8_ops.fp8_scaled_dot_general``, delayed scaling
* ``haliax-qdq``        flax ``in_qdq`` / ``out_qdq`` around a bf16 dot (haliax's pattern)

The last two reproduce the anchors of ``ANCHORS.md`` section 2 (``probe_h100.py``).

Usage (from the repository root)::

    python -m benchmarks.linear                 # default GPU shapes, appends records
    python -m benchmarks.linear --full          # + LLaMA-3 projections at M=16384, 70B FFN
    python -m benchmarks.linear --crossover     # small shapes, bf16 vs fp8jax-delayed only
    python -m benchmarks.linear --quick         # CPU smoke run, writes nothing
    python -m benchmarks.linear --shapes 8192,8192,8192 4096,4096,4096 --iters 50

Records (GPU, not ``--quick``) go to ``benchmarks/results/linear.jsonl`` (or ``--out``),
one JSON line per (shape, variant), in the format of ``BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp

import fp8jax
from fp8jax.inspect import parse_gemms

BF16, F32 = jnp.bfloat16, jnp.float32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FLAX_AMAX_HISTORY = 1024  # as in the anchors (flax's default)

VARIANTS = ("bf16", "fp8jax-delayed", "fp8jax-current", "fp8jax-selective", "flax-direct", "haliax-qdq")
CROSSOVER_VARIANTS = ("bf16", "fp8jax-delayed")

# Shapes are (M, K, N).
ANCHOR_SHAPES = [(16384, 4096, 4096), (16384, 4096, 14336), (8192, 8192, 8192), (4096, 2048, 2048)]
# (K, N) of the projections: qkv (fused), attention out, gate+up (fused), down.
LLAMA3_8B_KN = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
LLAMA3_70B_KN = [(8192, 10240), (8192, 8192), (8192, 57344), (28672, 8192)]
LLAMA3_70B_DEFAULT_KN = [(8192, 10240), (28672, 8192)]
QUICK_SHAPES = [(64, 32, 48), (128, 64, 64)]
CROSSOVER_M = (2048, 4096, 8192)
CROSSOVER_KN = (1024, 2048, 4096)

RECORD_FIELDS = ("bench", "params", "variant", "device", "date", "jax", "command", "ms", "tflops",
                 "speedup_vs_bf16", "speedup_vs_flax", "fp8_gemms", "peak_mem_mb")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "linear.jsonl"
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
        raise argparse.ArgumentTypeError(f"shape must be M,K,N (three integers), got {text!r}") from None
    if min(m, k, n) < 1:
        raise argparse.ArgumentTypeError(f"shape dims must be positive, got {text!r}")
    return m, k, n


# ----------------------------------------------------------------------------- steps
class MissingDependency(RuntimeError):
    """A variant's optional dependency is not installed: the variant is skipped."""


@dataclasses.dataclass
class Step:
    """A train step ready to time: ``fn(params, x, g)`` returns ``(loss, (grad wrt
    params, grad wrt x))``. ``jitted`` runs it from one executable, compiled on the
    first call and kept in ``compiled`` (so the GEMM report and the memory analysis
    read the very program that is timed, and nothing compiles twice).

    The loss is returned so that the forward GEMM is part of the program: the loss is
    linear in ``y``, so with gradients alone XLA removes the forward GEMM as dead code.
    """

    fn: Callable
    params: Any
    note: str = ""
    compiled: Any = dataclasses.field(init=False, default=None)

    def jitted(self, params, x, g):
        if self.compiled is None:
            self.compiled = jax.jit(self.fn).lower(params, x, g).compile()
        return self.compiled(params, x, g)

    def hlo_text(self, x, g) -> str:
        if self.compiled is None:
            self.jitted(self.params, x, g)
        return self.compiled.as_text()


def projection_loss(y, g):
    """``sum(y * G)`` in float32: its gradient w.r.t. ``y`` is ``G``."""
    return jnp.sum(y.astype(F32) * g.astype(F32))


def _apply(model, x):
    """Run a linear layer on ``x: [M, K]`` (``eqx.nn.Linear`` takes one vector)."""
    if isinstance(model, eqx.nn.Linear):
        return jax.vmap(model)(x)
    return model(x)


def _eqx_grad_fn(static):
    """Loss and gradient w.r.t. (array part of the model, x) of the projection loss."""

    def loss(params, x, g):
        return projection_loss(_apply(eqx.combine(params, static), x), g)

    return jax.value_and_grad(loss, argnums=(0, 1))


def build_bf16(layer: eqx.nn.Linear, x, g) -> Step:
    """Plain bf16 ``eqx.nn.Linear``."""
    params, static = eqx.partition(layer, eqx.is_array)
    return Step(_eqx_grad_fn(static), params)


def fp8jax_builder(config: fp8jax.Fp8Config) -> Callable[..., Step]:
    """Builder for an fp8jax variant: convert, run one step and write its FP8 state back
    (so delayed scales are calibrated), then time the same step."""

    def build(layer: eqx.nn.Linear, x, g) -> Step:
        model, report = fp8jax.fp8_linear_layers(layer, config, return_report=True)
        note = ""
        if not report.converted:
            note = "layer skipped by policy, runs bf16: " + "; ".join(report.skipped.values())
        params, static = eqx.partition(model, eqx.is_array)
        return calibrate(Step(_eqx_grad_fn(static), params, note), model, x, g)

    return build


def calibrate(step: Step, model, x, g) -> Step:
    """Run ``step`` once and write the FP8 state it returns into ``step.params`` (so the
    timed steps use calibrated delayed scales)."""
    _, (param_grads, _) = jax.block_until_ready(step.jitted(step.params, x, g))
    overwrites, _ = fp8jax.partition_for_grad_overwrite(param_grads)
    step.params, _ = eqx.partition(fp8jax.apply_updates(model, None, overwrites), eqx.is_array)
    return step


def _flax_fp8_ops():
    try:
        from flax.linen import fp8_ops
    except ImportError as e:
        raise MissingDependency(f"skipped: flax not installed ({e})") from None
    return fp8_ops


def _flax_state():
    """flax-style delayed-scaling state (scales and amax histories), as in the probe."""
    ones = jnp.ones((1,), F32)
    hist = jnp.zeros((FLAX_AMAX_HISTORY,), F32)
    return dict(ls=ones, rs=ones, gs=ones, lh=hist, rh=hist, gh=hist)


_KN_DN = (((1,), (0,)), ((), ()))  # x [M, K] . w [K, N] (flax kernel layout)


def _flax_step(loss, layer, x, g) -> Step:
    """Step over params ``(w [K, N], state)``; one warm step writes the new state
    (flax returns it as the state's gradient) so the scales are calibrated."""
    w_kn = jnp.asarray(layer.weight.T)
    step = Step(jax.value_and_grad(loss, argnums=(0, 1)), (w_kn, _flax_state()))
    _, ((_, new_state), _) = jax.block_until_ready(step.jitted(step.params, x, g))
    step.params = (w_kn, new_state)
    return step


def build_flax_direct(layer, x, g) -> Step:
    """flax ``fp8_scaled_dot_general`` (direct FP8 dots, delayed scaling), bf16 compute."""
    fp8_ops = _flax_fp8_ops()

    def loss(params, x, g):
        w, st = params
        y = fp8_ops.fp8_scaled_dot_general(
            x, w, _KN_DN, lhs_scale=st["ls"], rhs_scale=st["rs"], grad_scale=st["gs"],
            lhs_amax_history=st["lh"], rhs_amax_history=st["rh"], grad_amax_history=st["gh"],
            quantize_compute_type=BF16, preferred_element_type=BF16)
        return projection_loss(y, g)

    return _flax_step(loss, layer, x, g)


def build_haliax_qdq(layer, x, g) -> Step:
    """Quantize-dequantize around a bf16 dot (flax ``in_qdq``/``out_qdq``, haliax's pattern)."""
    fp8_ops = _flax_fp8_ops()

    def loss(params, x, g):
        w, st = params
        xq = fp8_ops.in_qdq(BF16, E4M3, x, st["ls"], st["lh"])
        wq = fp8_ops.in_qdq(BF16, E4M3, w, st["rs"], st["rh"])
        y = jax.lax.dot_general(xq, wq, _KN_DN)
        y = fp8_ops.out_qdq(BF16, E5M2, y, st["gs"], st["gh"])
        return projection_loss(y, g)

    return _flax_step(loss, layer, x, g)


BUILDERS: dict[str, Callable[..., Step]] = {
    "bf16": build_bf16,
    "fp8jax-delayed": fp8jax_builder(fp8jax.Fp8Config(scaling="delayed", selective=False)),
    "fp8jax-current": fp8jax_builder(fp8jax.Fp8Config(scaling="current", selective=False)),
    "fp8jax-selective": fp8jax_builder(fp8jax.Fp8Config()),
    # Not recorded variants (for `benchmarks.linear_tuning --variant`): fast FP8
    # accumulation in all three GEMMs; the one-pass Pallas cast-transpose kernel.
    "fp8jax-delayed-fastacc": fp8jax_builder(fp8jax.Fp8Config(scaling="delayed", selective=False, fast_accumulation="all")),
    "fp8jax-delayed-castkernel": fp8jax_builder(fp8jax.Fp8Config(scaling="delayed", selective=False, cast_kernel=True)),
    "flax-direct": build_flax_direct,
    "haliax-qdq": build_haliax_qdq,
}


# ----------------------------------------------------------------------------- measuring
def make_inputs(shape, seed: int = 0, n_inputs: int = 3):
    """The layer (bf16, weight [N, K]), ``n_inputs`` different x [M, K] and G [M, N]."""
    m, k, n = shape
    keys = jax.random.split(jax.random.PRNGKey(seed), n_inputs + 2)
    layer = eqx.nn.Linear(k, n, use_bias=False, dtype=BF16, key=keys[0])
    g = jax.random.normal(keys[1], (m, n), BF16)
    xs = [jax.random.normal(kx, (m, k), BF16) for kx in keys[2:]]
    return layer, jax.block_until_ready(xs), jax.block_until_ready(g)


def time_step(step: Step, xs, g, iters: int, reps: int, warmup: int = 2) -> float:
    """Median over ``reps`` of the mean time (ms) of ``iters`` back-to-back calls,
    rotating among the inputs ``xs`` (so no operand stays in L2)."""
    out = None
    for i in range(warmup):
        out = None
        out = step.jitted(step.params, xs[i % len(xs)], g)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(iters):
            # Drop the previous outputs first: XLA can then reuse their memory for this
            # call (a step whose gradients are as big as its weights, e.g. 64 experts,
            # otherwise holds two sets of gradients at once).
            out = None
            out = step.jitted(step.params, xs[i % len(xs)], g)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times) * 1e3


def time_call(fn: Callable, args, iters: int, reps: int) -> float:
    """Median over ``reps`` of the mean time (ms) of ``iters`` back-to-back ``fn(*args)``
    after one warm-up call (for kernels and GEMMs alone; steps use `time_step`)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times) * 1e3


def gemm_check(step: Step, x, g) -> tuple[int, int]:
    """(FP8 GEMMs, all GEMMs) in the compiled step (`fp8jax.inspect.parse_gemms`)."""
    gemms = parse_gemms(step.hlo_text(x, g))
    return sum(gm.is_fp8 for gm in gemms), len(gemms)


def peak_mem_mb(step: Step, x, g) -> float | None:
    """Arguments + outputs + temporaries of the compiled step, in MiB (None if the
    backend gives no memory analysis), from the executable that was timed."""
    try:
        step.hlo_text(x, g)
        stats = step.compiled.memory_analysis()
        total = stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes
    except Exception:  # not every backend implements it
        return None
    return total / 2**20


def measure_variant(name: str, layer, xs, g, iters: int, reps: int) -> dict:
    """Build, calibrate and time one variant; the measured fields of its row."""
    step = BUILDERS[name](layer, xs[0], g)
    ms = time_step(step, xs, g, iters, reps, warmup=1 if iters <= 2 else 2)
    n_fp8, n_gemms = gemm_check(step, xs[0], g)
    return dict(ms=ms, fp8_gemms=n_fp8 >= 3, fp8_gemm_count=n_fp8, gemm_count=n_gemms,
                peak_mem_mb=peak_mem_mb(step, xs[0], g), note=step.note)


def add_ratios(rows: list[dict], flops: float) -> None:
    """TFLOP/s and speedups vs bf16 and flax-direct (from the same run), in place."""
    ref = {r["variant"]: r.get("ms") for r in rows}
    for r in rows:
        ms = r.get("ms")
        ok = ms is not None and math.isfinite(ms) and ms > 0
        r["tflops"] = flops / (ms * 1e-3) / 1e12 if ok else None
        for key, base in (("speedup_vs_bf16", "bf16"), ("speedup_vs_flax", "flax-direct")):
            r[key] = ref[base] / ms if ok and ref.get(base) else None


def run_shape(shape, variants, iters: int, reps: int, meta: dict, seed: int = 0) -> list[dict]:
    """All ``variants`` on one shape; a failing variant gives an error row."""
    m, k, n = shape
    layer, xs, g = make_inputs(shape, seed)
    rows = []
    for name in variants:
        row = dict(meta, params=dict(M=m, K=k, N=n), variant=name, ms=None, fp8_gemms=None,
                   peak_mem_mb=None, note="", error=None)
        try:
            row.update(measure_variant(name, layer, xs, g, iters, reps))
        except MissingDependency as e:
            row["error"] = str(e)
        except Exception as e:  # keep measuring the other variants
            traceback.print_exc(limit=4, file=sys.stderr)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        rows.append(row)
    add_ratios(rows, 6.0 * m * k * n)
    return rows


# ----------------------------------------------------------------------------- output
def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _fp8_cell(row) -> str:
    if row.get("fp8_gemms") is None:
        return "-"
    return f"{'yes' if row['fp8_gemms'] else 'no'} ({row['fp8_gemm_count']}/{row['gemm_count']})"


def _shape_str(row) -> str:
    p = row["params"]
    return f"{p['M']} x {p['K']} x {p['N']}"


def format_shape_table(rows: list[dict]) -> str:
    """Human table of one shape's results."""
    head = f"{'variant':<18} {'ms':>9} {'TFLOP/s':>8} {'vs bf16':>8} {'vs flax':>8} {'fp8 (n/all)':>12} {'peak MB':>9}"
    lines = [f"\n=== linear train step, M x K x N = {_shape_str(rows[0])}", head, "-" * len(head)]
    for r in rows:
        if r["ms"] is None:
            lines.append(f"{r['variant']:<18} {'ERROR' if not r['error'].startswith('skipped') else 'SKIP':>9}  {r['error']}")
            continue
        line = (f"{r['variant']:<18} {r['ms']:>9.3f} {_fmt(r['tflops'], '8.1f')} "
                f"{_fmt(r['speedup_vs_bf16'], '7.2f', 'x'):>8} {_fmt(r['speedup_vs_flax'], '7.2f', 'x'):>8} "
                f"{_fp8_cell(r):>12} {_fmt(r['peak_mem_mb'], '9.1f')}")
        if r.get("note"):
            line += f"  ({r['note']})"
        lines.append(line)
    return "\n".join(lines)


def markdown_rows(rows: list[dict], case_header: str, case, columns, error_chars: int | None = None) -> list[str]:
    """Markdown table lines shared by the harnesses: ``case(r)`` (one or more cells,
    as ``case_header`` names them: ``"a | b"``) and the variant, then one cell per
    ``(header, cell(r))`` in ``columns``; a row without a time shows its error (cut
    to ``error_chars``) instead."""
    header = f"| {case_header} | variant | " + " | ".join(h for h, _ in columns) + " |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        if r.get("ms") is None:
            cells = [f"error: {str(r.get('error') or '')[:error_chars]}"] + [""] * (len(columns) - 1)
        else:
            cells = [cell(r) for _, cell in columns]
        lines.append(f"| {case(r)} | {r['variant']} | " + " | ".join(cells) + " |")
    return lines


def markdown_table(rows: list[dict]) -> str:
    """All results as a markdown table (for ``benchmarks/RESULTS.md``)."""
    if not rows:
        return ""
    meta = rows[0]
    columns = [("ms", lambda r: f"{r['ms']:.3f}"), ("TFLOP/s", lambda r: _fmt(r["tflops"], ".0f")),
               ("vs bf16", lambda r: _fmt(r["speedup_vs_bf16"], ".2f", "x")),
               ("vs flax-direct", lambda r: _fmt(r["speedup_vs_flax"], ".2f", "x")),
               ("FP8 GEMMs", _fp8_cell), ("peak MB", lambda r: _fmt(r["peak_mem_mb"], ".0f"))]
    return "\n".join([f"`{meta['command']}` on {meta['device']}, jax {meta['jax']}, {meta['date']} "
                      "(train step = fwd + dgrad + wgrad; ratios from the same run)", "",
                      *markdown_rows(rows, "M x K x N", _shape_str, columns)])


def crossover_grid(rows: list[dict], variant: str = "fp8jax-delayed") -> str:
    """Speedup of ``variant`` over bf16 as a grid: rows M, columns K = N."""
    speed = {(r["params"]["M"], r["params"]["K"]): r["speedup_vs_bf16"]
             for r in rows if r["variant"] == variant and r["params"]["K"] == r["params"]["N"]}
    ms = sorted({m for m, _ in speed})
    kns = sorted({kn for _, kn in speed})
    lines = [f"\n=== crossover: {variant} speedup over bf16 (rows M, columns K = N)",
             f"{'M':>7} " + " ".join(f"{kn:>8}" for kn in kns)]
    for m in ms:
        lines.append(f"{m:>7} " + " ".join(f"{_fmt(speed.get((m, kn)), '7.2f', 'x'):>8}" for kn in kns))
    return "\n".join(lines)


def to_record(row: dict) -> dict:
    """The JSON-lines record of a row (fields of ``BENCHMARKS.md`` + speedup_vs_flax)."""
    rounding = dict(ms=4, tflops=1, speedup_vs_bf16=3, speedup_vs_flax=3, peak_mem_mb=1)
    rec = {}
    for field in RECORD_FIELDS:
        value = row.get(field)
        if field in rounding and value is not None:
            value = round(value, rounding[field])
        rec[field] = value
    return rec


def append_records(rows: list[dict], path: Path, fields) -> int:
    """Append ``fields`` of the measured rows (errors left out) to ``path`` as JSON lines;
    the number written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(path, "a") as f:
        for r in rows:
            if r.get("ms") is not None:
                f.write(json.dumps({k: r.get(k) for k in fields}) + "\n")
                written += 1
    return written


def write_records(rows: list[dict], path: Path) -> int:
    """Append the measured rows (errors left out, values rounded) to ``path``; the number written."""
    return append_records([to_record(r) for r in rows if r["ms"] is not None], path, RECORD_FIELDS)


# ----------------------------------------------------------------------------- CLI
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=COMMAND_PREFIX, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny CPU-sized shapes, 2 iters; writes no records")
    p.add_argument("--full", action="store_true", help="add every LLaMA-3 8B/70B projection at M=8192 and 16384")
    p.add_argument("--crossover", action="store_true",
                   help="sweep M in {2048,4096,8192}, K=N in {1024,2048,4096}: bf16 vs fp8jax-delayed only")
    p.add_argument("--shapes", nargs="+", type=parse_shape, metavar="M,K,N", help="shapes to run (overrides the sets)")
    p.add_argument("--variants", type=lambda s: [v.strip() for v in s.split(",") if v.strip()],
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--iters", type=int, help="calls per timed repeat (default 20; 2 with --quick)")
    p.add_argument("--reps", type=int, help="timed repeats, the median is kept (default 5; 2 with --quick)")
    p.add_argument("--out", type=Path, default=None, help=f"records file (default {DEFAULT_OUT})")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.variants:
        unknown = [v for v in args.variants if v not in VARIANTS]
        if unknown:
            p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    return args


def select_shapes(args) -> list[tuple[int, int, int]]:
    if args.shapes:
        return _dedupe(args.shapes)
    if args.quick:
        return list(QUICK_SHAPES)
    if args.crossover:
        return crossover_shapes()
    return default_shapes(full=args.full)


def run_meta(argv: list[str], bench: str = "linear", prefix: str = COMMAND_PREFIX) -> dict:
    """Fields shared by every row of this run of ``bench`` (command ``prefix argv``)."""
    return dict(bench=bench, device=jax.devices()[0].device_kind,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                jax=jax.__version__, command=" ".join([prefix, *map(shlex.quote, argv)]))


def run_cases(cases, run_one, table, path: Path, fields, record: bool = True) -> list[dict]:
    """``run_one(case) -> rows`` for each case, printing ``table(rows)`` as it goes and, on a
    GPU when ``record``, appending the rows' ``fields`` to ``path`` per case (a run cut
    short keeps what it measured); then the whole table. Returns all rows."""
    record = record and jax.devices()[0].platform == "gpu"
    rows = []
    for case in cases:
        case_rows = run_one(case)
        print(table(case_rows), flush=True)
        rows += case_rows
        if record:
            append_records(case_rows, path, fields)
    print("\n" + table(rows), flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; return one result dict per (shape, variant)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    variants = args.variants or (list(CROSSOVER_VARIANTS) if args.crossover else list(VARIANTS))
    iters = args.iters or (2 if args.quick else 20)
    reps = args.reps or (2 if args.quick else 5)
    shapes = select_shapes(args)
    meta = run_meta(argv)
    print(f"{meta['command']}: {len(shapes)} shapes x {len(variants)} variants on {meta['device']} "
          f"(jax {meta['jax']}), {reps} x {iters} calls per variant", flush=True)
    record = not args.quick and jax.devices()[0].platform == "gpu"
    path = args.out or DEFAULT_OUT
    rows, written = [], 0
    for shape in shapes:
        shape_rows = run_shape(shape, variants, iters, reps, meta, args.seed)
        print(format_shape_table(shape_rows), flush=True)
        rows += shape_rows
        if record:  # per shape, so a run cut short keeps what it measured
            written += write_records(shape_rows, path)
    if args.crossover and "fp8jax-delayed" in variants and "bf16" in variants:
        print(crossover_grid(rows), flush=True)
    print("\n" + markdown_table(rows), flush=True)
    if record:
        print(f"\nappended {written} records to {path}")
    else:
        print(f"\n(no records written: {'--quick' if args.quick else 'not on a GPU'})")
    return rows


if __name__ == "__main__":
    main()
