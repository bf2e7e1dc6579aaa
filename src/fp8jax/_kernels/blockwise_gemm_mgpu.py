"""Hopper block-scaled FP8 GEMM (Pallas Mosaic GPU, ``wgmma``): DeepGEMM's scheme.

``out[i, j] = sum_k a_scale[i, k] * b_scale[j, k] * (a[i, kblock] . b[j, kblock])`` for
``a [M, K]``, ``b [N, K]`` (both K-major, FP8), ``a_scale [M, K/128]`` float32, and
``b_scale`` float32 either per row ``[N, K/128]`` (1x128 tiles: the wgrad's operands) or
per ``128 x 128`` block ``[N/128, K/128]`` (a weight, in the forward and dgrad).

Each math warpgroup owns a ``64 x tile_n`` output tile. Per 128-K chunk it accumulates
with ``wgmma`` into a fresh float32 accumulator, waits for it, and promotes it into the
tile's running float32 total (a loop carry in registers):
``total += chunk * (a_scale[rows, k] (x) b_scale[cols, k])``. Both accumulators live in
registers (64 + 64 per thread for ``64 x 128``), as in DeepGEMM's math warpgroups. The wait
before each promotion would idle the tensor cores, so something else must issue ``wgmma``
meanwhile:

* ``math_warpgroups=2`` (default, DeepGEMM's layout): a CTA computes a ``128 x tile_n``
  tile with two math warpgroups (64 rows each, sharing the B tile) and a third warpgroup
  that only issues the TMA loads (`plgpu.emit_pipeline_warp_specialized`); while one math
  warpgroup promotes, the other's ``wgmma`` runs. With B scaled per block and
  ``tile_n=128``, a chunk's B scale is one number per tile: it multiplies the two row
  scales a thread holds, and the promotion is one multiply-add per element instead of the
  outer product's three operations (clearly faster: `benchmarks/RESULTS.md`, "Block-scaled
  GEMM: DeepGEMM's warpgroup layout", 2026-11-25 fifth session). With
  ``waves=2`` each math warpgroup owns two 64-row tiles and runs their chunks in turn
  (DeepGEMM's ``256 x 128`` block): one B tile then feeds four ``wgmma`` waves.
* ``math_warpgroups=1``: one warpgroup per CTA loads and computes (`plgpu.emit_pipeline`),
  and ``ctas_per_sm`` CTAs share an SM. Also the layout the CPU interpret-mode test runs.

Written against the Pallas Mosaic GPU API of jax 0.10-0.11 (the calls
`fp8jax._kernels.grouped_gemm` and JAX's ``attention_mgpu`` use: ``emit_pipeline``,
``plgpu.ACC``, ``plgpu.load`` with ``Layout.WGMMA.reduce``). `reason` says why a call
cannot run here; callers then take the plain-JAX reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from .. import _jax_compat
from . import grouped_gemm as _gg
from .block_scales import row_scales

pl, plgpu = _gg.pl, _gg.plgpu
BLOCK_K = 128  # the K chunk promoted to float32: the recipe's block size


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles of `gemm`: each math warpgroup computes a ``tile_m x tile_n`` output tile."""

    tile_m: int = 64
    tile_n: int = 128
    # Two math warpgroups: 3 stages are the best of 2-5 with B per block and per column
    # alike (benchmarks/RESULTS.md, "Block-scaled GEMM: DeepGEMM's warpgroup layout",
    # 2026-11-25 fifth session).
    max_concurrent_steps: int = 3
    grid_tile_width: int = 8
    ctas_per_sm: int = 1
    math_warpgroups: int = 2  # 1: the single-warpgroup kernel (see the module docstring)
    # Two-warpgroup kernel: CTAs per cluster along N. 2: the two CTAs of a cluster compute
    # neighbouring N tiles of the same rows and share each A tile (one TMA multicast to
    # both), halving A's reads from L2; needs an even number of N tiles, else 1 is used.
    cluster_n: int = 1
    # Dense two-warpgroup kernel: CTAs per cluster along M (2: neighbouring M tiles of the
    # same columns share each B tile, DeepGEMM's 1x128 x 1x128 choice). One of the two is 1.
    cluster_m: int = 1
    # Two-warpgroup kernel: ``tile_m``-row waves per math warpgroup. 2: each warpgroup
    # promotes two 64-row tiles in turn (DeepGEMM's 256-row block), so one B tile feeds
    # four ``wgmma`` waves instead of two; dense GEMMs with bf16 output only.
    waves: int = 1

    @property
    def cta_tile_m(self) -> int:
        return self.tile_m * self.math_warpgroups * self.waves


