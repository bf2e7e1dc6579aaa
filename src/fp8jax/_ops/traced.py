"""How the FP8 ops are traced (`fp8jax._ops.dot` builds its ops on these): once per
configuration, shapes and trace context, and under ``jax.vmap`` with the vmapped axis
folded into the GEMM rows, the per-example trace ``custom_vmap`` makes for shapes kept
quiet."""

from __future__ import annotations

import contextvars
import functools

import jax
from jax import lax

from .._kernels import gemm as _gemm
from . import fsdp as _fsdp_op

# >0 while custom_vmap traces the per-example function only to get its shapes
QUIET: contextvars.ContextVar[int] = contextvars.ContextVar("fp8jax_quiet", default=0)


def merge(a, axis_size):
    """[V, B, M, C] -> [B, V*M, C]: fold a vmapped axis into the GEMM rows."""
    _, b, m, c = a.shape
    return lax.transpose(a, (1, 0, 2, 3)).reshape(b, axis_size * m, c)


def split_rows(a, axis_size):
    """[B, V*M, C] -> [V, B, M, C]."""
    b, vm, c = a.shape
    return lax.transpose(a.reshape(b, axis_size, vm // axis_size, c), (1, 0, 2, 3))


def split_cols(a, axis_size):
    """[B, C, V*M] -> [V, B, C, M]."""
    b, c, vm = a.shape
    return lax.transpose(a.reshape(b, c, axis_size, vm // axis_size), (2, 0, 1, 3))


def fallback_vmap(impl, in_batched, args):
    axes = jax.tree_util.tree_map(lambda b: 0 if b else None, in_batched)
    out = jax.vmap(impl, in_axes=tuple(axes))(*args)
    return out, jax.tree_util.tree_map(lambda _: True, out)


def under_vmap(x) -> bool:
    trace = getattr(x, "_trace", None)
    return trace is not None and "Batch" in type(trace).__name__


def quiet_when_vmapped(fn, probe_arg):
    """Call ``fn``; when its input is vmapped, the per-example trace custom_vmap makes
    for shapes must not warn or raise (the vmap rule decides on the merged rows)."""

    @functools.wraps(fn)
    def call(*args):
        quiet = under_vmap(jax.tree_util.tree_leaves(args[probe_arg])[0])
        token = QUIET.set(QUIET.get() + quiet)
        try:
            return fn(*args)
        finally:
            QUIET.reset(token)

    return call


def decide_loudly(probe, fn, *args):
    """``fn(*args)`` from a vmap rule (the real rows known): the policy's warnings are not
    muted there, unless ``probe`` is still vmapped (an outer ``jax.vmap`` decides)."""
    token = QUIET.set(int(under_vmap(probe)))
    try:
        return fn(*args)
    finally:
        QUIET.reset(token)


def traced_once(impl, name: str):
    """``impl`` under ``jax.jit`` (named ``name`` in the HLO): the layers of a model that
    share a `Spec` and shapes (a transformer's blocks) trace and lower it once, and the step
    calls that one function (issue 21: tracing and lowering are much of a small FP8 step's
    extra compile time). What the trace reads besides its arguments is part of the cache key:
    whether warnings are muted (`QUIET`, so custom_vmap's per-example trace is never the one
    a real call reuses), `fp8jax._kernels.gemm.tuning` and the FSDP axes
    (`fp8jax.distributed.fsdp_axes`). ``vmap`` over the state or the weight
    (`fallback_vmap`) maps the plain ``impl``."""

    def run(settings: tuple, *args):
        del settings
        return impl(*args)

    run.__name__ = run.__qualname__ = name
    jitted = jax.jit(run, static_argnums=0)

    @functools.wraps(impl)
    def call(*args):
        return jitted(trace_context(), *args)

    return call


def trace_context() -> tuple:
    """What an op's trace reads besides its arguments and `Spec`: whether warnings and
    errors are muted (`QUIET`: a shape-only per-example trace, replayed for a real call,
    would let an ``on_unsupported="raise"`` layer run in bf16 without a word), the GEMM
    tuning (`fp8jax._kernels.gemm.tuning`) and the FSDP axes
    (`fp8jax.distributed.fsdp_axes`)."""
    return (bool(QUIET.get()), _gemm.current_tuning(), _fsdp_op.current_axes())


def per_context(build):
    """``build(*key)`` cached per key and per `trace_context`. The ``custom_vmap`` ops it
    builds are traced once per function object where JAX caches that trace by the function
    and its shapes alone (jax 0.11; 0.10 traced each call): one object for every context
    would replay its first trace in another (on 2 GPUs a program traced after
    ``tuning.gemm(sequence_cast=False)`` kept XLA's casts inside ``sequence_cast=True``, and
    the reverse: benchmarks/RESULTS.md, twenty-seventh session)."""
    cached = functools.lru_cache(maxsize=None)(lambda context, *key: build(*key))

    @functools.wraps(build)
    def get(*key):
        return cached(trace_context(), *key)

    return get


def rows_scale(scale, m: int) -> bool:
    """Whether an activation's scale ``scale`` has one row per token (row- and block-wise
    recipes: ``[B, M, ...]``), so that a vmapped axis folded into the ``m`` rows splits it."""
    return scale.ndim == 3 and scale.shape[1] == m
