"""The block-wise recipe's one-pass cast (`fp8jax._kernels.tile_cast`) against the XLA path
(`fp8jax._recipe.tile_cast` twice). The kernel body runs in Pallas interpret mode on CPU;
the GPU test runs the compiled Triton kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gpu

from fp8jax import _quant as quant, _recipe as recipe
from fp8jax._kernels import tile_cast as tc

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _outlier_rows(key, shape, dtype=jnp.bfloat16):
    """Normal values times a per-row factor spanning e^-9..e^9: tiles of very different
    scales, and values in FP8's subnormal range after the cast."""
    k1, k2 = jax.random.split(key)
    spread = jnp.exp(3 * jax.random.normal(k2, (*shape[:2], 1)))
    return (jax.random.normal(k1, shape) * spread).astype(dtype)


def _xla_cast(t, dtype, power_of_two, weight):
    if weight:
        data, scale, amax = recipe.tile_cast(t, dtype, 128, 128, power_of_two=power_of_two)
        return data, scale, jnp.swapaxes(data, 1, 2), jnp.swapaxes(scale, 1, 2), amax
    data, scale, amax = recipe.tile_cast(t, dtype, 1, 128, power_of_two=power_of_two)
    data_t, scale_t, _ = recipe.tile_cast(
        jnp.swapaxes(t, 1, 2), dtype, 1, 128, power_of_two=power_of_two
    )
    return data, scale, data_t, scale_t, amax


def _f32(x):
    return np.asarray(x.astype(jnp.float32))


def _assert_same_cast(got, want, exact: bool):
    """Scales and amax equal; FP8 values equal, or (division rounded differently) at most
    one FP8 step apart in under 0.1% of the elements."""
    names = ("data", "scale", "data_t", "scale_t", "amax")
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape)
        g, w = _f32(g), _f32(w)
        if exact or "data" not in name:
            np.testing.assert_array_equal(g, w, err_msg=name)
            continue
        differ = g != w
        assert differ.mean() < 1e-3, (name, differ.mean())
        step = np.abs(w[differ]) * 2.0**-2 + 2.0**-9  # e4m3: 3 mantissa bits, subnormal 2^-9
        assert np.all(np.abs(g[differ] - w[differ]) <= step), name


@pytest.mark.parametrize("weight", [False, True])
@pytest.mark.parametrize("power_of_two", [True, False])
def test_interpret_kernel_matches_xla_cast(key, weight, power_of_two):
    t = _outlier_rows(key, (2, 128, 256))
    got = tc.cast_both(t, E4M3, 128, power_of_two=power_of_two, weight=weight, interpret=True)
    _assert_same_cast(got, _xla_cast(t, E4M3, power_of_two, weight), exact=power_of_two)


def test_interpret_kernel_keeps_nonfinite_out_of_scales(key):
    t = _outlier_rows(key, (1, 128, 256), jnp.float32).at[0, 3, 5].set(jnp.nan)
    t = t.at[0, 70, 200].set(-jnp.inf)
    data, scale, data_t, scale_t, amax = tc.cast_both(t, E5M2, 128, interpret=True)
    assert not np.isfinite(float(amax))
    for s in (scale, scale_t):
        assert np.all(np.isfinite(_f32(s))) and np.all(_f32(s) > 0)
    assert float(scale[0, 3, 0]) == 1.0 and float(scale_t[0, 5, 0]) == 1.0  # the NaN's tiles
    assert float(scale[0, 70, 1]) == 1.0 and float(scale_t[0, 200, 0]) == 1.0
    clean = _xla_cast(t.at[0, 3, 5].set(0.0).at[0, 70, 200].set(0.0), E5M2, False, False)
    assert _f32(scale)[0, 4, 0] == _f32(clean[1])[0, 4, 0]  # other rows keep their scales


