"""Megatron sequence parallelism for placed FP8 layers: which layers gather their tokens
and which scatter them (`fp8jax._ops.sequence_parallel` moves them), and how activations
between them are split. `fp8jax.distributed` re-exports the public functions."""

from __future__ import annotations

from typing import Any, Sequence

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding

from ._convert import _path_str
from ._dot_general import Fp8DotGeneral
from ._ops import fsdp
from ._ops.dot import WeightSharding
from ._ops.sequence_parallel import SequenceParallel, activation_spec
from ._ops.tp_ring import OVERLAPS
from ._placement import _axis_size, _check_mesh, _kinds, _names


def sequence_sharding(
    mesh: Mesh,
    shape: Sequence[int],
    batch_axes: Sequence[str] = ("data", "fsdp"),
    tensor_axis: str = "tensor",
) -> NamedSharding:
    """The sharding of a ``[batch, seq, ...]`` activation between sequence-parallel layers
    (``shard_model(..., sequence_parallel=True)``): its tokens split as those layers split
    their rows. Put it on the residual stream with ``jax.lax.with_sharding_constraint``.
    With one sequence per batch shard that is the sequence dim over ``tensor_axis``
    (Megatron's split); with several, the batch dim over the batch axes and the tensor
    axis. Raises ``ValueError`` naming the shape and axis when neither divides.

    Arguments:
        mesh: the Auto-axes mesh the layers were placed on.
        shape: the activation's shape, ``[batch, seq, ...]``.
        batch_axes: the mesh axes the batch is split over.
        tensor_axis: the tensor-parallel axis.

    Returns:
        The ``NamedSharding`` to constrain the activation to.
    """
    batch = _sequence_axes("sequence_sharding", mesh, tensor_axis, batch_axes)
    return NamedSharding(mesh, activation_spec(mesh, tuple(shape), batch, tensor_axis))


def _sequence_axes(fn: str, mesh, tensor_axis, batch_axes) -> tuple[str, ...]:
    """The batch axes of a sequence-parallel token split on ``mesh``, checked: an Auto
    mesh holding ``tensor_axis`` and ``batch_axes`` (names; default every other axis)."""
    _check_mesh(fn, mesh)
    if tensor_axis is None:
        raise ValueError(f"{fn}: tensor_axis must name a mesh axis.")
    _axis_size(mesh, tensor_axis, fn)
    return _batch_axes(mesh, _names(fn, "batch_axes", batch_axes, allow_none=True), tensor_axis, fn)


def _batch_axes(mesh: Mesh, batch_axes, tensor_axis: str, fn="shard_model") -> tuple[str, ...]:
    if batch_axes is None:
        return tuple(a for a in mesh.axis_names if a != tensor_axis)
    batch = tuple(batch_axes)
    for a in batch:
        _axis_size(mesh, a, fn)
    if tensor_axis in batch:
        raise ValueError(f"{fn}: batch_axes {batch} must not hold the tensor axis.")
    return batch


