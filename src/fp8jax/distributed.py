"""Sharded FP8 training on a `jax.sharding.Mesh` (GSPMD): place a converted model's
weights (FSDP, Megatron column/row tensor parallel), replicate its FP8 state, and
record each layer's weight sharding so its op all-gathers the weight in FP8.

Every amax is a ``jnp.max`` over a (sharded) global array, which GSPMD turns into a
scalar all-reduce: all devices quantize with the same scale and the replicated state
stays bit-identical. `hlo_collectives` lists a step's collectives with their dtypes.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Sequence

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import _sequence
from ._collectives import (  # noqa: F401  (public here too)
    Collective,
    compile_with_collectives,
    hlo_collectives,
    parse_collectives,
)
from ._convert import _path_str
from ._ops import fsdp
from ._ops.attention import AttnSplit
from ._ops.dot import WeightSharding
from ._ops.expert_parallel import ExpertSharding
from ._placement import _axis_size, _check_auto, _check_mesh, _kinds, _matches, _names
from ._sequence import _batch_axes, _record_sequence, check_overlap
from ._state import OverwriteWithGradient
from .nn._attention import DotProductAttention
from .nn._grouped import GroupedLinear
from .nn._linear import Linear
from .nn._mlp import ACTIVATIONS, FusedMLP

__all__ = [
    "Collective",
    "compile_with_collectives",
    "fp8_state_replicated",
    "fsdp_axes",
    "hlo_collectives",
    "parse_collectives",
    "record_fsdp",
    "sequence_parallel",
    "sequence_sharding",
    "set_fsdp_axes",
    "shard_model",
]


def _layers(model: Any) -> list[tuple[str, Any]]:
    is_layer = lambda x: isinstance(x, (Linear, eqx.nn.Linear))  # noqa: E731
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_layer)
    return [(_path_str(p), x) for p, x in flat if is_layer(x)]


def _placeable(x) -> bool:
    """An array, or its stand-in in a model built abstractly (``eqx.filter_eval_shape``)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _put(x, sharding: NamedSharding):
    """``x`` placed on ``sharding``: an array put there (``jax.device_put``), or a
    ``jax.ShapeDtypeStruct`` (a model built abstractly) carrying it, so that `shard_model`
    can place a model before its arrays exist and the arrays can then be made where they
    belong (``jax.jit(..., out_shardings=...)``: `fp8jax.train`'s sharded init)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.device_put(x, sharding)


def _embedding_tables(model: Any) -> list:
    """The weights of ``model``'s `eqx.nn.Embedding` layers."""
    is_emb = lambda x: isinstance(x, eqx.nn.Embedding)  # noqa: E731
    leaves = jax.tree_util.tree_leaves(model, is_leaf=is_emb)
    return [x.weight for x in leaves if is_emb(x) and _placeable(x.weight)]


def _embedding_spec(shape: tuple, mesh: Mesh, fsdp_axis: str | None) -> tuple:
    """PartitionSpec entries of an embedding table ``[*stack, vocab, dim]``'s last two dims:
    split over ``fsdp_axis`` along ``vocab`` (as an LM head's weight is), else along ``dim``,
    whichever the axis divides; whole where neither does or there is no such axis.
    Replicated, a table and its two AdamW moments cost every device 12 bytes an entry in
    float32 (LLaMA-3-8B's 128,256 x 4,096: 6.3 GB; benchmarks/RESULTS.md, twenty-fifth
    session); the lookup's and its gradient's collectives are XLA's."""
    n = _axis_size(mesh, fsdp_axis)
    vocab, dim = shape[-2:]
    if n == 1:
        return (None, None)
    return (
        (fsdp_axis, None) if vocab % n == 0 else (None, fsdp_axis) if dim % n == 0 else (None, None)
    )


