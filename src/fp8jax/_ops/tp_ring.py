"""Collective matmul for the sequence-parallel FP8 linear (``overlap="ring"`` or
``"chunks"``, issue 48).

`fp8jax._ops.sequence_parallel` moves a tensor-parallel pair's tokens whole, before or
after the GEMM; XLA then runs the collective exposed. Here each transition is a
``shard_map`` over the tensor axis of ``n`` devices that splits the GEMM by tokens, so
the transfer of one chunk runs under the GEMM of another:

- ``"ring"``: ``n`` steps; each runs the local FP8 GEMM on the chunk of tokens it holds
  while ``ppermute`` passes a chunk to the next device.
- ``"chunks"``: each device's tokens in ``k`` chunks (`fp8jax._kernels.gemm.Tuning`'s
  ``tp_chunks``); chunk ``j`` of every device moves as one all-gather or reduce-scatter
  (`gather_chunks`, `scatter_chunks`), NCCL's own collectives on ``1/k`` of the bytes,
  which XLA's scheduler may place beside another chunk's GEMM (on two H200 GPUs the step was
  slower than with whole moves: benchmarks/RESULTS.md, twenty-eighth session). The layers of
  `fp8jax._ops.dot` take it; `fp8jax.nn.FusedMLP`'s gated core keeps its whole moves.

================  ========================================  ==============================
layer             forward                                   backward
================  ========================================  ==============================
column-parallel   gather ring: the FP8 input's chunks       scatter ring: dgrad's partial
                  (e4m3) pass on, each times the local      sums (x dtype) accumulate; the
                  weight block; output rows assembled       FP8 input's transposed chunks
                                                            (e4m3) ride along for wgrad
row-parallel      scatter ring: the output's partial sums   gather ring: the FP8 output
                  (output dtype) accumulate chunk by        gradient's chunks (e5m2) pass
                  chunk, passed on with the accumulator     on for dgrad; wgrad reads the
                                                            gathered copy transposed
================  ========================================  ==============================

What moves in FP8 is a cast operand: its scale is per tensor and global (the amax is a
scalar all-reduce outside the ring, as on the unchunked path), so a chunk is exactly what
the device holding the whole tensor would have cast, and the ring passes values only.
Partial sums move in the GEMM's output dtype: an FP8 partial sum would need a scale known
before the sum and round once per device, while the unchunked path reduces the same
partials in the output dtype. The wgrad GEMM runs outside the ring on the gathered FP8
copy, as on the unchunked path (the partitioner sums it over the batch axes): the same
GEMM on the same operands. The reductions add the same partials in ring order, rounding
to their dtype at each hop, so a row-parallel output and a column-parallel input gradient
may differ from the unchunked step's in their last bit (and what is computed from them).
Only per-tensor recipes (`fp8jax._recipe_base.Recipe.per_tensor_scale`) take the ring:
the row- and block-wise recipes' per-token scales would have to travel with their chunks,
so they keep the unchunked path.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .._kernels import gemm as _gemm
from .._recipe_base import Cast
from .sequence_parallel import SequenceParallel

# `SequenceParallel.overlap`: constraint pairs, the ppermute ring, or chunked collectives
OVERLAPS = ("none", "ring", "chunks")
Gemm = Callable  # (a, a_scale, b, b_scale) -> a [B,P,C] . b [B,Q,C], the recipe's FP8 GEMM


def applies(sp: SequenceParallel | None, recipe) -> bool:
    """Whether a sequence-parallel layer's FP8 GEMMs run chunked (a ring or chunked
    collectives; else the constraint pairs)."""
    return sp is not None and sp.overlap in ("ring", "chunks") and recipe.per_tensor_scale


def _spec(sp: SequenceParallel, tokens_dim: int, split: bool, tensor_dim=None) -> P:
    """A 3-D operand's layout: tokens (dim ``tokens_dim``) split over the batch axes and,
    when ``split``, the tensor axis; dim ``tensor_dim`` (features) over the tensor axis."""
    entries: list = [None, None, None]
    entries[tokens_dim] = (*sp.batch, sp.axis) if split else (sp.batch or None)
    if tensor_dim is not None:
        entries[tensor_dim] = sp.axis
    return P(*entries)


def _weight(sp: SequenceParallel, tensor_dim: int) -> P:
    entries: list = [None, None, None]
    entries[tensor_dim] = sp.axis
    return P(*entries)


def _size(sp: SequenceParallel) -> int:
    return sp.mesh.shape[sp.axis]


def _shift(sp: SequenceParallel, a: jax.Array) -> jax.Array:
    """``a`` passed one step on along the ring: device ``i`` receives device ``i - 1``'s."""
    n = _size(sp)
    return jax.lax.ppermute(a, sp.axis, [(i, (i + 1) % n) for i in range(n)])