def sequence_parallel(
    model: Any,
    mesh: Mesh,
    column_parallel: Sequence[str],
    row_parallel: Sequence[str],
    tensor_axis: str = "tensor",
    batch_axes: Sequence[str] | None = None,
    tp_overlap: str = "none",
) -> Any:
    """Megatron sequence parallelism for a model whose weights are already placed on
    ``mesh`` (``jax.device_put``, ``hax.shard`` with an axis mapping, or `shard_model`):
    each FP8 layer matching ``column_parallel`` all-gathers its FP8 input's tokens over
    ``tensor_axis``, each matching ``row_parallel`` reduce-scatters its output
    (`fp8jax._ops.sequence_parallel`). A layer is any module whose ``dot_general`` is an
    `Fp8DotGeneral` (converted equinox and ``haliax.nn.Linear`` layers), named by its
    attribute path (``"up"``, ``"blocks.mlp.fc1"``; fnmatch patterns). Between those
    layers the activations' tokens must be split as `sequence_sharding` says (with the
    same ``batch_axes``; default here, as in `shard_model`: every mesh axis but
    ``tensor_axis``). A layer needs a ``weight`` attribute; a weight without a recorded
    sharding is gathered over the FSDP axes `set_fsdp_axes` names at this call.
    ``tp_overlap="ring"`` or ``"chunks"``: each layer's FP8 GEMMs run as collective
    matmuls, the tokens moved in chunks beside the GEMMs (`fp8jax._ops.tp_ring`) instead
    of whole before or after them.

    Arguments:
        model: a model whose FP8 layers' weights are placed on ``mesh``.
        mesh: the Auto-axes mesh.
        column_parallel: paths (or fnmatch patterns) of the column-parallel layers.
        row_parallel: paths (or patterns) of the row-parallel layers.
        tensor_axis: the mesh axis the pairs split their weights over.
        batch_axes: the mesh axes the tokens are split over outside the pairs (None:
            every axis but ``tensor_axis``).
        tp_overlap: ``"none"`` (whole collectives), ``"ring"`` or ``"chunks"`` (collective
            matmul).

    Returns:
        ``model`` with each matched layer's token movement recorded.

    Raises ``ValueError`` naming the layer when a pattern matches no layer, a layer is
    both, or its weight is not placed on ``mesh`` with the tensor axis on its output dims
    (column) or input dims (row)."""
    fn = "sequence_parallel"
    check_overlap(fn, tp_overlap)
    batch = _sequence_axes(fn, mesh, tensor_axis, batch_axes)
    column_parallel = _names(fn, "column_parallel", column_parallel)
    row_parallel = _names(fn, "row_parallel", row_parallel)
    layers = dict(_fp8_layers(model))
    kinds = _kinds(fn, list(layers), column_parallel, row_parallel, "FP8 layer")
    for path, kind in kinds.items():
        _check_split(path, layers[path], kind, mesh, tensor_axis)
    return _record_sequence(model, mesh, kinds, batch, tensor_axis, tp_overlap, fn)


def check_overlap(fn: str, tp_overlap, sequence_parallel: bool = True) -> None:
    """``tp_overlap`` is one of `OVERLAPS`, and other than ``"none"`` only with
    ``sequence_parallel`` (it moves sequence-parallel tokens: without them it would be
    ignored); raises ``ValueError`` naming ``fn`` otherwise."""
    if tp_overlap not in OVERLAPS:
        raise ValueError(f"{fn}: tp_overlap must be one of {OVERLAPS}, got {tp_overlap!r}.")
    if tp_overlap != "none" and not sequence_parallel:
        raise ValueError(
            f"{fn}: tp_overlap={tp_overlap!r} moves sequence-parallel tokens; it needs "
            "sequence_parallel."
        )


def check_overlap_recipe(fn: str, tp_overlap: str, recipe, where: str) -> None:
    """A ring or chunks (`fp8jax._ops.tp_ring.applies`) takes per-tensor recipes only: the
    row- and block-wise recipes' per-token scales would have to travel with their chunks.
    Raises ``ValueError`` naming ``fn`` and the layer (``where``) rather than let the layer
    move its tokens whole without a word."""
    if tp_overlap != "none" and not recipe.per_tensor_scale:
        raise ValueError(
            f"{fn}: tp_overlap={tp_overlap!r} takes per-tensor recipes only; {where} uses "
            f"{type(recipe).__name__} (use tp_overlap='none', or a per-tensor recipe)."
        )


def _fp8_layers(model: Any) -> list[tuple[str, Any]]:
    """(path, layer) of every module holding an `Fp8DotGeneral` as its ``dot_general``."""

    def is_layer(x):
        return isinstance(getattr(x, "dot_general", None), Fp8DotGeneral) and hasattr(x, "weight")

    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_layer)
    return [(_path_str(p), x) for p, x in flat if is_layer(x)]


