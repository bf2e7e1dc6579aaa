"""Megatron sequence parallelism around a tensor-parallel FP8 linear, by sharding constraints.

Outside a tensor-parallel pair the activations' tokens are split over the tensor axis
(norms, residual adds and dropout then run on ``1/tp`` of the tokens). The transitions
are the linear's, and each is pinned with a constraint pair (sharded -> gathered, or
partial -> sharded) so XLA moves exactly what is named, never its own choice:

================  ==========================================  ============================
layer             forward                                     backward
================  ==========================================  ============================
column-parallel   all-gather the FP8 input (e4m3, 1 B/elt)    all-gather the FP8 input's
                                                              transposed copy for wgrad;
                                                              reduce-scatter dgrad (x dtype)
row-parallel      reduce-scatter the output (its dtype)       all-gather the FP8 output
                                                              gradient, both layouts (e5m2)
================  ==========================================  ============================

Gathers move FP8: each device casts its own tokens with the global scale (the amax is a
scalar all-reduce), so the gathered copy is what one device would have cast. The
reductions stay in the GEMM's output dtype: FP8 partial sums would add a rounding per
device and need a scale known before the sum. The input's transposed copy is kept
sharded between forward and backward (``1/tp`` of the residual) and gathered again,
as Megatron-LM does with its input.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


class SequenceParallel(NamedTuple):
    """Static description of one sequence-parallel linear (hashable)."""

    mesh: jax.sharding.Mesh
    kind: str  # "column" (gathers its input) or "row" (scatters its output)
    batch: tuple[str, ...]  # mesh axes the batch is split over (tokens' major part)
    axis: str  # the tensor axis: tokens are split over it outside the pair


def _rows_entry(sp: SequenceParallel, split: bool):
    axes = (*sp.batch, sp.axis) if split else sp.batch
    return axes or None


def constrain(sp: SequenceParallel, a: jax.Array, rows_dim: int, split: bool, tensor_dim=None):
    """``a`` pinned to tokens (dim ``rows_dim``) split over the batch axes and, when
    ``split``, the tensor axis; dim ``tensor_dim`` (if given) split over the tensor axis."""
    entries: list = [None] * a.ndim
    entries[rows_dim] = _rows_entry(sp, split)
    if tensor_dim is not None:
        entries[tensor_dim] = sp.axis
    return jax.lax.with_sharding_constraint(a, NamedSharding(sp.mesh, P(*entries)))


def gather(sp: SequenceParallel | None, a: jax.Array, rows_dim: int) -> jax.Array:
    """All-gather ``a``'s tokens over the tensor axis (the identity without ``sp``)."""
    if sp is None:
        return a
    return constrain(sp, constrain(sp, a, rows_dim, True), rows_dim, False)


def gather_scaled(sp: SequenceParallel | None, data, scale, rows_dim: int):
    """`gather` of FP8 ``data`` and of its ``scale`` where the scale has one entry per token
    (row- and block-wise recipes; a per-tensor scale is already the same everywhere)."""
    if sp is None:
        return data, scale
    per_token = scale.ndim == data.ndim and scale.shape[rows_dim] == data.shape[rows_dim]
    return gather(sp, data, rows_dim), gather(sp, scale, rows_dim) if per_token else scale


def scatter(sp: SequenceParallel | None, a: jax.Array, rows_dim: int) -> jax.Array:
    """Pin a partial sum over the tensor axis to tokens split over it: a reduce-scatter."""
    return a if sp is None else constrain(sp, a, rows_dim, True)


def pin_operands(sp: SequenceParallel | None, x, w_nk):
    """A row-parallel GEMM's operands pinned to contract over the tensor axis (``x
    [B, M, K/tp]``, ``w [B, N, K/tp]``): the partitioner then sums partial products
    instead of moving an operand."""
    if sp is None or sp.kind != "row":
        return x, w_nk
    w_nk = jax.lax.with_sharding_constraint(w_nk, NamedSharding(sp.mesh, P(None, None, sp.axis)))
    return constrain(sp, x, 1, False, tensor_dim=2), w_nk


def of_kind(sp: SequenceParallel | None, kind: str) -> SequenceParallel | None:
    """``sp`` when it is a ``kind`` layer, else None."""
    return sp if sp is not None and sp.kind == kind else None
