"""The FP8 GEMM with its custom VJP, on canonical 3-D operands.

Any ``dot_general`` is brought to ``x3: [B, M, K]`` and ``w3: [B, N, K]`` (or
``[B, K, N]`` when the kernel is stored that way, as flax's is), and every GEMM gets
both operands contracting on their minor dim (the "TN" layout Hopper's FP8 GEMMs want):

* forward  ``y  = x3 . w3``         (xq [B,M,K] e4m3, wq  [B,N,K] e4m3)
* dgrad    ``dx = g  . w3^T``       (gq [B,M,N] e5m2, wq  [B,K,N] e4m3)
* wgrad    ``dw = g^T . x3``        (gTq [B,N,M] e5m2, xTq [B,K,M] e4m3)

Residuals are FP8 (1 byte/element): ``xTq`` and the kernel in ``[B, K, N]`` layout.
The scaling state's new value is returned as the state's "gradient" (gradient
hijacking); the state enters as `fp8jax._state.MAX_GRAD` values, so several uses of
one layer in a step combine their proposals by max.
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_batching import custom_vmap

from .. import _state
from .._config import Fp8Config, warn_below_min_tokens
from .._kernels import gemm as _gemm
from .._recipe_base import Cast, Recipe
from . import fsdp as _fsdp_op
from . import rows as _split
from . import sequence_parallel as _sp
from . import state_update as _update
from . import tp_ring as _ring
from . import traced as _traced

F32 = jnp.float32
STATE_FIELDS = _state.STATE_FIELDS
# Names given to the residuals that are cheap to keep and costly to recompute (the FP8
# weight, scales, amaxes), for `jax.checkpoint` policies: a policy saving these and
# not the FP8 input copy recomputes only the input's cast (see `fp8jax.nn.FusedMLP`).
KERNEL_RESIDUAL = "fp8jax_kernel_fp8"
SCALAR_RESIDUALS = "fp8jax_gemm_scalars"
INPUT_RESIDUAL = "fp8jax_input_fp8"  # the input's copy the backward reads (FP8 on FP8 paths)
SAVED_RESIDUAL_NAMES = (KERNEL_RESIDUAL, SCALAR_RESIDUALS)


class Spec(NamedTuple):
    """Static description of one FP8 GEMM call (hashable: a custom_vjp nondiff arg)."""

    config: Fp8Config
    out_dtype: np.dtype
    x_dtype: np.dtype  # dtypes of the operands: their gradients come back in these
    w_dtype: np.dtype
    rhs_k_first: bool  # w3 is [B, K, N] (kernel stored contracting-dims-first) instead of [B, N, K]
    # FSDP: (shard, gathered) NamedShardings of w3, see `w3_shardings`; () for a recorded
    # sharding with nothing to gather; None when nothing is recorded (found when compiling).
    w_shardings: tuple | None = None
    sequence: _sp.SequenceParallel | None = None  # Megatron sequence parallelism
    # Over several devices, the token split the casts (and the row- or block-wise recipes'
    # GEMMs) run per device under (`ops.rows`, `row_split`)
    rows: _split.RowSplit | None = None


class WeightSharding(NamedTuple):
    """How a layer's kernel (the ``rhs``, as called) is sharded, and the mesh axes
    (``gather``) it is all-gathered over before the GEMM (FSDP). Set by
    `fp8jax.distributed`; hashable, so it can be a static field."""

    mesh: jax.sharding.Mesh
    spec: tuple | None  # PartitionSpec entries of the rhs, one per dim; None: not recorded
    gather: tuple[str, ...]
    sequence: _sp.SequenceParallel | None = None  # tokens split over the tensor axis around it


def w3_shardings(ws: WeightSharding, rb, rf, rc, rhs_k_first: bool):
    """(shard, gathered) NamedShardings of the canonical ``w3`` for a kernel sharded as
    ``ws``; () when nothing is gathered; None when a merged dim would need a reshard
    (then `fp8jax._ops.fsdp` gathers it, as for weights placed by the user)."""
    from jax.sharding import NamedSharding, PartitionSpec

    spec = tuple(ws.spec) + (None,) * (len(rb) + len(rf) + len(rc) - len(ws.spec))
    merged = []
    for group in (rb, rc, rf) if rhs_k_first else (rb, rf, rc):
        sharded = [spec[i] for i in group if spec[i] is not None]
        if len(sharded) > 1 or (sharded and spec[group[0]] is None):
            return None  # only a group's leading dim may be sharded for a free reshape
        merged.append(sharded[0] if sharded else None)

    gathered = [_fsdp_op.split_axes(e, ws.gather)[0] for e in merged]
    if gathered == merged:
        return ()
    return (
        NamedSharding(ws.mesh, PartitionSpec(*merged)),
        NamedSharding(ws.mesh, PartitionSpec(*gathered)),
    )


def _fsdp(spec: Spec, a, transposed: bool, gathered: bool):
    """FSDP: pin ``a`` (w3's layout, or its transpose) to the kernel's shard layout, or
    to the gathered one. A constraint pair shard -> gathered makes XLA all-gather ``a``
    itself (FP8, 1 byte/element) instead of choosing what to move. Without a recorded
    sharding (weights placed by the user), gathering is `_fsdp_op.gather_fsdp`'s, decided
    from the real sharding when compiling; identity on one device."""
    if spec.w_shardings is None:
        return _fsdp_op.gather_fsdp(a) if gathered and not _traced.under_vmap(a) else a
    if not spec.w_shardings:
        return a
    s = spec.w_shardings[gathered]
    if transposed:
        b, p, c = s.spec
        s = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(b, c, p))
    return jax.lax.with_sharding_constraint(a, s)


_WARNED: set[str] = set()


def unsupported(config: Fp8Config, message: str) -> None:
    """Apply ``config.on_unsupported`` to a call FP8 cannot run (raise, warn once, or not)."""
    if _traced.QUIET.get():
        return
    if config.on_unsupported == "raise":
        raise ValueError(message)
    message += " Running it in the input precision instead."
    if config.on_unsupported == "warn" and message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=5)


def uses_fp8(spec: Spec, m: int, k: int = 0, n: int = 0) -> bool:
    """Runtime (shape) part of the policy: rows aligned, and enough of them (``selective``);
    ``k``, ``n``: the layer's features, for the warning below ``min_tokens``."""
    cfg = spec.config
    if m % cfg.alignment:
        unsupported(
            cfg, f"Fp8DotGeneral: the GEMM has M={m} rows, not a multiple of {cfg.alignment}."
        )
        return False
    if cfg.selective and m < cfg.min_tokens:
        if not _traced.QUIET.get():
            warn_below_min_tokens(cfg, m, k, n, spec.x_dtype)
        return False
    return True


# ----------------------------------------------------------------------------- forward
def scale_inputs(config: Fp8Config, state) -> tuple[tuple, tuple, tuple]:
    """What `fp8jax._recipe.PerTensor.gemm_scales` takes for one layer's state: the input,
    kernel and output-gradient histories, old scales and FP8 dtypes, in that order."""
    in_s, k_s, g_s, in_h, k_h, g_h, _ = state
    dtypes = (config.input_dtype, config.kernel_dtype, config.grad_dtype)
    return (in_h, k_h, g_h), (in_s, k_s, g_s), dtypes


def row_split(cfg: Fp8Config, ws) -> _split.RowSplit | None:
    """The token split a layer's casts run under on a mesh (`fp8jax._ops.rows`): those of a
    row- or block-wise layer, its GEMMs too (`Recipe.per_device_rows`); a delayed per-tensor
    layer's activation and output-gradient casts (`Recipe.per_device_casts`)."""
    return _split.of_weight(ws) if cfg.recipe.per_device_casts else None


def _rows(spec: Spec, m: int) -> _split.RowSplit | None:
    """``spec.rows`` where each device's share of ``m`` token rows holds whole tiles (of
    the block-wise recipe, or the row-wise cast kernel's 128-row squares; per-tensor: any)."""
    rows, tile = spec.rows, spec.config.recipe.row_tile
    return rows if rows and m % (rows.count * tile) == 0 else None


def _sequence_cast(spec: Spec, side: str, m: int) -> _split.RowSplit | None:
    """Under sequence parallelism (`fp8jax._kernels.gemm.Tuning.sequence_cast`, delayed
    per-tensor scaling), the split a cast that writes a transposed copy runs per device
    on (``side``: ``"input"`` or ``"grad"``): a column-parallel layer's input has its
    ``m`` tokens split over the batch axes and the tensor axis, its output gradient and a
    row-parallel layer's input their tokens over the batch axes and features over the
    tensor axis. None elsewhere: a row-parallel layer's output gradient is gathered and
    transposed once (`_bwd_impl`), a ring moves its own (`fp8jax._ops.tp_ring`)."""
    sp = spec.sequence
    if not _split.sequence_casts(sp, spec.config.recipe):
        return None
    tokens, features = _split.sequence_splits(sp)
    if (sp.kind, side) == ("column", "input"):
        split = tokens
    elif (sp.kind, side) in (("column", "grad"), ("row", "input")):
        split = features
    else:
        return None
    return split if m % split.count == 0 else None


def _cast_rows(rows, recipe: Recipe, t3, dtype, scale=None) -> Cast:
    """An activation or output gradient ``[B, M, K]`` in both layouts, per device on its
    tokens (``rows``): `fp8jax._recipe_base.Recipe.quantize_rows` (``scale``: delayed)."""
    return recipe.quantize_rows(functools.partial(_split.on_rows, rows), t3, dtype, scale)


def _gemm_rows(rows, recipe: Recipe, a, sa, b, sb, out_dtype, fast: bool, wgrad: bool = False):
    """``recipe.gemm``; with ``rows`` and `Recipe.per_device_rows`, per device on its tokens:
    the rows of ``a`` (forward, dgrad: ``b`` whole on every device) or, for the wgrad
    (``wgrad``), the contracted tokens of both, summed over the devices in the gradient's
    dtype (under FSDP XLA makes the sum and the layer's shard constraint a reduce-scatter).
    Per-tensor GEMMs are XLA's, which partitions them."""
    if rows is None or not recipe.per_device_rows:
        return recipe.gemm(a, sa, b, sb, out_dtype, fast)
    on_rows = functools.partial(_split.on_rows, rows)
    return recipe.gemm_rows(on_rows, a, sa, b, sb, out_dtype, fast, wgrad)


def _scales_in_forward(spec: Spec) -> bool:
    """Delayed per-tensor scaling: the forward computes all three scales at once
    (`fp8jax._recipe.PerTensor.gemm_scales`) and hands the output gradient's to the backward."""
    return spec.config.recipe.scale_known_before_cast


def _cast_input(spec: Spec, n: int, x3, state):
    """The forward's input side: ``x3``'s FP8 copies (the GEMM's, with its scale, and the
    transposed one the wgrad keeps, with its scale and amax) and the weight's and output
    gradient's scales where delayed scaling chooses all three at once; ``x3`` itself where
    the GEMM runs in the input precision (`uses_fp8`; ``n``: the layer's outputs, for its
    warning). Apart from the weight's side (`_weight_gemm`): a ``jax.checkpoint`` that
    recomputes the input's copy replays this op alone, from ``x3`` and the state, instead of
    keeping the high-precision weight for a replay of the whole forward."""
    cfg, recipe = spec.config, spec.config.recipe
    in_s, k_s, g_s, in_h, _, _, _ = state
    if not uses_fp8(spec, x3.shape[1], x3.shape[2], n):
        return x3, in_s, x3, in_s, jnp.zeros((), F32), k_s, g_s
    sx, sw, sg = None, k_s, g_s  # None: the cast chooses its own scale
    if _scales_in_forward(spec):  # all three in one small computation; sg to the backward
        scales = recipe.gemm_scales(*scale_inputs(cfg, state))
        sx, sw, sg = scales[0:1], scales[1:2], scales[2:3]
    rows = _rows(spec, x3.shape[1]) or _sequence_cast(spec, "input", x3.shape[1])
    if rows is None:
        x = recipe.quantize_both(x3, in_s, in_h, cfg.input_dtype, scale=sx)
    else:
        x = _cast_rows(rows, recipe, x3, cfg.input_dtype, sx)
    # Sequence parallel: a column-parallel layer's transposed copy stays split until the
    # backward (`_weight_gemm` gathers the GEMM's copy).
    col, _ = _sp.sides(spec.sequence)
    x_data_t = _sp.constrain(col, x.data_t, 2, True) if col else x.data_t
    return x.data, x.scale, x_data_t, x.scale_t, x.amax, sw, sg


def _weight_gemm(spec: Spec, x_data, x_scale, w3, state, sw, sg):
    """The forward's weight side and GEMM, from `_cast_input`'s copy of the input: ``y``,
    the weight's FP8 copy the dgrad reads, its scale and amax."""
    cfg, recipe = spec.config, spec.config.recipe
    _, k_s, _, _, k_h, _, _ = state
    out_dtype = spec.out_dtype
    if x_data.dtype != cfg.input_dtype:  # `_cast_input` chose the input precision
        y = _gemm.gemm(x_data, jnp.swapaxes(w3, 1, 2) if spec.rhs_k_first else w3, out_dtype)
        return y, w3, sw, jnp.zeros((), F32)
    sw = sw if _scales_in_forward(spec) else None  # None: the cast chooses its own scale
    rows = _rows(spec, x_data.shape[1])
    # FSDP: each device casts its own shard (global amax: a scalar all-reduce), the FP8
    # copy is all-gathered for the GEMM and kept sharded as the residual.
    w3 = _fsdp(spec, w3, False, False)
    w = recipe.quantize_both(w3, k_s, k_h, cfg.kernel_dtype, weight=True, scale=sw)
    w_nk, w_kn = (w.data_t, w.data) if spec.rhs_k_first else (w.data, w.data_t)
    # Per-tensor: scale_t is scale. Row/block-wise: each layout has its own scales.
    sw_nk, sw_kn = (w.scale_t, w.scale) if spec.rhs_k_first else (w.scale, w.scale_t)
    t = spec.rhs_k_first  # w_nk is w3's transpose
    w_nk = _fsdp(spec, w_nk, t, False)
    if spec.w_shardings and recipe.per_tensor_scale:
        # The kept copy is the pinned shard transposed (the same bits: one scale). From the
        # cast's unpinned output XLA transposed the gathered copy and sliced its shard in the
        # backward, holding every layer's gathered copy to it (8b fsdp=4: 1.3 GB a device).
        w_kn = jnp.swapaxes(w_nk, 1, 2)
    w_nk = _fsdp(spec, w_nk, t, True)
    w_kn = _fsdp(spec, w_kn, not t, False)
    # Sequence parallel: a column-parallel layer all-gathers its FP8 input's tokens; a
    # row-parallel one reduce-scatters its output. Identities without it.
    col, row = _sp.sides(spec.sequence)
    if _ring.applies(spec.sequence, recipe):  # the same moves, chunked under the GEMMs
        gemm = functools.partial(
            recipe.gemm, out_dtype=out_dtype, fast_accumulation=cfg.fast_forward
        )
        y = _ring.forward(spec.sequence, gemm, x_data, x_scale, w_nk, sw_nk)
        return y, w_kn, sw_kn, w.amax
    x_data, x_scale = _sp.gather_scaled(col, x_data, x_scale, 1)
    # x [B, M, K] . w [B, N, K]: column splits N (w's dim 1), row splits K (both dims 2)
    x_data, w_nk = _sp.pin_operands(col, x_data, w_nk, None, 1)
    x_data, w_nk = _sp.pin_operands(row, x_data, w_nk, 2, 2)
    y = _gemm_rows(rows, recipe, x_data, x_scale, w_nk, sw_nk, out_dtype, cfg.fast_forward)
    y = _sp.scatter(row, y, 1)
    return y, w_kn, sw_kn, w.amax


def _fwd_impl(spec: Spec, x3, w3, state):
    """``y`` and the residuals ``(xTq, w_kn, sx, sw, ax, aw, sg)``: two ``custom_vmap`` ops,
    `_cast_input` (whose inputs are ``x3`` and the state) and `_weight_gemm`."""
    n = w3.shape[2 if spec.rhs_k_first else 1]
    x_data, x_scale, xr, sx, ax, sw, sg = cast_fn(spec, n)(x3, state)
    y, wr, sw, aw = gemm_fn(spec)(x_data, x_scale, w3, state, sw, sg)
    return y, (xr, wr, sx, sw, ax, aw, sg)


def _after(a, amax):
    """``a`` (FP8) unchanged, computed from ``amax`` (the output gradient's) too: a saved
    copy the backward gathers again (its tokens under sequence parallelism, the weight
    under FSDP) is gathered only once the output gradient exists. The gather reads forward
    values only, so XLA may otherwise run it in the forward and hold the gathered copy, ``tp``
    or ``fsdp`` times the saved bytes, until the backward (an optimization barrier does not
    order it: XLA's CPU pipeline drops barriers before scheduling). The dependency is a max
    of the bits with a zero XLA cannot fold (``x != x and x == x`` is false for every ``x``,
    NaN included): one elementwise pass over the shard."""
    amax = jnp.max(jnp.asarray(amax, F32))
    zero = ((amax != amax) & (amax == amax)).astype(jnp.uint8)
    bits = jax.lax.bitcast_convert_type(a, jnp.uint8)
    return jax.lax.bitcast_convert_type(jnp.maximum(bits, zero), a.dtype)


def _bwd_impl(spec: Spec, res, g_scale, g_history, g3):
    """``g_scale``: the output gradient's scale where the forward chose it (delayed
    per-tensor scaling), else its old scale."""
    cfg, recipe = spec.config, spec.config.recipe
    xr, wr, sx, sw, _, _ = res
    if xr.dtype != cfg.input_dtype:  # plain (non-FP8) path chosen in the forward
        w_kn = wr if spec.rhs_k_first else jnp.swapaxes(wr, 1, 2)
        dx = _gemm.gemm(g3, w_kn, xr.dtype)
        gT, xT = jnp.swapaxes(g3, 1, 2), jnp.swapaxes(xr, 1, 2)
        dw = _gemm.gemm(xT, gT, wr.dtype) if spec.rhs_k_first else _gemm.gemm(gT, xT, wr.dtype)
        return dx, dw, jnp.zeros((), F32), g_scale
    known = g_scale if _scales_in_forward(spec) else None
    rows = _rows(spec, g3.shape[1])  # as the forward's: the same token count
    cast_rows = rows or _sequence_cast(spec, "grad", g3.shape[1])
    if cast_rows is None:
        g = recipe.quantize_both(g3, g_scale, g_history, cfg.grad_dtype, scale=known)
    else:
        g = _cast_rows(cast_rows, recipe, g3, cfg.grad_dtype, known)
    # Sequence parallel (`_sp`): column gathers its input again and reduce-scatters dgrad;
    # row gathers the FP8 output gradient's tokens: one layout where one scale covers the
    # tensor (wgrad's copy is the gathered one transposed on each device), else both.
    col, row = _sp.sides(spec.sequence)
    # The shards kept are gathered again after the output gradient's cast (`_after`).
    t, xTq, w_kn = not spec.rhs_k_first, xr, wr  # w_kn is w3's transpose
    if col is not None:
        xTq = _sp.constrain(col, _after(_sp.constrain(col, xr, 2, True), g.amax), 2, True)
    if spec.w_shardings:  # FSDP with a recorded sharding: the weight's shard
        w_kn = _fsdp(spec, _after(_fsdp(spec, wr, t, False), g.amax), t, False)
    w_kn = _fsdp(spec, w_kn, t, True)  # FSDP: all-gather FP8 again
    fast = cfg.fast_backward
    if _ring.applies(spec.sequence, recipe):  # dgrad as a ring; wgrad's operands gathered
        gemm = functools.partial(recipe.gemm, out_dtype=spec.x_dtype, fast_accumulation=fast)
        dx, xTq, g_data_t = _ring.backward(spec.sequence, gemm, g, w_kn, sw, xTq)
        g_scale_t = g.scale_t
    else:
        xTq, sx = _sp.gather_scaled(col, xTq, sx, 2)
        g_data, g_scale_nk = _sp.gather_scaled(row, g.data, g.scale, 1)
        if row is not None and recipe.per_tensor_scale:
            g_data_t, g_scale_t = jnp.swapaxes(g_data, 1, 2), g.scale_t
        else:
            g_data_t, g_scale_t = _sp.gather_scaled(row, g.data_t, g.scale_t, 2)
        # dgrad g [B, M, N] . w [B, K, N]: column contracts the split N, row splits K
        g_data, w_kn = _sp.pin_operands(col, g_data, w_kn, 2, 2)
        g_data, w_kn = _sp.pin_operands(row, g_data, w_kn, None, 1)
        dx = _gemm_rows(rows, recipe, g_data, g_scale_nk, w_kn, sw, spec.x_dtype, fast)
        dx = _sp.scatter(col, dx, 1)
    wdt = spec.w_dtype
    if spec.rhs_k_first:
        dw = _gemm_rows(rows, recipe, xTq, sx, g_data_t, g_scale_t, wdt, fast, wgrad=True)
    else:
        dw = _gemm_rows(rows, recipe, g_data_t, g_scale_t, xTq, sx, wdt, fast, wgrad=True)
    dw = _fsdp(spec, dw, False, False)  # FSDP: reduce-scatter in the gradient dtype
    return dx, dw, g.amax, recipe.summary(g.scale)


# ----------------------------------------------------------------------------- ops
@_traced.per_context
def fwd_fn(spec: Spec):
    """Forward compute (`_fwd_impl`) as two ``custom_vmap`` ops (`cast_fn`, `gemm_fn`):
    under ``jax.vmap`` over the activations the vmapped axis becomes GEMM rows (one GEMM,
    one amax over the whole batch)."""

    def impl(x3, w3, state):
        return _fwd_impl(spec, x3, w3, state)

    return _traced.quiet_when_vmapped(_traced.traced_once(impl, "fp8_gemm_forward"), 0)


@_traced.per_context
def cast_fn(spec: Spec, n: int):
    """`_cast_input` as a ``custom_vmap``: under ``jax.vmap`` over the activations the
    vmapped axis becomes rows of one cast (one amax); its copies come back split again."""

    def impl(x3, state):
        return _cast_input(spec, n, x3, state)

    fn = custom_vmap(impl)

    @fn.def_vmap
    def rule(axis_size, in_batched, x3, state):
        xb, sb = in_batched
        if axis_size == 0:
            raise ValueError(
                f"Fp8DotGeneral: vmapped over an axis of size 0 (each example's input "
                f"{tuple(x3.shape[1:])}): no rows, so no amax for the FP8 scales."
            )
        if not xb or any(jax.tree_util.tree_leaves(sb)):
            return _traced.decide_loudly(x3, _traced.fallback_vmap, impl, in_batched, (x3, state))
        merged = _traced.merge(x3, axis_size)
        data, scale, xr, *others = _traced.decide_loudly(x3, fn, merged, state)
        fp8 = xr.dtype == spec.config.input_dtype
        per_row = fp8 and _traced.rows_scale(scale, merged.shape[1])
        data = _traced.split_rows(data, axis_size)
        scale = _traced.split_rows(scale, axis_size) if per_row else scale
        xr = _traced.split_cols(xr, axis_size) if fp8 else _traced.split_rows(xr, axis_size)
        return (data, scale, xr, *others), (True, per_row, True) + (False,) * len(others)

    return fn


@_traced.per_context
def gemm_fn(spec: Spec):
    """`_weight_gemm` as a ``custom_vmap``: activations vmapped (the weight and state not)
    are one GEMM over all their rows."""

    def impl(x_data, x_scale, w3, state, sw, sg):
        return _weight_gemm(spec, x_data, x_scale, w3, state, sw, sg)

    fn = custom_vmap(impl)

    @fn.def_vmap
    def rule(axis_size, in_batched, *args):
        xb, scale_b, *others_b = in_batched
        if not xb or any(jax.tree_util.tree_leaves(others_b)):
            return _traced.fallback_vmap(impl, in_batched, args)
        x_data, x_scale, *others = args
        x_scale = _traced.merge(x_scale, axis_size) if scale_b else x_scale
        y, *res = fn(_traced.merge(x_data, axis_size), x_scale, *others)
        return (_traced.split_rows(y, axis_size), *res), (True,) + (False,) * len(res)

    return fn


@_traced.per_context
def bwd_fn(spec: Spec):
    """Backward compute as a ``custom_vmap`` (mirror of `fwd_fn`)."""

    def impl(res, g_scale, g_history, g3):
        return _bwd_impl(spec, res, g_scale, g_history, g3)

    fn = custom_vmap(_traced.traced_once(impl, "fp8_gemm_backward"))

    @fn.def_vmap
    def rule(axis_size, in_batched, res, g_scale, g_history, g3):
        rb, sb, hb, gb = in_batched
        x_b, w_b, *others_b = rb
        if not (x_b and gb) or w_b or any(others_b) or sb or hb:
            return _traced.fallback_vmap(impl, in_batched, (res, g_scale, g_history, g3))
        xr = res[0]
        fp8 = xr.dtype == spec.config.input_dtype
        if fp8:  # [V, B, K, M] -> [B, K, V*M]
            perm = (*range(1, xr.ndim - 1), 0, xr.ndim - 1)
            xm = lax.transpose(xr, perm).reshape(*xr.shape[1:-1], -1)
        else:
            xm = _traced.merge(xr, axis_size)
        dx, dw, ag, sg = fn((xm, *res[1:]), g_scale, g_history, _traced.merge(g3, axis_size))
        return (_traced.split_rows(dx, axis_size), dw, ag, sg), (True, False, False, False)

    return _traced.quiet_when_vmapped(fn, 3)


# ----------------------------------------------------------------------------- custom VJP
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_dot3(spec: Spec, x3, w3, state):
    """FP8 ``[B,M,K] x [B,N,K] -> [B,M,N]``; ``state``: `STATE_FIELDS` as `_state.MAX_GRAD`."""
    y, _ = fwd_fn(spec)(x3, w3, _state.values(state))
    return y


def _fp8_dot3_fwd(spec, x3, w3, state):
    values = _state.values(state)
    y, (xr, wr, *scalars) = fwd_fn(spec)(x3, w3, values)
    res = (
        checkpoint_name(xr, INPUT_RESIDUAL),
        checkpoint_name(wr, KERNEL_RESIDUAL),
        *(checkpoint_name(s, SCALAR_RESIDUALS) for s in scalars),
    )
    return y, (res, values)


def _fp8_dot3_bwd(spec, residuals, g3):
    res, state = residuals
    g_h = state[5]  # the output gradient's amax history
    *res, g_known = res  # the output gradient's scale, or its old one (`_fwd_impl`)
    dx, dw, ag, sg = bwd_fn(spec)(tuple(res), g_known, g_h, g3)
    xr, _, sx, sw, ax, aw = res
    if xr.dtype != spec.config.input_dtype:  # ran in the input precision: propose nothing
        return dx, dw, _state.no_proposal(state)
    summary = spec.config.recipe.summary  # per-tensor: the scale itself
    observed = _update.observed_amaxes(ax, aw, ag)
    proposed = _update.new_state(state, summary(sx), summary(sw), sg, observed, spec.config)
    return dx, dw, _state.proposal(proposed)


fp8_dot3.defvjp(_fp8_dot3_fwd, _fp8_dot3_bwd)