def _placed(path: str, layer, mesh: Mesh) -> tuple[tuple, int]:
    """A layer's weight PartitionSpec entries per layer (stack dims dropped) and the number
    of stack dims, checked to be placed on ``mesh`` itself."""
    weight = getattr(layer.weight, "array", layer.weight)  # a haliax NamedArray's array
    sharding = getattr(weight, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh != mesh:
        raise ValueError(
            f"sequence_parallel: layer {path!r}: its weight {tuple(weight.shape)} is not placed "
            f"on this mesh (sharding: {sharding}); place it first on the same Mesh "
            "(shard_model, hax.shard, jax.device_put)."
        )
    spec = tuple(sharding.spec) + (None,) * (weight.ndim - len(sharding.spec))
    stack = layer.dot_general.input_scale.ndim - 1
    return spec[stack:], stack


def _out_in_dims(layer, stack: int, ndim: int) -> tuple[list[int], list[int]]:
    """Which per-layer weight dims are outputs and which inputs: a haliax layer names them
    (``Out``, ``In``); fp8jax's and equinox's weights are ``[out, in]``."""
    axes = getattr(layer.weight, "axes", None)
    if axes is None or not hasattr(layer, "Out"):
        return [ndim - 2], [ndim - 1]
    outs = {a.name for a in (layer.Out if isinstance(layer.Out, tuple) else (layer.Out,))}
    names = [a.name for a in axes][stack:]
    return [i for i, n in enumerate(names) if n in outs], [
        i for i, n in enumerate(names) if n not in outs
    ]


def _check_split(path: str, layer, side: str, mesh: Mesh, tensor_axis: str) -> None:
    """The layer's weight has the tensor axis on its output dims (column) or input dims
    (row): else XLA would move the weight at every step, or the layer is not split."""
    spec, stack = _placed(path, layer, mesh)
    outs, ins = _out_in_dims(layer, stack, len(spec))

    def split(dims):
        return any(
            tensor_axis in (e if isinstance(e, tuple) else (e,))
            for e in map(spec.__getitem__, dims)
        )

    if not split(outs if side == "column" else ins):
        where = "output" if side == "column" else "input"
        raise ValueError(
            f"sequence_parallel: {side}-parallel layer {path!r}: its weight's {where} dims are "
            f"not split over {tensor_axis!r} (per-layer spec {spec}); a {side}-parallel layer "
            f"splits its {where} features."
        )


def _placed_sharding(path: str, layer, mesh: Mesh) -> WeightSharding:
    """The `WeightSharding` of a layer's placed weight, gathered over the FSDP axes
    (`set_fsdp_axes`) as the unrecorded path would."""
    spec, _ = _placed(path, layer, mesh)
    return WeightSharding(mesh, spec, tuple(a for a in fsdp.current_axes() if a in mesh.shape))


def _record_sequence(
    model, mesh, kinds: dict[str, str], batch, tensor_axis, overlap, fn: str
) -> Any:
    """Each FP8 layer in ``kinds`` (path -> "column"/"row") moves its tokens as Megatron's
    sequence parallelism does (`fp8jax._ops.sequence_parallel`); ``fn`` names the caller
    in errors (`check_overlap_recipe`)."""
    layers = dict(_fp8_layers(model))
    new = {}
    for path, kind in kinds.items():
        layer = layers.get(path)
        if layer is None:  # not an FP8 layer (shard_model also places plain linears)
            continue
        op = layer.dot_general
        check_overlap_recipe(fn, overlap, op.config.recipe, f"layer {path!r}")
        ws = op.weight_sharding or _placed_sharding(path, layer, mesh)
        sp = SequenceParallel(mesh, kind, batch, tensor_axis, overlap)
        new[id(layer)] = op.with_weight_sharding(ws._replace(sequence=sp))

    def record(layer):
        if id(layer) not in new:
            return layer
        return eqx.tree_at(lambda lay: lay.dot_general, layer, new[id(layer)])

    return jax.tree_util.tree_map(record, model, is_leaf=lambda x: id(x) in new)
