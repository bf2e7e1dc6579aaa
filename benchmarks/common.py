"""What the benchmark harnesses share: timing, the record format and the tables.

* **Steps and timing.** A `Step` is a jitted function ``fn(params, x, g)`` compiled once
  (the timed executable is the one whose GEMMs and memory are reported); `train_step`
  builds the usual one (loss ``sum(y * G)`` and its gradients w.r.t. the model and the
  input), `calibrate` writes one step's FP8 state back, `time_step` / `time_call` time
  it, `gemm_check` and `peak_mem_mb` read the compiled program.
* **Records.** `run_meta` gives the fields every record of a run shares (bench, device,
  date, jax, command), `append_records` appends rows as JSON lines to
  ``benchmarks/results/<bench>.jsonl`` (`results_path`) in the format of
  ``BENCHMARKS.md``, `run_cases` runs cases, prints their tables and records them (GPU
  only, never ``--quick``).
* **Tables.** `add_ratios` (TFLOP/s and speedups from one run), `fmt` and
  `markdown_rows` (the markdown tables of ``RESULTS.md``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import shlex
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp

import fp8jax
from fp8jax.inspect import parse_gemms

RESULTS = Path(__file__).resolve().parent / "results"
# The fields every record starts with (BENCHMARKS.md); each bench adds its measured ones.
META_FIELDS = ("bench", "params", "variant", "device", "date", "jax", "command")


# ----------------------------------------------------------------------------- steps
@dataclasses.dataclass
class Step:
    """A step ready to time: ``fn(params, x, g)``, for a train step returning
    ``(loss, (grad wrt params, grad wrt x))``. ``jitted`` runs it from one executable,
    compiled on the first call and kept in ``compiled`` (so the GEMM report and the
    memory analysis read the very program that is timed, and nothing compiles twice).

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
    return jnp.sum(y.astype(jnp.float32) * g.astype(jnp.float32))


def _call(model, x):
    return model(x)


def train_step(model, apply: Callable = _call, note: str = "") -> Step:
    """The `Step` of ``projection_loss(apply(model, x), g)``: the loss and its gradients
    w.r.t. (the array part of ``model``, ``x``)."""
    params, static = eqx.partition(model, eqx.is_array)

    def loss(params, x, g):
        return projection_loss(apply(eqx.combine(params, static), x), g)

    return Step(jax.value_and_grad(loss, argnums=(0, 1)), params, note)


def calibrate(step: Step, model, x, g) -> Step:
    """Run ``step`` once and write the FP8 state it returns into ``step.params`` (so the
    timed steps use calibrated delayed scales)."""
    _, (param_grads, _) = jax.block_until_ready(step.jitted(step.params, x, g))
    overwrites, _ = fp8jax.partition_for_grad_overwrite(param_grads)
    step.params, _ = eqx.partition(fp8jax.apply_updates(model, None, overwrites), eqx.is_array)
    return step


# ----------------------------------------------------------------------------- measuring
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


def error_text(e: Exception, limit: int = 300, first_line: bool = False) -> str:
    """``"Type: message"`` of a failed variant for its row (its first line only if asked),
    cut to ``limit`` characters."""
    message = str(e).splitlines()[0] if first_line and str(e) else str(e)
    return f"{type(e).__name__}: {message}"[:limit]


def add_ratios(rows: list[dict], flops, speedups: dict[str, str], case=None) -> None:
    """In place: ``tflops`` from ``flops`` (a number, or ``flops(row)``) and each
    ``speedups`` key as the time of its base variant over the row's time, both from
    this run, among the rows of the same ``case(row)`` (all rows when None); None
    where a time is missing."""
    case = case or (lambda r: None)
    ref = {(case(r), r["variant"]): r.get("ms") for r in rows}
    for r in rows:
        ms = r.get("ms")
        ok = ms is not None and math.isfinite(ms) and ms > 0
        n = flops(r) if callable(flops) else flops
        r["tflops"] = n / (ms * 1e-3) / 1e12 if ok else None
        for key, base in speedups.items():
            base_ms = ref.get((case(r), base))
            r[key] = base_ms / ms if ok and base_ms else None


