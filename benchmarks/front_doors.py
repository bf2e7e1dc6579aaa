"""Benchmark: one MLP train step through each front door of fp8jax, bf16 vs FP8.

The same model everywhere: ``layers`` linear layers ``dim -> dim`` (bias on, the frameworks'
default) with gelu between, loss ``mean(y.astype(f32) ** 2)``, gradients,
``optax.adam(1e-4)``, compute in bf16 whatever the parameter dtype, and the FP8 state
handled the way each front door's docs say:

* ``equinox``: ``eqx.nn.Linear`` layers, ``fp8jax.fp8_linear_layers``,
  ``eqx.filter_value_and_grad`` and ``fp8jax.optax_step`` (optimizer on
  ``fp8jax.trainable(model)``); f32 weights are cast to bf16 in the forward of the bf16
  model; the FP8 one is called on bf16 activations as it is (`fp8jax.nn.Linear` computes
  in its input's dtype; its FP8 cast reads the f32 weight, as linen's and nnx's do).
* ``linen``: ``nn.Dense(dtype=bf16, param_dtype=..., dot_general_cls=
  fp8jax.flax.fp8_dot_general_cls(cfg))`` in a flax ``TrainState``, whose
  ``apply_gradients`` writes the ``_overwrite_with_gradient`` collection from the grads.
* ``nnx``: ``nnx.Linear(dtype=bf16, param_dtype=...)``, ``fp8jax.nnx.fp8_linear_layers``,
  ``nnx.Optimizer(model, tx, wrt=nnx.Param)``, ``nnx.value_and_grad(...,
  argnums=fp8jax.nnx.diff_state(0))`` and ``fp8jax.nnx.update`` (jitted through
  ``nnx.split`` / ``nnx.merge`` in a ``jax.jit``, the same body as ``nnx.jit``'s).
* ``haliax``: ``haliax.nn.Linear`` layers (Embed -> Hidden -> ... -> Embed),
  ``fp8jax.fp8_linear_layers``, the equinox step; skipped in one line without haliax.

Each step is jitted with its state donated and timed as `benchmarks.common.time_step`
does (warm-up, median over ``--reps`` of the mean of ``--iters`` calls, inputs rotated).
The GEMMs are read from the compiled program (`fp8jax.inspect.parse_gemms`; on CPU the
lowered one, where XLA has not yet emulated FP8): on a GPU every GEMM of an fp8 row must be
FP8. Printed per (door, param dtype, tokens): bf16 ms, fp8 ms, FP8/bf16 speedup and that
speedup over equinox's at the same param dtype and tokens.

    python -m benchmarks.front_doors                          # GPU, appends records
    python -m benchmarks.front_doors --doors linen,nnx --tokens 16384 --param-dtypes f32
    python -m benchmarks.front_doors --profile /tmp/fd --kernel-summary
    python -m benchmarks.front_doors --quick                  # CPU smoke run, writes nothing

``--profile DIR`` records ``--profile-steps`` more steps of every case under
``jax.profiler.trace(DIR/<door>-<param dtype>-<tokens>-<precision>)``; ``--kernel-summary``
reads those traces back (`benchmarks.profile_train`) and prints per case the top kernels
by GPU time and the totals per category (FP8 GEMM, bf16 GEMM, casts/Pallas, XLA fusions,
transposes/copies). Records (GPU, not ``--quick``): ``benchmarks/results/front_doors.jsonl``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

import fp8jax
from benchmarks import common
from benchmarks.front_doors_builders import BUILDERS, ObjectCase, Skip, count_gemms

BF16, F32 = jnp.bfloat16, jnp.float32
DOORS = ("equinox", "linen", "nnx", "nnx-jit", "nnx-cached", "haliax")
DTYPES = {"bf16": BF16, "f32": F32}
PRECISIONS = ("bf16", "fp8")
DEFAULT_TOKENS = (8192, 16384)
COMMAND_PREFIX = "python -m benchmarks.front_doors"
DEFAULT_OUT = common.results_path("front_doors")
RECORD_FIELDS = (
    *common.META_FIELDS,
    "ms",
    "speedup_vs_bf16",
    "ratio_vs_equinox",
    "ms_vs_equinox",
    "fp8_gemms",
    "fp8_gemm_count",
    "gemm_count",
    "peak_mem_mb",
)
ROUNDING = dict(ms=4, speedup_vs_bf16=3, ratio_vs_equinox=3, ms_vs_equinox=3, peak_mem_mb=1)
CATEGORY_LABELS = {
    "gemm-fp8": "FP8 GEMM",
    "gemm": "bf16 GEMM",
    "pallas": "casts/Pallas",
    "elementwise": "XLA fusions (elementwise)",
    "reduction": "XLA fusions (reductions)",
    "copy/transpose": "transposes/copies",
    "attention": "attention",
    "other": "other",
}


# ----------------------------------------------------------------------------- measuring
class Case:
    """One (door, param dtype, tokens, precision): a jitted, donated step compiled once."""

    def __init__(self, state, step, x):
        self.state = state
        jitted = jax.jit(step, donate_argnums=0)
        self.lowered = jitted.lower(state, x)
        self.compiled = self.lowered.compile()

    def run(self, x):
        self.state, loss = self.compiled(self.state, x)
        return loss

    def gemms(self) -> tuple[int, int]:
        """(FP8 GEMMs, all GEMMs) of the step (`count_gemms`)."""
        return count_gemms(self.lowered, self.compiled)

    def peak_mem_mb(self) -> float | None:
        try:
            s = self.compiled.memory_analysis()
            total = s.temp_size_in_bytes + s.argument_size_in_bytes + s.output_size_in_bytes
        except Exception:  # not every backend implements it
            return None
        return total / 2**20


def time_case(case: Case, xs, iters: int, reps: int, warmup: int) -> float:
    """`benchmarks.common.time_step`'s method on a state-threading step (ms)."""
    loss = None
    for i in range(warmup):
        loss = case.run(xs[i % len(xs)])
    jax.block_until_ready((loss, case.state))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(iters):
            loss = case.run(xs[i % len(xs)])
        jax.block_until_ready((loss, case.state))
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times) * 1e3


