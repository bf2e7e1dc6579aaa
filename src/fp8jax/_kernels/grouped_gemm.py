"""Hopper grouped-GEMM kernels (Pallas Mosaic GPU) on the *aligned* group layout.

The rows of the activations are grouped by expert and every group starts at a
multiple of `ROW_ALIGN` rows (the padded layout built by `fp8jax.nn.GroupLayout`).
Both kernels take operands contracting on their minor dim (K-major), the only
layout Hopper's FP8 tensor-core instructions accept:

* `grouped_rows`:  ``out[r] = scale[g(r)] * lhs[r] . rhs[g(r)]^T`` for ``lhs [M, K]``
  and ``rhs [G, N, K]`` (forward ``x . W_e`` and dgrad ``dy . W_e^T``). Warp
  specialized: one warpgroup issues TMA loads, two run ``wgmma`` (after JAX's
  ``hopper_matmul_mgpu`` example), with the group's per-expert scale applied in the
  epilogue. Row blocks past the last group are skipped (their output rows are left
  undefined: callers mask them, see `fp8jax.nn.GroupLayout.row_valid`).
* `grouped_wgrad`: ``out[g] = scale * lhsT[:, rows_g] . rhsT[:, rows_g]^T`` for
  ``lhsT [K, M]`` and ``rhsT [N, M]`` (weight gradient ``x_e^T . dy_e``), one output
  tile per (group, tile) with the contraction running over that group's rows only
  (after JAX's ``transposed_ragged_dot_mgpu``). Empty groups get zeros.

Both accept bf16 or FP8 (e4m3/e5m2, mixed allowed on jax >= 0.11) operands. These
kernels are written against the Pallas Mosaic GPU API of jax 0.10-0.11; `available`
says whether this JAX and device can run them, and everything else falls back to the
plain-JAX reference in `fp8jax._ops.grouped_gemms`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

ROW_ALIGN = 128  # every group of the padded layout starts at a multiple of this many rows

try:  # Pallas Mosaic GPU moves between JAX releases: import lazily and guard.
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _IMPORT_ERROR = None
except Exception as e:  # pragma: no cover - depends on the installed JAX
    pl = plgpu = None
    _IMPORT_ERROR = e

_MIN_JAX = (0, 10, 0)


def _jax_version() -> tuple[int, ...]:
    return tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def available(device=None) -> tuple[bool, str]:
    """``(True, "")`` if the kernels can run on ``device`` (default: the first one),
    else ``(False, why)``."""
    if _IMPORT_ERROR is not None:
        return False, f"Pallas Mosaic GPU does not import: {_IMPORT_ERROR}"
    if _jax_version() < _MIN_JAX:
        return False, f"jax {jax.__version__} is older than {'.'.join(map(str, _MIN_JAX))}"
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return False, f"no GPU (platform {device.platform})"
    capability = getattr(device, "compute_capability", "")
    if not str(capability).startswith("9"):
        return False, f"the kernels need a Hopper GPU (compute capability 9.x), got {capability!r}"
    return True, ""


def _transposed(ref):
    """``ref`` viewed as its 2-D transpose (the method's name changed in jax 0.11)."""
    if hasattr(ref, "transpose"):
        try:
            return ref.transpose((1, 0))
        except (TypeError, NotImplementedError, AttributeError):
            pass
    return plgpu.transpose_ref(ref, (1, 0))


def _num_sms() -> int:
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def _smem_transforms(block_minor: int, dtype):
    swizzle = plgpu.find_swizzle(block_minor * jnp.dtype(dtype).itemsize * 8)
    return (
        plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )


# ----------------------------------------------------------------------------- configs
@dataclasses.dataclass(frozen=True)
class RowsConfig:
    """Tiles of `grouped_rows`: each of the two compute warpgroups owns a
    ``tile_m x tile_n`` accumulator; the CTA covers ``tile_m x 2*tile_n``."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 128
    max_concurrent_steps: int = 4
    grid_tile_width: int = 8
    epi_tile_n: int = 64


@dataclasses.dataclass(frozen=True)
class WgradConfig:
    """Tiles of `grouped_wgrad` (one warpgroup, ``block_m x block_n`` accumulator,
    ``block_k`` rows of the group per pipeline step)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    max_concurrent_steps: int = 4
    grid_tile_width: int = 8


def rows_supported(m: int, k: int, n: int, config: RowsConfig) -> str:
    """Why `grouped_rows` cannot run these sizes ("" when it can)."""
    if ROW_ALIGN % config.tile_m:
        return f"tile_m={config.tile_m} must divide the group alignment {ROW_ALIGN}"
    if m % ROW_ALIGN:
        return f"M={m} rows is not a multiple of {ROW_ALIGN}"
    if k % config.tile_k:
        return f"K={k} is not a multiple of tile_k={config.tile_k}"
    if n % (2 * config.tile_n):
        return f"N={n} is not a multiple of 2*tile_n={2 * config.tile_n}"
    return ""


def wgrad_supported(m: int, k: int, n: int, config: WgradConfig) -> str:
    """Why `grouped_wgrad` cannot run these sizes ("" when it can)."""
    if ROW_ALIGN % config.block_k:
        return f"block_k={config.block_k} must divide the group alignment {ROW_ALIGN}"
    if m % ROW_ALIGN:
        return f"M={m} rows is not a multiple of {ROW_ALIGN}"
    if k % config.block_m or n % config.block_n:
        return f"output [{k}, {n}] is not tiled by {config.block_m}x{config.block_n}"
    return ""


# ----------------------------------------------------------------------------- forward / dgrad
def grouped_rows(lhs, rhs, block_group, scales, *, out_dtype, config: RowsConfig = RowsConfig()):
    """``lhs [M, K]``, ``rhs [G, N, K]``, ``block_group [M // ROW_ALIGN]`` int32 (group
    of each row block, ``G`` past the last group), ``scales [G]`` float32 ->
    ``[M, N]`` in ``out_dtype``."""
    m, k = lhs.shape
    g, n, k2 = rhs.shape
    if k != k2:
        raise ValueError(f"grouped_rows: lhs {lhs.shape} and rhs {rhs.shape} disagree on K")
    why = rows_supported(m, k, n, config)
    if why:
        raise ValueError(f"grouped_rows: {why}")
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
    cta_n = 2 * tile_n
    m_iters, n_iters, k_iters = m // tile_m, n // cta_n, k // tile_k
    epi_n = min(config.epi_tile_n, tile_n)
    epi_m = min(64, tile_m)
    blocks_per_align = ROW_ALIGN // tile_m
    lhs_transforms = _smem_transforms(tile_k, lhs.dtype)
    rhs_transforms = _smem_transforms(tile_k, rhs.dtype)
    out_transforms = _smem_transforms(epi_n, out_dtype)
    num_out_slots = min(2, (tile_m * tile_n) // (epi_m * epi_n))

    def body(block_group_gmem, scales_gmem, a_gmem, b_gmem, out_gmem):
        def get_pipeline(pipeline_body, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                pipeline_body,
                grid=(k_iters,),
                memory_registers=40,
                in_specs=[
                    plgpu.BlockSpec(
                        (tile_m, tile_k),
                        lambda kk: (0, kk),
                        transforms=lhs_transforms,
                        memory_space=plgpu.SMEM,
                    ),
                    plgpu.BlockSpec(
                        (cta_n, tile_k),
                        lambda kk: (0, kk),
                        transforms=rhs_transforms,
                        memory_space=plgpu.SMEM,
                    ),
                ],
                wg_axis="wg",
                num_compute_wgs=2,
                max_concurrent_steps=config.max_concurrent_steps,
                compute_context=compute_context,
            )

        def ignore(*_, **__):
            return None

        @functools.partial(
            pl.run_scoped,
            pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem.at[0]),
            out_smem=plgpu.SMEM(
                (2, num_out_slots, epi_m, epi_n), out_dtype, transforms=out_transforms
            ),
            collective_axes="wg",
        )
        def _scope(pipeline_allocs, out_smem):
            wg_idx = jax.lax.axis_index("wg")

            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
            def _mn_loop(loop_info):
                (lin,) = loop_info.index
                m_idx, n_idx = plgpu.planar_snake(
                    lin, (m_iters, n_iters), 1, config.grid_tile_width
                )
                group = block_group_gmem[m_idx // blocks_per_align]
                m_slice = pl.ds(m_idx * tile_m, tile_m)
                n_slice = pl.ds(n_idx * cta_n, cta_n)
                wg_n_slice = pl.ds(wg_idx * tile_n, tile_n)

                @pl.when(group < g)
                def _run():
                    scale = scales_gmem[group]

                    def compute_context(eval_pipeline):
                        @functools.partial(
                            pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32)
                        )
                        def _acc_scope(acc_ref):
                            eval_pipeline(acc_ref)
                            acc = (acc_ref[...] * scale).astype(out_dtype)
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            for epi_mi in range(tile_m // epi_m):
                                for epi_ni in range(tile_n // epi_n):
                                    ms = slice(epi_mi * epi_m, (epi_mi + 1) * epi_m)
                                    ns = slice(epi_ni * epi_n, (epi_ni + 1) * epi_n)
                                    slot = (epi_mi * (tile_n // epi_n) + epi_ni) % num_out_slots
                                    plgpu.wait_smem_to_gmem(num_out_slots - 1, wait_read_only=True)
                                    out_smem[wg_idx, slot] = acc[ms, ns]
                                    plgpu.commit_smem()
                                    plgpu.copy_smem_to_gmem(
                                        out_smem.at[wg_idx, slot],
                                        out_gmem.at[m_slice, n_slice].at[:, wg_n_slice].at[ms, ns],
                                    )

                    def mma_body(_, a_smem, b_smem, acc_ref):
                        plgpu.wgmma(acc_ref, a_smem, _transposed(b_smem.at[wg_n_slice]))
                        plgpu.wgmma_wait(0)
                        return acc_ref

                    get_pipeline(mma_body, compute_context)(
                        a_gmem.at[m_slice, :],
                        b_gmem.at[group, n_slice, :],
                        allocations=pipeline_allocs,
                    )

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(_num_sms(),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(block_group.astype(jnp.int32), scales.astype(jnp.float32), lhs, rhs)


# ----------------------------------------------------------------------------- wgrad
def grouped_wgrad(
    lhs_t,
    rhs_t,
    group_starts,
    group_padded_sizes,
    scale,
    *,
    out_dtype,
    config: WgradConfig = WgradConfig(),
):
    """``lhs_t [K, M]``, ``rhs_t [N, M]``, ``group_starts [G]`` and
    ``group_padded_sizes [G]`` (row offsets and row counts, multiples of `ROW_ALIGN`),
    ``scale`` scalar float32 -> ``[G, K, N]``: per group the product over its rows."""
    k, m = lhs_t.shape
    n, m2 = rhs_t.shape
    if m != m2:
        raise ValueError(
            f"grouped_wgrad: lhs_t {lhs_t.shape} and rhs_t {rhs_t.shape} disagree on M"
        )
    why = wgrad_supported(m, k, n, config)
    if why:
        raise ValueError(f"grouped_wgrad: {why}")
    g = group_starts.shape[0]
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    grid_m, grid_n = k // bm, n // bn
    lhs_transforms = _smem_transforms(bk, lhs_t.dtype)
    rhs_transforms = _smem_transforms(bk, rhs_t.dtype)
    out_transforms = _smem_transforms(bn, out_dtype)
    steps = config.max_concurrent_steps

    def body(starts_gmem, blocks_gmem, scale_gmem, a_gmem, b_gmem, o_gmem):
        @plgpu.nd_loop((g, grid_m * grid_n), collective_axes="sm")
        def _loop(loop_info):
            g_i = loop_info.index[0]
            m_i, n_i = plgpu.planar_snake(
                loop_info.index[1], (grid_m, grid_n), 1, config.grid_tile_width
            )
            start = pl.multiple_of(starts_gmem[g_i], bk)
            rows = pl.ds(start, m)  # may run past M: the pipeline only reads this group's blocks
            num_blocks = blocks_gmem[g_i]

            def acc_scope(acc_ref):
                def step(_, a_smem, b_smem):
                    plgpu.wgmma(acc_ref, a_smem, _transposed(b_smem))
                    if steps == 1:
                        plgpu.wgmma_wait(0)

                @pl.when(num_blocks > 0)
                def _():
                    plgpu.emit_pipeline(
                        step,
                        grid=(num_blocks,),
                        in_specs=[
                            plgpu.BlockSpec(
                                (bm, bk),
                                lambda r: (m_i, r),
                                transforms=lhs_transforms,
                                delay_release=1 if steps > 1 else 0,
                            ),
                            plgpu.BlockSpec(
                                (bn, bk),
                                lambda r: (n_i, r),
                                transforms=rhs_transforms,
                                delay_release=1 if steps > 1 else 0,
                            ),
                        ],
                        max_concurrent_steps=steps,
                    )(a_gmem.at[:, rows], b_gmem.at[:, rows])

                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))
            out = (acc * scale_gmem[0]).astype(out_dtype)

            @functools.partial(
                pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), out_dtype, transforms=out_transforms)
            )
            def _store(o_smem):
                o_smem[...] = out
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem, o_gmem.at[g_i, pl.ds(m_i * bm, bm), pl.ds(n_i * bn, bn)]
                )
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((g, k, n), out_dtype),
        grid=(_num_sms(),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    group_blocks = group_padded_sizes.astype(jnp.int32) // bk
    return kernel(
        group_starts.astype(jnp.int32),
        group_blocks,
        jnp.asarray(scale, jnp.float32).reshape(1),
        lhs_t,
        rhs_t,
    )
