"""``fp8jax-train``: train a decoder-only transformer in bf16 or FP8 (on bytes, or a tokenizer's
tokens).

    fp8jax-train                          # tiny preset, FP8 vs bf16 (--compare), CPU-sized
    fp8jax-train --preset 1b --precision fp8 --out runs/1b
    fp8jax-train --data my_corpus.txt --steps 2000 --dim 512 --layers 8
    fp8jax-train --tokenizer bpe --vocab 8192 --out runs/bpe   # a BPE trained on the corpus
    fp8jax-train --preset 8b --tokenizer llama3/tokenizer.json     # your tokenizer
    fp8jax-train --out runs/tiny --resume # continue from the newest checkpoint
    fp8jax-train --preset 8b --mesh data=2,fsdp=4   # 8 devices: 2-way data x 4-way FSDP
    fp8jax-train --processes 8 --preset 8b --mesh data=2,fsdp=4   # one process per GPU

Writes to ``--out``: ``loss.png`` (loss curves), ``metrics.csv`` / ``metrics.json``,
``summary.md`` (the table printed at the end), TensorBoard event files under
``tb/<precision>/``, orbax checkpoints under ``ckpt-<precision>/`` every
``--checkpoint-every`` steps and on Ctrl-C (exit status 130), and ``fp8jax-run.json``
(the run's options); with ``--tokenizer bpe`` or ``PATH.json`` also ``tokenizer.json`` (the
run's tokenizer) and ``tokens-<hash>.npz`` (the corpus's token ids). A fresh run refuses a
non-empty ``--out`` that is not one of its runs (``--overwrite`` to train there anyway); it
replaces only files it wrote itself.
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
import numpy as np
from jax.experimental import multihost_utils

from .. import _compilation as compilation
from . import _interrupts as interrupts
from . import _launch as launch
from . import _resume as resume_
from . import _tokenizer as tokenizer
from ._checkpoint import restore_checkpoint, save_checkpoint
from ._config import PRESETS, RunConfig, build_model, compute_dtype, fp8_config, make_optimizer
from ._data import check_seq, load_corpus
from ._loop import TrainRun, train, train_interleaved
from ._mesh import (
    check_sequence_parallel,
    default_mesh,
    initialize_distributed,
    make_mesh,
    parse_mesh,
)
from ._metering import PEAK_BF16_FLOPS, energy_counter
from ._model import ModelConfig, Transformer, cast_for_compute
from ._options import _at_least, _positive, build_parser, millions  # noqa: F401 (generate's)
from ._report import plot, summarize, to_records, write_metrics
from ._rundir import (
    UsageError,
    atomic_write_text,
    config_record,
    prepare_out,
    read_json,
    read_marker,
    remove_created,
    write_marker,
)
from ._trainer import Trainer, lm_loss

# Re-exported: callers (benchmarks, notebooks) reach the trainer's pieces through `cli`.
__all__ = [
    "PEAK_BF16_FLOPS",
    "PRESETS",
    "ModelConfig",
    "RunConfig",
    "TrainRun",
    "Trainer",
    "Transformer",
    "UsageError",
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
INTERRUPTED = 130  # exit status after Ctrl-C (128 + SIGINT), as a shell reports it


def parse_args(argv):
    return _parser().parse_args(argv)


def _parser() -> argparse.ArgumentParser:
    return build_parser(__doc__)


def run_config(args, tok=None) -> RunConfig:
    """The run's config from its options. ``--tokenizer PATH.json``: ``tok`` is that file's
    tokenizer (loaded here when None), for its record and the default ``--vocab``."""
    preset = dict(PRESETS[args.preset])
    model = preset.pop("model")
    names = ("dim", "layers", "heads", "kv_heads", "ffn", "seq", "experts", "top_k", "vocab")
    names = (*names, "scan_unroll")
    overrides = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    tok = tok or tokenizer.from_option(args.tokenizer)
    vocab = tokenizer.model_vocab(args.tokenizer, tok, model.vocab)
    if args.vocab is None and vocab:
        overrides["vocab"] = vocab
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
        fp8_head=args.fp8_head,
        sequence_parallel=args.sequence_parallel,
        tp_overlap=args.tp_overlap,
        remat=args.remat,
        **preset,
        **tokenizer.run_fields(args.tokenizer, tok),
    )
    if args.eval_batches is not None:
        run.eval_batches = args.eval_batches
    if args.seed is not None:
        run.seed = args.seed
    return run


def _mesh(args):
    """The mesh to train on; None (one device, unsharded, as before meshes) when one
    device is visible and no --mesh is given, else `default_mesh` of the devices."""
    if args.mesh is None and jax.device_count() == 1:
        return None
    text = (
        default_mesh(jax.default_backend(), jax.device_count()) if args.mesh is None else args.mesh
    )
    return make_mesh(_usage(parse_mesh, text))


def _usage(fn, *args, prefix: str = "", **kwargs):
    """``fn(*args, **kwargs)``, its ValueError raised again as a `UsageError` (``prefix`` +
    its message)."""
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        raise UsageError(prefix + str(e)) from None


def _check_options(args):
    """The run's config and its tokenizer (None: a BPE to train), and the checks that need no
    devices, before JAX's backend starts."""
    tok = tokenizer.from_option(args.tokenizer)
    sizes = ("dim", "layers", "heads", "kv_heads", "ffn", "seq", "experts", "top_k", "vocab")
    given = " ".join(
        f"--{k.replace('_', '-')} {getattr(args, k)}" for k in sizes if getattr(args, k) is not None
    )
    prefix = f"--preset {args.preset} {given}".strip() + ": "
    run = _usage(run_config, args, tok, prefix=prefix)
    if tok is not None:
        tokenizer.check_vocab(run.model.vocab, tok)
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
    if args.overwrite and args.resume:
        raise UsageError("--overwrite starts afresh: it cannot go with --resume")
    if args.tp_overlap != "none" and not args.sequence_parallel:
        raise UsageError(f"--tp-overlap {args.tp_overlap} needs --sequence-parallel")
    if args.tp_overlap != "none" and not fp8_config(run).recipe.per_tensor_scale:
        # the rings and chunks take per-tensor scales only (`fp8jax._ops.tp_ring.applies`)
        raise UsageError(
            f"--tp-overlap {args.tp_overlap}: per-tensor scaling only (--recipe {run.recipe})"
        )
    multihost = [args.coordinator, args.num_processes, args.process_id]
    if args.processes is not None and any(v is not None for v in multihost):
        raise UsageError(
            f"--processes {args.processes} starts and joins its processes itself: it cannot go "
            "with --coordinator, --num-processes, --process-id (each process of a run you "
            "start yourself)"
        )
    if args.data is not None:
        data = Path(args.data).expanduser()
        if not data.exists():
            raise UsageError(f"--data {args.data}: no such file or directory")
        if not data.is_dir() and data.stat().st_size == 0 and not data.is_fifo():
            raise UsageError(f"--data {args.data}: empty (0 bytes)")
    return run, tok


