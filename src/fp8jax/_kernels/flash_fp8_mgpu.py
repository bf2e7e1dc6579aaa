"""Hopper FP8 flash-attention forward (Pallas Mosaic GPU, ``wgmma``), FA3's layout.

``out = softmax(scale * Q K^T) V`` for e4m3 ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``
(GQA: ``Hq`` a multiple of ``Hkv``) with per-tensor float32 scales (dequantized value =
fp8 * scale), ``D`` 64 or 128; bf16 output and the natural-log log-sum-exp
``lse [B, Hq, Sq]`` float32 of the scaled logits (for a backward).

Structured as JAX's Hopper attention (``jax.experimental.pallas.ops.gpu.attention_mgpu``,
its forward): a CTA owns ``2 * block_q`` query rows of one head; two compute warpgroups
(``block_q`` rows each) and a third warpgroup that only issues the TMA loads of the K and
V tiles into a ring of ``max_concurrent_steps`` slots (manual barriers). The two compute
warpgroups take turns on the tensor cores as in FA3 (ping-pong): a warpgroup waits for its
turn before its ``P V`` and hands the turn over once its next ``Q K^T`` is issued, so one
warpgroup's softmax runs while the other's matmuls do. Per KV block:

* ``S = Q K^T`` on ``wgmma`` with both e4m3 operands K-major (Q's ``[block_q, D]`` tile, K's
  ``[block_kv, D]`` tile as the transposed B operand), float32 accumulate, times
  ``q_scale * k_scale * softmax_scale * log2(e)`` folded into the softmax's exponent
  (``exp2(s * c - m)``, one FFMA a logit; the softmax runs in base 2);
* the online softmax in float32 (running row max ``m``, row sum ``l``);
* ``acc += P V``: P (float32 in [0, 1]) comes out of the exponent as ``P * 448``
  (`P_SCALE`: ``exp2(s c - m + log2 448)``, no multiply a logit), is rounded to e4m3 and
  stays in registers as the ``wgmma``'s A operand: `flash_fp8_layout.p_operand` reads its
  registers as Mosaic GPU's 8-bit ``wgmma`` layout, which reorders each 16 keys, and V comes
  pre-transposed with its keys reordered to match (``vT [B, Hkv, D, Sk]``, `_vt`: one
  pass of `key_transpose` in `flash_fp8`) so its ``[D, block_kv]`` tile is the K-major B
  operand FP8 ``wgmma`` needs.

The output is ``acc * v_scale / l`` (``l`` sums ``P * 448`` as ``acc`` does). Causal
(``Sq == Sk``, top-left aligned): KV blocks past the diagonal are skipped, the blocks the
diagonal crosses masked, and the grid runs its query tiles from the last (the most keys)
to the first.

`flash_fp8_reference` is the same algorithm in plain JAX (the same online softmax per
``block_kv`` and the same P quantization); `reason` says why the kernel cannot run.
Written against the Pallas Mosaic GPU API of jax 0.10-0.11 (the calls ``attention_mgpu``
uses). ``interpret=True`` runs the kernel in Pallas' GPU interpret mode (CPU, tests), with
a dot standing in for each ``wgmma`` (the interpreter has no transposed-B ``wgmma``) on
P and V in their natural key order (no register regrouping there, so no key reordering).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from .. import _jax_compat, _quant
from . import flash_fp8_layout as _lay
from . import grouped_gemm as _gg
from . import key_transpose as _kt

pl, plgpu = _gg.pl, _gg.plgpu
E4M3 = _lay.E4M3
P_SCALE = _quant.fp8_max(E4M3)  # P in [0, 1] is stored as e4m3 P * 448, e4m3's largest value
LOG2E = math.log2(math.e)
LOG2_P_SCALE = math.log2(P_SCALE)
COMPUTE_WGS = 2  # compute warpgroups per CTA (the third one loads)


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles of `flash_fp8`: each compute warpgroup owns ``block_q`` query rows (a CTA
    ``2 * block_q``); K/V stream in ``block_kv``-row tiles through a ring of
    ``max_concurrent_steps`` shared-memory slots. The defaults are the fastest measured
    where ``Sk`` is a multiple of 256 (`default_config` picks per shape; `benchmarks/
    RESULTS.md`, "FP8 flash attention")."""

    block_q: int = 64
    block_kv: int = 256
    max_concurrent_steps: int = 2


