"""Pure functions for FP8 scaling math (flax / Transformer Engine conventions).

Scales are *dequantization* factors: ``real ~= fp8_value * scale``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

F32 = jnp.float32


def fp8_max(dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def saturate(x: Array, inv_scale, dtype) -> Array:
    """Cast ``x * inv_scale`` to ``dtype`` with saturation (no inf from overflow); the
    one cast of XLA's path and of the Pallas kernels (their FP8 bits must agree)."""
    limit = fp8_max(dtype)
    # lax ops, not jnp.clip/where: the FP8 step calls these many times per layer, and each
    # jnp call is a nested jit to trace (a quarter of an FP8 step's lowering time).
    scaled = x.astype(F32) * inv_scale
    return lax.clamp(F32(-limit), scaled, F32(limit)).astype(dtype)


def saturate_in_kernel(x: Array, inv_scale, dtype) -> Array:
    """`saturate` inside a Pallas Triton kernel (see `clamp_in_kernel`)."""
    return clamp_in_kernel(x.astype(F32) * inv_scale, dtype)


def clamp_in_kernel(scaled: Array, dtype) -> Array:
    """Float32 ``scaled`` clamped to ``dtype``'s range and cast, inside a Pallas Triton
    kernel: Triton's clamp gives the bound for a NaN (XLA's keeps the NaN), which would turn
    a NaN input into finite FP8 values that no later step could tell apart; the select keeps
    it NaN, as XLA's path does."""
    limit = fp8_max(dtype)
    clamped = lax.clamp(F32(-limit), scaled, F32(limit))  # F32(-x): Pallas lowers these
    return lax.select(lax.ne(scaled, scaled), scaled, clamped).astype(dtype)


def quantize(x: Array, scale: Float[Array, "1"], dtype) -> Array:
    """Cast ``x / scale`` to ``dtype`` with saturation (no inf from overflow)."""
    return saturate(x, (1.0 / scale.astype(F32)).reshape(()), dtype)


def amax(x: Array) -> Float[Array, ""]:
    """max |x| as float32, non-finite if ``x`` holds a NaN (a NaN step must be counted, not
    recorded as the finite max). XLA's GPU max propagates NaN: there it is the plain
    reduction, which XLA fuses with the tensor's producer and cast. Other backends' max may
    drop NaN (the CPU's vectorized one does), so they map NaN to inf first (`tile_amax`)."""
    if jax.default_backend() == "gpu":
        return lax.reduce_max(lax.abs(x.astype(F32)), tuple(range(x.ndim)))
    return tile_amax(x)


def tile_amax(x: Array, axis=None) -> Array:
    """max |x| (over ``axis``, default all) as float32, inf where ``x`` holds a NaN: a
    tile's amax must come out non-finite (`sanitize_amax` then keeps it out of the
    history) whatever max's NaN convention is on the backend."""
    magnitude = lax.abs(lax.convert_element_type(x, F32))
    nan = lax.ne(magnitude, magnitude)
    magnitude = lax.select(nan, lax.full_like(magnitude, np.inf), magnitude)
    axes = range(x.ndim) if axis is None else np.atleast_1d(axis) % max(x.ndim, 1)
    return lax.reduce_max(magnitude, tuple(int(a) for a in axes))


def combined_max(*amaxes: Array) -> Float[Array, " n"]:
    """``[max(a) for a in amaxes]`` as float32, in one reduction: each amax is a scalar or
    a cast kernel's per-tile maxima (`fp8jax._kernels.cast.cast_transpose` with
    ``tiles=True``), padded with zeros (amaxes are >= 0) to a common length and reduced
    together: one small kernel in the backward's state update where a reduction after each
    cast made three per op. A NaN or Inf stays non-finite."""
    if all(np.size(a) == 1 for a in amaxes):  # lax ops: few to trace per layer (issue 21)
        flat = [lax.reshape(lax.convert_element_type(a, F32), (1,)) for a in amaxes]
        return lax.concatenate(flat, 0)
    flat = [jnp.ravel(a).astype(F32) for a in amaxes]
    width = max(f.size for f in flat)
    return jnp.max(jnp.stack([jnp.pad(f, (0, width - f.size)) for f in flat]), axis=1)


def sanitize_amax(value: Float[Array, "..."]) -> tuple[Array, Array]:
    """Split an observed amax into (finite amax or 0, 1.0 where it was NaN/Inf)."""
    value = lax.convert_element_type(value, F32)
    finite = lax.is_finite(value)
    zeros, ones = lax.full_like(value, 0), lax.full_like(value, 1)
    return lax.select(finite, value, zeros), lax.select(finite, zeros, ones)


