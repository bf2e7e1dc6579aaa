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

By default the matmuls run in bf16: q, k, v are upcast from e4m3 to bf16 by XLA before the
kernels (exact; the scales stay float32 scalars applied to the logits, dP and the results), P
and dS are recomputed in float32 and rounded to bf16 for their ``wgmma``. ``Config(fp8=True)``
runs all five on e4m3 ``wgmma`` (Mosaic GPU wants A and B of one type, so dO and dS are e4m3
too: dO with its amax scale, dS with a bound's, P^T as ``P^T * 448``). FP8 ``wgmma`` takes
only K-major operands: ``S = Q K^T``, ``dP = dO V^T`` and their transposes read Q, K, V, dO
tiles as they are (``D`` minor), but ``dV += P^T dO``, ``dK += dS^T Q`` and ``dQ += dS K``
contract over the rows of dO, Q and K, transposed before the kernels by `key_transpose`
(dO^T, Q^T ``[B, Hq, D, Sq]``, K^T ``[B, Hkv, D, Sk]``, each 16 rows reordered as
`flash_fp8_layout.p_operand` reads the P^T, dS^T and dS registers: `flash_fp8_mgpu._vt`). Causal
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
from . import flash_fp8_layout as _lay
from . import flash_fp8_mgpu as _fk
from . import grouped_gemm as _gg

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
    block_kv_dq: int = 128
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    max_concurrent_steps: int = 2
    fp8: bool = False  # e4m3 wgmma: dO and dS per-tensor scaled, P^T * 448 (`flash_fp8_bwd`)
    # with fp8, False runs the dQ kernel on bf16 operands (the dK/dV one stays e4m3): dQ = dS K
    # is where dS's e4m3 rounding costs the most accuracy (RESULTS.md, twenty-third session)
    fp8_dq: bool = True


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


def _dq(q, k, v, do, lse2, delta, scales, kt, causal, config: Config, interpret: bool):
    """dQ ``[B, Sq, Hq, D]`` bf16 from ``q, do [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``
    (bf16, or e4m3 with ``kt``, K^T for dS K), float32 ``lse2`` (base 2), ``delta [B, Hq,
    Sq]`` and ``scales`` (`flash_fp8_bwd`'s)."""
    (batch_size, sq, hq, d), (sk, hkv) = q.shape, k.shape[1:3]
    bq, bk = config.block_q_dq, config.block_kv_dq
    max_kv_steps = sk // bk
    steps = min(config.max_concurrent_steps, max_kv_steps)
    bf16, cdt, fp8 = jnp.bfloat16, q.dtype, kt is not None

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, s_ref, *refs):
        *kt_ref, dq_ref, smem, barriers = refs
        batch, q_head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        q_smem2, do_smem2, lse_smem2, delta_smem2, k_smem, v_smem, *extra = smem
        own_barriers, stream_barriers, consumed = barriers[:4], barriers[5:], barriers[4]
        tile = _lay.q_tile(sq // (COMPUTE_WGS * bq), causal)  # the heaviest first
        cta_base = tile * (COMPUTE_WGS * bq)
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
            dq = _lay.wgmma_layout(jnp.full((bq, d), 0, F32), plgpu.Layout.WGMMA, interpret)
            out_smem = extra[1].at[wg] if fp8 else q_smem
            kv_steps = pl.cdiv(q_base + bq, jnp.array(bk, jnp.int32)) if causal else max_kv_steps

            def kv_step(step, dq, masked: bool = False):
                slot = _p.ring(step, steps)
                _p.wait_all(stream_barriers, slot)
                k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
                s, dp = _p.mmas(
                    ((bq, bk), q_smem, k_tile, True),
                    ((bq, bk), do_smem, v_tile, True),
                    interpret=interpret,
                )
                if masked:
                    q_ids = _lay.iota((bq, bk), 0, interpret) + q_base
                    kv_ids = _lay.iota((bq, bk), 1, interpret) + step * bk
                    s = jnp.where(q_ids >= kv_ids, s, -jnp.inf)
                p = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(lse, s.shape, [0]))
                ds = p * (dp * v_scale - lax.broadcast_in_dim(delta, s.shape, [0]))
                if fp8:  # dS as e4m3 dS / ds_scale (the A operand's registers), K^T
                    ds8 = _lay.p_operand((ds * s_ref[5]).astype(cdt), interpret)
                    dq = _p.mma(dq, ds8, extra[0].at[slot], True, interpret)
                else:
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
                _p.release(kv_steps, cta_kv_steps, steps, stream_barriers, consumed)
            out_smem[...] = (dq * dq_scale).astype(bf16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, dq_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _memory_wg():
            kv_head = lax.div(q_head, jnp.array(hq // hkv, q_head.dtype))

            def src(ref):
                return lambda step: ref.at[batch, pl.ds(step * bk, bk), kv_head]

            srcs = [src(k_ref), src(v_ref)]
            if fp8:
                srcs.append(lambda step: kt_ref[0].at[batch, kv_head, :, pl.ds(step * bk, bk)])
            rings = (k_smem, v_smem, *extra[:1])
            loads = tuple(zip(srcs, rings, stream_barriers))
            _p.loader(cta_kv_steps, steps, loads, consumed, interpret)

    t = _gg._smem_transforms(d, cdt)
    smem = [
        plgpu.SMEM((COMPUTE_WGS, bq, d), cdt, transforms=t),
        plgpu.SMEM((COMPUTE_WGS, bq, d), cdt, transforms=t),
        plgpu.SMEM((COMPUTE_WGS, bq), F32),
        plgpu.SMEM((COMPUTE_WGS, bq), F32),
        plgpu.SMEM((steps, bk, d), cdt, transforms=t),
        plgpu.SMEM((steps, bk, d), cdt, transforms=t),
    ]
    if fp8:  # the K^T ring, dQ's bf16 staging
        smem.append(plgpu.SMEM((steps, d, bk), cdt, transforms=_gg._smem_transforms(bk, cdt)))
        bf16_t = _gg._smem_transforms(d, bf16)
        smem.append(plgpu.SMEM((COMPUTE_WGS, bq, d), bf16, transforms=bf16_t))
    barriers = (
        *(plgpu.Barrier(num_barriers=COMPUTE_WGS) for _ in range(4)),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=steps),
        *(plgpu.Barrier(num_barriers=steps) for _ in range(3 if fp8 else 2)),
    )
    grid = (hq, sq // (COMPUTE_WGS * bq), batch_size)
    out_type = jax.ShapeDtypeStruct(q.shape, bf16)
    args = (q, k, v, do, lse2, delta, scales, *([kt] if fp8 else []))
    return _p.call(
        entry, smem, barriers, out_type, grid, ("heads", "q_seq", "batch"), interpret, args
    )


def _dkv(q, k, v, do, lse2, delta, scales, qt_dot, causal, config: Config, interpret: bool):
    """dK, dV ``[B, Sk, Hq, D]`` bf16 (one per query head) from the inputs of `_dq` (e4m3
    with ``qt_dot``: Q^T and dO^T, ``[B, Hq, D, Sq]``, for dS^T Q and P^T dO)."""
    (batch_size, sq, hq, d), (sk, hkv) = q.shape, k.shape[1:3]
    bq, bk = config.block_q_dkv, config.block_kv_dkv
    n_q = sq // bq
    steps = min(config.max_concurrent_steps, n_q)
    bf16, cdt, fp8 = jnp.bfloat16, q.dtype, qt_dot is not None

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, s_ref, *refs):
        *t_refs, dk_ref, dv_ref, smem, bars = refs
        batch, q_head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem, *extra = smem
        own_barriers, stream_barriers, consumed = bars[:2], bars[3:], bars[2]
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
            out_smems = (extra[2].at[wg], extra[3].at[wg]) if fp8 else (k_smem, v_smem)
            zeros = jnp.full((bk, d), 0, F32)
            acc = tuple(_lay.wgmma_layout(zeros, plgpu.Layout.WGMMA, interpret) for _ in range(2))

            def q_step(i, carry, masked: bool = False):
                dk, dv = carry
                slot = _p.ring(i - first, steps)
                _p.wait_all(stream_barriers, slot)
                q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
                lse = _p.load_row(lse_smem.at[slot], 0, interpret)
                delta = _p.load_row(delta_smem.at[slot], 0, interpret)
                st = _p.mma((bk, bq), k_smem, q_tile, True, interpret)
                if masked:
                    kv_ids = _lay.iota((bk, bq), 0, interpret) + kv_base
                    q_ids = _lay.iota((bk, bq), 1, interpret) + i * bq
                    st = jnp.where(q_ids >= kv_ids, st, -jnp.inf)
                pt = jnp.exp2(st * qk_scale - lax.broadcast_in_dim(lse, st.shape, [1]))
                if fp8:  # P^T as e4m3 P^T * 448 (the A operand's registers), dO^T
                    pt_op = _lay.p_operand((pt * _fk.P_SCALE).astype(cdt), interpret)
                    dv_spec = (dv, pt_op, extra[1].at[slot], True)
                else:
                    dv_spec = (dv, pt.astype(bf16), do_tile, False)
                dv, dpt = _p.mmas(
                    dv_spec,
                    ((bk, bq), v_smem, do_tile, True),
                    interpret=interpret,
                )
                dst = pt * (dpt * v_scale - lax.broadcast_in_dim(delta, st.shape, [1]))
                if fp8:  # dS^T as e4m3 dS^T / ds_scale, Q^T
                    dst8 = _lay.p_operand((dst * s_ref[5]).astype(cdt), interpret)
                    dk = _p.mma(dk, dst8, extra[0].at[slot], True, interpret)
                else:
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
            out_smems[0][...] = (dk * dk_scale).astype(bf16)
            out_smems[1][...] = (dv * dv_scale).astype(bf16)
            plgpu.commit_smem()
            out_rows = (batch, pl.ds(kv_base, bk), q_head)
            plgpu.copy_smem_to_gmem(out_smems[0], dk_ref.at[out_rows])
            plgpu.copy_smem_to_gmem(out_smems[1], dv_ref.at[out_rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _memory_wg():
            def src(ref, rows: bool):
                def at(step):
                    block = pl.ds((first + step) * bq, bq)
                    return ref.at[batch, block, q_head] if rows else ref.at[batch, q_head, block]

                return at

            rings = (q_smem, do_smem, lse_smem, delta_smem, *extra[:2])
            srcs = [src(q_ref, True), src(do_ref, True), src(lse_ref, False), src(delta_ref, False)]
            for ref in t_refs:  # Q^T, dO^T
                at = lambda step, ref=ref: ref.at[batch, q_head, :, pl.ds((first + step) * bq, bq)]  # noqa: E731
                srcs.append(at)
            loads = tuple(zip(srcs, rings, stream_barriers))
            _p.loader(n_q - first, steps, loads, consumed, interpret)

    t = _gg._smem_transforms(d, cdt)
    smem = [
        plgpu.SMEM((COMPUTE_WGS, bk, d), cdt, transforms=t),
        plgpu.SMEM((COMPUTE_WGS, bk, d), cdt, transforms=t),
        plgpu.SMEM((steps, bq, d), cdt, transforms=t),
        plgpu.SMEM((steps, bq, d), cdt, transforms=t),
        plgpu.SMEM((steps, bq), F32),
        plgpu.SMEM((steps, bq), F32),
    ]
    if fp8:  # the Q^T and dO^T rings, dK's and dV's bf16 staging
        tt, bf16_t = _gg._smem_transforms(bq, cdt), _gg._smem_transforms(d, bf16)
        smem += [plgpu.SMEM((steps, d, bq), cdt, transforms=tt) for _ in range(2)]
        smem += [plgpu.SMEM((COMPUTE_WGS, bk, d), bf16, transforms=bf16_t) for _ in range(2)]
    barriers = (
        *(plgpu.Barrier(num_barriers=COMPUTE_WGS) for _ in range(2)),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=steps),
        *(plgpu.Barrier(num_barriers=steps) for _ in range(6 if fp8 else 4)),
    )
    grid = (hq, sk // (COMPUTE_WGS * bk), batch_size)
    out = jax.ShapeDtypeStruct((batch_size, sk, hq, d), bf16)
    args = (q, k, v, do, lse2, delta, scales, *(qt_dot or ()))
    return _p.call(
        entry, smem, barriers, (out, out), grid, ("heads", "kv_seq", "batch"), interpret, args
    )


def _quantize_dout(dout, v, v_scale, dout_scale=None):
    """dO as e4m3 with its per-tensor scale (amax / 448; or ``dout`` itself where it comes
    as e4m3 with its ``dout_scale``), and dS's scale from a bound:
    ``|dS| = P |dP - delta| <= 2 max_i |dO_i| max_j |V_j|`` (2-norms; O's rows are convex
    combinations of V's), over 448."""
    # floors after the division: tiny / 448 is subnormal, which the GPU flushes to 0, and
    # an all-zero dO (e4m3 underflow at a first step's scale) then gave 0 * inf = NaN
    tiny = jnp.finfo(F32).tiny
    if dout_scale is None:
        do_s = jnp.maximum(jnp.max(jnp.abs(dout.astype(F32))) / _fk.P_SCALE, tiny)
        do8 = (dout.astype(F32) / do_s).astype(_fk.E4M3)
    else:
        do8, do_s = dout, _scalar(dout_scale)
    norm = lambda x: jnp.sqrt(jnp.max(jnp.sum(jnp.square(x.astype(F32)), -1)))  # noqa: E731
    ds_s = jnp.maximum(2 * norm(do8) * do_s * norm(v) * v_scale / _fk.P_SCALE, tiny)
    return do8, do_s, ds_s


@functools.partial(
    jax.jit, static_argnames=("causal", "softmax_scale", "config", "interpret", "wrt_fp8")
)
def flash_fp8_bwd(
    q, k, v, q_scale, k_scale, v_scale, out, lse, dout, *, causal=False, softmax_scale=None,
    config=Config(), interpret=False, wrt_fp8=False, out_scale=None, dout_scale=None,
):  # fmt: skip
    """The attention backward on Hopper (see the module docstring); the arguments and
    results of `flash_fp8_bwd_reference`, plus ``config`` (`Config`), ``interpret`` (Pallas'
    GPU interpret mode, CPU) and ``wrt_fp8``: the gradients with respect to the e4m3 values
    themselves (those of the dequantized ones times the scales), as a ``custom_vjp`` needs.
    ``out`` and ``dout`` may also come as e4m3 with their per-tensor ``out_scale`` and
    ``dout_scale`` (the attention's FP8 path has them so): ``Config(fp8=True)`` then reads
    ``dout`` as it is, with no second rounding to a scale of its own.
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
    one, bf16 = jnp.float32(1), jnp.bfloat16
    for name, x, scale in (("out", out, out_scale), ("dout", dout, dout_scale)):
        if (x.dtype == _fk.E4M3) != (scale is not None):
            raise ValueError(f"flash_fp8_bwd: {name} {x.dtype} needs its scale if and only "
                             f"if it is {jnp.dtype(_fk.E4M3).name}")  # fmt: skip
    if out_scale is not None:
        out = out.astype(F32) * _scalar(out_scale)

    def scales(do_s=one, ds_s=one, dv_s=one):  # the logits' base-2 multiplier, dP's, dQ's,
        return jnp.stack(  # dK's, dV's scales and 1 / dS's (bf16 operands: all but dS's 1)
            [qs * ks * (sm * LOG2E), vs * do_s, ds_s * sm * ks * (qs if wrt_fp8 else one),
             ds_s * sm * qs * (ks if wrt_fp8 else one), dv_s * (vs if wrt_fp8 else one),
             1 / ds_s]
        )  # fmt: skip

    lse2 = lse.astype(F32) * LOG2E
    delta_of = lambda do: jnp.einsum("bqhd,bqhd->bhq", out.astype(F32), do)  # noqa: E731
    if not (config.fp8 and config.fp8_dq):  # the bf16 kernels read dO as given
        do = dout.astype(F32) * (one if dout_scale is None else _scalar(dout_scale))
        ops16 = tuple(x.astype(bf16) for x in (q, k, v, do))  # e4m3 -> bf16 is exact
        delta16 = delta_of(do)
    if config.fp8:
        do8, do_s, ds_s = _quantize_dout(dout, v, vs, dout_scale)
        delta8 = delta_of(do8.astype(F32) * do_s)  # from the dO the e4m3 kernels see
        perm = not interpret  # keys (queries) of each 16 as `flash_fp8_layout.p_operand` reads them
        ops8, scales8 = (q, k, v, do8), scales(do_s, ds_s, do_s / _fk.P_SCALE)
    if config.fp8 and config.fp8_dq:
        dq = _dq(*ops8, lse2, delta8, scales8, _fk._vt(k, perm), causal, config, interpret)
    else:
        dq = _dq(*ops16, lse2, delta16, scales(), None, causal, config, interpret)
    if config.fp8:
        qt_dot = (_fk._vt(q, perm), _fk._vt(do8, perm))
        dk, dv = _dkv(*ops8, lse2, delta8, scales8, qt_dot, causal, config, interpret)
    else:
        dk, dv = _dkv(*ops16, lse2, delta16, scales(), None, causal, config, interpret)
    if hq != hkv:  # sum a group's query heads
        group = lambda x: x.astype(F32).reshape(b, sk, hkv, hq // hkv, d).sum(3)  # noqa: E731
        dk, dv = group(dk).astype(bf16), group(dv).astype(bf16)
    return dq, dk, dv
