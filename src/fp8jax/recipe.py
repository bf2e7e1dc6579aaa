"""FP8 recipes: how a tensor's scale is chosen, how the tensor is cast, and how the GEMM
of two cast tensors is dequantized. Ops ask their config's recipe (`Fp8Config.recipe`)
instead of branching on config fields, so a new recipe (row-wise, block-wise) is a new
class here plus its kernels behind `fp8jax.kernels.gemm`'s seam.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array

from . import quant as q
from .kernels import gemm as _gemm
from .state import from_history

F32 = jnp.float32


class Cast(NamedTuple):
    """A tensor in FP8, in both layouts, with the scale it was cast with and its amax."""

    data: Array  # [B, P, C]
    data_t: Array  # [B, C, P]
    # dequantization factor(s), as the state keeps them: real ~ data * gemm_scale(scale)
    scale: Array
    amax: Array  # max |t| this step (non-finite if t held NaN/Inf)


@dataclasses.dataclass(frozen=True)
class PerTensor:
    """One scale per tensor (flax's and Transformer Engine's default recipe).

    ``delayed``: the scale comes from the amax history of earlier steps, so the cast
    needs one pass and the amax is its by-product. Otherwise ("current") the scale
    comes from this step's amax, one extra reduction before the cast.
    """

    delayed: bool = True
    algo: str = "max"  # over the history: "max" or "most_recent"
    margin: float = 0.0
    cast_kernel: bool = False

    @property
    def name(self) -> str:
        return "per-tensor-" + ("delayed" if self.delayed else "current")

    @property
    def scale_known_before_cast(self) -> bool:
        """Whether the scale is fixed before the tensor is read (fusable kernels need it)."""
        return self.delayed

    def history_length(self, configured: int) -> int:
        """Amax entries the state keeps (current scaling keeps the last one only)."""
        return configured if self.delayed else 1

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        del shape
        return (1,)

    def scale(
        self, history: Array, old_scale: Array, dtype, amax: Array | None = None, axis: int = -1
    ) -> Array:
        """The scale to cast with this step: from ``history`` along ``axis`` (delayed) or
        from ``amax``, the tensor's own (current); ``old_scale`` where neither is usable."""
        if self.delayed:
            amax = jnp.squeeze(from_history(history, self.algo, axis=axis), axis)
        return q.scale_from_amax(amax, old_scale, dtype, self.margin)

    def quantize_both(self, t: Array, old_scale: Array, history: Array, dtype) -> Cast:
        """``t: [B, P, C]`` cast to FP8 in both layouts (`fp8jax.kernels.gemm.quantize_both`)."""
        if self.delayed:
            scale = self.scale(history, old_scale, dtype)
            cast = _gemm.quantize_both(t, _gemm.gemm_scale(scale), dtype, self.cast_kernel)
            data, data_t, amax = cast
        else:
            amax = q.amax(t)
            scale = self.scale(history, old_scale, dtype, amax)
            cast = _gemm.quantize_both(t, _gemm.gemm_scale(scale), dtype, self.cast_kernel)
            data, data_t, _ = cast
        return Cast(data, data_t, scale, amax)

    def quantize(self, t: Array, scale: Array, dtype) -> Array:
        return q.quantize(t, scale, dtype)

    def dequantize(self, data: Array, scale: Array, dtype) -> Array:
        return (data.astype(F32) * scale.astype(F32)).astype(dtype)

    def gemm(
        self, a: Array, a_scale: Array, b: Array, b_scale: Array, out_dtype, fast_accumulation: bool
    ) -> Array:
        """``a [B,P,C] . b [B,Q,C]`` in FP8, dequantized by the two scales (by cuBLASLt: the
        operands were cast with `fp8jax.kernels.gemm.gemm_scale` of them)."""
        a_scale, b_scale = _gemm.gemm_scale(a_scale), _gemm.gemm_scale(b_scale)
        return _gemm.scaled_fp8_gemm(a, a_scale, b, b_scale, out_dtype, fast_accumulation)
