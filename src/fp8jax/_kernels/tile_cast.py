"""The block-wise recipe's cast: one read of each ``bs x bs`` square, both layouts written
(Pallas Triton).

The three GEMMs of a train step contract along different dims, so an activation or output
gradient ``t [B, P, C]`` is needed twice (DeepSeek-V3's and Transformer Engine's scheme):
``t`` per ``1 x bs`` tile along ``C``, and ``t^T [B, C, P]`` per ``1 x bs`` tile along
``P``, each cast from the high-precision tensor with its own tile scales. XLA runs that as
two passes over ``t``, the second a strided reduction fused with the transpose, several
times one layout's cast (`benchmarks/RESULTS.md`, "The casts (issues 23, 25)", 2026-11-25
sixth session). Here one program
loads a ``bs x bs`` square once, takes its row amaxes (the tiles along ``C``) and its column
amaxes (the tiles along ``P``), and writes both FP8 layouts and both scale sets. A weight's
``bs x bs`` block (one scale) takes the same kernel with ``weight=True``.

The scale math is `fp8jax._quant.tile_scales` (the recipe's), so the values are the XLA
path's up to the rounding of the division (exact with power-of-two scales). ``interpret``
runs the kernel body on any backend (the CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .. import _quant as q
from .cast import device_reason, pl, triton_params

F32 = jnp.float32
# Warps per program, the fastest of 4 / 8 / 16 on the GPU for activations and for weights
# (benchmarks/RESULTS.md, "The casts (issues 23, 25)", 2026-11-25 sixth session).
NUM_WARPS = {False: 4, True: 8}


def reason(shape: tuple[int, ...], block_size: int, device=None) -> str | None:
    """Why the kernel cannot cast a ``[B, P, C]`` tensor on ``device`` (default: the first
    device), or None when it can."""
    return device_reason(device) or shape_reason(shape, block_size)


def shape_reason(shape: tuple[int, ...], block_size: int) -> str | None:
    """Why a ``[B, P, C]`` shape does not tile into ``block_size`` squares, or None."""
    if block_size not in (32, 64, 128, 256):
        return f"block_size {block_size} is not a power of two in [32, 256]"
    if len(shape) != 3 or shape[1] % block_size or shape[2] % block_size:
        return f"shape {shape} is not [B, P, C] with P and C multiples of {block_size}"
    return None


def _kernel(t_ref, q_ref, s_ref, qt_ref, st_ref, amax_ref, *, margin, power_of_two, weight):
    t = t_ref[...].astype(F32)
    row_amax = q.tile_amax(t, axis=1)  # [bs]: the tiles along C
    col_amax = q.tile_amax(t, axis=0)  # [bs]: the tiles along P
    block_amax = jnp.max(row_amax)
    amax_ref[...] = block_amax.reshape(1, 1)
    if weight:  # one scale for the square, both layouts are the same values
        scale = q.tile_scales(block_amax, q_ref.dtype, margin, power_of_two)
        data = q.clamp_in_kernel(t / scale, q_ref.dtype)
        q_ref[...] = data
        qt_ref[...] = data.T
        s_ref[...] = scale.reshape(1, 1)
        st_ref[...] = scale.reshape(1, 1)
        return
    row_scale = q.tile_scales(row_amax, q_ref.dtype, margin, power_of_two)
    col_scale = q.tile_scales(col_amax, q_ref.dtype, margin, power_of_two)
    q_ref[...] = q.clamp_in_kernel(t / row_scale[:, None], q_ref.dtype)
    qt_ref[...] = q.clamp_in_kernel(t / col_scale[None, :], q_ref.dtype).T
    s_ref[...] = row_scale[:, None]
    st_ref[...] = col_scale[:, None]


@functools.partial(
    jax.jit,
    static_argnames=("dtype", "block_size", "margin", "power_of_two", "weight", "interpret"),
)
def cast_both(
    t,
    dtype,
    block_size: int = 128,
    margin: float = 0.0,
    power_of_two: bool = False,
    weight: bool = False,
    interpret: bool = False,
):
    """``t [B, P, C]`` -> ``(data [B, P, C], scale, data_t [B, C, P], scale_t, amax)``.

    Activations (``weight=False``): ``scale [B, P, C/bs]`` per ``1 x bs`` tile of ``data``,
    ``scale_t [B, C, P/bs]`` per ``1 x bs`` tile of ``data_t``. Weights: one scale per
    ``bs x bs`` block, ``scale [B, P/bs, C/bs]`` and ``scale_t`` its transpose. ``amax`` is
    ``max |t|`` as float32 (inf where ``t`` holds a NaN or an inf).
    """
    why = shape_reason(t.shape, block_size)
    if why is not None:
        raise ValueError(f"tile_cast.cast_both: {why}")
    bsz, p, c = t.shape
    bs = block_size
    grid = (bsz, p // bs, c // bs)
    square = pl.BlockSpec((None, bs, bs), lambda b, i, j: (b, i, j))
    square_t = pl.BlockSpec((None, bs, bs), lambda b, i, j: (b, j, i))
    one = pl.BlockSpec((None, 1, 1), lambda b, i, j: (b, i, j))
    if weight:
        scale_specs = [one, pl.BlockSpec((None, 1, 1), lambda b, i, j: (b, j, i))]
        scale_shapes = [(bsz, p // bs, c // bs), (bsz, c // bs, p // bs)]
    else:
        scale_specs = [
            pl.BlockSpec((None, bs, 1), lambda b, i, j: (b, i, j)),
            pl.BlockSpec((None, bs, 1), lambda b, i, j: (b, j, i)),
        ]
        scale_shapes = [(bsz, p, c // bs), (bsz, c, p // bs)]
    kernel = functools.partial(_kernel, margin=margin, power_of_two=power_of_two, weight=weight)
    data, scale, data_t, scale_t, tile_amax = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[square],
        out_specs=[square, scale_specs[0], square_t, scale_specs[1], one],
        out_shape=[
            jax.ShapeDtypeStruct((bsz, p, c), dtype),
            jax.ShapeDtypeStruct(scale_shapes[0], F32),
            jax.ShapeDtypeStruct((bsz, c, p), dtype),
            jax.ShapeDtypeStruct(scale_shapes[1], F32),
            jax.ShapeDtypeStruct(grid, F32),
        ],
        interpret=interpret,
        **triton_params(interpret, NUM_WARPS[weight]),
    )(t)
    return data, scale, data_t, scale_t, jnp.max(tile_amax)


def _rows_kernel(t_ref, row_scale_ref, col_scale_ref, q_ref, qt_ref):
    t = t_ref[...].astype(F32)
    q_ref[...] = q.clamp_in_kernel(t / row_scale_ref[...], q_ref.dtype)
    qt_ref[...] = q.clamp_in_kernel(t / col_scale_ref[...], q_ref.dtype).T


@functools.partial(jax.jit, static_argnames=("dtype", "block_size", "interpret"))
def cast_rows_with(t, scale, scale_t, dtype, block_size: int = 128, interpret=False):
    """The row-wise recipe's cast with its scales given: ``t [B, P, C]`` divided by
    ``scale [B, P, 1]`` and ``t^T [B, C, P]`` by ``scale_t [B, C, 1]`` (one per column of
    ``t``), both saturated to ``dtype``, in one read of ``t`` (XLA's path reads it twice,
    once strided). Returns ``(data, data_t)``, the bits of `fp8jax._recipe.RowWise`'s XLA
    path."""
    why = shape_reason(t.shape, block_size)
    if why is not None:
        raise ValueError(f"tile_cast.cast_rows_with: {why}")
    bsz, p, c = t.shape
    if scale.shape != (bsz, p, 1) or scale_t.shape != (bsz, c, 1):
        raise ValueError(
            f"tile_cast.cast_rows_with: scales {scale.shape} and {scale_t.shape} do not fit "
            f"t {t.shape} ([B, P, 1] and [B, C, 1])"
        )
    bs = block_size
    return pl.pallas_call(
        _rows_kernel,
        grid=(bsz, p // bs, c // bs),
        in_specs=[
            pl.BlockSpec((None, bs, bs), lambda b, i, j: (b, i, j)),
            pl.BlockSpec((None, bs, 1), lambda b, i, j: (b, i, 0)),
            pl.BlockSpec((None, 1, bs), lambda b, i, j: (b, 0, j)),
        ],
        out_specs=[
            pl.BlockSpec((None, bs, bs), lambda b, i, j: (b, i, j)),
            pl.BlockSpec((None, bs, bs), lambda b, i, j: (b, j, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((bsz, p, c), dtype),
            jax.ShapeDtypeStruct((bsz, c, p), dtype),
        ],
        interpret=interpret,
        **triton_params(interpret, NUM_WARPS[False]),
    )(t, scale.astype(F32), jnp.swapaxes(scale_t, 1, 2).astype(F32))
