"""Grouped experts (GroupedLinear, GroupedMLP, MoE) against float32 per-expert loops."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import normal, recorded, sqnr_db, take_state

import fp8jax
from fp8jax._ops import grouped as gr
from fp8jax._ops import grouped_gemms as gemms
from fp8jax import nn

G, D, F = 4, 32, 64


@pytest.fixture(autouse=True)
def _exact_float32_dots():
    # The oracles are float64; on a GPU float32 dots default to TF32.
    with jax.default_matmul_precision("highest"):
        yield
SIZES = [
    [10, 0, 35, 5],  # uneven, one empty
    [0, 50, 0, 0],  # one group holds every row
    [12, 13, 12, 13],
]


def loop_reference(x, weight, sizes):
    """float64 per-expert loop: the oracle."""
    x, weight = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    out = np.zeros((x.shape[0], weight.shape[-1]))
    start = 0
    for e, n in enumerate(sizes):
        out[start:start + n] = x[start:start + n] @ weight[e]
        start += n
    return out


def _first_sq(out):
    out = out[0] if isinstance(out, tuple) else out
    return jnp.sum(out.astype(jnp.float32) ** 2)


def calibrate(layer, *args, steps=2):
    """A few gradient steps that only update the FP8 state (delayed scaling warm-up)."""
    for _ in range(steps):
        grads = eqx.filter_grad(lambda m: _first_sq(m(*args)))(layer)
        layer = take_state(layer, grads)
    return layer


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_grouped_linear_matches_loop(sizes, scaling):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(sum(sizes[:2]) + len(scaling)), 3)
    layer = nn.GroupedLinear(G, D, F, key=k1, config=fp8jax.Fp8Config(scaling=scaling))
    x = normal(k2, (50, D))
    dy = normal(k3, (50, F))
    gs = jnp.array(sizes)
    layer = calibrate(layer, x, gs)

    y, vjp = jax.vjp(lambda l, x: l(x, gs), layer, x)
    dlayer, dx = vjp(dy)
    ref = loop_reference(x, layer.weight, sizes)
    assert sqnr_db(ref, y) > 25
    ref_dx = np.zeros_like(np.asarray(x, np.float64))
    start = 0
    for e, n in enumerate(sizes):
        ref_dx[start:start + n] = np.asarray(dy[start:start + n], np.float64) @ np.asarray(layer.weight[e], np.float64).T
        start += n
    assert sqnr_db(ref_dx, dx) > 20
    ref_dw = np.zeros(layer.weight.shape)
    start = 0
    for e, n in enumerate(sizes):
        ref_dw[e] = np.asarray(x[start:start + n], np.float64).T @ np.asarray(dy[start:start + n], np.float64)
        start += n
    for e, n in enumerate(sizes):
        if n == 0:
            assert np.all(np.asarray(dlayer.weight[e]) == 0)
    assert sqnr_db(ref_dw, dlayer.weight) > 20


def test_grouped_linear_plain_precision_exact():
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    layer = nn.GroupedLinear(G, D, F, key=k1, fp8=False)
    x = normal(k2, (50, D))
    sizes = SIZES[0]
    y = layer(x, jnp.array(sizes))
    assert sqnr_db(loop_reference(x, layer.weight, sizes), y) > 100
    dw = eqx.filter_grad(lambda l: jnp.sum(l(x, jnp.array(sizes))))(layer).weight
    ref = np.stack([np.asarray(x[s:s + n]).sum(0)[:, None].repeat(F, 1) for s, n in zip(np.cumsum([0] + sizes[:-1]), sizes)])
    np.testing.assert_allclose(dw, ref, rtol=1e-5, atol=1e-5)


def test_per_expert_weight_scales_and_history():
    k1, k2 = jax.random.split(jax.random.PRNGKey(2))
    layer = nn.GroupedLinear(G, D, F, key=k1)
    layer = eqx.tree_at(lambda l: l.weight, layer, layer.weight * jnp.array([1.0, 2.0, 4.0, 8.0])[:, None, None])
    x = normal(k2, (50, D))
    layer = calibrate(layer, x, jnp.array(SIZES[0]), steps=2)
    amax_w = np.abs(np.asarray(layer.weight)).max(axis=(1, 2))
    hist = layer.fp8_state.ordered_amax_history("kernel")
    np.testing.assert_allclose(hist[0], amax_w, rtol=1e-6)
    np.testing.assert_allclose(layer.fp8_state.kernel_scale, amax_w / 448.0, rtol=1e-6)
    assert recorded(layer.fp8_state) == 2.0
    assert layer.fp8_state.kernel_amax_history.shape == (1024, G)


def test_nonfinite_inputs_never_poison_scales():
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    layer = nn.GroupedLinear(G, D, F, key=k1)
    x = normal(k2, (50, D))
    gs = jnp.array(SIZES[2])
    layer = calibrate(layer, x, gs, steps=1)
    before = layer.fp8_state
    bad = x.at[3, 4].set(jnp.nan).at[20, 1].set(jnp.inf)
    grads = eqx.filter_grad(lambda m: jnp.sum(m(bad, gs)))(layer)
    after = take_state(layer, grads).fp8_state
    assert float(after.nonfinite_count[0]) == 1.0
    for name in ("input_scale", "kernel_scale", "output_grad_scale", "input_amax_history", "kernel_amax_history"):
        assert np.all(np.isfinite(np.asarray(getattr(after, name)))), name
    # the scale comes from the clean history; the bad step's amax is not recorded
    np.testing.assert_allclose(after.input_scale, np.max(before.input_amax_history) / 448.0, rtol=1e-6)
    assert float(after.ordered_amax_history("input")[0]) == 0.0


def test_group_size_errors_and_rows_past_the_groups():
    k1, k2 = jax.random.split(jax.random.PRNGKey(4))
    layer = nn.GroupedLinear(G, D, F, key=k1, fp8=False)
    x = normal(k2, (50, D))
    with pytest.raises(ValueError, match="shape \\(4,\\)"):
        layer(x, jnp.array([10, 40]))
    with pytest.raises(ValueError, match=">= 0"):
        layer(x, jnp.array([10, -1, 40, 1]))
    with pytest.raises(ValueError, match="more than the 50 rows"):
        layer(x, jnp.array([10, 10, 40, 1]))
    with pytest.raises(TypeError, match="integers"):
        layer(x, jnp.array([10.0, 10, 20, 10]))
    with pytest.raises(ValueError, match=r"\(rows, 32\)"):
        layer(x[:, :8], jnp.array([10, 10, 20, 10]))
    # traced sizes summing to less than the rows: the rest gets zeros
    y = eqx.filter_jit(lambda l, x, gs: l(x, gs))(layer, x, jnp.array([10, 0, 20, 5]))
    assert np.all(np.asarray(y[35:]) == 0)
    assert sqnr_db(loop_reference(x[:35], layer.weight, [10, 0, 20, 5]), y[:35]) > 100
    with pytest.raises(ValueError, match="backend"):
        nn.GroupedLinear(G, D, F, key=k1, backend="cuda")
    assert layer.with_backend("reference").backend == "reference"


def test_state_emitted_once_when_reused():
    k1, k2 = jax.random.split(jax.random.PRNGKey(5))
    layer = nn.GroupedLinear(G, D, D, key=k1)
    x = normal(k2, (50, D))
    gs = jnp.array(SIZES[0])
    grads = eqx.filter_grad(lambda m: jnp.sum(m(m(x, gs), gs)))(layer)
    new = take_state(layer, grads).fp8_state
    assert recorded(new) == 1.0
    y1 = layer(x, gs)
    expected = max(float(jnp.max(jnp.abs(x))), float(jnp.max(jnp.abs(y1[:50]))))
    assert float(new.input_amax_history[0]) == pytest.approx(expected, rel=0.05)


def _dense_moe_reference(moe, x):
    """float64: every expert on every token, combined by the top-k routing weights."""
    tokens = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    logits = tokens @ np.asarray(moe.router, np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :moe.top_k]
    w = np.take_along_axis(probs, top, -1)
    if moe.top_k > 1:
        w /= w.sum(-1, keepdims=True)
    w1 = np.asarray(moe.experts.fc1.weight, np.float64)
    w2 = np.asarray(moe.experts.fc2.weight, np.float64)
    out = np.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j in range(moe.top_k):
            e = top[t, j]
            h = tokens[t] @ w1[e]
            gate, up = np.split(h, 2)
            act = gate / (1 + np.exp(-gate)) * up
            out[t] += w[t, j] * (act @ w2[e])
    return out.reshape(x.shape)


@pytest.mark.parametrize("fp8", [False, True])
def test_moe_matches_dense_reference(fp8):
    k1, k2 = jax.random.split(jax.random.PRNGKey(6))
    moe = nn.MoE(D, F, G, key=k1, top_k=2, fp8=fp8)
    x = normal(k2, (2, 24, D))
    if fp8:
        moe = calibrate(moe, x)
    y, info = eqx.filter_jit(moe)(x)
    ref = _dense_moe_reference(moe, x)
    assert sqnr_db(ref, y) > (22 if fp8 else 60)
    assert int(jnp.sum(info.tokens_per_expert)) == 2 * 24 * 2
    assert float(info.dropped_fraction) == 0.0
    assert np.isfinite(float(info.load_balancing_loss)) and np.isfinite(float(info.router_z_loss))


def _moe_loss(m, x):
    y, info = m(x)
    return jnp.mean(jnp.square(y)) + 0.01 * info.load_balancing_loss


def test_moe_gradients_match_plain_reference():
    k1, k2 = jax.random.split(jax.random.PRNGKey(7))
    moe8 = nn.MoE(D, F, G, key=k1, top_k=2, fp8=True, config=fp8jax.Fp8Config(scaling="current"))
    moe = nn.MoE(D, F, G, key=k1, top_k=2, fp8=False)
    x = normal(k2, (48, D))
    g8, gx8 = jax.grad(_moe_loss, argnums=(0, 1))(moe8, x)
    g, gx = jax.grad(_moe_loss, argnums=(0, 1))(moe, x)
    assert sqnr_db(gx, gx8) > 18
    assert sqnr_db(g.router, g8.router) > 18
    assert sqnr_db(g.experts.fc1.weight, g8.experts.fc1.weight) > 18
    assert sqnr_db(g.experts.fc2.weight, g8.experts.fc2.weight) > 18


def test_moe_capacity_drops_and_ties():
    k1, k2 = jax.random.split(jax.random.PRNGKey(8))
    moe = nn.MoE(D, F, G, key=k1, top_k=1, capacity_factor=1.0, fp8=False)
    # a zero router: every score ties, top-1 picks expert 0 for every token
    moe = eqx.tree_at(lambda m: m.router, moe, jnp.zeros_like(moe.router))
    x = normal(k2, (40, D))
    y, info = moe(x)
    assert info.tokens_per_expert.tolist() == [10, 0, 0, 0]  # capacity ceil(1.0 * 40 / 4)
    assert float(info.dropped_fraction) == pytest.approx(0.75)
    assert float(info.load_balancing_loss) == pytest.approx(1.0)  # uniform scores: E * sum_e f_e / E
    ref = _dense_moe_reference(moe, x[:10])
    assert sqnr_db(ref, y[:10]) > 60  # the first 10 tokens win the slots
    assert np.all(np.asarray(y[10:]) == 0)
    with pytest.raises(ValueError, match="top_k"):
        nn.MoE(D, F, G, key=k1, top_k=5)
    with pytest.raises(ValueError, match="capacity_factor"):
        nn.MoE(D, F, G, key=k1, capacity_factor=0.0)
    with pytest.raises(ValueError, match=r"\(\.\.\., 32\)"):
        moe(x[:, :16])


def test_moe_sigmoid_topk_and_vmap():
    k1, k2 = jax.random.split(jax.random.PRNGKey(9))
    moe = nn.MoE(D, F, G, key=k1, top_k=3, score="sigmoid", activation="gelu")
    x = normal(k2, (3, 16, D))
    y, _ = moe(x)
    yv, _ = eqx.filter_vmap(moe)(x)  # per-example routing
    assert y.shape == yv.shape == x.shape
    assert np.all(np.isfinite(np.asarray(yv)))


def test_moe_trains_with_optax_and_updates_state():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(10), 3)
    moe = nn.MoE(D, F, G, key=k1, top_k=2)
    x = normal(k2, (64, D))
    target = normal(k3, (64, D))
    opt = optax.adam(3e-3)
    opt_state = opt.init(fp8jax.trainable(moe))

    @eqx.filter_jit
    def step(moe, opt_state):
        def loss(m):
            y, info = m(x)
            return jnp.mean((y - target) ** 2) + 0.01 * info.load_balancing_loss
        value, grads = eqx.filter_value_and_grad(loss)(moe)
        moe, opt_state = fp8jax.optax_step(opt, moe, grads, opt_state)
        return moe, opt_state, value

    losses = []
    for _ in range(30):
        moe, opt_state, value = step(moe, opt_state)
        losses.append(float(value))
    assert losses[-1] < 0.8 * losses[0]
    assert recorded(moe.experts.fc1.fp8_state) == 30.0
    assert float(moe.experts.fc2.fp8_state.output_grad_scale[0]) != 1.0


def test_checkpoint_split_and_merge(tmp_path):
    k1, k2 = jax.random.split(jax.random.PRNGKey(11))
    moe = nn.MoE(D, F, 8, key=k1, top_k=2)
    x = normal(k2, (32, D))
    moe = calibrate(moe, x)
    path = tmp_path / "moe8.eqx"
    eqx.tree_serialise_leaves(path, moe)
    template = nn.MoE(D, F, 8, key=jax.random.PRNGKey(99), top_k=2)
    loaded = eqx.tree_deserialise_leaves(path, template)
    # re-shard: 8 experts in one file -> 2 shards of 4 -> back to 8
    shards = nn.split_experts(loaded, 2)
    assert shards[1].experts.fc1.weight.shape[0] == 4
    assert shards[1].experts.fc1.fp8_state.kernel_amax_history.shape[-1] == 4
    for i, shard in enumerate(shards):
        eqx.tree_serialise_leaves(tmp_path / f"shard{i}.eqx", shard)
    templates = nn.split_experts(template, 2)
    restored = [eqx.tree_deserialise_leaves(tmp_path / f"shard{i}.eqx", t) for i, t in enumerate(templates)]
    merged = nn.merge_experts(restored)
    for a, b in zip(jax.tree_util.tree_leaves(moe), jax.tree_util.tree_leaves(merged)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(moe(x)[0], merged(x)[0])
    np.testing.assert_array_equal(shards[1].experts.fc2.fp8_state.kernel_scale,
                                  moe.experts.fc2.fp8_state.kernel_scale[4:])
    with pytest.raises(ValueError, match="3 equal shards"):
        nn.split_experts(moe, 3)


def test_layout_and_kernel_fallback_on_cpu():
    layout = nn.make_layout(jnp.array([3, 0, 130, 1]), 134)
    assert layout.num_rows == gr.padded_rows(134, 4, 128)
    np.testing.assert_array_equal(layout.starts, [0, 128, 128, 384])
    assert int(layout.row_valid.sum()) == 134
    assert gr.resolve_backend("auto", layout, 128, 256, jnp.bfloat16) == "reference"
    for name in ("pallas", "kernel"):  # the family's name and dispatch's
        with pytest.raises(ValueError, match="the kernel cannot run this call"):
            gr.resolve_backend(name, layout, 128, 256, jnp.bfloat16)
    assert gr.resolve_backend("reference", layout, 128, 256, jnp.bfloat16) == "reference"
    with pytest.raises(ValueError, match="backend must be one of"):
        gr.resolve_backend("triton", layout, 128, 256, jnp.bfloat16)


def test_pinned_kernel_configs_are_found():
    from fp8jax._kernels import grouped_gemm as gk
    rows, wgrad = gk.RowsConfig(max_concurrent_steps=2), gk.WgradConfig(max_concurrent_steps=2)
    gr.set_kernel_configs(jnp.float8_e4m3fn, 7, rows, wgrad)
    try:
        assert gr.kernel_configs(jnp.float8_e4m3fn, 7, (1024, 512, 256)) == (rows, wgrad)
        assert gr.kernel_configs(jnp.float8_e4m3fn, 8, (1024, 512, 256)) != (rows, wgrad)
    finally:
        gemms._TUNED.clear()
