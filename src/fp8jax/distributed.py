"""Sharded FP8 training on a `jax.sharding.Mesh` (GSPMD): place a converted model's
weights (FSDP, Megatron column/row tensor parallel), replicate its FP8 state, and
record each layer's weight sharding so its op all-gathers the weight in FP8.

Every amax is a ``jnp.max`` over a (sharded) global array, which GSPMD turns into a
scalar all-reduce: all devices quantize with the same scale and the replicated state
stays bit-identical. `hlo_collectives` lists a step's collectives with their dtypes.
"""

from __future__ import annotations

import fnmatch
import warnings
from typing import Any, Sequence

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .collectives import (  # noqa: F401  (public here too)
    Collective,
    compile_with_collectives,
    hlo_collectives,
    parse_collectives,
)
from .convert import _path_str
from .nn.linear import Linear
from .ops.dot import WeightSharding
from .ops.expert_parallel import ExpertSharding
from .state import OverwriteWithGradient


def _axis_size(mesh: Mesh, axis: str | None, fn: str = "shard_model") -> int:
    if axis is None:
        return 1
    if axis not in mesh.shape:
        raise ValueError(f"{fn}: mesh has no axis {axis!r}; its axes are {tuple(mesh.shape)}.")
    return mesh.shape[axis]


def _check_auto(mesh: Mesh, fn: str) -> None:
    """GSPMD (Auto) axes only: explicit-sharding meshes (`jax.make_mesh`'s default) need
    other constraints (`jax.sharding.reshard`), not written yet."""
    types = getattr(mesh, "axis_types", ())
    if any("Auto" not in str(t) for t in types):
        raise ValueError(
            f"{fn}: mesh axes must be Auto (GSPMD), got {tuple(map(str, types))}; build the "
            "mesh with jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) "
            "* len(names)) or jax.sharding.Mesh(devices, names)."
        )


def _matches(path: str, patterns: Sequence[str]) -> bool:
    return any(path == p or fnmatch.fnmatchcase(path, p) for p in patterns)


