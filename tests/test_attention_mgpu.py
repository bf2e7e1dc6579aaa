"""The attention's ``"mgpu"`` backend (fp8jax's own Hopper FP8 flash attention) against the
reference backend's FP8 path (CPU, Pallas' interpreter) and cuDNN's (Hopper)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU
from helpers import calibrated_attention, normal, sqnr_db, take_state

import fp8jax
from fp8jax.nn import DotProductAttention, MultiHeadAttention
from fp8jax.nn._attention import TENSORS

F32 = jnp.float32
UNOBSERVED = ("s", "dp")  # amaxes inside the mgpu kernels: recorded as 0


def _inputs(key, b, t, n, nk, h):
    kq, kk, kv, kg = jax.random.split(key, 4)
    bf16 = jnp.bfloat16
    return (normal(kq, (b, t, n, h), bf16), normal(kk, (b, t, nk, h), bf16),
            normal(kv, (b, t, nk, h), bf16), normal(kg, (b, t, n, h), F32))  # fmt: skip


def _step(attn, q, k, v, g):
    """One train step: the output, the q/k/v gradients and the module with its new state."""

    def loss(attn, q, k, v):
        out = attn(q, k, v)
        return jnp.sum(out.astype(F32) * g), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(attn, q, k, v)
    return out, grads[1:], take_state(attn, grads[0])


def _compare(backend, base, key, shape, out_db=25.0, grad_db=20.0):
    """``backend`` against ``base`` from one calibrated state: output, gradients, state."""
    q, k, v, g = _inputs(key, *shape)
    calibrated = calibrated_attention(
        DotProductAttention("fp8_dpa", is_causal=True, backend=base), q, k, v, g
    )
    want, want_grads, want_new = _step(calibrated, q, k, v, g)
    other = DotProductAttention("fp8_dpa", is_causal=True, backend=backend, state=calibrated.state)
    got, got_grads, got_new = _step(other, q, k, v, g)
    assert got.dtype == want.dtype == jnp.bfloat16
    assert sqnr_db(got, want) >= out_db
    for name, a, b in zip("qkv", got_grads, want_grads):
        assert a.dtype == jnp.bfloat16 and sqnr_db(a, b) >= grad_db, name
    # The same state update: the scales it used and the amaxes it recorded.
    np.testing.assert_array_equal(got_new.state.scales, want_new.state.scales)
    for name in TENSORS:
        a = float(got_new.state.ordered_amax_history(name)[0])
        b = float(want_new.state.ordered_amax_history(name)[0])
        if name in UNOBSERVED and backend.startswith("mgpu"):
            assert a == 0.0 and b > 0, name
        else:
            assert a == pytest.approx(b, rel=0.05), name
        # the older entries are the calibration's, untouched
        np.testing.assert_array_equal(
            got_new.state.ordered_amax_history(name)[1:],
            want_new.state.ordered_amax_history(name)[1:],
        )


def _cpu_only():
    if ON_GPU:
        pytest.skip("the interpreter is the CPU check; the GPU runs the kernels themselves")


def test_mgpu_interpret_matches_reference_fp8(key):
    _cpu_only()
    _compare("mgpu-interpret", "reference", key, (1, 128, 2, 1, 64))


def test_mgpu_output_and_gradients_are_not_rounded_to_e4m3(key):
    """The kernels write bf16 O, dQ, dK, dV; the backend passes them on as they are (cuDNN
    writes e4m3): off the e4m3 grid of their recorded scales, and at least as close to
    float32 attention as the reference backend's e4m3-rounded ones."""
    _cpu_only()
    q, k, v, g = _inputs(key, 1, 128, 2, 1, 64)
    base = DotProductAttention("fp8_dpa", is_causal=True, backend="reference")
    calibrated = calibrated_attention(base, q, k, v, g)
    runs = {}
    for backend in ("reference", "mgpu-interpret"):
        attn = DotProductAttention("fp8_dpa", is_causal=True, backend=backend,
                                   state=calibrated.state)  # fmt: skip
        runs[backend] = _step(attn, q, k, v, g)
    out, grads, new = runs["mgpu-interpret"]
    for name, x in zip(("o", "dq", "dk", "dv"), (out, *grads)):
        scale = new.state.scales[TENSORS.index(name)]
        x8 = (x.astype(F32) / scale).astype(jnp.float8_e4m3fn)
        grid = (x8.astype(F32) * scale).astype(x.dtype)  # as the backend dequantizes
        assert float(jnp.mean(grid != x)) > 0.5, name  # most values off the grid

    def exact(q, k, v):
        s = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, 2, 2)) / 8.0
        s = jnp.where(jnp.tril(jnp.ones((128, 128), bool)), s, -jnp.inf)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, -1), jnp.repeat(v, 2, 2))

    f32 = tuple(x.astype(F32) for x in (q, k, v))
    want, vjp = jax.vjp(exact, *f32)
    want_grads = vjp(g)
    ref_out, ref_grads, _ = runs["reference"]
    assert sqnr_db(out, want) >= sqnr_db(ref_out, want)
    for a, r, w in zip(grads, ref_grads, want_grads):
        assert sqnr_db(a, w) >= sqnr_db(r, w) - 0.5