def _zeros(chunk, n: int, dim: int):
    shape = list(chunk.shape)
    shape[dim] *= n
    return jnp.zeros(shape, chunk.dtype)


def gather_ring(sp: SequenceParallel, gemm: Gemm, a, sa, b, sb, keep: bool = False):
    """Per device: ``a [B, m, C]``, its chunk of the tokens, times ``b [B, Q, C]`` for
    every chunk of the ring. At step ``s`` device ``i`` holds chunk ``(i - s) % n`` and
    sends it on while multiplying it. Returns the output ``[B, n m, Q]`` with the chunks
    in token order and, with ``keep``, the gathered ``a`` (else None)."""
    n, i = _size(sp), jax.lax.axis_index(sp.axis)
    y, gathered = None, _zeros(a, n, 1) if keep else None
    for s in range(n):
        nxt = _shift(sp, a) if s + 1 < n else None
        part, at = gemm(a, sa, b, sb), (i - s) % n
        y = _zeros(part, n, 1) if y is None else y
        y = jax.lax.dynamic_update_slice_in_dim(y, part, at * a.shape[1], 1)
        if keep:
            gathered = jax.lax.dynamic_update_slice_in_dim(gathered, a, at * a.shape[1], 1)
        a = nxt
    return y, gathered


def scatter_ring(sp: SequenceParallel, gemm: Gemm, a, sa, b, sb, carry=None):
    """Per device: ``a [B, M, C]`` (all the batch shard's tokens, ``C`` split over the
    ring) times ``b [B, Q, C]``, summed over the ring and scattered over the tokens. At
    step ``s`` device ``i`` multiplies chunk ``(i - s - 1) % n`` and adds the accumulator
    received for that chunk; at the last step its own chunk is complete. ``carry``
    (``[B, K, m]``, its tokens on dim 2) is gathered along the ring at the same time.
    Returns ``([B, M / n, Q], gathered carry or None)``."""
    n, i = _size(sp), jax.lax.axis_index(sp.axis)
    m = a.shape[1] // n
    acc, gathered = None, None if carry is None else _zeros(carry, n, 2)
    for s in range(n):
        part = gemm(jax.lax.dynamic_slice_in_dim(a, ((i - s - 1) % n) * m, m, 1), sa, b, sb)
        acc = part if acc is None else _shift(sp, acc) + part
        if carry is not None:
            at = ((i - s) % n) * carry.shape[2]
            gathered = jax.lax.dynamic_update_slice_in_dim(gathered, carry, at, 2)
            carry = _shift(sp, carry) if s + 1 < n else None
    return acc, gathered


def chunk_count(m: int) -> int:
    """How many chunks ``m`` tokens per device split into: `Tuning.tp_chunks`, or the
    largest count below it that divides ``m``."""
    k = _gemm.current_tuning().tp_chunks  # a positive int (`Tuning` checks it)
    while m % k:
        k -= 1
    return k


def _natural(parts: list, n: int) -> jax.Array:
    """Chunk ``j``'s rows ``[B, n * mc, Q]`` (device-major: device ``d``'s ``mc`` rows
    of its chunk ``j`` at block ``d``) reassembled in token order ``[B, n * k * mc, Q]``."""
    b, _, q = parts[0].shape
    return jnp.stack([p.reshape(b, n, -1, q) for p in parts], axis=2).reshape(b, -1, q)


def gather_chunks(sp: SequenceParallel, gemm: Gemm, a, sa, b, sb, keep: bool = False):
    """`gather_ring`'s result by chunked all-gathers: chunk ``j`` of every device's
    tokens ``a [B, m, C]`` gathered, then multiplied; the next chunk may move meanwhile."""
    n, m = _size(sp), a.shape[1]
    k = chunk_count(m)
    mc = m // k
    parts = [
        jax.lax.all_gather(a[:, j * mc : (j + 1) * mc], sp.axis, axis=1, tiled=True)
        for j in range(k)
    ]
    y = _natural([gemm(p, sa, b, sb) for p in parts], n)
    return y, (_natural(parts, n) if keep else None)


