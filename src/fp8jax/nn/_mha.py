"""`MultiHeadAttention`: QKV projection, rotary position embedding (`rotary`), the attention
core of `fp8jax.nn._attention` (bf16 or FP8) and the output projection."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .. import _checks as checks
from .._config import Fp8Config, resolve_config
from ._attention import MODES, DotProductAttention
from ._linear import Linear, apply_linear


def rotary(
    x: Float[Array, "*B T N H"], base: float = 10000.0, positions=None
) -> Float[Array, "*B T N H"]:
    """Rotary position embedding (GPT-NeoX half-split convention) over the T axis;
    ``positions`` (default ``0 .. T-1``) has shape ``(T,)``.

    Arguments:
        x: ``[..., T, heads, head_dim]`` with an even ``head_dim``.
        base: the rotation's base (10000, as LLaMA).
        positions: each step's position, ``[T]`` (None: ``0 .. T-1``).

    Returns:
        ``x`` rotated, in its dtype (computed in float32).
    """
    x = jnp.asarray(x)
    if x.ndim < 3:
        raise ValueError(f"rotary expects x of shape [..., T, heads, head_dim], got {x.shape}")
    *_, t, _, h = x.shape
    if h % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {h}")
    _check_rope_base("rotary", base)
    if positions is None:
        positions = jnp.arange(t, dtype=jnp.float32)
    else:
        positions = jnp.asarray(positions, jnp.float32)
        if positions.shape != (t,):
            raise ValueError(
                f"rotary: positions must have shape ({t},), one per step of x's sequence axis "
                f"(x has shape {x.shape}), got positions of shape {positions.shape}"
            )
    inv = 1.0 / (base ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    angles = positions[:, None] * inv[None, :]  # [T, H/2]
    cos = jnp.cos(angles)[:, None, None, :]  # [T, 1, 1, H/2]: over heads and both halves
    signed_sin = jnp.stack([-jnp.sin(angles), jnp.sin(angles)], axis=1)[:, None]  # [T, 1, 2, H/2]
    # out = (x1 cos - x2 sin, x2 cos + x1 sin), with the halves swapped by a reverse
    # rather than split and concatenated: elementwise ops and a reverse fuse with what
    # reads the result (the FP8 cast of q and k and its amax) into one pass, a concatenate
    # does not (H100, jax 0.11.2).
    halves = x.astype(jnp.float32).reshape(*x.shape[:-1], 2, h // 2)
    out = halves * cos + jnp.flip(halves, axis=-2) * signed_sin
    return out.reshape(x.shape).astype(x.dtype)


def _check_rope_base(owner: str, base):
    if isinstance(base, jax.Array):  # traced or on a device: not checked
        return base
    return checks.positive_number(owner, "rope_base", base)


class MultiHeadAttention(eqx.Module):
    """QKV projection (one fused GEMM) -> optional rotary -> attention -> output projection.

    ``mode="fp8_mha"`` makes both projections FP8 `Linear`s and runs the core in FP8;
    ``"fp8_dpa"`` runs only the core in FP8 (projections are ``eqx.nn.Linear``, which
    `fp8jax.fp8_linear_layers` may still convert); ``"bf16"`` runs none in FP8.
    Input ``[..., T, dim]`` (any leading dims, or one sequence under ``jax.vmap``).

    Arguments:
        dim, num_heads: the model width and the query heads.
        num_kv_heads: key/value heads (grouped-query attention; None: ``num_heads``).
        head_dim: per head (None: ``dim // num_heads``).
        mode: ``"fp8_mha"``, ``"fp8_dpa"`` or ``"bf16"``.
        is_causal: causal masking.
        use_rotary, rope_base: rotary embedding of q and k, and its base.
        use_bias: biases in the projections.
        backend: the attention core's backend (`dot_product_attention`).
        config: the `Fp8Config` (None: the default one).
        dtype: the projections' dtype.
        key: initialises the projections.
    """

    qkv: Linear | eqx.nn.Linear
    out: Linear | eqx.nn.Linear
    attention: DotProductAttention
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    use_rotary: bool = eqx.field(static=True)
    rope_base: float = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        mode: str = "fp8_mha",
        is_causal: bool = True,
        use_rotary: bool = True,
        rope_base: float = 10000.0,
        use_bias: bool = False,
        backend: str = "auto",
        config: Fp8Config | None = None,
        dtype=None,
        key: PRNGKeyArray,
    ):
        dim = checks.count("MultiHeadAttention", "dim", dim)
        num_heads = checks.count("MultiHeadAttention", "num_heads", num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        num_kv_heads = checks.count("MultiHeadAttention", "num_kv_heads", num_kv_heads)
        if head_dim is not None:
            head_dim = checks.count("MultiHeadAttention", "head_dim", head_dim)
        if mode not in MODES:
            raise ValueError(f"MultiHeadAttention: mode must be one of {MODES}, got {mode!r}")
        try:
            config = resolve_config(config)
        except TypeError as e:
            raise TypeError(f"MultiHeadAttention: {e}.") from None
        if num_heads % num_kv_heads:
            raise ValueError(
                f"MultiHeadAttention: num_heads ({num_heads}) must be a multiple of "
                f"num_kv_heads ({num_kv_heads})"
            )
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(
                    f"MultiHeadAttention: dim ({dim}) must divide by num_heads "
                    f"({num_heads}), or pass head_dim"
                )
            head_dim = dim // num_heads
        if use_rotary:
            rope_base = _check_rope_base("MultiHeadAttention", rope_base)
            if head_dim % 2:
                raise ValueError(
                    f"MultiHeadAttention: rotary embedding (use_rotary=True) needs an even "
                    f"head_dim, got head_dim={head_dim}; pass an even head_dim or "
                    "use_rotary=False."
                )
        kqkv, kout = jax.random.split(key)
        qkv_features = (num_heads + 2 * num_kv_heads) * head_dim
        if mode == "fp8_mha":
            self.qkv = Linear(dim, qkv_features, use_bias, dtype=dtype, config=config, key=kqkv)
            self.out = Linear(
                num_heads * head_dim, dim, use_bias, dtype=dtype, config=config, key=kout
            )
        else:
            self.qkv = eqx.nn.Linear(dim, qkv_features, use_bias, dtype=dtype, key=kqkv)
            self.out = eqx.nn.Linear(num_heads * head_dim, dim, use_bias, dtype=dtype, key=kout)
        self.attention = DotProductAttention(
            mode, is_causal=is_causal, backend=backend, config=config
        )
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.use_rotary, self.rope_base = bool(use_rotary), float(rope_base)

    @jax.named_scope("fp8jax.nn.MultiHeadAttention")
    def __call__(
        self,
        x: Float[Array, "*B T dim"],
        *,
        query_seq_lengths=None,
        key_value_seq_lengths=None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "*B T dim"]:
        del key
        x = jnp.asarray(x)
        if x.ndim < 2:
            raise ValueError(
                f"MultiHeadAttention expects [..., T, dim] inputs, got shape {x.shape}"
            )
        if x.shape[-1] != self.qkv.in_features:
            raise ValueError(
                f"MultiHeadAttention expects inputs of shape (..., T, "
                f"{self.qkv.in_features}), got {x.shape}"
            )
        if x.size == 0:
            raise ValueError(
                f"MultiHeadAttention: x has shape {x.shape}, with no elements (a zero-size "
                "sequence or batch)"
            )
        lead, t = x.shape[:-2], x.shape[-2]
        xb = x.reshape((-1, t, x.shape[-1]))
        n, nk, h = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = apply_linear(self.qkv, xb).reshape(xb.shape[0], t, n + 2 * nk, h)
        q, k, v = qkv[:, :, :n], qkv[:, :, n : n + nk], qkv[:, :, n + nk :]
        if self.use_rotary:
            q, k = rotary(q, self.rope_base), rotary(k, self.rope_base)
        o = self.attention(
            q,
            k,
            v,
            query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths,
        )
        y = apply_linear(self.out, o.reshape(xb.shape[0], t, n * h))
        return y.reshape(lead + (t, y.shape[-1]))
