"""Every front door runs the same FP8 path (issue 47): one layer's lowered train step through
equinox, flax linen (``dot_general_cls``) and flax nnx (`fp8jax.nnx.fp8_linear_layers`) holds
the same FP8 GEMMs (operand and result types of forward, dgrad and wgrad) and the same kinds
of FP8 casts, with bf16 and with f32 parameters."""

import collections
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import fp8jax
from fp8jax.train._census import lowered_gemm_calls

CFG = fp8jax.Fp8Config(selective=False)
K, N, M = 64, 128, 32


def _loss(y, g):
    return jnp.sum(y.astype(jnp.float32) * g)


def _equinox(dtype, x, g):
    layer = eqx.nn.Linear(K, N, use_bias=False, dtype=dtype, key=jax.random.PRNGKey(0))
    layer = fp8jax.fp8_linear_layers(layer, CFG)
    params, static = eqx.partition(layer, eqx.is_array)

    def step(p, x):  # bf16 compute: the weights (not the FP8 state) cast, as flax's dtype=
        model = eqx.combine(p, static)
        weights = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), fp8jax.trainable(model))
        return _loss(jax.vmap(eqx.combine(weights, model))(x), g)

    return jax.jit(jax.grad(step, argnums=(0, 1))).lower(params, x)


def _linen(dtype, x, g):
    import flax.linen as nn

    dense = nn.Dense(N, use_bias=False, dtype=jnp.bfloat16, param_dtype=dtype,
                     dot_general_cls=fp8jax.flax.fp8_dot_general_cls(CFG))
    variables = dense.init(jax.random.PRNGKey(0), x)
    return jax.jit(jax.grad(lambda v, x: _loss(dense.apply(v, x), g), argnums=(0, 1))).lower(
        variables, x)


def _nnx(dtype, x, g):
    from flax import nnx

    model = nnx.Linear(K, N, use_bias=False, dtype=jnp.bfloat16, param_dtype=dtype,
                       rngs=nnx.Rngs(0))
    fp8jax.nnx.fp8_linear_layers(model, CFG)
    graphdef, state = nnx.split(model)
    fn = jax.grad(lambda s, x: _loss(nnx.merge(graphdef, s)(x), g), argnums=(0, 1))
    return jax.jit(fn).lower(state, x)


def _fp8_ops(lowered):
    """(the GEMM calls' types, the count of each FP8 convert's target type)."""
    text = lowered.as_text()
    # Operands sorted: a kernel stored [K, N] (flax) makes wgrad x^T.g where [N, K] makes
    # g^T.x, the same FP8 GEMM with its operands swapped.
    gemms = sorted(
        (tuple(sorted(g.operand_types)), g.result_type, g.is_fp8) for g in lowered_gemm_calls(text)
    )
    casts = collections.Counter(re.findall(r"stablehlo\.convert.*-> tensor<[^>]*x(f8\w+)>", text))
    return gemms, casts


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_adapters_lower_the_equinox_paths_fp8_ops(dtype):
    kx, kg = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (M, K), jnp.bfloat16)
    g = jax.random.normal(kg, (M, N), jnp.float32)
    want_gemms, want_casts = _fp8_ops(_equinox(dtype, x, g))
    assert len(want_gemms) == 3 and all(fp8 for *_, fp8 in want_gemms), want_gemms
    assert set(want_casts) == {"f8E4M3FN", "f8E5M2"}, want_casts
    for door in (_linen, _nnx):
        gemms, casts = _fp8_ops(door(dtype, x, g))
        assert gemms == want_gemms, (door.__name__, gemms, want_gemms)
        assert set(casts) == set(want_casts), (door.__name__, casts, want_casts)
