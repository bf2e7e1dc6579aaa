"""The usual equinox optimizer loop fails loudly on an FP8 model (`fp8jax._guard`); the
supported loops train as before."""

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax
from fp8jax import _guard
from fp8jax.config import Fp8Config

CFG = Fp8Config(selective=False, amax_history_length=4, on_unsupported="silent")


def _model(seed=0):
    return fp8jax.fp8_linear_layers(eqx.nn.MLP(32, 16, 64, 2, key=jax.random.PRNGKey(seed)), CFG)


def _data(i):
    kx, ky = jax.random.split(jax.random.PRNGKey(i))
    return jax.random.normal(kx, (32, 32)), jax.random.normal(ky, (32, 16))


def _loss(m, x, y):
    return jnp.mean((jax.vmap(m)(x) - y) ** 2)


def _usual_loop(opt, steps, jit=True):
    """The equinox loop of the README's warning: the optimizer sees the FP8 state."""
    model = _model()
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))

    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = opt.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    step = eqx.filter_jit(step) if jit else step
    for i in range(steps):
        model, opt_state, loss = step(model, opt_state, *_data(i))
        jax.block_until_ready(loss)
    return model


OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-3),
    "sgd": lambda: optax.sgd(1e-3),
    "clip+adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_usual_loop_fails_by_the_second_step(name):
    opt = OPTIMIZERS[name]()
    _usual_loop(opt, 1)  # the first step runs (the state is still valid)
    with pytest.raises(Exception, match="fp8jax.optax_step") as info:
        _usual_loop(opt, 2)
    text = str(info.value)
    assert "partition_for_grad_overwrite" in text and "trainable" in text
    assert "changed by an optimizer" in text


def test_usual_loop_fails_eagerly_too():
    with pytest.raises(Exception, match="fp8jax.optax_step"):
        _usual_loop(optax.adam(1e-4), 2, jit=False)


def test_warmup_learning_rate_is_detected():
    """A warmup's first tiny learning rate already moves the guard (a small power of 2)."""
    model = _usual_loop(optax.adam(optax.linear_schedule(1e-8, 1e-3, 1000)), 1)
    bad, _ = _guard.verdict([s.guard for _, s in fp8jax.fp8_state(model)])
    assert bool(bad)


def test_optax_step_keeps_guards_valid_and_cycling():
    model, opt = _model(), optax.adamw(1e-3)
    opt_state = opt.init(fp8jax.trainable(model))
    step = eqx.filter_jit(
        lambda m, s, x, y: fp8jax.optax_step(opt, m, eqx.filter_grad(_loss)(m, x, y), s)
    )
    seen = []
    for i in range(5):
        model, opt_state = step(model, opt_state, *_data(i))
        seen.append(float(fp8jax.fp8_state(model)[0][1].guard[0]))
    assert seen == [2.0**-19, 2.0**-18, 2.0**-17, 2.0**-20, 2.0**-19]
    bad, _ = _guard.verdict([s.guard for _, s in fp8jax.fp8_state(model)])
    assert not bool(bad)


def test_verdict_is_a_pure_function():
    good = jnp.full((3, 1), 2.0**-19)
    assert not bool(_guard.verdict([good])[0])
    bad, index = _guard.verdict([good, jnp.array([2.0**-20 + 1e-6])])
    assert bool(bad) and int(index) == 0
    bad, index = _guard.verdict([jnp.array([0.0])])
    assert bool(bad) and int(index) == 1
    assert bool(_guard.verdict([jnp.array([jnp.nan])])[0])


def _stacked(entered: bool):
    lin = eqx.filter_vmap(lambda k: eqx.nn.Linear(32, 32, key=k))(
        jax.random.split(jax.random.PRNGKey(3), 3)
    )
    layers = fp8jax.nn.Linear.from_linear(lin, CFG)

    def loss(layers, x):
        tree = fp8jax.enter_state(layers) if entered else layers
        params, static = eqx.partition(tree, eqx.is_array)

        def body(h, p):
            return jnp.tanh(eqx.combine(p, static)(h)), None

        return jnp.mean(jax.lax.scan(body, x, params)[0] ** 2)

    return layers, loss