def default_config(sk: int) -> Config:
    """The fastest measured `Config` that tiles ``Sk`` keys: 256-key tiles through 2 slots
    (two 64 KiB K + vT tiles fill shared memory), else 128-key tiles through 4."""
    return Config() if sk % 256 == 0 else Config(block_kv=128, max_concurrent_steps=4)


def reason(q_shape, k_shape, dtype, causal: bool = False, config=None, device=None):
    """Why the kernel cannot run ``q [B, Sq, Hq, D]``, ``k/v [B, Sk, Hkv, D]`` of ``dtype``
    with ``config`` (`default_config` when None; ``None`` when it can)."""
    ok, why = _gg.available(device)
    if not ok:
        return why
    return _shape_reason(q_shape, k_shape, dtype, causal, config)


def _shape_reason(q_shape, k_shape, dtype, causal, config: Config | None):
    """`reason` without the device check (the interpreter runs any shape that fits)."""
    if len(q_shape) != 4 or len(k_shape) != 4:
        return f"q {tuple(q_shape)}, k {tuple(k_shape)} are not [B, S, H, D]"
    config = default_config(k_shape[1]) if config is None else config
    (b, sq, hq, d), (bk_, sk, hkv, dk) = q_shape, k_shape
    if jnp.dtype(dtype) != jnp.dtype(E4M3):
        return f"dtype {jnp.dtype(dtype)} (the kernel takes float8_e4m3fn q, k, v)"
    if (b, d) != (bk_, dk):
        return f"q {tuple(q_shape)} and k/v {tuple(k_shape)} disagree on batch or head_dim"
    if d not in (64, 128):
        return f"head_dim {d} (the kernel takes 64 or 128)"
    if hq % hkv:
        return f"{hq} query heads are not a multiple of {hkv} KV heads"
    bq, bkv = config.block_q, config.block_kv
    if bq % 64 or bkv % 64 or bkv > 256 or config.max_concurrent_steps < 2:
        return f"{config}: block_q, block_kv multiples of 64 (block_kv <= 256), 2+ steps"
    if sq % (COMPUTE_WGS * bq) or sk % bkv:
        return f"Sq={sq}, Sk={sk} are not multiples of {COMPUTE_WGS * bq}, {bkv}"
    if causal and sq != sk:
        return f"causal with Sq={sq} != Sk={sk} (the kernel's mask is top-left aligned)"
    return None


# ----------------------------------------------------------------------------- reference
def _scales(q_scale, k_scale, v_scale, head_dim: int, softmax_scale):
    """The logits' multiplier in base 2 (``q_scale * k_scale * softmax_scale * log2 e``)
    and the output's (``v_scale / 448``), float32 scalars."""
    sm = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    f32 = lambda x: jnp.asarray(x, jnp.float32).reshape(())  # noqa: E731
    qk = f32(q_scale) * f32(k_scale) * jnp.float32(sm * LOG2E)
    return qk, f32(v_scale) / jnp.float32(P_SCALE)


