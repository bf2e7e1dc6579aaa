"""The front doors of `benchmarks.front_doors`: one MLP (``layers`` x ``dim``, gelu between)
through equinox, flax linen, flax nnx (``jax.jit`` over split state, the README's
``@nnx.jit``, and that step under ``nnx.cached_partial``) and haliax, each with that
framework's usual train step (adam, the FP8 state handled as its docs say). Each builder
returns ``(state, step)`` with ``step(state, x) -> (state, loss)``, pure (``nnx-jit``,
``nnx-cached``: mutable objects and their step)."""

from __future__ import annotations

from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import fp8jax
from benchmarks import common
from fp8jax.inspect import parse_gemms, parse_stablehlo_gemms

BF16, F32 = jnp.bfloat16, jnp.float32
LR = 1e-4


class Skip(RuntimeError):
    """A front door cannot run here (its framework is missing): one line, no row."""


def mse_loss(y) -> jax.Array:
    return jnp.mean(jnp.square(y.astype(F32)))


# ----------------------------------------------------------------------------- doors
# Each builder returns (state, step) with ``step(state, x) -> (state, loss)``, pure.
def _cast_params(model, dtype):
    """``model`` with its trainable arrays (not the FP8 state) cast to ``dtype``."""
    cast = jax.tree_util.tree_map(lambda a: a.astype(dtype), fp8jax.trainable(model))
    return eqx.combine(cast, model)


def _eqx_step(model, param_dtype, cast: bool = True) -> tuple[Any, Callable]:
    """The README's equinox step on any equinox model (``model(x)`` on ``[T, D]``); ``cast``:
    non-bf16 parameters are cast to bf16 in the forward (else the model computes in its
    input's dtype itself, as `fp8jax.nn.Linear` does: its FP8 cast reads the f32 weight)."""
    opt = optax.adam(LR)
    params, static = eqx.partition(model, eqx.is_array)

    def loss_fn(model, x):
        if cast and param_dtype != BF16:
            model = _cast_params(model, BF16)
        return mse_loss(model(x))

    def step(state, x):
        params, opt_state = state
        model = eqx.combine(params, static)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x)
        model, opt_state = fp8jax.optax_step(opt, model, grads, opt_state)
        return (eqx.filter(model, eqx.is_array), opt_state), loss

    return (params, opt.init(fp8jax.trainable(model))), step


class EqxMLP(eqx.Module):
    layers: list

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = jax.vmap(layer)(x)
            if i < len(self.layers) - 1:
                x = jax.nn.gelu(x)
        return x


def build_equinox(dim, layers, param_dtype, config, key):
    keys = jax.random.split(key, layers)
    model = EqxMLP([eqx.nn.Linear(dim, dim, dtype=param_dtype, key=k) for k in keys])
    if config is not None:
        model = fp8jax.fp8_linear_layers(model, config)
    return _eqx_step(model, param_dtype, cast=config is None)


class HaliaxMLP(eqx.Module):
    layers: list

    def __call__(self, x):  # x [T, D]: named (batch, embed) here
        import haliax as hax

        x = hax.named(x, (hax.Axis("batch", x.shape[0]), self.layers[0].In))
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = hax.nn.gelu(x)
        return x.array


def build_haliax(dim, layers, param_dtype, config, key):
    try:
        import haliax as hax
    except ImportError as e:
        raise Skip(f"haliax not installed ({e})") from None
    axes = [hax.Axis("embed", dim)] + [hax.Axis(f"hidden{i}", dim) for i in range(layers - 1)]
    axes.append(axes[0])
    keys = jax.random.split(key, layers)
    mlp = HaliaxMLP([hax.nn.Linear.init(axes[i], axes[i + 1], key=keys[i]) for i in range(layers)])
    mlp = jax.tree_util.tree_map(lambda a: a.astype(param_dtype), mlp)
    if config is not None:
        mlp = fp8jax.fp8_linear_layers(mlp, config)
    return _eqx_step(mlp, param_dtype)


