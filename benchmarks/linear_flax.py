"""The flax peers of `benchmarks.linear`: flax's direct FP8 dot and the quantize-dequantize
pattern haliax uses, each as a train step over ``(w [K, N], state)`` with delayed scaling.
They reproduce the anchors of ``ANCHORS.md`` section 2 (``probe_h100.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.common import Step, projection_loss
from benchmarks.flax_steps import MissingDependency, linen_step, nnx_step, require_flax

BF16, F32 = jnp.bfloat16, jnp.float32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FLAX_AMAX_HISTORY = 1024  # as in the anchors (flax's default)


def _flax_fp8_ops():
    try:
        from flax.linen import fp8_ops
    except ImportError as e:
        raise MissingDependency(f"skipped: flax not installed ({e})") from None
    return fp8_ops


def _flax_state():
    """flax-style delayed-scaling state (scales and amax histories), as in the probe."""
    ones = jnp.ones((1,), F32)
    hist = jnp.zeros((FLAX_AMAX_HISTORY,), F32)
    return dict(ls=ones, rs=ones, gs=ones, lh=hist, rh=hist, gh=hist)


_KN_DN = (((1,), (0,)), ((), ()))  # x [M, K] . w [K, N] (flax kernel layout)


def _flax_step(loss, layer, x, g) -> Step:
    """Step over params ``(w [K, N], state)``; one warm step writes the new state
    (flax returns it as the state's gradient) so the scales are calibrated."""
    w_kn = jnp.asarray(layer.weight.T)
    step = Step(jax.value_and_grad(loss, argnums=(0, 1)), (w_kn, _flax_state()))
    _, ((_, new_state), _) = jax.block_until_ready(step.jitted(step.params, x, g))
    step.params = (w_kn, new_state)
    return step


def build_flax_direct(layer, x, g) -> Step:
    """flax ``fp8_scaled_dot_general`` (direct FP8 dots, delayed scaling), bf16 compute."""
    fp8_ops = _flax_fp8_ops()

    def loss(params, x, g):
        w, st = params
        y = fp8_ops.fp8_scaled_dot_general(
            x,
            w,
            _KN_DN,
            lhs_scale=st["ls"],
            rhs_scale=st["rs"],
            grad_scale=st["gs"],
            lhs_amax_history=st["lh"],
            rhs_amax_history=st["rh"],
            grad_amax_history=st["gh"],
            quantize_compute_type=BF16,
            preferred_element_type=BF16,
        )
        return projection_loss(y, g)

    return _flax_step(loss, layer, x, g)


def build_haliax_qdq(layer, x, g) -> Step:
    """Quantize-dequantize around a bf16 dot (flax ``in_qdq``/``out_qdq``, haliax's pattern)."""
    fp8_ops = _flax_fp8_ops()

    def loss(params, x, g):
        w, st = params
        xq = fp8_ops.in_qdq(BF16, E4M3, x, st["ls"], st["lh"])
        wq = fp8_ops.in_qdq(BF16, E4M3, w, st["rs"], st["rh"])
        y = jax.lax.dot_general(xq, wq, _KN_DN)
        y = fp8_ops.out_qdq(BF16, E5M2, y, st["gs"], st["gh"])
        return projection_loss(y, g)

    return _flax_step(loss, layer, x, g)


# ----------------------------------------------------------------------------- front doors
# fp8jax through flax's own layers: ``nn.Dense(dot_general_cls=fp8_dot_general_cls(cfg))``
# and ``fp8jax.nnx.fp8_linear_layers`` on ``nnx.Linear``, bf16 compute, with the layer's
# weight and its dtype as ``param_dtype`` (bf16 or f32) (`benchmarks.flax_steps`).
def linen_builder(config):
    """``fp8jax-linen``: ``nn.Dense`` with fp8jax's ``dot_general_cls`` (``config``)."""

    def build(layer, x, g) -> Step:
        require_flax()
        import flax.linen as nn

        from fp8jax.flax import fp8_dot_general_cls

        n = layer.weight.shape[0]
        cls = fp8_dot_general_cls(config)
        dense = nn.Dense(
            n, use_bias=False, dtype=BF16, param_dtype=layer.weight.dtype, dot_general_cls=cls
        )
        variables = dense.init(jax.random.PRNGKey(0), x[:8])
        variables = {**variables, "params": {"kernel": jnp.asarray(layer.weight.T)}}
        return linen_step(dense, variables, x, g)

    return build


def nnx_builder(config):
    """``fp8jax-nnx``: ``nnx.Linear`` converted by ``fp8jax.nnx.fp8_linear_layers``."""

    def build(layer, x, g) -> Step:
        require_flax()
        from flax import nnx

        import fp8jax.nnx as fnnx

        n, k = layer.weight.shape
        model = nnx.Linear(
            k, n, use_bias=False, dtype=BF16, param_dtype=layer.weight.dtype, rngs=nnx.Rngs(0)
        )
        model.kernel.value = jnp.asarray(layer.weight.T)
        fnnx.fp8_linear_layers(model, config)
        return nnx_step(model, x, g)

    return build