# Block-scaled B (forward, dgrad), M a multiple of 128: two-CTA clusters sharing A and 4
# stages, a few percent faster than `Config()` at every shape timed (benchmarks/RESULTS.md,
# "Block-scaled GEMM: two-CTA clusters sharing A", 2026-11-26 twelfth session).
BLOCK_SCALES_128 = Config(max_concurrent_steps=4, cluster_n=2)
# M a multiple of 256 and bf16 out: DeepGEMM's choice at these shapes (256 x 128 blocks, two
# CTAs sharing A, 3 stages; its `DG_PRINT_CONFIGS`): faster than `BLOCK_SCALES_128` at the
# four shapes timed; per column two waves are slower (the promotion's outer product needs the
# registers) (benchmarks/RESULTS.md, "Block-scaled GEMM: 256-row blocks, DeepGEMM's layout",
# 2026-11-26 thirteenth session).
BLOCK_SCALES = Config(max_concurrent_steps=3, cluster_n=2, waves=2)
# B per column (the wgrad): two CTAs sharing B, 4 stages (DeepGEMM's 1x128 x 1x128 choice, with
# its 152-wide tiles): faster at three of the four shapes timed, a little slower at 8192^3
# (benchmarks/RESULTS.md, "The per-column kernel (the wgrad): two CTAs sharing B", 2026-11-26
# thirteenth session).
PER_COLUMN = Config(max_concurrent_steps=4, cluster_m=2)

