"""Fp8DotGeneral as a drop-in for lax.dot_general: dimension numbers, errors, fallbacks."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from helpers import normal, sqnr_db

CURRENT = fp8jax.Fp8Config(scaling="current", selective=False)

CASES = {
    # name: (lhs shape, rhs shape, dimension_numbers)
    "eqx [M,K]x[N,K]": ((64, 32), (48, 32), (((1,), (1,)), ((), ()))),
    "flax Dense [B,T,K]x[K,N]": ((2, 32, 64), (64, 48), (((2,), (0,)), ((), ()))),
    "two contracting dims (heads)": ((32, 4, 16), (4, 16, 32), (((1, 2), (0, 1)), ((), ()))),
    "batch dims": ((3, 32, 48), (3, 48, 16), (((2,), (1,)), ((0,), (0,)))),
    "contracting dim first": ((32, 64), (32, 16), (((0,), (0,)), ((), ()))),
    "batch not leading": ((32, 2, 16), (16, 2, 32), (((2,), (0,)), ((1,), (1,)))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dimension_numbers_match_reference(key, name):
    lhs_shape, rhs_shape, dn = CASES[name]
    k1, k2, k3 = jax.random.split(key, 3)
    lhs, rhs = normal(k1, lhs_shape), normal(k2, rhs_shape)
    op = fp8jax.Fp8DotGeneral(CURRENT)
    y = op(lhs, rhs, dn)
    ref = jax.lax.dot_general(lhs.astype(jnp.float64) if jax.config.x64_enabled else lhs, rhs, dn,
                              precision=jax.lax.Precision.HIGHEST)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert sqnr_db(y, ref) >= 25.0
    c = normal(k3, ref.shape)
    grad_fp8 = jax.grad(lambda a, b: jnp.sum(op(a, b, dn) * c), argnums=(0, 1))(lhs, rhs)
    grad_ref = jax.grad(lambda a, b: jnp.sum(jax.lax.dot_general(a, b, dn, precision="highest") * c),
                        argnums=(0, 1))(lhs, rhs)
    for g, r in zip(grad_fp8, grad_ref, strict=True):
        assert g.shape == r.shape
        assert sqnr_db(g, r) >= 20.0


def test_preferred_element_type(key):
    lhs, rhs = normal(key, (32, 32), jnp.bfloat16), normal(key, (32, 32), jnp.bfloat16)
    y = fp8jax.Fp8DotGeneral(CURRENT)(lhs, rhs, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    assert y.dtype == jnp.float32


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float8_e4m3fn, jnp.bool_])
def test_non_float_inputs_raise(dtype):
    lhs = jnp.ones((32, 32), dtype)
    with pytest.raises(TypeError, match=r"lhs must be float16/bfloat16/float32, got dtype"):
        fp8jax.Fp8DotGeneral(CURRENT)(lhs, jnp.ones((32, 32)), (((1,), (1,)), ((), ())))


def test_mismatched_shapes_raise():
    with pytest.raises(ValueError, match=r"lhs \(32, 48\) and rhs \(32, 32\)"):
        fp8jax.Fp8DotGeneral(CURRENT)(jnp.ones((32, 48)), jnp.ones((32, 32)), (((1,), (1,)), ((), ())))


def test_bad_dimension_numbers_raise():
    with pytest.raises(ValueError, match="dimension_numbers"):
        fp8jax.Fp8DotGeneral(CURRENT)(jnp.ones((32, 32)), jnp.ones((32, 32)), "ij,jk")


def test_misaligned_dims_fall_back_with_one_warning(key):
    op = fp8jax.Fp8DotGeneral(CURRENT)
    lhs, rhs = normal(key, (32, 40)), normal(key, (32, 40))  # K = 40
    fp8jax._ops.dot._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y1 = op(lhs, rhs, (((1,), (1,)), ((), ())))
        op(lhs, rhs, (((1,), (1,)), ((), ())))
    messages = [str(w.message) for w in caught if "K=40" in str(w.message)]
    assert len(messages) == 1 and "multiples of 16" in messages[0]
    np.testing.assert_allclose(y1, lhs @ rhs.T, rtol=1e-5, atol=1e-5)  # exact plain dot


def test_misaligned_rows_are_padded_and_run_fp8(key):
    """M=30 rows pad to 32 with zeros (the amax is unchanged) and run in FP8."""
    op = fp8jax.Fp8DotGeneral(CURRENT)
    lhs, rhs = normal(key, (30, 32)), normal(jax.random.fold_in(key, 1), (32, 32))
    dims = (((1,), (1,)), ((), ()))
    y = op(lhs, rhs, dims)
    assert y.shape == (30, 32)
    assert sqnr_db(y, lhs @ rhs.T) >= 25.0
    grad_fn = jax.grad(lambda a, op: jnp.sum(op(a, rhs, dims)), argnums=(0, 1))
    grad, state = grad_fn(lhs, op)
    assert sqnr_db(grad, jnp.ones((30, 32)) @ rhs) >= 25.0
    assert float(state.input_amax_history[0]) == float(jnp.max(jnp.abs(lhs)))
    report = fp8jax.fp8_gemm_report(lambda a: grad_fn(a, op), lhs, stage="lowered")
    assert len(report.gemms) == 3 and report.all_fp8, report


def test_on_unsupported_raise():
    op = fp8jax.Fp8DotGeneral(fp8jax.Fp8Config(selective=False, on_unsupported="raise"))
    with pytest.raises(ValueError, match="K=40"):
        op(jnp.ones((32, 40)), jnp.ones((32, 40)), (((1,), (1,)), ((), ())))


def test_stacked_state_must_be_sliced():
    op = fp8jax.Fp8DotGeneral(CURRENT, stack_shape=(3,))
    with pytest.raises(ValueError, match="stack shape"):
        op(jnp.ones((32, 32)), jnp.ones((32, 32)), (((1,), (1,)), ((), ())))


def test_linear_rejects_wrong_input_width(key):
    import equinox as eqx

    layer = fp8jax.fp8_linear_layers(eqx.nn.Linear(32, 32, key=key), CURRENT)
    with pytest.raises(ValueError, match=r"\(\.\.\., 32\), got \(8, 16\)"):
        layer(jnp.ones((8, 16)))


@pytest.mark.parametrize("m", [32, 30])  # FP8 path and plain fallback
def test_gradients_come_back_in_operand_dtypes(key, m):
    op = fp8jax.Fp8DotGeneral(CURRENT)
    lhs, rhs = normal(key, (m, 32), jnp.bfloat16), normal(key, (48, 32), jnp.float32)
    dn = (((1,), (1,)), ((), ()))
    assert op(lhs, rhs, dn).dtype == jnp.float32  # like lax.dot_general's promotion
    g_lhs, g_rhs = jax.grad(lambda a, b: jnp.sum(op(a, b, dn)), argnums=(0, 1))(lhs, rhs)
    assert g_lhs.dtype == jnp.bfloat16 and g_rhs.dtype == jnp.float32


def test_gemm_tuning_holds_in_its_block_and_keys_the_ops_trace(key):
    """`fp8jax._kernels.gemm.tuning` changes the next trace of the FP8 op though the op's
    forward was traced already (its cached trace is keyed by the tuning), and ends with its
    ``with`` block."""
    from fp8jax._kernels import gemm as _gemm

    op = fp8jax.Fp8DotGeneral(CURRENT)
    lhs, rhs = normal(key, (64, 32)), normal(jax.random.fold_in(key, 1), (48, 32))
    dn = (((1,), (1,)), ((), ()))

    def bitcasts():  # `gemm_scale` rounds a scale to bf16 (bit operations) for scaled_gemm
        jaxpr = jax.make_jaxpr(lambda a, b: op(a, b, dn))(lhs, rhs)  # a new outer trace
        return str(jaxpr).count("bitcast_convert_type")

    assert _gemm.current_tuning() == _gemm.Tuning()
    default = bitcasts()
    with _gemm.tuning(scaled_gemm=False) as tuning:
        assert _gemm.current_tuning() is tuning and not tuning.scaled_gemm
        assert default and not bitcasts()
    assert bitcasts() == default and _gemm.current_tuning() == _gemm.Tuning()
    with pytest.raises(TypeError):
        with _gemm.tuning(no_such_choice=True):
            pass
