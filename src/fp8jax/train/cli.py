"""``fp8jax-train``: train a byte-level decoder-only transformer in bf16 or FP8.

    fp8jax-train                          # tiny preset, FP8 vs bf16 (--compare), CPU-sized
    fp8jax-train --preset 1b --precision fp8 --out runs/1b
    fp8jax-train --data my_corpus.txt --steps 2000 --dim 512 --layers 8
    fp8jax-train --out runs/tiny --resume # continue from the newest checkpoint
    fp8jax-train --preset 8b --mesh data=2,fsdp=4   # 8 devices: 2-way data x 4-way FSDP

Writes to ``--out``: ``loss.png`` (loss curves), ``metrics.csv`` / ``metrics.json``,
``summary.md`` (the table printed at the end), TensorBoard event files under
``tb/<precision>/``, and orbax checkpoints under ``ckpt-<precision>/`` every
``--checkpoint-every`` steps and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import sys
from pathlib import Path

import jax

from .. import compilation
from ..recipe import RECIPES
from .checkpoint import has_checkpoint, restore_checkpoint, save_checkpoint
from .config import PRESETS, RunConfig, build_model, compute_dtype, fp8_config, make_optimizer
from .data import load_corpus
from .loop import Trainer, TrainRun, lm_loss, train, train_interleaved
from .mesh import check_sequence_parallel, initialize_distributed, make_mesh, parse_mesh
from .metering import PEAK_BF16_FLOPS, energy_counter
from .model import ModelConfig, Transformer, cast_for_compute
from .report import plot, summarize, to_records, write_metrics

# Re-exported: callers (benchmarks, notebooks) reach the trainer's pieces through `cli`.
__all__ = [
    "PEAK_BF16_FLOPS",
    "PRESETS",
    "ModelConfig",
    "RunConfig",
    "TrainRun",
    "Trainer",
    "Transformer",
    "build_model",
    "cast_for_compute",
    "compute_dtype",
    "console_main",
    "energy_counter",
    "fp8_config",
    "lm_loss",
    "main",
    "make_optimizer",
    "parse_args",
    "plot",
    "restore_checkpoint",
    "run_config",
    "save_checkpoint",
    "summarize",
    "to_records",
    "train",
    "train_interleaved",
    "write_metrics",
]
RECORD_COMMAND = "fp8jax-train"


class UsageError(ValueError):
    """A bad option value, found before anything is written: `main` raises it to callers in
    Python; on the command line it is a usage error (message on stderr, exit status 2)."""


def _at_least(low: int):
    """An argparse type: an int >= ``low`` (argparse names the option in its error)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is not allowed; expected an int >= {low}")
        return value

    parse.__name__ = "int"
    return parse


