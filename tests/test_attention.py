"""FP8 attention: numerics of the reference backend against float32, state updates,
modules, vmap, errors. (The cuDNN backend is checked on the GPU in test_gpu.py.)"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.nn import DotProductAttention, Fp8AttentionState, MultiHeadAttention, dot_product_attention
from fp8jax.nn._attention import TENSORS
from helpers import attention_loss as _loss
from helpers import calibrated_attention as _calibrated
from helpers import normal, recorded, sqnr_db, take_state

F32 = jnp.float32


def _qkv(key, b=2, t=64, n=4, nk=2, h=32, s=None, dtype=F32):
    kq, kk, kv, kg = jax.random.split(key, 4)
    s = t if s is None else s
    return (normal(kq, (b, t, n, h), dtype), normal(kk, (b, s, nk, h), dtype), normal(kv, (b, s, nk, h), dtype),
            normal(kg, (b, t, n, h), dtype, scale=1e-3))


def _exact(q, k, v, causal, q_len=None, kv_len=None):
    with jax.default_matmul_precision("float32"):
        return jax.nn.dot_product_attention(q.astype(F32), k.astype(F32), v.astype(F32), is_causal=causal,
                                            query_seq_lengths=q_len, key_value_seq_lengths=kv_len)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq,heads,kv_heads,head_dim", [(64, 4, 4, 32), (128, 4, 2, 64), (96, 8, 1, 16)])
def test_fp8_attention_matches_float32(key, causal, seq, heads, kv_heads, head_dim):
    q, k, v, g = _qkv(key, t=seq, n=heads, nk=kv_heads, h=head_dim)
    attn = _calibrated(DotProductAttention("fp8_dpa", is_causal=causal, backend="reference"), q, k, v, g)
    assert sqnr_db(attn(q, k, v), _exact(q, k, v, causal)) >= 22.0

    grads = jax.grad(_loss, argnums=(1, 2, 3))(attn, q, k, v, g)
    expected = jax.grad(lambda q, k, v: jnp.sum(_exact(q, k, v, causal) * g), argnums=(0, 1, 2))(q, k, v)
    for name, got, want in zip("qkv", grads, expected):
        assert sqnr_db(got, want) >= 20.0, name


def test_bf16_inputs_and_outputs(key):
    q, k, v, g = _qkv(key, dtype=jnp.bfloat16)
    attn = _calibrated(DotProductAttention("fp8_dpa", is_causal=True, backend="reference"), q, k, v, g)
    out = attn(q, k, v)
    assert out.dtype == jnp.bfloat16
    dq = jax.grad(_loss, argnums=1)(attn, q, k, v, g)
    assert dq.dtype == jnp.bfloat16
    assert sqnr_db(out, _exact(q, k, v, True)) >= 20.0


def test_state_records_every_tensor_and_scales_track_amax(key):
    q, k, v, g = _qkv(key)
    attn = DotProductAttention("fp8_dpa", is_causal=True, backend="reference")
    new = _calibrated(attn, q, k, v, g, steps=1)
    state = new.state
    assert recorded(state) == 1.0
    newest = {name: float(state.ordered_amax_history(name)[0]) for name in TENSORS}
    assert all(value > 0 for value in newest.values()), newest
    assert newest["q"] == pytest.approx(float(jnp.max(jnp.abs(q))))
    assert 0 < newest["s"] <= 1.0  # softmax probabilities
    assert newest["dq"] < 1.0  # gradients of a 1e-3 projection
    # The next step computes each scale from the recorded amax: amax / 448.
    new2 = _calibrated(new, q, k, v, g, steps=1)
    assert float(new2.state.scale("q")) == pytest.approx(newest["q"] / 448.0, rel=1e-6)
    assert float(new2.state.scale("dv")) == pytest.approx(newest["dv"] / 448.0, rel=1e-6)


def test_current_scaling_for_inputs(key):
    q, k, v, g = _qkv(key)
    cfg = fp8jax.Fp8Config(scaling="current")
    attn = DotProductAttention("fp8_dpa", is_causal=True, backend="reference", config=cfg)
    # Without any history the inputs are scaled from their own amax, and O from V's
    # scale (|O| <= max|V|): values far outside e4m3's range come out right at once.
    assert sqnr_db(attn(q, k * 0.01, v * 1000), _exact(q, k * 0.01, v * 1000, True)) >= 22.0
    delayed = DotProductAttention("fp8_dpa", is_causal=True, backend="reference")
    assert sqnr_db(delayed(q, k * 0.01, v * 1000), _exact(q, k * 0.01, v * 1000, True)) < 10.0
    assert attn.state.amax_history.shape == (len(TENSORS), 1)


def test_nonfinite_never_reaches_the_scales(key):
    q, k, v, g = _qkv(key)
    attn = _calibrated(DotProductAttention("fp8_dpa", is_causal=True, backend="reference"), q, k, v, g)
    bad_q = q.at[0, 3, 1, 2].set(jnp.nan)
    bad_g = g.at[1, 5, 0, 0].set(jnp.inf)
    new = take_state(attn, eqx.filter_grad(_loss)(attn, bad_q, k, v, bad_g))
    assert bool(jnp.all(jnp.isfinite(new.state.scales))) and bool(jnp.all(new.state.scales > 0))
    assert bool(jnp.all(jnp.isfinite(new.state.amax_history)))
    assert float(new.state.nonfinite_count[0]) == 1.0
    # The step after it is clean again.
    assert sqnr_db(new(q, k, v), _exact(q, k, v, True)) >= 22.0


def test_sequence_lengths_on_reference(key):
    q, k, v, g = _qkv(key, t=64)
    q_len, kv_len = jnp.array([64, 40], jnp.int32), jnp.array([64, 40], jnp.int32)
    attn = _calibrated(DotProductAttention("fp8_dpa", backend="reference"), q, k, v, g,
                       query_seq_lengths=q_len, key_value_seq_lengths=kv_len)
    out = attn(q, k, v, query_seq_lengths=q_len, key_value_seq_lengths=kv_len)
    want = _exact(q, k, v, False, q_len, kv_len)
    assert sqnr_db(out[0], want[0]) >= 22.0
    assert sqnr_db(out[1, :40], want[1, :40]) >= 22.0
    assert bool(jnp.all(out[1, 40:] == 0))  # padded query rows attend to nothing


def test_vmap_folds_into_one_call(key):
    q, k, v, g = _qkv(key)
    attn = _calibrated(DotProductAttention("fp8_dpa", is_causal=True, backend="reference"), q, k, v, g)
    np.testing.assert_array_equal(jax.vmap(attn)(q, k, v), attn(q, k, v))
    grads_vmapped = eqx.filter_grad(lambda a: jnp.sum(jax.vmap(a)(q, k, v) * g))(attn)
    grads_batched = eqx.filter_grad(lambda a: jnp.sum(a(q, k, v) * g))(attn)
    np.testing.assert_array_equal(grads_vmapped.state.amax_history, grads_batched.state.amax_history)


def test_two_uses_emit_the_state_once(key):
    q, k, v, g = _qkv(key)
    attn = _calibrated(DotProductAttention("fp8_dpa", is_causal=True, backend="reference"), q, k, v, g)
    once = take_state(attn, eqx.filter_grad(_loss)(attn, q, k, v, g))
    twice = take_state(attn, eqx.filter_grad(lambda a: _loss(a, q, k, v, g) + _loss(a, q * 0.5, k, v, g))(attn))
    assert recorded(twice.state) == recorded(once.state)
    np.testing.assert_allclose(twice.state.amax_history[0], once.state.amax_history[0])  # max(|q|, |q/2|) = |q|


def test_train_step_with_optax_keeps_state_out_of_the_optimizer(key):
    import optax

    mha = MultiHeadAttention(64, 4, num_kv_heads=2, mode="fp8_mha", backend="reference",
                             config=fp8jax.Fp8Config(selective=False), key=key)
    x = normal(key, (2, 32, 64))
    opt = optax.adam(1e-3)
    opt_state = opt.init(fp8jax.trainable(mha))

    @eqx.filter_jit
    def step(mha, opt_state):
        grads = eqx.filter_grad(lambda m: jnp.mean(m(x) ** 2))(mha)
        return fp8jax.optax_step(opt, mha, grads, opt_state)

    for _ in range(3):
        mha, opt_state = step(mha, opt_state)
    assert recorded(mha.attention.state) == 3.0
    assert recorded(mha.qkv.dot_general) == 3.0
    assert bool(jnp.all(jnp.isfinite(mha.qkv.weight)))


@pytest.mark.parametrize("mode", ["bf16", "fp8_dpa", "fp8_mha"])
def test_multi_head_attention_matches_float32(key, mode):
    cfg = fp8jax.Fp8Config(selective=False)
    mha = MultiHeadAttention(64, 4, num_kv_heads=2, mode=mode, backend="reference", config=cfg, key=key)
    x = normal(key, (2, 64, 64))
    g = normal(jax.random.fold_in(key, 1), (2, 64, 64), scale=1e-3)
    for _ in range(2):
        mha = take_state(mha, eqx.filter_grad(lambda m: jnp.sum(m(x) * g))(mha))
    plain = eqx.tree_at(lambda m: m.attention, mha, DotProductAttention("bf16", is_causal=True))
    if mode == "fp8_mha":
        plain = eqx.tree_at(lambda m: (m.qkv, m.out), plain, (mha.qkv.to_linear(), mha.out.to_linear()))
    with jax.default_matmul_precision("float32"):
        want = plain(x)
    assert mha(x).shape == x.shape
    assert sqnr_db(mha(x), want) >= (40.0 if mode == "bf16" else 20.0)
    # Any leading dims, and one sequence at a time under vmap.
    assert sqnr_db(jax.vmap(mha)(x), want) >= (40.0 if mode == "bf16" else 20.0)
    assert mha(x[None]).shape == (1,) + x.shape


def test_mha_projection_types(key):
    fp8 = MultiHeadAttention(64, 4, mode="fp8_mha", key=key)
    dpa = MultiHeadAttention(64, 4, mode="fp8_dpa", key=key)
    assert isinstance(fp8.qkv, fp8jax.nn.Linear) and isinstance(fp8.out, fp8jax.nn.Linear)
    assert isinstance(dpa.qkv, eqx.nn.Linear) and dpa.attention.state is not None
    assert MultiHeadAttention(64, 4, mode="bf16", key=key).attention.state is None
    # fp8_linear_layers converts the eqx projections of a dpa block and leaves the state alone.
    converted = fp8jax.fp8_linear_layers(dpa, fp8jax.Fp8Config(selective=False))
    assert isinstance(converted.qkv, fp8jax.nn.Linear)
    assert isinstance(converted.attention.state, Fp8AttentionState)


def test_rotary_matches_float64_half_split_rope(key):
    """`rotary` (also the trainer's) against GPT-NeoX's half-split RoPE written out in numpy."""
    x = normal(key, (2, 16, 3, 8))
    t, h = x.shape[1], x.shape[-1]
    angles = np.arange(t)[:, None] * 10000.0 ** (-np.arange(0, h, 2) / h)[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    x1, x2 = np.split(np.asarray(x, np.float64), 2, axis=-1)
    expected = np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    np.testing.assert_allclose(fp8jax.nn.rotary(x), expected, rtol=1e-6, atol=1e-6)


def test_clear_errors(key):
    q, k, v, _ = _qkv(key)
    state = Fp8AttentionState()
    with pytest.raises(ValueError, match="mode must be one of"):
        dot_product_attention(q, k, v, state, mode="fp4")
    with pytest.raises(ValueError, match="backend must be one of"):
        dot_product_attention(q, k, v, state, backend="flash")
    with pytest.raises(ValueError, match="BTNH"):
        dot_product_attention(q[0], k[0], v[0], state)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        dot_product_attention(q[:, :, :3], k, v, state)
    with pytest.raises(TypeError, match="share a dtype"):
        dot_product_attention(q.astype(jnp.bfloat16), k, v, state)
    with pytest.raises(TypeError, match="float16/bfloat16/float32"):
        dot_product_attention(q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32), state)
    with pytest.raises(TypeError, match="needs an Fp8AttentionState"):
        dot_product_attention(q, k, v, None, mode="fp8_dpa")
    with pytest.raises(ValueError, match="query_seq_lengths must be an int array"):
        dot_product_attention(q, k, v, state, backend="reference", query_seq_lengths=jnp.ones((3,), jnp.int32))
    with pytest.raises(ValueError, match="stack shape"):
        dot_product_attention(q, k, v, Fp8AttentionState(stack_shape=(2,)), backend="reference")
    if not fp8jax._kernels.cudnn_attention.availability()[0]:
        with pytest.raises(ValueError, match="the kernel cannot run this call"):
            dot_product_attention(q, k, v, state, backend="cudnn")
    with pytest.raises(ValueError, match="unknown attention tensor"):
        state.scale("p")
    with pytest.raises(ValueError, match="num_kv_heads"):
        MultiHeadAttention(64, 4, num_kv_heads=3, key=key)


def test_stacked_state_under_scan(key):
    q, k, v, g = _qkv(key)
    layers = 3
    attn = eqx.filter_vmap(lambda _: DotProductAttention("fp8_dpa", is_causal=True, backend="reference"))(
        jnp.arange(layers))
    assert attn.state.scales.shape == (layers, len(TENSORS))
    params, static = eqx.partition(attn, eqx.is_array)

    def model(params, q):
        def body(x, p):
            return eqx.combine(p, static)(x, k, v), None

        return jax.lax.scan(body, q, params)[0]

    grads = jax.grad(lambda p: jnp.sum(model(p, q) * g))(params)
    new = take_state(attn, grads)
    assert new.state.amax_history.shape[0] == layers
    np.testing.assert_array_equal(recorded(new.state), np.ones(layers))


def test_cudnn_backward_chunking_plan():
    from fp8jax._kernels.cudnn_attention import backward_chunks

    assert backward_chunks(2, 16, 16) == (2, 16)  # fits: one call
    assert backward_chunks(16, 16, 16) == (2, 16)  # batch split into 8 calls of 2 x 16 heads
    assert backward_chunks(3, 16, 16) == (1, 16)  # chunks divide the batch
    assert backward_chunks(1, 64, 8) == (1, 4)  # heads split along whole GQA groups (4 x 8 query heads)
    assert backward_chunks(1, 8, 1) == (1, 1)


def test_bad_rotary_settings_raise_at_construction(key):
    for base in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"MultiHeadAttention: rope_base=.* expected a finite number > 0"):
            MultiHeadAttention(64, 4, rope_base=base, key=key)
    with pytest.raises(ValueError, match="MultiHeadAttention: rotary .* even head_dim, got head_dim=15"):
        MultiHeadAttention(60, 4, head_dim=15, key=key)
    MultiHeadAttention(60, 4, head_dim=15, use_rotary=False, rope_base=0, key=key)  # no rotary: unused


def test_rotary_checks_rank_positions_and_base(key):
    x = normal(key, (2, 16, 3, 8))
    with pytest.raises(ValueError, match=r"positions must have shape \(16,\).*\(2, 16, 3, 8\).*\(5,\)"):
        fp8jax.nn.rotary(x, positions=jnp.arange(5))
    with pytest.raises(ValueError, match=r"rotary expects x of shape \[\.\.\., T, heads, head_dim\], got \(8,\)"):
        fp8jax.nn.rotary(jnp.ones(8))
    with pytest.raises(ValueError, match="rotary: rope_base=-1 is not allowed; expected a finite number > 0"):
        fp8jax.nn.rotary(x, -1)
    np.testing.assert_array_equal(fp8jax.nn.rotary(x, positions=np.arange(16)), fp8jax.nn.rotary(x))


def test_sequence_lengths_array_likes_and_range(key):
    mha = MultiHeadAttention(32, 2, mode="bf16", key=key)
    x = normal(key, (2, 16, 32))
    want = mha(x, query_seq_lengths=jnp.array([16, 16]), key_value_seq_lengths=jnp.array([16, 9]))
    np.testing.assert_array_equal(mha(x, query_seq_lengths=[16, 16], key_value_seq_lengths=(16, 9)), want)
    with pytest.raises(ValueError, match=r"query_seq_lengths must be in \[0, 16\].*\[100, -3\] out of range"):
        mha(x, query_seq_lengths=[100, -3])
    with pytest.raises(ValueError, match=r"key_value_seq_lengths must be in \[0, 16\].*\[17\] out of range"):
        mha(x, key_value_seq_lengths=[17, 16])
    with pytest.raises(TypeError, match="query_seq_lengths must be an int array of shape"):
        mha(x, query_seq_lengths="16")
    q, k, v, _ = _qkv(key, t=16)  # the FP8 reference backend too
    with pytest.raises(ValueError, match=r"query_seq_lengths must be in \[0, 16\]"):
        dot_product_attention(q, k, v, Fp8AttentionState(), backend="reference", query_seq_lengths=[16, 17])
    # Under jit the values are traced: only their shape and dtype are checked.
    f = jax.jit(lambda lengths: mha(x, key_value_seq_lengths=lengths))
    with jax.default_matmul_precision("highest"):  # a GPU runs float32 dots in TF32 otherwise
        np.testing.assert_allclose(f(jnp.array([16, 9])), mha(x, key_value_seq_lengths=[16, 9]), rtol=1e-5,
                                   atol=1e-6)
    with pytest.raises(ValueError, match=r"must be an int array of shape \(2,\)"):
        f(jnp.array([16, 9, 1]))


@pytest.mark.parametrize("shape", [(2, 0, 64), (0, 16, 64)])
def test_empty_input_raises(key, shape):
    with pytest.raises(ValueError, match=re.escape(f"MultiHeadAttention: x has shape {shape}, with no elements")):
        MultiHeadAttention(64, 4, key=key)(jnp.ones(shape))
