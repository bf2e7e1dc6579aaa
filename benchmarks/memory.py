"""Benchmark: the memory the trainer's step holds, bf16 vs FP8, per ``--remat`` choice.

Builds the `fp8jax-train` step (`fp8jax.train`'s `Trainer`: the model of a preset, AdamW,
the donated jitted step) for each precision and ``fp8jax-train --remat`` choice (``none``:
the backward keeps what it reads; ``lean``: the same but the norms' outputs, recomputed;
``fc1-fp8``: ``lean`` with the MLP's fc1 output in FP8 in the fp8 run; ``fp8``:
`fp8jax.remat_policy` per block, the GEMMs' input copies, FP8 in the fp8 run, bf16 in the
bf16 run; ``fp8-store``: the same with the MLP's fc1 output kept in FP8 in the fp8 run;
``fp8-min``: without fc1's output; ``full``: only each block's input), runs a few steps and
reports per case:

* ``peak_mem_mb``: on a GPU the allocator's peak (``peak_bytes_in_use``, the largest of the
  mesh's devices) over building the model and optimizer as the trainer does (on a mesh
  each device makes only its own shards: `fp8jax.train._mesh.build_placed`), compiling and
  running the step; on a
  CPU the compiled step's memory analysis (arguments + outputs + temporaries);
  ``peak_mem_source`` says which;
* ``compiled_mem_mb`` and ``temp_mem_mb``: the compiled step's memory analysis, all of it and
  its temporaries (per device; the outputs that reuse the donated parameters counted once;
  before 2026-11-27's nineteenth session, twice);
* ``saved_residual_mb``: what the step's backward keeps (`fp8jax.residuals_report` of the
  trainer's loss, the parameters themselves left out; the whole step's, all devices:
  `fp8jax.train._memory.saved_residuals`, as the trainer reports it), and
  ``saved_residuals``: the same by dtype;
* ``ms`` and ``tokens_per_s`` over ``--steps`` steps on one batch, and ``loss``, the last
  step's (a remat choice changes no math, ``fp8-store`` only the gradients' rounding: within
  a precision the cases' losses differ little); ``mem_vs_none`` and
  ``tokens_per_s_vs_none``: over the same precision's ``--remat none`` case of this run;
* with ``--max-batch``: ``max_batch``, the largest batch whose compiled step fits a device's
  memory, found by compiling only (`benchmarks.batch_search.search_batch`, the probe of
  ``benchmarks.distributed --max-batch``), with its ``max_batch_mem_mb`` and ``compiles``.

On a GPU each case runs in a process of its own (``--isolate``, the default there): the
allocator's peak cannot be reset within a process, and a case must not find the previous
one's buffers.

    python -m benchmarks.memory --preset 1b --batch 8 --variants bf16 fp8 --remat none fp8 full
    python -m benchmarks.memory --preset 1b --batch 8 --variants fp8 --remat none fp8 fp8-store \
        fp8-min
    python -m benchmarks.memory --preset 1b --batch 8 --variants fp8 --max-batch
    python -m benchmarks.memory --preset 8b --mesh fsdp=4 --fp8-head --fp8-attention \
        --batch 8 --variants bf16 fp8 --remat none fc1-fp8   # issue 49's 8b rows
    python -m benchmarks.memory --quick     # CPU smoke run, writes nothing

Records (GPU, not ``--quick``) go to ``benchmarks/results/memory.jsonl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks import batch_search, common, distributed
from fp8jax.train import _cli as cli
from fp8jax.train._memory import allocator_peak_bytes
from fp8jax.train._mesh import (
    AXES,
    default_mesh,
    make_mesh,
    parse_mesh,
)
from fp8jax.train._model import REMAT

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("bf16", "fp8")
DEFAULT_OUT = common.results_path("memory")
COMMAND_PREFIX = "python -m benchmarks.memory"
RESULT = "benchmarks.memory result: "  # the line a case's own process prints its row on
WARMUP = 2  # steps before the timed ones (the first runs the compiled step's loading)
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
_ours: set[str] = set()  # environment variables this process set for itself, not its cases
RECORD_FIELDS = (
    *common.META_FIELDS,
    "ms",
    "tokens_per_s",
    "loss",
    "peak_mem_mb",
    "peak_mem_source",
    "compiled_mem_mb",
    "temp_mem_mb",
    "saved_residual_mb",
    "saved_residuals",
    "mem_vs_none",
    "tokens_per_s_vs_none",
    "compile_s",
)
OPTIONAL_FIELDS = distributed.MAX_BATCH_FIELDS


def mesh_of(text: str | None):
    """(the trainer's mesh, its ``data=..,fsdp=..,tensor=..`` text): None on one device with
    no ``--mesh`` (the trainer's unsharded step), else ``text`` (default: the trainer's,
    `default_mesh`)."""
    if text is None and jax.device_count() == 1:
        return None, ",".join(f"{a}=1" for a in AXES)
    sizes = parse_mesh(text or default_mesh(jax.default_backend(), jax.device_count()))
    return make_mesh(sizes), ",".join(f"{a}={sizes[a]}" for a in AXES)


def probe_max_batch(trainer, run, mesh, limit_bytes: int, start: int | None = None) -> dict:
    """``benchmarks.distributed``'s ``--max-batch`` probe on the trainer's own step: the
    largest batch (a multiple of `batch_search.batch_unit`) whose compiled step fits
    ``limit_bytes`` per device, by compiling only, from ``start`` (``--max-batch-from``)."""
    dp = batch_search.batch_unit(mesh, run.sequence_parallel)

    def compiled(batch: int):
        shape = (batch, run.model.seq + 1)
        spec = jax.ShapeDtypeStruct(shape, np.int32, sharding=trainer.batch_sharding)
        return trainer.lower(spec).compile()

    row = batch_search.search_row(batch_search.batch_bytes(compiled, dp), dp, limit_bytes, start)
    return dict(row, memory_limit_gb=limit_bytes / 2**30)


def measure(
    run, precision: str, mesh, steps: int, limit_bytes: int | None = None, start=None
) -> dict:
    """One case: the trainer's step of ``run`` (its ``remat`` among the rest) in
    ``precision`` on ``mesh``; its memory, residuals and speed (and ``max_batch`` when
    ``limit_bytes`` is given)."""
    model = cli.build_model(run, precision, mesh)  # as `fp8jax-train`: placed as it is made
    trainer = cli.Trainer(
        model, cli.make_optimizer(run), mesh, run.sequence_parallel, run.tp_overlap
    )
    del model  # the trainer holds its own (placed) arrays
    rng = np.random.default_rng(0)
    host = rng.integers(0, run.model.vocab, (run.batch, run.model.seq + 1), dtype=np.int32)
    batch = trainer.device_batch(host)
    trainer.compile(batch)
    row = dict(trainer.residuals)  # `fp8jax.train._memory.saved_residuals`, traced at compile
    loss = None
    for _ in range(WARMUP):
        loss = trainer.step(batch)
    jax.block_until_ready(loss)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = trainer.step(batch)
    loss = float(loss)
    ms = (time.perf_counter() - t0) / steps * 1e3
    stats = trainer.compiled.memory_analysis()
    peak = allocator_peak_bytes()
    row.update(
        ms=ms,
        tokens_per_s=run.batch * run.model.seq / (ms * 1e-3),
        loss=loss,
        peak_mem_mb=trainer.peak_mem_mb() if peak is None else peak / 2**20,
        peak_mem_source="compiled" if peak is None else "allocator",
        compiled_mem_mb=trainer.peak_mem_mb(),
        temp_mem_mb=stats.temp_size_in_bytes / 2**20,
        compile_s=sum(trainer.compile_times.values()),
    )
    if limit_bytes is not None:
        row.update(probe_max_batch(trainer, run, mesh, limit_bytes, start))
    return row


def run_case(run, precision, args, isolate: bool, argv: list[str]) -> dict:
    """`measure` here, or (``isolate``) in a process of its own started with ``argv`` (this
    command's options for this one case): the row, or its ``error``."""
    try:
        if isolate:
            return _in_child(argv)
        limit = batch_search.memory_limit(args.memory_limit_gb) if args.max_batch else None
        mesh = mesh_of(args.mesh)[0]
        return measure(run, precision, mesh, args.steps, limit, args.max_batch_from)
    except Exception as e:  # a case that fails is reported, the others still run
        return dict(error=common.error_text(e))


def _in_child(argv: list[str]) -> dict:
    """The row a ``--child`` process of this module prints for ``argv``'s one case (its
    stderr goes to this process's)."""
    env = {k: v for k, v in os.environ.items() if k not in _ours}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH")) if p
    )
    cmd = [sys.executable, "-m", "benchmarks.memory", *argv, "--child"]
    out = subprocess.run(cmd, env=env, cwd=str(ROOT), stdout=subprocess.PIPE, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith(RESULT)]
    if out.returncode or not lines:
        status = out.returncode
        raise RuntimeError(f"the case's process exited with status {status} (its stderr above)")
    return json.loads(lines[-1][len(RESULT) :])


def add_vs_none(row: dict, none_rows: dict) -> None:
    """In place: ``mem_vs_none`` and ``tokens_per_s_vs_none`` against ``none_rows[variant]``
    (this run's ``--remat none`` row of the same precision; None where there is none)."""
    base = none_rows.get(row["variant"]) or {}
    for key, field in (("mem_vs_none", "peak_mem_mb"), ("tokens_per_s_vs_none", "tokens_per_s")):
        ok = row.get(field) and base.get(field)
        row[key] = row[field] / base[field] if ok else None


def table(rows) -> str:
    return "\n".join(
        common.markdown_rows(
            rows,
            "remat",
            lambda r: r["params"]["remat"],
            [
                ("ms", lambda r: common.fmt(r["ms"], ".1f")),
                ("tokens/s", lambda r: common.fmt(r["tokens_per_s"], ",.0f")),
                ("vs none", lambda r: common.fmt(r.get("tokens_per_s_vs_none"), ".2f", "x")),
                ("peak MiB", lambda r: common.fmt(r["peak_mem_mb"], ",.0f")),
                ("vs none", lambda r: common.fmt(r.get("mem_vs_none"), ".2f", "x")),
                ("temp MiB", lambda r: common.fmt(r["temp_mem_mb"], ",.0f")),
                ("residuals MiB", lambda r: common.fmt(r["saved_residual_mb"], ",.1f")),
                ("by dtype", lambda r: _dtypes(r["saved_residuals"])),
                ("max batch", lambda r: common.fmt(r.get("max_batch"), "d")),
            ],
        )
    )


def _dtypes(mb: dict) -> str:
    return ", ".join(f"{k} {v:,.1f}" for k, v in mb.items() if v >= 0.05) or "-"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=COMMAND_PREFIX, description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="1b", choices=sorted(cli.PRESETS))
    p.add_argument(
        "--mesh",
        default=None,
        help="e.g. fsdp=2 (default, as the trainer: unsharded on one device, else "
        "fsdp=<GPUs>, data=<devices> on CPUs)",
    )
    p.add_argument("--batch", type=int, default=None, help="global batch (default: the preset's)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument(
        "--remat", nargs="+", choices=REMAT, default=list(REMAT), help="fp8jax-train's --remat"
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; quick 2)")
    p.add_argument(
        "--max-batch",
        action="store_true",
        help="also find each case's largest batch that fits a device (compiling only)",
    )
    p.add_argument(
        "--memory-limit-gb",
        type=float,
        default=None,
        help="--max-batch: one device's memory in GiB (default: the GPU's; needed on a CPU)",
    )
    p.add_argument(
        "--max-batch-from",
        type=int,
        default=None,
        help="--max-batch: the first batch to compile (default: the data-parallel size)",
    )
    p.add_argument("--fp8-head", action="store_true", help="the LM head's GEMMs in FP8 too")
    p.add_argument("--fp8-attention", action="store_true", help="attention in FP8 too")
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each case in a process of its own (default: on a GPU)",
    )
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--quick", action="store_true", help="a tiny model, 2 steps; writes nothing")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = build_parser()
    args = p.parse_args(argv)
    if not args.child and args.isolate is not False and PREALLOCATE not in os.environ:
        # The cases' processes get the GPU (with the user's settings): this one allocates
        # nothing on it (set before JAX's backend starts).
        os.environ[PREALLOCATE] = "false"
        _ours.add(PREALLOCATE)
    if args.max_batch and args.child:  # a cut search (a timeout) still prints its row
        batch_search.interrupt_on_sigterm()
    if args.max_batch and args.memory_limit_gb is None and not common.on_gpu():
        p.error("--max-batch on a CPU needs --memory-limit-gb")
    if args.memory_limit_gb is not None and not args.memory_limit_gb > 0:
        p.error(f"--memory-limit-gb must be > 0, got {args.memory_limit_gb}")
    run = cli.RunConfig(**cli.PRESETS["tiny" if args.quick else args.preset])
    model = distributed.QUICK_MODEL if args.quick else run.model
    batch = args.batch or (4 * jax.device_count() if args.quick else run.batch)
    run = dataclasses.replace(
        run, model=model, batch=batch, fp8_head=args.fp8_head, fp8_attention=args.fp8_attention
    )
    args.steps = args.steps or (2 if args.quick else 10)
    mesh_text = mesh_of(args.mesh)[1]
    if args.child:  # one case (`run_case`): its row on stdout, nothing recorded
        (precision,), (remat,) = args.variants, args.remat
        row = run_case(dataclasses.replace(run, remat=remat), precision, args, False, [])
        print(RESULT + json.dumps(row), flush=True)
        return [row]
    isolate = common.on_gpu() if args.isolate is None else args.isolate
    print(
        f"{jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}, "
        f"mesh {mesh_text}, batch {batch}" + (", a process per case" if isolate else ""),
        flush=True,
    )
    meta = common.run_meta(argv, bench="memory", prefix=COMMAND_PREFIX)
    preset = "quick" if args.quick else args.preset
    cases = [(precision, remat) for precision in args.variants for remat in args.remat]
    none_rows: dict[str, dict] = {}

    def run_one(case):
        precision, remat = case
        child = _case_argv(args, precision, remat)
        row = run_case(dataclasses.replace(run, remat=remat), precision, args, isolate, child)
        params = dict(preset=preset, mesh=mesh_text, batch=batch, remat=remat)
        params.update({k: True for k in ("fp8_head", "fp8_attention") if getattr(args, k)})
        row = dict(meta, params=params, variant=precision, **row)
        if remat == "none" and row.get("ms") is not None:
            none_rows[precision] = row
        add_vs_none(row, none_rows)
        return [row]

    rows = common.run_cases(
        cases,
        run_one,
        table,
        Path(args.out),
        RECORD_FIELDS,
        record=not args.quick,
        optional=OPTIONAL_FIELDS,
    )
    written = sum(r.get("ms") is not None for r in rows)
    recorded = common.on_gpu() and not args.quick
    common.print_records_written(recorded, written, Path(args.out), args.quick)
    return rows


def _case_argv(args, precision: str, remat: str) -> list[str]:
    """This command's options (``args``) for one case's own process: its precision and remat
    only."""
    out = ["--preset", args.preset, "--variants", precision, "--remat", remat]
    options = dict(mesh=args.mesh, batch=args.batch, steps=args.steps)
    options["memory-limit-gb"] = args.memory_limit_gb
    options["max-batch-from"] = args.max_batch_from
    for option, value in options.items():
        if value is not None:
            out += [f"--{option}", str(value)]
    flags = ("max_batch", "quick", "fp8_head", "fp8_attention")
    return out + ["--" + f.replace("_", "-") for f in flags if getattr(args, f)]


if __name__ == "__main__":
    main()
