"""Block-scaled FP8 GEMM (DeepSeek-V3 / DeepGEMM scheme): the plain-JAX reference and the
dispatch to the Hopper kernel (`fp8jax._kernels.blockwise_gemm_mgpu`, Pallas Mosaic GPU).

``out[b, i, j] = sum_k  a_scale[b, i, k] * b_scale[b, j, k] * (a[b, i, kchunk] . b[b, j, kchunk])``

over K chunks of ``block_size``: each chunk's partial sum is exact-ish in float32 (at most
``block_size`` FP8 products), then multiplied by its two scales and added into a float32
accumulator ("promotion" every 128 K, which also bounds the tensor cores' reduced-precision
accumulation to one chunk). Operands are ``[B, P, C]`` and ``[B, Q, C]``, both contracting
on their minor dim; a scale is per row (``[B, P, ceil(C/bs)]``, the ``1 x bs`` tiles of
activations and gradients) or per block (``[B, ceil(P/bs), ceil(C/bs)]``, the ``bs x bs``
blocks of weights): `row_scales` expands the latter to the former.

Backends (`fp8jax._kernels.dispatch`): ``"kernel"`` runs the Pallas Mosaic-GPU kernel
(Hopper, jax >= 0.10, aligned shapes) or raises, ``"reference"`` the plain JAX below (any
platform; the tests' oracle), ``"auto"`` the kernel where it can run this call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import blockwise_gemm_mgpu as mgpu
from . import dispatch
from .block_scales import row_scales

F32 = jnp.float32
BACKENDS = ("auto", "kernel", "reference", "pallas")


def check_operands(a, a_scale, b, b_scale, block_size: int) -> None:
    """Raise early, naming the operand, on shapes or block sizes that do not fit."""
    if not isinstance(block_size, int) or block_size < 16 or block_size % 16:
        raise ValueError(f"blockwise GEMM: block_size={block_size!r} must be a multiple of 16")
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[2]:
        raise ValueError(
            f"blockwise GEMM: operands must be [B, P, C] and [B, Q, C], got {a.shape} and {b.shape}"
        )
    nk = -(-a.shape[2] // block_size)
    for name, t, s in (("a", a, a_scale), ("b", b, b_scale)):
        rows = t.shape[1]
        if s.ndim != 3 or s.shape[0] != t.shape[0] or s.shape[2] != nk:
            raise ValueError(
                f"blockwise GEMM: {name}_scale has shape {s.shape}; expected "
                f"[{t.shape[0]}, {rows} or {-(-rows // block_size)}, {nk}] for {name} {t.shape} "
                f"and block_size {block_size}"
            )


def reference(a, a_scale, b, b_scale, out_dtype, block_size: int = 128):
    """Plain-JAX block-scaled GEMM, mirroring the kernel: one float32 partial dot per K
    chunk, scaled by ``a_scale[i, k] * b_scale[j, k]`` and accumulated in float32."""
    check_operands(a, a_scale, b, b_scale, block_size)
    bsz, p, c = a.shape
    q = b.shape[1]
    nk = -(-c // block_size)
    sa, sb = row_scales(a_scale, p, block_size), row_scales(b_scale, q, block_size)
    pad = nk * block_size - c
    if pad:
        a = jnp.pad(a, ((0, 0), (0, 0), (0, pad)))
        b = jnp.pad(b, ((0, 0), (0, 0), (0, pad)))
    # K chunks first, for the scan: [nk, B, P, bs], [nk, B, Q, bs], [nk, B, P], [nk, B, Q]
    a4 = jnp.moveaxis(a.reshape(bsz, p, nk, block_size), 2, 0)
    b4 = jnp.moveaxis(b.reshape(bsz, q, nk, block_size), 2, 0)
    dims = (((2,), (2,)), ((0,), (0,)))

    def step(acc, chunk):
        ak, bk, sak, sbk = chunk
        # f32 operands at HIGHEST: an exact oracle on every backend. An FP8 dot on a GPU
        # would use cuBLASLt's reduced-precision accumulator, and so would dot(convert(f8)):
        # XLA rewrites that pattern into an FP8 GEMM, hence the barrier after the converts.
        ak, bk = lax.optimization_barrier((ak.astype(F32), bk.astype(F32)))
        partial = lax.dot_general(ak, bk, dims, lax.Precision.HIGHEST, preferred_element_type=F32)
        return acc + partial * sak[:, :, None] * sbk[:, None, :], None

    acc0 = jnp.zeros((bsz, p, q), F32)
    acc, _ = lax.scan(step, acc0, (a4, b4, jnp.moveaxis(sa, 2, 0), jnp.moveaxis(sb, 2, 0)))
    return acc.astype(out_dtype)


def kernel_reason(a, a_scale, b, b_scale, out_dtype, block_size: int) -> str | None:
    """Why the Hopper kernel cannot run this call (version, platform, shape, dtype), or None."""
    trace = getattr(a, "_trace", None)
    if trace is not None and "Batch" in type(trace).__name__:
        return "under jax.vmap (the kernel is one GEMM)"
    why = mgpu.reason(a.shape, b.shape, a.dtype, b.dtype, out_dtype, block_size)
    return why or dispatch.unpartitioned_reason()


# Named scope around the Hopper kernel's call: its custom call's HLO metadata carries it, so
# `fp8jax.fp8_gemm_report` can tell this FP8 GEMM from other Mosaic GPU calls.
BLOCKWISE_SCOPE = "fp8jax_blockwise_gemm"


def blockwise_gemm(a, a_scale, b, b_scale, out_dtype, block_size: int = 128, backend="auto"):
    """``a [B,P,C] . b [B,Q,C] -> [B,P,Q]`` with per-tile scales (see the module docstring),
    on the kernel or the reference by ``backend``."""
    check_operands(a, a_scale, b, b_scale, block_size)
    dispatch.check("blockwise GEMM", backend, BACKENDS)
    why = None
    if backend != "reference":
        why = kernel_reason(a, a_scale, b, b_scale, out_dtype, block_size)
    if dispatch.choose("blockwise GEMM", backend, why, BACKENDS) == "reference":
        return reference(a, a_scale, b, b_scale, out_dtype, block_size)
    sa = row_scales(a_scale, a.shape[1], block_size)
    with jax.named_scope(BLOCKWISE_SCOPE):  # b's scale per row or per block: either fits
        return mgpu.gemm(a[0], sa[0], b[0], b_scale[0], out_dtype=out_dtype)[None]
