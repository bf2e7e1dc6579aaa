"""Benchmark: how long a user's FP8 train step takes to compile, against bf16.

Each variant compiles in a fresh process (XLA reads its flags once per process), with the
flags a user has by default (``import fp8jax`` turns XLA's Triton GEMM autotuning off):

* ``bf16``        the step in bf16
* ``fp8``         the same step after ``fp8jax.fp8_linear_layers``
* ``fp8-cached``  ``fp8`` started a second time with the persistent compilation cache that
  a first start (``fill_s`` in the record) wrote

``bf16`` and ``fp8`` both compile without a persistent cache, as a user's own code does
unless it turns one on: writing the cache (and XLA's per-fusion autotuning cache that jax
turns on with it) costs a first start time that bf16 would not pay.

Models: ``two-block`` (issue 21's user model: two 4096 -> 14336 -> 4096 gelu MLP blocks,
16384 tokens, adamw through ``fp8jax.optax_step``, a plain ``eqx.filter_jit`` step),
``1b-trainer`` (``fp8jax-train --preset 1b``'s step, its own ``compile_s``: notebook 02),
and each other notebook's step as it is written there, at its GPU sizes (``quickstart``,
``fused-mlp``, ``mha``, ``moe``, ``sharded``, ``recipe-tensor|rowwise|blockwise``;
``notebooks`` names them all). The bf16 step is the same code without the conversion.

    python -m benchmarks.compile                      # two-block and 1b-trainer, records
    python -m benchmarks.compile --models notebooks   # every notebook's step
    python -m benchmarks.compile --flags triton       # XLA's default autotuning kept (slow)
    python -m benchmarks.compile --quick              # CPU smoke run, writes nothing

``compile_s`` is lower + compile, the median over ``--repeats`` fresh processes (each
``fp8-cached`` with its own cache; every run is in the record's ``compile_s_runs``).
``lower_s`` (every model but ``1b-trainer``) is the tracing and lowering part of it (Python:
in small steps most of FP8's extra time). ``step_ms`` is one step after compiling, the
median of 10, to show the GEMMs run as fast either way. ``fusions`` and
``hlo_instructions`` count the compiled module's fusions and instructions: the same from
run to run, where compile times of one program vary by 10-30% between fresh processes.
``1b-step`` is ``1b-trainer``'s step compiled from abstract shapes in one process
(no weights, data or steps).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.compile_cases import HEADER, MODELS, TAIL

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "compile.jsonl"
VARIANTS = ("bf16", "fp8", "fp8-cached")


def _env(flags: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "FP8JAX_KEEP_TRITON_GEMM")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    if flags == "triton":
        env["FP8JAX_KEEP_TRITON_GEMM"] = "1"
    return env


def _run(cmd: list[str], flags: str, timeout: int) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, env=_env(flags), capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise RuntimeError(f"{shlex.join(cmd[:4])} failed:\n{out.stderr[-2000:]}")
    return out


def _program_args(model: str, variant: str, quick: bool, cache: str) -> tuple[str, list[str]]:
    """``model``'s program (`HEADER` + its `MODELS` entry + `TAIL`) and the arguments it
    reads: model, precision, quick, cache directory (``-``: none)."""
    precision = "bf16" if variant == "bf16" else "fp8"
    cached = cache if variant.startswith("fp8-cache") else "-"
    return HEADER + MODELS[model] + TAIL, [model, precision, "1" if quick else "0", cached]


def user_step(model: str, variant: str, cache: str, flags: str, quick: bool) -> dict:
    """``model``'s step (`MODELS`) compiled in a fresh process."""
    program, args = _program_args(model, variant, quick, cache)
    cmd = [sys.executable, "-c", program, *args]
    return json.loads(_run(cmd, flags, timeout=900).stdout.strip().splitlines()[-1])


def run_here(model: str, variant: str = "fp8", quick: bool = True) -> dict:
    """``model``'s step run in this process (tests: no fresh process per model); the
    numbers are not a first compile's."""
    import contextlib
    import io

    program, args = _program_args(model, variant, quick, "-")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(program, {"ARGV": ["-", *args], "__name__": "__compile_step__"})
    return json.loads(printed.getvalue().strip().splitlines()[-1])


