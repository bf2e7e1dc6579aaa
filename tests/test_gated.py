"""fp8jax._ops.gated: the gated FP8 MLP core (one custom VJP, Pallas activation kernels)."""

import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax._kernels import gated_activation as _act
from fp8jax._ops import gated as _gated
from fp8jax.nn import FusedMLP
from fp8jax.nn import _mlp as mlp_module
from helpers import normal, sqnr_db, take_state
from test_mlp import _grad_ref, _grads, _np_act, _params, _reference

HIDDEN, FFN, TOKENS = 64, 128, 128
DELAYED = fp8jax.Fp8Config(selective=False)
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


@pytest.fixture
def mode():
    """Set the activation's mode (`_act.tuning`) for the rest of one test."""
    with contextlib.ExitStack() as stack:
        yield lambda value: stack.enter_context(_act.tuning(activation=value))


def _block(key, activation="swiglu", **kw):
    mlp = FusedMLP(HIDDEN, FFN, activation=activation, norm="rmsnorm", config=kw.pop("config", DELAYED), key=key, **kw)
    return eqx.tree_at(lambda m: m.norm_weight, mlp, 1.0 + 0.2 * normal(jax.random.fold_in(key, 1), (HIDDEN,)))


def _bits(a):
    """FP8 bytes, with -0 read as +0 (0x80 -> 0: XLA and the kernel may sign a product with
    relu's zero differently; a GEMM cannot tell them apart)."""
    bits = np.asarray(a).view(np.uint8).copy()
    bits[bits == 0x80] = 0
    return bits