def _compare(args) -> bool:
    return not args.precision or args.compare


def main(argv: list[str] | None = None, *, interrupt_at: int | None = None) -> dict[str, dict]:
    """Train as the command line says. ``argv`` None (``fp8jax-train``, ``python -m
    fp8jax.train``): ``sys.argv``, a bad option value is a usage error (exit status 2) and
    Ctrl-C exits with status 130 (during training: once checkpointed and the outputs
    written); with a list of arguments a bad value raises `UsageError` (a ValueError)
    instead, and an interrupted run returns its results (``interrupted``: True). With
    ``--processes N`` the run's N processes (`launch`) return theirs through ``--out``; one
    that fails raises `launch.LaunchError` (command line: its message, and its status).

    Arguments:
        argv: the command line's arguments (``fp8jax-train --help`` lists them), or None.
        interrupt_at: simulate Ctrl-C at this step (tests).

    Returns:
        Each precision's result dict, by precision (``"bf16"``, ``"fp8"``).
    """
    if argv is not None:
        return _main(list(argv), interrupt_at)
    parser = _parser()
    try:
        results = _main(sys.argv[1:], interrupt_at)
        if _interrupted_now:  # this invocation's training, not a result read back from --out
            raise SystemExit(INTERRUPTED)
        return results
    except UsageError as e:
        parser.error(str(e))
    except launch.LaunchError as e:  # a process of --processes failed: its output is above
        print(e, file=sys.stderr)
        raise SystemExit(e.status) from None
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (which checkpoints)
        print("\nfp8jax-train: interrupted", file=sys.stderr)
        raise SystemExit(INTERRUPTED) from None


