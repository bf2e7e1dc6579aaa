"""On an NVIDIA GPU: the compiled train step really runs FP8 GEMMs (skipped elsewhere)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import fp8jax
from conftest import gpu
from helpers import normal, sqnr_db

pytestmark = [gpu, pytest.mark.gpu]
ALL = fp8jax.Fp8Config(selective=False)


def _step(model, x, c):
    def loss(model, x):
        return jnp.sum(model(x).astype(jnp.float32) * c)

    return jax.value_and_grad(lambda m, x: loss(m, x), argnums=(0, 1))(model, x)


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_linear_train_step_is_three_fp8_gemms(key, scaling):
    layer = eqx.nn.Linear(1024, 2048, dtype=jnp.bfloat16, key=key)
    model = fp8jax.fp8_linear_layers(layer, fp8jax.Fp8Config(scaling=scaling, selective=False))
    x = normal(key, (4096, 1024), jnp.bfloat16)
    c = normal(key, (4096, 2048), jnp.float32)
    report = fp8jax.assert_fp8(_step, model, x, c, expected=3)
    assert all("f8" in g.target for g in report.gemms), report


def test_vmap_idiom_is_three_fp8_gemms(key):
    model = fp8jax.fp8_linear_layers(eqx.nn.Linear(1024, 1024, dtype=jnp.bfloat16, key=key), ALL)
    x = normal(key, (8, 512, 1024), jnp.bfloat16)

    def step(model, x):
        return jax.grad(lambda m, x: jnp.sum(jax.vmap(jax.vmap(m))(x).astype(jnp.float32) ** 2),
                        argnums=(0, 1))(model, x)

    fp8jax.assert_fp8(step, model, x, expected=3)


def test_flax_kernel_layout_is_fp8(key):
    op = fp8jax.Fp8DotGeneral(ALL)
    x, w = normal(key, (2, 1024, 1024), jnp.bfloat16), normal(key, (1024, 2048), jnp.bfloat16)
    dn = (((2,), (0,)), ((), ()))

    def step(op, x, w):
        return jax.grad(lambda x, w: jnp.sum(op(x, w, dn).astype(jnp.float32) ** 2), argnums=(0, 1))(x, w)

    fp8jax.assert_fp8(step, op, x, w, expected=3)


def test_gpu_numerics_match_reference(key):
    layer = eqx.nn.Linear(2048, 1024, dtype=jnp.float32, key=key)
    model = fp8jax.fp8_linear_layers(layer, fp8jax.Fp8Config(scaling="current", selective=False))
    x = normal(key, (2048, 2048), jnp.bfloat16)
    ref = jax.vmap(layer)(x.astype(jnp.float32))
    assert sqnr_db(model(x), ref) >= 25.0


@pytest.mark.parametrize("fused", [True, False])
def test_fused_mlp_train_step_is_six_fp8_gemms(key, fused):
    mlp = fp8jax.nn.FusedMLP(1024, 2048, activation="swiglu", config=ALL, dtype=jnp.bfloat16, key=key)
    mlp = mlp.with_fused(fused)
    x = normal(key, (4096, 1024), jnp.bfloat16)
    c = normal(key, (4096, 1024), jnp.float32)
    fp8jax.assert_fp8(_step, mlp, x, c, expected=6)


def test_fused_mlp_matches_reference_on_gpu(key):
    mlp = fp8jax.nn.FusedMLP(1024, 2048, activation="gelu", config=ALL, key=key)
    x = normal(key, (4096, 1024))
    ref = mlp.with_fused(False)
    ref = fp8jax.nn.FusedMLP.from_modules(eqx.nn.RMSNorm(1024), ref.fc1.to_linear(), ref.fc2.to_linear(),
                                         activation="gelu", fp8=False, fused=False)
    with jax.default_matmul_precision("float32"):
        expected = ref(x)
    # 25.5-26 dB on CPU at width 64; 23.6 dB measured on the H100 at width 1024.
    assert sqnr_db(mlp(x), expected) >= 23.0
