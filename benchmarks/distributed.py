"""Benchmark: the trainer's LM train step on a device mesh, bf16 vs FP8.

Builds a `fp8jax-train` preset's model (`fp8jax.train`), places it with
the trainer's `fp8jax.train._mesh.place_model` (`fp8jax.shard_model`) on a mesh over all
visible devices (FSDP over ``fsdp``, Megatron column/row over ``tensor``: ``qkv``/``fc1``
column, ``o``/``fc2`` row; ``--sequence-parallel`` as the trainer's; the batch over
``data`` x ``fsdp``), and times a plain jitted train step. Reports per variant:

* ``tokens_per_s`` and ``ms`` (step time);
* ``scaling_efficiency``: tokens/s over ``devices x`` the tokens/s of the same step with
  the per-device batch on one device (1.0 on a mesh of one; None with ``baseline_error``
  where that step fails, e.g. a model too large for one device: the mesh's row stays);
* ``allgather_bytes``: bytes of the all-gathered results per device per step, from the
  partitioned HLO (`fp8jax.distributed.hlo_collectives`; layers are unrolled so that each
  layer's gathers are counted), and ``allgather_dtypes`` (count per element type: FSDP
  weights move as ``f8e4m3fn`` in the FP8 variant);
* ``collective_bytes`` and ``collective_dtypes``: the same per collective kind (all-gather,
  reduce-scatter, all-reduce, ...): which move FP8 and which bf16/f32;
* ``exposed_comm_ms`` and ``comm_ms``: per step, the time a collective kernel runs with no
  compute kernel beside it, and all collective time (a profile of 3 steps on the GPUs,
  `benchmarks.comm_profile`), and ``collective_schedule``: per collective kind, how many
  XLA left synchronous or scheduled beside nothing, XLA's fusions, or a library kernel
  (`benchmarks.hlo_schedule`; GPUs only);
* ``speedup_vs_bf16`` (FP8 rows: over the bf16 row of the same run);
* ``peak_mem_mb`` of the compiled step (arguments + outputs + temporaries, the outputs
  that reuse the donated parameters and optimizer state counted once; records before
  2026-11-27's nineteenth session counted them twice);
* ``saved_residual_mb`` and ``saved_residuals`` (MiB by dtype): what the step's backward
  keeps besides the parameters, all devices (`fp8jax.train._memory.saved_residuals`, as
  the trainer reports it; traced only).

``--max-batch`` times nothing: per variant it finds ``max_batch``, the largest global batch
(a multiple of ``data x fsdp``) whose compiled step fits in one device's memory (XLA's
memory analysis: temporaries + arguments + outputs, against the GPU's ``bytes_limit`` or
``--memory-limit-gb``), by compiling only: doubling, then bisecting. FP8 keeps its GEMM
inputs for the backward in one byte instead of two, so it fits a larger batch where
activations dominate. ``--max-batch-from N`` starts the search at N. A search cut short
(Ctrl-C, or SIGTERM from ``timeout`` once the current compile returns) still writes its row:
``max_batch`` is then the largest batch that fit so far, and ``max_batch_complete`` is False.

    python -m benchmarks.distributed --preset 1b              # 1 GPU: a mesh of one
    python -m benchmarks.distributed --mesh data=2,fsdp=4     # 8 devices
    python -m benchmarks.distributed --preset 8b --mesh fsdp=4 --no-baseline  # 128k vocab
    python -m benchmarks.distributed --quick                  # CPU smoke run, writes nothing
    python -m benchmarks.distributed --preset 1b --max-batch  # largest batch per variant

Records (GPU, not ``--quick``) go to ``benchmarks/results/distributed.jsonl``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import os
import re
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from benchmarks import batch_search, comm_profile, common, hlo_schedule
from benchmarks.distributed_tables import max_batch_table, table
from fp8jax import _compilation as compilation
from fp8jax import distributed, tuning
from fp8jax._ops.tp_ring import OVERLAPS
from fp8jax.nn import cross_entropy
from fp8jax.train import _cli as cli
from fp8jax.train._memory import compiled_bytes, saved_residuals
from fp8jax.train._mesh import check_sequence_parallel
from fp8jax.train._model import REMAT, ModelConfig, cast_for_compute
from fp8jax.train._trainer import _init_sharded, _shardings

VARIANTS = ("bf16", "fp8")
AXES = ("data", "fsdp", "tensor")
# A CPU-sized model (the trainer's tiny preset is slow to compile 8-way on 2 cores).
QUICK_MODEL = ModelConfig(dim=64, layers=2, heads=2, kv_heads=2, ffn=128, seq=32)
DTYPE_BYTES = {"f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4}
DEFAULT_OUT = common.results_path("distributed")
COMMAND_PREFIX = "python -m benchmarks.distributed"
RECORD_FIELDS = (
    *common.META_FIELDS,
    "ms",
    "tokens_per_s",
    "scaling_efficiency",
    "speedup_vs_bf16",
    "allgather_bytes",
    "allgather_dtypes",
    "collective_bytes",
    "collective_dtypes",
    "exposed_comm_ms",
    "comm_ms",
    "peak_mem_mb",
    "saved_residual_mb",
    "saved_residuals",
)
# A ``--max-batch`` row's fields (`batch_search.search_row`'s and the limit), here and in
# `benchmarks.memory`; ``max_batch_complete`` False: the search was cut (a timeout), so
# ``max_batch`` is a lower bound.
MAX_BATCH_FIELDS = (
    "max_batch",
    "max_batch_mem_mb",
    "next_mem_mb",
    "memory_limit_gb",
    "compiles",
    "max_batch_complete",
)
# Fields only some records have (written where a row has them).
OPTIONAL_FIELDS = (
    *MAX_BATCH_FIELDS,
    "time_breakdown_ms",  # GPU: where the step's time goes (`comm_profile.breakdown_ms`)
    "collective_schedule",  # GPU: what runs beside each collective (`hlo_schedule`)
)


def parse_mesh(text: str, devices: int) -> dict[str, int]:
    """``"data=2,fsdp=4"`` -> ``{"data": 2, "fsdp": 4, "tensor": 1}``; the sizes must
    multiply to ``devices``."""
    sizes = dict.fromkeys(AXES, 1)
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in AXES or not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(
                f"--mesh: expected axis=size items with axes {AXES}, got {item!r}"
            )
        sizes[name] = int(value)
    if math.prod(sizes.values()) != devices:
        raise argparse.ArgumentTypeError(
            f"--mesh {text!r} has {math.prod(sizes.values())} devices; {devices} are visible"
        )
    return sizes


def make_mesh(sizes: dict[str, int], devices) -> Mesh:
    return Mesh(np.array(devices).reshape(tuple(sizes[a] for a in AXES)), AXES)


def _loss(model, batch):
    """The trainer's next-byte cross-entropy (plus the MoE load-balancing loss)."""
    logits, aux = cast_for_compute(model, cli.compute_dtype()).forward(batch[:, :-1], None)
    return cross_entropy(logits, batch[:, 1:]).mean() + aux


