"""The FP8 flash attention's K-major operands in one pass (Pallas Triton).

Hopper's 8-bit ``wgmma`` contracts only over its operands' minor dim, so the flash kernels
take ``v`` (forward) and ``q, k, dO`` (backward) transposed, ``[B, S, H, D] -> [B, H, D, S]``,
with each 16 keys reordered as `flash_fp8_layout.p_operand` presents P's registers. XLA
writes that as a loop fusion of a 7-d transpose, byte by byte, several times slower than
the memory pass it is (benchmarks/RESULTS.md, twenty-seventh session). Here each program
moves one ``[block, D]`` tile of one head: rows read whole, the 16-key reorder applied to
the rows as they are gathered, the tile written transposed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import cast as _cast

pl = _cast.pl
BLOCK = 64  # keys a program moves
NUM_WARPS = 4


def key_order(p):
    """The key position ``p`` holds (integers, numpy or jax): position ``4t + 2a + b`` of
    each 16 holds key ``8a + 2t + b`` (`flash_fp8_mgpu._vt`)."""
    t, a, b = (p % 16) // 4, (p % 4) // 2, p % 2
    return p - p % 16 + 8 * a + 2 * t + b


def reference(x, permute_keys: bool):
    """`transpose_keys` in plain JAX (XLA's transpose): the CPU's path and the kernel's
    oracle. The reorder is `key_order` as a swap of each 16 keys' ``(a, t)`` axes."""
    xt = jnp.transpose(x, (0, 2, 3, 1))
    if not permute_keys:
        return xt
    b, h, d, sk = xt.shape
    return jnp.swapaxes(xt.reshape(b, h, d, sk // 16, 2, 4, 2), -3, -2).reshape(b, h, d, sk)


def reason(shape, dtype=jnp.float8_e4m3fn, block: int = BLOCK) -> str | None:
    """Why `transpose_keys` cannot take a ``[B, S, H, D]`` tensor of ``dtype`` on this device
    (None: it can)."""
    why = _cast.device_reason(local=True)
    if why is None and jnp.dtype(dtype).itemsize != 1:
        why = f"{jnp.dtype(dtype).name} is not a 1-byte type"
    if why is None and (len(shape) != 4 or shape[1] % block or shape[3] % 16):
        why = f"shape {shape} is not [B, S, H, D] with S % {block} == 0 and D % 16 == 0"
    return why


def _kernel(x_ref, o_ref, *, permute_keys: bool):
    if permute_keys:
        rows = key_order(jax.lax.broadcasted_iota(jnp.int32, (x_ref.shape[0],), 0))
        tile = x_ref[rows, :]
    else:
        tile = x_ref[...]
    o_ref[...] = tile.T


@functools.partial(jax.jit, static_argnames=("permute_keys", "interpret", "block", "num_warps"))
def transpose_keys(
    x, permute_keys: bool, interpret: bool = False, block: int = BLOCK, num_warps: int = NUM_WARPS
):
    """``x [B, S, H, D]`` as ``[B, H, D, S]``, each 16 keys in `key_order` with
    ``permute_keys``.

    Arguments:
        x: a 1-byte tensor (e4m3) ``[B, S, H, D]``, ``S`` a multiple of ``block``.
        permute_keys: reorder each 16 keys as the flash kernels' 8-bit P operand reads them.
        interpret: Pallas' interpreter (CPU tests).
        block, num_warps: the tile (keys a program moves) and its warps, for tuning.

    Returns:
        ``[B, H, D, S]`` of ``x``'s dtype.
    """
    b, s, h, d = x.shape
    if s % block:
        raise ValueError(f"transpose_keys: S={s} is not a multiple of {block}")
    return pl.pallas_call(
        functools.partial(_kernel, permute_keys=permute_keys),
        grid=(b, h, s // block),
        in_specs=[pl.BlockSpec((None, block, None, d), lambda i, j, k: (i, k, j, 0))],
        out_specs=pl.BlockSpec((None, None, d, block), lambda i, j, k: (i, j, 0, k)),
        out_shape=jax.ShapeDtypeStruct((b, h, d, s), x.dtype),
        interpret=interpret,
        **_cast.triton_params(interpret, num_warps),
    )(x)
