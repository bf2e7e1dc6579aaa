"""Block scales per row: shared by the block-scaled GEMM's reference (`blockwise_gemm`) and
its Hopper kernel (`blockwise_gemm_mgpu`), below both."""

from __future__ import annotations

import jax.numpy as jnp

F32 = jnp.float32


def row_scales(scale, rows: int, block_size: int):
    """``scale [B, rows or ceil(rows/bs), nk]`` -> one per row ``[B, rows, nk]`` (a weight's
    ``bs x bs`` block scale repeated over the block's rows)."""
    if scale.shape[1] == rows:
        return scale.astype(F32)
    blocks = -(-rows // block_size)
    if scale.shape[1] != blocks:
        raise ValueError(
            f"blockwise GEMM: a scale of shape {scale.shape} fits neither {rows} rows nor "
            f"{blocks} blocks of {block_size} rows"
        )
    return jnp.repeat(scale.astype(F32), block_size, axis=1)[:, :rows]
