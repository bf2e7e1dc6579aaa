"""FP8 flash attention with its gradient: `flash_fp8_mgpu.flash_fp8` forward and
`flash_fp8_bwd_mgpu.flash_fp8_bwd` backward joined by a ``jax.custom_vjp``.

The cotangents of the e4m3 ``q, k, v`` are those of the e4m3 values themselves (the
dequantized values' gradients times the scales, bf16), so a quantization in front,
``q8 = (x / s).astype(e4m3)``, passes the straight-through gradient on to ``x``; the scales
get none (they come from amax, not from the loss).
"""

from __future__ import annotations

import functools

import jax

from . import flash_fp8_bwd_mgpu as _bwd
from . import flash_fp8_mgpu as _fwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def flash_fp8_attention(
    q, k, v, q_scale, k_scale, v_scale, causal=False, softmax_scale=None,
    config=None, bwd_config=_bwd.Config(), interpret=False,
):  # fmt: skip
    """``softmax(sm * Q K^T) V`` of e4m3 ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]`` with
    per-tensor scales, differentiable with respect to ``q, k, v``.

    Arguments:
        q, k, v, q_scale, k_scale, v_scale, causal, softmax_scale, config, interpret: as
            `flash_fp8` (``config`` its tiles).
        bwd_config: the backward's tiles (`flash_fp8_bwd_mgpu.Config`).

    Returns:
        ``out [B, Sq, Hq, D]`` bf16.
    """
    args = (q, k, v, q_scale, k_scale, v_scale, causal, softmax_scale, config, bwd_config)
    return _forward(*args, interpret)[0]


def _forward(q, k, v, q_scale, k_scale, v_scale, causal, softmax_scale, config, bwd_config,
             interpret):  # fmt: skip
    del bwd_config
    out, lse = _fwd.flash_fp8(
        q, k, v, q_scale, k_scale, v_scale, causal=causal, softmax_scale=softmax_scale,
        config=config, interpret=interpret,
    )  # fmt: skip
    return out, (q, k, v, q_scale, k_scale, v_scale, out, lse)


def _backward(causal, softmax_scale, config, bwd_config, interpret, residuals, dout):
    del config
    dq, dk, dv = _bwd.flash_fp8_bwd(
        *residuals, dout, causal=causal, softmax_scale=softmax_scale, config=bwd_config,
        interpret=interpret, wrt_fp8=True,
    )  # fmt: skip
    return dq, dk, dv, None, None, None


flash_fp8_attention.defvjp(_forward, _backward)
