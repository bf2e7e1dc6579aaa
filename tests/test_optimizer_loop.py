"""The usual equinox optimizer loop fails loudly on an FP8 model (`fp8jax._guard`): a NaN
loss that `fp8jax.check_state` explains (``FP8JAX_GUARD=nan``, the default, no device->host
sync) or an error (``FP8JAX_GUARD=raise``); the supported loops train as before."""

import re

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax
from fp8jax import _guard
from fp8jax._config import Fp8Config

CALLBACK = r"custom_call @\w*callback"  # a host callback in StableHLO text
CFG = Fp8Config(selective=False, amax_history_length=4, on_unsupported="silent")


def _model(seed=0):
    return fp8jax.fp8_linear_layers(eqx.nn.MLP(32, 16, 64, 2, key=jax.random.PRNGKey(seed)), CFG)


def _data(i):
    kx, ky = jax.random.split(jax.random.PRNGKey(i))
    return jax.random.normal(kx, (32, 32)), jax.random.normal(ky, (32, 16))


def _loss(m, x, y):
    return jnp.mean((jax.vmap(m)(x) - y) ** 2)


@pytest.fixture
def raise_mode(monkeypatch):
    """``FP8JAX_GUARD=raise`` (the mode is read at trace time; the fixture clears JAX's
    caches before and after)."""
    monkeypatch.setenv("FP8JAX_GUARD", "raise")


def _usual_loop(opt, steps, jit=True, losses=None):
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
        if losses is not None:
            losses.append(float(loss))
    return model


def _assert_trained_message(text):
    assert "fp8jax.optax_step" in text, text
    assert "partition_for_grad_overwrite" in text and "trainable" in text
    assert "changed by an optimizer" in text


OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-3),
    "sgd": lambda: optax.sgd(1e-3),
    "clip+adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_usual_loop_gives_nan_by_the_second_step(name):
    """Default mode (nan): the step after the optimizer trained the state gives a NaN loss,
    and `fp8jax.check_state` says why."""
    losses = []
    model = _usual_loop(OPTIMIZERS[name](), 3, losses=losses)
    assert np.isfinite(losses[0]) and np.isnan(losses[1]) and np.isnan(losses[2]), losses
    with pytest.raises(ValueError) as info:
        fp8jax.check_state(model)
    _assert_trained_message(str(info.value))
    assert str(info.value).startswith("fp8jax.check_state: FP8 state at .layers[0]")


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_usual_loop_fails_by_the_second_step(name, raise_mode):
    opt = OPTIMIZERS[name]()
    _usual_loop(opt, 1)  # the first step runs (the state is still valid)
    with pytest.raises(Exception, match="fp8jax.optax_step") as info:
        _usual_loop(opt, 2)
    _assert_trained_message(str(info.value))


def test_usual_loop_fails_eagerly_too(raise_mode):
    with pytest.raises(Exception, match="fp8jax.optax_step"):
        _usual_loop(optax.adam(1e-4), 2, jit=False)


def test_usual_loop_eagerly_in_nan_mode():
    """Without jit, under ``eqx.filter_value_and_grad`` the guards are tracers: the loss is
    NaN; where an op sees its guard concrete (a plain call) it raises at once."""
    losses = []
    model = _usual_loop(optax.adam(1e-4), 2, jit=False, losses=losses)
    assert np.isfinite(losses[0]) and np.isnan(losses[1]), losses
    with pytest.raises(ValueError) as info:
        jax.vmap(model)(_data(0)[0])
    _assert_trained_message(str(info.value))
    with pytest.raises(ValueError, match="changed by an optimizer"):
        fp8jax.check_state(model)


def test_guard_mode_is_checked(monkeypatch):
    monkeypatch.setenv("FP8JAX_GUARD", "loud")
    with pytest.raises(ValueError, match="FP8JAX_GUARD='loud' is not allowed") as info:
        eqx.filter_jit(_loss)(_model(), *_data(0))
    assert all(m in str(info.value) for m in ("nan", "raise", "off"))