def _layers(model: Any) -> list[tuple[str, Any]]:
    is_layer = lambda x: isinstance(x, (Linear, eqx.nn.Linear))  # noqa: E731
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_layer)
    return [(_path_str(p), x) for p, x in flat if is_layer(x)]


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
        free = [i for i in (0, 1) if spec[i] is None]
        spec[max(free, key=lambda i: (shape[-2:][i], -i))] = fsdp_axis  # the larger dim
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
    recipe = layer.dot_general.config.recipe if isinstance(layer, Linear) else None
    return recipe.block_size if getattr(recipe, "kind", None) == "blockwise" else None


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
) -> Any:
    """``model`` with its arrays placed on ``mesh``: each linear weight sharded over
    ``fsdp_axis`` along its larger dim (FSDP) and, for layers whose dotted path matches
    ``column_parallel`` / ``row_parallel`` (names or fnmatch patterns), over
    ``tensor_axis`` along out / in (Megatron; a column-parallel bias too); everything
    else, the FP8 state included, replicated. ``expert_axis``: shard every
    `fp8jax.nn.GroupedLinear`'s experts (``weight [E, in, out]`` along ``E``; MoE expert
    parallel), else replicate them. ``fp8_all_gather``: record the sharding
    in each FP8 layer so it casts its shard and all-gathers FP8 (`record_fsdp`).

    ``sequence_parallel``: Megatron sequence parallelism (`fp8jax.ops.sequence_parallel`).
    Outside the tensor-parallel layers the tokens are split over ``batch_axes`` (default:
    every mesh axis but ``tensor_axis``) and then ``tensor_axis``, as the user's own
    sharding constraints on the activations say; each column-parallel layer all-gathers
    its FP8 input's tokens, each row-parallel one reduce-scatters its output.

    Raises ``ValueError`` naming the layer, the dim and the axis when an axis size does
    not divide the dim it shards, or when a pattern matches no layer.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"shard_model: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}."
        )
    _check_auto(mesh, "shard_model")
    _axis_size(mesh, fsdp_axis)
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
    for what, patterns in (("column_parallel", column_parallel), ("row_parallel", row_parallel)):
        for p in patterns:
            if not any(_matches(path, [p]) for path, _ in layers):
                raise ValueError(
                    f"shard_model: {what} pattern {p!r} matches no linear layer; layers are: "
                    + ", ".join(path for path, _ in layers)
                )
    _check_gated_splits(model, mesh, tensor_axis, column_parallel)
    placements: dict[int, NamedSharding] = _expert_placements(model, mesh, expert_axis)
    kinds: dict[str, str] = {}  # path -> "column" / "row" of the tensor-parallel layers
    for path, layer in layers:
        col, row = _matches(path, column_parallel), _matches(path, row_parallel)
        if col and row:
            raise ValueError(f"shard_model: layer {path!r} is both column- and row-parallel.")
        if col or row:
            kinds[path] = "column" if col else "row"
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
    replicated = NamedSharding(mesh, P())

    def place(x):
        if not eqx.is_array(x):
            return x
        return jax.device_put(x, placements.get(id(x), replicated))

    model = jax.tree_util.tree_map(place, model)
    if expert_axis is not None:
        model = _record_experts(model, ExpertSharding(mesh, expert_axis))
    gather = (fsdp_axis,) if fsdp_axis and fp8_all_gather else ()
    if fp8_all_gather or sequence_parallel:
        model = record_fsdp(model, gather)
    if sequence_parallel:
        batch = _batch_axes(mesh, batch_axes, tensor_axis)
        model = _record_sequence(model, mesh, kinds, batch, tensor_axis)
    return model


def _check_gated_splits(model: Any, mesh: Mesh, tensor_axis, column_parallel) -> None:
    """A column-parallel gated `FusedMLP` fc1 must split into whole gate/up pairs
    (``gate_block``); with ``[gate | up]`` rows it works but reshuffles every step: warn."""
    from .nn.mlp import ACTIVATIONS, FusedMLP

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
    axis. Raises ``ValueError`` naming the shape and axis when neither divides."""
    from .ops.sequence_parallel import activation_spec

    batch = _batch_axes(mesh, batch_axes, tensor_axis)
    _axis_size(mesh, tensor_axis)
    return NamedSharding(mesh, activation_spec(mesh, tuple(shape), batch, tensor_axis))


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
) -> Any:
    """Megatron sequence parallelism for a model whose weights are already placed on
    ``mesh`` (``jax.device_put``, ``hax.shard`` with an axis mapping, or `shard_model`):
    each FP8 layer matching ``column_parallel`` all-gathers its FP8 input's tokens over
    ``tensor_axis``, each matching ``row_parallel`` reduce-scatters its output
    (`fp8jax.ops.sequence_parallel`). A layer is any module whose ``dot_general`` is an
    `Fp8DotGeneral` (converted equinox and ``haliax.nn.Linear`` layers), named by its
    attribute path (``"up"``, ``"blocks.mlp.fc1"``; fnmatch patterns). Between those
    layers the activations' tokens must be split as `sequence_sharding` says (with the
    same ``batch_axes``; default here, as in `shard_model`: every mesh axis but
    ``tensor_axis``). A layer needs a ``weight`` attribute; a weight without a recorded
    sharding is gathered over the FSDP axes `set_fsdp_axes` names at this call.

    Raises ``ValueError`` naming the layer when a pattern matches no layer, a layer is
    both, or its weight is not placed on ``mesh`` with the tensor axis on its output dims
    (column) or input dims (row)."""
    fn = "sequence_parallel"
    _check_auto(mesh, fn)
    if tensor_axis is None:
        raise ValueError(f"{fn}: tensor_axis must name a mesh axis.")
    _axis_size(mesh, tensor_axis, fn)
    layers = dict(_fp8_layers(model))
    kinds: dict[str, str] = {}
    for kind, patterns in (("column", column_parallel), ("row", row_parallel)):
        for p in patterns:
            hits = [path for path in layers if _matches(path, [p])]
            if not hits:
                raise ValueError(
                    f"sequence_parallel: {kind}_parallel pattern {p!r} matches no FP8 layer; "
                    "layers are: " + ", ".join(layers)
                )
            for path in hits:
                if kinds.setdefault(path, kind) != kind:
                    raise ValueError(f"sequence_parallel: layer {path!r} is both column and row.")
    batch = _batch_axes(mesh, batch_axes, tensor_axis, fn)
    for path, kind in kinds.items():
        _check_split(path, layers[path], kind, mesh, tensor_axis)
    return _record_sequence(model, mesh, kinds, batch, tensor_axis)


def _fp8_layers(model: Any) -> list[tuple[str, Any]]:
    """(path, layer) of every module holding an `Fp8DotGeneral` as its ``dot_general``."""
    from .dot_general import Fp8DotGeneral

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


def _check_split(path: str, layer, kind: str, mesh: Mesh, tensor_axis: str) -> None:
    """The layer's weight has the tensor axis on its output dims (column) or input dims
    (row): else XLA would move the weight at every step, or the layer is not split."""
    spec, stack = _placed(path, layer, mesh)
    outs, ins = _out_in_dims(layer, stack, len(spec))

    def split(dims):
        return any(
            tensor_axis in (e if isinstance(e, tuple) else (e,))
            for e in map(spec.__getitem__, dims)
        )

    if not split(outs if kind == "column" else ins):
        where = "output" if kind == "column" else "input"
        raise ValueError(
            f"sequence_parallel: {kind}-parallel layer {path!r}: its weight's {where} dims are "
            f"not split over {tensor_axis!r} (per-layer spec {spec}); a {kind}-parallel layer "
            f"splits its {where} features."
        )


