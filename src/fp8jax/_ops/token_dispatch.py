"""Expert-parallel token dispatch and combine over all-to-alls (`fp8jax.nn.MoE`'s
``dispatch="all_to_all"``).

The tokens are split over every mesh axis (``D`` devices); each device routes its own (the
router is replicated) and packs, for each device ``d`` of the expert axis (``n`` of them,
``per = G / n`` experts each), a buffer of ``C`` rows: its assignments to ``d``'s experts,
by local expert, then by token (static shapes). The buffers cross the expert axis in one
all-to-all, in FP8 or in bf16. Each device lays the rows it received out by its local
experts (`fp8jax._ops.expert_parallel.BlockLayout`: its own block of the rows), the experts
run on their blocks, and the outputs go back in bf16 (DeepSeek-V3 dispatches in FP8 and
combines in bf16). Each token then sums its top-k outputs with the router weights.

FP8 on the wire, two ways:

* The experts' fc1 casts its input with one scale per tensor (``precast``: the default
  delayed per-tensor recipe, or current per-tensor scaling): each device casts its send
  buffer to e4m3 with fc1's own input scale, chosen before the dispatch as fc1 would choose
  it (delayed: from fc1's state; current: from the rows' global amax, a scalar all-reduce);
  only the e4m3 values cross (no scales), and fc1 takes them as they arrive
  (`fp8jax._ops.grouped.grouped_fp8_precast`), with that scale and the global amax for
  its state update. The rows round once, as fc1 alone would round them.
* Otherwise (row- or block-wise experts; ``dispatch_dtype="fp8"`` with bf16 experts) each
  row goes as e4m3 with its own float32 scale (current scaling; the scales in a second,
  small all-to-all) and is dequantized on arrival: the experts cast it again with their own
  recipe, so those rows round twice. One scale per row rather than per 128-wide tile: the
  experts' own cast bounds the precision the rows arrive with, so finer scales on the wire
  would buy little; a row's scale costs 4 bytes next to its ``H`` bytes.

Backward: the combine's all-to-all is autodiff's (the reverse all-to-all of the bf16 output
gradient); the dispatch's exchange has its own VJP: the row gradients go back through the
reverse all-to-all in bf16, straight through the quantization. Pre-cast, the rows' gradient
rides on `Dispatch.rows`, bf16 zeros standing in for the e4m3 rows (unused in the forward,
so XLA drops them): fc1's gradient for its input lands there. Every row gather's gradient
is a gather through the inverse map (`_gather`), not a scatter-add.

Capacity: with a capacity ``cap`` (`MoE.capacity` of one device's tokens) each device
keeps, per expert, its first ``cap`` assignments (in token order; the rest are dropped),
and ``C = min(tokens * min(top_k, per), per * cap)``; dropless (``cap`` None), ``C`` is the
upper bound ``tokens * min(top_k, per)``: every assignment fits, at the price of buffers up
to ``n`` times the balanced traffic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .. import _quant as q
from .expert_parallel import BlockLayout, ExpertSharding, _shard_map
from .group_layout import _round_up, layout_from_sizes, padded_rows
from .grouped import InputCast

F32, BF16, E4M3 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn
I32 = jnp.int32


class Dispatch(NamedTuple):
    """What `dispatch` sent where (global arrays, split over every mesh axis).

    Arguments:
        rows: ``[D * R, H]`` each device's received rows in its block's padded layout.
        layout: their `BlockLayout`.
        row_of_slot: ``[D * n * C]`` the padded row of each received slot (``R``: empty).
        slot: ``[T * k]`` the send slot of each assignment (``n * C``: dropped).
        kept_sizes: ``[D, G]`` the assignments each device kept per expert.
        slot_of_row: ``[D * R]`` the inverse of ``row_of_slot`` (``n * C``: no slot).
        assignment: ``[D * n * C]`` the inverse of ``slot`` (``tokens * k``: empty slot).
        precast: the rows cast once with fc1's input scale (``rows`` then holds zeros that
            carry their gradient), or None.
    """

    rows: jax.Array
    layout: BlockLayout
    row_of_slot: jax.Array
    slot: jax.Array
    kept_sizes: jax.Array
    slot_of_row: jax.Array
    assignment: jax.Array
    precast: InputCast | None = None

    def kept(self) -> jax.Array:
        """``[T * k]`` whether each assignment was sent (not dropped by the capacity)."""
        n_slots = self.row_of_slot.shape[0] // self.layout.group_sizes.shape[0]
        return self.slot < n_slots


def sizes(experts: ExpertSharding, tokens: int, top_k: int, num_experts: int, capacity, align):
    """Static ``(C, R)``: send slots per destination device, padded rows per block."""
    n, d = experts.mesh.shape[experts.axis], experts.mesh.size
    tl, per = tokens // d, num_experts // n
    reach = tl if capacity is None else min(tl, capacity)  # rows one source sends one expert
    c = min(tl * min(top_k, per), per * reach)
    r = min(padded_rows(n * c, per, align), per * _round_up(n * reach, align))
    return c, r


def top_k(experts: ExpertSharding, probs, k: int):
    """``jax.lax.top_k(probs, k)`` on each device's tokens (XLA's partitioner would gather
    ``probs [T, G]`` onto every device first)."""
    every = P(tuple(experts.mesh.axis_names))
    return _shard_map(experts, lambda p: tuple(jax.lax.top_k(p, k)), every, (every, every))(probs)


def _all_to_all(x, axis):
    return jax.lax.all_to_all(x, axis, 0, 0)


def quantize_rows(x):
    """``x [..., H]`` as e4m3 with one float32 scale per row: the tiled recipes' current
    scaling (`fp8jax._quant.tile_scales` of each row's amax) with a ``1 x H`` tile."""
    scale = q.tile_scales(q.tile_amax(x, axis=-1), E4M3)
    return q.saturate(x, 1.0 / scale[..., None], E4M3), scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather(num_rows: int, x, index, inverse):
    """``x[index]`` (rows; an index past the end gives zeros). ``inverse [num_rows * m]``:
    the output rows that read each row of ``x`` (``m`` each; past the end: none), so the
    gradient is a gather and a sum over ``m`` where autodiff's would be a scatter-add."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _gather_fwd(num_rows, x, index, inverse):
    return _gather(num_rows, x, index, inverse), (index, inverse)


def _gather_bwd(num_rows, res, ct):
    index, inverse = res
    dx = jnp.take(ct, inverse, axis=0, mode="fill", fill_value=0)
    m = inverse.shape[0] // num_rows
    if m > 1:
        dx = jnp.sum(dx.reshape(num_rows, m, -1).astype(F32), axis=1).astype(ct.dtype)
    return dx, None, None


_gather.defvjp(_gather_fwd, _gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _exchange(axis: str, fp8: bool, x):
    """``x [n, C, H]``: block ``i`` to device ``i`` of ``axis`` (FP8 or bf16 on the wire)."""
    return _exchange_fwd(axis, fp8, x)[0]


def _exchange_fwd(axis, fp8, x):
    if not fp8:
        return _all_to_all(x.astype(BF16), axis).astype(x.dtype), None
    values, scales = quantize_rows(x)
    values, scales = _all_to_all(values, axis), _all_to_all(scales, axis)
    return (values.astype(F32) * scales[..., None]).astype(x.dtype), None


def _exchange_bwd(axis, fp8, _, ct):
    """The reverse all-to-all of the rows' gradient in bf16 (straight through the cast)."""
    return (_all_to_all(ct.astype(BF16), axis).astype(ct.dtype),)


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


class Precast(NamedTuple):
    """How to cast the rows before the dispatch: ``scale(amax, *args)`` gives fc1's ``[1]``
    input scale from the rows' global amax (delayed scaling ignores it; ``args``: arrays
    replicated on every device, fc1's state); ``dtype``: fc1's input FP8 dtype."""

    scale: Callable
    args: tuple
    dtype: jnp.dtype = E4M3


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _exchange_cast(axis: str, dtype, x, scale):
    """``x [n, C, H]`` cast to FP8 ``dtype`` with ``scale`` and sent as `_exchange` sends it:
    ``(the received FP8 rows, zeros like x that carry their gradient)``."""
    return _exchange_cast_fwd(axis, dtype, x, scale)[0]


def _exchange_cast_fwd(axis, dtype, x, scale):
    values = _all_to_all(q.quantize(x, scale, dtype), axis)
    return (values, jnp.zeros(x.shape, x.dtype)), jnp.zeros_like(scale)


def _exchange_cast_bwd(axis, dtype, zero_scale, cts):
    """The stand-in's gradient through the reverse all-to-all in bf16 (straight through)."""
    _, ct = cts
    return _all_to_all(ct.astype(BF16), axis).astype(ct.dtype), zero_scale


_exchange_cast.defvjp(_exchange_cast_fwd, _exchange_cast_bwd)


def dispatch(
    experts: ExpertSharding,
    tokens,
    expert_ids,
    num_experts: int,
    capacity,
    align: int,
    fp8: bool,
    precast: Precast | None = None,
) -> Dispatch:
    """Send each token's rows to the devices of its experts (one all-to-all).

    Arguments:
        experts: the experts' mesh axis.
        tokens: ``[T, H]`` (T divisible by the mesh's device count).
        expert_ids: ``[T, k]`` each token's experts.
        num_experts: ``G``.
        capacity: assignments each device keeps per expert, or None (dropless).
        align: the padded layout's group alignment.
        fp8: e4m3 rows with per-row scales on the wire (else bf16).
        precast: cast the rows once with fc1's input scale instead (e4m3, no scales on the
            wire), handed on as `Dispatch.precast`.

    Returns:
        The `Dispatch`: the received rows in blocks, and the maps `combine` takes back.
    """
    axis, n = experts.axis, experts.mesh.shape[experts.axis]
    t, k = expert_ids.shape
    c, r = sizes(experts, t, k, num_experts, capacity, align)
    per, h = num_experts // n, tokens.shape[-1]

    def local(tokens, ids, *scale_args):
        a = ids.size
        flat = ids.reshape(-1).astype(I32)  # assignments, token-major
        order = jnp.argsort(flat, stable=True)
        sorted_e = flat[order]
        counts = jnp.bincount(flat, length=num_experts).astype(I32)
        rank = jnp.arange(a, dtype=I32) - (jnp.cumsum(counts) - counts)[sorted_e]
        kept = counts if capacity is None else jnp.minimum(counts, capacity)
        kc = kept.reshape(n, per)
        first = (jnp.cumsum(kc, axis=1) - kc).reshape(-1)  # expert's first slot in its buffer
        slot_sorted = jnp.where(
            rank < kept[sorted_e], (sorted_e // per) * c + first[sorted_e] + rank, n * c
        )
        slot = jnp.zeros((a,), I32).at[order].set(slot_sorted)
        assign = jnp.full((n * c,), a, I32).at[slot].set(jnp.arange(a, dtype=I32), mode="drop")
        send = _gather(tokens.shape[0], tokens, assign // k, slot)
        if precast is None:
            recv = _exchange(axis, fp8, send.reshape(n, c, h)).reshape(n * c, h)
        else:  # the global amax of the rows sent (fc1's, as on one device), one all-reduce
            amax = jax.lax.pmax(q.amax(jax.lax.stop_gradient(send)), experts.mesh.axis_names)
            scale = jax.lax.stop_gradient(precast.scale(amax, *scale_args))
            values, recv = _exchange_cast(axis, precast.dtype, send.reshape(n, c, h), scale)
            values, recv = jax.lax.stop_gradient(values).reshape(n * c, h), recv.reshape(n * c, h)

        got = _all_to_all(kc, axis)  # [source, local expert] rows received
        layout = layout_from_sizes(jnp.sum(got, axis=0), r, align)
        ends = jnp.cumsum(got, axis=1)
        i = jnp.arange(c, dtype=I32)
        j = jnp.sum(ends[:, None, :] <= i[None, :, None], axis=-1).astype(I32)  # [n, c]
        jj, src = jnp.minimum(j, per - 1), jnp.arange(n)[:, None]
        earlier = jnp.cumsum(got, axis=0) - got  # expert's rows from earlier sources
        row = layout.starts[jj] + earlier[src, jj] + i - (ends - got)[src, jj]
        row = jnp.where(j < per, row, r).reshape(-1)
        source = jnp.full((r,), n * c, I32).at[row].set(jnp.arange(n * c, dtype=I32), mode="drop")
        rows = _gather(n * c, recv, source, row)
        maps = (row, slot, kept[None], source, assign)
        out = (rows, layout.group_sizes[None], layout.row_valid, *maps)
        if precast is None:
            return out
        cast = jnp.take(values, source, axis=0, mode="fill", fill_value=0)  # padding: zeros
        return out + (cast, scale, amax)

    every = P(tuple(experts.mesh.axis_names))
    args = () if precast is None else tuple(jax.lax.stop_gradient(a) for a in precast.args)
    out_specs = (every,) * 8 + (() if precast is None else (every, P(), P()))
    out = _shard_map(experts, local, (every, every) + (P(),) * len(args), out_specs)(
        tokens, expert_ids, *args
    )
    rows, group_sizes, row_valid, *maps = out[:8]
    layout = BlockLayout(group_sizes, row_valid, align, num_experts)
    cast = None if precast is None else InputCast(*out[8:])
    return Dispatch(rows, layout, *maps, precast=cast)


def combine(experts: ExpertSharding, y, plan: Dispatch, top_k: int):
    """The experts' outputs ``y [D * R, H]`` back to their tokens (one bf16 all-to-all):
    ``[T, k, H]``, zeros for dropped assignments."""
    axis, n = experts.axis, experts.mesh.shape[experts.axis]

    def local(y, row, slot, source, assignment):
        h = y.shape[-1]
        send = _gather(y.shape[0], y.astype(BF16), row, source)
        back = _all_to_all(send.reshape(n, -1, h), axis).reshape(-1, h)
        out = _gather(back.shape[0], back, slot, assignment)
        return out.reshape(-1, top_k, h).astype(y.dtype)

    every = P(tuple(experts.mesh.axis_names))
    maps = (plan.row_of_slot, plan.slot, plan.slot_of_row, plan.assignment)
    return _shard_map(experts, local, (every,) * 5, every)(y, *maps)
