"""The flax front doors as `benchmarks.common.Step` s, shared by `benchmarks.linear` (one
layer) and `benchmarks.mlp` (the MLP block): loss ``sum(y * G)``, its gradients w.r.t. the
parameters (the FP8 state's new value among them) and the input, one warm step's FP8 state
written back as each door's docs say (linen: what ``TrainState.apply_gradients`` does to the
``_overwrite_with_gradient`` collection; nnx: `fp8jax.nnx.overwrite_state`), so the timed
steps use calibrated delayed scales. A missing flax raises `MissingDependency`."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from benchmarks.common import Step, projection_loss


class MissingDependency(RuntimeError):
    """A variant's optional dependency is not installed: the variant is skipped."""


def require_flax() -> None:
    """Raise `MissingDependency` (one line saying why) where flax or fp8jax's adapters
    cannot be imported."""
    try:
        import flax.linen  # noqa: F401
        from flax import nnx  # noqa: F401

        import fp8jax.flax  # noqa: F401
        import fp8jax.nnx  # noqa: F401
    except ImportError as e:
        raise MissingDependency(f"skipped: flax not installed ({e})") from None


def _calibrated(loss, params, x, g) -> Step:
    """The `Step` of ``loss(params, x, g)`` over ``params = (trainable, fp8 state)``, run
    once with the new state written into ``params``."""
    step = Step(jax.value_and_grad(loss, argnums=(0, 1)), params)
    _, ((_, new_state), _) = jax.block_until_ready(step.jitted(step.params, x, g))
    step.params = (params[0], new_state)
    return step


def linen_step(module, variables, x, g) -> Step:
    """``module.apply(variables, x)`` (a linen module whose layers take fp8jax's
    ``dot_general_cls``), differentiated w.r.t. all its variables as a ``TrainState``'s
    step does; params ``(variables but the FP8 state, the FP8 state)``."""
    from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT as OWG

    trainable = {k: v for k, v in variables.items() if k != OWG}

    def loss(p, x, g):
        return projection_loss(module.apply({**p[0], OWG: p[1]}, x), g)

    return _calibrated(loss, (trainable, variables.get(OWG, {})), x, g)


def nnx_step(model, x, g) -> Step:
    """``model(x)`` (converted by `fp8jax.nnx.fp8_linear_layers`) under ``jax.jit`` over its
    ``nnx.split`` state; params ``(nnx.Param state, Fp8State state)``."""
    from flax import nnx

    import fp8jax.nnx as fnnx

    graphdef, params, state = nnx.split(model, nnx.Param, fnnx.Fp8State)

    def loss(p, x, g):
        return projection_loss(nnx.merge(graphdef, *p)(x), g)

    return _calibrated(loss, (params, state), x, g)


@dataclasses.dataclass
class CachedStep(Step):
    """A step bound to its nnx objects by ``nnx.cached_partial``: timed as called,
    ``call(x, g)`` (``params`` unused); its program (GEMMs, memory) is the same ``nnx.jit``
    function's, lowered on the objects (``lower(x, g)``) once it is asked for."""

    call: Callable[..., Any] | None = None
    lower: Callable[..., Any] | None = None

    def jitted(self, params, x, g):
        del params
        return self.call(x, g)

    def hlo_text(self, x, g) -> str:
        if self.compiled is None:
            self.compiled = self.lower(x, g).compile()
        return self.compiled.as_text()


def nnx_cached_step(model, x, g) -> CachedStep:
    """The README's nnx step: ``@nnx.jit`` over the model, ``nnx.value_and_grad`` with
    ``argnums=fp8jax.nnx.diff_state(0)`` (and the input), bound to the model by
    ``nnx.cached_partial`` (nnx walks the model's graph once, not per call)."""
    from flax import nnx

    import fp8jax.nnx as fnnx

    @nnx.jit
    def step(model, x, g):
        def loss(model, x):
            return projection_loss(model(x), g)

        return nnx.value_and_grad(loss, argnums=(fnnx.diff_state(0), 1))(model, x)

    cached = nnx.cached_partial(step, model)
    _, (grads, _) = jax.block_until_ready(cached(x, g))
    fnnx.overwrite_state(model, grads)  # the cached objects share the model's variables
    return CachedStep(
        step, (), note="nnx.cached_partial", call=cached, lower=lambda x, g: step.lower(model, x, g)
    )