def build_step(run: cli.RunConfig, precision: str, mesh: Mesh):
    """(jitted step, params, opt_state, static) of ``run``'s model sharded on ``mesh``."""
    sequence_parallel = run.sequence_parallel and mesh.shape["tensor"] > 1
    run = dataclasses.replace(run, sequence_parallel=sequence_parallel)
    model = cli.build_model(run, precision, mesh)  # each device makes its own shards
    optimizer = cli.make_optimizer(run)
    params, static = eqx.partition(model, eqx.is_array)
    opt_state = _init_sharded(optimizer, fp8jax.trainable(model), mesh)  # as the trainer

    def step(params, opt_state, batch):
        model = eqx.combine(params, static)
        loss, grads = eqx.filter_value_and_grad(_loss)(model, batch)
        model, opt_state = fp8jax.optax_step(optimizer, model, grads, opt_state)
        return eqx.filter(model, eqx.is_array), opt_state, loss

    # outputs where the inputs are (as the trainer pins them): the compiled step takes its own
    # outputs, which XLA may otherwise lay out differently (a bf16 FSDP step did)
    out = (_shardings(params), _shardings(opt_state), NamedSharding(mesh, P()))
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=out), params, opt_state, static


def collective_summary(collectives) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """(bytes of the results per collective kind, count per kind and element type)."""
    total, kinds = collections.Counter(), collections.defaultdict(collections.Counter)
    for c in collectives:
        for dtype, shape in zip(c.dtype.split(","), re.findall(r"\[([\d,]*)\]", c.shape)):
            dims = [int(d) for d in shape.split(",") if d]
            total[c.kind] += math.prod(dims) * DTYPE_BYTES.get(dtype, 4)
            kinds[c.kind][dtype] += 1
    return dict(total), {k: dict(v) for k, v in kinds.items()}


def gather_summary(collectives) -> tuple[int, dict[str, int]]:
    """(bytes of all all-gather results, count per element type)."""
    total, kinds = collective_summary(collectives)
    return total.get("all-gather", 0), kinds.get("all-gather", {})


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The batch's sharding: its sequences split over ``data`` x ``fsdp``."""
    data_axes = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1) or None
    return NamedSharding(mesh, P(data_axes))