# ----------------------------------------------------------------------------- layout and kernels
def test_interleave_round_trip_and_halves(key):
    w1 = normal(key, (2 * FFN, HIDDEN))
    w1i = _gated.interleave(w1)
    np.testing.assert_array_equal(_gated.deinterleave(w1i), w1)
    x = normal(jax.random.fold_in(key, 1), (TOKENS, HIDDEN))
    gate, up = _act._halves(x @ w1i.T)
    np.testing.assert_allclose(gate, x @ w1[:FFN].T, rtol=1e-5, atol=1e-5)  # natural [gate | up] order back
    np.testing.assert_allclose(up, x @ w1[FFN:].T, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(_act._join(gate, up), x @ w1i.T)


@pytest.mark.parametrize("activation", _gated.ACTIVATIONS)
def test_gate_functions_and_derivatives_match_jax(activation):
    """The kernels' hand-written ``act`` and ``act'`` (exp and arithmetic only) against the
    float64 oracle of the MLP tests and its central differences."""
    x = np.concatenate([np.linspace(-8.0, 8.0, 4001), [-1e-3, 1e-3, 30.0, -30.0]])
    x = x[np.abs(x) > 1e-4]  # not across relu's kink
    ones = np.ones_like(x)
    ref = lambda v: _np_act(activation, np.concatenate([v, ones]))  # act(v) * 1  # noqa: E731
    step = 1e-5
    dref = (ref(x + step) - ref(x - step)) / (2 * step)
    act, dact = _act._gate(activation, jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(act, ref(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dact, dref, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="gelu"):
        _act._gate("gelu", x)


@pytest.mark.parametrize("activation,poison", [("swiglu", None), ("swiglu", jnp.nan), ("swiglu", jnp.inf),
                                                *((a, None) for a in _gated.ACTIVATIONS[1:])])
def test_kernels_in_interpret_mode_equal_the_plain_jax_path(key, mode, activation, poison):
    kh, kd = jax.random.split(key)
    h = (normal(kh, (TOKENS, 2 * FFN)) * 300).astype(jnp.bfloat16)
    da = (normal(kd, (TOKENS, FFN)) * 50).astype(jnp.bfloat16)
    if poison is not None:
        h = h.at[3, 5].set(poison)
    h_scale, a_scale, da_scale, dh_scale = (jnp.array([v], jnp.float32) for v in (0.01, 0.02, 0.003, 0.0005))
    out = {}
    for m in ("xla", "interpret"):
        mode(m)
        out[m] = (_gated.activation_fp8(h, h_scale, a_scale, E4M3, activation),
                  _gated.activation_grad_fp8(h, h_scale, da, da_scale, dh_scale, E5M2, a_scale, E4M3, activation))
        aq_only, no_transpose, amax_only = _gated.activation_fp8(h, h_scale, a_scale, E4M3, activation, transposed=False)
        assert no_transpose is None
        np.testing.assert_array_equal(_bits(aq_only), _bits(out[m][0][0]))
        np.testing.assert_array_equal(np.asarray(amax_only), np.asarray(out[m][0][2]))
    # the backward's recomputed FP8 activation is the forward's, bit for bit
    np.testing.assert_array_equal(_bits(out["interpret"][1][3]), _bits(out["interpret"][0][1]))
    np.testing.assert_array_equal(_bits(out["xla"][1][3]), _bits(out["xla"][0][1]))
    # the forward's transposed copy is in h's interleaved order, the backward's in natural order
    for reorder, (aq, at, aa, *_), (kq, kt, ka, *_) in zip((lambda t: t, _gated.deinterleave), out["xla"],
                                                          out["interpret"]):
        np.testing.assert_array_equal(_bits(kq), _bits(aq))
        np.testing.assert_array_equal(_bits(kt), _bits(at))
        np.testing.assert_array_equal(_bits(kt), _bits(reorder(jnp.swapaxes(kq, 0, 1))))
        ka, aa = float(jnp.max(ka)), float(jnp.max(aa))  # the kernels' per-tile maxima
        if poison is None:
            assert np.isfinite(ka) and ka > 0
            np.testing.assert_allclose(ka, aa, rtol=1e-6)
        else:
            assert not np.isfinite(ka) and not np.isfinite(aa)


# ----------------------------------------------------------------------------- the MLP core
# One activation in interpret mode: the kernels of every activation are checked against the XLA
# path bit for bit (test_kernels_in_interpret_mode_equal_the_plain_jax_path), the core with each.
@pytest.mark.parametrize("m,activation", [("xla", "swiglu"), ("interpret", "swiglu"),
                                          *(("xla", a) for a in _gated.ACTIVATIONS[1:])])
def test_core_matches_float_references_and_xla_path(key, mode, m, activation):
    mode(m)
    kx, km, kc = jax.random.split(key, 3)
    mlp = _block(km, activation, residual=True)
    x = normal(kx, (2, TOKENS // 2, HIDDEN), scale=2.0)
    c = normal(kc, (2, TOKENS // 2, HIDDEN))
    assert mlp_module._gated_core_runs(mlp, x)
    for _ in range(2):  # the second step runs with calibrated delayed scales
        grads = _grads(mlp, x, c)
        mlp = take_state(mlp, grads[0])
    assert sqnr_db(mlp(x), _reference(_params(mlp), x, "rmsnorm", activation, residual=True)) >= 35.0
    assert sqnr_db(mlp(x) - x, mlp_module._checkpointed_call(mlp, x) - x) >= 28.0  # the XLA path, same state
    (g_ref, gx_ref), (g_model, g_x) = _grad_ref(mlp, x, c), _grads(mlp, x, c)
    # relu's gradient mask flips where FP8 noise changes the sign of fc1's output near zero,
    # which a float reference cannot reproduce: the same floor as the XLA path's tests (test_mlp).
    floor = 12.0 if activation == "reglu" else 19.0
    assert sqnr_db(g_x, gx_ref + c) >= 30.0  # + c: the residual's gradient, not in the reference block
    for name, threshold in (("norm_weight", min(floor, 16.0)), ("w1", floor), ("w2", 19.0)):
        assert sqnr_db(_params(g_model)[name], _params(g_ref)[name]) >= threshold, name


@pytest.mark.parametrize("m", ["xla", "interpret", "kernel"])
def test_gate_block_layouts_compute_the_same_block(key, mode, m):
    """fc1 rows as ``[gate | up]`` or interleaved (`FusedMLP.gate_block`: the core's own 64,
    and 128, 32 and 16, which it relayouts): the same loss, and fc1's gradient in each layout's
    own row order, equal to the halves' one bit for bit (a row permutation of the same
    math); the XLA path the same at 64."""
    if m == "kernel" and not _gated._cast_kernel.supported((1, TOKENS, 2 * FFN))[0]:
        pytest.skip("compiled Pallas kernels need a Hopper GPU")
    mode(m)
    kx, km, kc = jax.random.split(key, 3)
    mlp = _block(km, fc1_bias=False)
    x, c = normal(kx, (TOKENS, HIDDEN), scale=2.0), normal(kc, (TOKENS, HIDDEN))
    loss = lambda m, x: jnp.sum(m(x) * c)  # noqa: E731
    ref_loss, ref_grad = eqx.filter_value_and_grad(loss)(mlp, x)
    for block in (64, 128, 32, 16):
        other = mlp.with_gate_block(block)
        assert other.gate_block == block and mlp_module._gated_core_runs(other, x)
        value, grad = eqx.filter_value_and_grad(loss)(other, x)
        assert float(value) == float(ref_loss)
        back = mlp_module.relayout_rows(grad.fc1.weight, -2, block, None)
        np.testing.assert_array_equal(back, ref_grad.fc1.weight)
        np.testing.assert_array_equal(grad.fc2.weight, ref_grad.fc2.weight)
    np.testing.assert_array_equal(mlp.with_gate_block(64).with_gate_block(None).fc1.weight, mlp.fc1.weight)
    xla = mlp_module._checkpointed_call
    np.testing.assert_allclose(xla(mlp.with_gate_block(64), x), xla(mlp, x), rtol=1e-6, atol=1e-6)


def test_bad_gate_block_raises(key):
    with pytest.raises(ValueError, match=r"gate_block=48 must divide ffn=128"):
        FusedMLP(HIDDEN, FFN, gate_block=48, key=key)
    with pytest.raises(ValueError, match=r"activation 'gelu' is not gated"):
        FusedMLP(HIDDEN, FFN, activation="gelu", gate_block=64, key=key)
    with pytest.raises(ValueError, match=r"positive int, got 0"):
        FusedMLP(HIDDEN, FFN, key=key).with_gate_block(0)


def test_core_writes_the_same_state_as_the_xla_path(key, mode):
    mode("xla")
    kx, km = jax.random.split(key)
    mlp = _block(km)
    x = normal(kx, (TOKENS, HIDDEN))
    loss = lambda m, x: jnp.sum(m(x) ** 2)  # noqa: E731
    loss_xla = lambda m, x: jnp.sum(mlp_module._checkpointed_call(m, x) ** 2)  # noqa: E731
    new, old = eqx.filter_grad(loss)(mlp, x), eqx.filter_grad(loss_xla)(mlp, x)
    for layer in ("fc1", "fc2"):
        a, b = getattr(new, layer).dot_general, getattr(old, layer).dot_general
        for field in ("input_amax_history", "kernel_amax_history", "output_grad_amax_history", "input_scale",
                      "kernel_scale", "output_grad_scale"):
            np.testing.assert_allclose(getattr(a, field), getattr(b, field), rtol=0.05, err_msg=f"{layer}.{field}")
            assert float(jnp.max(getattr(a, field))) > 0, (layer, field)
    # A second step from the recorded histories chooses scales off the bf16 grid; both paths
    # record them as chosen, not the rounded copies the casts and GEMMs take
    # (`fp8jax._kernels.gemm.gemm_scale`).
    overwrites, _ = fp8jax.partition_for_grad_overwrite(new)
    mlp = fp8jax.apply_updates(mlp, None, overwrites)
    new, old = eqx.filter_grad(loss)(mlp, x), eqx.filter_grad(loss_xla)(mlp, x)
    for layer in ("fc1", "fc2"):
        a, b = getattr(new, layer).dot_general, getattr(old, layer).dot_general
        for field in ("input_scale", "kernel_scale", "output_grad_scale"):
            value = getattr(a, field)
            assert float(fp8jax._kernels.gemm.gemm_scale(value)[0]) != float(value[0]), (layer, field)
            np.testing.assert_array_equal(value, getattr(b, field), err_msg=f"{layer}.{field}")


def test_core_keeps_nonfinite_out_of_the_state(key, mode):
    mode("interpret")
    kx, km = jax.random.split(key)
    mlp = _block(km)
    x = normal(kx, (TOKENS, HIDDEN)).at[7, 3].set(jnp.inf)
    grads = eqx.filter_grad(lambda m, x: jnp.sum(m(x)))(mlp, x)
    new = take_state(mlp, grads)
    for layer in (new.fc1.dot_general, new.fc2.dot_general):
        assert float(layer.nonfinite_count[0]) == 1.0
        for field in ("input_scale", "kernel_scale", "output_grad_scale", "input_amax_history",
                      "kernel_amax_history", "output_grad_amax_history"):
            assert np.all(np.isfinite(np.asarray(getattr(layer, field)))), field


def test_core_runs_only_where_it_applies(key, mode):
    kx, km = jax.random.split(key)
    x = normal(kx, (TOKENS, HIDDEN))
    mode("auto")  # no Hopper GPU here: the XLA path
    assert not mlp_module._gated_core_runs(_block(km), x) or jax.devices()[0].platform == "gpu"
    assert set(_gated.GPU_TESTED) <= set(_gated.ACTIVATIONS)
    assert not mlp_module._gated_core_runs(_block(km, "geglu"), x) or jax.devices()[0].platform == "gpu"
    mode("xla")
    assert mlp_module._gated_core_runs(_block(km), x)
    assert not mlp_module._gated_core_runs(_block(km, config=fp8jax.Fp8Config(scaling="current", selective=False)), x)
    assert not mlp_module._gated_core_runs(_block(km, fc1_bias=True), x)
    assert not mlp_module._gated_core_runs(_block(km), x[:100])  # tokens not a multiple of the tile
    for activation in ("geglu", "reglu"):
        assert mlp_module._gated_core_runs(_block(km, activation), x)
    for activation in ("gelu", "silu", "relu"):  # ungated: XLA's fusions
        assert not mlp_module._gated_core_runs(FusedMLP(HIDDEN, FFN, activation=activation, config=DELAYED, key=km), x)
    # Under vmap the per-example trace does not take the core; results still agree.
    mlp = _block(km)
    xs = x.reshape(2, TOKENS // 2, HIDDEN)
    np.testing.assert_allclose(jax.vmap(mlp)(xs), mlp_module._checkpointed_call(mlp, xs), rtol=1e-5, atol=1e-5)


def test_activation_tuning_is_checked_and_ends_with_its_block():
    """`fp8jax._kernels.gated_activation.tuning`: its values inside the block, the defaults
    after; a mode it does not know is refused."""
    with _act.tuning(activation="xla", rows=128) as tuning:
        assert _act.current_tuning() is tuning
        assert _act._rows(256) == 128 and _act._rows(192) == _act.BLOCK
    assert _act.current_tuning() == _act.Tuning() and _act._rows(256) == 32
    with pytest.raises(ValueError, match="activation must be one of"):
        _act.Tuning(activation="fast")
