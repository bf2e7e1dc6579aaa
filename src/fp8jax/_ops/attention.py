"""FP8 flash attention with its custom VJP: cuDNN on Hopper, a plain-JAX reference elsewhere.

Layout BTNH (``[batch, seq, heads, head_dim]``), K/V may have fewer heads (GQA).
Ten tensors carry FP8 scaling state, all e4m3 (cuDNN's FP8 attention takes one FP8
type): the inputs ``q, k, v``; inside the kernel ``s`` (softmax probabilities P,
the left operand of P.V) and ``o`` (output); in the backward ``do`` (output grad),
``dp`` (grad of the logits, the operand of the dQ/dK GEMMs) and ``dq, dk, dv``.
Softmax and its statistics stay in float32. ``q, k, v`` follow ``config.scaling``
(delayed or current); ``s`` has the fixed scale 1/448 (flash attention quantizes
``exp(S - running row max)``, which is at most 1; on H100 any larger scale saturated);
the other six are delayed (the kernel needs their scales before it runs), except
``do`` under current scaling. As in `fp8jax._ops.dot`, the new
state is returned as the state's gradient, entering as `fp8jax._state.MAX_GRAD` values
so that repeated uses of one state in a step combine by max.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.sharding import PartitionSpec as P

from .. import _quant as qt
from .. import _state
from .._config import Fp8Config
from .._kernels import cudnn_attention as cudnn
from .._kernels import dispatch
from . import attention_mgpu as mgpu

F32 = jnp.float32
E4M3 = jnp.float8_e4m3fn
TENSORS = ("q", "k", "v", "s", "o", "do", "dp", "dq", "dk", "dv")
IDX = {name: i for i, name in enumerate(TENSORS)}
# P's scale: the softmax numerator exp(S - row max) is in [0, 1], so 1/448 uses e4m3's
# full range and can never saturate. The others start at 1 (flax/TE convention).
S_SCALE = 1.0 / 448.0
INITIAL_SCALES = tuple(S_SCALE if name == "s" else 1.0 for name in TENSORS)


class AttnSplit(NamedTuple):
    """Where a placed model's attention runs (`fp8jax.shard_model` records it): its
    sequences split over ``batch_axes`` of ``mesh`` and its heads over ``head_axis`` (None:
    not split). Hashable: part of `AttnSpec`."""

    mesh: jax.sharding.Mesh
    batch_axes: tuple[str, ...]
    head_axis: str | None = None


class AttnSpec(NamedTuple):
    """Static description of one attention call (hashable: a custom_vjp nondiff arg)."""

    config: Fp8Config
    backend: str  # "cudnn" | "reference" | "mgpu" | "mgpu-interpret" (`attention_mgpu`)
    causal: bool
    softmax_scale: float
    in_dtype: np.dtype  # of q, k, v: their gradients come back in it
    out_dtype: np.dtype
    split: AttnSplit | None = None


# ----------------------------------------------------------------------------- reference
def _mask(spec: AttnSpec, b, t, s, q_len, kv_len):
    """Boolean [B, 1, 1, T, S] mask (top-left aligned causal, like jax.nn)."""
    mask = jnp.ones((1, 1, 1, t, s), bool)
    if spec.causal:
        mask = mask & jnp.tril(jnp.ones((t, s), bool))[None, None, None]
    if kv_len is not None:
        mask = mask & (jnp.arange(s)[None, :] < kv_len[:, None])[:, None, None, None, :]
    if q_len is not None:
        mask = mask & (jnp.arange(t)[None, :] < q_len[:, None])[:, None, None, :, None]
    return jnp.broadcast_to(mask, (b, 1, 1, t, s))


def _probs(spec, q8, k8, s_q, s_k, q_len, kv_len, normalize=True):
    """Softmax probabilities [B, Nkv, G, T, S] in f32 from FP8 q, k (and q, k in f32);
    with ``normalize=False`` the numerator exp(S - row max) and the row sums."""
    b, t, n, h = q8.shape
    s, nk = k8.shape[1], k8.shape[2]
    qf = (q8.astype(F32) * s_q).reshape(b, t, nk, n // nk, h)
    kf = k8.astype(F32) * s_k
    logits = jnp.einsum("btkgh,bskh->bkgts", qf, kf) * spec.softmax_scale
    mask = _mask(spec, b, t, s, q_len, kv_len)
    logits = jnp.where(mask, logits, -jnp.inf)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0.0)), 0.0)
    total = jnp.sum(p, axis=-1, keepdims=True)
    total = jnp.where(total > 0, total, 1.0)
    if not normalize:
        return p, total, qf, kf
    return p / total, qf, kf


def _reference_forward(spec, q8, k8, v8, sc, q_len, kv_len):
    b, t, n, h = q8.shape
    # Like flash attention: the FP8 P.V GEMM takes the numerator exp(S - row max), the
    # division by the row sum (kept in f32) comes after it.
    numerator, total, _, _ = _probs(
        spec, q8, k8, sc[IDX["q"]], sc[IDX["k"]], q_len, kv_len, normalize=False
    )
    amax_s = qt.amax(numerator / total)
    pf = qt.quantize(numerator, sc[IDX["s"]], E4M3).astype(F32) * sc[IDX["s"]]
    vf = v8.astype(F32) * sc[IDX["v"]]
    o = jnp.einsum("bkgts,bskh->bkgth", pf, vf) / total
    o = jnp.moveaxis(o, 3, 1).reshape(b, t, n, h)
    return qt.quantize(o, sc[IDX["o"]], E4M3), amax_s, qt.amax(o), None


def _reference_backward(spec, q8, k8, v8, o8, do8, stats, sc, q_len, kv_len):
    del stats
    b, t, n, h = q8.shape
    nk = k8.shape[2]
    p, qf, kf = _probs(spec, q8, k8, sc[IDX["q"]], sc[IDX["k"]], q_len, kv_len)
    pf = qt.quantize(p, sc[IDX["s"]], E4M3).astype(F32) * sc[IDX["s"]]
    vf = v8.astype(F32) * sc[IDX["v"]]
    dof = (do8.astype(F32) * sc[IDX["do"]]).reshape(b, t, nk, n // nk, h)
    of = (o8.astype(F32) * sc[IDX["o"]]).reshape(b, t, nk, n // nk, h)
    dv = jnp.einsum("bkgts,btkgh->bskh", pf, dof)
    dpf = jnp.einsum("btkgh,bskh->bkgts", dof, vf)
    rowsum = jnp.moveaxis(jnp.sum(dof * of, axis=-1), 1, -1)  # [B, Nkv, G, T]
    ds = p * (dpf - rowsum[..., None])
    amax_dp = qt.amax(ds)
    dsf = qt.quantize(ds, sc[IDX["dp"]], E4M3).astype(F32) * sc[IDX["dp"]]
    dq = (jnp.einsum("bkgts,bskh->btkgh", dsf, kf) * spec.softmax_scale).reshape(b, t, n, h)
    dk = jnp.einsum("bkgts,btkgh->bskh", dsf, qf) * spec.softmax_scale
    out = []
    for name, grad in (("dq", dq), ("dk", dk), ("dv", dv)):
        out.append(qt.quantize(grad, sc[IDX[name]], E4M3))
    return (*out, qt.amax(dq), qt.amax(dk), qt.amax(dv), amax_dp)


# ----------------------------------------------------------------------------- per shard
# cuDNN's FP8 attention is a custom call whose partitioning rule (JAX's) failed to compile
# with the batch split over four GPUs ("dimensions mismatch as broadcasting", jax 0.11.2)
# and declares the amaxes replicated though each device sees only its own rows. Where
# the model was placed on a mesh, each device runs the kernel on its own sequences and
# heads (attention mixes neither), and the amaxes are combined by ``pmax``.
BTNH, HEADS_FIRST, ROWS, WHOLE, MAX = "btnh", "bn", "b", "whole", "max"


def _split_spec(split: AttnSplit, kind: str) -> P:
    """The ``shard_map`` spec of an array of ``kind`` (dims it leaves out are not split)."""
    batch = split.batch_axes or None
    if kind == BTNH:
        return P(batch, None, split.head_axis)
    if kind == HEADS_FIRST:  # softmax statistics [B, N, T, ...]
        return P(batch, split.head_axis)
    if kind == ROWS:
        return P(batch)
    return P()


def _on_shards(split: AttnSplit | None, fn, args: tuple, in_kinds: tuple, out_kinds: tuple):
    """``fn(*args)`` on each device's sequences and heads when ``split`` is given and the
    program spans several devices outside a ``shard_map`` (else a plain call). Kinds:
    `BTNH`, `HEADS_FIRST`, `ROWS` (``[B]``), `WHOLE` (replicated) and, for outputs, `MAX`
    (an amax: ``pmax`` over the split axes). None args and outputs pass through."""
    if split is None or dispatch.unpartitioned_reason() is None:
        return fn(*args)
    axes = tuple(split.batch_axes) + ((split.head_axis,) if split.head_axis else ())
    rows = math.prod(split.mesh.shape[a] for a in split.batch_axes)
    if args[0].shape[0] % rows:
        raise ValueError(
            f"FP8 attention: {args[0].shape[0]} sequences do not split over the mesh axes "
            f"{split.batch_axes} ({rows} devices) that the model was placed to split them over"
        )
    present = [i for i, a in enumerate(args) if a is not None]

    def local(*given):
        full = list(args)
        for i, a in zip(present, given):
            full[i] = a
        outs = fn(*full)
        return tuple(
            None if o is None else jax.lax.pmax(o, axes) if k == MAX else o
            for o, k in zip(outs, out_kinds)
        )

    return jax.shard_map(
        local,
        mesh=split.mesh,
        in_specs=tuple(_split_spec(split, in_kinds[i]) for i in present),
        out_specs=tuple(_split_spec(split, k) for k in out_kinds),
        check_vma=False,
    )(*(args[i] for i in present))


# ----------------------------------------------------------------------------- backends
def _fit(split: AttnSplit | None, q, k) -> AttnSplit | None:
    """``split`` for these shapes: heads split only where the head axis divides both the
    query and the KV heads (else each device runs all heads of its sequences)."""
    if split is None or split.head_axis is None:
        return split
    n = split.mesh.shape[split.head_axis]
    return split if q.shape[2] % n == 0 and k.shape[2] % n == 0 else split._replace(head_axis=None)


def _backend_forward(spec, q8, k8, v8, sc, q_len, kv_len, training):
    return _on_shards(
        _fit(spec.split, q8, k8),
        lambda *a: _local_forward(spec, *a, training),
        (q8, k8, v8, sc, q_len, kv_len),
        (BTNH, BTNH, BTNH, WHOLE, ROWS, ROWS),
        (BTNH, MAX, MAX, HEADS_FIRST),
    )


def _backend_backward(spec, q8, k8, v8, o8, do8, stats, sc, q_len, kv_len):
    return _on_shards(
        _fit(spec.split, q8, k8),
        lambda *a: _local_backward(spec, *a),
        (q8, k8, v8, o8, do8, stats, sc, q_len, kv_len),
        (BTNH,) * 5 + (HEADS_FIRST, WHOLE, ROWS, ROWS),
        (BTNH,) * 3 + (MAX,) * 4,
    )


def _local_forward(spec, q8, k8, v8, sc, q_len, kv_len, training):
    if spec.backend == "reference":
        return _reference_forward(spec, q8, k8, v8, sc, q_len, kv_len)
    if spec.backend in mgpu.BACKENDS:  # no padding mask: q_len, kv_len are None
        o8, amax_s, amax_o, lse = mgpu.forward(spec, q8, k8, v8, *(sc[IDX[n]] for n in "qkvo"))
        return o8, amax_s, amax_o, lse if training else None
    # Always cuDNN's training kernel: its inference variant gave wrong outputs without a
    # mask on H100 (jax 0.11.2, tests/test_gpu.py); the extra softmax stats are small.
    o8, amax_s, amax_o, stats = cudnn.forward(
        q8,
        k8,
        v8,
        descale_q=sc[IDX["q"]],
        descale_k=sc[IDX["k"]],
        descale_v=sc[IDX["v"]],
        descale_s=sc[IDX["s"]],
        scale_s=1.0 / sc[IDX["s"]],
        scale_o=1.0 / sc[IDX["o"]],
        softmax_scale=spec.softmax_scale,
        causal=spec.causal,
        training=True,
    )
    return o8, amax_s, amax_o, stats if training else None


def _local_backward(spec, q8, k8, v8, o8, do8, stats, sc, q_len, kv_len):
    if spec.backend == "reference":
        return _reference_backward(spec, q8, k8, v8, o8, do8, stats, sc, q_len, kv_len)
    if spec.backend in mgpu.BACKENDS:
        return mgpu.backward(spec, q8, k8, v8, o8, do8, stats, {n: sc[i] for n, i in IDX.items()})
    return cudnn.backward(
        q8,
        k8,
        v8,
        o8,
        do8,
        stats,
        descale_q=sc[IDX["q"]],
        descale_k=sc[IDX["k"]],
        descale_v=sc[IDX["v"]],
        descale_o=sc[IDX["o"]],
        descale_do=sc[IDX["do"]],
        descale_s=sc[IDX["s"]],
        descale_dp=sc[IDX["dp"]],
        scale_s=1.0 / sc[IDX["s"]],
        scale_dq=1.0 / sc[IDX["dq"]],
        scale_dk=1.0 / sc[IDX["dk"]],
        scale_dv=1.0 / sc[IDX["dv"]],
        scale_dp=1.0 / sc[IDX["dp"]],
        softmax_scale=spec.softmax_scale,
        causal=spec.causal,
    )


# ----------------------------------------------------------------------------- compute
def delayed_scales(config: Fp8Config, state) -> jax.Array:
    """The ten scales from the amax history (old scale where it is empty): what the
    kernel needs before it runs, whatever the recipe does for q, k, v and do."""
    scales, history, _ = state
    return config.recipe.history_scale(history, scales, E4M3)


def _forward_impl(spec: AttnSpec, training: bool, q, k, v, q_len, kv_len, state):
    cfg = spec.config
    sc = delayed_scales(cfg, state)
    in_amax = jnp.stack([qt.amax(q), qt.amax(k), qt.amax(v)])
    sc = sc.at[:3].set(cfg.recipe.scale(state[1][:3], state[0][:3], E4M3, in_amax))
    # |O| <= max|V| (each output row is a convex combination of V's rows): before O has
    # an amax history, V's scale is a scale that cannot overflow.
    o_unseen = jnp.max(state[1][IDX["o"]]) <= 0
    sc = sc.at[IDX["o"]].set(jnp.where(o_unseen, sc[IDX["v"]], sc[IDX["o"]]))
    sc = sc.at[IDX["s"]].set(S_SCALE)
    q8, k8, v8 = (cfg.recipe.quantize(x, sc[i], E4M3) for i, x in enumerate((q, k, v)))
    o8, amax_s, amax_o, stats = _backend_forward(spec, q8, k8, v8, sc, q_len, kv_len, training)
    if o8.dtype == E4M3:
        o = cfg.recipe.dequantize(o8, sc[IDX["o"]], spec.out_dtype)
    else:  # the kernel's own output (`attention_mgpu`): e4m3 only as the backward's residual
        o, o8 = o8.astype(spec.out_dtype), cfg.recipe.quantize(o8, sc[IDX["o"]], E4M3)
    fwd_amax = jnp.concatenate([in_amax, jnp.stack([amax_s, amax_o])])
    return o, ((q8, k8, v8, o8, stats, q_len, kv_len), (sc, fwd_amax))


def _backward_impl(spec: AttnSpec, tensors, scalars, state, g):
    cfg = spec.config
    q8, k8, v8, o8, stats, q_len, kv_len = tensors
    sc, fwd_amax = scalars
    amax_do = qt.amax(g)
    do = IDX["do"]
    sc = sc.at[do].set(cfg.recipe.scale(state[1][do], state[0][do], E4M3, amax_do))
    do8 = cfg.recipe.quantize(g, sc[do], E4M3)
    dq8, dk8, dv8, amax_dq, amax_dk, amax_dv, amax_dp = _backend_backward(
        spec, q8, k8, v8, o8, do8, stats, sc, q_len, kv_len
    )
    grads = tuple(  # e4m3 from cuDNN; bf16 from `attention_mgpu`, passed on as it is
        cfg.recipe.dequantize(x8, sc[IDX[name]], spec.in_dtype)
        if x8.dtype == E4M3
        else x8.astype(spec.in_dtype)
        for x8, name in zip((dq8, dk8, dv8), ("dq", "dk", "dv"))
    )
    amaxes = jnp.concatenate([fwd_amax, jnp.stack([amax_do, amax_dp, amax_dq, amax_dk, amax_dv])])
    return grads, (sc, amaxes)


# ----------------------------------------------------------------------------- vmap rules
# Under jax.vmap over the activations, the vmapped axis is folded into the batch axis
# (a free reshape in BTNH): one kernel call and one amax per tensor over the whole
# vmapped batch, like `fp8jax._ops.dot` does for GEMM rows.
def _fold(x, size):
    return None if x is None else x.reshape((size * x.shape[1],) + x.shape[2:])


def _unfold(x, size):
    return None if x is None else x.reshape((size, x.shape[0] // size) + x.shape[1:])


def _broadcast_unbatched(x, batched, size):
    if x is None or batched:
        return x
    return jnp.broadcast_to(x, (size,) + x.shape)


def _any(tree) -> bool:
    return any(jax.tree_util.tree_leaves(tree))


@functools.lru_cache(maxsize=None)
def forward_fn(spec: AttnSpec, training: bool):
    def impl(q, k, v, q_len, kv_len, state):
        return _forward_impl(spec, training, q, k, v, q_len, kv_len, state)

    fn = custom_vmap(impl)

    @fn.def_vmap
    def rule(axis_size, in_batched, q, k, v, q_len, kv_len, state):
        qb, kb, vb, qlb, kvlb, sb = in_batched
        if _any(sb) or not (qb or kb or vb):
            out = jax.vmap(impl, in_axes=tuple(0 if _any(b) else None for b in in_batched))(
                q, k, v, q_len, kv_len, state
            )
            return out, jax.tree_util.tree_map(lambda _: True, out)
        q, k, v = (_broadcast_unbatched(x, b, axis_size) for x, b in ((q, qb), (k, kb), (v, vb)))
        q_len = _broadcast_unbatched(q_len, _any(qlb), axis_size)
        kv_len = _broadcast_unbatched(kv_len, _any(kvlb), axis_size)
        o, (tensors, scalars) = fn(*(_fold(x, axis_size) for x in (q, k, v, q_len, kv_len)), state)
        tensors = tuple(_unfold(x, axis_size) for x in tensors)
        out = (_unfold(o, axis_size), (tensors, scalars))
        batched = jax.tree_util.tree_map(lambda _: True, tensors)
        return out, (True, (batched, (False, False)))

    return fn


@functools.lru_cache(maxsize=None)
def backward_fn(spec: AttnSpec):
    def impl(tensors, scalars, state, g):
        return _backward_impl(spec, tensors, scalars, state, g)

    fn = custom_vmap(impl)

    @fn.def_vmap
    def rule(axis_size, in_batched, tensors, scalars, state, g):
        tb, cb, sb, gb = in_batched
        if _any(cb) or _any(sb):
            out = jax.vmap(impl, in_axes=(0, 0 if _any(cb) else None, 0 if _any(sb) else None, 0))(
                *(
                    jax.tree_util.tree_map(
                        lambda x, b: x if b else jnp.broadcast_to(x, (axis_size,) + x.shape),
                        tensors,
                        tb,
                    ),
                    scalars,
                    state,
                    g if gb else jnp.broadcast_to(g, (axis_size,) + g.shape),
                )
            )
            return out, jax.tree_util.tree_map(lambda _: True, out)
        tensors = jax.tree_util.tree_map(
            lambda x, b: _fold(_broadcast_unbatched(x, b, axis_size), axis_size), tensors, tb
        )
        g = _fold(_broadcast_unbatched(g, gb, axis_size), axis_size)
        grads, scalars_out = fn(tensors, scalars, state, g)
        return (tuple(_unfold(x, axis_size) for x in grads), scalars_out), (
            (True, True, True),
            (False, False),
        )

    return fn


# ----------------------------------------------------------------------------- custom VJP
def new_state(state, scales_used, combined):
    """The state after a step: the scales it used, and its ten amaxes recorded."""
    _, history, nonfinite = state
    history = _state.record(history, combined[:-1], axis=-1)
    return (scales_used.astype(F32), history, nonfinite + combined[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_attention(spec: AttnSpec, q, k, v, q_len, kv_len, state):
    """FP8 attention on BTNH arrays; ``state`` as `fp8jax._state.MAX_GRAD`."""
    o, _ = forward_fn(spec, False)(q, k, v, q_len, kv_len, _state.values(state))
    return o


def _fp8_attention_fwd(spec, q, k, v, q_len, kv_len, state):
    state = _state.values(state)
    o, (tensors, scalars) = forward_fn(spec, True)(q, k, v, q_len, kv_len, state)
    return o, (tensors, scalars, state)


def _fp8_attention_bwd(spec, residuals, cotangents):
    g = cotangents
    tensors, scalars, state = residuals
    (dq, dk, dv), (sc, amaxes) = backward_fn(spec)(tensors, scalars, state, g)
    observed, bad = qt.sanitize_amax(amaxes)
    state_ct = _state.proposal(
        new_state(state, sc, jnp.concatenate([observed, jnp.max(bad).reshape(1)]))
    )
    _, _, _, _, _, q_len, kv_len = tensors
    lens_ct = tuple(
        None if x is None else np.zeros(x.shape, jax.dtypes.float0) for x in (q_len, kv_len)
    )
    return (dq, dk, dv, *lens_ct, state_ct)


fp8_attention.defvjp(_fp8_attention_fwd, _fp8_attention_bwd)
