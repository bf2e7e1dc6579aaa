"""The one-pass cast + transpose + amax kernel and the FP8 GEMM accumulation choice.

The kernel body runs in Pallas interpret mode on CPU (bit-for-bit against the XLA
cast); `test_gpu.py` checks the compiled Triton kernel on the GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax._kernels import cast as _cast_kernel
from fp8jax._kernels import gemm as _gemm
from fp8jax import _quant as q
from helpers import normal

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _bits(a):
    return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape", [(1, 64, 96), (3, 128, 32)])
def test_interpret_kernel_matches_xla_cast_bit_for_bit(key, dtype, shape):
    x = normal(key, shape, jnp.bfloat16, scale=7.0)
    scale = jnp.array([0.9 * float(q.amax(x)) / float(jnp.finfo(dtype).max)], jnp.float32)
    rows, cols, amax = _cast_kernel.cast_transpose(x, scale, dtype, interpret=True)
    expected = q.quantize(x, scale, dtype)
    assert rows.shape == shape and cols.shape == (shape[0], shape[2], shape[1])
    np.testing.assert_array_equal(_bits(rows), _bits(expected))
    np.testing.assert_array_equal(_bits(cols), _bits(jnp.swapaxes(expected, 1, 2)))
    assert float(amax) == float(q.amax(x))
    # The scale leaves headroom only for 90% of the amax: the largest values saturate.
    assert float(jnp.max(jnp.abs(rows.astype(jnp.float32)))) == float(jnp.finfo(dtype).max)


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_interpret_kernel_amax_is_non_finite_for_bad_values(key, bad):
    x = normal(key, (1, 64, 64), jnp.float32).at[0, 5, 9].set(bad)
    _, _, amax = _cast_kernel.cast_transpose(x, jnp.ones((1,), jnp.float32), E4M3, interpret=True)
    assert not np.isfinite(float(amax))
    finite, flag = q.sanitize_amax(amax)
    assert float(finite) == 0.0 and float(flag) == 1.0


def test_kernel_rejects_shapes_it_cannot_tile(key):
    with pytest.raises(ValueError, match=r"\(1, 48, 64\)"):
        _cast_kernel.cast_transpose(normal(key, (1, 48, 64)), jnp.ones((1,)), E4M3, interpret=True)
    ok, why = _cast_kernel.supported((1, 48, 64))
    assert not ok and why


def test_cast_kernel_setting_falls_back_where_it_cannot_run(key):
    """With the kernel asked for, a device or shape it cannot take runs the XLA cast,
    and a layer with ``Fp8Config(cast_kernel=True)`` trains as with the default."""
    x = normal(key, (1, 48, 64), jnp.bfloat16)
    rows, cols, amax = _gemm.quantize_both(x, jnp.array([0.01]), E4M3, cast_kernel=True)
    np.testing.assert_array_equal(_bits(cols), _bits(jnp.swapaxes(rows, 1, 2)))
    assert float(amax) == float(q.amax(x))
    xs, w = normal(key, (64, 32), jnp.bfloat16), normal(key, (48, 32), jnp.bfloat16)
    dn = (((1,), (1,)), ((), ()))
    grads = [jax.grad(lambda x, w, op=fp8jax.Fp8DotGeneral(fp8jax.Fp8Config(selective=False, cast_kernel=ck)):
                      jnp.sum(op(x, w, dn).astype(jnp.float32) ** 2), argnums=(0, 1))(xs, w) for ck in (False, True)]
    for a, b in zip(*grads):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _dot_precisions(config, key):
    op = fp8jax.Fp8DotGeneral(config)
    x, w = normal(key, (64, 32), jnp.bfloat16), normal(key, (48, 32), jnp.bfloat16)
    dn = (((1,), (1,)), ((), ()))
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(op(x, w, dn).astype(jnp.float32)), argnums=(0, 1)))(x, w)
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general" and eqn.invars[0].aval.dtype.itemsize == 1:
                found.append(eqn.params["precision"])
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", None)
                if inner is not None:
                    walk(getattr(inner, "jaxpr", inner))

    walk(jaxpr.jaxpr)
    return found


def _is_highest(precision):
    return precision is not None and all(p == jax.lax.Precision.HIGHEST for p in
                                         (precision if isinstance(precision, tuple) else (precision,)))


@pytest.mark.parametrize("mode, fast_fwd, fast_bwd", [("forward", True, False), ("all", True, True),
                                                      ("none", False, False)])
def test_fast_accumulation_sets_the_fp8_gemm_precision(key, mode, fast_fwd, fast_bwd):
    """Forward first, then dgrad and wgrad: HIGHEST (promoted accumulation) unless fast."""
    config = fp8jax.Fp8Config(selective=False, fast_accumulation=mode)
    precisions = _dot_precisions(config, key)
    assert len(precisions) == 3, precisions
    assert [not _is_highest(p) for p in precisions] == [fast_fwd, fast_bwd, fast_bwd]


def test_new_config_fields_are_validated():
    with pytest.raises(ValueError, match="fast_accumulation"):
        fp8jax.Fp8Config(fast_accumulation="sometimes")
    with pytest.raises(ValueError, match="cast_kernel"):
        fp8jax.Fp8Config(cast_kernel="yes")


def test_combined_max_reduces_scalars_and_tile_maxima_together(key):
    """`q.combined_max`: one ``[n]`` of per-argument maxima, whatever each one's size;
    a NaN or Inf stays non-finite."""
    tiles = jnp.abs(normal(key, (4, 8), jnp.float32))
    scalar, row = jnp.float32(3.5), jnp.abs(normal(jax.random.fold_in(key, 1), (5,), jnp.float32))
    got = q.combined_max(tiles, scalar, row)
    np.testing.assert_array_equal(got, [jnp.max(tiles), 3.5, jnp.max(row)])
    np.testing.assert_array_equal(q.combined_max(scalar, jnp.float32(2.0)), [3.5, 2.0])
    for bad in (jnp.nan, jnp.inf):
        got = q.combined_max(tiles.at[1, 2].set(bad), scalar)
        assert not np.isfinite(float(got[0])) and float(got[1]) == 3.5


def test_interpret_kernel_tile_maxima_reduce_to_the_amax(key):
    x = normal(key, (2, 128, 64), jnp.bfloat16, scale=3.0)
    _, _, tiles = _cast_kernel.cast_transpose(x, jnp.ones((1,)), E4M3, interpret=True, tiles=True)
    assert tiles.size > 1
    assert float(jnp.max(tiles)) == float(q.amax(x))


def test_state_from_the_kernels_tile_maxima_matches_the_xla_cast(key, monkeypatch):
    """The per-tensor op with the cast kernel (compiled on a GPU, its body in interpret mode
    elsewhere) records the same amaxes and scales as with XLA's cast: its tile maxima are
    reduced in the backward's state update (`q.combined_max`), not after each cast."""
    x, w = normal(key, (128, 64), jnp.bfloat16, scale=2.0), normal(key, (64, 64), jnp.bfloat16)
    dn = (((1,), (1,)), ((), ()))

    def grads(cast_kernel):
        op = fp8jax.Fp8DotGeneral(fp8jax.Fp8Config(selective=False, cast_kernel=cast_kernel))
        loss = lambda op, x, w: jnp.sum(op(x, w, dn).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(op, x, w)

    xla = grads(False)
    calls, original = [], _cast_kernel.cast_transpose
    interpret = jax.default_backend() != "gpu"

    def kernel_cast(t, scale, dtype, tiles=False):
        calls.append(tiles)
        return original(t, scale, dtype, interpret=interpret, tiles=tiles)

    monkeypatch.setattr(_cast_kernel, "supported", lambda shape, *a, **k: (True, ""))
    monkeypatch.setattr(_cast_kernel, "cast_transpose", kernel_cast)
    kernel = grads(True)
    assert len(calls) >= 3 and all(calls)  # x, w, g, each with its tile maxima
    for new, old in zip(kernel[0].state(), xla[0].state()):
        np.testing.assert_array_equal(new, old)
    assert float(kernel[0].input_amax_history[0]) == float(q.amax(x)) > 0
    for a, b in zip(kernel[1:], xla[1:]):  # the same FP8 bits into the same GEMMs
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-2 * np.abs(b).max())