def test_mha_fp8_mha_on_mgpu_interpret(key):
    """`MultiHeadAttention` hands its backend to the core: fp8_mha on the kernels gives the
    reference backend's output (the same weights, a fresh state; the forward)."""
    _cpu_only()
    cfg = fp8jax.Fp8Config(selective=False)
    x = normal(key, (1, 128, 128))
    out = {}
    for backend in ("reference", "mgpu-interpret"):
        mha = MultiHeadAttention(128, 2, num_kv_heads=1, mode="fp8_mha", backend=backend,
                                 config=cfg, key=key)  # fmt: skip
        assert mha.attention.backend == backend
        out[backend] = eqx.filter_jit(lambda m, x: m(x))(mha, x)
    assert sqnr_db(out["mgpu-interpret"], out["reference"]) >= 25.0


@pytest.mark.parametrize(
    "kw, shape, kv_seq, match",
    [
        (dict(backend="mgpu"), (1, 128, 2, 1, 64), 128, "no GPU" if not ON_GPU else None),
        (dict(backend="mgpu-interpret"), (1, 128, 2, 1, 32), 128, "head_dim 32"),
        (dict(backend="mgpu-interpret"), (1, 96, 2, 1, 64), 96, "Sq=96"),
        (dict(backend="mgpu-interpret"), (1, 128, 2, 1, 64), 256, "causal with Sq=128 != Sk=256"),
        (dict(backend="mgpu-interpret", key_value_seq_lengths=jnp.array([100])),
         (1, 128, 2, 1, 64), 128, "padding mask"),
    ],
)  # fmt: skip
def test_mgpu_unsupported_raises_with_the_reason(key, kw, shape, kv_seq, match):
    if match is None:
        pytest.skip("a GPU: the kernels may run here")
    q, k, v, _ = _inputs(key, *shape)
    k, v = (jnp.concatenate([x, x], axis=1)[:, :kv_seq] for x in (k, v))
    attn = DotProductAttention("fp8_dpa", is_causal=True, backend=kw.pop("backend"))
    with pytest.raises(ValueError, match=f"backend='mgpu.*cannot run this call.*{match}"):
        attn(q, k, v, **kw)


def test_mgpu_in_bf16_mode_raises(key):
    """``backend="mgpu"`` runs the FP8 modes only: in bf16 mode it says so instead of
    running another kernel."""
    from fp8jax.nn import dot_product_attention

    q, k, v, _ = _inputs(key, 1, 128, 2, 1, 64)
    with pytest.raises(ValueError, match="runs the FP8 modes"):
        dot_product_attention(q, k, v, mode="bf16", is_causal=True, backend="mgpu")


def _hopper_reason():
    from fp8jax._ops import attention_mgpu

    return attention_mgpu.reason((2, 1024, 8, 128), (2, 1024, 8, 128), True, False)


@pytest.mark.skipif(not ON_GPU or _hopper_reason() is not None, reason="needs a Hopper GPU")
def test_mgpu_matches_cudnn_fp8_on_hopper(key):
    _compare("mgpu", "cudnn", key, (2, 1024, 8, 8, 128))


def test_auto_picks_mgpu_for_causal_calls_it_can_run(monkeypatch):
    """"auto" runs the mgpu kernels for a causal call on one device's arrays where they can
    run it (a Hopper GPU, pretended on a CPU), cuDNN's path (the reference on a CPU)
    otherwise: not causal, a split over devices, padding, or several devices and no
    shard_map around the call."""
    from fp8jax._kernels import dispatch
    from fp8jax._ops import attention_mgpu
    from fp8jax.nn import _attention as A

    q = k = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
    choose = A._choose_backend
    cudnn = "cudnn" if ON_GPU else "reference"  # auto's choice without the mgpu kernels
    assert choose("auto", q, k, False, True, None) == ("mgpu" if ON_GPU else "reference")
    monkeypatch.setattr(attention_mgpu, "reason", lambda *a: None)
    monkeypatch.setattr(dispatch, "unpartitioned_reason", lambda: None)
    assert choose("auto", q, k, False, True, None) == "mgpu"
    assert choose("auto", q, k, False, False, None) == cudnn
    assert choose("auto", q[:, :128], k, False, False, None) == cudnn
    split = object()
    assert choose("auto", q, k, False, True, split) == cudnn
    if ON_GPU:  # cuDNN asked for: no override
        assert choose("cudnn", q, k, False, True, None) == "cudnn"
    else:
        with pytest.raises(ValueError, match="cannot run"):
            choose("cudnn", q, k, False, True, None)
    monkeypatch.setattr(dispatch, "unpartitioned_reason", lambda: "8 devices, no shard_map")
    assert choose("auto", q, k, False, True, None) == cudnn
    monkeypatch.setattr(A, "AUTO_MGPU", False)
    monkeypatch.setattr(dispatch, "unpartitioned_reason", lambda: None)
    assert choose("auto", q, k, False, True, None) == cudnn
    # padding: the mgpu kernels have no mask (cuDNN's FP8 neither: the reference)
    assert choose("auto", q, k, True, True, None) == "reference"


def test_gemm_report_counts_the_flash_attention_kernels_as_fp8():
    """A Mosaic GPU call under the attention kernels' named scope is an FP8 GEMM in
    `fp8jax.fp8_gemm_report` (its float32 side inputs dropped); one outside it is none."""
    from helpers import mosaic_calls_hlo

    from fp8jax._ops.attention_mgpu import FLASH_SCOPE
    from fp8jax.inspect import parse_gemms

    hlo = mosaic_calls_hlo(FLASH_SCOPE, ["f8e4m3fn", "f8e4m3fn", "f8e4m3fn", "f32"])
    (gemm,) = parse_gemms(hlo)
    assert gemm.is_fp8 and gemm.operand_types == ("f8e4m3fn", "f8e4m3fn")
