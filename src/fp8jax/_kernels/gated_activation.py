"""One-pass Pallas Triton kernels for the gated activation of the FP8 MLP core
(`fp8jax._ops.gated`), with the plain-JAX path they must equal:

* forward: ``h -> a = act(h_gate) * h_up`` -> ``a`` in FP8 + amax (the transposed copy
  only on request: the core does not keep it);
* backward: ``(h, da) -> dh = [da * h_up * act'(h_gate), da * act(h_gate)]`` -> ``dh``
  in FP8 in both layouts + amax, and ``a``'s FP8 transposed copy again for fc2's wgrad.

To let one tile hold matching gate and up columns, fc1's weight rows are interleaved
in blocks of `BLOCK` (``[g0 u0 g1 u1 ...]``) when cast to FP8, unless they are stored
that way (``FusedMLP(gate_block=64)``); the backward kernel writes the transposed gradient
in the stored order. The same math runs in plain JAX where the kernels cannot (CPU, other
GPUs), and the kernels run in interpret mode on CPU for the tests. ``act`` is one of
`ACTIVATIONS` (silu, tanh-gelu, quick-gelu, relu, squared relu), written with ``exp`` and
arithmetic only so that every one lowers to Triton as silu does.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from .. import _quant as q
from . import cast as _cast_kernel

pl = _cast_kernel.pl  # the guarded Pallas import (None where it does not import)

F32, BF16 = jnp.float32, jnp.bfloat16

BLOCK = 64  # tile width of the kernels in features, and the interleaving block of fc1's rows
MODES = ("auto", "kernel", "interpret", "xla")


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How the activation runs, read when the MLP core is traced; `tuning` sets it for a
    block of code.

    Arguments:
        activation: "auto" (Pallas kernels where Pallas Triton runs, else plain JAX),
            "kernel", "interpret" (the kernels in interpret mode, for CPU tests) or "xla".
        rows: token rows per kernel tile (32).
        num_warps: warps per kernel program (8).
    """

    # "auto": kernels where `_cast_kernel.supported` says Pallas Triton runs (Hopper), else
    # the plain-JAX activation; "kernel": the kernels (compiled); "interpret": kernels in
    # interpret mode (CPU tests); "xla": the plain-JAX activation.
    activation: str = "auto"
    # 32 x 8 warps: the fastest of rows 32-256 x warps 2-8 for both kernels at the 1b and 8b
    # MLP shapes on an H200 (benchmarks/RESULTS.md, twenty-first session)
    rows: int = 32  # token rows per tile
    num_warps: int = 8

    def __post_init__(self):
        if self.activation not in MODES:
            raise ValueError(f"activation must be one of {MODES}, got {self.activation!r}")


_TUNING: contextvars.ContextVar[Tuning] = contextvars.ContextVar("fp8jax_gated", default=Tuning())


def current_tuning() -> Tuning:
    """The `Tuning` in effect here (the defaults outside any `tuning` block).

    Arguments:
        none.

    Returns:
        The `Tuning` the MLP core traced now reads.
    """
    return _TUNING.get()


@contextlib.contextmanager
def tuning(**changes) -> Iterator[Tuning]:
    """Trace the MLP core with these `Tuning` fields changed, inside the ``with`` block
    (``with tuning(activation="interpret"): ...``); a step jitted before the block is not
    traced again by entering it. A field `Tuning` does not have raises TypeError.

    Arguments:
        changes: `Tuning` fields and their values.

    Returns:
        A context manager yielding the `Tuning` in force inside the block.
    """
    token = _TUNING.set(dataclasses.replace(_TUNING.get(), **changes))
    try:
        yield _TUNING.get()
    finally:
        _TUNING.reset(token)


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
# on `FusedMLP`'s XLA path until it is listed here (``tuning(activation="kernel")`` forces
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
    """Token rows per tile: `Tuning.rows` where it divides ``m``, else `BLOCK`."""
    rows = current_tuning().rows
    return rows if m % rows == 0 else BLOCK


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
    return aq, (at[0] if transposed else None), tile_amax  # reduced by `q.combined_max`


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
    return dh, dht.reshape(two_f, m), tile_amax, at  # reduced by `q.combined_max`


def _mode(shape) -> str:
    mode = current_tuning().activation
    if mode == "auto":
        return "kernel" if _cast_kernel.supported((1, *shape))[0] else "xla"
    return mode


def activation_fp8(h, h_scale, a_scale, dtype, activation="swiglu", transposed=True):
    """``activation(h * h_scale)`` (``h`` interleaved ``[M, 2F]``) cast to ``dtype`` with the
    dequantization scale ``a_scale``: ``(aq [M, F], aq^T [F, M], amax)``; ``aq^T`` is None
    unless ``transposed`` (the MLP core's backward recomputes it, so its forward skips it).
    From the kernel the amax is its per-tile maxima (reduced with the layer's other amaxes
    by `q.combined_max`)."""
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
            num_warps=current_tuning().num_warps,
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
            num_warps=current_tuning().num_warps,
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
