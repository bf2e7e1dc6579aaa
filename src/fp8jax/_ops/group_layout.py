"""The padded row layout of grouped (per-expert) GEMMs: which rows belong to which expert.

Rows are grouped by expert in a *padded layout*: group ``e`` owns rows
``[starts[e], starts[e] + padded_sizes[e])``, its real rows first, then zero rows up
to a multiple of ``align``. Rows after the last group are outside every group. Shared by
the grouped ops (`fp8jax._ops.grouped`, which re-exports it), their row- and block-wise
path (`fp8jax._ops.grouped_tiled`) and expert parallelism (`fp8jax._ops.expert_parallel`).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from .. import _guard
from .._kernels import grouped_gemm as gk

ROW_ALIGN = gk.ROW_ALIGN


class GroupLayout(eqx.Module):
    """Where each expert's rows live in the padded layout (all arrays: jit-friendly).

    ``group_sizes[e]`` real rows of expert ``e`` start at row ``starts[e]``; the group
    spans ``padded_sizes[e]`` rows (a multiple of ``align``). ``row_valid[r]`` is True
    for real rows. Rows that are not valid hold zeros on input and undefined values
    on output (the Pallas kernel skips blocks after the last group).
    """

    group_sizes: Int[Array, " G"]
    starts: Int[Array, " G"]
    padded_sizes: Int[Array, " G"]
    row_valid: Bool[Array, " M_pad"]
    block_group: Int[Array, " blocks"]
    align: int = eqx.field(static=True)

    @property
    def num_groups(self) -> int:
        return int(self.group_sizes.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.row_valid.shape[0])

    def row_group(self) -> Int[Array, " M_pad"]:
        """Group of each padded row (``G`` after the last group)."""
        ends = jnp.cumsum(self.padded_sizes)
        return jnp.searchsorted(
            ends, jnp.arange(self.num_rows, dtype=jnp.int32), side="right"
        ).astype(jnp.int32)


def padded_rows(num_rows: int, num_groups: int, align: int) -> int:
    """Static row count of a padded layout holding ``num_rows`` real rows in
    ``num_groups`` groups (worst case: every group needs ``align - 1`` padding rows)."""
    return _round_up(num_rows + num_groups * (align - 1), align) if align > 1 else num_rows


def _round_up(x, m):
    return -(-x // m) * m


def layout_from_sizes(
    group_sizes: Int[Array, " G"], num_padded_rows: int, align: int
) -> GroupLayout:
    """Padded layout for real groups of ``group_sizes`` rows in ``num_padded_rows`` rows."""
    group_sizes = jnp.asarray(group_sizes).astype(jnp.int32)
    if group_sizes.ndim != 1:
        raise ValueError(f"group_sizes must be 1-D [num_experts], got shape {group_sizes.shape}")
    padded = _round_up(group_sizes, align) if align > 1 else group_sizes
    starts = jnp.cumsum(padded) - padded
    ends = starts + padded
    rows = jnp.arange(num_padded_rows, dtype=jnp.int32)
    group = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    g = group_sizes.shape[0]
    safe = jnp.minimum(group, g - 1)
    row_valid = (group < g) & (rows - starts[safe] < group_sizes[safe])
    block = gk.ROW_ALIGN
    if num_padded_rows % block == 0:
        block_group = group[::block]
    else:
        block_group = jnp.full((0,), g, jnp.int32)
    return GroupLayout(
        group_sizes,
        starts.astype(jnp.int32),
        padded.astype(jnp.int32),
        row_valid,
        block_group,
        align,
    )


def clip_group_sizes(group_sizes: Int[Array, " G"], num_rows: int) -> Int[Array, " G"]:
    """Group sizes as used: negative sizes count as 0 and groups are cut where their
    running total passes ``num_rows`` (rows past the total belong to no group)."""
    sizes = jnp.maximum(jnp.asarray(group_sizes).astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), num_rows)
    return ends - jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])


def check_group_sizes(group_sizes, num_rows: int, num_experts: int):
    """``group_sizes``, checked: shape and dtype always; concrete sizes raise at once when
    negative or summing past ``num_rows``. Traced ones (under ``jit``; sums past the rows
    are cut at the last row, `clip_group_sizes`): with ``FP8JAX_GUARD=raise`` one
    ``eqx.error_if`` fails the call when a size is negative (a device->host sync per call);
    by default the caller poisons its output instead (`fp8jax._guard.poison_if`: NaN, no sync).

    Arguments:
        group_sizes: rows per expert, ``[num_experts]`` integers.
        num_rows: the rows of the sorted input.
        num_experts: the layer's experts.

    Returns:
        ``group_sizes`` (traced: with the runtime check attached; use this value).
    """
    shape = np.shape(group_sizes)
    if shape != (num_experts,):
        raise ValueError(
            f"group_sizes must have shape ({num_experts},) (one per expert), got {shape}"
        )
    if not jnp.issubdtype(jnp.asarray(group_sizes).dtype, jnp.integer):
        raise TypeError(f"group_sizes must be integers, got dtype {jnp.asarray(group_sizes).dtype}")
    if isinstance(group_sizes, jax.core.Tracer):
        if _guard.mode() != "raise":
            return group_sizes  # the caller poisons its output (`_guard.poison_if`)
        return eqx.error_if(
            group_sizes,
            jnp.any(group_sizes < 0),
            f"group_sizes must be >= 0 (rows per expert, summing to at most the {num_rows} "
            "rows of x_sorted); got a negative size",
        )
    sizes = np.asarray(group_sizes)
    if (sizes < 0).any():
        raise ValueError(f"group_sizes must be >= 0, got {sizes.tolist()}")
    if sizes.sum() > num_rows:
        raise ValueError(
            f"group_sizes sum to {int(sizes.sum())}, more than the {num_rows} rows of x"
        )
    return group_sizes


def source_rows(layout: GroupLayout) -> Int[Array, " M_pad"]:
    """For each padded row, the row of the unpadded (sorted) input it holds; rows
    that hold none point one past the end (a zero row)."""
    g = layout.num_groups
    group = layout.row_group()
    safe = jnp.minimum(group, g - 1)
    unpadded_starts = jnp.cumsum(layout.group_sizes) - layout.group_sizes
    rows = jnp.arange(layout.num_rows, dtype=jnp.int32)
    src = unpadded_starts[safe] + rows - layout.starts[safe]
    return jnp.where(layout.row_valid, src, _BIG).astype(jnp.int32)


_BIG = np.iinfo(np.int32).max // 2


def padded_positions(layout: GroupLayout, num_rows: int) -> Int[Array, " M"]:
    """For each unpadded (sorted) row, its row in the padded layout (rows past the
    groups' total map past the end)."""
    ends = jnp.cumsum(layout.group_sizes)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    group = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    g = layout.num_groups
    safe = jnp.minimum(group, g - 1)
    pos = layout.starts[safe] + rows - (ends[safe] - layout.group_sizes[safe])
    return jnp.where(group < g, pos, _BIG).astype(jnp.int32)


def pad_rows(x, layout: GroupLayout):
    """Sorted rows ``x [M, D]`` -> padded layout ``[M_pad, D]`` (zeros off the groups)."""
    src = source_rows(layout)
    return jnp.take(x, src, axis=0, mode="fill", fill_value=0)


def unpad_rows(y, layout: GroupLayout, num_rows: int):
    """Padded ``y [M_pad, D]`` -> sorted rows ``[M, D]`` (zeros for rows in no group)."""
    return jnp.take(y, padded_positions(layout, num_rows), axis=0, mode="fill", fill_value=0)


def _masked(x, layout: GroupLayout):
    """``x [M_pad, D]`` with the rows off the groups set to zero."""
    return jnp.where(layout.row_valid[:, None], x, jnp.zeros((), x.dtype))


def _zero_ct(a):
    """The zero cotangent of a layout leaf (``float0`` for integer and bool leaves)."""
    if jnp.issubdtype(a.dtype, jnp.integer) or a.dtype == bool:
        return np.zeros(a.shape, jax.dtypes.float0)
    return jnp.zeros_like(a)
