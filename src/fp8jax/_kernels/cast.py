"""One-pass FP8 cast into both layouts, with the amax as a by-product (Pallas Triton).

The backward of an FP8 GEMM needs every operand twice: row-wise (``[B, P, C]``) and
column-wise (``[B, C, P]``), because Hopper's FP8 GEMMs only contract over the minor
dim. XLA fuses the cast with the amax reduction but writes the transposed copy in a
second pass that reads the FP8 copy back (`benchmarks/RESULTS.md`). `cast_transpose`
reads the high-precision tensor once and writes both FP8 layouts and a per-tile amax
in the same kernel.

It needs the scale before the cast, which delayed scaling has (the scale comes from
the amax history); current scaling runs its amax pass first. `supported` says
whether a tensor can take the kernel; callers fall back to the XLA path otherwise.
The kernel is written against the Pallas Triton API of jax 0.10-0.11; ``interpret``
runs the same kernel body on any backend (used by the CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .. import _quant as q
from . import dispatch

try:  # Pallas moves between JAX releases: import lazily and guard.
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    _IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001  # pragma: no cover - depends on the installed JAX
    pl = pltriton = None
    _IMPORT_ERROR = e

F32 = jnp.float32
BLOCK_SIZES = (
    64,
    32,
)  # tile edge candidates, largest first (64 was fastest on H100, benchmarks/RESULTS.md)
NUM_WARPS = 4


def _block(size: int) -> int | None:
    return next((b for b in BLOCK_SIZES if size % b == 0), None)


def device_reason(device=None, local: bool = False) -> str | None:
    """Why the Pallas Triton FP8 casts cannot run on ``device`` (default: the first
    device) in the program being traced (`dispatch.unpartitioned_reason`, unless the
    caller runs them on ``local`` shards itself), or None."""
    if _IMPORT_ERROR is not None:
        return f"Pallas Triton does not import: {_IMPORT_ERROR}"
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return f"no GPU (platform {device.platform})"
    capability = str(getattr(device, "compute_capability", ""))
    if not capability[:1].isdigit() or int(capability.split(".")[0]) < 9:
        return f"FP8 conversion in the kernel needs compute capability >= 9.0, got {capability!r}"
    return None if local else dispatch.unpartitioned_reason()


def supported(shape: tuple[int, ...], device=None, local: bool = False) -> tuple[bool, str]:
    """Whether a ``[B, P, C]`` tensor can take the kernel on ``device`` (default: the
    first device): ``(True, "")`` or ``(False, why)``; ``local`` as in `device_reason`."""
    why = device_reason(device, local)
    if why is not None:
        return False, why
    if len(shape) != 3 or _block(shape[1]) is None or _block(shape[2]) is None:
        return False, f"shape {shape} is not [B, P, C] with P and C multiples of {BLOCK_SIZES[-1]}"
    return True, ""


def triton_params(interpret: bool, num_warps: int) -> dict:
    """``pallas_call`` keyword arguments for a Triton kernel (none in interpret mode)."""
    if interpret:
        return {}
    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=1)}


def _kernel(t_ref, inv_scale_ref, q_ref, qt_ref, amax_ref):
    t = t_ref[...]
    amax_ref[...] = q.tile_amax(t).reshape(1, 1)
    quantized = q.saturate_in_kernel(t, inv_scale_ref[0], q_ref.dtype)
    q_ref[...] = quantized
    qt_ref[...] = quantized.T


@functools.partial(jax.jit, static_argnames=("dtype", "interpret", "block", "num_warps", "tiles"))
def cast_transpose(
    t3,
    scale,
    dtype,
    interpret: bool = False,
    block: int | None = None,
    num_warps: int | None = None,
    tiles: bool = False,
):
    """``(t3 / scale)`` saturated to ``dtype`` as ``[B, P, C]`` and ``[B, C, P]``, plus
    ``max |t3|`` (inf where ``t3`` holds a NaN or an inf) as a float32 scalar, or with
    ``tiles`` each tile's (a small float32 array whose max it is, for `q.combined_max`).

    ``scale`` is the (dequantization) scale, shape ``[1]`` or ``[]``. ``block`` (tile
    edge) and ``num_warps`` override the defaults (for tuning).
    """
    batch, rows, cols = t3.shape
    block_rows, block_cols = (block, block) if block else (_block(rows), _block(cols))
    if block_rows is None or block_cols is None or rows % block_rows or cols % block_cols:
        raise ValueError(
            f"cast_transpose: shape {t3.shape} needs P and C multiples of "
            f"{block or BLOCK_SIZES[-1]}"
        )
    grid = (batch, rows // block_rows, cols // block_cols)
    inv_scale = (1.0 / scale.astype(F32)).reshape(1)
    quantized, transposed, tile_amax = pl.pallas_call(
        _kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, block_rows, block_cols), lambda b, i, j: (b, i, j)),
            pl.BlockSpec((1,), lambda b, i, j: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((None, block_rows, block_cols), lambda b, i, j: (b, i, j)),
            pl.BlockSpec((None, block_cols, block_rows), lambda b, i, j: (b, j, i)),
            pl.BlockSpec((None, 1, 1), lambda b, i, j: (b, i, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, rows, cols), dtype),
            jax.ShapeDtypeStruct((batch, cols, rows), dtype),
            jax.ShapeDtypeStruct(grid, F32),
        ],
        interpret=interpret,
        **triton_params(interpret, num_warps or NUM_WARPS),
    )(t3, inv_scale)
    return quantized, transposed, tile_amax if tiles else jnp.max(tile_amax)
