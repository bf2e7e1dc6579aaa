"""Misuse of the training API fails with a message naming the argument or field."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax
from fp8jax._config import Fp8Config

CFG = Fp8Config(selective=False, amax_history_length=4, on_unsupported="silent")


def _loss(m, x):
    return jnp.mean(m(x) ** 2)


@pytest.fixture(scope="module")
def setup():
    model = fp8jax.nn.Linear(32, 32, key=jax.random.PRNGKey(0), config=CFG)
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 32))
    grads = eqx.filter_grad(_loss)(model, x)
    return model, x, grads


MODES = ["nan", "raise"]


def _poisoned(model, x, match):
    """Mode nan: ``model`` (returned under jit) is marked: its loss is NaN and
    `fp8jax.check_state` raises ``match``."""
    assert np.isnan(float(eqx.filter_jit(_loss)(model, x)))
    with pytest.raises(ValueError, match=match):
        fp8jax.check_state(model)


@pytest.mark.parametrize("mode", MODES)
def test_optax_step_swapped_model_and_grads(setup, mode, monkeypatch):
    monkeypatch.setenv("FP8JAX_GUARD", mode)
    model, x, grads = setup
    opt = optax.adam(1e-3)
    s = opt.init(fp8jax.trainable(model))
    with pytest.raises(ValueError, match="optax_step: .*model and grads swapped"):
        fp8jax.optax_step(opt, grads, model, s)  # concrete: raises now in every mode
    step = eqx.filter_jit(lambda m, g, s: fp8jax.optax_step(opt, m, g, s))
    if mode == "raise":
        with pytest.raises(Exception, match="model and grads swapped"):
            jax.block_until_ready(step(grads, model, s))
    else:
        _poisoned(step(grads, model, s)[0], x, "check_state: .*model and grads swapped")
    new, _ = step(model, grads, s)  # the right order passes under jit too
    assert fp8jax.check_state(new) is None
    assert np.isfinite(float(eqx.filter_jit(_loss)(new, x)))


@pytest.mark.parametrize("mode", MODES)
def test_optax_step_model_as_its_gradients(setup, mode, monkeypatch):
    monkeypatch.setenv("FP8JAX_GUARD", mode)
    model, x, _ = setup
    opt = optax.sgd(1e-3)
    s = opt.init(fp8jax.trainable(model))
    with pytest.raises(ValueError, match="grads is the model itself"):
        fp8jax.optax_step(opt, model, model, s)
    copy = jax.tree_util.tree_map(lambda x: x + 0 if eqx.is_array(x) else x, model)
    with pytest.raises(ValueError, match="the model passed as its\\s+gradients"):
        fp8jax.optax_step(opt, model, copy, s)
    step = eqx.filter_jit(lambda m, g, s: fp8jax.optax_step(opt, m, g, s))
    if mode == "raise":
        with pytest.raises(Exception, match="the model passed as its"):
            jax.block_until_ready(step(model, copy, s))
        return
    marked, s = step(model, copy, s)
    _poisoned(marked, x, "the model passed as its")
    # The mark stays through later (right) steps: the first reason is kept.
    marked, _ = step(marked, eqx.filter_grad(_loss)(marked, x), s)
    _poisoned(marked, x, "the model passed as its")


@pytest.mark.parametrize("mode", MODES)
def test_accumulate_grads_rejects_a_model(setup, mode, monkeypatch):
    monkeypatch.setenv("FP8JAX_GUARD", mode)
    model, x, grads = setup
    with pytest.raises(ValueError, match="accumulate_grads: .*one of them is a model"):
        fp8jax.accumulate_grads(model, grads)
    acc = eqx.filter_jit(fp8jax.accumulate_grads)
    if mode == "raise":
        with pytest.raises(Exception, match="one of them is a model"):
            jax.block_until_ready(acc(model, grads))
    else:
        bad = acc(model, grads)
        with pytest.raises(ValueError, match="one of them is a model"):
            fp8jax.check_state(bad)
        opt = optax.sgd(1e-3)
        s = opt.init(fp8jax.trainable(model))
        step = eqx.filter_jit(lambda m, g, s: fp8jax.optax_step(opt, m, g, s))
        _poisoned(step(model, bad, s)[0], x, "accumulate_grads: .*one of them is a model")
    good = acc(acc(None, grads), grads)  # fine
    assert fp8jax.check_state(good) is None


def test_optax_step_with_another_optimizers_state(setup):
    model, _, grads = setup
    other = optax.sgd(1e-3).init(fp8jax.trainable(model))
    with pytest.raises(ValueError, match=r"optimizer\.init\(fp8jax\.trainable\(model\)\)") as info:
        fp8jax.optax_step(optax.adam(1e-3), model, grads, other)
    assert "EmptyState" in str(info.value)  # the optimizer's own error, quoted


def test_optax_step_with_state_of_the_untrimmed_model(setup):
    model, _, grads = setup
    opt = optax.adam(1e-3)
    with pytest.raises(ValueError, match=r"optimizer\.init\(fp8jax\.trainable\(model\)\)"):
        fp8jax.optax_step(opt, model, grads, opt.init(eqx.filter(model, eqx.is_array)))


def test_misshaped_state_field_names_it(setup):
    model, x, _ = setup
    bad = eqx.tree_at(lambda m: m.dot_general.input_amax_history, model, jnp.zeros(5))
    with pytest.raises(ValueError, match=r"input_amax_history has shape \(5,\); expected \(4,\)"):
        bad(x)
    bad = eqx.tree_at(lambda m: m.dot_general.kernel_scale, model, jnp.ones((2,)))
    with pytest.raises(ValueError, match=r"kernel_scale has shape \(2,\); expected \(1,\)"):
        eqx.filter_jit(_loss)(bad, x)


def test_load_inference_mismatch_names_the_layer(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    def make(width):
        mlp = eqx.nn.MLP(32, 16, width, 2, key=jax.random.PRNGKey(0))
        return fp8jax.fp8_linear_layers(mlp, CFG)

    closed = []
    close = ocp.StandardCheckpointer.close
    monkeypatch.setattr(
        ocp.StandardCheckpointer, "close", lambda self: (closed.append(1), close(self))[1]
    )
    inf = fp8jax.to_inference(make(64))
    path = fp8jax.save_inference(tmp_path / "ck", inf)
    like = eqx.filter_eval_shape(fp8jax.to_inference, make(48))
    with pytest.raises(ValueError, match=r"load_inference: .*layer \.?layers\.0") as info:
        fp8jax.load_inference(path, like)
    assert "(64, 32)" in str(info.value) and "(48, 32)" in str(info.value), str(info.value)
    # Both checkpointers closed: no orbax "Event loop is closed" tracebacks at exit.
    assert len(closed) == 2
