"""The MLP blocks' elementwise math: activations (plain and gated), the layouts of a gated
fc1's gate and up rows, and the norms. Shared by `fp8jax.nn.FusedMLP`, the grouped experts
and the trainer."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._ops import gated as _gated
from .._ops.gated import relayout_rows

__all__ = ["ACTIVATIONS", "NORMS", "activate", "normalize", "relayout_rows"]

F32 = jnp.float32


@jax.custom_jvp
def _gelu(x):
    """GELU, tanh approximation (``jax.nn.gelu(approximate=True)``), written as
    ``x * sigmoid(2k(x + 0.044715 x^3))`` with its derivative in closed form: with
    ``tanh`` XLA writes the activation in bf16 in a pass of its own and casts it to FP8
    in a second one; in this form it fuses the activation with its cast as it does for
    silu (H100, jax 0.11.2). Value and derivative are `_gated._gate`'s, the Pallas core's."""
    return _gated._gate("geglu", x)[0].astype(x.dtype)


@_gelu.defjvp
def _gelu_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    act, derivative = _gated._gate("geglu", x)
    return act.astype(x.dtype), (derivative * t).astype(t.dtype)


def _qgelu(x):
    return x * jax.nn.sigmoid(1.702 * x)


def _srelu(x):
    return jnp.square(jax.nn.relu(x))


# name -> (elementwise function, gated). Gated activations split fc1's output in two
# halves along the feature axis: act(first half) * second half (Megatron's convention:
# ``x0, x1 = chunk(x, 2, -1); act(x0) * x1``; TE's geglu/swiglu do the same).
ACTIVATIONS: dict[str, tuple[Callable, bool]] = {
    "gelu": (_gelu, False),
    "geglu": (_gelu, True),
    "qgelu": (_qgelu, False),
    "qgeglu": (_qgelu, True),
    "silu": (jax.nn.silu, False),
    "swiglu": (jax.nn.silu, True),
    "relu": (jax.nn.relu, False),
    "reglu": (jax.nn.relu, True),
    "srelu": (_srelu, False),
    "sreglu": (_srelu, True),
}
NORMS = ("layernorm", "rmsnorm")


def activate(h: Array, activation: str, gate_block: int | None = None) -> Array:
    """Apply ``activation`` to fc1's output ``h`` (gated ones halve the last dim), in
    ``h.dtype`` as a plain bf16 model does (no f32 copies kept for the backward).
    ``gate_block``: the layout of ``h``'s gate and up features (`FusedMLP.gate_block`)."""
    fn, gated = ACTIVATIONS[activation]
    if not gated:
        return fn(h)
    if gate_block is None:
        gate, up = jnp.split(h, 2, axis=-1)
    else:  # a split of the blocks' dim keeps a sharded last dim where it is
        *lead, two_f = h.shape
        pairs = h.reshape(*lead, two_f // (2 * gate_block), 2, gate_block)
        gate, up = (pairs[..., i, :].reshape(*lead, two_f // 2) for i in (0, 1))
    return fn(gate) * up


def normalize(
    x: Array,
    weight: Array | None,
    bias: Array | None,
    norm: str,
    eps: float,
    zero_centered_gamma: bool = False,
) -> Array:
    """LayerNorm or RMSNorm over the last dim, statistics in f32, output in ``x.dtype``.
    With ``zero_centered_gamma`` the scale applied is ``1 + weight`` (TE's option).

    The backward keeps only ``x`` and two f32 numbers per row (mean and 1/rms) and
    recomputes the rest, whatever the compiler does: the jaxpr of the plain f32 formula's
    derivative keeps three f32 copies of ``x`` (XLA's GPU fusion already avoided storing
    them in the trainer's step: benchmarks/RESULTS.md, seventeenth session). Where the output
    feeds an FP8 GEMM, that GEMM keeps its own FP8 copy."""
    return _normalize(x, weight, bias, norm, float(eps), bool(zero_centered_gamma))


def _stats(x32: Array, norm: str, eps: float) -> tuple[Array, Array]:
    """(mean, 1/rms of ``x - mean``) per row, f32; the mean is 0 for RMSNorm."""
    mean = jnp.mean(x32, axis=-1, keepdims=True) if norm == "layernorm" else jnp.zeros((), F32)
    xc = x32 - mean
    return mean, jax.lax.rsqrt(jnp.mean(jnp.square(xc), axis=-1, keepdims=True) + eps)


def _gamma(weight: Array | None, zero_centered_gamma: bool):
    if weight is None:
        return None
    gamma = weight.astype(F32)
    return 1.0 + gamma if zero_centered_gamma else gamma


def _affine(xhat: Array, weight, bias, zero_centered_gamma: bool) -> Array:
    gamma = _gamma(weight, zero_centered_gamma)
    y = xhat if gamma is None else xhat * gamma
    return y if bias is None else y + bias.astype(F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _normalize(x, weight, bias, norm, eps, zero_centered_gamma):
    return _normalize_fwd(x, weight, bias, norm, eps, zero_centered_gamma)[0]


def _normalize_fwd(x, weight, bias, norm, eps, zero_centered_gamma):
    x32 = x.astype(F32)
    mean, rstd = _stats(x32, norm, eps)
    y = _affine((x32 - mean) * rstd, weight, bias, zero_centered_gamma).astype(x.dtype)
    return y, (x, weight, bias, mean, rstd)


def _sum_to(g: Array, like: Array) -> Array:
    """``g`` summed over its leading dims to ``like``'s shape and dtype."""
    return jnp.sum(g.reshape(-1, g.shape[-1]), axis=0).reshape(like.shape).astype(like.dtype)


def _normalize_bwd(norm, eps, zero_centered_gamma, res, g):
    del eps
    x, weight, bias, mean, rstd = res
    g32 = g.astype(F32)
    xhat = (x.astype(F32) - mean) * rstd
    gamma = _gamma(weight, zero_centered_gamma)
    gxhat = g32 if gamma is None else g32 * gamma
    inner = gxhat - xhat * jnp.mean(gxhat * xhat, axis=-1, keepdims=True)
    if norm == "layernorm":
        inner = inner - jnp.mean(gxhat, axis=-1, keepdims=True)
    dx = (rstd * inner).astype(x.dtype)
    dw = None if weight is None else _sum_to(g32 * xhat, weight)
    db = None if bias is None else _sum_to(g32, bias)
    return dx, dw, db


_normalize.defvjp(_normalize_fwd, _normalize_bwd)


def check_gate_block(gate_block, ffn: int, activation: str) -> None:
    """`FusedMLP`'s ``gate_block``: None, or a positive int dividing ``ffn`` for a gated
    activation."""
    if gate_block is None:
        return
    if not ACTIVATIONS[activation][1]:
        raise ValueError(
            f"FusedMLP: gate_block={gate_block!r} lays out a gated fc1's gate and up rows, "
            f"but activation {activation!r} is not gated; leave gate_block=None"
        )
    if isinstance(gate_block, bool) or not isinstance(gate_block, int) or gate_block < 1:
        raise ValueError(f"FusedMLP: gate_block must be None or a positive int, got {gate_block!r}")
    if ffn % gate_block:
        raise ValueError(
            f"FusedMLP: gate_block={gate_block} must divide ffn={ffn} (fc1's gate and up halves "
            "are interleaved in blocks of gate_block rows)"
        )


def check_kinds(norm: str, activation: str) -> None:
    """`FusedMLP`'s ``norm`` and ``activation``: names in `NORMS` and `ACTIVATIONS`."""
    if norm not in NORMS:
        raise ValueError(f"FusedMLP: unknown norm {norm!r}; choose from {NORMS}")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"FusedMLP: unknown activation {activation!r}; choose from {tuple(ACTIVATIONS)}"
        )