def test_off_mode_neither_checks_nor_poisons(monkeypatch):
    monkeypatch.setenv("FP8JAX_GUARD", "off")
    losses = []
    model = _usual_loop(optax.adam(1e-3), 2, losses=losses)
    assert np.all(np.isfinite(losses)), losses
    with pytest.raises(ValueError, match="changed by an optimizer"):
        fp8jax.check_state(model)  # the host-side check works in every mode


def test_nan_mode_output_is_bit_identical(monkeypatch):
    """The poison added to a valid layer's output is -0.0: an exact identity. The loss is
    bit-identical; the gradients too on the CPU. On a GPU the added op moves XLA's fusions,
    which reorders float32 sums in the backward (seen: 1e-8 apart, 2.5e-6 relative)."""
    model, (x, y) = _model(), _data(0)
    fn = eqx.filter_jit(eqx.filter_value_and_grad(_loss))
    loss, grads = fn(model, x, y)
    monkeypatch.setenv("FP8JAX_GUARD", "off")
    jax.clear_caches()  # the mode is read at trace time
    loss_off, grads_off = fn(model, x, y)
    assert float(loss) == float(loss_off)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads_off)):
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _primitives(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


def test_nan_mode_step_has_no_cond_or_callback(monkeypatch):
    """The default mode adds no ``lax.cond`` and no host callback to a training step (no
    device->host sync); ``raise`` mode does."""
    model, opt = _model(), optax.adamw(1e-3)
    opt_state = opt.init(fp8jax.trainable(model))

    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
        return fp8jax.optax_step(opt, model, grads, opt_state), loss

    def acc_step(model, x, y):
        acc = fp8jax.accumulate_grads(None, eqx.filter_grad(_loss)(model, x, y))
        return fp8jax.accumulate_grads(acc, eqx.filter_grad(_loss)(model, x, y))

    for fn, args in ((step, (model, opt_state)), (acc_step, (model,))):
        jaxpr = eqx.filter_make_jaxpr(fn)(*args, *_data(0))[0]
        names = _primitives(jaxpr.jaxpr)
        assert not [n for n in names if "cond" in n or "callback" in n], sorted(names)
        text = eqx.filter_jit(fn).lower(*args, *_data(0)).as_text()
        assert "stablehlo.case" not in text and "stablehlo.if" not in text
        # a host callback is a custom call (a kernel's serialized source names this test)
        assert not re.search(CALLBACK, text)
    (model, opt_state), loss = eqx.filter_jit(step)(model, opt_state, *_data(0))
    assert np.isfinite(float(loss)) and fp8jax.check_state(model) is None
    monkeypatch.setenv("FP8JAX_GUARD", "raise")
    jax.clear_caches()
    text = eqx.filter_jit(step).lower(model, opt_state, *_data(0)).as_text()
    assert re.search(CALLBACK, text)  # the check above can see one


def test_raise_mode_step_has_conds(raise_mode):
    model = _model()
    names = _primitives(eqx.filter_make_jaxpr(eqx.filter_grad(_loss))(model, *_data(0))[0].jaxpr)
    assert "cond" in names


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
    assert fp8jax.check_state(model) is None


def test_verdict_is_a_pure_function():
    good = jnp.full((3, 1), 2.0**-19)
    assert not bool(_guard.verdict([good])[0])
    bad, index = _guard.verdict([good, jnp.array([2.0**-20 + 1e-6])])
    assert bool(bad) and int(index) == 0
    bad, index = _guard.verdict([jnp.array([0.0])])
    assert bool(bad) and int(index) == 1
    assert bool(_guard.verdict([jnp.array([jnp.nan])])[0])
    # The cycle; a negative guard (a code written under jit, mode nan) stays.
    np.testing.assert_array_equal(
        _guard.advance(jnp.array([*_guard.VALUES, -1.0, -5.0])),
        [2.0**-19, 2.0**-18, 2.0**-17, 2.0**-20, -1.0, -5.0],
    )


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


@pytest.mark.parametrize("mode", ["nan", "raise"])
@pytest.mark.parametrize("entered", [False, True])
def test_scan_over_stacked_layers_usual_loop_fails(entered, mode, monkeypatch):
    monkeypatch.setenv("FP8JAX_GUARD", mode)
    layers, loss = _stacked(entered)
    x = jax.random.normal(jax.random.PRNGKey(4), (16, 32))
    opt = optax.sgd(1e-2)
    s = opt.init(eqx.filter(layers, eqx.is_inexact_array))
    grads = eqx.filter_jit(eqx.filter_grad(loss))(layers, x)
    assert grads.dot_general.guard.shape == (3, 1)
    updates, s = opt.update(grads, s)
    layers = eqx.apply_updates(layers, updates)
    value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    if mode == "raise":
        with pytest.raises(Exception, match="fp8jax.optax_step"):
            jax.block_until_ready(value_and_grad(layers, x))
        return
    value, grads = value_and_grad(layers, x)
    assert np.isnan(float(value)) and np.isnan(np.asarray(grads.weight)).all()
    with pytest.raises(ValueError, match="fp8jax.optax_step"):
        fp8jax.check_state(layers)


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
def test_enter_state_checks_once_per_stack(entered, monkeypatch):
    """Mode raise: with the state entered before the scan, the ops inside it do not check
    again: one check (a ``cond``) for the whole stack, outside the loop; else one per layer
    inside. Mode nan (the default): no ``cond`` at all."""
    layers, loss = _stacked(entered)
    params, static = eqx.partition(layers, eqx.is_array)
    fn = jax.grad(lambda p, x: loss(eqx.combine(p, static), x))
    x = jnp.ones((16, 32))
    assert _checks(fn, params, x) == 0
    assert _checks(fn, params, x, in_loops=True) == 0
    monkeypatch.setenv("FP8JAX_GUARD", "raise")
    jax.clear_caches()  # the mode is read at trace time
    assert _checks(fn, params, x) == (1 if entered else 0)
    assert _checks(fn, params, x, in_loops=True) == (0 if entered else 1)


@pytest.mark.parametrize("mode", ["nan", "raise"])
def test_weight_tying_checks_once_and_trains_as_before(mode, monkeypatch):
    monkeypatch.setenv("FP8JAX_GUARD", mode)
    lin = fp8jax.nn.Linear(32, 32, key=jax.random.PRNGKey(5), config=CFG)
    x = jax.random.normal(jax.random.PRNGKey(6), (16, 32))

    def loss(layer, x):
        return jnp.mean(layer(jnp.tanh(layer(x))) ** 2)

    params, static = eqx.partition(lin, eqx.is_array)
    checks = _checks(jax.grad(lambda p: loss(eqx.combine(p, static), x)), params)
    assert checks == (1 if mode == "raise" else 0)
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
    assert fp8jax.check_state(model) is None
    assert np.isfinite(float(_loss(model, *_data(99))))


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
    assert np.isfinite(float(_loss(model, *_data(1))))
    assert fp8jax.check_state(model) is None


def _usual_loop_is_loud(model, loss, guard, mode):
    """``fp8jax.optax_step`` keeps ``guard(model)`` cycling over three steps with finite
    losses; the usual equinox loop (plain Adam, which a zero guard gradient would not move)
    runs its first step, then gives a NaN loss and `fp8jax.check_state`'s message (mode
    ``nan``) or raises (``raise``)."""
    opt = optax.adam(1e-3)

    @eqx.filter_jit
    def usual(m, s):
        value, grads = eqx.filter_value_and_grad(loss)(m)
        updates, s = opt.update(grads, s, eqx.filter(m, eqx.is_inexact_array))
        return eqx.apply_updates(m, updates), s, value

    @eqx.filter_jit
    def supported(m, s):
        value, grads = eqx.filter_value_and_grad(loss)(m)
        m, s = fp8jax.optax_step(opt, m, grads, s)
        return m, s, value

    m, s, guards = model, opt.init(fp8jax.trainable(model)), []
    for _ in range(3):
        m, s, value = supported(m, s)
        assert np.isfinite(float(value))
        guards.append(float(guard(m)[0]))
    assert len(set(guards)) == 3, guards  # cycling
    fp8jax.check_state(m)
    m, s = model, opt.init(eqx.filter(model, eqx.is_inexact_array))
    m, s, value = usual(m, s)  # the first step runs: the state is still valid
    assert np.isfinite(float(value))
    if mode == "nan":
        assert np.isnan(float(usual(m, s)[2]))
        with pytest.raises(ValueError, match="changed by an optimizer"):
            fp8jax.check_state(usual(m, s)[0])
    else:
        with pytest.raises(Exception, match="fp8jax.optax_step"):
            jax.block_until_ready(usual(m, s)[2])


@pytest.mark.parametrize("mode", ["nan", "raise"])
def test_usual_loop_fails_on_the_gated_mlp_core_too(mode, monkeypatch):
    """`FusedMLP` on its gated core (what runs on Hopper; here with its plain-JAX activation)
    checks its linears' guards as `fp8jax.Fp8DotGeneral` does (before, the core never read
    its guards and the loop trained the state silently)."""
    from fp8jax._kernels.gated_activation import tuning
    from fp8jax.nn import _mlp_paths

    monkeypatch.setenv("FP8JAX_GUARD", mode)
    mlp = fp8jax.nn.FusedMLP(64, 128, residual=True, fp8=False, key=jax.random.PRNGKey(0))
    mlp = fp8jax.fp8_linear_layers(mlp, CFG)
    x = jax.random.normal(jax.random.PRNGKey(1), (256, 64), jnp.bfloat16)
    with tuning(activation="xla"):
        assert _mlp_paths._gated_core_runs(mlp, x)
        _usual_loop_is_loud(
            mlp, lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2),
            lambda m: m.fc1.dot_general.guard, mode,
        )  # fmt: skip


