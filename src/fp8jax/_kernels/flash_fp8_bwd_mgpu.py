"""Hopper flash-attention backward for the FP8 forward `flash_fp8_mgpu` (Pallas Mosaic GPU).

Gradients of ``out = softmax(sm * Q K^T) V`` with respect to the dequantized ``Q = q * q_scale``,
``K = k * k_scale``, ``V = v * v_scale`` (e4m3 ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``,
GQA: dK, dV summed over the query heads of a group), from the forward's bf16 ``out`` and
natural-log ``lse [B, Hq, Sq]`` and the bf16 ``dout``. With ``delta = rowsum(dO * O)``,
``P = exp(sm * Q K^T - lse)``, ``dP = dO V^T`` and ``dS = P (dP - delta)``:
``dV = P^T dO``, ``dK = sm dS^T Q``, ``dQ = sm dS K``.

Structured as JAX's Hopper attention backward (``attention_mgpu._attention_bwd``): two
kernels, each with two compute warpgroups and a third that only issues TMA loads into a ring
of ``max_concurrent_steps`` slots (manual barriers, as `flash_fp8_mgpu`):

* dK/dV: a warpgroup owns ``block_kv`` keys of one query head (K and V tiles in shared
  memory) and streams the Q, dO, lse and delta blocks: ``S^T = K Q^T``, ``P^T``,
  ``dV += P^T dO``, ``dP^T = V dO^T``, ``dS^T``, ``dK += dS^T Q``. With GQA each query head
  writes its own dK, dV and XLA sums a group's;
* dQ: a warpgroup owns ``block_q`` query rows (Q and dO in shared memory) and streams the K
  and V blocks: ``S = Q K^T``, ``P``, ``dP = dO V^T``, ``dS``, ``dQ += dS K``.

This first version runs the matmuls in bf16: q, k, v are upcast from e4m3 to bf16 by XLA
before the kernels (exact; the scales stay float32 scalars applied to the logits, dP and the
results), P and dS are recomputed in float32 and rounded to bf16 for their ``wgmma``. Causal
(``Sq == Sk``, top-left): blocks past the diagonal are skipped, the ones it crosses masked.

`flash_fp8_bwd_reference` is the math in plain float32 JAX. ``interpret=True`` runs the
kernels in Pallas' GPU interpret mode (CPU, tests), a dot standing in for each ``wgmma``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from . import flash_fp8_bwd_parts as _p
from . import flash_fp8_mgpu as _fk
from . import grouped_gemm as _gg
from .flash_fp8_mgpu import _iota, _wgmma_layout

pl, plgpu = _gg.pl, _gg.plgpu
F32 = jnp.float32
LOG2E = _fk.LOG2E
COMPUTE_WGS = _p.COMPUTE_WGS


def _softmax_scale(head_dim: int, softmax_scale) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def _scalar(x):
    return jnp.asarray(x, F32).reshape(())


# ----------------------------------------------------------------------------- reference
@functools.partial(jax.jit, static_argnames=("causal", "softmax_scale"))
def flash_fp8_bwd_reference(
    q, k, v, q_scale, k_scale, v_scale, out, lse, dout, *, causal=False, softmax_scale=None
):
    """The attention backward in plain float32 JAX (P recomputed from ``lse``).

    Arguments:
        q, k, v: ``[B, Sq, Hq, D]``, ``[B, Sk, Hkv, D]`` float8_e4m3fn (``Hq % Hkv == 0``).
        q_scale, k_scale, v_scale: per-tensor float32 scales (value = fp8 * scale).
        out: the forward's ``[B, Sq, Hq, D]`` output; lse: its ``[B, Hq, Sq]`` natural-log
            log-sum-exp of the scaled logits.
        dout: the output's cotangent ``[B, Sq, Hq, D]``.
        causal: keys after the query masked (``Sq == Sk``, top-left aligned).
        softmax_scale: the logits' scale, ``1/sqrt(D)`` when None.

    Returns:
        ``(dq, dk, dv)`` bf16, the gradients with respect to the dequantized q, k, v.
    """
    (b, sq, hq, d), (sk, hkv) = q.shape, k.shape[1:3]
    g, sm = hq // hkv, _softmax_scale(d, softmax_scale)
    hi = lax.Precision.HIGHEST
    qf = (q.astype(F32) * _scalar(q_scale)).reshape(b, sq, hkv, g, d)
    kf, vf = k.astype(F32) * _scalar(k_scale), v.astype(F32) * _scalar(v_scale)
    do = dout.astype(F32).reshape(b, sq, hkv, g, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, kf, precision=hi) * sm
    if causal:
        s = jnp.where(jnp.arange(sq)[:, None] >= jnp.arange(sk)[None, :], s, -jnp.inf)
    p = jnp.exp(s - lse.astype(F32).reshape(b, hkv, g, sq)[..., None])
    delta = jnp.einsum("bqhgd,bqhgd->bhgq", do, out.astype(F32).reshape(do.shape), precision=hi)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", do, vf, precision=hi)
    ds = p * (dp - delta[..., None])
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, do, precision=hi)
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qf, precision=hi) * sm
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, kf, precision=hi).reshape(b, sq, hq, d) * sm
    return tuple(x.astype(jnp.bfloat16) for x in (dq, dk, dv))


# ----------------------------------------------------------------------------- kernels
@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles of `flash_fp8_bwd`: the dQ kernel's warpgroups own ``block_q_dq`` query rows
    each and stream ``block_kv_dq``-key K/V blocks; the dK/dV kernel's own ``block_kv_dkv``
    keys each and stream ``block_q_dkv``-row Q/dO blocks; rings of ``max_concurrent_steps``
    shared-memory slots."""

    block_q_dq: int = 64
    block_kv_dq: int = 64
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    max_concurrent_steps: int = 2


