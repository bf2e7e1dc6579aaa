"""The trainer's device mesh (``--mesh data=2,fsdp=4``): parse it, build it over the
visible devices, place the model on it (`fp8jax.shard_model`) and shard each batch over
its ``data`` and ``fsdp`` axes; and ``jax.distributed.initialize`` for multi-host runs."""

from __future__ import annotations

import os

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..distributed import _embedding_spec, _put, sequence_sharding, shard_model

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the batch is split over these; replicated over "tensor"
# Megatron split of the dense blocks under a "tensor" axis of size > 1 (the MoE's grouped
# experts are not linear layers: they stay as placed by FSDP / replicated).
COLUMN_PARALLEL = ("blocks.attn.qkv", "blocks.mlp.fc1")
ROW_PARALLEL = ("blocks.attn.o", "blocks.mlp.fc2")


def parse_mesh(text: str, device_count: int | None = None) -> dict[str, int]:
    """``"data=2,fsdp=4"`` -> ``{"data": 2, "fsdp": 4, "tensor": 1}``; axes left out are
    1. Raises ``ValueError`` naming ``--mesh`` for an unknown or repeated axis, a size
    that is not a positive int, or sizes whose product is not ``device_count``
    (default: the number of visible devices)."""
    device_count = len(jax.devices()) if device_count is None else device_count
    sizes = dict.fromkeys(AXES, 1)
    seen = set()
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        name = name.strip()
        if not eq:
            raise ValueError(f"--mesh {text!r}: {part!r} is not AXIS=SIZE (e.g. data=2,fsdp=4)")
        if name not in sizes:
            raise ValueError(f"--mesh {text!r}: unknown axis {name!r}; axes are {', '.join(AXES)}")
        if name in seen:
            raise ValueError(f"--mesh {text!r}: axis {name!r} is given twice")
        seen.add(name)
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"--mesh {text!r}: size {value!r} of {name!r} is not an int") from None
        if sizes[name] < 1:
            raise ValueError(f"--mesh {text!r}: size of {name!r} must be >= 1, got {sizes[name]}")
    total = int(np.prod(list(sizes.values())))
    if total != device_count:
        raise ValueError(
            f"--mesh {text!r}: the axis sizes multiply to {total}, but {device_count} devices "
            f"are visible; their product must equal the device count (default: "
            f"fsdp={device_count} on GPUs, data={device_count} elsewhere)"
        )
    return sizes


def default_mesh(backend: str, device_count: int) -> str:
    """``--mesh``'s default over ``device_count`` devices: FSDP on GPUs (faster than data
    parallel there and in less memory: benchmarks/RESULTS.md, nineteenth session), data
    parallel elsewhere (the CPU's virtual devices, where the tests run and weight gathers
    only cost compile time)."""
    return f"fsdp={device_count}" if backend == "gpu" else f"data={device_count}"


def make_mesh(sizes: dict[str, int], devices=None) -> Mesh:
    """A GSPMD (Auto) mesh with axes ``data, fsdp, tensor`` over ``devices`` (default:
    all visible ones, ordered by `jax.make_mesh` for the hardware's topology)."""
    shape = tuple(sizes.get(a, 1) for a in AXES)
    if devices is None:
        auto = (jax.sharding.AxisType.Auto,) * len(AXES)
        return jax.make_mesh(shape, AXES, axis_types=auto)
    return Mesh(np.asarray(devices).reshape(shape), AXES)


def batch_size_per_shard(mesh: Mesh) -> int:
    """How many ways a batch is split: the product of the mesh's batch axes."""
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def check_batch(batch: int, mesh: Mesh) -> None:
    n = batch_size_per_shard(mesh)
    if batch % n:
        raise ValueError(
            f"--batch {batch} does not divide over the mesh's data x fsdp = {n} devices "
            f"(--mesh {','.join(f'{a}={s}' for a, s in mesh.shape.items())}); use a multiple of {n}"
        )


