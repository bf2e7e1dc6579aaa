"""The grouped (per-expert) GEMMs on the padded row layout (`fp8jax._ops.group_layout`):
the Pallas Mosaic-GPU kernels (`fp8jax._kernels.grouped_gemm`) or the plain-JAX reference,
by backend, with their tile choices.

* rows    ``[M_pad, K] x [G, N, K] -> [M_pad, N]`` (forward, dgrad), times ``scales[g]``
* wgrad   ``[K, M_pad] x [N, M_pad] -> [G, K, N]``, each group over its own rows

Below the custom VJPs (`fp8jax._ops.grouped`, which re-exports the public names), their
row- and block-wise path (`fp8jax._ops.grouped_tiled`) and expert parallelism
(`fp8jax._ops.expert_parallel`), which all run these GEMMs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._kernels import dispatch
from .._kernels import grouped_gemm as gk
from . import traced as _traced
from .group_layout import GroupLayout

GROUPED_SCOPE = (
    "fp8jax_grouped_gemm"  # named scope around the grouped-GEMM kernels (in HLO metadata)
)

F32 = jnp.float32
BACKENDS = ("auto", "pallas", "reference")


def _kernel_reason(layout: GroupLayout, k: int, n: int, dtype, per_device: bool = False) -> str:
    ok, why = gk.available()
    if not ok:
        return why
    why = None if per_device else dispatch.unpartitioned_reason()
    if why:
        return why
    if layout.align % gk.ROW_ALIGN:
        return (
            f"the layout's groups are aligned to {layout.align} rows, "
            f"the kernel needs {gk.ROW_ALIGN}"
        )
    m, g = layout.num_rows, layout.num_groups
    fwd_rows, wgrad_cfg = kernel_configs(
        dtype, g, (m, k, n)
    )  # the keys `rows_gemm` / `wgrad_gemm` look up
    dgrad_rows, _ = kernel_configs(dtype, g, (m, n, k))
    return (
        gk.rows_supported(m, k, n, fwd_rows)
        or gk.rows_supported(m, n, k, dgrad_rows)
        or gk.wgrad_supported(m, k, n, wgrad_cfg)
    )


def check_backend(backend: str, owner: str = "grouped GEMM") -> str:
    """``backend`` if it is one of `BACKENDS` (`fp8jax._kernels.dispatch`'s names accepted
    too), else a ValueError naming ``owner``."""
    dispatch.check(owner, backend, BACKENDS)
    return backend


def resolve_backend(
    backend: str, layout: GroupLayout, k: int, n: int, dtype, per_device: bool = False
) -> str:
    """``"pallas"`` or ``"reference"`` for a GEMM set of sizes ``[M_pad, k] x [G, k, n]``
    (`fp8jax._kernels.dispatch.choose`). ``per_device``: the GEMMs run inside a shard_map
    over every mesh axis (the block GEMMs of `fp8jax._ops.expert_parallel`), where the
    kernels see their own shard; ``layout`` then gives one device's sizes."""
    why = _kernel_reason(layout, k, n, dtype, per_device) or None
    chosen = dispatch.choose("grouped GEMM", backend, why, BACKENDS)
    return "pallas" if chosen == "kernel" else "reference"


# Tile choices measured on H100 (benchmarks/RESULTS.md, grouped_gemm sweep); `tune`
# can override them per shape.
_TUNED: dict[tuple, tuple[gk.RowsConfig, gk.WgradConfig]] = {}


def kernel_configs(dtype, num_groups: int, shape: tuple[int, int, int] | None = None):
    """(rows, wgrad) kernel configs for operands of ``dtype``: pinned for this shape,
    else pinned for any shape, else the measured defaults."""
    for key in (
        (jnp.dtype(dtype).name, num_groups, shape),
        (jnp.dtype(dtype).name, num_groups, None),
    ):
        if key in _TUNED:
            return _TUNED[key]
    fp8 = jnp.dtype(dtype).itemsize == 1
    tile_k = 128 if fp8 else 64
    rows = gk.RowsConfig(
        tile_k=tile_k,
        max_concurrent_steps=3 if fp8 else 4,
        grid_tile_width=8 if num_groups <= 16 or fp8 else 16,
    )
    wgrad = gk.WgradConfig(block_k=tile_k, max_concurrent_steps=6)
    return rows, wgrad