# The single-warpgroup kernel's best setting at 8192^3: 2 stages beat 3 and 4
# (benchmarks/RESULTS.md, "Block-scaled GEMM pipeline depth (issue 25)", 2026-11-25).
SINGLE_WARPGROUP = Config(max_concurrent_steps=2, ctas_per_sm=2, math_warpgroups=1)


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
    if config.math_warpgroups not in (1, 2) or config.tile_m != 64:
        return f"{config}: tile_m must be 64 and math_warpgroups 1 or 2"
    if m % SINGLE_WARPGROUP.tile_m or n % config.tile_n or k % BLOCK_K:
        return (
            f"M={m}, N={n}, K={k} are not multiples of tile_m={SINGLE_WARPGROUP.tile_m}, "
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
    if interpret:
        return ref[...]
    try:  # jax >= 0.11 takes the indexed ref alone (passing an index is deprecated)
        return plgpu.load(ref, layout=layout)
    except TypeError:
        return plgpu.load(ref, (), layout=layout)


def gemm(a, a_scale, b, b_scale, *, out_dtype, config: Config | None = None, interpret=False):
    """``a [M, K]``, ``a_scale [M, K/128]``, ``b [N, K]`` and ``b_scale`` one per row
    ``[N, K/128]`` or per ``128 x 128`` block ``[N/128, K/128]`` -> ``[M, N]`` in
    ``out_dtype`` (see the module docstring). ``config`` None: `BLOCK_SCALES` for block
    scales (`BLOCK_SCALES_128` where M is not a multiple of 256 or the output float32), else
    `PER_COLUMN`. ``interpret``: run in Pallas' GPU interpret mode (CPU, tests;
    two CTAs, one warpgroup each). An M that two math warpgroups do not divide (a multiple
    of 64, not of 128) runs on one."""
    m, k = a.shape
    n, k2 = b.shape
    nk = k // BLOCK_K
    b_blocks = b_scale.shape[0] != n
    if config is None:
        config = BLOCK_SCALES if b_blocks else PER_COLUMN
    if k != k2 or a_scale.shape != (m, nk) or b_scale.shape not in ((n, nk), (n // BLOCK_K, nk)):
        raise ValueError(
            f"blockwise GEMM kernel: a {a.shape}, a_scale {a_scale.shape}, b {b.shape}, "
            f"b_scale {b_scale.shape} do not fit [M, K], [M, K/128], [N, K], "
            "[N or N/128, K/128]"
        )
    why = reason((1, m, k), (1, n, k), a.dtype, b.dtype, out_dtype, BLOCK_K, config)
    if why and not (interpret and why == _gg.available()[1]):
        raise ValueError(f"blockwise GEMM kernel: {why}")
    if config.waves > 1 and (m % config.cta_tile_m or jnp.dtype(out_dtype) != jnp.bfloat16):
        # 128-row blocks (float32 tiles of two waves do not fit the SMEM with the stages)
        one = dataclasses.replace(config, waves=1)
        config = BLOCK_SCALES_128 if config == BLOCK_SCALES else one
    sa = _chunk_major(a_scale)  # [nk * M]
    two = config.math_warpgroups == 2 and not interpret and m % config.cta_tile_m == 0
    if two and b_blocks and config.tile_n == BLOCK_K:
        sb = _block_scales_per_row(b_scale, config.tile_m)
        return _warp_specialized(a, sa, b, sb, out_dtype, config, b_blocks=True)
    sb = _chunk_major(row_scales(b_scale[None], n, BLOCK_K)[0])  # one per row: [nk * N]
    if two:
        return _warp_specialized(a, sa, b, sb, out_dtype, config, b_blocks=False)
    if config.math_warpgroups != 1:
        config = dataclasses.replace(SINGLE_WARPGROUP, tile_n=config.tile_n)
    return _single_warpgroup(a, sa, b, sb, out_dtype, config, interpret)


def _chunk_major(scale):
    """``[rows, chunks]`` scales -> flat ``[chunks * rows]`` float32, K chunk first: the
    scales of one chunk for a row tile are contiguous (one TMA)."""
    return scale.astype(jnp.float32).T.reshape(-1)


def _block_scales_per_row(b_scale, tile_m: int):
    """``[..., N/128, K/128]`` block scales -> ``[..., K/128 * N/128 * tile_m]``: one per
    (N tile, K chunk), K chunk first, repeated over a warpgroup's ``tile_m`` rows, so that it
    multiplies the row scales (2 per thread) instead of every accumulator element."""
    flat = jnp.swapaxes(b_scale.astype(jnp.float32), -1, -2).reshape(*b_scale.shape[:-2], -1)
    return jnp.repeat(flat, tile_m, axis=-1)


def _scaled_chunk(a_smem, b_smem, row_s, col_s, shape):
    """One 128-K chunk's ``wgmma`` into a fresh float32 accumulator, waited for and scaled
    by ``row_s (x) col_s``: the term the promotion adds to the running total."""

    def chunk_scope(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, _gg._transposed(b_smem))
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    return pl.run_scoped(chunk_scope, plgpu.ACC(shape, jnp.float32)) * _outer(row_s, col_s, shape)


def _outer(row_s, col_s, shape):
    """``row_s (x) col_s``: a chunk's scale for every element of the tile (``col_s`` None:
    the row scales alone, broadcast over the columns)."""
    rows = lax.broadcast_in_dim(row_s, shape, [0])
    return rows if col_s is None else rows * lax.broadcast_in_dim(col_s, shape, [1])


def _wgmma_zero(shape):
    """A float32 zero tile in the ``wgmma`` accumulator layout (a running total's start)."""
    return plgpu.layout_cast(jnp.full(shape, 0, jnp.float32), plgpu.Layout.WGMMA)


def _promotion_step(wg, waves: int, b_blocks: bool, shape):
    """The two-warpgroup kernels' pipeline step for math warpgroup ``wg``: per wave (its
    ``waves`` row tiles of ``shape``, in turn) one chunk's ``wgmma``, promoted into that
    wave's running total with the chunk's A row scales and B scales (``b_blocks``: one per
    block, folded into the row scales; else one per column)."""
    bm = shape[0]

    def step(_, a_smem, b_smem, sa_smem, sb_smem, totals):
        layout_rows, layout_cols = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
        # The chunk's B scale (one per block, repeated over a wave's rows) or column scales.
        b_s = _load(sb_smem, layout_rows if b_blocks else layout_cols, False)
        new = []
        for w, total in enumerate(totals):
            rows = pl.ds((wg * waves + w) * bm, bm)
            row_s = _load(sa_smem.at[rows], layout_rows, False)
            row_s, col_s = (row_s * b_s, None) if b_blocks else (row_s, b_s)
            new.append(total + _scaled_chunk(a_smem.at[rows], b_smem, row_s, col_s, shape))
        return tuple(new)

    return step


def _ws_pipeline(
    step,
    compute_context,
    config: Config,
    dtypes,
    grid_mn,
    num_steps,
    sb_block,
    m_i=0,
    n_i=0,
    first=0,
    cluster_n=1,
    cluster_m=1,
):
    """The two-warpgroup kernels' pipeline over ``num_steps`` K chunks (static, or a traced
    group length), from chunk ``first``: per step the ``cta_tile_m x 128`` A tile, the
    ``tile_n x 128`` B tile, and their chunk's scales (``sb_block`` B scales per N tile)
    from the chunk-major scale vectors. ``cluster_n=2``: A's tile is multicast to the
    cluster's two CTAs (both load the same rows); ``cluster_m=2``: B's tile is."""
    grid_m, grid_n = grid_mn
    a_shared = dict(collective_axes=("cluster",)) if cluster_n == 2 else {}
    b_shared = dict(collective_axes=("cluster",)) if cluster_m == 2 else {}
    bk = BLOCK_K
    a_transforms, b_transforms = (_gg._smem_transforms(bk, dtype) for dtype in dtypes)
    return plgpu.emit_pipeline_warp_specialized(
        step,
        grid=(num_steps,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec(
                (config.cta_tile_m, bk), lambda kk: (m_i, kk), transforms=a_transforms, **a_shared
            ),
            plgpu.BlockSpec(
                (config.tile_n, bk), lambda kk: (n_i, kk), transforms=b_transforms, **b_shared
            ),
            plgpu.BlockSpec((config.cta_tile_m,), lambda kk: ((first + kk) * grid_m + m_i,)),
            plgpu.BlockSpec((sb_block,), lambda kk: ((first + kk) * grid_n + n_i,)),
        ],
        wg_axis="wg",
        num_compute_wgs=config.math_warpgroups,
        max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context,
    )


def _store_tiles(o_smems, outs, dsts):
    """A math warpgroup's finished tiles: into their SMEM slots (once the previous tiles'
    copies have read them), then one TMA copy each to ``dsts``."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for o_smem, out in zip(o_smems, outs, strict=True):
        o_smem[...] = out
    plgpu.commit_smem()
    for o_smem, dst in zip(o_smems, dsts, strict=True):
        plgpu.copy_smem_to_gmem(o_smem, dst)


def _ws_kernel(body, out_type, config: Config, cluster_n: int = 1):
    """``body`` as a persistent kernel: ``ctas_per_sm`` CTAs per SM, each with the math
    warpgroups and one TMA warpgroup (axis ``"wg"``); ``cluster_n`` CTAs per cluster (axis
    ``"cluster"``, persistent loop axis ``"sm"`` over the clusters)."""
    clusters = dict(cluster=(cluster_n,), cluster_names=("cluster",)) if cluster_n > 1 else {}
    return plgpu.kernel(
        body,
        out_type=out_type,
        grid=(_gg._num_sms() * config.ctas_per_sm // cluster_n,),
        grid_names=("sm",),
        num_threads=config.math_warpgroups + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **clusters,
    )


def _warp_specialized(a, sa, b, sb, out_dtype, config: Config, b_blocks: bool, block_group=None):
    """Two math warpgroups per ``128 x tile_n`` CTA tile and one TMA warpgroup. ``sb``:
    ``b_blocks``: one scale per (N tile, K chunk) repeated 64 times; else one per column.

    ``block_group`` (grouped experts, `fp8jax._kernels.blockwise_grouped_mgpu`): ``b [G, N,
    K]`` and ``sb [G, ...]``, and the group of each 128-row block of ``a``; a block past
    the last group (``G``) is skipped, its output rows left undefined."""
    grouped = block_group is not None
    (m, k), n = a.shape, b.shape[-2]
    num_groups = b.shape[0] if grouped else 1
    bm, bn, wgs, waves = config.tile_m, config.tile_n, config.math_warpgroups, config.waves
    cta_m = config.cta_tile_m
    grid_m, grid_n, nk = m // cta_m, n // bn, k // BLOCK_K
    cluster_n = config.cluster_n if grid_n % config.cluster_n == 0 else 1
    cluster_m = config.cluster_m if grid_m % config.cluster_m == 0 and not grouped else 1
    cluster_m = 1 if cluster_n > 1 else cluster_m
    out_transforms = _gg._smem_transforms(bn, out_dtype)

    def body(a_gmem, b_gmem, sa_gmem, sb_gmem, *refs):
        bg_gmem, o_gmem = refs if grouped else (None, refs[0])
        wg = lax.axis_index("wg")
        b_one, sb_one = (b_gmem.at[0], sb_gmem.at[0]) if grouped else (b_gmem, sb_gmem)
        step = _promotion_step(wg, waves, b_blocks, (bm, bn))

        def pipeline(compute_context, m_i=0, n_i=0):
            sb_block = bm if b_blocks else bn
            return _ws_pipeline(
                step, compute_context, config, (a.dtype, b.dtype), (grid_m, grid_n), nk,
                sb_block, m_i, n_i, cluster_n=cluster_n, cluster_m=cluster_m,
            )  # fmt: skip

        ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on it)

        @functools.partial(
            pl.run_scoped,
            allocs=pipeline(ignore).get_allocations(a_gmem, b_one, sa_gmem, sb_one),
            o_smem=plgpu.SMEM((wgs * waves, bm, bn), out_dtype, transforms=out_transforms),
            collective_axes="wg",
        )
        def _scope(allocs, o_smem):
            @plgpu.nd_loop(((grid_m // cluster_m) * (grid_n // cluster_n),), collective_axes="sm")
            def _loop(loop_info):
                (lin,) = loop_info.index
                tiles = (grid_m // cluster_m, grid_n // cluster_n)
                m_i, n_i = plgpu.planar_snake(lin, tiles, 1, config.grid_tile_width)
                if cluster_n > 1:  # the cluster's CTAs: neighbouring N tiles, same rows
                    n_i = n_i * cluster_n + lax.axis_index("cluster")
                if cluster_m > 1:  # neighbouring M tiles, same columns
                    m_i = m_i * cluster_m + lax.axis_index("cluster")

                def compute_context(run):
                    totals = run(tuple(_wgmma_zero((bm, bn)) for _ in range(waves)))
                    tiles = [wg * waves + w for w in range(waves)]
                    cols = pl.ds(n_i * bn, bn)
                    _store_tiles(
                        [o_smem.at[t] for t in tiles],
                        [total.astype(out_dtype) for total in totals],
                        [o_gmem.at[pl.ds(m_i * cta_m + t * bm, bm), cols] for t in tiles],
                    )

                if not grouped:
                    pipeline(compute_context, m_i, n_i)(
                        a_gmem, b_gmem, sa_gmem, sb_gmem, allocations=allocs
                    )
                    return
                group = bg_gmem[m_i]  # one group per CTA tile (128 or 256 rows)

                @pl.when(group < num_groups)
                def _run():
                    pipeline(compute_context, m_i, n_i)(
                        a_gmem, b_gmem.at[group], sa_gmem, sb_gmem.at[group], allocations=allocs
                    )

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = _ws_kernel(
        body, jax.ShapeDtypeStruct((m, n), out_dtype), config, max(cluster_n, cluster_m)
    )
    if grouped:
        return kernel(a, b, sa, sb, block_group.astype(jnp.int32))
    return kernel(a, b, sa, sb)


def _single_warpgroup(a, sa, b, sb, out_dtype, config: Config, interpret: bool):
    """One warpgroup per ``tile_m x tile_n`` tile, loading and computing; ``ctas_per_sm``
    CTAs per SM."""
    (m, k), n = a.shape, b.shape[0]
    nk = k // BLOCK_K
    bm, bn, bk = config.tile_m, config.tile_n, BLOCK_K
    grid_m, grid_n = m // bm, n // bn
    a_transforms = _gg._smem_transforms(bk, a.dtype)
    b_transforms = _gg._smem_transforms(bk, b.dtype)
    out_transforms = _gg._smem_transforms(bn, out_dtype)

    def body(a_gmem, b_gmem, sa_gmem, sb_gmem, o_gmem):
        @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
        def _loop(loop_info):
            (lin,) = loop_info.index
            m_i, n_i = plgpu.planar_snake(lin, (grid_m, grid_n), 1, config.grid_tile_width)

            def step(_, a_smem, b_smem, sa_smem, sb_smem, total):
                # The scales first: their loads overlap the chunk's wgmma.
                row_s = _load(sa_smem, plgpu.Layout.WGMMA.reduce(1), interpret)
                col_s = _load(sb_smem, plgpu.Layout.WGMMA.reduce(0), interpret)

                if not interpret:
                    return total + _scaled_chunk(a_smem, b_smem, row_s, col_s, (bm, bn))
                # The interpreter's wgmma takes no transposed B: a dot stands in for it.
                dims = (((1,), (1,)), ((), ()))
                chunk = lax.dot_general(
                    a_smem[...], b_smem[...], dims, preferred_element_type=jnp.float32
                )
                return total + chunk * _outer(row_s, col_s, (bm, bn))

            # The interpreter has no layouts.
            zero = jnp.full((bm, bn), 0, jnp.float32) if interpret else _wgmma_zero((bm, bn))
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
        extra = dict(interpret=_jax_compat.interpret_gpu_params()())
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