def scale_from_amax(amax_value: Array, old_scale: Array, dtype, margin: float) -> Array:
    """flax's ``compute_scale``: amax * 2**margin / fp8_max, keeping ``old_scale`` when
    amax is zero or not finite, and never returning a zero, negative, NaN or Inf scale: a
    corrupt ``old_scale`` (one of those) is replaced by 1, the scale of a fresh state."""
    return scale_from_limit(amax_value, old_scale, fp8_max(dtype), margin)


def scale_from_limit(amax_value: Array, old_scale: Array, limit, margin: float) -> Array:
    """`scale_from_amax` with the FP8 maximum given as a number or an array (one per
    element of ``amax_value``: several tensors of different FP8 dtypes at once)."""
    amax_value = amax_value.astype(F32)
    old_scale = old_scale.astype(F32)
    sf = (jnp.asarray(limit, F32) / amax_value) / (2.0**margin)
    shape = jnp.broadcast_shapes(amax_value.shape, old_scale.shape, sf.shape)
    amax_value, sf = jnp.broadcast_to(amax_value, shape), jnp.broadcast_to(sf, shape)
    old_scale = jnp.broadcast_to(old_scale, shape)
    sane = (old_scale > 0.0) & (old_scale < jnp.inf)  # False for NaN too
    old_scale = lax.select(sane, old_scale, jnp.ones_like(old_scale))
    usable = (amax_value > 0.0) & jnp.isfinite(amax_value)
    new = 1.0 / lax.select(usable, sf, 1.0 / old_scale)
    return lax.select(jnp.isfinite(new) & (new > 0.0), new, old_scale)


_TINY = float(jnp.finfo(jnp.float32).tiny)

# Outliers under delayed scaling (`outlier_factor`): a tensor keeps this many powers of two
# below its amax in the FP8 format's normal range.
OUTLIER_KEPT_BITS = 8


def outlier_factor(dtype) -> float:
    """How many times the newest recorded amax an observed amax may be and still be
    recorded in a delayed-scaling history (`fp8jax._recipe.PerTensor.screen`):
    ``2**(floor(log2(max / smallest_normal)) - 8)``, 64 for e4m3 (448 / 2**-6 = 2**14.8),
    2**21 for e5m2 (57344 / 2**-14 = 2**29.8).

    Why: a history holding ``F`` times a tensor's typical amax ``A`` scales that tensor's
    max to ``fp8_max / F``, so its values below ``A * F * smallest_normal / fp8_max`` lose
    precision (subnormals), and a few powers of two lower they flush to zero; for the whole
    history's length (1024 steps). With the factor above, values down to ``A / 2**8.8``
    (e4m3: ``A / 448``) stay normal: a Gaussian tensor's amax is 4-6 sigma, so that is about
    sigma / 100, below which lie under 1% of the values and a negligible share of their
    energy. Recording an amax up to ``F * A`` therefore costs nothing measurable; above it
    the loss grows by a bit per doubling, until (e4m3: ``F = 2**17.8``, max over smallest
    subnormal) the tensor flushes to zero: a single 1e30 element in a batch of unit-scale
    activations made every later step's output 99.9% wrong for the next 1023 steps
    (measured on CPU). A smaller factor would reject more legitimate jumps (each costs one
    more step of saturation)."""
    span = math.log2(fp8_max(dtype) / float(jnp.finfo(dtype).smallest_normal))
    return 2.0 ** (math.floor(span) - OUTLIER_KEPT_BITS)


def tile_scales(amax: Array, dtype, margin: float = 0.0, power_of_two: bool = False) -> Array:
    """Dequantization scales of tiles from their amaxes: ``amax * 2**margin / fp8_max``;
    1 for an all-zero or non-finite tile (current scaling has no history to fall back on,
    and a NaN/Inf tile must not produce a NaN scale); rounded up to a power of two on
    request (exact to apply, and never saturating). Plain ``lax`` math (one multiply, no
    division, no ``isfinite``) so the Pallas cast kernel computes the same bits."""
    s = amax.astype(F32) * F32(2.0**margin / fp8_max(dtype))
    s = jnp.where((s > 0) & (s < jnp.inf), jnp.maximum(s, _TINY), F32(1.0))
    return ceil_power_of_two(s) if power_of_two else s


def ceil_power_of_two(s: Array) -> Array:
    """The smallest power of two >= ``s`` for positive normal float32 ``s``, exactly (a
    carry into the exponent bits; ``log2`` would round an exact power up by one)."""
    bits = lax.bitcast_convert_type(s, jnp.int32)
    bits = (bits + jnp.int32(0x7FFFFF)) & jnp.int32(0x7F800000)
    return lax.bitcast_convert_type(bits, F32)
