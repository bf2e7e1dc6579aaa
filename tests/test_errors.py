"""Bad inputs to the public API fail early with a ValueError/TypeError naming the
offending option, shape or dtype (CPU, no compilation beyond tiny traces)."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax
from fp8jax import Fp8Config

CFG = Fp8Config(selective=False, amax_history_length=4)


# --- Fp8Config ------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(scaling="Delayed"), r"scaling='Delayed'.*'delayed' or 'current'"),
    (dict(fp8_format="e5m2"), r"fp8_format='e5m2'"),
    (dict(amax_compute_algo="mean"), r"amax_compute_algo='mean'"),
    (dict(fast_accumulation=True), r"fast_accumulation=True"),
    (dict(on_unsupported="error"), r"on_unsupported='error'"),
    (dict(amax_history_length=0), r"amax_history_length=0.*int >= 1"),
    (dict(amax_history_length=2.0), r"amax_history_length=2\.0.*int >= 1"),
    (dict(amax_history_length="16"), r"amax_history_length='16'"),
    (dict(amax_history_length=True), r"amax_history_length=True"),
    (dict(amax_history_length=10**10), r"amax_history_length=10000000000.*\[1, 65536\]"),
    (dict(alignment=0), r"alignment=0"),
    (dict(min_tokens=-1), r"min_tokens=-1.*int >= 0"),
    (dict(min_features=1.5), r"min_features=1\.5"),
    (dict(min_weight_elements="big"), r"min_weight_elements='big'"),
    (dict(margin=-1), r"margin=-1.*\[0, 8\]"),
    (dict(margin="1"), r"margin='1'"),
    (dict(margin=float("nan")), r"margin=nan"),
    (dict(margin=True), r"margin=True"),
    (dict(cast_kernel="False"), r"cast_kernel='False'.*True or False"),
    (dict(cast_kernel=1), r"cast_kernel=1"),
    (dict(selective="False"), r"selective='False'.*True or False"),
    (dict(selective=0), r"selective=0"),
    (dict(targets=5), r"targets=5.*regex string"),
    (dict(targets={"up"}), r"targets=\{'up'\}"),
    (dict(targets=b"up"), r"targets=b'up'"),
    (dict(targets=[]), r"targets=\[\].*at least one"),
    (dict(targets=["up", 3]), r"targets\[1\]=3.*a string"),
    (dict(targets="("), r"targets='\('.*valid regex"),
    (dict(targets=["ok", "a("]), r"targets='a\('.*valid regex"),
    (dict(targets=eqx.nn.Linear), r"targets=.*not a class"),
    (dict(targets=lambda path: True), r"targets=.*two arguments \(path, module\)"),
])
def test_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Fp8Config(**kwargs)


def test_config_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'scale'"):
        Fp8Config(scale="delayed")


def test_config_replace_is_checked_too():
    import dataclasses

    with pytest.raises(ValueError, match=r"margin=-3"):
        dataclasses.replace(Fp8Config(), margin=-3)


def test_config_accepts_numpy_scalars_as_python_values():
    cfg = Fp8Config(amax_history_length=np.int32(16), margin=np.float32(1.0), selective=np.True_)
    assert type(cfg.amax_history_length) is int and cfg.amax_history_length == 16
    assert type(cfg.margin) is float and type(cfg.selective) is bool
    assert Fp8Config(targets=["a", "b"]).targets == ("a", "b")
    assert Fp8Config(targets=lambda path, module: True).matches("x", None)


# --- fp8jax.nn.Linear -----------------------------------------------------------------
@pytest.fixture
def layer(key):
    return fp8jax.nn.Linear(32, 16, config=CFG, key=key)


@pytest.mark.parametrize("shape", [(4, 31), (32, 4), ()])
def test_linear_rejects_input_shape(layer, shape):
    match = r"inputs of shape \(\.\.\., 32\), got " + re_tuple(shape)
    with pytest.raises(ValueError, match=match):
        layer(jnp.ones(shape))


def re_tuple(shape):
    return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.float8_e4m3fn, jnp.complex64])
def test_linear_rejects_input_dtype(layer, dtype):
    name = jnp.dtype(dtype).name
    with pytest.raises(TypeError, match=rf"x must be float16/bfloat16/float32, got dtype {name} "
                                        r"with shape \(4, 32\)"):
        layer(jnp.ones((4, 32), dtype))


@pytest.mark.parametrize("x, name", [(None, "NoneType"), ("abc", "str")])
def test_linear_rejects_non_arrays(layer, x, name):
    with pytest.raises(TypeError, match=rf"x must be an array, got {name}"):
        layer(x)


@pytest.mark.parametrize("args, match", [
    ((0, 16), r"in_features=0.*int >= 1"),
    ((-1, 16), r"in_features=-1"),
    ((2.5, 16), r"in_features=2\.5"),
    (("scalar", 16), r"in_features='scalar'"),
    ((32, 0), r"out_features=0"),
])
def test_linear_rejects_features(key, args, match):
    with pytest.raises(ValueError, match=match):
        fp8jax.nn.Linear(*args, key=key)


def test_linear_rejects_int_dtype_and_bad_config(key):
    with pytest.raises(TypeError, match=r"dtype=int32 .*floating dtype"):
        fp8jax.nn.Linear(32, 16, dtype=jnp.int32, key=key)
    with pytest.raises(TypeError, match=r"dtype=float8_e4m3fn .*floating dtype"):
        fp8jax.nn.Linear(32, 16, dtype=jnp.float8_e4m3fn, key=key)
    with pytest.raises(TypeError, match=r"use_bias='no' is not allowed; expected True or False"):
        fp8jax.nn.Linear(32, 16, use_bias="no", key=key)
    assert fp8jax.nn.Linear(np.int64(32), 16, key=key).in_features == 32  # numpy ints are ints
    with pytest.raises(TypeError, match=r"config must be an fp8jax.Fp8Config, got dict"):
        fp8jax.nn.Linear(32, 16, config={"scaling": "current"}, key=key)


def test_from_linear_rejects_non_linears_and_bad_arrays(key):
    base = eqx.nn.Linear(32, 16, key=key)
    with pytest.raises(TypeError, match=r"expects an eqx.nn.Linear, got MLP"):
        fp8jax.nn.Linear.from_linear(eqx.nn.MLP(4, 4, 4, 1, key=key))
    with pytest.raises(TypeError, match=r"expects an eqx.nn.Linear, got NoneType"):
        fp8jax.nn.Linear.from_linear(None)
    transposed = eqx.tree_at(lambda l: l.weight, base, base.weight.T)
    with pytest.raises(ValueError, match=r"weight has shape \(32, 16\); expected "
                                         r"\[\.\.\., out_features=16, in_features=32\]"):
        fp8jax.nn.Linear.from_linear(transposed)
    with pytest.raises(ValueError, match=r"weight has shape \(32, 16\)"):
        fp8jax.fp8_linear_layers(transposed, CFG)  # reached through the converter too
    with pytest.raises(ValueError, match=r"weight has shape \(16,\)"):
        fp8jax.nn.Linear.from_linear(eqx.tree_at(lambda l: l.weight, base, base.weight[:, 0]))
    with pytest.raises(ValueError, match=r"bias has shape \(3,\); expected \(16,\)"):
        fp8jax.nn.Linear.from_linear(eqx.tree_at(lambda l: l.bias, base, jnp.ones(3)))
    int_weight = eqx.tree_at(lambda l: l.weight, base, base.weight.astype(jnp.int32))
    with pytest.raises(TypeError, match=r"weight dtype int32"):
        fp8jax.nn.Linear.from_linear(int_weight)


def test_from_linear_accepts_stacked_linears(key):
    stacked = eqx.filter_vmap(lambda k: eqx.nn.Linear(32, 16, key=k))(jax.random.split(key, 3))
    assert fp8jax.nn.Linear.from_linear(stacked, CFG).weight.shape == (3, 16, 32)


# --- fp8_linear_layers (convert.py: checks that already hold) ---------------------------
def test_fp8_linear_layers_rejects(key):
    with pytest.raises(ValueError, match=r"no linear layer .* found in dict"):
        fp8jax.fp8_linear_layers({"a": jnp.ones(3)})
    with pytest.raises(ValueError, match=r"no linear layer .* found in Conv2d"):
        fp8jax.fp8_linear_layers(eqx.nn.Conv2d(3, 3, 3, key=key))
    with pytest.raises(ValueError, match=r"targets='zz' match no linear layer"):
        fp8jax.fp8_linear_layers(eqx.nn.Linear(32, 32, key=key), Fp8Config(targets="zz"))
    with pytest.raises(TypeError, match=r"config must be an fp8jax.Fp8Config, got str"):
        fp8jax.fp8_linear_layers(eqx.nn.Linear(32, 32, key=key), "delayed")


# --- optax_step / apply_updates / accumulate_grads --------------------------------------
class Two(eqx.Module):
    a: eqx.Module
    b: eqx.Module

    def __init__(self, key, hidden=32):
        ka, kb = jax.random.split(key)
        self.a, self.b = eqx.nn.Linear(32, hidden, key=ka), eqx.nn.Linear(hidden, 32, key=kb)

    def __call__(self, x):
        return self.b(self.a(x))


def _grads(model):
    x = jnp.ones((16, 32))
    return eqx.filter_grad(lambda m: jnp.sum(m(x)))(model)


@pytest.fixture
def setup(key):
    model = fp8jax.fp8_linear_layers(Two(key), CFG)
    opt = optax.adam(1e-3)
    return model, _grads(model), opt, opt.init(fp8jax.trainable(model))


def test_optax_step_rejects_grads_of_another_model(key, setup):
    model, grads, opt, state = setup
    one = fp8jax.fp8_linear_layers(eqx.nn.Linear(32, 32, key=key), CFG)
    with pytest.raises(ValueError, match=r"optax_step: the gradients do not match the model: at "
                                         r"the top level, model: type Two; gradients: type Lin"):
        fp8jax.optax_step(opt, model, _grads(one), state)
    wider = fp8jax.fp8_linear_layers(Two(key, hidden=64), CFG)
    with pytest.raises(ValueError, match=r"at \.a, model: out_features=32; "
                                         r"gradients: out_features=64"):
        fp8jax.optax_step(opt, model, _grads(wider), state)
    longer = fp8jax.fp8_linear_layers(Two(key), Fp8Config(selective=False, amax_history_length=8))
    with pytest.raises(ValueError, match=r"at \.a\.dot_general, model: "
                                         r"config\.amax_history_length=4; gradients: "
                                         r"config\.amax_history_length=8"):
        fp8jax.optax_step(opt, model, _grads(longer), state)
    with pytest.raises(ValueError, match=r"grads is None"):
        fp8jax.optax_step(opt, model, None, state)


def test_optax_step_names_the_first_array_of_another_shape(setup):
    model, grads, opt, state = setup
    bad = eqx.tree_at(lambda g: g.b.bias, grads, jnp.ones(5))
    with pytest.raises(ValueError, match=r"at \.b\.bias, model: shape \(32,\); "
                                         r"gradients: shape \(5,\)"):
        fp8jax.optax_step(opt, model, bad, state)


def test_optax_step_rejects_wrong_opt_state_and_optimizer(key, setup):
    model, grads, opt, state = setup
    with pytest.raises(ValueError, match=r"opt_state holds FP8 state; .*"
                                         r"optimizer\.init\(fp8jax\.trainable\(model\)\)"):
        fp8jax.optax_step(opt, model, grads, opt.init(eqx.filter(model, eqx.is_inexact_array)))
    other = fp8jax.fp8_linear_layers(eqx.nn.Linear(32, 32, key=key), CFG)
    with pytest.raises(ValueError, match=r"opt_state does not fit this model's trainable"):
        fp8jax.optax_step(opt, model, grads, opt.init(fp8jax.trainable(other)))
    with pytest.raises(TypeError, match=r"optimizer must be an optax.GradientTransformation, "
                                        r"got str"):
        fp8jax.optax_step("adam", model, grads, state)
    with pytest.raises(TypeError, match=r"optimizer must be .*, got Two"):
        fp8jax.optax_step(model, opt, grads, state)  # arguments swapped


def test_apply_updates_keeps_old_state_where_overwrites_are_not_finite(setup):
    """Overwrites that carry Inf/NaN (state that went through arithmetic, a corrupted
    checkpoint) never reach a scale or a history: those elements keep their old values,
    the finite ones are written."""
    model, grads, _, _ = setup
    overwrites, _ = fp8jax.partition_for_grad_overwrite(grads)
    clean = fp8jax.apply_updates(model, None, overwrites).a.dot_general
    bad = eqx.tree_at(lambda o: (o.a.dot_general.input_scale,
                                 o.a.dot_general.input_amax_history),
                      overwrites, (jnp.full((1,), jnp.inf),
                                   overwrites.a.dot_general.input_amax_history.at[0].set(jnp.nan)))
    new = fp8jax.apply_updates(model, None, bad).a.dot_general
    old = model.a.dot_general
    np.testing.assert_array_equal(new.input_scale, old.input_scale)
    np.testing.assert_array_equal(new.input_amax_history[0], old.input_amax_history[0])
    np.testing.assert_array_equal(new.input_amax_history[1:], clean.input_amax_history[1:])
    np.testing.assert_array_equal(new.kernel_scale, clean.kernel_scale)
    assert float(clean.input_amax_history[0]) > 0  # the step did record an amax


def test_apply_updates_and_accumulate_reject_another_model(key, setup):
    model, grads, opt, state = setup
    one = fp8jax.fp8_linear_layers(eqx.nn.Linear(32, 32, key=key), CFG)
    overwrites, true_grads = fp8jax.partition_for_grad_overwrite(_grads(one))
    with pytest.raises(ValueError, match=r"apply_updates: the overwrites do not match the model"):
        fp8jax.apply_updates(model, None, overwrites)
    with pytest.raises(ValueError, match=r"apply_updates: the updates do not match the model"):
        fp8jax.apply_updates(model, true_grads, None)
    with pytest.raises(ValueError, match=r"accumulate_grads: the gradients do not match the "
                                         r"accumulated gradients: at the top level"):
        fp8jax.accumulate_grads(grads, _grads(one))
    with pytest.raises(TypeError, match=r"scale_grads: factor='0.5'"):
        fp8jax.scale_grads(grads, "0.5")
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"scale_grads: factor=.* expected a finite number"):
            fp8jax.scale_grads(grads, bad)


def test_good_steps_still_pass(setup):
    model, grads, opt, state = setup
    acc = fp8jax.accumulate_grads(fp8jax.accumulate_grads(None, grads), grads)
    new_model, _ = fp8jax.optax_step(opt, model, fp8jax.scale_grads(acc, 0.5), state)
    assert new_model.a.weight.shape == model.a.weight.shape


# --- fp8_gemm_report / assert_fp8 / saved_activation_bytes ------------------------------
def _fn(m, x):
    return m(x)


def test_gemm_report_rejects(key):
    layer = fp8jax.nn.Linear(32, 16, config=CFG, key=key)
    x = jnp.ones((16, 32))
    with pytest.raises(TypeError, match=r"fn must be a callable .*got ArrayImpl"):
        fp8jax.fp8_gemm_report(x, layer, stage="lowered")
    with pytest.raises(TypeError, match=r"fn must be a callable .*got NoneType"):
        fp8jax.fp8_gemm_report(None, x)
    with pytest.raises(TypeError, match=r"_fn cannot be called with the 0 positional"):
        fp8jax.fp8_gemm_report(_fn, stage="lowered")
    with pytest.raises(TypeError, match=r"Linear cannot be called with the 2 positional"):
        fp8jax.fp8_gemm_report(layer, _fn, x, stage="lowered")  # arguments swapped
    with pytest.raises(ValueError, match=r"stage='hlo' is not allowed"):
        fp8jax.fp8_gemm_report(_fn, layer, x, stage="hlo")
    lowered = jax.jit(_fn).lower(layer, x)
    with pytest.raises(TypeError, match=r"fn is a jax Lowered program, which takes no arguments"):
        fp8jax.fp8_gemm_report(lowered, layer, x)
    assert fp8jax.fp8_gemm_report(lowered, stage="lowered").num_fp8 == 1  # accepted as is
    with pytest.raises(ValueError, match=r"stage='lowered' needs .* got a Compiled one"):
        fp8jax.fp8_gemm_report(lowered.compile(), stage="lowered")


def test_assert_fp8_and_saved_activation_bytes_reject(key):
    layer = fp8jax.nn.Linear(32, 16, config=CFG, key=key)
    x = jnp.ones((16, 32))
    for expected in ("2", -1, True):
        with pytest.raises(ValueError, match=rf"assert_fp8: expected={expected!r} is not allowed"):
            fp8jax.assert_fp8(_fn, layer, x, expected=expected, stage="lowered")
    with pytest.raises(ValueError, match=r"stage='x' is not allowed"):
        fp8jax.assert_fp8(_fn, layer, x, stage="x")
    with pytest.raises(TypeError, match=r"saved_activation_bytes: model must be a callable"):
        fp8jax.saved_activation_bytes(x, x)
    with pytest.raises(TypeError, match=r"saved_activation_bytes: dim='8'"):
        fp8jax.saved_activation_bytes(layer, x, dim="8")


# --- fp8jax-demo ------------------------------------------------------------------------
@pytest.mark.parametrize("argv, match", [
    (["--steps", "0"], r"--steps 0 is not allowed"),
    (["--width", "10"], r"--width 10 is not allowed; expected a positive multiple of 16"),
    (["--width", "0"], r"--width 0 is not allowed"),
    (["--steps", "abc"], r"argument --steps: invalid int value: 'abc'"),
])
def test_demo_rejects_options(argv, match, capsys):
    from fp8jax import _demo as demo

    with pytest.raises(SystemExit) as exc:
        demo.run(argv)
    assert exc.value.code == 2
    assert re.search(match, capsys.readouterr().err)