def measure(
    run, precision, mesh, batch_size: int, steps: int, hlo: bool = True, top_kernels: int = 0
) -> dict:
    """Step time, tokens/s, collectives (and their exposed time on GPUs), peak memory and
    (with ``hlo``) the saved residuals of one variant on ``mesh``; on GPUs it prints the
    ``top_kernels`` costliest kernels that are neither GEMMs, attention nor collectives."""
    step, params, opt_state, static = build_step(run, precision, mesh)
    rng = np.random.default_rng(0)
    batch = jax.device_put(
        rng.integers(0, run.model.vocab, (batch_size, run.model.seq + 1), dtype=np.int32),
        batch_sharding(mesh),
    )
    lowered = step.lower(params, opt_state, batch)
    # before the step runs: it donates the parameters
    row = saved_residuals(_loss, eqx.combine(params, static), batch) if hlo else {}
    if hlo and mesh.size > 1:
        compiled, collectives = distributed.compile_with_collectives(lowered)
        row["allgather_bytes"], row["allgather_dtypes"] = gather_summary(collectives)
        row["collective_bytes"], row["collective_dtypes"] = collective_summary(collectives)
    else:  # one device: no collectives
        compiled = lowered.compile()
        row["allgather_bytes"], row["allgather_dtypes"] = (0, {}) if hlo else (None, None)
    for _ in range(2):  # warm-up
        params, opt_state, loss = compiled(params, opt_state, batch)
    jax.block_until_ready(loss)
    t0 = time.perf_counter()
    for _ in range(steps):
        params, opt_state, loss = compiled(params, opt_state, batch)
    jax.block_until_ready(loss)
    ms = (time.perf_counter() - t0) / steps * 1e3
    if hlo and mesh.size > 1 and common.on_gpu():
        state = [params, opt_state]

        def one_step():
            state[0], state[1], out = compiled(state[0], state[1], batch)
            jax.block_until_ready(out)

        breakdown = comm_profile.profile_step(one_step, top=top_kernels)
        params, opt_state = state
        row["collective_schedule"] = hlo_schedule.collective_schedule(compiled.as_text())
        if top_kernels:
            print(
                f"{precision}: collectives by what runs beside them: {row['collective_schedule']}"
            )
        if breakdown is not None:  # where the step's time goes: GEMMs, attention, the rest
            row["exposed_comm_ms"], row["comm_ms"] = breakdown["exposed_comm"], breakdown["comm"]
            row["time_breakdown_ms"] = breakdown
            print(
                f"{precision}: time per step (ms) "
                + ", ".join(f"{k} {v:.1f}" for k, v in breakdown.items()),
                flush=True,
            )
    mem = compiled_bytes(compiled, donated=True)  # the step donates params and opt state
    mem = None if mem is None else mem / 2**20
    return dict(row, ms=ms, tokens_per_s=batch_size * run.model.seq / (ms * 1e-3), peak_mem_mb=mem)


def max_batch(run, precision, mesh, limit_bytes: int, start: int | None = None) -> dict:
    """The largest global batch (a multiple of the data-parallel size ``dp = data x
    fsdp``) whose compiled step fits in ``limit_bytes`` per device (`compiled_bytes`, the
    donated parameters and optimizer state counted once), found by compiling only: no
    step runs. From ``dp``, each next batch is where the line through two batches
    already compiled meets the limit (memory grows about linearly with the batch; where
    the line says nothing, the batch doubles), and after a step that did not halve the
    range between the largest batch that fits and the smallest that does not, the middle
    of it (bisection); until they are ``dp`` apart. ``start``: the first batch compiled instead
    of ``dp`` (``--max-batch-from``: near the answer, fewer of the slow large compiles).
    Under sequence parallelism ``dp`` is ``data x fsdp x tensor`` (`batch_search.batch_unit`).

    Returns:
        `batch_search.search_row`'s fields: ``max_batch`` (0: not even ``dp`` fits), its
        ``max_batch_mem_mb``, ``next_mem_mb`` (of ``max_batch + dp``, which does not fit),
        the number of ``compiles`` and ``max_batch_complete``.
    """
    step, params, opt_state, _ = build_step(run, precision, mesh)
    sharding, dp = batch_sharding(mesh), batch_search.batch_unit(mesh, run.sequence_parallel)

    def compiled(batch: int):
        spec = jax.ShapeDtypeStruct((batch, run.model.seq + 1), np.int32, sharding=sharding)
        return step.lower(params, opt_state, spec).compile()

    return batch_search.search_row(batch_search.batch_bytes(compiled, dp), dp, limit_bytes, start)