def build_linen(dim, layers, param_dtype, config, key):
    import flax.linen as nn
    from flax.training.train_state import TrainState

    cls = None if config is None else fp8jax.flax.fp8_dot_general_cls(config)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(layers):
                kw = {} if cls is None else dict(dot_general_cls=cls)
                x = nn.Dense(dim, dtype=BF16, param_dtype=param_dtype, **kw)(x)
                if i < layers - 1:
                    x = nn.gelu(x)
            return x

    model = MLP()
    variables = model.init(key, jnp.zeros((8, dim), BF16))
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(LR))

    def step(state, x):
        loss, grads = jax.value_and_grad(lambda v: mse_loss(state.apply_fn(v, x)))(state.params)
        # flax's TrainState: the optimizer on "params", "_overwrite_with_gradient" overwritten.
        return state.apply_gradients(grads=grads), loss

    return state, step


def build_nnx(dim, layers, param_dtype, config, key, objects=False):
    from flax import nnx

    rngs = nnx.Rngs(key)

    class MLP(nnx.Module):
        def __init__(self):
            self.layers = nnx.List(
                [
                    nnx.Linear(dim, dim, dtype=BF16, param_dtype=param_dtype, rngs=rngs)
                    for _ in range(layers)
                ]
            )

        def __call__(self, x):
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i < layers - 1:
                    x = nnx.gelu(x)
            return x

    model = MLP()
    if config is not None:
        fp8jax.nnx.fp8_linear_layers(model, config)
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    if objects:
        return model, optimizer
    graphdef, state = nnx.split((model, optimizer))

    def step(state, x):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(
            lambda m: mse_loss(m(x)), argnums=fp8jax.nnx.diff_state(0)
        )(model)
        fp8jax.nnx.update(model, optimizer, grads)  # Params: optimizer; Fp8State: overwrite
        return nnx.state((model, optimizer)), loss

    return state, step


def build_nnx_jit(dim, layers, param_dtype, config, key):
    """The nnx step exactly as the README writes it: ``@nnx.jit`` over the model and the
    optimizer objects (nnx's per-call graph traversal included in the time)."""
    from flax import nnx

    model, optimizer = build_nnx(dim, layers, param_dtype, config, key, objects=True)

    @nnx.jit
    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(
            lambda m: mse_loss(m(x)), argnums=fp8jax.nnx.diff_state(0)
        )(model)
        fp8jax.nnx.update(model, optimizer, grads)
        return loss

    return (model, optimizer), step


def build_nnx_cached(dim, layers, param_dtype, config, key):
    """The README's ``@nnx.jit`` step bound to its objects with ``nnx.cached_partial`` (flax's
    remedy for per-call graph traversal: the objects' structure is cached, not re-walked)."""
    from flax import nnx

    (model, optimizer), step = build_nnx_jit(dim, layers, param_dtype, config, key)
    cached = nnx.cached_partial(step, model, optimizer)
    cached.lower = lambda x: step.lower(model, optimizer, x)  # its program, for the census
    return (), cached


BUILDERS = dict(
    equinox=build_equinox,
    linen=build_linen,
    nnx=build_nnx,
    haliax=build_haliax,
    **{"nnx-jit": build_nnx_jit, "nnx-cached": build_nnx_cached},
)


def count_gemms(lowered, compiled=None) -> tuple[int, int]:
    """(FP8 GEMMs, all GEMMs) of a step: its compiled program on a GPU, the lowered one
    elsewhere (a CPU's XLA rewrites FP8 dots into f32 ones)."""
    if common.on_gpu():
        found = parse_gemms((compiled or lowered.compile()).as_text())
    else:
        found = parse_stablehlo_gemms(lowered.as_text())
    return sum(g.is_fp8 for g in found), len(found)


class ObjectCase:
    """A step that takes mutable objects (``nnx.jit``, ``nnx.cached_partial``): timed as
    called; its GEMMs read from the program its ``lower`` gives for the objects."""

    def __init__(self, objects, step, x):
        self.objects, self.step, self.x = objects, step, x
        self.state = objects
        self.run(x)

    def run(self, x):
        return self.step(*self.objects, x)

    def gemms(self) -> tuple[int, int]:
        return count_gemms(self.step.lower(*self.objects, self.x))

    def peak_mem_mb(self) -> None:
        return None
