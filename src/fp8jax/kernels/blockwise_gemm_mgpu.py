"""Hopper block-scaled FP8 GEMM (Pallas Mosaic GPU, ``wgmma``): DeepGEMM's scheme.

``out[i, j] = sum_k a_scale[i, k] * b_scale[j, k] * (a[i, kblock] . b[j, kblock])`` for
``a [M, K]``, ``b [N, K]`` (both K-major, FP8), ``a_scale [M, K/128]`` and
``b_scale [N, K/128]`` float32 (a weight's ``128 x 128`` block scales arrive expanded to its
rows by `fp8jax.kernels.blockwise_gemm.row_scales`).

Per output tile (``tile_m x tile_n``, one warpgroup) the K loop is a Pallas pipeline (TMA
loads of the FP8 tiles and of the two scale vectors, ``max_concurrent_steps`` ahead). Each
step accumulates one 128-K chunk with ``wgmma`` into a fresh float32 accumulator, waits for
it, and promotes it into the tile's running float32 total (a loop carry in registers):
``total += chunk * (a_scale[rows, k] (x) b_scale[cols, k])``. Both accumulators live in
registers, so the tile is 64 rows (64 + 64 registers per thread for ``64 x 128``), as in
DeepGEMM's math warpgroups; two CTAs share an SM to hide the per-step ``wgmma`` wait.

Written against the Pallas Mosaic GPU API of jax 0.10-0.11 (the calls
`fp8jax.kernels.grouped_gemm` and JAX's ``attention_mgpu`` use: ``emit_pipeline``,
``plgpu.ACC``, ``plgpu.load`` with ``Layout.WGMMA.reduce``). `reason` says why a call
cannot run here; callers then take the plain-JAX reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import grouped_gemm as _gg

pl, plgpu = _gg.pl, _gg.plgpu
BLOCK_K = 128  # the K chunk promoted to float32: the recipe's block size


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles of `gemm`: one warpgroup per ``tile_m x tile_n`` output tile."""

    tile_m: int = 64
    tile_n: int = 128
    # 2 stages: 760 TFLOP/s at 8192^3 on the H100 against 677 with 3 and 658 with 4
    # (benchmarks/RESULTS.md, 2026-11-25 fourth session)
    max_concurrent_steps: int = 2
    grid_tile_width: int = 8
    ctas_per_sm: int = 2


def reason(a_shape, b_shape, a_dtype, b_dtype, out_dtype, block_size, config=Config()) -> str:
    """Why the kernel cannot run ``[B, M, K] x [B, N, K]`` ("" when it can)."""
    ok, why = _gg.available()
    if not ok:
        return why
    if block_size != BLOCK_K:
        return f"block_size={block_size}; the kernel promotes every {BLOCK_K} K"
    if a_shape[0] != 1:
        return f"batch {a_shape[0]} > 1 (the kernel runs one GEMM)"
    (_, m, k), n = a_shape, b_shape[1]
    if m % config.tile_m or n % config.tile_n or k % BLOCK_K:
        return (
            f"M={m}, N={n}, K={k} are not multiples of tile_m={config.tile_m}, "
            f"tile_n={config.tile_n}, {BLOCK_K}"
        )
    fp8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)
    if jnp.dtype(a_dtype) not in map(jnp.dtype, fp8) or jnp.dtype(b_dtype) not in map(
        jnp.dtype, fp8
    ):
        return f"operands {jnp.dtype(a_dtype)} x {jnp.dtype(b_dtype)} are not FP8"
    if jnp.dtype(a_dtype) != jnp.dtype(b_dtype) and _gg._jax_version() < (0, 11, 0):
        return "mixed e4m3 x e5m2 operands need jax >= 0.11"
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return f"out_dtype {jnp.dtype(out_dtype)} (the kernel writes float32 or bfloat16)"
    return ""


def _load(ref, layout, interpret: bool):
    """A scale vector from SMEM in ``layout`` (the interpreter has no ``plgpu.load``)."""
    return ref[...] if interpret else plgpu.load(ref, (), layout=layout)