def _weight_spec(path, shape, mesh, fsdp_axis, tensor_axis, parallel, block=None) -> tuple:
    """PartitionSpec entries of a ``[*stack, out, in]`` weight (the last two dims).
    ``block``: the block-wise recipe's block size, which each shard should hold whole (else
    XLA's partitioner replicates the weight for the cast, gathering it in full precision:
    warn)."""
    out_f, in_f = shape[-2:]
    spec: list = [None, None]  # out, in
    if parallel == "column":
        spec[0] = tensor_axis
    elif parallel == "row":
        spec[1] = tensor_axis
    if _axis_size(mesh, fsdp_axis) > 1:
        # out, the major dim of the row-major weight, where the axis divides it: its shards
        # and gathers are contiguous, and so are the gradient's reduce-scatter and the
        # optimizer's update of the shard (split along in, XLA transposed the stacked fc2
        # weight and both Adam moments of every step to the gradient's layout and back:
        # benchmarks/RESULTS.md, twenty-first session); else in where the axis divides it (a
        # vocabulary of 50,257 rows leaves the head's in dim to FSDP); where neither
        # divides, the larger, refused below
        free = [i for i in (0, 1) if spec[i] is None]
        n = _axis_size(mesh, fsdp_axis)
        spec[max(free, key=lambda i: (shape[-2:][i] % n == 0, -i, shape[-2:][i]))] = fsdp_axis
    names = ("out_features", "in_features")
    for i, axis in enumerate(spec):
        n = _axis_size(mesh, axis)
        if axis is not None and (out_f, in_f)[i] % n:
            raise ValueError(
                f"shard_model: layer {path!r}: {names[i]}={(out_f, in_f)[i]} "
                f"(weight {tuple(shape)}) is not divisible by mesh axis {axis!r} of size {n}."
            )
        size = (out_f, in_f)[i]
        if block and n > 1 and (size // n) % block:
            warnings.warn(
                f"shard_model: layer {path!r}: {names[i]}={size} over mesh axis {axis!r} of "
                f"size {n} gives shards of {size // n}, not whole {block}-blocks of the "
                "block-wise recipe: XLA will gather the weight in full precision to cast it.",
                stacklevel=3,
            )
    return tuple(spec)


def _block_size(layer) -> int | None:
    """The block-wise recipe's block size of an FP8 layer, else None."""
    return layer.dot_general.config.recipe.weight_block if isinstance(layer, Linear) else None


def shard_model(
    model: Any,
    mesh: Mesh,
    fsdp_axis: str | None = "fsdp",
    tensor_axis: str | None = None,
    *,
    column_parallel: Sequence[str] = (),
    row_parallel: Sequence[str] = (),
    expert_axis: str | None = None,
    fp8_all_gather: bool = True,
    sequence_parallel: bool = False,
    batch_axes: Sequence[str] | None = None,
    tp_overlap: str = "none",
) -> Any:
    """``model`` with its arrays placed on ``mesh``: each linear weight sharded over
    ``fsdp_axis`` along ``out`` where the axis divides it, else ``in`` (FSDP), each
    `eqx.nn.Embedding` table along its vocabulary where the axis divides it, else its dim,
    and, for layers whose dotted path matches
    ``column_parallel`` / ``row_parallel`` (names or fnmatch patterns), over
    ``tensor_axis`` along out / in (Megatron; a column-parallel bias too); everything
    else, the FP8 state included, replicated. ``expert_axis``: shard every
    `fp8jax.nn.GroupedLinear`'s experts (``weight [E, in, out]`` along ``E``; MoE expert
    parallel; `fp8jax.nn.MoE` with ``dispatch="all_to_all"`` then sends each token to its
    experts' devices in all-to-alls), else replicate them. ``fp8_all_gather``: record the sharding
    in each FP8 layer so it casts its shard and all-gathers FP8 (`record_fsdp`).

    ``sequence_parallel``: Megatron sequence parallelism (`fp8jax._ops.sequence_parallel`).
    Outside the tensor-parallel layers the tokens are split over ``batch_axes`` (default:
    every mesh axis but ``tensor_axis``) and then ``tensor_axis``, as the user's own
    sharding constraints on the activations say; each column-parallel layer all-gathers
    its FP8 input's tokens, each row-parallel one reduce-scatters its output;
    ``tp_overlap="ring"`` or ``"chunks"`` moves them in chunks beside the GEMMs
    (`fp8jax._ops.tp_ring`).

    Arguments:
        model: a converted model (`fp8_linear_layers`, `fp8jax.nn` modules).
        mesh: a mesh with Auto axes (GSPMD).
        fsdp_axis: the mesh axis of FSDP (None: weights not sharded for FSDP).
        tensor_axis: the mesh axis of tensor parallelism (needed by the two lists below).
        column_parallel, row_parallel: dotted paths (or fnmatch patterns) of the
            tensor-parallel layers.
        expert_axis: the mesh axis of expert parallelism, or None.
        fp8_all_gather: record the sharding so weights are all-gathered in FP8.
        sequence_parallel: Megatron sequence parallelism between the tensor-parallel pairs.
        batch_axes: the mesh axes the tokens are split over (None: every axis but
            ``tensor_axis``).
        tp_overlap: with ``sequence_parallel``: ``"none"`` (each collective whole),
            ``"ring"`` or ``"chunks"`` (collective matmul, per-tensor recipes).

    Returns:
        ``model`` with every array placed on ``mesh`` (and the shardings recorded).

    Raises ``ValueError`` naming the layer, the dim and the axis when an axis size does
    not divide the dim it shards, or when a pattern matches no layer; and when
    ``tp_overlap`` is asked without ``sequence_parallel`` or of a layer whose recipe has
    per-token scales.
    """
    _check_mesh("shard_model", mesh)
    check_overlap("shard_model", tp_overlap, sequence_parallel)
    column_parallel = _names("shard_model", "column_parallel", column_parallel)
    row_parallel = _names("shard_model", "row_parallel", row_parallel)
    batch_axes = _names("shard_model", "batch_axes", batch_axes, allow_none=True)
    _axis_size(mesh, fsdp_axis)
    if fsdp_axis is not None and fsdp_axis == tensor_axis:
        raise ValueError(
            f"shard_model: fsdp_axis and tensor_axis are both {fsdp_axis!r}; a weight dim is "
            "split over FSDP or tensor parallelism, each on its own mesh axis."
        )
    if (column_parallel or row_parallel) and tensor_axis is None:
        raise ValueError("shard_model: column_parallel/row_parallel need a tensor_axis.")
    if sequence_parallel and not (column_parallel or row_parallel):
        raise ValueError(
            "shard_model: sequence_parallel needs tensor-parallel layers (column_parallel, "
            "row_parallel): it moves tokens between them."
        )
    _axis_size(mesh, tensor_axis)
    _axis_size(mesh, expert_axis)
    layers = _layers(model)
    paths = [path for path, _ in layers]
    kinds = _kinds("shard_model", paths, column_parallel, row_parallel, "linear layer")
    _check_gated_splits(model, mesh, tensor_axis, column_parallel)
    placements: dict[int, NamedSharding] = _expert_placements(model, mesh, expert_axis)
    for path, layer in layers:
        col = kinds.get(path) == "column"
        w = layer.weight
        spec = _weight_spec(
            path,
            w.shape,
            mesh,
            fsdp_axis,
            tensor_axis,
            kinds.get(path),
            _block_size(layer),
        )
        stack = (None,) * (w.ndim - 2)
        placements[id(w)] = NamedSharding(mesh, P(*stack, *spec))
        if layer.bias is not None:
            placements[id(layer.bias)] = NamedSharding(mesh, P(*stack, spec[0] if col else None))
    for table in _embedding_tables(model):
        spec = _embedding_spec(table.shape, mesh, fsdp_axis)
        placements[id(table)] = NamedSharding(mesh, P(*(None,) * (table.ndim - 2), *spec))
    replicated = NamedSharding(mesh, P())

    def place(x):
        if not _placeable(x):
            return x
        return _put(x, placements.get(id(x), replicated))

    model = jax.tree_util.tree_map(place, model)
    if expert_axis is not None:
        model = _record_experts(model, ExpertSharding(mesh, expert_axis))
    gather = (fsdp_axis,) if fsdp_axis and fp8_all_gather else ()
    if fp8_all_gather or sequence_parallel:
        model = record_fsdp(model, gather)
    if sequence_parallel:
        batch = _batch_axes(mesh, batch_axes, tensor_axis)
        model = _record_sequence(model, mesh, kinds, batch, tensor_axis, tp_overlap, "shard_model")
    heads = tensor_axis if (column_parallel or row_parallel) else None
    return _record_attention(model, mesh, _batch_axes(mesh, batch_axes, tensor_axis), heads)


def _record_attention(model: Any, mesh: Mesh, batch_axes, head_axis: str | None) -> Any:
    """``model`` with each FP8 `DotProductAttention` run per device on its sequences
    (split over ``batch_axes``) and heads (over ``head_axis``, the tensor-parallel axis:
    column-parallel QKV projections split the heads), as `fp8jax._ops.attention.AttnSplit`
    says; axes of size 1 are left out. A no-op on one device."""
    batch = tuple(a for a in batch_axes if mesh.shape[a] > 1)
    head = head_axis if head_axis is not None and mesh.shape[head_axis] > 1 else None
    if not (batch or head):
        return model
    split = AttnSplit(mesh, batch, head)
    is_attn = lambda x: isinstance(x, DotProductAttention)  # noqa: E731

    def record(x):
        return x.with_split(split) if is_attn(x) and x.state is not None else x

    return jax.tree_util.tree_map(record, model, is_leaf=is_attn)


def _check_gated_splits(model: Any, mesh: Mesh, tensor_axis, column_parallel) -> None:
    """A column-parallel gated `FusedMLP` fc1 must split into whole gate/up pairs
    (``gate_block``); with ``[gate | up]`` rows it works but reshuffles every step: warn."""
    n = _axis_size(mesh, tensor_axis)
    if n == 1:
        return
    is_mlp = lambda x: isinstance(x, FusedMLP)  # noqa: E731
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_mlp)
    for p, mlp in flat:
        path = _path_str(p)
        fc1 = f"{path}.fc1" if path else "fc1"
        if not is_mlp(mlp) or not ACTIVATIONS[mlp.activation][1]:
            continue
        if not _matches(fc1, column_parallel):
            continue
        if mlp.gate_block is None:
            warnings.warn(
                f"shard_model: FusedMLP {path or '(root)'!r} stores fc1 as [gate | up], so a "
                f"column split over {tensor_axis!r} puts gates and ups on different devices "
                "and XLA reshuffles them at every step; convert it with "
                "mlp.with_gate_block(64) (or build it with gate_block=64) first.",
                stacklevel=3,
            )
        elif mlp.ffn % (n * mlp.gate_block):
            raise ValueError(
                f"shard_model: layer {fc1!r}: ffn={mlp.ffn} does not split into whole "
                f"gate_block={mlp.gate_block} pairs over mesh axis {tensor_axis!r} of size {n}; "
                f"use a gate_block dividing ffn / {n}."
            )


