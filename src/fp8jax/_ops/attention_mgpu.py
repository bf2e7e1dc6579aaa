"""The ``"mgpu"`` backend of `fp8jax._ops.attention`: fp8jax's own Hopper FP8 flash attention
(`fp8jax._kernels.flash_fp8_mgpu` forward, `fp8jax._kernels.flash_fp8_bwd_mgpu` backward,
the pair `fp8jax._kernels.flash_fp8_vjp` joins) in the place of cuDNN's.

The op's custom VJP stays the same (the same casts of q, k, v and dO with the state's
scales, the same state update); only the kernel calls differ. The kernels return bf16 O and
dQ, dK, dV where cuDNN writes them in e4m3. They are passed on as they are: rounding them to
e4m3 and back would cost a pass each and the gradients' precision, where cuDNN has no
choice. Their amaxes are recorded as on cuDNN, and O is cast to e4m3 for the backward's
residual (`fp8jax._ops.attention._forward_impl`). P and dS stay inside the kernels (P's
scale is fixed, dS's comes from a bound: `BWD_CONFIG`): ``s`` and ``dp`` record no amax
(0, "not observed": their scales stay as they are).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _quant as qt
from .._kernels import flash_fp8_bwd_mgpu as _bwd
from .._kernels import flash_fp8_mgpu as _fwd

E4M3 = jnp.float8_e4m3fn
BACKENDS = ("mgpu", "mgpu-interpret")  # the second: Pallas' interpreter (CPU tests)
# The backward's five products on e4m3 (dO and dS with their own scales): the FP8 modes'
# backward, as cuDNN's FP8 path runs it (accuracy and speed against bf16: RESULTS.md).
BWD_CONFIG = _bwd.Config(fp8=True)
# The kernels' named scope: `fp8jax.inspect.fp8_gemm_report` counts the Mosaic GPU calls
# under it as FP8 GEMMs (their Q K^T, P V and backward products run e4m3 wgmma).
FLASH_SCOPE = "fp8jax_flash_attention"


def reason(q_shape, k_shape, causal: bool, interpret: bool) -> str | None:
    """Why the kernels cannot run ``q [B, T, N, H]``, ``k/v [B, S, K, H]`` (None: they can);
    with ``interpret`` only the shape rules (the interpreter needs no GPU)."""
    for module, config in ((_fwd, None), (_bwd, BWD_CONFIG)):
        if interpret:
            why = module._shape_reason(q_shape, k_shape, E4M3, causal, config)
        else:
            why = module.reason(q_shape, k_shape, E4M3, causal, config)
        if why is not None:
            return why
    return None


def forward(spec, q8, k8, v8, s_q, s_k, s_v, s_o):
    """``(o, amax_s, amax_o, lse)`` as cuDNN's forward returns them, but ``o`` the kernel's
    bf16 output (``amax_s``: 0)."""
    with jax.named_scope(FLASH_SCOPE):
        out, lse = _fwd.flash_fp8(
            q8, k8, v8, s_q, s_k, s_v, causal=spec.causal, softmax_scale=spec.softmax_scale,
            interpret=spec.backend == "mgpu-interpret",
        )  # fmt: skip
    del s_o  # o is not rounded to e4m3 here (the caller casts its residual)
    return out, jnp.zeros((), jnp.float32), qt.amax(out), lse


def backward(spec, q8, k8, v8, o8, do8, lse, scales: dict):
    """``(dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp)`` as cuDNN's backward returns
    them, but the gradients bf16, as the kernels write them (``amax_dp``: 0); ``scales`` maps
    the tensors' names to their scales."""
    with jax.named_scope(FLASH_SCOPE):
        grads = _bwd.flash_fp8_bwd(  # o8, do8 with their scales: dO is not cast again
            q8, k8, v8, scales["q"], scales["k"], scales["v"], o8, lse, do8,
            causal=spec.causal, softmax_scale=spec.softmax_scale, config=BWD_CONFIG,
            interpret=spec.backend == "mgpu-interpret", out_scale=scales["o"],
            dout_scale=scales["do"],
        )  # fmt: skip
    return (*grads, *(qt.amax(g) for g in grads), jnp.zeros((), jnp.float32))