def gemm(a, a_scale, b, b_scale, *, out_dtype, config: Config = Config(), interpret=False):
    """``a [M, K]``, ``a_scale [M, K/128]``, ``b [N, K]``, ``b_scale [N, K/128]`` ->
    ``[M, N]`` in ``out_dtype`` (see the module docstring). ``interpret``: run in Pallas'
    GPU interpret mode (CPU, tests; two CTAs)."""
    m, k = a.shape
    n, k2 = b.shape
    nk = k // BLOCK_K
    if k != k2 or a_scale.shape != (m, nk) or b_scale.shape != (n, nk):
        raise ValueError(
            f"blockwise GEMM kernel: a {a.shape}, a_scale {a_scale.shape}, b {b.shape}, "
            f"b_scale {b_scale.shape} do not fit [M, K], [M, K/128], [N, K], [N, K/128]"
        )
    why = reason((1, m, k), (1, n, k), a.dtype, b.dtype, out_dtype, BLOCK_K, config)
    if why and not (interpret and why == _gg.available()[1]):
        raise ValueError(f"blockwise GEMM kernel: {why}")
    bm, bn, bk = config.tile_m, config.tile_n, BLOCK_K
    grid_m, grid_n = m // bm, n // bn
    a_transforms = _gg._smem_transforms(bk, a.dtype)
    b_transforms = _gg._smem_transforms(bk, b.dtype)
    out_transforms = _gg._smem_transforms(bn, out_dtype)
    # K chunk first, flat: the scales of one chunk for a row tile are contiguous (one TMA).
    sa = a_scale.astype(jnp.float32).T.reshape(-1)  # [nk * M]
    sb = b_scale.astype(jnp.float32).T.reshape(-1)  # [nk * N]

    def body(a_gmem, b_gmem, sa_gmem, sb_gmem, o_gmem):
        @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
        def _loop(loop_info):
            (lin,) = loop_info.index
            m_i, n_i = plgpu.planar_snake(lin, (grid_m, grid_n), 1, config.grid_tile_width)

            def step(_, a_smem, b_smem, sa_smem, sb_smem, total):
                # The scales first: their loads overlap the chunk's wgmma.
                row_s = _load(sa_smem, plgpu.Layout.WGMMA.reduce(1), interpret)
                col_s = _load(sb_smem, plgpu.Layout.WGMMA.reduce(0), interpret)

                def chunk_scope(acc_ref):
                    plgpu.wgmma(acc_ref, a_smem, _gg._transposed(b_smem))
                    plgpu.wgmma_wait(0)
                    return acc_ref[...]

                if interpret:  # the interpreter's wgmma takes no transposed B
                    dims = (((1,), (1,)), ((), ()))
                    chunk = lax.dot_general(
                        a_smem[...], b_smem[...], dims, preferred_element_type=jnp.float32
                    )
                else:
                    chunk = pl.run_scoped(chunk_scope, plgpu.ACC((bm, bn), jnp.float32))
                scale = lax.broadcast_in_dim(row_s, (bm, bn), [0]) * lax.broadcast_in_dim(
                    col_s, (bm, bn), [1]
                )
                return total + chunk * scale

            zero = jnp.full((bm, bn), 0, jnp.float32)
            if not interpret:  # the interpreter has no layouts
                zero = plgpu.layout_cast(zero, plgpu.Layout.WGMMA)
            total = plgpu.emit_pipeline(
                step,
                grid=(nk,),
                in_specs=[
                    plgpu.BlockSpec((bm, bk), lambda kk: (m_i, kk), transforms=a_transforms),
                    plgpu.BlockSpec((bn, bk), lambda kk: (n_i, kk), transforms=b_transforms),
                    plgpu.BlockSpec((bm,), lambda kk: (kk * grid_m + m_i,)),
                    plgpu.BlockSpec((bn,), lambda kk: (kk * grid_n + n_i,)),
                ],
                max_concurrent_steps=config.max_concurrent_steps,
                init_carry=zero,
            )(a_gmem, b_gmem, sa_gmem, sb_gmem)
            out = total.astype(out_dtype)

            @functools.partial(
                pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), out_dtype, transforms=out_transforms)
            )
            def _store(o_smem):
                o_smem[...] = out
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(m_i * bm, bm), pl.ds(n_i * bn, bn)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    extra = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        extra = dict(interpret=InterpretGPUParams())
    ctas = 2 if interpret else _gg._num_sms() * config.ctas_per_sm
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(ctas,),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **extra,
    )
    return kernel(a, b, sa, sb)