def trainer(variant: str, cache: str, flags: str, quick: bool) -> dict:
    precision = "bf16" if variant == "bf16" else "fp8"
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "fp8jax.train",
            "--preset",
            "tiny" if quick else "1b",
            "--precision",
            precision,
            "--steps",
            "2",
            "--eval-every",
            "2",
            "--checkpoint-every",
            "0",
            "--eval-batches",
            "1",
            "--no-plot",
            "--quiet",
            "--max-bytes",
            str(2**20),
            "--out",
            out,
        ]
        cached = variant.startswith("fp8-cache")
        cmd += ["--compile-cache", cache] if cached else ["--no-compile-cache"]
        _run(cmd, flags, timeout=900)
        result = json.loads((Path(out) / f"result-{precision}.json").read_text())
    return dict(
        compile_s=result["compile_s"], fp8_gemms=result.get("fp8_gemms"), gemms=result.get("gemms")
    )


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.compile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--models",
        nargs="+",
        default=["two-block", "1b-trainer"],
        choices=[*MODELS, "1b-trainer", "notebooks"],
        help="notebooks: every notebook's step (quickstart, fused-mlp, mha, moe, sharded, "
        "recipe-*; 1b-trainer is notebook 02's)",
    )
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument(
        "--flags",
        choices=["default", "triton"],
        default="default",
        help="default: what a user gets; triton: FP8JAX_KEEP_TRITON_GEMM=1",
    )
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per variant")
    p.add_argument("--quick", action="store_true", help="tiny CPU-sized run, writes nothing")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if "notebooks" in args.models:
        at = args.models.index("notebooks")
        notebooks = [m for m in MODELS if m not in ("two-block", "1b-step")] + ["1b-trainer"]
        args.models[at : at + 1] = [m for m in notebooks if m not in args.models]
    rows = []
    with tempfile.TemporaryDirectory() as cache_root:
        for model in args.models:
            runs: dict[str, list[dict]] = {v: [] for v in args.variants}
            for i in range(args.repeats):
                cache = str(Path(cache_root) / model / str(i))  # filled, then read
                for variant in args.variants:
                    todo = ["fp8-cache-fill", variant] if variant == "fp8-cached" else [variant]
                    got = [
                        trainer(v, cache, args.flags, args.quick)
                        if model == "1b-trainer"
                        else user_step(model, v, cache, args.flags, args.quick)
                        for v in todo
                    ]
                    row = dict(got[-1], fill_s=got[0]["compile_s"]) if len(got) > 1 else got[0]
                    runs[variant].append(row)
                    print(f"  {model} {variant} run {i + 1}: {row['compile_s']:.2f} s", flush=True)
            for variant, got in runs.items():
                row = dict(got[0], model=model, variant=variant)
                row["compile_s_runs"] = [r["compile_s"] for r in got]
                row["compile_s"] = statistics.median(row["compile_s_runs"])
                if "fill_s" in row:
                    row["fill_s"] = statistics.median(r["fill_s"] for r in got)
                for key in ("step_ms", "lower_s"):
                    if row.get(key) is not None:
                        row[key] = statistics.median(r[key] for r in got)
                rows.append(row)
                extra = f", lowering {row['lower_s']:.2f} s" if "lower_s" in row else ""
                extra += f", step {row['step_ms']:.2f} ms" if row.get("step_ms") else ""
                if "fusions" in row:
                    extra += f", {row['fusions']} fusions / {row['hlo_instructions']} HLO"
                print(
                    f"{model:<16} {variant:<11} compile {row['compile_s']:7.2f} s (median of "
                    f"{len(got)}), FP8 GEMMs {row.get('fp8_gemms')}/{row.get('gemms')}{extra}",
                    flush=True,
                )
        for model in args.models:
            got = {r["variant"]: r["compile_s"] for r in rows if r["model"] == model}
            if "bf16" in got and "fp8" in got:
                print(f"{model:<16} fp8 / bf16 compile: {got['fp8'] / got['bf16']:.2f}x")
    if not args.quick:
        _write(rows, args, argv)
    return rows


def _write(rows: list[dict], args, argv) -> None:
    """Append the rows to ``args.out`` in the records format (GPU runs only)."""
    from benchmarks import common

    if not common.on_gpu():
        return
    meta = common.run_meta(argv or sys.argv[1:], "compile", "python -m benchmarks.compile")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        for r in rows:
            rec = dict(
                bench=meta["bench"],
                params=dict(model=r["model"], flags=args.flags),
                variant=r["variant"],
                **{k: meta[k] for k in ("device", "date", "jax", "command")},
                compile_s=round(r["compile_s"], 2),
                compile_s_runs=[round(v, 2) for v in r["compile_s_runs"]],
                fp8_gemms=r.get("fp8_gemms"),
                gemm_count=r.get("gemms"),
            )
            if "fill_s" in r:
                rec["fill_s"] = round(r["fill_s"], 2)
            if r.get("step_ms") is not None:
                rec["ms"] = round(r["step_ms"], 3)
            if "lower_s" in r:
                rec["lower_s"] = round(r["lower_s"], 3)
            for key in ("fusions", "hlo_instructions"):  # of the compiled (optimized) module
                if key in r:
                    rec[key] = r[key]
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