@pytest.mark.parametrize("entered", [False, True])
def test_scan_over_stacked_layers_usual_loop_fails(entered):
    layers, loss = _stacked(entered)
    x = jax.random.normal(jax.random.PRNGKey(4), (16, 32))
    opt = optax.sgd(1e-2)
    s = opt.init(eqx.filter(layers, eqx.is_inexact_array))
    grads = eqx.filter_jit(eqx.filter_grad(loss))(layers, x)
    assert grads.dot_general.guard.shape == (3, 1)
    updates, s = opt.update(grads, s)
    layers = eqx.apply_updates(layers, updates)
    with pytest.raises(Exception, match="fp8jax.optax_step"):
        jax.block_until_ready(eqx.filter_jit(eqx.filter_grad(loss))(layers, x))


def _checks(fn, *args, in_loops=False):
    """How many guard checks (``cond``s) ``fn``'s jaxpr holds outside loops (or inside)."""

    def count(jaxpr, inside):
        n = 0
        for eqn in jaxpr.eqns:
            loop = eqn.primitive.name in ("scan", "while")
            if eqn.primitive.name == "cond" and inside == in_loops:
                n += 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                n += count(sub, inside or loop)
        return n

    return count(jax.make_jaxpr(fn)(*args).jaxpr, False)


@pytest.mark.parametrize("entered", [False, True])
def test_enter_state_checks_once_per_stack(entered):
    """With the state entered before the scan, the ops inside it do not check again: one
    check (a ``cond``) for the whole stack, outside the loop; else one per layer inside."""
    layers, loss = _stacked(entered)
    params, static = eqx.partition(layers, eqx.is_array)
    fn = jax.grad(lambda p, x: loss(eqx.combine(p, static), x))
    x = jnp.ones((16, 32))
    assert _checks(fn, params, x) == (1 if entered else 0)
    assert _checks(fn, params, x, in_loops=True) == (0 if entered else 1)


def test_weight_tying_checks_once_and_trains_as_before():
    lin = fp8jax.nn.Linear(32, 32, key=jax.random.PRNGKey(5), config=CFG)
    x = jax.random.normal(jax.random.PRNGKey(6), (16, 32))

    def loss(layer, x):
        return jnp.mean(layer(jnp.tanh(layer(x))) ** 2)

    params, static = eqx.partition(lin, eqx.is_array)
    assert _checks(jax.grad(lambda p: loss(eqx.combine(p, static), x)), params) == 1
    grads = eqx.filter_grad(loss)(lin, x)
    np.testing.assert_array_equal(grads.dot_general.guard, [2.0**-19])  # max, not a sum


def test_accumulate_and_multisteps_keep_guards_exact():
    model = _model()
    opt = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    s = opt.init(fp8jax.trainable(model))
    for i in range(3):
        acc = None
        for j in range(2):
            acc = fp8jax.accumulate_grads(acc, eqx.filter_grad(_loss)(model, *_data(10 * i + j)))
        model, s = fp8jax.optax_step(opt, model, fp8jax.scale_grads(acc, 0.5), s)
    bad, _ = _guard.verdict([st.guard for _, st in fp8jax.fp8_state(model)])
    assert not bool(bad)
    jax.block_until_ready(_loss(model, *_data(99)))


def test_guardless_state_still_runs():
    """A state without a guard (the adapters' `from_state`, older models) is unchecked."""
    model = _model()
    model = jax.tree_util.tree_map(
        lambda x: eqx.tree_at(lambda s: s.guard, x, None) if hasattr(x, "guard") else x,
        model,
        is_leaf=lambda x: isinstance(x, fp8jax.Fp8DotGeneral),
    )
    opt = optax.adam(1e-3)
    s = opt.init(fp8jax.trainable(model))
    grads = eqx.filter_grad(_loss)(model, *_data(0))
    model, s = fp8jax.optax_step(opt, model, grads, s)
    jax.block_until_ready(_loss(model, *_data(1)))