_interrupted_now = False  # whether the last `main` stopped training on Ctrl-C


def _main(argv: list[str], interrupt_at: int | None) -> dict[str, dict]:
    global _interrupted_now
    _interrupted_now = False
    interrupts.clear()
    launch.die_with_launcher()  # a process of --processes: not without its launcher
    args = parse_args(argv)
    run, tok = _check_options(args)
    if args.processes is not None:
        return _launch(args, argv, interrupt_at)
    _usage(initialize_distributed, args.coordinator, args.num_processes, args.process_id)
    if (args.num_processes or 1) > 1:  # all processes stop after one agreed step
        interrupts.synchronize()
    if args.xla_triton_gemm:  # undo what importing fp8jax set, while the backend has not started
        flags = os.environ.get("XLA_FLAGS", "").replace(compilation.TRITON_GEMM_OFF, "")
        os.environ["XLA_FLAGS"] = " ".join(flags.split())
    if not args.no_compile_cache:
        compilation.enable_compilation_cache(args.compile_cache)
    mesh = _mesh(args)
    if args.sequence_parallel:
        _usage(check_sequence_parallel, run, mesh)
    out = args.out or Path("runs") / args.preset
    # before the corpus is read or a model built: a bad --out fails now, not after training.
    # Process 0 checks and creates it (another would find its first files, or race it).
    created = []
    if jax.process_index() == 0:
        created = prepare_out(out, resume=args.resume, overwrite=args.overwrite)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("fp8jax-train: --out checked")
    try:
        results = _train(args, argv, run, tok, mesh, out, interrupt_at)
    except BaseException:
        remove_created(created)  # those still empty: a failed start leaves nothing behind
        raise
    return results


def _launch(args, argv: list[str], interrupt_at) -> dict[str, dict]:
    """``--processes N``: the run as N processes (`launch`); their results, read back from
    ``--out`` (process 0 wrote them)."""
    global _interrupted_now
    if interrupt_at is not None:
        raise ValueError("interrupt_at (a simulated Ctrl-C) does not reach --processes' runs")
    options = list(_parser()._option_string_actions)
    command = " ".join([RECORD_COMMAND, *map(shlex.quote, argv)])
    status = launch.launch(argv, args.processes, options, command)
    _interrupted_now = status == launch.INTERRUPTED
    out = args.out or Path("runs") / args.preset
    precisions = ["bf16", "fp8"] if _compare(args) else [args.precision]
    paths = {p: out / f"result-{p}.json" for p in precisions}
    return {p: read_json(path) for p, path in paths.items() if path.exists()}