def place_model(model, mesh: Mesh, sequence_parallel: bool = False, tp_overlap: str = "none"):
    """``model`` on ``mesh``: linear weights sharded over ``fsdp`` (FP8 layers then
    all-gather FP8), the embedding too (`shard_embedding`) and, with a ``tensor`` axis > 1,
    the attention and dense MLP split Megatron-style; everything else (norms, FP8 state)
    replicated. With
    ``sequence_parallel`` the residual stream's tokens are split over ``tensor`` too
    (`check_sequence_parallel` says when it applies), moved as ``tp_overlap`` says
    (`fp8jax.shard_model`)."""
    tp = mesh.shape["tensor"] > 1
    dense = not model.cfg.experts
    model = shard_model(
        model,
        mesh,
        fsdp_axis="fsdp",
        tensor_axis="tensor" if tp else None,
        column_parallel=(COLUMN_PARALLEL if dense else COLUMN_PARALLEL[:1]) if tp else (),
        row_parallel=(ROW_PARALLEL if dense else ROW_PARALLEL[:1]) if tp else (),
        sequence_parallel=sequence_parallel,
        batch_axes=BATCH_AXES,
        tp_overlap=tp_overlap,
    )
    model = eqx.tree_at(lambda m: m.embed, model, shard_embedding(model.embed, mesh))
    if not sequence_parallel:
        return model
    return model.with_token_split((mesh, BATCH_AXES, "tensor"))


def build_placed(build, mesh: Mesh, sequence_parallel: bool = False, tp_overlap: str = "none"):
    """``build()``'s model made on ``mesh`` where `place_model` puts it, each device computing
    only its own shards: the model is built and placed abstractly (``eqx.filter_eval_shape``),
    then one jitted ``build`` makes its arrays with those shardings. Built whole on one
    device and then placed, a model had to fit one device in float32 with room to spare.
    The values are ``build()``'s up to XLA fusing the initialisation (the last bit of some
    normal draws: the embedding's, the MoE router's)."""
    abstract = place_model(eqx.filter_eval_shape(build), mesh, sequence_parallel, tp_overlap)
    shapes, static = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    # flat: the placed tree's static records (the weights' shardings) are not build()'s
    made = jax.jit(
        lambda: jax.tree_util.tree_leaves(eqx.filter(build(), eqx.is_array)),
        out_shardings=[x.sharding for x in leaves],
    )()
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, made), static)


def shard_embedding(embed, mesh: Mesh):
    """``embed`` (``[vocab, dim]``, the trainer's table: a plain array, not an
    `eqx.nn.Embedding`) split over the mesh's ``fsdp`` axis as `fp8jax.shard_model` splits
    an embedding (`fp8jax.distributed._embedding_spec`)."""
    spec = _embedding_spec(embed.shape, mesh, "fsdp")
    return _put(embed, NamedSharding(mesh, P(*spec)))


def check_sequence_parallel(run, mesh: Mesh | None) -> None:
    """``--sequence-parallel`` needs a tensor axis > 1, dense blocks, and a sequence the
    tensor axis divides; raises ``ValueError`` naming the option otherwise."""
    tensor = mesh.shape["tensor"] if mesh is not None else 1
    if tensor == 1:
        raise ValueError("--sequence-parallel needs a --mesh with tensor > 1 (e.g. tensor=4)")
    if run.model.experts:
        raise ValueError("--sequence-parallel: dense blocks only (--experts 0)")
    try:  # the split the model's residual stream will take (`place_model`)
        sequence_sharding(mesh, (run.batch, run.model.seq), BATCH_AXES, "tensor")
    except ValueError:
        local = run.batch // batch_size_per_shard(mesh)
        raise ValueError(
            f"--sequence-parallel: {local} sequences of --seq {run.model.seq} per batch shard "
            f"split neither as one sequence (seq divisible by tensor={tensor}) nor as whole "
            f"sequences (per-shard batch divisible by tensor={tensor})"
        ) from None


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES, None))


def put_batch(batch: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global batch from the host copy every process holds (the corpus draws batches
    from (seed, step) alone): each process fills only its own devices' shards."""
    return jax.make_array_from_callback(batch.shape, sharding, lambda index: batch[index])


def initialize_distributed(
    coordinator: str | None, num_processes: int | None, process_id: int | None
):
    """``jax.distributed.initialize`` for a multi-host run, before JAX's backend starts.
    All three options together, or none (single process). ``$JAX_LOCAL_DEVICE_IDS``
    (``0,1``: GPU ordinals; ``--processes`` sets it) restricts the process to those GPUs."""
    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if not any(given):
        return
    if not all(given):
        raise ValueError(
            "--coordinator, --num-processes and --process-id go together (a multi-host run "
            "needs all three on every host)"
        )
    if not 0 <= process_id < num_processes:
        raise ValueError(
            f"--process-id {process_id} must be in [0, --num-processes {num_processes})"
        )
    ids = os.environ.get("JAX_LOCAL_DEVICE_IDS", "").strip()  # (newer jax reads it too)
    local = [int(i) for i in ids.split(",")] if ids else None
    jax.distributed.initialize(
        coordinator, num_processes=num_processes, process_id=process_id, local_device_ids=local
    )