def profile_case(case: Case, xs, name: str, args) -> dict | None:
    """``--profile-steps`` steps under ``jax.profiler.trace``; with ``--kernel-summary``
    device ms per step by category and the top kernels."""
    from benchmarks import profile_train as pt

    tmp = None
    if args.profile:
        trace_dir = str(Path(args.profile) / name)
    else:
        tmp = tempfile.TemporaryDirectory()
        trace_dir = tmp.name
    steps = args.profile_steps
    with jax.profiler.trace(trace_dir):
        for i in range(steps):
            loss = case.run(xs[i % len(xs)])
        jax.block_until_ready((loss, case.state))
    if not args.kernel_summary:
        return None
    kernels = pt.device_kernel_ns(trace_dir)
    lines = pt._instructions(case.compiled.as_text())
    by_cat, by_op = pt.kernel_ms(kernels, lines, steps)
    top = [(ms, cat, op, pt._summary(lines.get(op, ""))) for (cat, op), ms in by_op.items()]
    top = sorted(top, key=lambda t: -t[0])[: args.top]
    if tmp is not None:
        tmp.cleanup()
    return dict(by_cat=dict(by_cat), top=top, total=sum(by_cat.values()))


def format_kernels(name: str, summary: dict) -> str:
    lines = [f"\n--- kernels of {name}: {summary['total']:.3f} ms of GPU time per step"]
    for cat, ms in sorted(summary["by_cat"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {CATEGORY_LABELS.get(cat, cat):<27} {ms:8.3f} ms")
    if not summary["by_cat"]:
        lines.append("  (no device kernels in the trace: not a GPU?)")
    for ms, cat, op, text in summary["top"]:
        lines.append(f"  {ms:8.3f} ms  {CATEGORY_LABELS.get(cat, cat):<18} {op[:40]:<40} {text}")
    return "\n".join(lines)


def run_one(door, pd_name, tokens, precision, xs, args, config) -> dict:
    """Build, compile, time (and profile) one case; its measured fields."""
    state, step = BUILDERS[door](
        args.dim,
        args.layers,
        DTYPES[pd_name],
        config if precision == "fp8" else None,
        jax.random.PRNGKey(args.seed),
    )
    case = (ObjectCase if door in ("nnx-jit", "nnx-cached") else Case)(state, step, xs[0])
    ms = time_case(case, xs, args.iters, args.reps, warmup=1 if args.iters <= 2 else 2)
    n_fp8, n = case.gemms()
    out = dict(
        ms=ms,
        fp8_gemm_count=n_fp8,
        gemm_count=n,
        fp8_gemms=n > 0 and n_fp8 == n,
        peak_mem_mb=case.peak_mem_mb(),
    )
    if args.profile or args.kernel_summary:
        name = f"{door}-{pd_name}-{tokens}-{precision}"
        summary = profile_case(case, xs, name, args)
        if summary is not None:
            out["kernels"] = summary
            print(format_kernels(name, summary), flush=True)
    return out


def add_ratios(rows: list[dict]) -> None:
    """In place: fp8 rows' ``speedup_vs_bf16`` (same door, dtype, tokens) and
    ``ratio_vs_equinox`` (that speedup over equinox's); every row's ``ms_vs_equinox``
    (equinox's ms of the same precision over the row's)."""
    ms = {(r["params"]["door"], r["variant"]): r.get("ms") for r in rows}
    for r in rows:
        door = r["params"]["door"]
        r["speedup_vs_bf16"] = r["ratio_vs_equinox"] = r["ms_vs_equinox"] = None
        if r.get("ms") is None:
            continue
        eq = ms.get(("equinox", r["variant"]))
        r["ms_vs_equinox"] = eq / r["ms"] if eq else None
        if r["variant"] == "fp8" and ms.get((door, "bf16")):
            r["speedup_vs_bf16"] = ms[(door, "bf16")] / r["ms"]
    speed = {r["params"]["door"]: r["speedup_vs_bf16"] for r in rows if r["variant"] == "fp8"}
    for r in rows:
        if r["variant"] == "fp8" and r["speedup_vs_bf16"] and speed.get("equinox"):
            r["ratio_vs_equinox"] = r["speedup_vs_bf16"] / speed["equinox"]


def run_group(pd_name, tokens, doors, args, meta, config) -> list[dict]:
    """Every door, bf16 then fp8, at one (param dtype, tokens)."""
    keys = jax.random.split(jax.random.PRNGKey(args.seed + 1), 3)
    xs = jax.block_until_ready([jax.random.normal(k, (tokens, args.dim), BF16) for k in keys])
    rows = []
    for door in doors:
        for precision in args.precisions:
            params = dict(
                door=door, param_dtype=pd_name, tokens=tokens, layers=args.layers, dim=args.dim
            )
            row = dict(meta, params=params, variant=precision, ms=None, error=None)
            try:
                row.update(run_one(door, pd_name, tokens, precision, xs, args, config))
            except Skip as e:
                print(f"skipped {door}: {e}", flush=True)
                break
            except Exception as e:  # keep measuring the others
                traceback.print_exc(limit=6, file=sys.stderr)
                row["error"] = common.error_text(e, 200, first_line=True)
            rows.append(row)
    add_ratios(rows)
    return rows


# ----------------------------------------------------------------------------- output
def format_table(rows: list[dict]) -> str:
    """One line per (door, param dtype, tokens): bf16 ms, fp8 ms, FP8/bf16, vs equinox."""
    head = (
        f"| {'front door':<8} | params | tokens | bf16 ms | FP8 ms | FP8/bf16 | "
        "vs equinox | FP8 GEMMs | bf16 vs eqx |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    groups: dict[tuple, dict] = {}
    for r in rows:
        p = r["params"]
        groups.setdefault((p["door"], p["param_dtype"], p["tokens"]), {})[r["variant"]] = r
    for (door, pd_name, tokens), by in groups.items():
        b, f = by.get("bf16", {}), by.get("fp8", {})
        gemms = "-" if f.get("gemm_count") is None else f"{f['fp8_gemm_count']}/{f['gemm_count']}"
        err = " ".join(f"{v} error: {r['error']}" for v, r in by.items() if r.get("error"))
        lines.append(
            f"| {door:<8} | {pd_name} | {tokens} | {common.fmt(b.get('ms'), '.3f')} | "
            f"{common.fmt(f.get('ms'), '.3f')} | "
            f"{common.fmt(f.get('speedup_vs_bf16'), '.2f', 'x')}"
            f" | {common.fmt(f.get('ratio_vs_equinox'), '.2f', 'x')} | {gemms} | "
            f"{common.fmt(b.get('ms_vs_equinox'), '.2f', 'x')} |" + (f" {err}" if err else "")
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI
def _csv(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=COMMAND_PREFIX,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="CPU smoke run: dim 64, 128 tokens, 2 iters, every layer FP8; writes nothing",
    )
    p.add_argument("--doors", type=_csv, help=f"subset of {','.join(DOORS)} (default all)")
    p.add_argument("--tokens", type=lambda s: [int(v) for v in _csv(s)], help="default 8192,16384")
    p.add_argument("--param-dtypes", type=_csv, help="subset of bf16,f32 (default both)")
    p.add_argument("--precisions", type=_csv, default=list(PRECISIONS), help="bf16,fp8")
    p.add_argument("--dim", type=int, help="layer width (default 4096; 64 with --quick)")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--iters", type=int, help="calls per timed repeat (default 20; 2 with --quick)")
    p.add_argument("--reps", type=int, help="timed repeats, median kept (default 5; 2 --quick)")
    p.add_argument("--profile", help="write a jax.profiler trace per case under this folder")
    p.add_argument(
        "--kernel-summary",
        action="store_true",
        help="per case: top kernels by GPU time and totals per category (from the trace)",
    )
    p.add_argument("--profile-steps", type=int, default=5, help="steps traced per case")
    p.add_argument("--top", type=int, default=12, help="kernels listed by --kernel-summary")
    p.add_argument("--out", type=Path, default=None, help=f"records file (default {DEFAULT_OUT})")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.doors = args.doors or list(DOORS)
    args.param_dtypes = args.param_dtypes or list(DTYPES)
    for name, given, allowed in (
        ("doors", args.doors, DOORS),
        ("param-dtypes", args.param_dtypes, DTYPES),
        ("precisions", args.precisions, PRECISIONS),
    ):
        bad = [v for v in given if v not in allowed]
        if bad:
            p.error(f"unknown --{name} {bad}; choose from {', '.join(allowed)}")
    args.tokens = args.tokens or ([128] if args.quick else list(DEFAULT_TOKENS))
    args.dim = args.dim or (64 if args.quick else 4096)
    args.iters = args.iters or (2 if args.quick else 20)
    args.reps = args.reps or (2 if args.quick else 5)
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; one row per (door, param dtype, tokens, precision)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # The README's default config; --quick converts its tiny layers (the size policy would
    # keep them bf16).
    config = fp8jax.Fp8Config(selective=False) if args.quick else fp8jax.Fp8Config()
    meta = common.run_meta(argv, "front_doors", COMMAND_PREFIX)
    print(
        f"{meta['command']}: doors {args.doors} x params {args.param_dtypes} x tokens "
        f"{args.tokens}, {args.layers} layers {args.dim}x{args.dim}, gelu, adam, on "
        f"{meta['device']} (jax {meta['jax']}), {args.reps} x {args.iters} calls per case",
        flush=True,
    )
    record = not args.quick and common.on_gpu()
    path = args.out or DEFAULT_OUT
    rows, written = [], 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        for pd_name in args.param_dtypes:
            for tokens in args.tokens:
                group = run_group(pd_name, tokens, args.doors, args, meta, config)
                print("\n" + format_table(group), flush=True)
                rows += group
                if record:  # per group, so a run cut short keeps what it measured
                    written += common.append_records(group, path, RECORD_FIELDS, ROUNDING)
    print(f"\n=== front doors, {args.layers} x {args.dim}x{args.dim} MLP train step")
    print(format_table(rows))
    if common.on_gpu():
        bad = [r for r in rows if r["variant"] == "fp8" and r.get("ms") and not r["fp8_gemms"]]
        for r in bad:
            print(f"WARNING: {r['params']} fp8 ran {r['fp8_gemm_count']}/{r['gemm_count']} FP8")
    common.print_records_written(record, written, path, args.quick)
    return rows


if __name__ == "__main__":
    main()
