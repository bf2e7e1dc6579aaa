"""Grouped (per-expert) GEMMs for MoE: the aligned row layout, backends, and the FP8
and bf16 custom VJPs.

Rows are grouped by expert in a *padded layout*: group ``e`` owns rows
``[starts[e], starts[e] + padded_sizes[e])``, its real rows first, then zero rows up
to a multiple of ``align``. Rows after the last group are outside every group. The
three GEMMs of training run per group:

* forward ``y = x . W_e``  (``x [M, in]``, ``W [G, in, out]``)
* dgrad   ``dx = dy . W_e^T``
* wgrad   ``dW_e = x_e^T . dy_e``

FP8 scaling: inputs and output gradients per tensor (one scale shared by all
experts: the rows of all experts form one GEMM operand, so one cast pass and one
amax serve every group, as in Transformer Engine's per-tensor recipe); weights per
expert (``[G]`` scales, ``[history, G]`` amax histories: experts see different
numbers of tokens and drift apart, and each expert's scale is one multiply in the
kernel's epilogue).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from .. import _guard
from .. import quant as q
from .. import state as _state
from ..config import Fp8Config
from ..kernels import dispatch
from ..kernels import grouped_gemm as gk
from . import dot as _dot
from . import expert_parallel as _ep

GROUPED_SCOPE = (
    "fp8jax_grouped_gemm"  # named scope around the grouped-GEMM kernels (in HLO metadata)
)
ROW_ALIGN = gk.ROW_ALIGN

F32 = jnp.float32
BACKENDS = ("auto", "pallas", "reference")


# ----------------------------------------------------------------------------- layout
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


# ----------------------------------------------------------------------------- backends
def _kernel_reason(layout: GroupLayout, k: int, n: int, dtype) -> str:
    ok, why = gk.available()
    if not ok:
        return why
    why = dispatch.unpartitioned_reason()
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
    """``backend`` if it is one of `BACKENDS` (`fp8jax.kernels.dispatch`'s names accepted
    too), else a ValueError naming ``owner``."""
    dispatch.check(owner, backend, BACKENDS)
    return backend


def resolve_backend(backend: str, layout: GroupLayout, k: int, n: int, dtype) -> str:
    """``"pallas"`` or ``"reference"`` for a GEMM set of sizes ``[M_pad, k] x [G, k, n]``
    (`fp8jax.kernels.dispatch.choose`)."""
    why = _kernel_reason(layout, k, n, dtype) or None
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
    if not _dot._under_vmap(lhs):
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


def _masked(x, layout: GroupLayout):
    return jnp.where(layout.row_valid[:, None], x, jnp.zeros((), x.dtype))


# ----------------------------------------------------------------------------- bf16 (no FP8)
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def grouped_plain(backend: str, x, w, layout: GroupLayout, experts=None):
    """``y = x . W_e`` per group in the input precision through the same kernels
    (``experts``: an `ExpertSharding` to run them per device on its own experts)."""
    return _plain_fwd(backend, x, w, layout, experts)[0]


def _plain_fwd(backend, x, w, layout, experts=None):
    xm = _masked(x, layout)
    y = _gemms_for(experts)[0](
        backend,
        xm,
        jnp.swapaxes(w, 1, 2).astype(x.dtype),
        layout,
        jnp.ones((layout.num_groups,), F32),
        x.dtype,
    )
    return y, (xm, w, layout)


def _plain_bwd(backend, experts, res, dy):
    xm, w, layout = res
    rows, wgrad = _gemms_for(experts)
    dym = _masked(dy.astype(xm.dtype), layout)
    ones = jnp.ones((layout.num_groups,), F32)
    dx = _masked(rows(backend, dym, w.astype(xm.dtype), layout, ones, xm.dtype), layout)
    dw = wgrad(backend, xm.T, dym.T, layout, jnp.ones((), F32), w.dtype)
    return dx, dw, jax.tree_util.tree_map(_zero_ct, layout)


grouped_plain.defvjp(_plain_fwd, _plain_bwd)


# ----------------------------------------------------------------------------- FP8
class Spec(NamedTuple):
    config: Fp8Config
    backend: str
    x_dtype: np.dtype
    w_dtype: np.dtype
    experts: _ep.ExpertSharding | None = None  # expert parallel: GEMMs per device


ExpertSharding = _ep.ExpertSharding


def _gemms(spec: Spec):
    return _gemms_for(spec.experts)


def _gemms_for(experts: _ep.ExpertSharding | None):
    """(rows, wgrad) GEMMs: the module's, or each device's on its experts (`_ep`)."""
    if experts is None:
        return rows_gemm, wgrad_gemm
    return (
        functools.partial(_ep.rows_gemm, experts),
        functools.partial(_ep.wgrad_gemm, experts),
    )


def _per_expert_amax(w):
    return jnp.max(jnp.abs(w), axis=(1, 2)).astype(F32)


def _zero_ct(a):
    if jnp.issubdtype(a.dtype, jnp.integer) or a.dtype == bool:
        return np.zeros(a.shape, jax.dtypes.float0)
    return jnp.zeros_like(a)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def grouped_fp8(spec: Spec, x, w, layout: GroupLayout, state):
    """FP8 ``y = x . W_e`` per group; ``state`` as `fp8jax.state.MAX_GRAD`."""
    y, _ = _fp8_fwd_impl(spec, x, w, layout, _state.values(state))
    return y


def _fp8_fwd_impl(spec: Spec, x, w, layout, state):
    cfg = spec.config
    if not cfg.recipe.per_tensor_scale:
        from .grouped_tiled import tiled_fwd  # row/block-wise (imports this module)

        return tiled_fwd(spec, x, w, layout)
    in_s, k_s, _, in_h, k_h, _, _ = state
    xm = _masked(x, layout)
    ax, aw = q.amax(xm), _per_expert_amax(w)
    sx = cfg.recipe.scale(in_h, in_s, cfg.input_dtype, ax)
    sw = cfg.recipe.scale(k_h, k_s, cfg.kernel_dtype, aw, axis=0)  # one per expert
    xq = q.quantize(xm, sx, cfg.input_dtype)
    limit = q.fp8_max(cfg.kernel_dtype)
    wq = jnp.clip(w.astype(F32) / sw[:, None, None], -limit, limit).astype(
        cfg.kernel_dtype
    )  # [G, in, out]
    y = _gemms(spec)[0](spec.backend, xq, jnp.swapaxes(wq, 1, 2), layout, sx * sw, spec.x_dtype)
    return y, (xq.T, wq, sx, sw, ax, aw)


def _grouped_fp8_fwd(spec, x, w, layout, state):
    values = _state.values(state)
    y, res = _fp8_fwd_impl(spec, x, w, layout, values)
    return y, (res, layout, values)


def _grouped_fp8_bwd(spec, residuals, cotangents):
    if not spec.config.recipe.per_tensor_scale:
        from .grouped_tiled import tiled_bwd

        return tiled_bwd(spec, residuals, cotangents)
    dy = cotangents
    (xTq, wq, sx, sw, ax, aw), layout, state = residuals
    cfg = spec.config
    _, _, g_s, _, _, g_h, _ = state
    dym = _masked(dy, layout)
    ag = q.amax(dym)
    sg = cfg.recipe.scale(g_h, g_s, cfg.grad_dtype, ag)
    dyq = q.quantize(dym, sg, cfg.grad_dtype)
    rows, wgrad = _gemms(spec)
    dx = _masked(rows(spec.backend, dyq, wq, layout, sg * sw, spec.x_dtype), layout)
    dw = wgrad(spec.backend, xTq, dyq.T, layout, (sx * sg).reshape(()), spec.w_dtype)

    observed, bad = q.sanitize_amax(jnp.concatenate([ax.reshape(1), ag.reshape(1), aw]))
    in_s, k_s, g_s, in_h, k_h, g_h, nonfinite = state
    proposed = (
        sx.astype(in_s.dtype),
        sw.astype(k_s.dtype),
        sg.astype(g_s.dtype),
        _state.record(in_h, observed[0]),
        _state.record(k_h, observed[2:]),
        _state.record(g_h, observed[1]),
        nonfinite + jnp.max(bad),
    )
    return dx, dw, jax.tree_util.tree_map(_zero_ct, layout), _state.proposal(proposed)


grouped_fp8.defvjp(_grouped_fp8_fwd, _grouped_fp8_bwd)
