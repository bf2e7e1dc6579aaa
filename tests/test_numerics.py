"""Forward and gradient accuracy of FP8 GEMMs against a float64 reference."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from helpers import normal, sqnr_db, take_state

SHAPES = [(64, 32, 48), (256, 128, 64), (128, 512, 256)]  # (M, K, N)


def _reference(x, w, b, c):
    """float64 forward and gradients of loss = sum((x @ w.T + b) * c)."""
    x, w, c = (np.asarray(a, np.float64) for a in (x, w, c))
    y = x @ w.T + np.asarray(b, np.float64)
    return y, c @ w, c.T @ x


@pytest.mark.parametrize("scaling", ["delayed", "current"])
@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_sqnr(key, scaling, fp8_format, shape, dtype):
    m, k, n = shape
    kx, kw, kc, kx2 = jax.random.split(key, 4)
    config = fp8jax.Fp8Config(scaling=scaling, fp8_format=fp8_format, selective=False)
    layer = eqx.nn.Linear(k, n, key=kw)
    layer = eqx.tree_at(lambda l: (l.weight, l.bias), layer, (layer.weight.astype(dtype), layer.bias.astype(dtype)))
    model = fp8jax.fp8_linear_layers(layer, config)
    c = normal(kc, (m, n), dtype, scale=1e-3)  # realistic small output gradients

    def loss(model, x):
        return jnp.sum(model(x).astype(jnp.float32) * c.astype(jnp.float32))

    step = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    # Delayed scaling needs one step of history (flax convention: scale 1 before it).
    _, grads = step(model, normal(kx2, (m, k), dtype, scale=3.0))
    model = take_state(model, grads)
    x = normal(kx, (m, k), dtype, scale=3.0)
    y = model(x)
    (_, grads), dx = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, x), jax.grad(lambda x: loss(model, x))(x)
    y_ref, dx_ref, dw_ref = _reference(x, layer.weight, layer.bias, c)
    assert y.dtype == dtype
    assert sqnr_db(y, y_ref) >= 25.0
    assert sqnr_db(dx, dx_ref) >= 20.0
    assert sqnr_db(grads.weight, dw_ref) >= 20.0
    assert np.all(np.isfinite(np.asarray(grads.weight, np.float32)))


def test_sqnr_metric_can_fail(key):
    """The tolerance is meaningful: plain e5m2 without scaling of tiny grads fails it."""
    x = normal(key, (64, 64), scale=1e-6)
    crushed = x.astype(jnp.float8_e5m2).astype(jnp.float32)
    assert sqnr_db(crushed, x) < 20.0


def test_matches_original_linear(key):
    """A converted eqx.nn.Linear computes the original function to FP8 accuracy."""
    layer = eqx.nn.Linear(64, 32, key=key)
    model = fp8jax.fp8_linear_layers(layer, fp8jax.Fp8Config(scaling="current", selective=False))
    x = normal(jax.random.fold_in(key, 1), (16, 64))
    assert model.weight is layer.weight and model.bias is layer.bias
    assert sqnr_db(jax.vmap(model)(x), jax.vmap(layer)(x)) >= 25.0
    assert sqnr_db(model(x[0]), layer(x[0])) >= 25.0


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_gemm_scales_equal_one_scale_per_tensor(key, algo):
    """The forward's one-reduction scales (`PerTensor.gemm_scales`) are bit-identical to
    three `PerTensor.scale` calls: fresh histories, one all-zero (keeps its old scale)."""
    from fp8jax._recipe import PerTensor

    recipe = PerTensor(algo=algo, margin=1.0)
    k1, k2 = jax.random.split(key)
    histories = list(jnp.abs(jax.random.normal(k1, (3, 16))) * jnp.array([[1.0], [30.0], [1e-3]]))
    histories[2] = jnp.zeros(16)
    olds = tuple(jnp.abs(jax.random.normal(k2, (3, 1))) + 0.5)
    dtypes = (jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.float8_e5m2)
    together = np.asarray(recipe.gemm_scales(tuple(histories), olds, dtypes))
    one_by_one = [np.asarray(recipe.scale(h, o, d)) for h, o, d in zip(histories, olds, dtypes)]
    np.testing.assert_array_equal(together, np.concatenate(one_by_one))
    assert together[2] == np.asarray(olds[2])[0]  # zero history: old scale kept
