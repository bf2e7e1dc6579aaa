"""Register layouts and the grid order that the FP8 flash-attention kernels share
(`flash_fp8_mgpu` forward, `flash_fp8_bwd_mgpu` backward; Pallas Mosaic GPU): e4m3 P-like
tiles handed to ``wgmma`` as its 8-bit A operand from registers, ``wgmma`` layouts and
iotas (none in interpret mode), and the causal grid's heaviest-first tile order."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import grouped_gemm as _gg

pl, plgpu = _gg.pl, _gg.plgpu
E4M3 = jnp.float8_e4m3fn


def p_operand(p8, interpret: bool):
    """The e4m3 P tile ``[64, bk]`` (``WGMMA`` layout: a thread's pairs of keys ``2t, 2t + 1``
    of each 8) as the 8-bit wgmma A operand: each 16 keys' two pairs, ``2t, 2t + 1`` and
    ``8 + 2t, 9 + 2t``, read as one register of keys ``4t .. 4t + 3`` (`flash_fp8_mgpu._vt`
    reorders V's keys to match), no data moved."""
    if interpret:
        return p8
    from jax.experimental.mosaic.gpu import fragmented_array as mfa
    from jax.experimental.mosaic.gpu import utils as mutils

    out_type = plgpu.ShapeDtypeStruct(p8.shape, E4M3, plgpu.Layout.WGMMA_8BIT)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,), return_type=out_type)
    def regroup(_, p):
        regs = p.registers
        shape = mfa.WGMMA_LAYOUT_8BIT.registers_shape(p.shape)
        assert regs.shape == (shape[0], 2 * shape[1], *shape[2:]), (regs.shape, shape)
        new = np.empty(shape, dtype=object)
        for idx in np.ndindex(shape):
            pair = [regs[(idx[0], 2 * idx[1] + i, *idx[2:])] for i in range(2)]
            new[idx] = mutils.vector_concat(pair)
        return mfa.FragmentedArray(
            _registers=new, _layout=mfa.WGMMA_LAYOUT_8BIT, _is_signed=p.is_signed
        )

    return regroup(p8)


def wgmma_layout(x, layout, interpret: bool):
    """``x`` in a ``wgmma`` register layout (the interpreter has no layouts)."""
    return x if interpret else plgpu.layout_cast(x, layout)


def iota(shape, dim: int, interpret: bool):
    """``broadcasted_iota`` of int32 in the ``WGMMA`` layout (plain in interpret mode)."""
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def q_tile(count: int, causal: bool):
    """The CTA's tile along the grid axis ``"q_seq"`` of ``count``: under a causal mask the
    last tile (the most keys) first. CUDA launches a grid in order, so the heaviest CTAs
    would otherwise come in the last wave, a few multiprocessors busy and the rest idle."""
    i = lax.axis_index("q_seq")
    return count - 1 - i if causal else i
