"""flax nnx adapter: the same numbers as the equinox path, state kept out of nnx.Optimizer."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax
from helpers import normal, sqnr_db

nnx = pytest.importorskip("flax.nnx")
import fp8jax.nnx as fp8nnx  # noqa: E402
from fp8jax._state import STATE_FIELDS  # noqa: E402

CFG = fp8jax.Fp8Config(selective=False, amax_history_length=8)
D_IN, HIDDEN, D_OUT, ROWS = 32, 64, 16, 32


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(D_IN, HIDDEN, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, D_OUT, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


class EqxMLP(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def _eqx_twin(model: NnxMLP) -> EqxMLP:
    """An equinox MLP with ``model``'s weights (eqx [out, in] = nnx kernel [in, out].T)."""

    def linear(layer):
        lin = eqx.nn.Linear(layer.in_features, layer.out_features, key=jax.random.PRNGKey(0))
        lin = eqx.tree_at(lambda m: m.weight, lin, layer.kernel[...].T)
        return eqx.tree_at(lambda m: m.bias, lin, layer.bias[...])

    return EqxMLP(linear(model.up), linear(model.down))


def _nnx_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def _eqx_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)  # fp8jax.nn.Linear takes leading dims


def _batches(key, n=3):
    keys = jax.random.split(key, 2 * n)
    return [
        (normal(keys[2 * i], (ROWS, D_IN), scale=1.0 + i), normal(keys[2 * i + 1], (ROWS, D_OUT)))
        for i in range(n)
    ]


def _close(a, b, what, rtol=1e-5):
    a, b = np.asarray(a), np.asarray(b)
    atol = rtol * max(float(np.max(np.abs(b))), 1e-30)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=what)


