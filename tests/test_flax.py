"""flax.linen adapter: nn.Dense with fp8jax's dot_general, state through TrainState."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax
from helpers import normal, sqnr_db

nn = pytest.importorskip("flax.linen")
from flax.training import train_state  # noqa: E402

import fp8jax.flax as fp8flax  # noqa: E402

OWG = "_overwrite_with_gradient"
CFG = fp8jax.Fp8Config(selective=False, amax_history_length=8)


class Model(nn.Module):
    fp8: bool

    @nn.compact
    def __call__(self, x):
        cls = fp8flax.fp8_dot_general_cls(CFG) if self.fp8 else None
        x = nn.gelu(nn.Dense(64, dot_general_cls=cls)(x))
        return nn.Dense(32, dot_general_cls=cls)(x)


def test_dense_matches_plain_and_uses_fp8(key):
    x = normal(key, (32, 48))
    fp8_model, plain = Model(fp8=True), Model(fp8=False)
    variables = fp8_model.init(key, x)
    assert set(variables) == {"params", OWG}
    assert variables[OWG]["Dense_0"]["Fp8DotGeneralOp_0"]["input_amax_history"].shape == (8,)
    assert tuple(variables[OWG]["Dense_0"]["Fp8DotGeneralOp_0"]) == fp8flax.FLAX_STATE  # flax's order
    y = fp8_model.apply(variables, x)
    y_ref = plain.apply({"params": variables["params"]}, x)
    assert sqnr_db(y, y_ref) >= 20.0
    report = fp8jax.fp8_gemm_report(
        lambda v, x: jax.grad(lambda v: jnp.sum(fp8_model.apply(v, x)))(v), variables, x, stage="lowered")
    assert len(report.gemms) == 6 and report.all_fp8, report


def test_train_state_overwrites_state(key):
    x = normal(key, (32, 48), scale=3.0)
    model = Model(fp8=True)
    variables = model.init(key, x)
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adamw(1e-3))

    @jax.jit
    def step(state, x):
        grads = jax.grad(lambda v: jnp.mean(state.apply_fn(v, x) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    for _ in range(3):
        state = step(state, x)
    owg = state.params[OWG]["Dense_0"]["Fp8DotGeneralOp_0"]
    assert set(owg) == set(fp8flax.FLAX_STATE)  # flax's variables, no others
    newest_first = np.asarray(owg["input_amax_history"])[[0, -1, -2]]  # flax's rolled layout
    np.testing.assert_allclose(newest_first, jnp.max(jnp.abs(x)), rtol=1e-6)
    assert np.count_nonzero(owg["input_amax_history"]) == 3
    np.testing.assert_allclose(owg["input_scale"], jnp.max(jnp.abs(x)) / 448.0, rtol=1e-6)
    assert not np.array_equal(state.params["params"]["Dense_0"]["kernel"], variables["params"]["Dense_0"]["kernel"])