def _expert_placements(model: Any, mesh: Mesh, axis: str | None) -> dict[int, NamedSharding]:
    """Each `GroupedLinear` weight ``[*stack, E, in, out]`` sharded over ``axis`` along E."""
    if axis is None:
        return {}
    is_grouped = lambda x: isinstance(x, GroupedLinear)  # noqa: E731
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_grouped)
    n, out = _axis_size(mesh, axis), {}
    for p, layer in flat:
        if not is_grouped(layer):
            continue
        w = layer.weight
        if w.shape[-3] % n:
            raise ValueError(
                f"shard_model: layer {_path_str(p)!r}: num_experts={w.shape[-3]} "
                f"(weight {tuple(w.shape)}) is not divisible by mesh axis {axis!r} of size {n}."
            )
        out[id(w)] = NamedSharding(mesh, P(*(None,) * (w.ndim - 3), axis, None, None))
        state = layer.fp8_state
        if state is not None:  # per-expert kernel state goes with its experts
            for a in (state.kernel_scale, state.kernel_amax_history):
                out[id(a)] = NamedSharding(mesh, P(*(None,) * (a.ndim - 1), axis))
    if not out:
        raise ValueError("shard_model: expert_axis is set but the model has no GroupedLinear.")
    return out


def _record_experts(model: Any, experts: ExpertSharding) -> Any:
    """Every `GroupedLinear` runs its FP8 GEMMs per device on its own experts."""
    is_grouped = lambda x: isinstance(x, GroupedLinear)  # noqa: E731
    return jax.tree_util.tree_map(
        lambda x: x.with_expert_sharding(experts) if is_grouped(x) else x,
        model,
        is_leaf=is_grouped,
    )


