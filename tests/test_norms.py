"""`fp8jax.nn._elementwise.normalize`: its backward (kept: the input and two f32 numbers per row)
matches differentiating the f32 formula, in float64, for both norms and every affine option;
and it keeps no f32 copy of its input for the backward (issue 49)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import sqnr_db

from fp8jax.nn._elementwise import normalize


def _reference(x, weight, bias, norm, eps, zero_centered_gamma):
    """The formula, differentiated by JAX (what `normalize` computed before its VJP)."""
    x = x.astype(jnp.float64)
    if norm == "layernorm":
        x = x - jnp.mean(x, axis=-1, keepdims=True)
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * (1.0 + weight if zero_centered_gamma else weight)
    return y if bias is None else y + bias


@pytest.fixture
def x64():
    """float64 in JAX for the test's duration (the reference is differentiated in float64)."""
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("affine", ["none", "weight", "weight+bias", "zero_centered"])
def test_normalize_gradients_match_the_formula_in_float64(norm, affine, x64):
    k = jax.random.split(jax.random.PRNGKey(sum(map(ord, norm + affine))), 4)
    x = jax.random.normal(k[0], (3, 5, 64), jnp.float64) * 3 + 0.5
    w = None if affine == "none" else jax.random.normal(k[1], (64,), jnp.float64)
    b = jax.random.normal(k[2], (64,), jnp.float64) if affine == "weight+bias" else None
    g = jax.random.normal(k[3], x.shape, jnp.float64)
    zc = affine == "zero_centered"

    def loss(fn):
        return lambda x, w, b: jnp.sum(fn(x, w, b, norm, 1e-5, zc) * g)

    got = jax.grad(loss(normalize), argnums=(0, 1, 2))(x, w, b)
    ref = jax.grad(loss(_reference), argnums=(0, 1, 2))(x, w, b)
    y, y_ref = normalize(x, w, b, norm, 1e-5, zc), _reference(x, w, b, norm, 1e-5, zc)
    assert sqnr_db(y, y_ref) > 100  # float32 math inside
    for r, o in zip(ref, got):
        if r is None:
            assert o is None
            continue
        # float32 statistics and math inside: ~140 dB; a wrong term gives < 20 dB
        assert sqnr_db(o, r) > 100, sqnr_db(o, r)


def test_normalize_in_bf16_matches_float64_and_runs_under_vmap_and_jit(x64):
    k = jax.random.split(jax.random.PRNGKey(7), 3)
    x = jax.random.normal(k[0], (4, 16, 128), jnp.bfloat16)
    w = jax.random.normal(k[1], (128,), jnp.float32)
    g = jax.random.normal(k[2], x.shape, jnp.bfloat16)

    def loss(x, w):
        y = jax.vmap(lambda r: normalize(r, w, None, "rmsnorm", 1e-5))(x)
        return jnp.sum((y * g).astype(jnp.float32))

    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    x_, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
    rx, rw = jax.grad(lambda x, w: jnp.sum(
        _reference(x, w, None, "rmsnorm", 1e-5, False) * g64), argnums=(0, 1))(x_, w64)
    assert sqnr_db(dx, rx) > 35 and sqnr_db(dw, rw) > 35  # bf16 dx: ~45 dB


def test_normalize_keeps_its_bf16_input_and_per_row_stats_only():
    """Residuals of a bf16 RMSNorm over [tokens, 4096]: the input (8 KiB a token) and two f32
    numbers a row, not the three f32 [tokens, 4096] copies the plain formula keeps."""
    x = jax.random.normal(jax.random.PRNGKey(0), (512, 4096), jnp.bfloat16)
    w = jnp.ones((4096,), jnp.float32)
    _, vjp = jax.vjp(lambda x, w: normalize(x, w, None, "rmsnorm", 1e-5), x, w)
    saved = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(vjp)
                if hasattr(a, "dtype") and 512 in a.shape)
    assert saved <= 512 * 4096 * 2 + 512 * 8, saved  # x in bf16 + (mean, rstd) per row
    _, plain = jax.vjp(lambda x, w: _reference(x.astype(jnp.float32), w, None, "rmsnorm",
                                               1e-5, False).astype(x.dtype), x, w)
    before = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(plain)
                 if hasattr(a, "dtype") and 512 in a.shape)
    assert before >= 3 * 512 * 4096 * 4  # the formula's f32 copies: what this VJP removes
