"""FP8 gated MLP core (fc1 -> swiglu/geglu/reglu/... -> fc2) as one custom VJP with one-pass
activation kernels.

Through XLA, the FP8 MLP spends as much time in memory passes over fc1's output as it
saves in the GEMMs (`benchmarks/RESULTS.md`, the trainer profile): the dequantize of
fc1's output, the activation and fc2's input cast, a separate amax pass, a separate FP8
transpose, and in the backward the gated gradient written as two halves and
concatenated. Here fc1's GEMM output stays unscaled bf16 (it is the saved residual),
and two Pallas Triton kernels (`fp8jax._kernels.gated_activation`) do the rest, each in
one read, so the forward keeps only ``h``, the FP8 ``x^T`` and the FP8 weights.

fc1's weight rows are interleaved in blocks of `BLOCK` when cast to FP8 (one kernel tile
holds matching gate and up columns), unless they are stored that way
(``FusedMLP(gate_block=64)``, the layout that splits without communication under tensor
parallelism); fc1's wgrad comes out in the weight's own order (natural ``[gate | up]``,
Megatron's convention, or interleaved). Delayed scaling only (the activation's scale must
be known before the pass).

``Spec.fc1_out_fp8`` keeps ``h`` for the backward as e4m3 with one scale instead (`saved_fp8`,
outside the kernels: the backward's kernel reads the exact bf16 copy of the e4m3 values and
takes the scale in its ``h`` scale).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array

from .. import _quant as q
from .. import _state
from .._config import Fp8Config
from .._kernels import cast as _cast_kernel
from .._kernels import gemm as _gemm
from .._kernels.gated_activation import (  # noqa: F401  (re-exported: the core's public names)
    ACTIVATIONS,
    BLOCK,
    GPU_TESTED,
    _gate,  # the activations' math, which `fp8jax.nn._elementwise` shares
    activation_fp8,
    activation_grad_fp8,
    current_tuning,
    deinterleave,
    interleave,
    relayout_rows,
    tuning,
)
from . import dot as _dot
from . import rows as _split
from . import saved_fp8 as _saved
from . import sequence_parallel as _sp
from . import state_update as _update

BF16 = jnp.bfloat16
# fc1's output (``h``, bf16; or its FP8 copy and scale, `FusedMLP.fc1_out_fp8`): the checkpoint
# name `fp8jax.nn.FusedMLP` gives it on either path, which `fp8jax.remat_policy` saves (a gated
# activation's backward reads it).
FC1_OUT = "fp8jax_mlp_fc1_out"


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
    rows: _split.RowSplit | None = None  # the kernels' token split on a mesh (`fp8jax._ops.rows`)
    fc1_out_fp8: bool = False  # keep ``h`` for the backward as e4m3 + scale (`saved_fp8`)
    # Megatron sequence parallelism: fc1's column-parallel record (fc2 is its row-parallel
    # pair); the kernels then run per device (`_sequence_splits`), ``rows`` is None
    sequence: _sp.SequenceParallel | None = None


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
    if current_tuning().activation == "auto" and (
        activation not in GPU_TESTED or not _cast_kernel.supported((1, m, 2 * ffn), None, local)[0]
    ):
        return False  # the plain-JAX activation is no faster than XLA's own fusions
    aligned = m % BLOCK == 0 and ffn % BLOCK == 0 and hidden % 16 == 0 and out % 16 == 0
    return (
        aligned
        and config1.recipe.scale_known_before_cast
        and config2.recipe.scale_known_before_cast
    )


def _sequence_splits(spec: Spec):
    """``(column, row, tokens, features, dims)`` under sequence parallelism: fc1's and fc2's
    records, the token split of x's and g's casts (batch axes and the tensor axis), the
    activation kernels' split (tokens over the batch axes, fc1's output features over the
    tensor axis) and the explicit dims of its 2-D operands; without it ``(None, None,
    spec.rows, spec.rows, 0)``: one token split for all."""
    col = spec.sequence
    if col is None:
        return None, None, spec.rows, spec.rows, 0
    tokens, features = _split.sequence_splits(col)
    return col, col._replace(kind="row"), tokens, features, _split.Dims(0, 1)


def _relayout(a, src: int | None, dst: int | None, local: bool):
    """fc1's rows (``a``'s dim 0) from gate/up layout ``src`` to ``dst`` (`relayout_rows`).
    With ``local`` (both are blocks, one a multiple of the other) the move stays inside each
    group of ``2 * max(src, dst)`` rows: a tensor-parallel split of the rows moves nothing,
    where `relayout_rows` passes through ``[gate | up]``, a permutation across devices."""
    if not local or src == dst:
        return relayout_rows(a, 0, src, dst)
    big, small = max(src, dst), min(src, dst)
    n, rest = a.shape[0] // (2 * big), a.shape[1:]
    if src == big:  # [g(big) u(big)] -> [g0 u0 g1 u1 ...] in blocks of small
        a = a.reshape(n, 2, big // small, small, *rest).swapaxes(1, 2)
    else:
        a = a.reshape(n, big // small, 2, small, *rest).swapaxes(1, 2)
    return a.reshape(-1, *rest)


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


def _local_amax(rows, fn, index: int):
    """``fn`` whose output ``index`` (an amax, per-tile maxima from the kernels) is reduced
    on each device first when the core runs on a token split (``rows``): one scalar
    ``pmax`` per amax across the devices. Without a split the maxima stay for
    `q.combined_max`."""
    if rows is None:
        return fn

    def call(*args):
        out = list(fn(*args))
        out[index] = jnp.max(out[index])
        return tuple(out)

    return call


def _cast(rows, t, scale, dtype, cast_kernel: bool):
    """`fp8jax._kernels.gemm.quantize_both` of an activation or output gradient ``t [M, C]``
    as ``[1, M, C]``: on a token split (``rows``, unless `fp8jax._kernels.gemm.Tuning.
    per_device_cast` is off) per device on its rows, where the Pallas cast can run, its amax
    one scalar pmax. The cast is elementwise with a known scale: the same bits either way."""
    rows = rows if _gemm.current_tuning().per_device_cast else None

    def cast(t, scale):
        return _gemm.quantize_both(t, scale, dtype, cast_kernel)

    cast = _local_amax(rows, cast, 2)
    return _split.on_rows(rows, cast, (t[None], scale), (1, None), (1, 2, "max"))


def _scaled_gemm(a, sa, b, sb, out_dtype, fast: bool, config: Fp8Config):
    """`fp8jax._kernels.gemm.scaled_fp8_gemm` of the core's operands: cuBLASLt takes the
    scales where every operand came from a Pallas kernel (the casts and the activation
    kernels run on the same shapes, `current_tuning`'s activation not ``"xla"``)."""
    kernels = config.cast_kernel and current_tuning().activation in ("auto", "kernel")
    return _gemm.scaled_fp8_gemm(a, sa, b, sb, out_dtype, fast, kernels)


def _forward(spec: Spec, x, w1, state1, w2, state2, save_fp8: bool = False):
    """``(y, residuals)``; ``save_fp8``: the residuals hold ``h`` as (e4m3, scale)
    (`Spec.fc1_out_fp8`), cast before fc2's GEMM runs (`saved_fp8.save_fp8_before`, tied to
    fc2's FP8 input: ``h`` dies in the forward, and no bf16 rounding moves)."""
    c1, c2 = spec.config1, spec.config2
    col, row, tokens, features, dims = _sequence_splits(spec)
    chosen = _scales(spec, state1, state2)  # what the states record
    sx, sw1, sdh, sa, sw2, sg = map(_gemm.gemm_scale, chosen)  # what casts and GEMMs take
    xq, xTq, ax = _cast(tokens, x, sx, c1.input_dtype, c1.cast_kernel)
    w1c = _relayout(w1, spec.gate_block, BLOCK, col is not None)[None]  # the core's layout
    w1q, w1Tq, aw1 = _gemm.quantize_both(w1c, sw1, c1.kernel_dtype, c1.cast_kernel)
    # sequence parallel: x's FP8 tokens gathered, fc1 split over its output features
    xq, w1q = _sp.pin_operands(col, _sp.gather(col, xq, 1), w1q, None, 1)
    h = _gemm.gemm(xq, w1q, BF16, _gemm.gemm_precision(c1.fast_forward))[
        0
    ]  # [M, 2F] interleaved, not dequantized
    h_scale = (sx * sw1).reshape(())
    aq, _, aa = _split.on_rows(
        features,
        _local_amax(
            features,
            lambda h, hs, s: activation_fp8(h, hs, s, c2.input_dtype, spec.activation, False),
            2,
        ),
        (h, h_scale, sa),
        (dims, None, None),
        (dims, None, "max"),
    )
    saved_h = h
    if save_fp8:
        aq, saved_h = _saved.save_fp8_before(h, _saved.margin(c1), aq)
    w2q, w2Tq, aw2 = _gemm.quantize_both(w2[None], sw2, c2.kernel_dtype, c2.cast_kernel)
    a3, w2q = _sp.pin_operands(row, aq[None], w2q, 2, 2)  # fc2 split over its inputs
    y = _sp.scatter(row, _scaled_gemm(a3, sa, w2q, sw2, spec.x_dtype, c2.fast_forward, c2), 1)
    y = y[0]
    # fc2's wgrad operand aq^T is not kept: the backward kernel recomputes it from h
    residuals = (xTq, w1Tq, saved_h, w2Tq, *chosen, ax, aw1, aa, aw2)
    return y, residuals


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gated_mlp(spec: Spec, x, w1, state1, w2, state2):
    """``fc2(act(fc1(x)_gate) * fc1(x)_up)`` with FP8 GEMMs (``act`` from ``spec.activation``):
    ``x [M, C]``, ``w1 [2F, C]`` (rows ``[gate | up]``, or interleaved in blocks of
    ``spec.gate_block``), ``w2 [N, F]``; ``state1``/``state2``
    the fc1/fc2 `_dot.STATE_FIELDS` tuples as `fp8jax._state.MAX_GRAD`, whose new values
    come back as their gradients."""
    return _forward(spec, x, w1, _state.values(state1), w2, _state.values(state2))[0]


def _dht_block(gate_block: int | None) -> int | None:
    """The row layout the backward kernel writes fc1's transposed gradient in: the stored
    one where the kernel can (``[gate | up]`` or blocks of `BLOCK`), else ``[gate | up]``
    (then permuted to the stored one)."""
    return gate_block if gate_block in (None, BLOCK) else None


def _fwd(spec, x, w1, state1, w2, state2):
    state1, state2 = _state.values(state1), _state.values(state2)
    # h as (e4m3, scale) with fc1_out_fp8: current scaling from its amax
    y, residuals = _forward(spec, x, w1, state1, w2, state2, spec.fc1_out_fp8)
    return y, (_named(residuals), state1, state2)


def _named(residuals):
    """The residuals under the checkpoint names `fp8jax.remat_policy` saves, as `_dot` names
    an FP8 GEMM's: the FP8 input copy, the FP8 weights, fc1's output (or its FP8 copy and
    scale) and the scalars (under a ``jax.checkpoint`` with that policy the core's forward
    then does not run again)."""
    xTq, w1Tq, h, w2Tq, *scalars = residuals
    return (
        checkpoint_name(xTq, _dot.INPUT_RESIDUAL),
        checkpoint_name(w1Tq, _dot.KERNEL_RESIDUAL),
        jax.tree_util.tree_map(lambda a: checkpoint_name(a, FC1_OUT), h),
        checkpoint_name(w2Tq, _dot.KERNEL_RESIDUAL),
        *(checkpoint_name(s, _dot.SCALAR_RESIDUALS) for s in scalars),
    )


def _bwd(spec, saved, g):
    (xTq, w1Tq, h, w2Tq, *chosen, ax, aw1, aa, aw2), state1, state2 = saved
    c1, c2 = spec.config1, spec.config2
    sx, sw1, sdh, sa, sw2, sg = map(_gemm.gemm_scale, chosen)
    col, row, tokens, features, dims = _sequence_splits(spec)
    gq, gTq, ag = _cast(tokens, g, sg, c2.grad_dtype, c2.cast_kernel)
    if row is not None:  # g's FP8 tokens gathered once; fc2's wgrad reads them transposed
        gq = _sp.gather(row, gq, 1)
        gTq = jnp.swapaxes(gq, 1, 2)
    gq, w2Tq = _sp.pin_operands(col, gq, w2Tq, None, 1)  # da split over fc2's inputs
    da = _gemm.gemm(gq, w2Tq, BF16, _gemm.gemm_precision(c2.fast_backward))[
        0
    ]  # [M, F], not dequantized
    # per device under sequence parallelism: fc1's transposed gradient in the kernels' own
    # blocks (a `[gate | up]` of each device's rows is not the weight's), moved locally
    dht_block = BLOCK if col is not None else _dht_block(spec.gate_block)

    def grad(h, hs, da, das, sdh, sa):
        return activation_grad_fp8(
            h, hs, da, das, sdh, c1.grad_dtype, sa, c2.input_dtype, spec.activation,
            dht_block=dht_block,
        )  # fmt: skip

    h_scale = (sx * sw1).reshape(())
    if spec.fc1_out_fp8:  # e4m3 -> bf16 is exact; the kernel applies the scale in float32
        (h, h8_scale), da = _saved.read_after(h, da)
        h, h_scale = h.astype(BF16), h_scale * h8_scale.reshape(())
    args = (h, h_scale, da, (sg * sw2).reshape(()), sdh, sa)
    in_dims = (dims, None, dims, None, None, None)
    t_dims = _split.Dims(1, 0) if col is not None else 1  # the transposed outputs
    grad = _local_amax(features, grad, 2)
    dhq, dhTq, adh, aTq = _split.on_rows(
        features, grad, args, in_dims, (dims, t_dims, "max", t_dims)
    )
    dw2 = _scaled_gemm(gTq, sg, aTq[None], sa, spec.w2_dtype, c2.fast_backward, c2)[0]
    d3, w1Tq = _sp.pin_operands(col, dhq[None], w1Tq, 2, 2)  # contracts fc1's split rows
    dx = _sp.scatter(col, _scaled_gemm(d3, sdh, w1Tq, sw1, spec.x_dtype, c1.fast_backward, c1), 1)
    dx = dx[0]
    if col is not None:  # x's transposed FP8 tokens, kept split, gathered again only once
        # g's amax exists (`fp8jax._ops.dot._after`: else XLA may gather in the forward)
        xTq = _sp.gather(col, _dot._after(_sp.constrain(col, xTq, 2, True), ag), 2)
    dw1 = _scaled_gemm(dhTq[None], sdh, xTq, sx, spec.w1_dtype, c1.fast_backward, c1)[0]
    dw1 = _relayout(dw1, dht_block, spec.gate_block, col is not None)  # as stored

    amaxes = q.combined_max(ax, aw1, adh, aa, aw2, ag)  # both layers' in one reduction
    cx, cw1, cdh, ca, cw2, cg = chosen
    state1_ct = _update.new_state(state1, cx, cw1, cdh, _update.observed_amaxes(*amaxes[:3]))
    state2_ct = _update.new_state(state2, ca, cw2, cg, _update.observed_amaxes(*amaxes[3:]))
    return dx, dw1, _state.proposal(state1_ct), dw2, _state.proposal(state2_ct)


gated_mlp.defvjp(_fwd, _bwd)