def scatter_chunks(sp: SequenceParallel, gemm: Gemm, a, sa, b, sb, carry=None):
    """`scatter_ring`'s result by chunked reduce-scatters: the rows of chunk ``j`` of
    every device's tokens (``a [B, M, C]``, ``M = n m``) multiplied, then their partial
    sums reduce-scattered, which may run beside the next chunk's GEMM. ``carry`` is
    all-gathered whole on its dim 2."""
    n = _size(sp)
    bsz, big_m, c = a.shape
    m = big_m // n
    k = chunk_count(m)
    mc = m // k
    a5 = a.reshape(bsz, n, k, mc, c)
    outs = []
    for j in range(k):
        part = gemm(a5[:, :, j].reshape(bsz, n * mc, c), sa, b, sb)
        outs.append(jax.lax.psum_scatter(part, sp.axis, scatter_dimension=1, tiled=True))
    y = outs[0] if k == 1 else jnp.concatenate(outs, axis=1)
    gathered = None if carry is None else jax.lax.all_gather(carry, sp.axis, axis=2, tiled=True)
    return y, gathered


def _gather(sp: SequenceParallel):
    return gather_chunks if sp.overlap == "chunks" else gather_ring


def _scatter(sp: SequenceParallel):
    return scatter_chunks if sp.overlap == "chunks" else scatter_ring


def _ring(sp: SequenceParallel, body, in_specs: tuple, out_specs):
    return jax.shard_map(
        body, mesh=sp.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )


def forward(sp: SequenceParallel, gemm: Gemm, x, sx, w, sw) -> jax.Array:
    """The forward GEMM ``x [B, M, K] . w [B, N, K]`` of a sequence-parallel layer as a
    ring. Column: ``x``'s tokens split over the tensor axis, ``w``'s ``N``; the output's
    tokens gathered, its ``N`` split. Row: ``x``'s and ``w``'s ``K`` split; the output's
    tokens split (its partial sums reduced along the ring)."""
    scalars = (P(), P())
    if sp.kind == "column":
        body = lambda x, w, sx, sw: _gather(sp)(sp, gemm, x, sx, w, sw)[0]  # noqa: E731
        specs = (_spec(sp, 1, True), _weight(sp, 1), *scalars)
        return _ring(sp, body, specs, _spec(sp, 1, False, 2))(x, w, sx, sw)
    body = lambda x, w, sx, sw: _scatter(sp)(sp, gemm, x, sx, w, sw)[0]  # noqa: E731
    specs = (_spec(sp, 1, False, 2), _weight(sp, 2), *scalars)
    return _ring(sp, body, specs, _spec(sp, 1, True))(x, w, sx, sw)


def backward(sp: SequenceParallel, gemm: Gemm, g: Cast, w_kn, sw, xTq):
    """The dgrad ``g [B, M, N] . w_kn [B, K, N]`` of a sequence-parallel layer as a ring,
    and the wgrad's FP8 operands. Column: a scatter ring (``N`` split, ``dx``'s tokens
    scattered) that gathers the input's transposed copy ``xTq [B, K, M]`` on the way. Row:
    a gather ring over ``g``'s tokens (``dx``'s ``K`` split), whose gathered copy,
    transposed, is the wgrad's (per-tensor: the cast's ``data_t`` is ``data`` transposed).
    Returns ``(dx, xTq gathered, g's [B, N, M] copy)``."""
    scalars = (P(), P())
    if sp.kind == "column":

        def col(gd, w, sg, sw, xt):
            return _scatter(sp)(sp, gemm, gd, sg, w, sw, carry=xt)

        specs = (_spec(sp, 1, False, 2), _weight(sp, 2), *scalars, _spec(sp, 2, True))
        outs = (_spec(sp, 1, True), _spec(sp, 2, False))
        dx, xTq = _ring(sp, col, specs, outs)(g.data, w_kn, g.scale, sw, xTq)
        return dx, xTq, g.data_t

    def row(gd, w, sg, sw):
        return _gather(sp)(sp, gemm, gd, sg, w, sw, keep=True)

    specs = (_spec(sp, 1, True), _weight(sp, 1), *scalars)
    outs = (_spec(sp, 1, False, 2), _spec(sp, 1, False))
    dx, g_all = _ring(sp, row, specs, outs)(g.data, w_kn, g.scale, sw)
    return dx, xTq, jnp.swapaxes(g_all, 1, 2)