def reason(q_shape, k_shape, dtype, causal: bool = False, config=Config(), device=None):
    """Why the kernels cannot run ``q [B, Sq, Hq, D]``, ``k/v [B, Sk, Hkv, D]`` of ``dtype``
    (``None`` when they can)."""
    ok, why = _gg.available(device)
    return why if not ok else _shape_reason(q_shape, k_shape, dtype, causal, config)


def _shape_reason(q_shape, k_shape, dtype, causal, config: Config):
    """`reason` without the device check (the interpreter runs any shape that fits)."""
    c = config
    for bq, bk in ((c.block_q_dq, c.block_kv_dq), (c.block_q_dkv, c.block_kv_dkv)):
        if bq % 64 or bk % 64 or bq > 128 or bk > 128 or c.max_concurrent_steps < 2:
            return f"{c}: blocks of 64 or 128, 2+ steps"
    fwd = _fk.Config(block_q=c.block_q_dq, block_kv=c.block_kv_dq)
    why = _fk._shape_reason(q_shape, k_shape, dtype, causal, fwd)  # dQ's tiling, shapes
    if why is None and len(q_shape) == 4:
        sq, sk = q_shape[1], k_shape[1]
        if sk % (COMPUTE_WGS * c.block_kv_dkv) or sq % c.block_q_dkv:
            why = f"Sk={sk}, Sq={sq} are not multiples of {2 * c.block_kv_dkv}, {c.block_q_dkv}"
    return why


