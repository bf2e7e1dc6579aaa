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
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

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
