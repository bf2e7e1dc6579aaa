"""An activation kept for the backward as FP8 (e4m3 and one float32 scale) instead of bf16:
half its bytes, as DeepSeek-V3 (technical report, sec. 3.3) caches the SwiGLU operator's
input in FP8. `FusedMLP(fc1_out_fp8=True)` keeps fc1's output this way, on its gated core
(`fp8jax._ops.gated`) and on its XLA path (`through_fp8_residual`).

Current scaling: the scale comes from the tensor's own amax (the recipe's margin), so the
forward pays one extra read of the tensor for the amax and one read + 1-byte write for the
cast, the backward one 1-byte read + write of the restored copy (no GEMM runs again). The
rounding enters only what the backward computes from the copy (the activation's gradient
and the activation recomputed for fc2's weight gradient), never the forward's values.

Two optimization barriers make the compiled step hold the copy, not ``x``: the cast runs in
the forward (`save_fp8_before`) and the restore in the backward (`read_after`); without
them XLA kept the bf16 tensor from the forward to the backward anyway (issue 49).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array

from .. import _quant as q

E4M3 = jnp.float8_e4m3fn
F32 = jnp.float32


def margin(config) -> float:
    """The scale's headroom for a layer of `fp8jax.Fp8Config` ``config``: its recipe's margin
    (0 where it has none, or for None: a bf16 layer)."""
    return float(getattr(getattr(config, "recipe", None), "margin", 0.0))


def save_fp8(x: Array, margin: float = 0.0) -> tuple[Array, Array]:
    """``(x8, scale)``: ``x`` cast to e4m3 with the dequantization scale (``x ~= x8 *
    scale``, a float32 scalar) from its amax (``amax * 2**margin / 448``; 1 where the amax is
    zero or not finite: a NaN stays NaN, an Inf saturates)."""
    scale = q.scale_from_amax(q.amax(x), jnp.ones((), F32), E4M3, margin)
    return q.quantize(x, scale, E4M3), scale


def save_fp8_before(x: Array, margin: float, tied: Array) -> tuple[Array, tuple[Array, Array]]:
    """``(tied, (x8, scale))``: `save_fp8` of ``x``, passed through one optimization barrier
    with ``tied`` (what the forward reads next: ``x`` itself, or a later tensor computed from
    it), so that the forward goes on only once the copy exists and ``x`` can die there.
    Without it XLA fuses the cast into the backward's reader of the copy (fewer bytes
    moved), which then reads ``x`` itself: the bf16 tensor stays live from the forward to
    the backward beside the copy, and the compiled step's peak does not drop (issue 49).
    XLA:GPU honours the barrier through fusion and scheduling; XLA:CPU removes barriers
    before fusion. The values are those of `save_fp8` and ``tied``."""
    tied, x8, scale = jax.lax.optimization_barrier((tied, *save_fp8(x, margin)))
    return tied, (x8, scale)


def read_after(saved, tied: Array):
    """``(saved, tied)`` (``saved``: an ``(x8, scale)`` copy) through one optimization
    barrier, so that the backward restores the copy only once ``tied`` (a tensor of the
    backward: the cotangent) exists. Without it XLA may schedule the restore right after
    the cast, in the forward, and keep its bf16 result to the backward in place of the copy
    (issue 49)."""
    return jax.lax.optimization_barrier((saved, tied))


def restore(x8: Array, scale: Array, dtype) -> Array:
    """``x8 * scale`` in ``dtype`` (one elementwise pass)."""
    return (x8.astype(F32) * scale.astype(F32)).astype(dtype)


def through_fp8_residual(fn: Callable, x: Array, name: str, margin: float = 0.0) -> Array:
    """``fn(x)`` (the same forward, bit for bit), whose backward reads ``x`` from an FP8 copy
    (`save_fp8`) kept under the checkpoint name ``name`` (its scale too: a policy keeps or
    drops both) instead of ``x`` itself: ``fn``'s
    VJP at the restored ``x``. ``fn``: an elementwise function of ``x`` alone (no closed-over
    arrays: its cotangent is ``x``'s only).

    Arguments:
        fn: the function (hashable: a module-level function or a ``functools.partial`` of
            one with static arguments).
        x: its input.
        name: the checkpoint name of the FP8 copy (``jax.checkpoint`` policies see it).
        margin: the scale's headroom in powers of two.

    Returns:
        ``fn(x)``.
    """
    return _through(fn, name, float(margin), jnp.dtype(x.dtype), x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _through(fn, name, margin, dtype, x):
    return fn(x)


def _through_fwd(fn, name, margin, dtype, x):
    x, (x8, scale) = save_fp8_before(x, margin, x)
    return fn(x), (checkpoint_name(x8, name), checkpoint_name(scale, name))


def _through_bwd(fn, name, margin, dtype, residuals, g):
    residuals, g = read_after(residuals, g)
    _, vjp = jax.vjp(fn, restore(*residuals, dtype))
    return vjp(g)


_through.defvjp(_through_fwd, _through_bwd)
