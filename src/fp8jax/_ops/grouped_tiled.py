"""Grouped expert GEMMs under the row-wise and block-wise recipes (`Fp8Config(recipe=...)`).

The operands are cast as the linear's are (`fp8jax._recipe`: the rows of all experts as one
activation, each expert's ``[in, out]`` weight per block on its own). Block-wise, on a Hopper
GPU with 128-aligned sizes, the three GEMMs run the block-scaled grouped kernels
(`fp8jax._kernels.blockwise_grouped_mgpu`): FP8 operands, every 128-K chunk promoted into a
float32 accumulator. Elsewhere (row-wise, CPU, unaligned sizes, expert parallelism, or
``backend="reference"``) the casts are dequantized into the float32 grouped reference: the
recipe's numerics without FP8 GEMMs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _quant as q
from .. import _state
from .._kernels import blockwise_grouped_mgpu as bgk
from .._kernels import dispatch
from .._recipe_base import Recipe
from . import expert_parallel as _ep
from . import grouped_gemms as _gemms
from . import traced as _traced
from .group_layout import _masked, _zero_ct

F32 = jnp.float32


def _deq(recipe: Recipe, data, scale):
    return recipe.dequantize(data, scale, F32)


def _references(spec, layout):
    """The float32 (rows, wgrad) references: global, or per device on the blocks of a
    `BlockLayout` (the all-to-all dispatch's rows, which only their device can read)."""
    if isinstance(layout, _ep.BlockLayout):
        return (
            lambda *a: _ep.block_rows_gemm(spec.experts, "reference", *a),
            lambda *a: _ep.block_wgrad_gemm(spec.experts, "reference", *a),
        )
    return _gemms._rows_reference, _gemms._wgrad_reference


def kernel_reason(spec, layout, k: int, n: int, operand) -> str | None:
    """Why the block-scaled grouped kernels cannot run this layer's ``[M, k] x [G, k, n]``
    (None when they can); ``operand``: a traced input, to tell a ``jax.vmap``."""
    cfg = spec.config
    why = cfg.recipe.grouped_kernel_reason()
    if why is not None:
        return why
    if spec.experts is not None:
        return "expert parallelism (the kernels run one device's groups)"
    if _traced.under_vmap(operand):
        return "under jax.vmap"
    if layout.align % bgk.BLOCK:
        return f"the layout's groups are aligned to {layout.align} rows, not {bgk.BLOCK}"
    dtypes = {jnp.dtype(cfg.input_dtype), jnp.dtype(cfg.kernel_dtype), jnp.dtype(cfg.grad_dtype)}
    if len(dtypes) != 1:
        return f"mixed FP8 dtypes {sorted(d.name for d in dtypes)}"
    why = bgk.reason(layout.num_rows, k, n, cfg.input_dtype, spec.x_dtype)
    return why or dispatch.unpartitioned_reason()


def _use_kernel(spec, layout, k: int, n: int, operand) -> bool:
    """The kernels where they can run, unless ``backend="reference"`` (a layer the kernels
    cannot run takes the reference under every backend, as before they existed)."""
    if dispatch.ALIASES.get(spec.backend, spec.backend) == "reference":
        return False
    return kernel_reason(spec, layout, k, n, operand) is None


def tiled_fwd(spec, x, w, layout):
    cfg, recipe = spec.config, spec.config.recipe
    xm = _masked(x, layout)
    xc = recipe.quantize_both(xm[None], None, None, cfg.input_dtype)
    wc = recipe.quantize_both(w, None, None, cfg.kernel_dtype, weight=True)  # [G, in, out]
    if _use_kernel(spec, layout, w.shape[1], w.shape[2], x):
        with jax.named_scope(_gemms.GROUPED_SCOPE):
            y = bgk.grouped_rows(
                xc.data[0], xc.scale[0], wc.data_t, wc.scale_t, layout.block_group,
                out_dtype=spec.x_dtype, group_align=layout.align,
            )  # fmt: skip
    else:
        y = _references(spec, layout)[0](
            _deq(recipe, xc.data, xc.scale)[0],
            _deq(recipe, wc.data_t, wc.scale_t),
            layout,
            jnp.ones((layout.num_groups,), F32),
            spec.x_dtype,
        )
    sw = jnp.max(wc.scale, axis=(1, 2))  # per expert, for the state
    return y, (xc.data_t, xc.scale_t, wc.data, wc.scale, xc.amax, _gemms._per_expert_amax(w), sw)


def tiled_bwd(spec, residuals, dy):
    (xTq, sxT, wq, swq, ax, aw, sw), layout, state = residuals
    cfg, recipe = spec.config, spec.config.recipe
    gc = recipe.quantize_both(_masked(dy, layout)[None], None, None, cfg.grad_dtype)
    if _use_kernel(spec, layout, wq.shape[1], wq.shape[2], dy):
        with jax.named_scope(_gemms.GROUPED_SCOPE):
            dx = bgk.grouped_rows(
                gc.data[0], gc.scale[0], wq, swq, layout.block_group, out_dtype=spec.x_dtype,
                group_align=layout.align,
            )  # fmt: skip
            dw = bgk.grouped_wgrad(
                xTq[0], sxT[0], gc.data_t[0], gc.scale_t[0], layout.starts,
                layout.padded_sizes, out_dtype=spec.w_dtype,
            )  # fmt: skip
    else:
        ones = jnp.ones((layout.num_groups,), F32)
        rows_ref, wgrad_ref = _references(spec, layout)
        dy_deq = _deq(recipe, gc.data, gc.scale)[0]
        dx = rows_ref(dy_deq, _deq(recipe, wq, swq), layout, ones, spec.x_dtype)
        x_t, dy_t = _deq(recipe, xTq, sxT)[0], _deq(recipe, gc.data_t, gc.scale_t)[0]
        dw = wgrad_ref(x_t, dy_t, layout, jnp.ones((), F32), spec.w_dtype)
    dx = _masked(dx, layout)
    observed, bad = q.sanitize_amax(jnp.concatenate([ax.reshape(1), gc.amax.reshape(1), aw]))
    in_s, k_s, g_s, in_h, k_h, g_h, nonfinite = state
    proposed = (
        recipe.summary(sxT).astype(in_s.dtype),
        sw.astype(k_s.dtype),
        recipe.summary(gc.scale).astype(g_s.dtype),
        _state.record(in_h, observed[0]),
        _state.record(k_h, observed[2:]),
        _state.record(g_h, observed[1]),
        nonfinite + jnp.max(bad),
    )
    return dx, dw, jax.tree_util.tree_map(_zero_ct, layout), _state.proposal(proposed)
