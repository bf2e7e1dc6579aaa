"""Block-scaled FP8 GEMMs for grouped experts (Pallas Mosaic GPU, Hopper): the block-wise
recipe on the aligned group layout of `fp8jax._kernels.grouped_gemm` (every expert's rows
start at a multiple of 128).

* `grouped_rows`: ``out[r] = sum_k a_scale[r, k] * b_scale[g(r), :, k] * (a[r, kchunk] .
  b[g(r), :, kchunk])`` for ``a [M, K]`` (1x128 tiles) and ``b [G, N, K]`` (128x128 blocks):
  the forward ``x . W_e`` and the dgrad ``dy . W_e^T``. It is the dense kernel
  (`fp8jax._kernels.blockwise_gemm_mgpu`, two math warpgroups, block B scales folded into the
  row scales) with each 128-row CTA tile reading its group's weight.
* `grouped_wgrad`: ``out[g] = sum over group g's 128-row chunks c of (a_t[:, c] . b_t[:, c]^T)
  * (a_scale[:, c] (x) b_scale[:, c])`` for ``a_t [K, M]``, ``b_t [N, M]`` (both 1x128 tiles
  along M: the weight gradient ``x_e^T . dy_e``). The dense kernel's layout too (two math
  warpgroups and a TMA warpgroup per ``128 x 128`` tile), every chunk promoted with
  per-column scales, the pipeline as long as the group; empty groups get zeros.

Both need FP8 operands and float32 scales; `reason` says why a call cannot run here, and
`fp8jax._ops.grouped_tiled` then takes the float32 reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import blockwise_gemm_mgpu as _mg
from . import grouped_gemm as _gg

pl, plgpu = _gg.pl, _gg.plgpu
BLOCK = _mg.BLOCK_K  # 128: the recipe's tile, the group alignment, the promotion chunk
# `grouped_wgrad` with 4 pipeline stages, where the dense kernels keep 3: the best of 2-5,
# by far at 8 experts, a little at 64 (benchmarks/RESULTS.md, "Grouped block-scaled wgrad:
# pipeline depth", 2026-11-26 eleventh session).
WGRAD_CONFIG = _mg.Config(max_concurrent_steps=4)


def reason(m: int, k: int, n: int, dtype, out_dtype) -> str:
    """Why the kernels cannot run ``[M, K] x [G, N, K]`` (and its dgrad and wgrad) here
    ("" when they can)."""
    ok, why = _gg.available()
    if not ok:
        return why
    if m % BLOCK or k % BLOCK or n % BLOCK:
        return f"M={m}, K={k}, N={n} are not multiples of {BLOCK}"
    if _gg.ROW_ALIGN != BLOCK:
        return f"the group alignment {_gg.ROW_ALIGN} is not the block {BLOCK}"
    fp8 = tuple(map(jnp.dtype, (jnp.float8_e4m3fn, jnp.float8_e5m2)))
    if jnp.dtype(dtype) not in fp8:
        return f"operands {jnp.dtype(dtype)} are not FP8"
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return f"out_dtype {jnp.dtype(out_dtype)} (the kernels write float32 or bfloat16)"
    return ""


# Groups aligned to 256 rows: each CTA runs DeepGEMM's 256 x 128 block (two waves per math
# warpgroup, `blockwise_gemm_mgpu.Config.waves`) on one group, two CTAs sharing A: faster
# than 128-row blocks at 8 and 64 experts (benchmarks/RESULTS.md, "Grouped experts: 256-row
# blocks on 256-aligned groups", 2026-11-26 thirteenth session).
ALIGNED_256 = _mg.Config(waves=2, cluster_n=2)


def grouped_rows(a, a_scale, b, b_scale, block_group, *, out_dtype, group_align: int = BLOCK):
    """``a [M, K]``, ``a_scale [M, K/128]``, ``b [G, N, K]``, ``b_scale [G, N/128, K/128]``
    and ``block_group [M/128]`` (group of each row block, ``G`` past the last) -> ``[M, N]``;
    rows of blocks past the last group are undefined. ``group_align=256``: every group
    starts at a multiple of 256 rows (the caller's layout says so), so 256-row blocks with
    a bf16 output run `ALIGNED_256`."""
    m, k = a.shape
    g, n, _ = b.shape
    nk = k // BLOCK
    if a_scale.shape != (m, nk) or b_scale.shape != (g, n // BLOCK, nk):
        raise ValueError(
            f"blockwise grouped GEMM: a {a.shape}, a_scale {a_scale.shape}, b {b.shape}, "
            f"b_scale {b_scale.shape} do not fit [M, K], [M, K/128], [G, N, K], "
            "[G, N/128, K/128]"
        )
    config = _mg.Config()
    if group_align % 256 == 0 and m % 256 == 0 and jnp.dtype(out_dtype) == jnp.bfloat16:
        config, block_group = ALIGNED_256, block_group[::2]  # one group per 256-row block
    sa, sb = _mg._chunk_major(a_scale), _mg._block_scales_per_row(b_scale, config.tile_m)
    return _mg._warp_specialized(
        a, sa, b, sb, out_dtype, config, b_blocks=True, block_group=block_group
    )


def grouped_wgrad(a_t, a_scale, b_t, b_scale, group_starts, group_padded_sizes, *, out_dtype):
    """``a_t [K, M]``, ``a_scale [K, M/128]``, ``b_t [N, M]``, ``b_scale [N, M/128]``,
    ``group_starts [G]`` and ``group_padded_sizes [G]`` (multiples of 128) -> ``[G, K, N]``."""
    k, m = a_t.shape
    n, g = b_t.shape[0], group_starts.shape[0]
    nm = m // BLOCK
    if a_scale.shape != (k, nm) or b_scale.shape != (n, nm) or b_t.shape[1] != m:
        raise ValueError(
            f"blockwise grouped wgrad: a_t {a_t.shape}, a_scale {a_scale.shape}, b_t "
            f"{b_t.shape}, b_scale {b_scale.shape} do not fit [K, M], [K, M/128], [N, M], "
            "[N, M/128]"
        )
    config = WGRAD_CONFIG
    bm, bn, bk, wgs = config.tile_m, config.tile_n, BLOCK, config.math_warpgroups
    cta_m = config.cta_tile_m
    grid_m, grid_n = k // cta_m, n // bn
    out_transforms = _gg._smem_transforms(bn, out_dtype)

    def body(starts_gmem, blocks_gmem, a_gmem, b_gmem, sa_gmem, sb_gmem, o_gmem):
        wg = jax.lax.axis_index("wg")
        step = _mg._promotion_step(wg, 1, False, (bm, bn))

        def pipeline(compute_context, num_blocks, first=0, m_i=0, n_i=0):
            return _mg._ws_pipeline(
                step, compute_context, config, (a_t.dtype, b_t.dtype), (grid_m, grid_n),
                num_blocks, bn, m_i, n_i, first,
            )  # fmt: skip

        ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on it)
        # Allocations from a static pipeline as long as the longest group could be.
        static = pipeline(ignore, max(nm, config.max_concurrent_steps))

        @functools.partial(
            pl.run_scoped,
            allocs=static.get_allocations(a_gmem, b_gmem, sa_gmem, sb_gmem),
            o_smem=plgpu.SMEM((wgs, bm, bn), out_dtype, transforms=out_transforms),
            collective_axes="wg",
        )
        def _scope(allocs, o_smem):
            @plgpu.nd_loop((g, grid_m * grid_n), collective_axes="sm")
            def _loop(loop_info):
                g_i = loop_info.index[0]
                m_i, n_i = plgpu.planar_snake(
                    loop_info.index[1], (grid_m, grid_n), 1, config.grid_tile_width
                )
                start = pl.multiple_of(starts_gmem[g_i], bk)
                num_blocks = blocks_gmem[g_i]
                group_rows = pl.ds(start, m)  # may run past M: only the group's blocks are read

                def store(total):
                    dst = o_gmem.at[g_i, pl.ds(m_i * cta_m + wg * bm, bm), pl.ds(n_i * bn, bn)]
                    _mg._store_tiles([o_smem.at[wg]], [total.astype(out_dtype)], [dst])

                def compute_context(run):
                    (total,) = run((_mg._wgmma_zero((bm, bn)),))
                    store(total)

                @pl.when(num_blocks > 0)
                def _run():
                    pipeline(compute_context, num_blocks, start // bk, m_i, n_i)(
                        a_gmem.at[:, group_rows],
                        b_gmem.at[:, group_rows],
                        sa_gmem,
                        sb_gmem,
                        allocations=allocs,
                    )

                @pl.when((num_blocks == 0) & (wg < wgs))
                def _empty():
                    store(_mg._wgmma_zero((bm, bn)))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = _mg._ws_kernel(body, jax.ShapeDtypeStruct((g, k, n), out_dtype), config)
    blocks = group_padded_sizes.astype(jnp.int32) // bk
    sa, sb = _mg._chunk_major(a_scale), _mg._chunk_major(b_scale)  # [M/128 * K], [M/128 * N]
    return kernel(group_starts.astype(jnp.int32), blocks, a_t, b_t, sa, sb)
