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
                                                              gradient (e5m2) once and
                                                              transpose it locally for
                                                              wgrad (per-tensor scale; tiled
                                                              recipes gather both layouts)
================  ==========================================  ============================

Gathers move FP8: each device casts its own tokens with the global scale (the amax is a
scalar all-reduce), so the gathered copy is what one device would have cast. The
reductions stay in the GEMM's output dtype: FP8 partial sums would add a rounding per
device and need a scale known before the sum. The input's transposed copy is kept
sharded between forward and backward (``1/tp`` of the residual) and gathered again,
as Megatron-LM does with its input. A GEMM the selection policy runs in the input
precision carries no constraints: the partitioner places it. With ``overlap="ring"`` the
FP8 GEMMs of a per-tensor recipe move the same tokens in chunks under their GEMMs instead
(`fp8jax._ops.tp_ring`).
"""

from __future__ import annotations

import math
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
    # "none": the constraint pairs here; "ring": collective matmul (`fp8jax._ops.tp_ring`)
    overlap: str = "none"


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


def pin_operands(sp: SequenceParallel | None, a, b, a_tensor_dim, b_tensor_dim: int):
    """A GEMM's operands ``a [B, M, C]`` (tokens gathered) and ``b [B, D, C]`` pinned to
    their tensor-parallel layout (dims ``a_tensor_dim`` / ``b_tensor_dim`` over the tensor
    axis; ``a_tensor_dim`` None: not split): the partitioner then multiplies the local
    blocks (summing partial products where C is split) instead of moving an operand."""
    if sp is None:
        return a, b
    spec = [None, None, None]
    spec[b_tensor_dim] = sp.axis
    b = jax.lax.with_sharding_constraint(b, NamedSharding(sp.mesh, P(*spec)))
    return constrain(sp, a, 1, False, tensor_dim=a_tensor_dim), b


def activation_spec(mesh, shape: tuple[int, ...], batch: tuple[str, ...], axis: str) -> P:
    """The PartitionSpec of a ``[batch, seq, ...]`` activation that splits its tokens the
    way the op splits its rows (flattened batch-major, over ``batch`` then ``axis``): the
    sequence dim over ``axis`` when each batch shard holds one sequence, else the batch dim
    over both (a split of the sequence dim with several local sequences is not a split of
    the flattened rows, and would cost an all-to-all at every layer)."""
    n_batch = math.prod(mesh.shape[a] for a in batch)
    tp, rest = mesh.shape[axis], (None,) * (len(shape) - 2)
    if len(shape) < 2 or shape[0] % n_batch:
        raise ValueError(
            f"sequence parallel: activation {tuple(shape)} needs [batch, seq, ...] with batch "
            f"divisible by the batch axes {batch} ({n_batch} devices)."
        )
    local = shape[0] // n_batch
    if local == 1:
        if shape[1] % tp:
            raise ValueError(
                f"sequence parallel: sequence length {shape[1]} (activation {tuple(shape)}) is "
                f"not divisible by tensor axis {axis!r} of size {tp}."
            )
        return P(batch or None, axis, *rest)
    if local % tp:
        raise ValueError(
            f"sequence parallel: {local} sequences per batch shard (activation {tuple(shape)}) "
            f"split neither as one sequence per shard nor evenly over tensor axis {axis!r} of "
            f"size {tp}."
        )
    return P((*batch, axis), None, *rest)


def sides(sp: SequenceParallel | None) -> tuple[SequenceParallel | None, ...]:
    """``(column, row)``: ``sp`` in the place of its kind, None in the other (both None
    without sequence parallelism)."""
    if sp is None:
        return None, None
    return {"column": (sp, None), "row": (None, sp)}[sp.kind]