@pytest.mark.parametrize("mode", ["nan", "raise"])
def test_usual_loop_fails_on_an_fp8_attention_state(mode, monkeypatch):
    """A model whose only FP8 part is attention: its `Fp8AttentionState` carries a guard as
    `fp8jax.Fp8DotGeneral` does (before, the usual loop trained its scales and histories
    silently)."""
    monkeypatch.setenv("FP8JAX_GUARD", mode)

    class Model(eqx.Module):
        proj: eqx.nn.Linear
        attn: fp8jax.nn.DotProductAttention

        def __call__(self, x):  # x [B, T, 32] -> q = k = v, 2 heads of 16
            h = jax.vmap(jax.vmap(self.proj))(x).reshape(x.shape[:2] + (2, 16))
            return self.attn(h, h, h)

    model = Model(
        eqx.nn.Linear(32, 32, key=jax.random.PRNGKey(0)),
        fp8jax.nn.DotProductAttention("fp8_dpa", is_causal=True, backend="reference"),
    )
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 64, 32))
    _usual_loop_is_loud(
        model, lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2), lambda m: m.attn.state.guard,
        mode,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["nan", "raise"])
def test_usual_loop_fails_on_a_grouped_experts_state(mode, monkeypatch):
    """A model whose only FP8 part is its experts (`fp8jax.nn.GroupedLinear`): the
    `Fp8GroupedState` carries a guard (before, the usual loop trained it silently)."""
    monkeypatch.setenv("FP8JAX_GUARD", mode)
    experts = fp8jax.nn.GroupedLinear(4, 32, 32, key=jax.random.PRNGKey(0), config=CFG)
    x = jax.random.normal(jax.random.PRNGKey(1), (256, 32))
    sizes = jnp.asarray([64, 32, 96, 64], jnp.int32)
    _usual_loop_is_loud(
        experts, lambda m: jnp.mean(m(x, sizes).astype(jnp.float32) ** 2),
        lambda m: m.fp8_state.guard, mode,
    )  # fmt: skip


def test_attention_state_without_a_guard_still_runs():
    """An `Fp8AttentionState` built before it had a guard (``guard=None``) runs unchecked."""
    attn = fp8jax.nn.DotProductAttention("fp8_dpa", is_causal=True, backend="reference")
    old = eqx.tree_at(lambda a: a.state.guard, attn, None, is_leaf=lambda x: x is None)
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 32, 2, 16))
    np.testing.assert_array_equal(old(q, q, q), attn(q, q, q))