def _train(args, argv, run, tok, mesh, out: Path, interrupt_at) -> dict[str, dict]:
    precisions = ["bf16", "fp8"] if _compare(args) else [args.precision]
    main_process = jax.process_index() == 0
    marker = read_marker(out)
    if tok is None and args.resume:  # --tokenizer bpe: the run's, not trained again
        tok = tokenizer.of_run(out)
        run = dataclasses.replace(run, **tokenizer.record(tok))
    notices = resume_.check_resume(out, run, precisions, marker) if args.resume else []
    results, todo, resume = resume_.todo(args, precisions, out, run, marker)
    text = _usage(load_corpus, args.data, max_bytes=args.max_bytes)
    # tok None (--tokenizer bpe, a fresh run): trained on this corpus's training split
    ids = tokenizer.tokens(text, tok, out, run.model.vocab)
    tok, corpus = ids.tokenizer, ids.corpus
    run = dataclasses.replace(run, **tokenizer.record(tok))
    results = {**resume_.earlier_results(precisions, out, run, marker), **results}
    _usage(check_seq, corpus, run.model.seq)
    if jax.process_count() > 1 and tok.sha256:
        digest = np.frombuffer(bytes.fromhex(tok.sha256), np.uint8)
        multihost_utils.assert_equal(digest, "fp8jax-train: the processes' tokenizers differ")
    mesh_text = ",".join(f"{a}={n}" for a, n in mesh.shape.items()) if mesh is not None else ""
    device = jax.devices()[0]
    meta = dict(
        device=device.device_kind,
        platform=device.platform,
        jax=jax.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        # --processes: the command that started this process and the others
        command=os.environ.get(launch.COMMAND_ENV)
        or " ".join([RECORD_COMMAND, *map(shlex.quote, argv)]),
        preset=args.preset,
        devices=jax.device_count(),
        processes=jax.process_count(),
        mesh=mesh_text,
        model=dataclasses.asdict(run.model),
        batch=run.batch,
        steps=run.steps,
        lr=run.lr,
        remat=run.remat,
        corpus=dict(
            source=corpus.source,
            files=corpus.files,
            train_bytes=len(text.train),
            val_bytes=len(text.val),
        ),
        tokenizer=dict(
            tokenizer.record(tok), file=str(out / tokenizer.FILE) if tok.sha256 else None
        ),
    )
    if corpus is not text:
        meta["corpus"].update(train_tokens=len(corpus.train), val_tokens=len(corpus.val))
    where = device.device_kind + (f" x {mesh.devices.size} (mesh {mesh_text})" if mesh else "")
    if jax.process_count() > 1:
        where += f", {jax.process_count()} processes"
    if main_process:
        print(
            f"fp8jax-train: preset {args.preset}, {millions(run.model.non_embedding_params())} "
            f"params, {run.steps} steps x {run.batch} x {run.model.seq} tokens"
            + ("" if run.remat in ("none", "auto") else f" (--remat {run.remat})")
            + f", on {where}; "
            f"corpus {corpus.source} ({corpus.files} files, {len(text.train) / 1e6:.1f} MB "
            "train)",
            flush=True,
        )
        if corpus is not text:
            print(ids.describe(out), flush=True)
        for notice in notices:
            print(notice, file=sys.stderr, flush=True)
        # A fresh run's options, before anything of it is written. A resumed run's are
        # recorded once its checkpoint restored (`_write_outputs`): not the options of a
        # failed attempt, which the next --resume would be compared with.
        fresh = [p for p in todo if not resume[p]]
        if fresh:
            write_marker(out, {p: config_record(run, p) for p in fresh}, meta["command"])
        ids.keep(out)  # after the marker: --out is one of the trainer's runs
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
            if new[precision]["interrupted"] or interrupts.requested():
                break
    global _interrupted_now
    _interrupted_now = any(r["interrupted"] for r in new.values())
    if interrupts.requested() and not _interrupted_now:  # Ctrl-C after a run's last step
        _interrupted_now = True
        rest = [p for p in todo if p not in new]
        if main_process:
            print(
                f"\ninterrupted: {', '.join(new)} complete"
                + (f", {', '.join(rest)} not started; continue with --resume" if rest else ""),
                file=sys.stderr,
            )
    results.update(new)
    table = summarize(results)
    if main_process:
        _write_outputs(args, run, out, meta, new, results, table)
    return results


def _write_outputs(args, run, out: Path, meta: dict, new: dict, results: dict, table: str) -> None:
    """The run's files (results, summary, metrics, plot, records; each written whole or not
    at all) and the printed table."""
    for precision, r in new.items():
        atomic_write_text(out / f"result-{precision}.json", json.dumps(r))
    if new:
        write_marker(out, {p: config_record(run, p) for p in new}, meta["command"])
    atomic_write_text(
        out / "summary.md", f"{meta['command']} on {meta['device']} ({meta['date']})\n\n{table}\n"
    )
    write_metrics(results, out, meta)
    params = millions(run.model.non_embedding_params())
    title = f"{args.preset}: {params} params, {meta['device']}"
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
            census = f" (counted in the {r['gemm_census']})" if r.get("gemm_census") else ""
            print(
                f"{name}: compiled in {r['compile_s']:.0f} s; the step runs {r['fp8_gemms']} of "
                f"its {r['gemms']} GEMM calls in FP8{census}"
            )
    tb = "" if args.no_tensorboard else ", tb/"
    print(
        f"\nwrote {out}/metrics.csv, metrics.json, summary.md{tb}"
        + (f", {png.name}" if png else "")
    )


def console_main() -> int:
    """``fp8jax-train``'s entry point. `main` returns its results for callers in Python, which
    a console script would hand to ``sys.exit`` (printing them and exiting with status 1).
    A bad option value exits with status 2 (argparse's usage error), Ctrl-C with 130 (after
    the checkpoint, when it came during training)."""
    main()
    return 0


if __name__ == "__main__":
    sys.exit(console_main())
