"""Our kernels on a mesh, per device on its own token rows.

The Pallas and Mosaic GPU kernels are custom calls that XLA cannot partition: in a program
over several devices it would all-gather their operands and run them on whole arrays on
every device (`fp8jax._kernels.dispatch.unpartitioned_reason` keeps them out of such
programs). Most of what they do is local to a token row, though: casting an activation's
``1 x 128`` tiles or, with a scale known before it, the whole tensor (delayed per-tensor
scaling), a GEMM whose token dim is free, an elementwise activation. Where a layer
knows its mesh (placed by `fp8jax.shard_model`: data parallel, FSDP), `on_rows` runs such a
call under ``shard_map`` over the token split, and reduces what is not local: an amax by
``pmax`` (every device then scales alike; the row-wise recipe's column amaxes, one per
feature over all tokens, likewise), a GEMM contracting the tokens (the wgrad) by ``psum``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from .._kernels import dispatch
from .._kernels import gemm as _gemm


class RowSplit(NamedTuple):
    """Token rows split over ``axes`` of ``mesh``, in that order (hashable: a static field);
    ``features``: mesh axes that split the other dim of a ``[B, rows, cols]`` operand (a
    tensor-parallel layer's features; `on_rows` then takes 3-D operands only)."""

    mesh: jax.sharding.Mesh
    axes: tuple[str, ...]
    features: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes)


class Dims(NamedTuple):
    """An `on_rows` operand's two split dims: ``token`` over ``RowSplit.axes``, ``feature``
    over ``RowSplit.features`` (one leaf of ``out_dims``, not a pytree of two)."""

    token: int
    feature: int


def splits_features(ws) -> bool:
    """Whether a layer placed as ``ws`` (`fp8jax._ops.dot.WeightSharding`) is tensor or
    sequence parallel: its weight split over a mesh axis it does not all-gather, or its
    tokens moved between the tensor-parallel devices."""
    if ws is None:
        return False
    if ws.sequence is not None:
        return True
    return any(
        axis is not None and axis not in ws.gather and ws.mesh.shape[axis] > 1
        for entry in ws.spec
        for axis in (entry if isinstance(entry, tuple) else (entry,))
    )


def of_weight(ws) -> RowSplit | None:
    """The token split of a layer whose weight was placed as ``ws`` (`fp8jax._ops.dot.
    WeightSharding`): every mesh axis of size > 1, when the program spans several devices
    outside a ``shard_map`` (else None: the kernels run as they are). None too for a
    tensor- or sequence-parallel layer (its features or tokens move between devices: the
    XLA path partitions it)."""
    if ws is None or splits_features(ws) or dispatch.unpartitioned_reason() is None:
        return None
    return RowSplit(ws.mesh, tuple(a for a in ws.mesh.axis_names if ws.mesh.shape[a] > 1))


def sequence_splits(sp) -> tuple[RowSplit, RowSplit]:
    """``(tokens, features)`` under Megatron sequence parallelism (``sp``: a layer's
    `fp8jax._ops.sequence_parallel.SequenceParallel`): the split of an activation outside
    the tensor-parallel pair (its tokens over the batch axes and the tensor axis) and of one
    inside it (its tokens over the batch axes, its features over the tensor axis)."""
    return RowSplit(sp.mesh, (*sp.batch, sp.axis)), RowSplit(sp.mesh, sp.batch, (sp.axis,))


def sequence_casts(sp, recipe) -> bool:
    """Whether a sequence-parallel layer (``sp``; None: not one) casts per device on
    `sequence_splits` (`fp8jax._kernels.gemm.Tuning.sequence_cast`): in a program over
    several devices outside ``shard_map``, without the ppermute ring (`fp8jax._ops.tp_ring`
    moves its own; its chunked collectives take the same per-device casts), for delayed
    per-tensor scaling (a row-wise cast's row scale spans the features the tensor axis
    splits)."""
    return (
        sp is not None
        and sp.overlap in ("none", "chunks")
        and recipe.per_device_casts
        and recipe.per_tensor_scale
        and not recipe.per_device_rows
        and _gemm.current_tuning().sequence_cast
        and dispatch.unpartitioned_reason() is not None
    )


def on_rows(rows: RowSplit | None, fn: Callable, args: tuple, in_dims: tuple, out_dims: Any):
    """``fn(*args)`` per device on its token rows. ``in_dims``: each arg's token dim (None:
    the whole array on every device). ``out_dims``: a pytree like ``fn``'s output with,
    per array, its token dim, ``"max"`` (an amax: ``pmax``) or ``"sum"`` (a partial sum
    over the tokens: ``psum``). With ``rows.features`` a token dim of 1 or 2 names a
    ``[B, rows, cols]`` array whose other dim is split over those axes, a `Dims` any
    array's two split dims, and the reductions span both splits. A plain call when ``rows``
    is None."""
    if rows is None:
        return fn(*args)
    every = (*rows.axes, *rows.features)

    def spec(dim):
        if isinstance(dim, int) and rows.features:  # [B, rows, cols]: the other dim's
            if dim not in (1, 2):
                raise ValueError(f"on_rows: a feature split needs [B, rows, cols], got dim {dim}.")
            dim = Dims(dim, 3 - dim)
        if isinstance(dim, Dims):
            entries: list = [None] * (max(dim) + 1)
            entries[dim.token], entries[dim.feature] = rows.axes or None, rows.features or None
            return P(*entries)
        return P(*(None,) * dim, rows.axes) if isinstance(dim, int) else P()

    def reduce(out, dim):
        if dim == "max":
            return jax.lax.pmax(out, every)
        if dim == "sum":
            return jax.lax.psum(out, every)
        return out

    def local(*local_args):
        return jax.tree.map(reduce, fn(*local_args), out_dims)

    return jax.shard_map(
        local,
        mesh=rows.mesh,
        in_specs=tuple(spec(d) for d in in_dims),
        out_specs=jax.tree.map(spec, out_dims, is_leaf=lambda d: isinstance(d, Dims)),
        check_vma=False,
    )(*args)
