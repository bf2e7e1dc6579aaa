"""The FP8 inference dot: `Fp8InferenceDot` (``jax.lax.dot_general``'s signature over an e4m3
kernel), its one FP8 GEMM (`fp8_matmul`, which `fp8jax._inference.Fp8InferenceLinear` runs too),
and the weight cast of `fp8jax.to_inference` (`quantize_kernel`, the frozen input scale).

Below `fp8jax._inference` and the haliax and nnx inference adapters
(`fp8jax._interop.inference`, `fp8jax._interop.nnx_inference`), which all share it.
"""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array

from . import _checks as checks
from . import _quant as q
from ._kernels import gemm as _gemm
from ._ops.traced import under_vmap as _under_vmap
from ._state import from_history

E4M3 = jnp.float8_e4m3fn
F32 = jnp.float32
_ROW_ALIGNMENT = 16  # cuBLASLt FP8 GEMMs want every dim a multiple of 16


def fp8_matmul(x, weight, weight_scale, input_scale, margin: float, fast: bool, out_dtype):
    """``x [M, K] @ dequant(weight [N, K]).T`` as one FP8 GEMM: ``x`` cast to e4m3 with
    ``input_scale`` (None: from its own amax), both operands contracting on their minor
    dim, ``out_dtype`` out; then ``input_scale * weight_scale`` (``[1]`` or ``[N]``, one
    per output column) applied to the product."""
    m = x.shape[0]
    if input_scale is None:  # current scaling: this call's amax
        scale = q.scale_from_amax(q.amax(x), jnp.ones((1,), F32), E4M3, margin)
        input_scale = _gemm.gemm_scale(scale)  # on the grid training's casts use
    xq = q.quantize(x, input_scale, E4M3)
    pad = 0 if _under_vmap(x) else -m % _ROW_ALIGNMENT
    if pad:
        xq = jnp.pad(xq, ((0, pad), (0, 0)))
    precision = _gemm.gemm_precision(fast)
    y = _gemm.gemm(xq[None], weight[None], out_dtype, precision)[0, :m]
    scale = input_scale.astype(F32).reshape(()) * weight_scale.astype(F32)
    return (y.astype(F32) * scale).astype(out_dtype)


class Fp8InferenceDot(eqx.Module):
    """``jax.lax.dot_general``'s signature over an e4m3 kernel (``rhs``), with the kernel's
    scale(s) and the frozen input scale: what `to_inference` puts in a haliax or flax nnx
    layer's ``dot_general``. Any contracting dims (no batch dims): the operands are brought
    to ``[M, K]`` and ``[N, K]`` (K-major, as `Fp8DotGeneral` does; a kernel stored
    ``[in, out]`` is transposed per call); ``weight_scale`` is ``[1]`` or one per output
    feature (``N``, the kernel's free dims in their order)."""

    weight_scale: Array
    input_scale: Array | None
    margin: float = eqx.field(static=True)
    fast_accumulation: bool = eqx.field(static=True)

    def __call__(
        self,
        lhs,
        rhs,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ):
        del precision  # the FP8 GEMM's accumulation is fast_accumulation's
        if out_sharding is not None:
            raise NotImplementedError("Fp8InferenceDot: out_sharding is not supported.")
        lhs = checks.float_array("Fp8InferenceDot", "lhs", jnp.asarray(lhs))
        if rhs.dtype != E4M3:
            raise TypeError(
                f"Fp8InferenceDot: the kernel (rhs) must be float8_e4m3fn, got "
                f"{rhs.dtype}; convert the model with fp8jax.to_inference."
            )
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (tuple(int(i) for i in d) for d in (lc, rc, lb, rb))
        lf = tuple(i for i in range(lhs.ndim) if i not in lc + lb)
        rf = tuple(i for i in range(rhs.ndim) if i not in rc + rb)
        if lb or rb:
            raise NotImplementedError("Fp8InferenceDot: batch dimensions are not supported.")
        m_shape = tuple(lhs.shape[i] for i in lf)
        n_shape = tuple(rhs.shape[i] for i in rf)
        k = math.prod(lhs.shape[i] for i in lc)
        x2 = jnp.transpose(lhs, lf + lc).reshape(-1, k)
        w2 = jnp.transpose(rhs, rf + rc).reshape(-1, k)
        out_dtype = preferred_element_type or lhs.dtype
        y = fp8_matmul(
            x2,
            w2,
            self.weight_scale,
            self.input_scale,
            self.margin,
            self.fast_accumulation,
            out_dtype,
        )
        return y.reshape(m_shape + n_shape)


def quantize_kernel(
    w, stack: int, in_axes: tuple[int, ...], weight_scaling: str, margin: float
) -> tuple[Array, Array]:
    """(e4m3 kernel, ``[*stack, 1]`` or ``[*stack, N]`` dequantization scale) of a kernel
    whose first ``stack`` dims are layers and ``in_axes`` its contracting dims: the amax
    over the whole matrix (``"tensor"``) or over ``in_axes`` for each output feature
    (``"channel"``; N: the kernel's other dims, in their order)."""
    w = jnp.asarray(w, F32)
    free = tuple(i for i in range(stack, w.ndim) if i not in in_axes)
    reduce = tuple(range(stack, w.ndim)) if weight_scaling == "tensor" else in_axes
    amax = jnp.max(jnp.abs(w), axis=reduce, keepdims=True)
    # on the grid of training's casts (`fp8jax._kernels.gemm.gemm_scale`): the same FP8 values
    scale = _gemm.gemm_scale(q.scale_from_amax(amax, jnp.ones_like(amax), E4M3, margin))
    n = 1 if weight_scaling == "tensor" else math.prod(w.shape[i] for i in free)
    return q.saturate(w, 1.0 / scale, E4M3), scale.reshape(w.shape[:stack] + (n,))


def _frozen_input_scale(layer: Any) -> Array:
    """The input scale delayed scaling would use next: from the amax history with the
    layer's algorithm and margin (its current scale where the history holds no amax).
    ``layer``: an FP8-trained layer, its ``dot_general`` an `fp8jax.Fp8DotGeneral`."""
    op = layer.dot_general
    cfg = op.config
    amax = from_history(op.input_amax_history, cfg.amax_compute_algo, axis=-1)
    return _gemm.gemm_scale(q.scale_from_amax(amax, op.input_scale, E4M3, cfg.margin))