def set_fsdp_axes(axes: Sequence[str]) -> None:
    """Mesh axis names meaning FSDP for weights placed by the user (default ``("fsdp",)``):
    an FP8 layer whose weight is sharded over one of them all-gathers its FP8 copy over
    it before the GEMM (`fp8jax._ops.fsdp`). Read when a step is traced (and part of its cache
    key): set it first. For the whole process, every thread and notebook cell; `fsdp_axes`
    sets them for a ``with`` block.

    Arguments:
        axes: the mesh axis names (strings).

    Returns:
        None.
    """
    fsdp.set_axes(axes, "set_fsdp_axes")


def fsdp_axes(axes: Sequence[str]) -> contextlib.AbstractContextManager:
    """`set_fsdp_axes` for the steps traced inside a ``with`` block.

    Arguments:
        axes: the mesh axis names (strings).

    Returns:
        A context manager: ``with fsdp_axes(("shard",)): step(...)``.
    """
    return fsdp.axes(axes, "fsdp_axes")


def record_fsdp(model: Any, fsdp_axes: Sequence[str] = ("fsdp",)) -> Any:
    """``model`` with each FP8 linear's weight sharding recorded from its placed weight
    (a `NamedSharding`, e.g. put there by the user): a layer whose weight is sharded
    over any of ``fsdp_axes`` then casts its shard to FP8 and all-gathers the FP8
    copy (forward and backward) and reduce-scatters its gradient. Layers whose weight
    is not a placed `NamedSharding` are left as they are.

    Arguments:
        model: a model whose FP8 linears' weights are placed (``jax.device_put``).
        fsdp_axes: the mesh axes that mean FSDP.

    Returns:
        ``model`` with each placed FP8 linear's weight sharding recorded.
    """
    fsdp_axes = _names("record_fsdp", "fsdp_axes", fsdp_axes)

    def record(layer):
        if not isinstance(layer, Linear):
            return layer
        sharding = getattr(layer.weight, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            return layer
        _check_auto(sharding.mesh, "record_fsdp")
        spec = tuple(sharding.spec) + (None,) * (layer.weight.ndim - len(sharding.spec))
        ws = WeightSharding(sharding.mesh, spec[-2:], fsdp_axes)
        op = layer.dot_general.with_weight_sharding(ws)
        return eqx.tree_at(lambda lin: lin.dot_general, layer, op)

    return jax.tree_util.tree_map(record, model, is_leaf=lambda x: isinstance(x, Linear))


def fp8_state_replicated(model: Any) -> bool:
    """Whether every FP8 state array holds the same bytes on all devices that hold the
    same part of it (all devices for replicated state; those of one expert shard for a
    per-expert state sharded with its experts): the check that the state stayed
    bit-identical across devices after sharded steps.

    Arguments:
        model: a model placed on a mesh (reads every shard: one transfer per array).

    Returns:
        True where every copy agrees.
    """
    import numpy as np

    flat = jax.tree_util.tree_leaves(
        eqx.filter(
            model,
            lambda x: isinstance(x, OverwriteWithGradient),
            is_leaf=lambda x: isinstance(x, OverwriteWithGradient),
        )
    )
    for leaf in flat:
        parts: dict[str, bytes] = {}
        for s in leaf.addressable_shards:
            data = np.asarray(s.data)
            if parts.setdefault(str(s.index), data.tobytes()) != data.tobytes():
                return False
    return True


# Public here too.
sequence_parallel = _sequence.sequence_parallel
sequence_sharding = _sequence.sequence_sharding