def _online_block(carry, s, v_block):
    """One KV block of the online softmax (base 2): ``s [..., Sq, bk]`` scaled logits,
    ``v_block [..., bk, D]``; P quantized as the kernel does (e4m3 ``P * 448``)."""
    acc, m, row_sum = carry
    m_new = jnp.maximum(m, s.max(-1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[..., None])
    p8 = (p * P_SCALE).astype(E4M3).astype(jnp.float32)
    pv = jnp.matmul(p8, v_block, precision=lax.Precision.HIGHEST)
    return acc * alpha[..., None] + pv, m_new, row_sum * alpha + p.sum(-1)


@functools.partial(jax.jit, static_argnames=("causal", "softmax_scale", "config", "interpret"))
def flash_fp8_reference(
    q, k, v, q_scale, k_scale, v_scale, *, causal=False, softmax_scale=None,
    config=None, interpret=False,
):  # fmt: skip
    """`flash_fp8` in plain JAX: the same online softmax over ``config.block_kv`` KV
    blocks (its running max and sums in float32, ``exp2``) with the same e4m3 P, on
    exact products of the FP8 operands (float32; on a GPU XLA may run these dots as FP8
    GEMMs, whose accumulation, as the kernel's, is narrower). ``interpret`` is ignored.

    Returns:
        ``(out [B, Sq, Hq, D] bf16, lse [B, Hq, Sq] float32)``.
    """
    del interpret
    (b, sq, hq, d), (sk, hkv) = q.shape, k.shape[1:3]
    config = default_config(sk) if config is None else config
    qk_scale, out_scale = _scales(q_scale, k_scale, v_scale, d, softmax_scale)
    g = hq // hkv
    qf = q.astype(jnp.float32).reshape(b, sq, hkv, g, d)
    s = jnp.einsum(
        "bqhgd,bkhd->bhgqk", qf, k.astype(jnp.float32), precision=lax.Precision.HIGHEST
    ) * qk_scale  # fmt: skip
    if causal:
        s = jnp.where(jnp.arange(sq)[:, None] >= jnp.arange(sk)[None, :], s, -jnp.inf)
    bkv = min(config.block_kv, sk)
    nblocks = sk // bkv
    s_blocks = jnp.moveaxis(s.reshape(*s.shape[:-1], nblocks, bkv), -2, 0)
    v_blocks = jnp.moveaxis(v.astype(jnp.float32).reshape(b, nblocks, bkv, hkv, d), 1, 0)
    v_blocks = jnp.transpose(v_blocks, (0, 1, 3, 2, 4))[:, :, :, None]  # [n, b, h, 1, bk, d]
    init = (
        jnp.zeros((b, hkv, g, sq, d), jnp.float32),
        jnp.full((b, hkv, g, sq), -jnp.inf, jnp.float32),
        jnp.zeros((b, hkv, g, sq), jnp.float32),
    )
    step = lambda carry, xs: (_online_block(carry, *xs), None)  # noqa: E731
    (acc, m, row_sum), _ = lax.scan(step, init, (s_blocks, v_blocks))
    out = acc * (out_scale / row_sum)[..., None]
    out = jnp.transpose(out.reshape(b, hq, sq, d), (0, 2, 1, 3)).astype(jnp.bfloat16)
    lse = ((m + jnp.log2(row_sum)) / LOG2E).reshape(b, hq, sq)
    return out, lse


# ----------------------------------------------------------------------------- kernel
@functools.partial(jax.jit, static_argnames=("causal", "softmax_scale", "config", "interpret"))
def flash_fp8(
    q, k, v, q_scale, k_scale, v_scale, *, causal=False, softmax_scale=None,
    config=None, interpret=False,
):  # fmt: skip
    """FP8 flash-attention forward on Hopper (see the module docstring).

    Arguments:
        q, k, v: ``[B, Sq, Hq, D]``, ``[B, Sk, Hkv, D]`` float8_e4m3fn.
        q_scale, k_scale, v_scale: per-tensor float32 scales (value = fp8 * scale).
        causal: mask keys after the query (``Sq == Sk``).
        softmax_scale: the logits' scale, ``1/sqrt(D)`` when None.
        config: tile sizes (`Config`; `default_config` of ``Sk`` when None).
        interpret: run in Pallas' GPU interpret mode (CPU; tests).

    Returns:
        ``(out [B, Sq, Hq, D] bf16, lse [B, Hq, Sq] float32)``, ``lse`` the natural-log
        log-sum-exp of the scaled logits per query row.
    """
    why = _shape_reason(q.shape, k.shape, q.dtype, causal, config)
    if why is None and not interpret:
        why = reason(q.shape, k.shape, q.dtype, causal, config)
    if why is None and (k.dtype != q.dtype or v.dtype != q.dtype or v.shape != k.shape):
        why = f"k {k.dtype}{k.shape}, v {v.dtype}{v.shape} do not match q's dtype and k"
    if why is not None:
        raise ValueError(f"FP8 flash-attention kernel: {why}")
    config = default_config(k.shape[1]) if config is None else config
    qk_scale, out_scale = _scales(q_scale, k_scale, v_scale, q.shape[-1], softmax_scale)
    vt = _vt(v, permute_keys=not interpret)
    scales = jnp.stack([qk_scale, out_scale])
    return _forward(q, k, vt, scales, causal, config, interpret)


def _vt(v, permute_keys: bool):
    """``v [B, Sk, Hkv, D]`` as ``vT [B, Hkv, D, Sk]`` (the PV operand K-major); with
    ``permute_keys`` (the GPU) each 16 keys reordered as `flash_fp8_layout.p_operand`
    presents P's: the register position ``4t + 2a + b`` holds key ``8a + 2t + b``
    (`key_transpose.key_order`)."""
    if permute_keys and _kt.reason(v.shape, v.dtype) is None:  # one pass, not XLA's byte loop
        return _kt.transpose_keys(v, permute_keys=True)
    return _kt.reference(v, permute_keys)


def _mma_qk(q_smem, k_smem, shape, interpret: bool, between=None):
    """``Q K^T`` of a Q tile ``[bq, D]`` and a K tile ``[bk, D]`` (float32 ``shape``),
    ``between`` called while the ``wgmma`` runs."""
    if interpret:  # a dot stands in for the wgmma; ``between`` keeps the barriers' order
        dims = (((1,), (1,)), ((), ()))
        s = lax.dot_general(q_smem[...], k_smem[...], dims, preferred_element_type=jnp.float32)
        if between is not None:
            between()
        return s

    def scope(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, _gg._transposed(k_smem))
        if between is not None:
            between()
        return acc_ref[...]

    return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))