# ----------------------------------------------------------------------------- records
def on_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


def results_path(bench: str) -> Path:
    """``benchmarks/results/<bench>.jsonl``: where ``bench``'s records go."""
    return RESULTS / f"{bench}.jsonl"


def run_meta(argv: list[str], bench: str, prefix: str) -> dict:
    """Fields shared by every row of this run of ``bench`` (command ``prefix argv``)."""
    return dict(
        bench=bench,
        device=jax.devices()[0].device_kind,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        jax=jax.__version__,
        command=" ".join([prefix, *map(shlex.quote, argv)]),
    )


def append_records(
    rows: list[dict],
    path: Path,
    fields,
    rounding: dict | None = None,
    optional=(),
    measured: str = "ms",
) -> int:
    """Append ``fields`` of the measured rows (those with a ``measured`` value: errors left
    out; values rounded to ``rounding[field]`` digits) to ``path`` as JSON lines, then the
    ``optional`` fields a row has (not None: e.g. a peer framework's versions); the number
    written."""
    rounding = rounding or {}
    path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(path, "a") as f:
        for r in rows:
            if r.get(measured) is None:
                continue
            rec = {}
            for k in fields:
                value = r.get(k)
                rec[k] = round(value, rounding[k]) if k in rounding and value is not None else value
            rec.update((k, r[k]) for k in optional if r.get(k) is not None)
            f.write(json.dumps(rec) + "\n")
            written += 1
    return written


def print_records_written(record: bool, written: int, path: Path, quick: bool) -> None:
    """The last line of a harness's run: how many records went where, or why none did."""
    if record:
        print(f"\nappended {written} records to {path}")
    else:
        print(f"\n(no records written: {'--quick' if quick else 'not on a GPU'})")


def run_cases(
    cases,
    run_one,
    table,
    path: Path,
    fields,
    record: bool = True,
    optional=(),
    measured: str = "ms",
) -> list[dict]:
    """``run_one(case) -> rows`` for each case, printing ``table(rows)`` as it goes and, on a
    GPU when ``record``, appending the rows' ``fields`` (and ``optional`` ones; ``measured``:
    the field a row that did not fail has, see `append_records`) to ``path`` per case (a
    run cut short keeps what it measured); then the whole table. Returns all rows."""
    record = record and on_gpu()
    rows = []
    for case in cases:
        case_rows = run_one(case)
        print(table(case_rows), flush=True)
        rows += case_rows
        if record:
            append_records(case_rows, path, fields, optional=optional, measured=measured)
    print("\n" + table(rows), flush=True)
    return rows


# ----------------------------------------------------------------------------- tables
def fmt(value, spec: str, suffix: str = "") -> str:
    """``value`` formatted by ``spec`` (+ ``suffix``), ``-`` for None."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def markdown_rows(
    rows: list[dict], case_header: str, case, columns, error_chars: int | None = None
) -> list[str]:
    """Markdown table lines shared by the harnesses: ``case(r)`` (one or more cells,
    as ``case_header`` names them: ``"a | b"``) and the variant, then one cell per
    ``(header, cell(r))`` in ``columns``; a row without a time shows its error (cut
    to ``error_chars``) instead."""
    header = f"| {case_header} | variant | " + " | ".join(h for h, _ in columns) + " |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        if r.get("ms") is None:
            error = f"error: {str(r.get('error') or '')[:error_chars]}"
            cells = [error] + [""] * (len(columns) - 1)
        else:
            cells = [cell(r) for _, cell in columns]
        lines.append(f"| {case(r)} | {r['variant']} | " + " | ".join(cells) + " |")
    return lines