def test_matches_equinox_path_over_three_steps(key):
    # Measured on CPU: loss and FP8 state equal, gradients and weights within 7e-8 of
    # their max (the kernels' layouts differ: nnx [in, out], equinox [out, in]).
    model = NnxMLP(nnx.Rngs(0))
    twin = fp8jax.fp8_linear_layers(_eqx_twin(model), CFG)
    model, report = fp8nnx.fp8_linear_layers(model, CFG, return_report=True)
    assert report.converted == ["down", "up"], report

    tx = optax.adam(1e-2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    opt_state = tx.init(fp8jax.trainable(twin))

    @nnx.jit
    def nnx_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(_nnx_loss, argnums=fp8nnx.diff_state(0))(model, x, y)
        fp8nnx.update(model, optimizer, grads)
        return loss, grads

    @eqx.filter_jit
    def eqx_step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(_eqx_loss)(model, x, y)
        model, opt_state = fp8jax.optax_step(tx, model, grads, opt_state)
        return loss, grads, model, opt_state

    for step, (x, y) in enumerate(_batches(key)):
        loss, grads = nnx_step(model, optimizer, x, y)
        eloss, egrads, twin, opt_state = eqx_step(twin, opt_state, x, y)
        _close(loss, eloss, f"loss, step {step}", rtol=1e-6)
        for name in ("up", "down"):
            g, e = getattr(grads, name), getattr(egrads, name)
            _close(g.kernel[...], e.weight.T, f"{name} kernel grad, step {step}")
            _close(g.bias[...], e.bias, f"{name} bias grad, step {step}")
            for field in STATE_FIELDS:  # the new state, as the gradient
                got = getattr(g.dot_general, field)[...]
                want = getattr(e.dot_general, field)
                _close(got, want, f"{name}.{field} grad, step {step}", rtol=1e-6)

    for name in ("up", "down"):
        layer, e = getattr(model, name), getattr(twin, name)
        _close(layer.kernel[...], e.weight.T, f"{name} kernel after 3 steps")
        _close(layer.bias[...], e.bias, f"{name} bias after 3 steps")
        for field in STATE_FIELDS:
            got = getattr(layer.dot_general, field)[...]
            want = getattr(e.dot_general, field)
            _close(got, want, f"{name}.{field} after 3 steps", rtol=1e-6)


def test_state_rolls_and_stays_out_of_the_optimizer(key):
    model = fp8nnx.fp8_linear_layers(NnxMLP(nnx.Rngs(1)), CFG)
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    # The optimizer's state mirrors the 4 params (adam: mu and nu), no FP8 state.
    opt_leaves = nnx.to_flat_state(nnx.state(optimizer.opt_state))
    assert not any("dot_general" in map(str, path) for path, _ in opt_leaves)
    assert not any(isinstance(v, fp8nnx.Fp8State) for _, v in opt_leaves)
    assert not nnx.to_flat_state(nnx.state(model, nnx.All(nnx.Param, fp8nnx.Fp8State)))

    @nnx.jit
    def step(model, optimizer, x, y):
        grads = nnx.grad(_nnx_loss, argnums=fp8nnx.diff_state(0))(model, x, y)
        fp8nnx.update(model, optimizer, grads)

    batches = _batches(key)
    for x, y in batches:
        step(model, optimizer, x, y)
    hist = np.asarray(model.up.dot_general.input_amax_history[...])
    amaxes = [float(jnp.max(jnp.abs(x))) for x, _ in batches]
    # flax's layout: rolled each step, newest at index 0, then back from the end.
    np.testing.assert_array_equal(hist[[0, -1, -2]], np.float32(amaxes[::-1]))
    assert not hist[1:-2].any()
    newest_first = model.up.dot_general.ordered_amax_history("input")
    np.testing.assert_array_equal(newest_first[:3], np.float32(amaxes[::-1]))
    assert float(model.up.dot_general.input_scale[0]) != 1.0  # delayed scale has moved
    assert int(optimizer.step[...]) == 3


def test_readmes_cached_partial_step_matches_the_nnx_jit_step(key):
    """The README's step under ``nnx.cached_partial`` updates the same model and optimizer
    objects as calling the ``@nnx.jit`` step with them: same state and parameters after three
    steps, bit for bit."""

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(_nnx_loss, argnums=fp8nnx.diff_state(0))(model, x, y)
        fp8nnx.update(model, optimizer, grads)
        return loss

    models = [fp8nnx.fp8_linear_layers(NnxMLP(nnx.Rngs(1)), CFG) for _ in range(2)]
    optimizers = [nnx.Optimizer(m, optax.adam(1e-3), wrt=nnx.Param) for m in models]
    cached = nnx.cached_partial(step, models[1], optimizers[1])
    for x, y in _batches(key):
        step(models[0], optimizers[0], x, y)
        cached(x, y)
    plain, fast = (nnx.to_flat_state(nnx.state(m)) for m in models)
    assert len(plain) == len(fast) > 0
    for (path, a), (_, b) in zip(plain, fast):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
    assert float(models[1].up.dot_general.input_scale[0]) != 1.0  # it trained the state
    assert int(optimizers[1].step[...]) == 3


def test_train_step_gemms_all_fp8(key):
    model = fp8nnx.fp8_linear_layers(NnxMLP(nnx.Rngs(2)), CFG)
    graphdef, state = nnx.split(model)
    x, y = _batches(key, 1)[0]

    def grads(state, x, y):
        model = nnx.merge(graphdef, state)
        return nnx.grad(_nnx_loss, argnums=fp8nnx.diff_state(0))(model, x, y)

    report = fp8jax.fp8_gemm_report(grads, state, x, y, stage="lowered")
    assert len(report.gemms) == 6 and report.all_fp8, report


def test_linear_general_and_einsum(key):
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.gen = nnx.LinearGeneral((2, 16), (2, 16), axis=(-2, -1), rngs=rngs)
            self.ein = nnx.Einsum("btd,dh->bth", (32, 48), (48,), rngs=rngs)
            self.small = nnx.Linear(32, 8, rngs=rngs)

        def __call__(self, x):  # x: [b, t, 32]
            return self.gen(x.reshape(*x.shape[:-1], 2, 16)), self.ein(x), self.small(x)

    x = normal(key, (2, 16, 32))
    plain = Model(nnx.Rngs(3))
    ref = plain(x)
    model, report = fp8nnx.fp8_linear_layers(Model(nnx.Rngs(3)), CFG, return_report=True)
    assert report.converted == ["ein", "gen"]
    assert report.skipped == {"small": "in=32, out=8 not multiples of 16"}
    assert isinstance(model.ein.einsum_op, fp8nnx.Fp8EinsumOp)
    for got, want in zip(model(x)[:2], ref[:2], strict=True):
        assert sqnr_db(got, want) >= 20.0
    grads = nnx.grad(lambda m: sum(jnp.sum(o**2) for o in m(x)), argnums=fp8nnx.diff_state(0))(
        model
    )
    fp8nnx.overwrite_state(model, grads)
    for op in (model.gen.dot_general, model.ein.einsum_op):
        assert float(op.input_amax_history[0]) == pytest.approx(float(jnp.max(jnp.abs(x))))
        assert float(op.kernel_amax_history[0]) > 0


def test_selection_policy_and_errors():
    class Wide(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(32, 32, rngs=rngs)
            self.b = nnx.Linear(32, 32, rngs=rngs)

        def __call__(self, x):
            return self.b(self.a(x))

    with pytest.warns(UserWarning, match="converted no layer"):
        _, report = fp8nnx.fp8_linear_layers(Wide(nnx.Rngs(0)), None, return_report=True)
    assert "too small to gain" in report.skipped["a"]
    cfg = fp8jax.Fp8Config(selective=False, targets=["b"])
    model, report = fp8nnx.fp8_linear_layers(Wide(nnx.Rngs(0)), cfg, return_report=True)
    assert report.converted == ["b"] and report.skipped == {"a": "not in targets"}
    assert model.a.dot_general is jax.lax.dot_general
    again = fp8nnx.fp8_linear_layers(model, cfg, return_report=True)[1]
    assert again.skipped == {"a": "not in targets"} and again.layers[1].reason == "already FP8"
    with pytest.raises(ValueError, match="match no layer"):
        fp8nnx.fp8_linear_layers(Wide(nnx.Rngs(0)), fp8jax.Fp8Config(targets="nope"))
    typo = fp8jax.Fp8Config(selective=False, targets=["b", "aa"])  # one entry selects nothing
    with pytest.warns(UserWarning, match=r"targets entries \['aa'\] match no layer"):
        _, report = fp8nnx.fp8_linear_layers(Wide(nnx.Rngs(0)), typo, return_report=True)
    assert report.converted == ["b"]  # the other entries still apply
    with pytest.raises(TypeError, match="flax.nnx.Module"):
        fp8nnx.fp8_linear_layers(eqx.nn.Linear(32, 32, key=jax.random.PRNGKey(0)))

    x = jnp.ones((16, 32))
    optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
    plain_grads = nnx.grad(lambda m: jnp.sum(m(x)))(model)  # Params only
    with pytest.raises(ValueError, match="diff_state"):
        fp8nnx.update(model, optimizer, plain_grads)
    assert int(optimizer.step[...]) == 0  # nothing written
    everything = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Variable)
    grads = nnx.grad(lambda m: jnp.sum(m(x)), argnums=fp8nnx.diff_state(0))(model)
    with pytest.raises(ValueError, match="wrt=nnx.Param"):
        fp8nnx.update(model, everything, grads)


def test_layer_that_did_not_run_keeps_its_state():
    class TwoPaths(nnx.Module):
        def __init__(self, rngs):
            self.used = nnx.Linear(32, 32, rngs=rngs)
            self.unused = nnx.Linear(32, 32, rngs=rngs)

    model = fp8nnx.fp8_linear_layers(TwoPaths(nnx.Rngs(0)), CFG)
    optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
    grads = nnx.grad(
        lambda m: jnp.sum(m.used(jnp.full((16, 32), 2.0))), argnums=fp8nnx.diff_state(0)
    )(model)
    fp8nnx.update(model, optimizer, grads)
    assert float(model.used.dot_general.input_amax_history[0]) == 2.0
    assert float(model.unused.dot_general.input_scale[0]) == 1.0  # not zeroed
    assert not model.unused.dot_general.input_amax_history[...].any()


def test_stacked_layers_under_scan_get_per_layer_state():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(32, 32, rngs=rngs)

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(rngs):
        return Block(rngs)

    def forward(blocks, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return jax.nn.relu(block.lin(x))

        return body(x, blocks)

    blocks, report = fp8nnx.fp8_linear_layers(
        make(nnx.Rngs(0).split(3)), CFG, return_report=True
    )
    assert report.layers[0].stack == (3,) and report.converted == ["lin"]
    assert blocks.lin.dot_general.input_scale.shape == (3, 1)
    x = jnp.full((16, 32), 2.0)
    grads = nnx.grad(lambda b: jnp.sum(forward(b, x) ** 2), argnums=fp8nnx.diff_state(0))(blocks)
    fp8nnx.overwrite_state(blocks, grads)
    hist = np.asarray(blocks.lin.dot_general.input_amax_history[...])
    assert hist[0, 0] == 2.0 and hist[1, 0] > 0 and hist[2, 0] > 0 and not hist[:, 1:].any()
    report = fp8jax.fp8_gemm_report(
        lambda s, x: nnx.grad(lambda b: jnp.sum(forward(b, x) ** 2), argnums=fp8nnx.diff_state(0))(
            nnx.merge(nnx.graphdef(blocks), s)
        ),
        nnx.state(blocks),
        x,
        stage="lowered",
    )
    assert report.all_fp8, report