def _mma_pv(acc, p, vt_smem, interpret: bool, between=None):
    """``acc + P V`` of an e4m3 P tile ``[bq, bk]`` (registers, from
    `flash_fp8_layout.p_operand`) and a vT tile ``[D, bk]`` (K-major), ``between`` called
    while the ``wgmma`` runs."""
    if interpret:
        dims = (((1,), (1,)), ((), ()))
        pv = lax.dot_general(p, vt_smem[...], dims, preferred_element_type=jnp.float32)
        if between is not None:
            between()
        return acc + pv

    def compute(acc_ref):
        plgpu.wgmma(acc_ref, p, _gg._transposed(vt_smem))
        if between is not None:
            between()

    return pl.run_state(compute)(plgpu.ACC.init(acc))


def _forward(q, k, vt, scales, causal: bool, config: Config, interpret: bool):
    """The kernel on ``q [B, Sq, Hq, D]``, ``k [B, Sk, Hkv, D]``, ``vt [B, Hkv, D, Sk]``
    and ``scales [2]`` (the logits' base-2 multiplier, the output's)."""
    (batch_size, sq, hq, d), (sk, hkv) = q.shape, k.shape[1:3]
    heads_per_kv = hq // hkv
    bq, bk = config.block_q, config.block_kv
    steps = min(config.max_concurrent_steps, sk // bk)  # ring slots
    max_kv_steps = sk // bk
    num_q_tiles = sq // (COMPUTE_WGS * bq)

    def kernel(q_ref, k_ref, vt_ref, s_ref, out_ref, lse_ref, smem, barriers):
        batch, q_head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        q_smem2, k_smem, vt_smem, o_smem2, lse_smem2 = smem
        k_barriers, v_barriers, q_barriers, k_consumed, v_consumed, schedule = barriers

        def qk_issued():  # right after a Q K^T wgmma is issued: the other warpgroup's turn
            plgpu.barrier_arrive(schedule.at[1 - wg])

        def before_pv(slot=None):  # after the softmax: wait for V and the tensor cores
            if slot is not None:
                plgpu.barrier_wait(v_barriers.at[slot])
            plgpu.barrier_wait(schedule.at[wg])  # this warpgroup's turn

        tile = _lay.q_tile(num_q_tiles, causal)
        if causal:  # the CTA's last row decides how far the loader goes
            cta_end = (tile + 1) * (COMPUTE_WGS * bq)
            cta_kv_steps = pl.cdiv(cta_end, jnp.array(bk, jnp.int32))
        else:
            cta_kv_steps = max_kv_steps

        @pl.when(wg < COMPUTE_WGS)
        def _compute_wg():
            plgpu.set_max_registers(232, action="increase")
            q_smem, o_smem = q_smem2.at[wg], o_smem2.at[wg]
            lse_smem = lse_smem2.at[wg]
            q_base = tile * (COMPUTE_WGS * bq) + wg * bq
            if causal:
                kv_steps = pl.cdiv(q_base + bq, jnp.array(bk, jnp.int32))
            else:
                kv_steps = max_kv_steps
            rows = (batch, pl.ds(q_base, bq), q_head)
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, q_barriers.at[wg])
            qk_scale, out_scale = s_ref[0], s_ref[1]
            plgpu.barrier_wait(q_barriers.at[wg])

            row = plgpu.Layout.WGMMA.reduce(1)
            m_i = _lay.wgmma_layout(jnp.full((bq,), -jnp.inf, jnp.float32), row, interpret)
            l_i = _lay.wgmma_layout(jnp.full((bq,), 0, jnp.float32), row, interpret)
            acc = _lay.wgmma_layout(
                jnp.full((bq, d), 0, jnp.float32), plgpu.Layout.WGMMA, interpret
            )

            @pl.when(kv_steps > 0)
            def _():
                plgpu.barrier_wait(k_barriers.at[0])

            @pl.when(wg == 1)  # warpgroup 0 issues the first Q K^T
            def _():
                plgpu.barrier_wait(schedule.at[1])

            def ring(step):
                return lax.rem(step, jnp.array(steps, jnp.int32))

            def softmax(s, m_i, l_i, step, masked: bool):
                """The online softmax (base 2, float32) of the raw logits ``s``: P as e4m3
                ``P * 448`` (the PV wgmma's A operand), the new row max, the accumulator's
                rescale factor and the new row sum."""
                if masked:
                    q_ids = _lay.iota((bq, bk), 0, interpret) + q_base
                    kv_ids = _lay.iota((bq, bk), 1, interpret) + step * bk
                    s = jnp.where(q_ids >= kv_ids, s, -jnp.inf)
                # qk_scale > 0: max(s * c) = max(s) * c
                m_ij = jnp.maximum(m_i, s.max(axis=1) * qk_scale)
                # p is P * 448 straight from the exponent: no multiply a logit
                bias = lax.broadcast_in_dim(m_ij - LOG2_P_SCALE, s.shape, [0])
                p = jnp.exp2(s * qk_scale - bias)
                alpha = jnp.exp2(m_i - m_ij)
                return p.astype(E4M3), m_ij, alpha, l_i * alpha + p.sum(axis=1)

            def rescale(acc, alpha):
                return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

            def wait_k(step):  # K of ``step`` (when there is one) has landed
                @pl.when(step < kv_steps)
                def _wait():
                    plgpu.barrier_wait(k_barriers.at[ring(step)])

            def kv_step(step, carry, masked: bool = False):
                acc, m_i, l_i = carry
                slot = ring(step)
                s = _mma_qk(q_smem, k_smem.at[slot], (bq, bk), interpret, qk_issued)
                plgpu.barrier_arrive(k_consumed.at[slot])
                p8, m_ij, alpha, l_i = softmax(s, m_i, l_i, step, masked)
                acc = rescale(acc, alpha)
                p_op = _lay.p_operand(p8, interpret)
                acc, l_i, m_ij, p_op = lax.optimization_barrier((acc, l_i, m_ij, p_op))
                before_pv(slot)

                wait_next_k = functools.partial(wait_k, step + 1)  # while P V runs
                acc = _mma_pv(acc, p_op, vt_smem.at[slot], interpret, wait_next_k)
                plgpu.barrier_arrive(v_consumed.at[slot])
                return acc, m_ij, l_i

            carry = (acc, m_i, l_i)
            if not causal:
                acc, m_i, l_i = lax.fori_loop(0, max_kv_steps, kv_step, carry)
            else:
                unmasked = lax.div(q_base, jnp.array(bk, jnp.int32))
                carry = lax.fori_loop(0, unmasked, kv_step, carry)
                masked = functools.partial(kv_step, masked=True)
                acc, m_i, l_i = lax.fori_loop(unmasked, kv_steps, masked, carry)
            if causal:

                def flush(step, _):
                    # Release the slots this warpgroup does not need (the other one may),
                    # and keep the schedule barriers' counts in step with it.
                    slot = lax.rem(step, jnp.array(steps, step.dtype))
                    if interpret:  # the interpreter wants every phase waited for
                        plgpu.barrier_wait(k_barriers.at[slot])
                        plgpu.barrier_wait(v_barriers.at[slot])
                    plgpu.barrier_arrive(k_consumed.at[slot])
                    plgpu.barrier_arrive(v_consumed.at[slot])
                    qk_issued()
                    before_pv()

                lax.fori_loop(kv_steps, cta_kv_steps, flush, None)

            @pl.when(wg == 0)  # warpgroup 1's last turn
            def _():
                plgpu.barrier_arrive(schedule.at[1])

            inv_l = out_scale * P_SCALE / l_i  # l_i sums P * 448
            o_smem[...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(jnp.bfloat16)
            lse_smem[...] = (m_i + jnp.log2(l_i) - LOG2_P_SCALE) * jnp.float32(1 / LOG2E)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_ref.at[rows])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, q_head, pl.ds(q_base, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _memory_wg():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = lax.div(q_head, jnp.array(heads_per_kv, q_head.dtype))

            def load(step, slot):
                cols = pl.ds(step * bk, bk)
                plgpu.copy_gmem_to_smem(
                    k_ref.at[batch, cols, kv_head], k_smem.at[slot], k_barriers.at[slot]
                )
                plgpu.copy_gmem_to_smem(
                    vt_ref.at[batch, kv_head, :, cols], vt_smem.at[slot], v_barriers.at[slot]
                )

            for i in range(steps):
                load(i, i)

            @pl.loop(0, cta_kv_steps - steps)
            def _kv_loop(step):
                slot = lax.rem(step, jnp.array(steps, step.dtype))
                plgpu.barrier_wait(k_consumed.at[slot])
                plgpu.barrier_wait(v_consumed.at[slot])
                load(step + steps, slot)

            if interpret:  # the interpreter wants every phase of a barrier waited for

                @pl.loop(jnp.maximum(cta_kv_steps - steps, 0), cta_kv_steps)
                def _drain(step):
                    slot = lax.rem(step, jnp.array(steps, step.dtype))
                    plgpu.barrier_wait(k_consumed.at[slot])
                    plgpu.barrier_wait(v_consumed.at[slot])

    def entry(q_ref, k_ref, vt_ref, s_ref, out_ref, lse_ref):
        qk_t = _gg._smem_transforms(d, E4M3)  # Q, K tiles: D minor
        pv_t = _gg._smem_transforms(bk, E4M3)  # vT tiles: block_kv minor
        smem = (
            plgpu.SMEM((COMPUTE_WGS, bq, d), E4M3, transforms=qk_t),
            plgpu.SMEM((steps, bk, d), E4M3, transforms=qk_t),
            plgpu.SMEM((steps, d, bk), E4M3, transforms=pv_t),
            plgpu.SMEM(
                (COMPUTE_WGS, bq, d), jnp.bfloat16, transforms=_gg._smem_transforms(d, jnp.bfloat16)
            ),
            plgpu.SMEM((COMPUTE_WGS, bq), jnp.float32),
        )
        consumed = plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=steps)
        barriers = (
            plgpu.Barrier(num_barriers=steps),
            plgpu.Barrier(num_barriers=steps),
            plgpu.Barrier(num_barriers=COMPUTE_WGS),
            consumed,
            consumed,
            plgpu.Barrier(num_barriers=COMPUTE_WGS),  # a warpgroup's turn each
        )
        pl.run_scoped(
            lambda smem, barriers: kernel(
                q_ref, k_ref, vt_ref, s_ref, out_ref, lse_ref, smem, barriers
            ),
            smem,
            barriers,
            collective_axes="wg",
        )

    extra = {}
    if interpret:
        extra = dict(interpret=_jax_compat.interpret_gpu_params()())
    out_type = (
        jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
        jax.ShapeDtypeStruct((batch_size, hq, sq), jnp.float32),
    )
    return plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(hq, num_q_tiles, batch_size),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **extra,
    )(q, k, vt, scales)