def _dq(q, k, v, do, lse2, delta, scales, causal: bool, config: Config, interpret: bool):
    """dQ ``[B, Sq, Hq, D]`` bf16 from bf16 ``q, do [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv,
    D]``, float32 ``lse2`` (base 2), ``delta [B, Hq, Sq]`` and ``scales`` (`_scales`)."""
    (batch_size, sq, hq, d), (sk, hkv) = q.shape, k.shape[1:3]
    bq, bk = config.block_q_dq, config.block_kv_dq
    max_kv_steps = sk // bk
    steps = min(config.max_concurrent_steps, max_kv_steps)
    bf16 = jnp.bfloat16

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, s_ref, dq_ref, smem, barriers):
        batch, q_head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        q_smem2, do_smem2, lse_smem2, delta_smem2, k_smem, v_smem = smem
        own_barriers, (k_barriers, v_barriers, consumed) = barriers[:4], barriers[4:]
        cta_base = lax.axis_index("q_seq") * (COMPUTE_WGS * bq)
        if causal:  # the CTA's last row decides how far the loader goes
            cta_kv_steps = pl.cdiv(cta_base + COMPUTE_WGS * bq, jnp.array(bk, jnp.int32))
        else:
            cta_kv_steps = max_kv_steps

        @pl.when(wg < COMPUTE_WGS)
        def _compute_wg():
            plgpu.set_max_registers(232, action="increase")
            q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
            q_base = cta_base + wg * bq
            rows = (batch, pl.ds(q_base, bq), q_head)
            row_ids = (batch, q_head, pl.ds(q_base, bq))
            srcs = (q_ref.at[rows], do_ref.at[rows], lse_ref.at[row_ids], delta_ref.at[row_ids])
            dsts = (q_smem, do_smem, lse_smem2.at[wg], delta_smem2.at[wg])
            for src, dst, bar in zip(srcs, dsts, own_barriers):
                plgpu.copy_gmem_to_smem(src, dst, bar.at[wg])
            _p.wait_all(own_barriers, wg)
            qk_scale, v_scale, dq_scale = s_ref[0], s_ref[1], s_ref[2]
            lse = _p.load_row(lse_smem2.at[wg], 1, interpret)
            delta = _p.load_row(delta_smem2.at[wg], 1, interpret)
            dq = _wgmma_layout(jnp.full((bq, d), 0, F32), plgpu.Layout.WGMMA, interpret)
            kv_steps = pl.cdiv(q_base + bq, jnp.array(bk, jnp.int32)) if causal else max_kv_steps

            def kv_step(step, dq, masked: bool = False):
                slot = _p.ring(step, steps)
                _p.wait_all((k_barriers, v_barriers), slot)
                k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
                s, dp = _p.mmas(
                    ((bq, bk), q_smem, k_tile, True),
                    ((bq, bk), do_smem, v_tile, True),
                    interpret=interpret,
                )
                if masked:
                    q_ids = _iota((bq, bk), 0, interpret) + q_base
                    kv_ids = _iota((bq, bk), 1, interpret) + step * bk
                    s = jnp.where(q_ids >= kv_ids, s, -jnp.inf)
                p = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(lse, s.shape, [0]))
                ds = p * (dp * v_scale - lax.broadcast_in_dim(delta, s.shape, [0]))
                dq = _p.mma(dq, ds.astype(bf16), k_tile, False, interpret)
                plgpu.barrier_arrive(consumed.at[slot])
                return dq

            if not causal:
                dq = lax.fori_loop(0, max_kv_steps, kv_step, dq)
            else:
                unmasked = lax.div(q_base, jnp.array(bk, jnp.int32))
                dq = lax.fori_loop(0, unmasked, kv_step, dq)
                masked = functools.partial(kv_step, masked=True)
                dq = lax.fori_loop(unmasked, kv_steps, masked, dq)
                _p.release(kv_steps, cta_kv_steps, steps, (k_barriers, v_barriers), consumed)
            q_smem[...] = (dq * dq_scale).astype(bf16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _memory_wg():
            kv_head = lax.div(q_head, jnp.array(hq // hkv, q_head.dtype))

            def src(ref):
                return lambda step: ref.at[batch, pl.ds(step * bk, bk), kv_head]

            loads = ((src(k_ref), k_smem, k_barriers), (src(v_ref), v_smem, v_barriers))
            _p.loader(cta_kv_steps, steps, loads, consumed, interpret)

    t = _gg._smem_transforms(d, bf16)
    smem = (
        plgpu.SMEM((COMPUTE_WGS, bq, d), bf16, transforms=t),
        plgpu.SMEM((COMPUTE_WGS, bq, d), bf16, transforms=t),
        plgpu.SMEM((COMPUTE_WGS, bq), F32),
        plgpu.SMEM((COMPUTE_WGS, bq), F32),
        plgpu.SMEM((steps, bk, d), bf16, transforms=t),
        plgpu.SMEM((steps, bk, d), bf16, transforms=t),
    )
    barriers = (
        *(plgpu.Barrier(num_barriers=COMPUTE_WGS) for _ in range(4)),
        plgpu.Barrier(num_barriers=steps),
        plgpu.Barrier(num_barriers=steps),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=steps),
    )
    grid = (hq, sq // (COMPUTE_WGS * bq), batch_size)
    out_type = jax.ShapeDtypeStruct(q.shape, bf16)
    args = (q, k, v, do, lse2, delta, scales)
    return _p.call(
        entry, smem, barriers, out_type, grid, ("heads", "q_seq", "batch"), interpret, args
    )


def _dkv(q, k, v, do, lse2, delta, scales, causal: bool, config: Config, interpret: bool):
    """dK, dV ``[B, Sk, Hq, D]`` bf16 (one per query head) from the inputs of `_dq`."""
    (batch_size, sq, hq, d), (sk, hkv) = q.shape, k.shape[1:3]
    bq, bk = config.block_q_dkv, config.block_kv_dkv
    n_q = sq // bq
    steps = min(config.max_concurrent_steps, n_q)
    bf16 = jnp.bfloat16

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, s_ref, dk_ref, dv_ref, smem, bars):
        batch, q_head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem = smem
        own_barriers, stream_barriers, consumed = bars[:2], bars[2:6], bars[6]
        kv_head = lax.div(q_head, jnp.array(hq // hkv, q_head.dtype))
        cta_base = lax.axis_index("kv_seq") * (COMPUTE_WGS * bk)
        # the stream starts at the first Q block the CTA's first key sees (causal)
        first = lax.div(cta_base, jnp.array(bq, jnp.int32)) if causal else 0

        @pl.when(wg < COMPUTE_WGS)
        def _compute_wg():
            plgpu.set_max_registers(232, action="increase")
            k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
            kv_base = cta_base + wg * bk
            rows = (batch, pl.ds(kv_base, bk), kv_head)
            for src, dst, bar in zip((k_ref, v_ref), (k_smem, v_smem), own_barriers):
                plgpu.copy_gmem_to_smem(src.at[rows], dst, bar.at[wg])
            _p.wait_all(own_barriers, wg)
            qk_scale, v_scale, dk_scale, dv_scale = s_ref[0], s_ref[1], s_ref[3], s_ref[4]
            zeros = jnp.full((bk, d), 0, F32)
            acc = tuple(_wgmma_layout(zeros, plgpu.Layout.WGMMA, interpret) for _ in range(2))

            def q_step(i, carry, masked: bool = False):
                dk, dv = carry
                slot = _p.ring(i - first, steps)
                _p.wait_all(stream_barriers, slot)
                q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
                lse = _p.load_row(lse_smem.at[slot], 0, interpret)
                delta = _p.load_row(delta_smem.at[slot], 0, interpret)
                st = _p.mma((bk, bq), k_smem, q_tile, True, interpret)
                if masked:
                    kv_ids = _iota((bk, bq), 0, interpret) + kv_base
                    q_ids = _iota((bk, bq), 1, interpret) + i * bq
                    st = jnp.where(q_ids >= kv_ids, st, -jnp.inf)
                pt = jnp.exp2(st * qk_scale - lax.broadcast_in_dim(lse, st.shape, [1]))
                dv, dpt = _p.mmas(
                    (dv, pt.astype(bf16), do_tile, False),
                    ((bk, bq), v_smem, do_tile, True),
                    interpret=interpret,
                )
                dst = pt * (dpt * v_scale - lax.broadcast_in_dim(delta, st.shape, [1]))
                dk = _p.mma(dk, dst.astype(bf16), q_tile, False, interpret)
                plgpu.barrier_arrive(consumed.at[slot])
                return dk, dv

            if not causal:
                dk, dv = lax.fori_loop(0, n_q, q_step, acc)
            else:
                own_first = lax.div(kv_base, jnp.array(bq, jnp.int32))
                _p.release(0, own_first - first, steps, stream_barriers, consumed)
                unmasked = jnp.minimum(pl.cdiv(kv_base + bk, jnp.array(bq, jnp.int32)), n_q)
                masked = functools.partial(q_step, masked=True)
                acc = lax.fori_loop(own_first, unmasked, masked, acc)
                dk, dv = lax.fori_loop(unmasked, n_q, q_step, acc)
            k_smem[...] = (dk * dk_scale).astype(bf16)
            v_smem[...] = (dv * dv_scale).astype(bf16)
            plgpu.commit_smem()
            out_rows = (batch, pl.ds(kv_base, bk), q_head)
            plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[out_rows])
            plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[out_rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _memory_wg():
            def src(ref, rows: bool):
                def at(step):
                    block = pl.ds((first + step) * bq, bq)
                    return ref.at[batch, block, q_head] if rows else ref.at[batch, q_head, block]

                return at

            rings = (q_smem, do_smem, lse_smem, delta_smem)
            srcs = (src(q_ref, True), src(do_ref, True), src(lse_ref, False), src(delta_ref, False))
            loads = tuple(zip(srcs, rings, stream_barriers))
            _p.loader(n_q - first, steps, loads, consumed, interpret)

    t = _gg._smem_transforms(d, bf16)
    smem = (
        plgpu.SMEM((COMPUTE_WGS, bk, d), bf16, transforms=t),
        plgpu.SMEM((COMPUTE_WGS, bk, d), bf16, transforms=t),
        plgpu.SMEM((steps, bq, d), bf16, transforms=t),
        plgpu.SMEM((steps, bq, d), bf16, transforms=t),
        plgpu.SMEM((steps, bq), F32),
        plgpu.SMEM((steps, bq), F32),
    )
    barriers = (
        *(plgpu.Barrier(num_barriers=COMPUTE_WGS) for _ in range(2)),
        *(plgpu.Barrier(num_barriers=steps) for _ in range(4)),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=steps),
    )
    grid = (hq, sk // (COMPUTE_WGS * bk), batch_size)
    out = jax.ShapeDtypeStruct((batch_size, sk, hq, d), bf16)
    args = (q, k, v, do, lse2, delta, scales)
    return _p.call(
        entry, smem, barriers, (out, out), grid, ("heads", "kv_seq", "batch"), interpret, args
    )


@functools.partial(
    jax.jit, static_argnames=("causal", "softmax_scale", "config", "interpret", "wrt_fp8")
)
def flash_fp8_bwd(
    q, k, v, q_scale, k_scale, v_scale, out, lse, dout, *, causal=False, softmax_scale=None,
    config=Config(), interpret=False, wrt_fp8=False,
):  # fmt: skip
    """The attention backward on Hopper (see the module docstring); the arguments and
    results of `flash_fp8_bwd_reference`, plus ``config`` (`Config`), ``interpret`` (Pallas'
    GPU interpret mode, CPU) and ``wrt_fp8``: the gradients with respect to the e4m3 values
    themselves (those of the dequantized ones times the scales), as a ``custom_vjp`` needs.
    """
    why = _shape_reason(q.shape, k.shape, q.dtype, causal, config)
    if why is None and not interpret:
        why = reason(q.shape, k.shape, q.dtype, causal, config)
    if why is None and (k.dtype != q.dtype or v.dtype != q.dtype or v.shape != k.shape):
        why = f"k {k.dtype}{k.shape}, v {v.dtype}{v.shape} do not match q's dtype and k"
    if why is not None:
        raise ValueError(f"FP8 flash-attention backward kernel: {why}")
    (b, _, hq, d), (sk, hkv) = q.shape, k.shape[1:3]
    sm = _softmax_scale(d, softmax_scale)
    qs, ks, vs = _scalar(q_scale), _scalar(k_scale), _scalar(v_scale)
    one = jnp.float32(1)
    scales = jnp.stack(  # logits' base-2 multiplier, dP's, dQ's, dK's, dV's
        [qs * ks * (sm * LOG2E), vs, sm * ks * (qs if wrt_fp8 else one),
         sm * qs * (ks if wrt_fp8 else one), vs if wrt_fp8 else one]
    )  # fmt: skip
    bf16 = jnp.bfloat16
    qb, kb, vb, dob = (x.astype(bf16) for x in (q, k, v, dout))  # e4m3 -> bf16 is exact
    lse2 = lse.astype(F32) * LOG2E
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(F32), dout.astype(F32))
    args = (qb, kb, vb, dob, lse2, delta, scales, causal, config, interpret)
    dq = _dq(*args)
    dk, dv = _dkv(*args)
    if hq != hkv:  # sum a group's query heads
        group = lambda x: x.astype(F32).reshape(b, sk, hkv, hq // hkv, d).sum(3)  # noqa: E731
        dk, dv = group(dk).astype(bf16), group(dv).astype(bf16)
    return dq, dk, dv
