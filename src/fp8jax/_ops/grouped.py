"""Grouped (per-expert) GEMMs for MoE: the FP8 and bf16 custom VJPs.

Rows are grouped by expert in a *padded layout* (`fp8jax._ops.group_layout`); the three
GEMMs of training run per group (`fp8jax._ops.grouped_gemms`: kernels or reference):

* forward ``y = x . W_e``  (``x [M, in]``, ``W [G, in, out]``)
* dgrad   ``dx = dy . W_e^T``
* wgrad   ``dW_e = x_e^T . dy_e``

FP8 scaling: inputs and output gradients per tensor (one scale shared by all
experts: the rows of all experts form one GEMM operand, so one cast pass and one
amax serve every group, as in Transformer Engine's per-tensor recipe); weights per
expert (``[G]`` scales, ``[history, G]`` amax histories: experts see different
numbers of tokens and drift apart, and each expert's scale is one multiply in the
kernel's epilogue). Row- and block-wise recipes take `fp8jax._ops.grouped_tiled`.

The layout and GEMM names are re-exported here: this module is the grouped ops' front.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _quant as q
from .. import _state
from .._config import Fp8Config
from . import expert_parallel as _ep
from .group_layout import (  # noqa: F401  (public here too)
    ROW_ALIGN,
    GroupLayout,
    _masked,
    _zero_ct,
    check_group_sizes,
    clip_group_sizes,
    layout_from_sizes,
    pad_rows,
    padded_positions,
    padded_rows,
    source_rows,
    unpad_rows,
)
from .grouped_gemms import (  # noqa: F401  (public here too)
    BACKENDS,
    F32,
    GROUPED_SCOPE,
    _per_expert_amax,
    check_backend,
    kernel_configs,
    resolve_backend,
    rows_gemm,
    set_kernel_configs,
    wgrad_gemm,
)
from .grouped_tiled import tiled_bwd, tiled_fwd


# ----------------------------------------------------------------------------- bf16 (no FP8)
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def grouped_plain(backend: str, x, w, layout: GroupLayout, experts=None):
    """``y = x . W_e`` per group in the input precision through the same kernels
    (``experts``: an `ExpertSharding` to run them per device on its own experts)."""
    return _plain_fwd(backend, x, w, layout, experts)[0]


def _plain_fwd(backend, x, w, layout, experts=None):
    xm = _masked(x, layout)
    y = _gemms_for(experts, layout)[0](
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
    rows, wgrad = _gemms_for(experts, layout)
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
BlockLayout = _ep.BlockLayout


def _gemms(spec: Spec, layout):
    return _gemms_for(spec.experts, layout)


def _gemms_for(experts: _ep.ExpertSharding | None, layout):
    """(rows, wgrad) GEMMs: the module's, or each device's on its experts (`_ep`): on
    whole rows, or on its block of a `BlockLayout` (the all-to-all dispatch's rows)."""
    if experts is None:
        return rows_gemm, wgrad_gemm
    if isinstance(layout, BlockLayout):
        return (
            functools.partial(_ep.block_rows_gemm, experts),
            functools.partial(_ep.block_wgrad_gemm, experts),
        )
    return (
        functools.partial(_ep.rows_gemm, experts),
        functools.partial(_ep.wgrad_gemm, experts),
    )


class InputCast(NamedTuple):
    """An input already cast with the GEMM's own per-tensor scale (`grouped_fp8_precast`).

    Arguments:
        values: ``[M_pad, in]`` the FP8 rows (zeros off the groups).
        scale: the ``[1]`` scale they were cast with (`input_scale`'s).
        amax: the input's amax, for the state update.
    """

    values: jax.Array
    scale: jax.Array
    amax: jax.Array


def input_scale(config: Fp8Config, amax, input_scale, input_history):
    """The per-tensor input scale the FP8 op chooses (`_fp8_fwd_impl`): from the state's
    history (delayed) or from ``amax``, the input's (current)."""
    return config.recipe.scale(input_history, input_scale, config.input_dtype, amax)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def grouped_fp8(spec: Spec, x, w, layout: GroupLayout, state):
    """FP8 ``y = x . W_e`` per group; ``state`` as `fp8jax._state.MAX_GRAD`."""
    y, _ = _fp8_fwd_impl(spec, x, w, layout, _state.values(state))
    return y


def _fp8_fwd_impl(spec: Spec, x, w, layout, state, cast: InputCast | None = None):
    cfg = spec.config
    if not cfg.recipe.per_tensor_scale:
        return tiled_fwd(spec, x, w, layout)
    in_s, k_s, _, in_h, k_h, _, _ = state
    aw = _per_expert_amax(w)
    if cast is None:
        xm = _masked(x, layout)
        ax = q.amax(xm)
        sx = input_scale(cfg, ax, in_s, in_h)
        xq = q.quantize(xm, sx, cfg.input_dtype)
    else:
        xq, sx, ax = cast
    sw = cfg.recipe.scale(k_h, k_s, cfg.kernel_dtype, aw, axis=0)  # one per expert
    limit = q.fp8_max(cfg.kernel_dtype)
    wq = jnp.clip(w.astype(F32) / sw[:, None, None], -limit, limit).astype(
        cfg.kernel_dtype
    )  # [G, in, out]
    rows = _gemms(spec, layout)[0]
    y = rows(spec.backend, xq, jnp.swapaxes(wq, 1, 2), layout, sx * sw, spec.x_dtype)
    return y, (xq.T, wq, sx, sw, ax, aw)


def _grouped_fp8_fwd(spec, x, w, layout, state):
    values = _state.values(state)
    y, res = _fp8_fwd_impl(spec, x, w, layout, values)
    return y, (res, layout, values)


def _grouped_fp8_bwd(spec, residuals, cotangents):
    if not spec.config.recipe.per_tensor_scale:
        return tiled_bwd(spec, residuals, cotangents)
    dy = cotangents
    (xTq, wq, sx, sw, ax, aw), layout, state = residuals
    cfg = spec.config
    _, _, g_s, _, _, g_h, _ = state
    dym = _masked(dy, layout)
    ag = q.amax(dym)
    sg = cfg.recipe.scale(g_h, g_s, cfg.grad_dtype, ag)
    dyq = q.quantize(dym, sg, cfg.grad_dtype)
    rows, wgrad = _gemms(spec, layout)
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def grouped_fp8_precast(spec: Spec, x, cast: InputCast, w, layout: GroupLayout, state):
    """`grouped_fp8` on an input already cast with its own scale (per-tensor recipes):
    ``cast`` goes into the GEMMs as it is (no cast pass), ``cast.amax`` into the state.
    ``x``: zeros of the input's shape and dtype, unused in the forward: the input's gradient
    (as `grouped_fp8`'s, straight through the cast) is its cotangent."""
    y, _ = _fp8_fwd_impl(spec, x, w, layout, _state.values(state), cast)
    return y


def _precast_fwd(spec, x, cast, w, layout, state):
    values = _state.values(state)
    y, res = _fp8_fwd_impl(spec, x, w, layout, values, cast)
    return y, (res, layout, values)


def _precast_bwd(spec, residuals, dy):
    dx, dw, d_layout, d_state = _grouped_fp8_bwd(spec, residuals, dy)
    x_t, _, sx, _, ax, _ = residuals[0]
    zeros = InputCast(jnp.zeros(x_t.shape[::-1], x_t.dtype), jnp.zeros_like(sx), jnp.zeros_like(ax))
    return dx, zeros, dw, d_layout, d_state


grouped_fp8_precast.defvjp(_precast_fwd, _precast_bwd)