def _placed_sharding(path: str, layer, mesh: Mesh) -> WeightSharding:
    """The `WeightSharding` of a layer's placed weight, gathered over the FSDP axes
    (`set_fsdp_axes`) as the unrecorded path would."""
    from .ops import fsdp

    spec, _ = _placed(path, layer, mesh)
    return WeightSharding(mesh, spec, tuple(a for a in fsdp.FSDP_AXES if a in mesh.shape))


def _record_sequence(model, mesh, kinds: dict[str, str], batch, tensor_axis) -> Any:
    """Each FP8 layer in ``kinds`` (path -> "column"/"row") moves its tokens as Megatron's
    sequence parallelism does (`fp8jax.ops.sequence_parallel`)."""
    from .ops.sequence_parallel import SequenceParallel

    layers = dict(_fp8_layers(model))
    new = {}
    for path, kind in kinds.items():
        layer = layers.get(path)
        if layer is None:  # not an FP8 layer (shard_model also places plain linears)
            continue
        op = layer.dot_general
        ws = op.weight_sharding or _placed_sharding(path, layer, mesh)
        sp = SequenceParallel(mesh, kind, batch, tensor_axis)
        new[id(layer)] = _copy_with(op, "weight_sharding", ws._replace(sequence=sp))

    def record(layer):
        if id(layer) not in new:
            return layer
        return eqx.tree_at(lambda lay: lay.dot_general, layer, new[id(layer)])

    return jax.tree_util.tree_map(record, model, is_leaf=lambda x: id(x) in new)


def _expert_placements(model: Any, mesh: Mesh, axis: str | None) -> dict[int, NamedSharding]:
    """Each `GroupedLinear` weight ``[*stack, E, in, out]`` sharded over ``axis`` along E."""
    from .nn.grouped import GroupedLinear

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


def _copy_with(module: Any, name: str, value: Any) -> Any:
    """A shallow copy of an equinox module with one (static) field set."""
    new = object.__new__(type(module))
    for key, v in vars(module).items():
        object.__setattr__(new, key, v)
    object.__setattr__(new, name, value)
    return new


def _record_experts(model: Any, experts: ExpertSharding) -> Any:
    """Every `GroupedLinear` runs its FP8 GEMMs per device on its own experts."""
    from .nn.grouped import GroupedLinear

    is_grouped = lambda x: isinstance(x, GroupedLinear)  # noqa: E731
    return jax.tree_util.tree_map(
        lambda x: _copy_with(x, "expert_sharding", experts) if is_grouped(x) else x,
        model,
        is_leaf=is_grouped,
    )


def set_fsdp_axes(axes: Sequence[str]) -> None:
    """Mesh axis names meaning FSDP for weights placed by the user (default ``("fsdp",)``):
    an FP8 layer whose weight is sharded over one of them all-gathers its FP8 copy over
    it before the GEMM (`fp8jax.ops.fsdp`). Read when a step is traced: set it first."""
    from .ops import fsdp

    if isinstance(axes, str) or not all(isinstance(a, str) for a in axes):
        raise TypeError(f"set_fsdp_axes: expected a sequence of axis names, got {axes!r}.")
    fsdp.FSDP_AXES[:] = list(axes)


def record_fsdp(model: Any, fsdp_axes: Sequence[str] = ("fsdp",)) -> Any:
    """``model`` with each FP8 linear's weight sharding recorded from its placed weight
    (a `NamedSharding`, e.g. put there by the user): a layer whose weight is sharded
    over any of ``fsdp_axes`` then casts its shard to FP8 and all-gathers the FP8
    copy (forward and backward) and reduce-scatters its gradient. Layers whose weight
    is not a placed `NamedSharding` are left as they are."""
    fsdp_axes = tuple(fsdp_axes)

    def record(layer):
        if not isinstance(layer, Linear):
            return layer
        sharding = getattr(layer.weight, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            return layer
        _check_auto(sharding.mesh, "record_fsdp")
        spec = tuple(sharding.spec) + (None,) * (layer.weight.ndim - len(sharding.spec))
        ws = WeightSharding(sharding.mesh, spec[-2:], fsdp_axes)
        op = _copy_with(layer.dot_general, "weight_sharding", ws)
        return eqx.tree_at(lambda lin: lin.dot_general, layer, op)

    return jax.tree_util.tree_map(record, model, is_leaf=lambda x: isinstance(x, Linear))


def fp8_state_replicated(model: Any) -> bool:
    """Whether every FP8 state array holds the same bytes on all devices that hold the
    same part of it (all devices for replicated state; those of one expert shard for a
    per-expert state sharded with its experts)."""
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
