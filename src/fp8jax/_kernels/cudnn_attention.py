"""The one place that touches JAX's private cuDNN FP8 flash-attention primitives.

JAX's private cuDNN fused-attention module (`fp8jax._jax_compat.cudnn_attention`) has had
FP8 forward/backward primitives since jax 0.4.35 (cuDNN >= 9.1); the public
``jax.nn.dot_product_attention`` has no FP8 path. We bind the primitives directly (not its
``custom_vjp``) so that the gradient of the output can be quantized with our own scale and
every scale is ours.
Everything here is checked once by `availability` and fails with a clear message.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .. import _jax_compat

F32 = jnp.float32
MIN_CUDNN = 90100
# What cuDNN's FP8 flash attention (through XLA) accepts when training. Its inference
# kernel accepts more (head_dim <= 256) but gave wrong outputs without a mask on H100
# (jax 0.11.2), so only the training kernel is used.
TRAIN_HEAD_DIM = 128
TRAIN_SEQ_MULTIPLE = 128


@functools.lru_cache(maxsize=None)
def availability() -> tuple[bool, str]:
    """``(True, "")`` when the cuDNN FP8 attention primitives can run here, else
    ``(False, why)``."""
    try:
        fa = _jax_compat.cudnn_attention()
    except ImportError as e:  # pragma: no cover - depends on the jax build
        return False, str(e)
    try:
        device = jax.devices()[0]
    except RuntimeError as e:  # pragma: no cover
        return False, str(e)
    if device.platform != "gpu":
        return False, f"no GPU (default device is {device.platform})"
    capability = getattr(device, "compute_capability", "0.0")
    if tuple(int(x) for x in str(capability).split(".")[:2]) < (9, 0):
        return False, f"FP8 attention needs compute capability >= 9.0 (Hopper), got {capability}"
    try:
        version = fa.check_cudnn_version()
    except Exception as e:  # noqa: BLE001 - any failure means "not here"
        return False, f"cuDNN not found ({e})"
    if version < MIN_CUDNN:
        return False, f"cuDNN {version} is older than 9.1, the first with FP8 attention"
    return True, ""


def _fa():
    return _jax_compat.cudnn_attention()


def limits(head_dim: int, seq_q: int, seq_kv: int) -> str | None:
    """Why cuDNN's FP8 attention (the training kernel, used for inference too) cannot
    run these sizes, or None if it can."""
    if head_dim != TRAIN_HEAD_DIM or seq_q % TRAIN_SEQ_MULTIPLE or seq_kv % TRAIN_SEQ_MULTIPLE:
        return (
            f"cuDNN FP8 attention runs only head_dim={TRAIN_HEAD_DIM} with sequence lengths "
            f"that are multiples of {TRAIN_SEQ_MULTIPLE}; got head_dim={head_dim}, "
            f"seq_q={seq_q}, seq_kv={seq_kv}"
        )
    return None


def _p(x):
    return jnp.asarray(x, F32).reshape(1, 1, 1, 1)


def forward(
    q8,
    k8,
    v8,
    *,
    descale_q,
    descale_k,
    descale_v,
    descale_s,
    scale_s,
    scale_o,
    softmax_scale: float,
    causal: bool,
    training: bool,
):
    """cuDNN FP8 attention forward on BTNH e4m3 operands.

    Returns ``(o8, amax_s, amax_o, stats)``; ``stats`` (softmax log-sum-exp, the
    backward's residual) is None when ``training`` is False.
    """
    fa = _fa()
    out = fa._dot_product_attention_fp8_fwd_p_wrapper.bind(
        q8,
        k8,
        v8,
        _p(descale_q),
        _p(descale_k),
        _p(descale_v),
        _p(descale_s),
        _p(scale_s),
        _p(scale_o),
        scale=float(softmax_scale),
        use_causal_mask=bool(causal),
        layout=fa.AttentionLayout.BTNH.value,
        is_training=bool(training),
    )
    o8, amax_s, amax_o = out[0], out[1], out[2]
    stats = out[3] if training else None
    return o8, amax_s.reshape(()), amax_o.reshape(()), stats


# The roles XLA gives the twelve scale operands of the FP8 backward custom call, in the
# order JAX's primitive binds them (jax 0.11.2 / cuDNN 9.19, measured on H100 by doubling
# one operand at a time: benchmarks/_probe_cudnn_fp8.py, checked by tests/test_gpu.py).
# JAX binds them in its own documented order, which differs from the one XLA reads from
# the fourth operand on; with all scales 1 (JAX's own tests) the two cannot be told apart.
BWD_OPERAND_ROLES = (
    "descale_q",
    "descale_k",
    "descale_v",
    "descale_s",
    "descale_o",
    "descale_do",
    "descale_dp",
    "scale_s",
    "scale_dp",
    "scale_dq",
    "scale_dk",
    "scale_dv",
)
# cuDNN's FP8 backward beats bf16 while batch * heads <= 32 and falls well behind it beyond
# (cuDNN 9.19; benchmarks/RESULTS.md, "Attention", 2026-11-23: what was found on the way):
# larger problems run as several calls of at most this many (batch, head) pairs.
BWD_MAX_BATCH_HEADS = 32


def _bwd_call(q8, k8, v8, o8, do8, stats, scales: dict, softmax_scale: float, causal: bool):
    fa = _fa()
    out = fa._dot_product_attention_fp8_bwd_p_wrapper.bind(
        q8,
        k8,
        v8,
        o8,
        do8,
        stats,
        *(_p(scales[role]) for role in BWD_OPERAND_ROLES),
        scale=float(softmax_scale),
        use_causal_mask=bool(causal),
        layout=fa.AttentionLayout.BTNH.value,
    )
    return out[:3], jnp.stack([a.reshape(()) for a in out[3:7]])


def backward_chunks(batch: int, heads: int, kv_heads: int, limit: int | None = None):
    """``(batch_chunk, kv_heads_chunk)``: the largest chunk sizes dividing ``batch`` and
    ``kv_heads`` with ``batch_chunk * query_heads_chunk <= limit`` (default
    `BWD_MAX_BATCH_HEADS`, read at trace time; whole problem if it fits)."""
    limit = BWD_MAX_BATCH_HEADS if limit is None else limit
    group = heads // kv_heads
    kv_chunk = max(
        [d for d in range(1, kv_heads + 1) if kv_heads % d == 0 and d * group <= limit] or [1]
    )
    per_batch = kv_chunk * group
    b_chunk = max(
        [d for d in range(1, batch + 1) if batch % d == 0 and d * per_batch <= limit] or [1]
    )
    return b_chunk, kv_chunk


def backward(
    q8,
    k8,
    v8,
    o8,
    do8,
    stats,
    *,
    descale_q,
    descale_k,
    descale_v,
    descale_o,
    descale_do,
    descale_s,
    descale_dp,
    scale_s,
    scale_dq,
    scale_dk,
    scale_dv,
    scale_dp,
    softmax_scale: float,
    causal: bool,
):
    """cuDNN FP8 attention backward. Returns ``(dq8, dk8, dv8, amax_dq, amax_dk,
    amax_dv, amax_dp)``; the gradients are e4m3, quantized with ``scale_d*``."""
    scales = dict(
        descale_q=descale_q,
        descale_k=descale_k,
        descale_v=descale_v,
        descale_o=descale_o,
        descale_do=descale_do,
        descale_s=descale_s,
        descale_dp=descale_dp,
        scale_s=scale_s,
        scale_dq=scale_dq,
        scale_dk=scale_dk,
        scale_dv=scale_dv,
        scale_dp=scale_dp,
    )
    batch, _, heads, _ = q8.shape
    kv_heads = k8.shape[2]
    group = heads // kv_heads
    b_chunk, kv_chunk = backward_chunks(batch, heads, kv_heads)
    grads, amaxes = [], []
    for b0 in range(0, batch, b_chunk):
        row = []
        for k0 in range(0, kv_heads, kv_chunk):
            qs = slice(k0 * group, (k0 + kv_chunk) * group)
            ks = slice(k0, k0 + kv_chunk)
            bs = slice(b0, b0 + b_chunk)
            part, amax = _bwd_call(
                q8[bs, :, qs],
                k8[bs, :, ks],
                v8[bs, :, ks],
                o8[bs, :, qs],
                do8[bs, :, qs],
                stats[bs, qs],
                scales,
                softmax_scale,
                causal,
            )
            row.append(part)
            amaxes.append(amax)
        grads.append(
            [jnp.concatenate(parts, axis=2) if len(parts) > 1 else parts[0] for parts in zip(*row)]
        )
    dq8, dk8, dv8 = (
        jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0] for parts in zip(*grads)
    )
    amax = jnp.max(jnp.stack(amaxes), axis=0)
    return (dq8, dk8, dv8, amax[0], amax[1], amax[2], amax[3])