def set_kernel_configs(
    dtype, num_groups: int, rows: gk.RowsConfig, wgrad: gk.WgradConfig, shape=None
) -> None:
    """Pin the kernel tiles for ``dtype`` and ``num_groups``: for every shape, or for one
    ``(M_pad, K, N)`` (K: the contracting size of ``rows_gemm``; for ``wgrad_gemm`` the
    output ``[K, N]``)."""
    _TUNED[(jnp.dtype(dtype).name, num_groups, shape)] = (rows, wgrad)


def _ragged(lhs, rhs_kn, layout: GroupLayout):
    """float32 ``lhs[r] . rhs_kn[g(r)]``: ``lax.ragged_dot``, or (under ``jax.vmap``,
    which ragged_dot does not support) one masked dot per group."""
    if not _traced.under_vmap(lhs):
        return jax.lax.ragged_dot(lhs, rhs_kn, layout.padded_sizes, preferred_element_type=F32)
    group = layout.row_group()
    out = jnp.zeros((lhs.shape[0], rhs_kn.shape[-1]), F32)
    for e in range(layout.num_groups):
        out = out + jnp.where(
            (group == e)[:, None], jnp.dot(lhs, rhs_kn[e], preferred_element_type=F32), 0.0
        )
    return out


def _rows_reference(lhs, rhs_nk, layout: GroupLayout, scales, out_dtype):
    """Plain-JAX ``out[r] = scales[g] * lhs[r] . rhs_nk[g]^T`` (float32 math)."""
    out = _ragged(lhs.astype(F32), jnp.swapaxes(rhs_nk, 1, 2).astype(F32), layout)
    group = jnp.minimum(layout.row_group(), layout.num_groups - 1)
    return (out * scales[group][:, None]).astype(out_dtype)


def _wgrad_reference(lhs_t, rhs_t, layout: GroupLayout, scale, out_dtype):
    """Plain-JAX ``out[g] = scale * lhs_t[:, rows_g] . rhs_t[:, rows_g]^T``."""
    lhs, rhs = lhs_t.T.astype(F32), rhs_t.T.astype(F32)
    g, k, n = layout.num_groups, lhs.shape[1], rhs.shape[1]
    _, vjp = jax.vjp(lambda w: _ragged(lhs, w, layout), jnp.zeros((g, k, n), F32))
    (dw,) = vjp(rhs)
    return (dw * scale).astype(out_dtype)


def rows_gemm(backend, lhs, rhs_nk, layout: GroupLayout, scales, out_dtype):
    """``[M_pad, K] x [G, N, K] -> [M_pad, N]`` per group, times ``scales[g]``."""
    if backend == "pallas":
        with jax.named_scope(GROUPED_SCOPE):
            rows_cfg, _ = kernel_configs(
                lhs.dtype, layout.num_groups, (layout.num_rows, lhs.shape[1], rhs_nk.shape[1])
            )
            return gk.grouped_rows(
                lhs, rhs_nk, layout.block_group, scales, out_dtype=out_dtype, config=rows_cfg
            )
    return _rows_reference(lhs, rhs_nk, layout, scales, out_dtype)


def wgrad_gemm(backend, lhs_t, rhs_t, layout: GroupLayout, scale, out_dtype):
    """``[K, M_pad] x [N, M_pad] -> [G, K, N]``, each group over its own rows."""
    if backend == "pallas":
        with jax.named_scope(GROUPED_SCOPE):
            _, wgrad_cfg = kernel_configs(
                lhs_t.dtype, layout.num_groups, (layout.num_rows, lhs_t.shape[0], rhs_t.shape[0])
            )
            return gk.grouped_wgrad(
                lhs_t,
                rhs_t,
                layout.starts,
                layout.padded_sizes,
                scale,
                out_dtype=out_dtype,
                config=wgrad_cfg,
            )
    return _wgrad_reference(lhs_t, rhs_t, layout, scale, out_dtype)


def _per_expert_amax(w):
    return jnp.max(jnp.abs(w), axis=(1, 2)).astype(F32)