def test_gemm_scale_rounds_up_to_the_bf16_grid_once(key):
    """`gemm_scale`: the smallest bf16 value >= the scale (never a smaller scale, so the cast
    cannot overflow), exact on bf16 values, idempotent."""
    scale = jnp.abs(normal(key, (64,), jnp.float32)) + 1e-3
    rounded = _gemm.gemm_scale(scale)
    assert bool(jnp.all(rounded >= scale))
    np.testing.assert_array_equal(rounded, rounded.astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(_gemm.gemm_scale(rounded), rounded)
    step = jnp.ldexp(1.0, jnp.frexp(scale)[1] - 8)  # one bf16 ulp at the scale's binade
    assert bool(jnp.all(rounded - scale < step))
    exact = jnp.array([0.5, 3.0, 2.0**-20], jnp.float32)
    np.testing.assert_array_equal(_gemm.gemm_scale(exact), exact)


def test_cublaslt_takes_scales_only_of_kernel_cast_bf16_gemms(monkeypatch):
    """`takes_scales`: only on the GPU, with the cast kernel on, a bf16 output, and both
    operands of shapes the kernel casts (the others keep the multiply after the GEMM)."""
    ok, bad = (1, 256, 512), (1, 250, 512)
    on_gpu = jax.default_backend() == "gpu"
    assert _gemm.takes_scales(ok, ok, True) == on_gpu  # this machine, unpatched
    monkeypatch.setattr(_gemm.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(_cast_kernel, "supported", lambda shape, *a, **k: (shape[1] % 32 == 0, ""))
    assert _gemm.takes_scales(ok, ok, True)
    assert not _gemm.takes_scales(ok, bad, True)
    assert not _gemm.takes_scales(ok, ok, False)
    assert not _gemm.takes_scales(ok, ok, True, jnp.float32)
    with _gemm.tuning(scaled_gemm=False):
        assert not _gemm.takes_scales(ok, ok, True)
