"""Expert parallel grouped GEMMs: each device runs the grouped GEMM on its own experts.

An MoE's experts (``W [G, ...]``) sharded over a mesh axis would leave the grouped
kernel (a custom call the SPMD partitioner cannot split) to be run on gathered weights.
Here the two GEMM shapes of `fp8jax._ops.grouped_gemms` run under ``shard_map`` instead: the
rows (every expert's, in the padded layout) come in whole, each device shifts its own
experts' rows to the front (their groups are contiguous and start at a multiple of the
row alignment), runs the kernel on its ``G / n`` local weights with the local layout,
and shifts back. Rows GEMM outputs are zero off the local groups and summed over the
axis (activation-sized, in the output dtype); weight gradients come out sharded.
All scales (and so every amax) are computed outside, over the global arrays.

With an all-to-all dispatch (`fp8jax._ops.token_dispatch`) the rows come in *blocks*
instead: ``[D * R, K]`` split over every mesh axis (``D`` devices), each device's block
holding only its own experts' rows in its own padded layout (`BlockLayout`). The block
GEMMs below run each device's kernel on its block: no shift, no psum of the rows; weight
gradients are summed over the mesh axes other than the expert axis (data parallelism).
"""

from __future__ import annotations

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Int

from . import grouped_gemms
from .group_layout import layout_from_sizes


class ExpertSharding(NamedTuple):
    """Experts (dim ``-3`` of a grouped weight) sharded over ``axis`` of ``mesh``."""

    mesh: Mesh
    axis: str


def _local_layout(layout, axis: str, per: int):
    """(local layout, row shift) of this device's ``per`` experts."""
    lo = jax.lax.axis_index(axis) * per
    sizes = jax.lax.dynamic_slice_in_dim(layout.group_sizes, lo, per)
    shift = jax.lax.dynamic_index_in_dim(layout.starts, lo, keepdims=False)
    return layout_from_sizes(sizes, layout.num_rows, layout.align), shift


def _shard_map(experts: ExpertSharding, fn, in_specs, out_specs):
    return jax.shard_map(
        fn, mesh=experts.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )


def rows_gemm(experts: ExpertSharding, backend, lhs, rhs_nk, layout, scales, out_dtype):
    """`fp8jax._ops.grouped_gemms.rows_gemm` with ``rhs_nk [G, N, K]`` and ``scales [G]`` split
    over ``experts.axis``: ``[M_pad, K] -> [M_pad, N]``, replicated."""
    n = experts.mesh.shape[experts.axis]
    per = layout.num_groups // n

    def local(lhs, rhs_nk, layout, scales):
        local_layout, shift = _local_layout(layout, experts.axis, per)
        out = grouped_gemms.rows_gemm(
            backend, jnp.roll(lhs, -shift, axis=0), rhs_nk, local_layout, scales, out_dtype
        )
        out = jnp.where(local_layout.row_valid[:, None], out, jnp.zeros((), out.dtype))
        return jax.lax.psum(jnp.roll(out, shift, axis=0), experts.axis)

    specs = (P(), P(experts.axis), P(), P(experts.axis))
    return _shard_map(experts, local, specs, P())(lhs, rhs_nk, layout, scales)


def wgrad_gemm(experts: ExpertSharding, backend, lhs_t, rhs_t, layout, scale, out_dtype):
    """`fp8jax._ops.grouped_gemms.wgrad_gemm` with each device computing its own experts'
    gradients: ``[K, M_pad] x [N, M_pad] -> [G, K, N]`` sharded over ``experts.axis``."""
    n = experts.mesh.shape[experts.axis]
    per = layout.num_groups // n

    def local(lhs_t, rhs_t, layout, scale):
        local_layout, shift = _local_layout(layout, experts.axis, per)
        return grouped_gemms.wgrad_gemm(
            backend,
            jnp.roll(lhs_t, -shift, axis=1),
            jnp.roll(rhs_t, -shift, axis=1),
            local_layout,
            scale,
            out_dtype,
        )

    specs = (P(), P(), P(), P())
    return _shard_map(experts, local, specs, P(experts.axis))(lhs_t, rhs_t, layout, scale)


# ----------------------------------------------------------------------------- blocked rows
class BlockShape(NamedTuple):
    """The sizes one device's block GEMM sees (what `grouped_gemms.resolve_backend` reads)."""

    num_rows: int
    num_groups: int
    align: int


class BlockLayout(eqx.Module):
    """Rows in device blocks: ``[D * R]`` rows split over every mesh axis, block ``d``
    holding its device's ``per = G / n`` experts in a padded layout of ``R`` rows.

    ``group_sizes [D, per]``: each block's real rows per local expert; ``row_valid
    [D * R]``: the real rows. ``num_groups`` is the layer's ``G`` experts.
    """

    group_sizes: Int[Array, "D per"]
    row_valid: Bool[Array, " DR"]
    align: int = eqx.field(static=True)
    experts: int = eqx.field(static=True)

    @property
    def num_groups(self) -> int:
        return self.experts

    @property
    def num_rows(self) -> int:
        return int(self.row_valid.shape[0])

    def block_shape(self) -> BlockShape:
        d, per = self.group_sizes.shape
        return BlockShape(self.num_rows // d, per, self.align)


def _all_axes(experts: ExpertSharding):
    return tuple(experts.mesh.axis_names)


def _block_layout(layout: BlockLayout):
    """This device's `GroupLayout` (inside the shard_map: ``group_sizes`` is ``[1, per]``)."""
    return layout_from_sizes(layout.group_sizes[0], layout.row_valid.shape[0], layout.align)


def _layout_specs(experts: ExpertSharding, layout: BlockLayout):
    """``layout``'s arrays split over every mesh axis (a spec tree of its structure)."""
    return jax.tree_util.tree_map(lambda _: P(_all_axes(experts)), layout)


def block_rows_gemm(
    experts: ExpertSharding, backend, lhs, rhs_nk, layout: BlockLayout, scales, out_dtype
):
    """`grouped_gemms.rows_gemm` per device on its block: ``lhs [D * R, K]`` and the
    output split over every mesh axis, ``rhs_nk [G, N, K]`` and ``scales [G]`` over
    ``experts.axis``."""
    every = P(_all_axes(experts))

    def local(lhs, rhs_nk, layout, scales):
        return grouped_gemms.rows_gemm(
            backend, lhs, rhs_nk, _block_layout(layout), scales, out_dtype
        )

    specs = (every, P(experts.axis), _layout_specs(experts, layout), P(experts.axis))
    return _shard_map(experts, local, specs, every)(lhs, rhs_nk, layout, scales)


def block_wgrad_gemm(
    experts: ExpertSharding, backend, lhs_t, rhs_t, layout: BlockLayout, scale, out_dtype
):
    """`grouped_gemms.wgrad_gemm` per device on its block (``[K, D * R] x [N, D * R]``),
    summed (in float32) over the mesh axes but ``experts.axis``: ``[G, K, N]`` split over it."""
    every = P(None, _all_axes(experts))
    others = tuple(a for a in _all_axes(experts) if a != experts.axis)

    def local(lhs_t, rhs_t, layout, scale):
        dtype = jnp.float32 if others else out_dtype  # partial sums added in float32
        dw = grouped_gemms.wgrad_gemm(backend, lhs_t, rhs_t, _block_layout(layout), scale, dtype)
        return jax.lax.psum(dw, others).astype(out_dtype) if others else dw

    specs = (every, every, _layout_specs(experts, layout), P())
    return _shard_map(experts, local, specs, P(experts.axis))(lhs_t, rhs_t, layout, scale)