def test_bad_shapes_and_block_sizes_get_clear_errors(key):
    t = jax.random.normal(key, (1, 192, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"\(1, 192, 256\).*multiples of 128"):
        tc.cast_both(t, E4M3, 128, interpret=True)
    with pytest.raises(ValueError, match="block_size 96"):
        tc.cast_both(t, E4M3, 96, interpret=True)
    assert tc.shape_reason((1, 192, 256), 64) is None
    if jax.devices()[0].platform != "gpu":
        assert "no GPU" in tc.reason((1, 256, 256), 128)


def test_ceil_power_of_two_is_exact():
    s = jnp.array([1.0, 1.5, 2.0, 2.0**-126, 3.0 * 2.0**-100, 0.75, 2.0**100 * 1.01], jnp.float32)
    want = np.array([1.0, 2.0, 2.0, 2.0**-126, 2.0**-98, 1.0, 2.0**101], np.float32)
    np.testing.assert_array_equal(np.asarray(quant.ceil_power_of_two(s)), want)


@gpu
@pytest.mark.parametrize("weight", [False, True])
@pytest.mark.parametrize("power_of_two", [True, False])
def test_kernel_matches_xla_cast_on_gpu(key, weight, power_of_two):
    t = _outlier_rows(key, (1, 1024, 768))
    got = jax.jit(lambda t: tc.cast_both(t, E4M3, 128, power_of_two=power_of_two, weight=weight))(t)
    want = jax.jit(lambda t: _xla_cast(t, E4M3, power_of_two, weight))(t)
    _assert_same_cast(got, want, exact=power_of_two)
    # A NaN stays NaN in both layouts, as in XLA's cast (Triton's clamp alone gives the bound)
    bad = t.at[0, 5, 7].set(jnp.nan)
    data, _, data_t, _, amax = tc.cast_both(bad, E4M3, 128, power_of_two=power_of_two, weight=weight)
    assert np.isnan(_f32(data)[0, 5, 7]) and np.isnan(_f32(data_t)[0, 7, 5])
    assert not np.isfinite(float(amax))


def _xla_rows(t, dtype):
    data, scale, amax = recipe.tile_cast(t, dtype, 1, t.shape[2])
    data_t, scale_t, _ = recipe.tile_cast(jnp.swapaxes(t, 1, 2), dtype, 1, t.shape[1])
    return data, scale, data_t, scale_t, amax


def _kernel_rows(t, dtype, interpret=False):
    """The row-wise recipe's scales, then the kernel's cast with them."""
    rowwise = recipe.RowWise()
    row_amax, col_amax = rowwise.amaxes(t)
    scale, scale_t = rowwise.scales(row_amax, col_amax, dtype)
    data, data_t = tc.cast_rows_with(t, scale, scale_t, dtype, interpret=interpret)
    return data, scale, data_t, scale_t, jnp.max(row_amax)


def test_interpret_rowwise_cast_matches_xla_cast(key):
    t = _outlier_rows(key, (2, 128, 256))
    got = _kernel_rows(t, E4M3, interpret=True)
    _assert_same_cast(got, _xla_rows(t, E4M3), exact=False)
    bad = t.at[1, 5, 7].set(jnp.nan)
    _, scale, _, scale_t, amax = _kernel_rows(bad, E4M3, interpret=True)
    assert not np.isfinite(float(amax))
    assert float(scale[1, 5, 0]) == 1.0 and float(scale_t[1, 7, 0]) == 1.0
    assert np.all(np.isfinite(_f32(scale))) and np.all(np.isfinite(_f32(scale_t)))


@gpu
def test_rowwise_kernel_matches_xla_cast_on_gpu(key):
    t = _outlier_rows(key, (1, 1024, 768))
    got = jax.jit(lambda t: _kernel_rows(t, E4M3))(t)
    _assert_same_cast(got, jax.jit(lambda t: _xla_rows(t, E4M3))(t), exact=False)
    data, _, data_t, _, _ = _kernel_rows(t.at[0, 5, 7].set(jnp.nan), E4M3)
    assert np.isnan(_f32(data)[0, 5, 7]) and np.isnan(_f32(data_t)[0, 7, 5])


def test_rowwise_cast_with_bad_scales_names_shapes():
    t = jnp.ones((1, 128, 256))
    with pytest.raises(ValueError, match=r"scales \(1, 256, 1\) and \(1, 128, 1\) do not fit"):
        tc.cast_rows_with(t, jnp.ones((1, 256, 1)), jnp.ones((1, 128, 1)), E4M3, interpret=True)