def _positive(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is not allowed; expected a number > 0")
    return value


def parse_args(argv):
    return _parser().parse_args(argv)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fp8jax-train",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    add = p.add_argument
    add("--preset", choices=sorted(PRESETS), default="tiny")
    add(
        "--precision",
        choices=["bf16", "fp8"],
        default=None,
        help="train one precision (default: --compare both)",
    )
    add("--compare", action="store_true", help="bf16 then fp8, same seed and data order (default)")
    add(
        "--interleave",
        type=int,
        default=0,
        metavar="K",
        help="with --compare: train both in one process, K steps of each in turn, so both are "
        "timed on the same GPU state (a GPU at its power cap runs slower than a cool one); "
        "needs memory for both models",
    )
    add("--data", default=None, help="text file or directory (default: the Python stdlib sources)")
    add("--out", type=Path, default=None, help="output directory (default runs/<preset>)")
    add("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    for name, typ in (
        ("steps", _at_least(1)),
        ("batch", _at_least(1)),
        ("lr", _positive),
        ("warmup", _at_least(0)),
        ("eval-every", _at_least(1)),
        ("eval-batches", _at_least(1)),
        ("checkpoint-every", _at_least(0)),
        ("seed", int),
    ):
        add(f"--{name}", type=typ, default=None)
    for name in ("dim", "layers", "heads", "kv-heads", "ffn", "seq", "experts", "top-k"):
        add(f"--{name}", type=_at_least(1), default=None, help="model size override")
    add("--scaling", choices=["delayed", "current"], default="delayed")
    add(
        "--recipe",
        choices=list(RECIPES),
        default="tensor",
        help="FP8 scaling granularity: per tensor, per row, or DeepSeek-V3 1x128/128x128 blocks",
    )
    add(
        "--fast-accumulation",
        choices=["forward", "all", "none"],
        default="forward",
        help="FP8 GEMMs allowed Hopper's fast accumulation (default: forward only, as TE)",
    )
    add(
        "--cast-kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="FP8 casts through the one-pass Pallas cast + transpose + amax kernel (Hopper; "
        "the default; --no-cast-kernel: XLA's fused casts)",
    )
    add(
        "--scan-unroll",
        type=_at_least(1),
        default=None,
        help="layers per scan iteration; = --layers unrolls fully (no residual stacking between "
        "layers)",
    )
    add(
        "--fp8-everywhere",
        action="store_true",
        help="turn the size policy off (FP8 on every block linear)",
    )
    add(
        "--fp8-attention",
        action="store_true",
        help="the fp8 run also runs attention in FP8 (cuDNN FP8 flash attention on H100: pays "
        "from seq 8192 on, slower below; needs head_dim 128 and seq a multiple of 128 on GPU)",
    )
    add(
        "--mesh",
        default=None,
        metavar="AXIS=N,...",
        help="device mesh over axes data, fsdp, tensor (e.g. data=2,fsdp=4; axes left out are 1); "
        "the sizes must multiply to the number of visible devices. The batch is split over data "
        "and fsdp, weights sharded over fsdp (FP8 all-gather) and tensor (Megatron). Default: "
        "data parallel over all visible devices",
    )
    add(
        "--sequence-parallel",
        action="store_true",
        help="Megatron sequence parallelism (needs --mesh with tensor > 1, dense blocks): "
        "between the tensor-parallel layers the tokens are split over tensor; FP8 layers "
        "all-gather their FP8 inputs and reduce-scatter their outputs",
    )
    add(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="multi-host: jax.distributed.initialize's coordinator address (process 0's host); "
        "with --num-processes and --process-id, on every host",
    )
    add("--num-processes", type=_at_least(1), default=None, help="multi-host: number of processes")
    add("--process-id", type=_at_least(0), default=None, help="multi-host: this process's index")
    add(
        "--xla-triton-gemm",
        action="store_true",
        help="keep XLA's Triton GEMM autotuning (off by default here: on an H100 it spent ~190 s "
        "compiling the fp8 step, then chose cuBLASLt for every FP8 GEMM anyway)",
    )
    add(
        "--compile-cache",
        type=Path,
        default=None,
        metavar="DIR",
        help="JAX's persistent compilation cache: a restart loads the compiled steps "
        f"(default {compilation.DEFAULT_CACHE}, or $FP8JAX_CACHE_DIR)",
    )
    add("--no-compile-cache", action="store_true", help="compile from scratch")
    add("--max-bytes", type=_at_least(1), default=64 * 2**20, help="corpus size cap")
    add("--record", type=Path, default=None, help="append benchmark records (JSON lines) here")
    add("--no-plot", action="store_true")
    add("--no-tensorboard", action="store_true", help="no TensorBoard event files (tb/<precision>)")
    add("--quiet", action="store_true", help="no progress bar")
    return p


def run_config(args) -> RunConfig:
    preset = dict(PRESETS[args.preset])
    model = preset.pop("model")
    names = ("dim", "layers", "heads", "kv_heads", "ffn", "seq", "experts", "top_k", "scan_unroll")
    overrides = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    model = dataclasses.replace(model, **overrides)
    for k in ("steps", "batch", "lr", "warmup", "eval_every", "checkpoint_every"):
        if getattr(args, k) is not None:
            preset[k] = getattr(args, k)
    if args.fp8_everywhere:
        preset["selective"] = False
    run = RunConfig(
        model=model,
        scaling=args.scaling,
        recipe=args.recipe,
        fast_accumulation=args.fast_accumulation,
        cast_kernel=args.cast_kernel,
        fp8_attention=args.fp8_attention,
        sequence_parallel=args.sequence_parallel,
        **preset,
    )
    if args.eval_batches is not None:
        run.eval_batches = args.eval_batches
    if args.seed is not None:
        run.seed = args.seed
    return run


def _mesh(args):
    """The mesh to train on; None (one device, unsharded, as before meshes) when one
    device is visible and no --mesh is given."""
    if args.mesh is None and jax.device_count() == 1:
        return None
    text = f"data={jax.device_count()}" if args.mesh is None else args.mesh
    return make_mesh(_usage(parse_mesh, text))


def _usage(fn, *args, prefix: str = "", **kwargs):
    """``fn(*args, **kwargs)``, its ValueError raised again as a `UsageError` (``prefix`` +
    its message)."""
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        raise UsageError(prefix + str(e)) from None


def _check_options(args) -> RunConfig:
    """The run's config, and the checks that need no devices, before JAX's backend starts."""
    sizes = ("dim", "layers", "heads", "kv_heads", "ffn", "seq", "experts", "top_k")
    given = " ".join(
        f"--{k.replace('_', '-')} {getattr(args, k)}" for k in sizes if getattr(args, k) is not None
    )
    run = _usage(run_config, args, prefix=f"--preset {args.preset} {given}".strip() + ": ")
    if args.interleave < 0:
        raise UsageError(f"--interleave {args.interleave}: K must be > 0 (0: off)")
    if args.interleave and not _compare(args):
        raise UsageError(
            f"--interleave {args.interleave} needs both precisions (--compare, not "
            f"--precision {args.precision})"
        )
    if args.warmup is not None and args.warmup > run.steps:
        raise UsageError(f"--warmup {args.warmup} is larger than --steps {run.steps}")
    if args.mesh is not None and not args.mesh.strip():
        raise UsageError(f"--mesh {args.mesh!r}: expected AXIS=SIZE,... (e.g. data=2,fsdp=4)")
    if args.data is not None and not Path(args.data).expanduser().exists():
        raise UsageError(f"--data {args.data}: no such file or directory")
    return run


def _compare(args) -> bool:
    return not args.precision or args.compare


def _todo(args, precisions, out, run) -> tuple[dict[str, dict], list[str], dict[str, bool]]:
    """Results already on disk, the precisions to train, and which of them resume."""
    results: dict[str, dict] = {}
    # Results of the other precision from an earlier invocation into the same --out.
    for name in ("bf16", "fp8"):
        path = out / f"result-{name}.json"
        if name not in precisions and path.exists():
            results[name] = json.loads(path.read_text())
    todo = []
    for precision in precisions:
        done = out / f"result-{precision}.json"
        if args.resume and done.exists():
            previous = json.loads(done.read_text())
            if previous["steps"] >= run.steps and not previous["interrupted"]:
                results[precision] = previous  # finished before the interruption
                continue
        todo.append(precision)
    # --resume continues what has a checkpoint; a precision the interruption came before starts
    # fresh (unless nothing has one: then there is nothing to resume, and restoring says so).
    started = [p for p in todo if has_checkpoint(out, p)]
    resume = {p: args.resume and (p in started or not started) for p in todo}
    return results, todo, resume


def main(argv: list[str] | None = None, *, interrupt_at: int | None = None) -> dict[str, dict]:
    """Train as the command line says. ``argv`` None (``fp8jax-train``, ``python -m
    fp8jax.train``): ``sys.argv``, and a bad option value is a usage error (exit status 2);
    with a list of arguments a bad value raises `UsageError` (a ValueError) instead."""
    if argv is not None:
        return _main(list(argv), interrupt_at)
    parser = _parser()
    try:
        return _main(sys.argv[1:], interrupt_at)
    except UsageError as e:
        parser.error(str(e))


def _main(argv: list[str], interrupt_at: int | None) -> dict[str, dict]:
    args = parse_args(argv)
    run = _check_options(args)
    _usage(initialize_distributed, args.coordinator, args.num_processes, args.process_id)
    if args.xla_triton_gemm:  # undo what importing fp8jax set, while the backend has not started
        flags = os.environ.get("XLA_FLAGS", "").replace(compilation.TRITON_GEMM_OFF, "")
        os.environ["XLA_FLAGS"] = " ".join(flags.split())
    if not args.no_compile_cache:
        compilation.enable_compilation_cache(args.compile_cache)
    precisions = ["bf16", "fp8"] if _compare(args) else [args.precision]
    mesh = _mesh(args)
    if args.sequence_parallel:
        _usage(check_sequence_parallel, run, mesh)
    mesh_text = ",".join(f"{a}={n}" for a, n in mesh.shape.items()) if mesh is not None else ""
    out = args.out or Path("runs") / args.preset
    main_process = jax.process_index() == 0
    corpus = _usage(load_corpus, args.data, max_bytes=args.max_bytes)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = e.strerror or e
        raise UsageError(f"--out {out}: cannot create the output directory: {why}") from None
    device = jax.devices()[0]
    meta = dict(
        device=device.device_kind,
        platform=device.platform,
        jax=jax.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        command=" ".join([RECORD_COMMAND, *map(shlex.quote, argv)]),
        preset=args.preset,
        devices=jax.device_count(),
        mesh=mesh_text,
        model=dataclasses.asdict(run.model),
        batch=run.batch,
        steps=run.steps,
        lr=run.lr,
        corpus=dict(
            source=corpus.source,
            files=corpus.files,
            train_bytes=len(corpus.train),
            val_bytes=len(corpus.val),
        ),
    )
    where = device.device_kind + (f" x {mesh.devices.size} (mesh {mesh_text})" if mesh else "")
    if main_process:
        print(
            f"fp8jax-train: preset {args.preset}, {run.model.non_embedding_params() / 1e6:.1f}M "
            f"params, {run.steps} steps x {run.batch} x {run.model.seq} tokens, on {where}; "
            f"corpus {corpus.source} ({corpus.files} files, {len(corpus.train) / 1e6:.1f} MB "
            "train)",
            flush=True,
        )
    results, todo, resume = _todo(args, precisions, out, run)
    common = dict(
        quiet=args.quiet, interrupt_at=interrupt_at, mesh=mesh, tensorboard=not args.no_tensorboard
    )
    if args.interleave and len(todo) > 1:
        new = train_interleaved(
            run, todo, corpus, out, chunk=args.interleave, resume=resume, **common
        )
    else:
        new = {}
        for precision in todo:
            new[precision] = train(run, precision, corpus, out, resume=resume[precision], **common)
            if new[precision]["interrupted"]:
                break
    results.update(new)
    table = summarize(results)
    if main_process:
        _write_outputs(args, run, out, meta, new, results, table)
    return results


def _write_outputs(args, run, out: Path, meta: dict, new: dict, results: dict, table: str) -> None:
    """The run's files (results, summary, metrics, plot, records) and the printed table."""
    for precision, r in new.items():
        (out / f"result-{precision}.json").write_text(json.dumps(r))
    (out / "summary.md").write_text(
        f"{meta['command']} on {meta['device']} ({meta['date']})\n\n{table}\n"
    )
    write_metrics(results, out, meta)
    title = f"{args.preset}: {run.model.non_embedding_params() / 1e6:.0f}M params, {meta['device']}"
    png = None if args.no_plot else plot(results, out, title)
    if args.record:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        with open(args.record, "a") as f:
            # this process's runs only: a bf16 result read back from ``out`` was recorded by
            # the command that trained it (its gap and speedup fields are relative anyway)
            ran = {name: results[name] for name in new}
            for rec in to_records(ran, run, args.preset, meta, args.interleave):
                f.write(json.dumps(rec) + "\n")
    print("\n" + table)
    for name, r in results.items():
        if r.get("compile_s") is not None:
            print(
                f"{name}: compiled in {r['compile_s']:.0f} s; the step runs {r['fp8_gemms']} of "
                f"its {r['gemms']} GEMM calls in FP8"
            )
    tb = "" if args.no_tensorboard else ", tb/"
    print(
        f"\nwrote {out}/metrics.csv, metrics.json, summary.md{tb}"
        + (f", {png.name}" if png else "")
    )


def console_main() -> int:
    """``fp8jax-train``'s entry point. `main` returns its results for callers in Python, which
    a console script would hand to ``sys.exit`` (printing them and exiting with status 1).
    A bad option value exits with status 2 (argparse's usage error)."""
    main()
    return 0


if __name__ == "__main__":
    sys.exit(console_main())
