"""FP8 gated MLP core (fc1 -> swiglu/geglu/reglu/... -> fc2) as one custom VJP with one-pass
activation kernels.

Through XLA, the FP8 MLP spends as much time in memory passes over fc1's output as it
saves in the GEMMs (`benchmarks/RESULTS.md`, the trainer profile): the dequantize of
fc1's output, the activation and fc2's input cast, a separate amax pass, a separate FP8
transpose, and in the backward the gated gradient written as two halves and
concatenated. Here fc1's GEMM output stays unscaled bf16 (it is the saved residual),
and two Pallas Triton kernels do the rest, each in one read:

* forward: ``h -> a = act(h_gate) * h_up`` -> ``a`` in FP8 + amax (the transposed copy
  only on request: the core does not keep it);
* backward: ``(h, da) -> dh = [da * h_up * act'(h_gate), da * act(h_gate)]`` -> ``dh``
  in FP8 in both layouts + amax, and ``a``'s FP8 transposed copy again for fc2's wgrad
  (so the forward keeps only ``h``, the FP8 ``x^T`` and the FP8 weights).

To let one tile hold matching gate and up columns, fc1's weight rows are interleaved
in blocks of `BLOCK` (``[g0 u0 g1 u1 ...]``) when cast to FP8, unless they are stored
that way (``FusedMLP(gate_block=64)``, the layout that splits without communication
under tensor parallelism); the backward kernel writes the transposed gradient in the
stored order (natural ``[gate | up]``, Megatron's convention, or interleaved), so fc1's
wgrad comes out in the weight's own order.
Delayed scaling only (the activation's scale must be known before the pass). The
same math runs in plain JAX where the kernels cannot (CPU, other GPUs), and the
kernels run in interpret mode on CPU for the tests. ``act`` is one of `ACTIVATIONS`
(silu, tanh-gelu, quick-gelu, relu, squared relu), written with ``exp`` and arithmetic
only so that every one lowers to Triton as silu does.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .. import quant as q
from .. import state as _state
from ..config import Fp8Config
from ..kernels import cast as _cast_kernel
from ..kernels import gemm as _gemm
from . import dot as _dot
from . import rows as _split

pl = _cast_kernel.pl  # the guarded Pallas import (None where it does not import)

F32, BF16 = jnp.float32, jnp.bfloat16
BLOCK = 64  # tile width of the kernels in features, and the interleaving block of fc1's rows
TILE = {
    "rows": 64,
    "num_warps": 4,
}  # token rows per tile and warps (module-level for the tuning probe)
# "auto": kernels where `_cast_kernel.supported` says Pallas Triton runs (Hopper), else
# the plain-JAX activation; "kernel": the kernels (compiled); "interpret": kernels in
# interpret mode (CPU tests); "xla": the plain-JAX activation.
MODE = {"activation": "auto"}


# ----------------------------------------------------------------------------- layout
def interleave(w1, block: int = BLOCK):
    """fc1 rows ``[gate | up]`` (``[2F, C]``) -> ``[g0 u0 g1 u1 ...]`` in blocks of ``block``."""
    two_f, c = w1.shape
    f = two_f // 2
    return w1.reshape(2, f // block, block, c).swapaxes(0, 1).reshape(two_f, c)


def deinterleave(w1i, block: int = BLOCK):
    """Inverse of `interleave`."""
    two_f, c = w1i.shape
    f = two_f // 2
    return w1i.reshape(f // block, 2, block, c).swapaxes(0, 1).reshape(two_f, c)


def relayout_rows(a, axis: int, src: int | None, dst: int | None):
    """``a``'s gate/up entries along ``axis`` moved from layout ``src`` to ``dst`` (None:
    ``[gate | up]``; an int ``b``: ``[g0 u0 g1 u1 ...]`` in blocks of ``b``)."""
    if src == dst:
        return a
    moved = jnp.moveaxis(a, axis, 0)
    rows = moved.reshape(moved.shape[0], -1)
    rows = rows if src is None else deinterleave(rows, src)
    rows = rows if dst is None else interleave(rows, dst)
    return jnp.moveaxis(rows.reshape(moved.shape), 0, axis)


def _halves(h, block: int = BLOCK):
    """Gate and up parts ``[M, F]`` of an interleaved ``[M, 2F]``."""
    m, two_f = h.shape
    h4 = h.reshape(m, two_f // (2 * block), 2, block)
    return h4[:, :, 0, :].reshape(m, -1), h4[:, :, 1, :].reshape(m, -1)


def _join(gate, up, block: int = BLOCK):
    """Inverse of `_halves`."""
    m, f = gate.shape
    return jnp.stack(
        [gate.reshape(m, f // block, block), up.reshape(m, f // block, block)], axis=2
    ).reshape(m, 2 * f)


# ----------------------------------------------------------------------------- math
def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


_GELU_K = 2.0 * math.sqrt(2.0 / math.pi)  # gelu_tanh(x) = x * sigmoid(_GELU_K * (x + 0.044715 x^3))
# The gated activations the core runs (`fp8jax.nn.ACTIVATIONS` names; gelu is the tanh form).
ACTIVATIONS = ("swiglu", "geglu", "qgeglu", "reglu", "sreglu")
# Those whose kernels have passed tests/test_gpu.py on a Hopper GPU (all five: H100, jax
# 0.11.2, 2026-11-23) and are taken in "auto" mode. An activation added to ACTIVATIONS stays
# on `FusedMLP`'s XLA path until it is listed here (``MODE["activation"] = "kernel"`` forces
# the kernels, as the GPU test does).
GPU_TESTED = ACTIVATIONS


def _gate(activation: str, x):
    """``(act(x), act'(x))`` for the gate half, in ``x``'s dtype (the kernels pass f32)."""
    if activation == "swiglu":
        sig = _sigmoid(x)
        return x * sig, sig * (1.0 + x * (1.0 - sig))
    if activation == "qgeglu":
        sig = _sigmoid(1.702 * x)
        return x * sig, sig * (1.0 + 1.702 * x * (1.0 - sig))
    if activation == "geglu":
        sig = _sigmoid(_GELU_K * (x + 0.044715 * x * x * x))
        return x * sig, sig + x * sig * (1.0 - sig) * _GELU_K * (1.0 + 3 * 0.044715 * x * x)
    relu = jnp.maximum(x, 0.0)
    if activation == "reglu":
        return relu, (x > 0).astype(F32)
    if activation == "sreglu":
        return relu * relu, 2.0 * relu
    raise ValueError(f"the gated core runs {ACTIVATIONS}, not {activation!r}")


def _glu(activation: str, gate, up):
    return _gate(activation, gate)[0] * up


def _glu_grad(activation: str, gate, up, da):
    act, dact = _gate(activation, gate)
    return da * up * dact, da * act


# ----------------------------------------------------------------------------- kernels
def _fwd_kernel(h_ref, scalars_ref, aq_ref, *out_refs, block, activation):
    *at_ref, amax_ref = out_refs  # ``at_ref`` only when the transposed copy is asked for
    h_scale, inv_a_scale = scalars_ref[0], scalars_ref[1]
    gate = h_ref[:, :block].astype(F32) * h_scale
    up = h_ref[:, block:].astype(F32) * h_scale
    a = _glu(activation, gate, up)
    amax_ref[...] = q.tile_amax(a).reshape(1, 1)
    aq = q.saturate_in_kernel(a, inv_a_scale, aq_ref.dtype)
    aq_ref[...] = aq
    if at_ref:
        at_ref[0][...] = aq.T


def _bwd_kernel(
    h_ref, da_ref, scalars_ref, dh_ref, dht_ref, amax_ref, at_ref, *, block, activation
):
    h_scale, da_scale, inv_dh_scale, inv_a_scale = (
        scalars_ref[0],
        scalars_ref[1],
        scalars_ref[2],
        scalars_ref[3],
    )
    gate = h_ref[:, :block].astype(F32) * h_scale
    up = h_ref[:, block:].astype(F32) * h_scale
    at_ref[...] = q.saturate_in_kernel(
        _glu(activation, gate, up), inv_a_scale, at_ref.dtype
    ).T  # fc2's wgrad operand
    d_gate, d_up = _glu_grad(activation, gate, up, da_ref[...].astype(F32) * da_scale)
    amax_ref[...] = jnp.maximum(q.tile_amax(d_gate), q.tile_amax(d_up)).reshape(1, 1)
    gq = q.saturate_in_kernel(d_gate, inv_dh_scale, dh_ref.dtype)
    uq = q.saturate_in_kernel(d_up, inv_dh_scale, dh_ref.dtype)
    dh_ref[:, :block] = gq
    dh_ref[:, block:] = uq
    dht_ref[0] = gq.T  # the transposed copy: gate rows, then up rows, of this feature block
    dht_ref[1] = uq.T


def _rows(m: int) -> int:
    """Token rows per tile: `TILE` where it divides ``m``, else `BLOCK`."""
    return TILE["rows"] if m % TILE["rows"] == 0 else BLOCK


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret, num_warps, *args):
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        **_cast_kernel.triton_params(interpret, num_warps),
    )(*args)


@functools.partial(
    jax.jit, static_argnames=("dtype", "activation", "interpret", "rows", "num_warps", "transposed")
)
def _fwd_pallas(
    h,
    h_scale,
    a_scale,
    dtype,
    activation="swiglu",
    interpret=False,
    rows=BLOCK,
    num_warps=4,
    transposed=True,
):
    m, two_f = h.shape
    f, b, r = two_f // 2, BLOCK, rows
    grid = (m // r, f // b)
    scalars = jnp.stack([h_scale.reshape(()), 1.0 / a_scale.reshape(())]).astype(F32)
    t_spec, t_shape = (
        [pl.BlockSpec((b, r), lambda i, j: (j, i))],
        [jax.ShapeDtypeStruct((f, m), dtype)],
    )
    aq, *at, tile_amax = _call(
        functools.partial(_fwd_kernel, block=b, activation=activation),
        grid,
        [pl.BlockSpec((r, 2 * b), lambda i, j: (i, j)), pl.BlockSpec((2,), lambda i, j: (0,))],
        [
            pl.BlockSpec((r, b), lambda i, j: (i, j)),
            *t_spec[:transposed],
            pl.BlockSpec((1, 1), lambda i, j: (i, j)),
        ],
        [
            jax.ShapeDtypeStruct((m, f), dtype),
            *t_shape[:transposed],
            jax.ShapeDtypeStruct(grid, F32),
        ],
        interpret,
        num_warps,
        h,
        scalars,
    )
    return aq, (at[0] if transposed else None), jnp.max(tile_amax)


@functools.partial(
    jax.jit,
    static_argnames=(
        "dtype",
        "a_dtype",
        "activation",
        "interpret",
        "rows",
        "num_warps",
        "dht_block",
    ),
)
def _bwd_pallas(
    h,
    h_scale,
    da,
    da_scale,
    dh_scale,
    a_scale,
    dtype,
    a_dtype,
    activation="swiglu",
    interpret=False,
    rows=BLOCK,
    num_warps=4,
    dht_block=None,
):
    m, two_f = h.shape
    f, b, r = two_f // 2, BLOCK, rows
    grid = (m // r, f // b)
    # dh^T with its rows [gate | up] ([2, F, M]) or interleaved like h ([F/b, 2, b, M])
    dht_spec, dht_shape = (
        (pl.BlockSpec((2, b, r), lambda i, j: (0, j, i)), (2, f, m))
        if dht_block is None
        else (pl.BlockSpec((None, 2, b, r), lambda i, j: (j, 0, 0, i)), (f // b, 2, b, m))
    )
    scalars = jnp.stack(
        [
            h_scale.reshape(()),
            da_scale.reshape(()),
            1.0 / dh_scale.reshape(()),
            1.0 / a_scale.reshape(()),
        ]
    ).astype(F32)
    dh, dht, tile_amax, at = _call(
        functools.partial(_bwd_kernel, block=b, activation=activation),
        grid,
        [
            pl.BlockSpec((r, 2 * b), lambda i, j: (i, j)),
            pl.BlockSpec((r, b), lambda i, j: (i, j)),
            pl.BlockSpec((4,), lambda i, j: (0,)),
        ],
        [
            pl.BlockSpec((r, 2 * b), lambda i, j: (i, j)),
            dht_spec,
            pl.BlockSpec((1, 1), lambda i, j: (i, j)),
            pl.BlockSpec((b, r), lambda i, j: (j, i)),
        ],
        [
            jax.ShapeDtypeStruct((m, two_f), dtype),
            jax.ShapeDtypeStruct(dht_shape, dtype),
            jax.ShapeDtypeStruct(grid, F32),
            jax.ShapeDtypeStruct((f, m), a_dtype),
        ],
        interpret,
        num_warps,
        h,
        da,
        scalars,
    )
    return dh, dht.reshape(two_f, m), jnp.max(tile_amax), at


def _mode(shape) -> str:
    mode = MODE["activation"]
    if mode == "auto":
        return "kernel" if _cast_kernel.supported((1, *shape))[0] else "xla"
    return mode


def activation_fp8(h, h_scale, a_scale, dtype, activation="swiglu", transposed=True):
    """``activation(h * h_scale)`` (``h`` interleaved ``[M, 2F]``) cast to ``dtype`` with the
    dequantization scale ``a_scale``: ``(aq [M, F], aq^T [F, M], amax)``; ``aq^T`` is None
    unless ``transposed`` (the MLP core's backward recomputes it, so its forward skips it)."""
    mode = _mode(h.shape)
    if mode != "xla":
        return _fwd_pallas(
            h,
            h_scale,
            a_scale,
            dtype,
            activation,
            interpret=mode == "interpret",
            rows=_rows(h.shape[0]),
            num_warps=TILE["num_warps"],
            transposed=transposed,
        )
    gate, up = _halves(h.astype(F32) * h_scale.reshape(()))
    a = _glu(activation, gate, up)
    aq = q.saturate(a, 1.0 / a_scale.reshape(()), dtype)
    return aq, (aq.T if transposed else None), q.tile_amax(a)


def activation_grad_fp8(
    h, h_scale, da, da_scale, dh_scale, dtype, a_scale, a_dtype, activation="swiglu", dht_block=None
):
    """Gradient of `activation_fp8` w.r.t. ``h`` for the output gradient ``da * da_scale``,
    cast to ``dtype`` (scale ``dh_scale``): ``(dhq [M, 2F], dhq^T [2F, M], amax, aq^T)``.
    ``dhq`` is interleaved like ``h`` (fc1's dgrad contracts it with the interleaved weight);
    ``dhq^T`` has its rows ``[gate | up]`` (``dht_block`` None) or interleaved in blocks of
    ``dht_block`` (the kernel: `BLOCK` only), so that fc1's wgrad comes out in the weight's
    own row order (a row permutation of it kept XLA from fusing the optimizer's update).
    ``aq^T`` is the forward's FP8 activation (scale ``a_scale``) recomputed in the same
    pass, so the forward need not keep it."""
    mode = _mode(h.shape)
    if mode != "xla":
        return _bwd_pallas(
            h,
            h_scale,
            da,
            da_scale,
            dh_scale,
            a_scale,
            dtype,
            a_dtype,
            activation,
            interpret=mode == "interpret",
            rows=_rows(h.shape[0]),
            num_warps=TILE["num_warps"],
            dht_block=dht_block,
        )
    gate, up = _halves(h.astype(F32) * h_scale.reshape(()))
    d_gate, d_up = _glu_grad(activation, gate, up, da.astype(F32) * da_scale.reshape(()))
    inv = 1.0 / dh_scale.reshape(())
    gate_q, up_q = q.saturate(d_gate, inv, dtype), q.saturate(d_up, inv, dtype)
    aq = q.saturate(_glu(activation, gate, up), 1.0 / a_scale.reshape(()), a_dtype)
    dhq = _join(gate_q, up_q)
    return (
        dhq,
        relayout_rows(jnp.concatenate([gate_q.T, up_q.T]), 0, None, dht_block),
        jnp.maximum(q.tile_amax(d_gate), q.tile_amax(d_up)),
        aq.T,
    )


# ----------------------------------------------------------------------------- custom VJP
class Spec(NamedTuple):
    """Static description of one call (a custom_vjp nondiff arg)."""

    config1: Fp8Config
    config2: Fp8Config
    x_dtype: np.dtype
    w1_dtype: np.dtype
    w2_dtype: np.dtype
    activation: str = "swiglu"  # one of `ACTIVATIONS`
    gate_block: int | None = None  # fc1's row layout (`fp8jax.nn.FusedMLP.gate_block`)
    rows: _split.RowSplit | None = None  # the kernels' token split on a mesh (`fp8jax.ops.rows`)


def usable(
    config1: Fp8Config,
    config2: Fp8Config,
    m: int,
    hidden: int,
    ffn: int,
    out: int,
    activation: str = "swiglu",
    rows: _split.RowSplit | None = None,
) -> bool:
    """Whether the core can run this MLP (else `FusedMLP` takes its XLA path); ``rows``:
    the token split its kernels run under (None: the whole program's rows)."""
    if activation not in ACTIVATIONS:
        return False
    n = 1 if rows is None else rows.count
    if m % n:
        return False
    m //= n
    local = rows is not None
    if MODE["activation"] == "auto" and (
        activation not in GPU_TESTED or not _cast_kernel.supported((1, m, 2 * ffn), None, local)[0]
    ):
        return False  # the plain-JAX activation is no faster than XLA's own fusions
    aligned = m % BLOCK == 0 and ffn % BLOCK == 0 and hidden % 16 == 0 and out % 16 == 0
    return (
        aligned
        and config1.recipe.scale_known_before_cast
        and config2.recipe.scale_known_before_cast
    )


def _scales(spec: Spec, state1, state2) -> tuple[Array, ...]:
    """The six scales of the two layers' operands, ``(sx, sw1, sdh, sa, sw2, sg)``, from
    their histories (delayed scaling: the core runs only then), all in the forward and
    in one reduction where both layers' recipes and history lengths agree."""
    c1, c2 = spec.config1, spec.config2
    (h1, o1, d1), (h2, o2, d2) = _dot.scale_inputs(c1, state1), _dot.scale_inputs(c2, state2)
    if c1.recipe == c2.recipe and len({jnp.shape(h) for h in h1 + h2}) == 1:
        scales = c1.recipe.gemm_scales(h1 + h2, o1 + o2, d1 + d2)
    else:
        scales = jnp.concatenate(
            [c1.recipe.gemm_scales(h1, o1, d1), c2.recipe.gemm_scales(h2, o2, d2)]
        )
    return tuple(scales[i : i + 1] for i in range(6))


def _forward(spec: Spec, x, w1, state1, w2, state2):
    c1, c2 = spec.config1, spec.config2
    sx, sw1, sdh, sa, sw2, sg = _scales(spec, state1, state2)
    xq, xTq, ax = _gemm.quantize_both(x[None], sx, c1.input_dtype, c1.cast_kernel)
    w1c = relayout_rows(w1, 0, spec.gate_block, BLOCK)[None]  # the core's layout
    w1q, w1Tq, aw1 = _gemm.quantize_both(w1c, sw1, c1.kernel_dtype, c1.cast_kernel)
    h = _gemm.gemm(xq, w1q, BF16, _gemm.gemm_precision(c1.fast_forward))[
        0
    ]  # [M, 2F] interleaved, not dequantized
    h_scale = (sx * sw1).reshape(())
    aq, _, aa = _split.on_rows(
        spec.rows,
        lambda h, hs, s: activation_fp8(h, hs, s, c2.input_dtype, spec.activation, False),
        (h, h_scale, sa),
        (0, None, None),
        (0, None, "max"),
    )
    w2q, w2Tq, aw2 = _gemm.quantize_both(w2[None], sw2, c2.kernel_dtype, c2.cast_kernel)
    y = _gemm.fp8_gemm(aq[None], sa, w2q, sw2, spec.x_dtype, c2.fast_forward)[0]
    # fc2's wgrad operand aq^T is not kept: the backward kernel recomputes it from h
    residuals = (xTq, w1Tq, h, w2Tq, sx, sw1, sa, sw2, ax, aw1, aa, aw2, sg, sdh)
    return y, residuals


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gated_mlp(spec: Spec, x, w1, state1, w2, state2):
    """``fc2(act(fc1(x)_gate) * fc1(x)_up)`` with FP8 GEMMs (``act`` from ``spec.activation``):
    ``x [M, C]``, ``w1 [2F, C]`` (rows ``[gate | up]``, or interleaved in blocks of
    ``spec.gate_block``), ``w2 [N, F]``; ``state1``/``state2``
    the fc1/fc2 `_dot.STATE_FIELDS` tuples as `fp8jax.state.MAX_GRAD`, whose new values
    come back as their gradients."""
    return _forward(spec, x, w1, _state.values(state1), w2, _state.values(state2))[0]


def _dht_block(gate_block: int | None) -> int | None:
    """The row layout the backward kernel writes fc1's transposed gradient in: the stored
    one where the kernel can (``[gate | up]`` or blocks of `BLOCK`), else ``[gate | up]``
    (then permuted to the stored one)."""
    return gate_block if gate_block in (None, BLOCK) else None


def _fwd(spec, x, w1, state1, w2, state2):
    state1, state2 = _state.values(state1), _state.values(state2)
    y, residuals = _forward(spec, x, w1, state1, w2, state2)
    return y, (residuals, state1, state2)


def _bwd(spec, saved, g):
    (xTq, w1Tq, h, w2Tq, sx, sw1, sa, sw2, ax, aw1, aa, aw2, sg, sdh), state1, state2 = saved
    c1, c2 = spec.config1, spec.config2
    gq, gTq, ag = _gemm.quantize_both(g[None], sg, c2.grad_dtype, c2.cast_kernel)
    da = _gemm.gemm(gq, w2Tq, BF16, _gemm.gemm_precision(c2.fast_backward))[
        0
    ]  # [M, F], not dequantized

    def grad(h, hs, da, das, sdh, sa):
        return activation_grad_fp8(
            h, hs, da, das, sdh, c1.grad_dtype, sa, c2.input_dtype, spec.activation,
            dht_block=_dht_block(spec.gate_block),
        )  # fmt: skip

    args = (h, (sx * sw1).reshape(()), da, (sg * sw2).reshape(()), sdh, sa)
    in_dims = (0, None, 0, None, None, None)
    dhq, dhTq, adh, aTq = _split.on_rows(spec.rows, grad, args, in_dims, (0, 1, "max", 1))
    dw2 = _gemm.fp8_gemm(gTq, sg, aTq[None], sa, spec.w2_dtype, c2.fast_backward)[0]
    dx = _gemm.fp8_gemm(dhq[None], sdh, w1Tq, sw1, spec.x_dtype, c1.fast_backward)[0]
    dw1 = _gemm.fp8_gemm(dhTq[None], sdh, xTq, sx, spec.w1_dtype, c1.fast_backward)[0]
    dw1 = relayout_rows(dw1, 0, _dht_block(spec.gate_block), spec.gate_block)  # as stored

    amaxes = q.combined_max(ax, aw1, adh, aa, aw2, ag)  # both layers' in one reduction
    state1_ct = _dot.new_state(state1, sx, sw1, sdh, _dot.observed_amaxes(*amaxes[:3]))
    state2_ct = _dot.new_state(state2, sa, sw2, sg, _dot.observed_amaxes(*amaxes[3:]))
    return dx, dw1, _state.proposal(state1_ct), dw2, _state.proposal(state2_ct)


gated_mlp.defvjp(_fwd, _bwd)