def run_params(run, sizes, devices) -> dict:
    """A record's ``params``: what the run measured (mesh, devices, model, settings)."""
    params = dict(
        mesh=",".join(f"{a}={sizes[a]}" for a in AXES),
        gpus=len(devices),
        processes=jax.process_count(),
        vocab=run.model.vocab,
        batch=run.batch,
    )
    if run.sequence_parallel:
        params["sequence_parallel"] = True
    if run.tp_overlap != "none":
        params["tp_overlap"] = run.tp_overlap
    if run.tp_overlap == "chunks":  # --tp-chunks
        params["tp_chunks"] = tuning.current_gemm().tp_chunks
    if run.sequence_parallel:  # --no-sequence-cast, in effect where it measures
        params["sequence_cast"] = tuning.current_gemm().sequence_cast
    if run.fp8_head:
        params["fp8_head"] = True
    if run.fp8_attention:
        params["fp8_attention"] = True
    if run.remat not in ("none", "auto"):
        params["remat"] = run.remat
    flags = os.environ.get("XLA_FLAGS", "").replace(compilation.TRITON_GEMM_OFF, "").strip()
    if flags:  # the user's XLA flags change what is measured: they go with the record
        params["xla_flags"] = flags
    return params


def run_variant(
    run, precision, sizes, devices, steps, baseline: bool, top_kernels: int = 0
) -> dict:
    mesh = make_mesh(sizes, devices)
    params = run_params(run, sizes, devices)
    try:
        row = measure(run, precision, mesh, run.batch, steps, top_kernels=top_kernels)
    except Exception as e:  # a variant that fails is reported, the others still run
        return dict(params=params, variant=precision, error=common.error_text(e))
    row["scaling_efficiency"] = 1.0 if len(devices) == 1 else None
    if baseline and len(devices) > 1:
        per_device = run.batch // (sizes["data"] * sizes["fsdp"])
        one = make_mesh(dict.fromkeys(AXES, 1), devices[:1])
        try:
            single = measure(run, precision, one, per_device, steps, hlo=False)
            row["scaling_efficiency"] = row["tokens_per_s"] / (
                len(devices) * single["tokens_per_s"]
            )
        except Exception as e:  # e.g. a model too large for one device: the mesh's row stays
            row["baseline_error"] = common.error_text(e)
    return dict(params=params, variant=precision, **row)


def probe_variant(run, precision, sizes, devices, limit_bytes: int, start=None) -> dict:
    """A ``--max-batch`` row: `max_batch` of one variant on the mesh ``sizes``."""
    params = run_params(run, sizes, devices)
    del params["batch"]  # the probe's to find
    try:
        row = max_batch(run, precision, make_mesh(sizes, devices), limit_bytes, start)
    except Exception as e:  # a variant that fails is reported, the others still run
        row = dict(error=common.error_text(e))
    return dict(params=params, variant=precision, memory_limit_gb=limit_bytes / 2**30, **row)


