"""The FP8 state a use of a layer proposes after its step (`fp8jax._ops.dot`,
`fp8jax._ops.gated`): the scales it used, its amaxes recorded, anomalies counted."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _quant as q
from .. import _state
from .._config import Fp8Config

F32 = jnp.float32


def observed_amaxes(ax, aw, ag):
    """What one use saw: ``[amax_x, amax_w, amax_g, nonfinite flag]``, non-finite
    amaxes zeroed and flagged. Each amax is a scalar or a cast kernel's tile maxima
    (`q.combined_max`)."""
    observed, bad = q.sanitize_amax(q.combined_max(ax, aw, ag))
    # Behind a barrier: the tile maxima's reduction runs once, in its own kernel. Without it
    # XLA (jax 0.11.2) fused it into the loop over the history update and recomputed it per
    # history entry, which cost the flax linen step its whole FP8 gain (issue 47;
    # benchmarks/RESULTS.md, "Front doors (issue 47)").
    flag = lax.reshape(lax.reduce_max(bad, tuple(range(bad.ndim))), (1,))
    return jax.lax.optimization_barrier(lax.concatenate([observed, flag], 0))


def new_state(state, sx, sw, sg, observed, config: Fp8Config | None = None):
    """The float32 state one use proposes: the scales it used, its amaxes recorded
    (`_state.record`), its non-finite flag counted. Histories of one length are recorded
    as one ``[3, L]`` update (one kernel where three separate ones compiled three).

    With ``config``, an outlier amax is recorded as 0 where its recipe says so (delayed
    scaling: `fp8jax._recipe.PerTensor.screen`). Corrupt fields of the old state (NaN, Inf or
    negative history entries, scales not finite and positive: `_state.needs_repair`) come
    out repaired: the scales used were computed without them, the histories record them as
    0. ``nonfinite_count`` counts one per kind of anomaly in the step: a non-finite amax,
    a rejected outlier, a repaired state. A few scalar selects and one reduction over the
    histories, fused with their update: no host callback, no ``lax.cond``."""
    in_s, k_s, g_s, in_h, k_h, g_h, nonfinite = state
    histories = (in_h, k_h, g_h)
    if len({h.shape for h in histories}) == 1 and in_h.ndim == 1:
        return _new_state_stacked(state, sx, sw, sg, observed, config)
    repaired = _state.needs_repair((in_s, k_s, g_s), histories, nonfinite)
    histories = tuple(map(_state.clean_amax, histories))
    histories = tuple(_state.record(h, a) for h, a in zip(histories, observed[:3]))
    return (
        sx.astype(in_s.dtype),
        sw.astype(k_s.dtype),
        sg.astype(g_s.dtype),
        *histories,
        _state.clean_amax(nonfinite) + observed[3] + repaired,
    )


def _new_state_stacked(state, sx, sw, sg, observed, config: Fp8Config | None):
    """`new_state` for three ``[L]`` histories: they are stacked once into ``[3, L]`` and
    checked, cleaned, screened and recorded in one go, and the scalar fields are checked as
    one vector (the same values as field by field, in about half the ops to trace and
    lower: issue 21)."""
    in_s, k_s, g_s, in_h, k_h, g_h, nonfinite = state
    stacked = jnp.stack((in_h, k_h, g_h)).astype(F32)
    # Corrupt entries per history: the forward's reduction (`_state.history_stats`, shared).
    stats, valid = _state.history_stats(stacked, with_valid=True)
    clean = lax.select(valid, stacked, lax.full_like(stacked, 0))  # `_state.clean_amax`
    first = lax.slice_in_dim(clean, 0, 1, axis=1)  # the newest entries, [3, 1]
    # The scales must be positive, the count >= 0 (`_state.needs_repair`): ``s != 0`` for the
    # scales, ``s != NaN`` (always true) for the count.
    fields = (in_s, k_s, g_s, nonfinite)
    scalars = lax.concatenate([jnp.asarray(x, F32).reshape(1) for x in fields], 0)
    usable, scalars_clean = _state.checked_amax(scalars)
    nonzero = lax.ne(scalars, np.array([0.0, 0.0, 0.0, np.nan], np.float32))
    corrupt = lax.squeeze(lax.slice_in_dim(stats, 1, 2, axis=1), (1,))
    bad = lax.convert_element_type(lax.bitwise_not(lax.bitwise_and(usable, nonzero)), F32)
    bad = lax.concatenate([bad, corrupt], 0)
    repaired = functools.reduce(lax.max, lax.split(bad, (1,) * 7))
    amaxes, rejected = observed[:3], jnp.zeros((), F32)
    if config is not None:
        dtypes = (config.input_dtype, config.kernel_dtype, config.grad_dtype)
        amaxes, rejected = config.recipe.screen(amaxes, lax.squeeze(first, (1,)), dtypes)
    recorded = lax.split(_state.record(clean, amaxes, axis=1), (1, 1, 1), 0)
    count = lax.add(lax.slice_in_dim(scalars_clean, 3, 4), lax.slice_in_dim(observed, 3, 4))
    return (
        sx.astype(in_s.dtype),
        sw.astype(k_s.dtype),
        sg.astype(g_s.dtype),
        *(lax.squeeze(h, (0,)) for h in recorded),
        lax.add(lax.add(count, rejected), repaired),
    )
