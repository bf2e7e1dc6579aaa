"""Hopper flash-attention backward for the FP8 forward `flash_fp8_mgpu` (Pallas Mosaic GPU).

Gradients of ``out = softmax(sm * Q K^T) V`` with respect to the dequantized ``Q = q * q_scale``,
``K = k * k_scale``, ``V = v * v_scale`` (e4m3 ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``,
GQA: dK, dV summed over the query heads of a group), from the forward's bf16 ``out`` and
natural-log ``lse [B, Hq, Sq]`` and the bf16 ``dout``. With ``delta = rowsum(dO * O)``,
``P = exp(sm * Q K^T - lse)``, ``dP = dO V^T`` and ``dS = P (dP - delta)``:
``dV = P^T dO``, ``dK = sm dS^T Q``, ``dQ = sm dS K``.

Structured as JAX's Hopper attention backward (``attention_mgpu._attention_bwd``): two
kernels, each with two compute warpgroups and a third that only issues TMA loads into a ring
of ``max_concurrent_steps`` slots (manual barriers, as `flash_fp8_mgpu`):

* dK/dV: a warpgroup owns ``block_kv`` keys of one query head (K and V tiles in shared
  memory) and streams the Q, dO, lse and delta blocks: ``S^T = K Q^T``, ``P^T``,
  ``dV += P^T dO``, ``dP^T = V dO^T``, ``dS^T``, ``dK += dS^T Q``. With GQA each query head
  writes its own dK, dV and XLA sums a group's;
* dQ: a warpgroup owns ``block_q`` query rows (Q and dO in shared memory) and streams the K
  and V blocks: ``S = Q K^T``, ``P``, ``dP = dO V^T``, ``dS``, ``dQ += dS K``.

This first version runs the matmuls in bf16: q, k, v are upcast from e4m3 to bf16 by XLA
before the kernels (exact; the scales stay float32 scalars applied to the logits, dP and the
results), P and dS are recomputed in float32 and rounded to bf16 for their ``wgmma``. Causal
(``Sq == Sk``, top-left): blocks past the diagonal are skipped, the ones it crosses masked.

`flash_fp8_bwd_reference` is the math in plain float32 JAX. ``interpret=True`` runs the
kernels in Pallas' GPU interpret mode (CPU, tests), a dot standing in for each ``wgmma``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def _softmax_scale(head_dim: int, softmax_scale) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def _scalar(x):
    return jnp.asarray(x, F32).reshape(())


# ----------------------------------------------------------------------------- reference
@functools.partial(jax.jit, static_argnames=("causal", "softmax_scale"))
def flash_fp8_bwd_reference(
    q, k, v, q_scale, k_scale, v_scale, out, lse, dout, *, causal=False, softmax_scale=None
):
    """The attention backward in plain float32 JAX (P recomputed from ``lse``).

    Arguments:
        q, k, v: ``[B, Sq, Hq, D]``, ``[B, Sk, Hkv, D]`` float8_e4m3fn (``Hq % Hkv == 0``).
        q_scale, k_scale, v_scale: per-tensor float32 scales (value = fp8 * scale).
        out: the forward's ``[B, Sq, Hq, D]`` output; lse: its ``[B, Hq, Sq]`` natural-log
            log-sum-exp of the scaled logits.
        dout: the output's cotangent ``[B, Sq, Hq, D]``.
        causal: keys after the query masked (``Sq == Sk``, top-left aligned).
        softmax_scale: the logits' scale, ``1/sqrt(D)`` when None.

    Returns:
        ``(dq, dk, dv)`` bf16, the gradients with respect to the dequantized q, k, v.
    """
    (b, sq, hq, d), (sk, hkv) = q.shape, k.shape[1:3]
    g, sm = hq // hkv, _softmax_scale(d, softmax_scale)
    hi = lax.Precision.HIGHEST
    qf = (q.astype(F32) * _scalar(q_scale)).reshape(b, sq, hkv, g, d)
    kf, vf = k.astype(F32) * _scalar(k_scale), v.astype(F32) * _scalar(v_scale)
    do = dout.astype(F32).reshape(b, sq, hkv, g, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, kf, precision=hi) * sm
    if causal:
        s = jnp.where(jnp.arange(sq)[:, None] >= jnp.arange(sk)[None, :], s, -jnp.inf)
    p = jnp.exp(s - lse.astype(F32).reshape(b, hkv, g, sq)[..., None])
    delta = jnp.einsum("bqhgd,bqhgd->bhgq", do, out.astype(F32).reshape(do.shape), precision=hi)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", do, vf, precision=hi)
    ds = p * (dp - delta[..., None])
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, do, precision=hi)
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qf, precision=hi) * sm
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, kf, precision=hi).reshape(b, sq, hq, d) * sm
    return tuple(x.astype(jnp.bfloat16) for x in (dq, dk, dv))