def _tuned(args) -> dict:
    """The `fp8jax.tuning.gemm` choices the command line makes."""
    chunks = {} if args.tp_chunks is None else {"tp_chunks": args.tp_chunks}
    return dict(sequence_cast=not args.no_sequence_cast, **chunks)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog=COMMAND_PREFIX, description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="1b", choices=sorted(cli.PRESETS))
    p.add_argument("--mesh", default=None, help="e.g. data=2,fsdp=4 (default: fsdp=<devices>)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--batch", type=int, default=None, help="global batch (sequences)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--no-baseline", action="store_true", help="skip the one-device run")
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Megatron sequence parallelism over the tensor axis (fp8jax-train's option)",
    )
    p.add_argument(
        "--tp-overlap",
        choices=OVERLAPS,
        default="none",
        help="with --sequence-parallel: 'ring' or 'chunks' moves the FP8 layers' tokens as "
        "collective matmuls (fp8jax-train's option)",
    )
    p.add_argument(
        "--tp-chunks",
        type=cli._at_least(1),
        help="with --tp-overlap chunks: chunks per device (fp8jax.tuning.gemm(tp_chunks=K); "
        "default: its default)",
    )
    p.add_argument(
        "--no-sequence-cast",
        action="store_true",
        help="with --sequence-parallel: XLA's partitioned FP8 casts and gated MLP core, not "
        "fp8jax's per-device ones (fp8jax.tuning.gemm(sequence_cast=False); for comparison)",
    )
    p.add_argument(
        "--vocab", type=int, default=None, help="vocabulary size (default: the preset's)"
    )
    p.add_argument("--fp8-head", action="store_true", help="the LM head's GEMMs in FP8 too")
    p.add_argument(
        "--remat",
        choices=REMAT,
        default="none",
        help="what the backward keeps of each block (fp8jax-train's --remat; default none)",
    )
    p.add_argument(
        "--fp8-attention",
        action="store_true",
        help="attention in FP8 too (cuDNN on Hopper; fp8jax-train's option)",
    )
    p.add_argument(
        "--top-kernels",
        type=int,
        default=0,
        help="GPU: print this many of the costliest kernels besides GEMMs, attention and "
        "collectives, and of the collectives with their exposed time (by kernel name, from "
        "the step's profile)",
    )
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--quick", action="store_true", help="tiny model, 2 steps; writes no records")
    p.add_argument(
        "--max-batch",
        action="store_true",
        help="find each variant's largest global batch that fits in device memory, by "
        "compiling only (no step runs)",
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
        help="--max-batch: the first batch to compile (default: the data-parallel size); "
        "near the answer the search compiles fewer large steps",
    )
    args = p.parse_args(argv)
    devices = jax.devices()
    if args.max_batch and args.memory_limit_gb is None and not common.on_gpu():
        p.error("--max-batch on a CPU needs --memory-limit-gb")
    if args.memory_limit_gb is not None and not args.memory_limit_gb > 0:
        p.error(f"--memory-limit-gb must be > 0, got {args.memory_limit_gb}")
    sizes = parse_mesh(args.mesh or f"fsdp={len(devices)}", len(devices))
    run = cli.RunConfig(**cli.PRESETS["tiny" if args.quick else args.preset])
    model = QUICK_MODEL if args.quick else run.model
    # unrolled layers: each layer's all-gathers appear (and are counted) in the HLO
    model = dataclasses.replace(model, scan_unroll=model.layers)
    if args.vocab is not None:
        model = dataclasses.replace(model, vocab=args.vocab)
    batch = args.batch or (2 * len(devices) if args.quick else run.batch)
    run = dataclasses.replace(
        run,
        model=model,
        batch=batch,
        sequence_parallel=args.sequence_parallel,
        tp_overlap=args.tp_overlap,
        fp8_head=args.fp8_head,
        fp8_attention=args.fp8_attention,
        remat=args.remat,
    )
    if args.tp_overlap != "none" and not args.sequence_parallel:
        p.error(f"--tp-overlap {args.tp_overlap} needs --sequence-parallel")
    if args.no_sequence_cast and not args.sequence_parallel:
        p.error("--no-sequence-cast needs --sequence-parallel")
    if args.tp_chunks is not None and args.tp_overlap != "chunks":
        p.error("--tp-chunks needs --tp-overlap chunks")
    if args.sequence_parallel:
        check_sequence_parallel(run, make_mesh(sizes, devices))
    steps = args.steps or (2 if args.quick else 10)
    print(f"{devices[0].device_kind} x{len(devices)}, jax {jax.__version__}, {sizes}", flush=True)
    meta = common.run_meta(argv, bench="distributed", prefix=COMMAND_PREFIX)
    preset = "quick" if args.quick else args.preset
    if args.max_batch:
        limit = batch_search.memory_limit(args.memory_limit_gb)
        batch_search.interrupt_on_sigterm()

        def probe_one(precision):
            with tuning.gemm(**_tuned(args)):
                row = probe_variant(run, precision, sizes, devices, limit, args.max_batch_from)
            row["params"] = dict(preset=preset, **row["params"])
            return [dict(meta, **row)]

        return common.run_cases(
            args.variants,
            probe_one,
            max_batch_table,
            Path(args.out),
            RECORD_FIELDS,
            record=not args.quick,
            optional=OPTIONAL_FIELDS,
            measured="max_batch",
        )
    bf16_ms = []

    def run_one(precision):
        with tuning.gemm(**_tuned(args)):
            row = run_variant(
                run, precision, sizes, devices, steps, not args.no_baseline, args.top_kernels
            )
        row["params"] = dict(preset=preset, **row["params"])
        if precision == "bf16":
            bf16_ms.append(row.get("ms"))
        elif row.get("ms") and bf16_ms and bf16_ms[-1]:
            row["speedup_vs_bf16"] = bf16_ms[-1] / row["ms"]
        return [dict(meta, **row)]

    return common.run_cases(
        args.variants,
        run_one,
        table,
        Path(args.out),
        RECORD_FIELDS,
        record=not args.quick,
        optional=OPTIONAL_FIELDS,
    )


if __name__ == "__main__":
    main()
