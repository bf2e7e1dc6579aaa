"""State semantics of delayed scaling: flax parity, reuse, vmap, accumulation, scan,
data parallelism, NaN/Inf, optax."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax
from fp8jax import _state
from helpers import normal, take_state, recorded

CFG = fp8jax.Fp8Config(selective=False, amax_history_length=4)


def _layer(key, k=32, n=32, config=CFG):
    return fp8jax.fp8_linear_layers(eqx.nn.Linear(k, n, key=key), config)


def _grads(model, x, c):
    return eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(x) * c)))(model, x)


# --- a. flax parity -------------------------------------------------------------------
def test_delayed_scaling_matches_flax(key):
    from flax.linen import fp8_ops

    model = _layer(key)
    length = CFG.amax_history_length
    flax_state = {name: (jnp.ones((1,)), jnp.zeros((length,))) for name in ("x", "w", "g")}
    for step in range(7):  # rolls past the 4-long history
        kx, kc = jax.random.split(jax.random.fold_in(key, step))
        x = normal(kx, (64, 32), scale=0.5 + step)  # amax moves every step
        c = normal(kc, (64, 32), scale=10.0 ** -step)
        model = take_state(model, _grads(model, x, c))
        for name, value, dtype in (("x", x, jnp.float8_e4m3fn), ("w", model.weight, jnp.float8_e4m3fn),
                                   ("g", c, jnp.float8_e5m2)):
            flax_state[name] = fp8_ops.update_fp8_meta(value, dtype, *flax_state[name])
        dg = model.dot_general
        for name, ours_scale, ours_hist in (("x", dg.input_scale, dg.input_amax_history),
                                            ("w", dg.kernel_scale, dg.kernel_amax_history),
                                            ("g", dg.output_grad_scale, dg.output_grad_amax_history)):
            flax_scale, flax_hist = flax_state[name]
            np.testing.assert_array_equal(ours_scale, flax_scale, err_msg=f"{name} scale, step {step}")
            np.testing.assert_array_equal(ours_hist, flax_hist, err_msg=f"{name} history, step {step}")
        newest = dg.ordered_amax_history("input")[0]
        assert float(newest) == float(jnp.max(jnp.abs(x)))


def test_most_recent_algo_uses_last_amax(key):
    cfg = fp8jax.Fp8Config(selective=False, amax_history_length=4, amax_compute_algo="most_recent")
    model = _layer(key, config=cfg)
    amaxes = []
    for step, scale in enumerate([8.0, 1.0, 2.0]):
        x = normal(jax.random.fold_in(key, step), (32, 32), scale=scale)
        model = take_state(model, _grads(model, x, jnp.ones((32, 32))))
        amaxes.append(float(jnp.max(jnp.abs(x))))
    # scale used at step 2 comes from step 1's amax only (not the max, which is step 0's)
    np.testing.assert_allclose(model.dot_general.input_scale, amaxes[1] / 448.0, rtol=1e-6)


# --- b. reuse in one step -------------------------------------------------------------
def test_layer_used_twice_max_combines(key):
    model = _layer(key)
    model = eqx.tree_at(lambda m: m.weight, model, model.weight * 4.0)  # |y1| well above |x|
    kx, kc = jax.random.split(key)
    x, c = normal(kx, (32, 32), scale=5.0), normal(kc, (32, 32), scale=0.1)
    # warm the state so scales are not 1.0
    model = take_state(model, _grads(model, x * 0.5, c))
    y1 = model(x)
    g1 = jax.grad(lambda y: jnp.sum(model(y) * c))(y1)  # grad reaching the first use
    grads = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(m(x)) * c)))(model, x)
    new = take_state(model, grads).dot_general
    old = model.dot_general
    assert recorded(new) == recorded(old) + 1  # one update, not two
    # scale from the old history (not summed over the two uses)
    np.testing.assert_allclose(new.input_scale, jnp.max(old.input_amax_history) / 448.0, rtol=1e-6)
    newest = {w: float(new.ordered_amax_history(w)[0]) for w in ("input", "kernel", "output_grad")}
    assert newest["input"] == pytest.approx(max(float(jnp.max(jnp.abs(x))), float(jnp.max(jnp.abs(y1)))), rel=1e-6)
    assert newest["input"] > float(jnp.max(jnp.abs(x)))  # the second use's input counted
    assert newest["kernel"] == float(jnp.max(jnp.abs(model.weight)))
    assert newest["output_grad"] == pytest.approx(max(float(jnp.max(jnp.abs(c))), float(jnp.max(jnp.abs(g1)))), rel=1e-6)


def test_layer_used_three_times_under_jit_and_grad(key):
    model = _layer(key)
    x = normal(key, (16, 32))
    grads = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(m(m(x))))))(model, x)
    new = take_state(model, grads).dot_general
    assert recorded(new) == 1.0
    assert float(new.nonfinite_count[0]) == 0.0
    assert np.all(np.asarray(new.input_scale) == 1.0)


# --- c. vmap ------------------------------------------------------------------------------
def test_vmap_is_one_gemm_with_global_amax(key):
    model = _layer(key)
    x, c = normal(key, (64, 32), scale=2.0), normal(jax.random.fold_in(key, 1), (64, 32))

    def loss_vmap(m, x):
        return jnp.sum(jax.vmap(m)(x) * c)

    def loss_plain(m, x):
        return jnp.sum(m(x) * c)

    g_vmap = eqx.filter_jit(eqx.filter_grad(loss_vmap))(model, x)
    g_plain = eqx.filter_jit(eqx.filter_grad(loss_plain))(model, x)
    for a, b in zip(jax.tree_util.tree_leaves(g_vmap), jax.tree_util.tree_leaves(g_plain), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(g_vmap.dot_general.input_amax_history, g_plain.dot_general.input_amax_history)
    report = fp8jax.fp8_gemm_report(eqx.filter_grad(loss_vmap), model, x, stage="lowered")
    assert len(report.gemms) == 3 and report.all_fp8, report
    assert not any("batching_dims" in g.line for g in report.gemms), report  # not one GEMM per example


def test_nested_vmap_folds_all_axes_into_rows(key):
    model = _layer(key)
    x = normal(key, (4, 16, 32))
    y = jax.vmap(jax.vmap(model))(x)
    np.testing.assert_allclose(y, model(x), rtol=1e-6, atol=1e-6)
    report = fp8jax.fp8_gemm_report(lambda m, x: jax.vmap(jax.vmap(m))(x), model, x, stage="lowered")
    assert len(report.gemms) == 1 and report.all_fp8


# --- d. gradient accumulation -----------------------------------------------------------
def _micro(key, n=4):
    keys = jax.random.split(key, n)
    return [normal(k, (16, 32), scale=1.0 + i) for i, k in enumerate(keys)]


def test_python_loop_accumulation(key):
    model = _layer(key)
    micro = _micro(key)
    c = jnp.ones((16, 32))
    acc, naive = None, None
    for x in micro:
        g = _grads(model, x, c)
        acc = fp8jax.accumulate_grads(acc, g)
        naive = g if naive is None else jax.tree_util.tree_map(jnp.add, naive, g)
    full = _grads(model, jnp.concatenate(micro), jnp.ones((64, 32)))
    ow_acc, g_acc = fp8jax.partition_for_grad_overwrite(acc)
    ow_full, g_full = fp8jax.partition_for_grad_overwrite(full)
    for a, b in zip(jax.tree_util.tree_leaves(ow_acc), jax.tree_util.tree_leaves(ow_full), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(g_acc.weight, g_full.weight, rtol=2e-2, atol=1e-2)
    # plain summation is what the helper exists to avoid
    assert float(naive.dot_general.input_scale[0]) == 4.0  # four proposals of scale 1, summed


def test_scan_accumulation(key):
    model = _layer(key)
    xs = jnp.stack(_micro(key))
    c = jnp.ones((16, 32))

    @eqx.filter_jit
    def accumulate(model, xs):
        first = _grads(model, xs[0], c)

        def body(acc, x):
            return fp8jax.accumulate_grads(acc, eqx.filter_grad(lambda m: jnp.sum(m(x) * c))(model)), None

        acc, _ = jax.lax.scan(body, first, xs[1:])
        return acc

    acc = accumulate(model, xs)
    new = take_state(model, acc).dot_general
    assert recorded(new) == 1.0
    assert float(new.ordered_amax_history("input")[0]) == float(jnp.max(jnp.abs(xs)))


def test_optax_multisteps(key):
    model = _layer(key, config=fp8jax.Fp8Config(selective=False, amax_history_length=8))
    opt = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    opt_state = opt.init(fp8jax.trainable(model))
    w0 = model.weight
    for i, x in enumerate(_micro(key, 4)):
        grads = _grads(model, x, jnp.ones((16, 32)))
        model, opt_state = fp8jax.optax_step(opt, model, grads, opt_state)
        if i == 0:
            np.testing.assert_array_equal(model.weight, w0)  # no parameter update mid-accumulation
    assert not np.array_equal(model.weight, w0)
    # the FP8 state advances every micro-step (each is a forward/backward pass)
    assert recorded(model.dot_general) == 4.0


# --- e. stacked layers under scan ---------------------------------------------------------
class Stack(eqx.Module):
    layers: eqx.Module

    enter: bool = eqx.field(static=True)
    unroll: int = eqx.field(static=True)

    def __init__(self, key, depth=3, width=32, enter=False, unroll=1):
        self.layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(width, width, key=k))(jax.random.split(key, depth))
        self.enter, self.unroll = enter, unroll

    def __call__(self, x):
        layers = fp8jax.enter_state(self.layers) if self.enter else self.layers
        dynamic, static = eqx.partition(layers, eqx.is_array)

        def body(h, layer_arrays):
            layer = eqx.combine(layer_arrays, static)
            return jnp.tanh(layer(h)) * 3.0, None

        return jax.lax.scan(body, x, dynamic, unroll=self.unroll)[0]


def test_scan_over_stacked_layers(key):
    model, report = fp8jax.fp8_linear_layers(Stack(key), CFG, return_report=True)
    assert report.layers[0].stack == (3,)
    dg = model.layers.dot_general
    assert dg.input_amax_history.shape == (3, 4) and dg.input_scale.shape == (3, 1)
    x = normal(key, (16, 32), scale=7.0)
    grads = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(x))))(model, x)
    new = take_state(model, grads).layers.dot_general
    np.testing.assert_array_equal(recorded(new), [1, 1, 1])
    first = new.input_amax_history[:, 0]
    assert float(first[0]) == float(jnp.max(jnp.abs(x)))
    assert np.all(np.asarray(first[1:]) <= 3.0)  # later layers see tanh(.) * 3
    # equals running the layers one by one (to float32 rounding: the scanned step and the
    # op-by-op loop are two programs, whose tanh came out 2 ulps apart at XLA's CPU
    # optimization level 0, the CI setting in conftest.py)
    h = x
    for i in range(3):
        layer = jax.tree_util.tree_map(lambda a, i=i: a[i], model.layers)
        np.testing.assert_allclose(first[i], jnp.max(jnp.abs(h)), rtol=1e-6)
        h = jnp.tanh(layer(h)) * 3.0



def test_stacked_state_entered_before_the_scan_gives_the_same_step(key):
    """`fp8jax.enter_state` on the stacked layers before an unrolled ``lax.scan`` (the
    conversion once on ``[layers, ...]`` arrays, outside the loop: a smaller program to
    compile, issue 21) gives the same new state and gradients as entering inside it."""
    x = normal(key, (16, 32), scale=5.0)
    results = []
    for enter in (False, True):
        model = fp8jax.fp8_linear_layers(Stack(key, enter=enter, unroll=3), CFG)
        loss = lambda m, x: jnp.sum(m(x) ** 2)  # noqa: E731
        jaxpr = jax.make_jaxpr(eqx.filter_grad(loss))(model, x).jaxpr
        scan = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
        assert ("_to_max_grad" in str(scan.params["jaxpr"])) != enter
        results.append(eqx.filter_jit(eqx.filter_grad(loss))(model, x))
    inside, outside = (jax.tree_util.tree_leaves(r) for r in results)
    assert len(inside) == len(outside)
    for a, b in zip(inside, outside):
        np.testing.assert_array_equal(a, b)
    new = take_state(model, results[1]).layers.dot_general
    np.testing.assert_array_equal(recorded(new), [1, 1, 1])


def test_each_layers_new_state_sits_behind_an_optimization_barrier(key):
    """The compile-time fix of `fp8jax._state.proposal` (issue 21): every proposal of the
    stacked layers' backward goes through an optimization barrier, so XLA cannot fuse one
    layer's state math into the kernel that stacks all layers' new state."""
    model = fp8jax.fp8_linear_layers(Stack(key), CFG)
    x = normal(key, (16, 32))
    jaxpr = str(jax.make_jaxpr(eqx.filter_grad(lambda m, x: jnp.sum(m(x))))(model, x))
    assert "optimization_barrier" in jaxpr

# --- f. data parallel ------------------------------------------------------------------------
def test_data_parallel_amax_is_global(key):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = np.array(jax.devices()[:8])
    if devices.size < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = Mesh(devices, ("data",))
    model = _layer(key)
    x = normal(key, (128, 32)) * jnp.linspace(0.1, 10.0, 128)[:, None]  # amax lives on one shard
    c = normal(jax.random.fold_in(key, 1), (128, 32))
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    cs = jax.device_put(c, NamedSharding(mesh, P("data", None)))
    sharded = _grads(model, xs, cs)
    single = _grads(model, x, c)
    for a, b in zip(jax.tree_util.tree_leaves(sharded.dot_general), jax.tree_util.tree_leaves(single.dot_general), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(sharded.weight, single.weight, rtol=1e-5, atol=1e-5)


# --- g. NaN / Inf ------------------------------------------------------------------------------
@pytest.mark.parametrize("scaling", ["delayed", "current"])
@pytest.mark.parametrize("where", ["input", "grad", "zeros"])
def test_nonfinite_never_poisons_scales(key, scaling, where):
    cfg = fp8jax.Fp8Config(selective=False, amax_history_length=4, scaling=scaling)
    model = _layer(key, config=cfg)
    x, c = normal(key, (16, 32), scale=4.0), normal(jax.random.fold_in(key, 1), (16, 32))
    model = take_state(model, _grads(model, x, c))
    model = take_state(model, _grads(model, x, c))
    before = model.dot_general
    if where == "input":
        x = x.at[3, 5].set(jnp.nan).at[0, 0].set(jnp.inf)
    elif where == "grad":
        c = c.at[2, 2].set(jnp.inf)
    else:
        x = jnp.zeros_like(x)
    after = take_state(model, _grads(model, x, c)).dot_general
    for name in ("input_scale", "kernel_scale", "output_grad_scale"):
        value = np.asarray(getattr(after, name))
        assert np.all(np.isfinite(value)) and np.all(value > 0), name
    assert np.all(np.isfinite(np.asarray(after.input_amax_history)))
    assert np.all(np.isfinite(np.asarray(after.output_grad_amax_history)))
    expected = 0.0 if where == "zeros" else 1.0
    assert float(after.nonfinite_count[0]) == float(before.nonfinite_count[0]) + expected
    if scaling == "current" and where != "zeros":
        bad = "input_scale" if where == "input" else "output_grad_scale"
        np.testing.assert_array_equal(getattr(after, bad), getattr(before, bad))  # previous scale kept
    # and the next clean step is fine again
    x, c = normal(key, (16, 32), scale=4.0), normal(jax.random.fold_in(key, 2), (16, 32))
    final = take_state(model, _grads(eqx.tree_at(lambda m: m.dot_general, model, after), x, c)).dot_general
    assert np.all(np.isfinite(np.asarray(final.input_scale)))


def test_unused_layer_keeps_its_state(key):
    model = _layer(key)
    model = take_state(model, _grads(model, normal(key, (16, 32), scale=3.0), jnp.ones((16, 32))))
    grads = eqx.filter_grad(lambda m: jnp.sum(m.weight) * 0.0)(model)  # layer not called
    kept = take_state(model, grads).dot_general
    for a, b in zip(jax.tree_util.tree_leaves(kept), jax.tree_util.tree_leaves(model.dot_general), strict=True):
        np.testing.assert_array_equal(a, b)


# --- h. optax never touches the state ----------------------------------------------------------
def test_optax_global_transforms_never_see_state(key):
    model = _layer(key)
    model = take_state(model, _grads(model, normal(key, (16, 32), scale=50.0), jnp.ones((16, 32)) * 100))
    opt = optax.chain(optax.clip_by_global_norm(1e-3), optax.adamw(1e-2, weight_decay=0.5))
    opt_state = opt.init(fp8jax.trainable(model))
    assert all(leaf.size != CFG.amax_history_length for leaf in jax.tree_util.tree_leaves(opt_state)
               if hasattr(leaf, "size") and leaf.ndim == 1 and leaf.shape[0] == 4)
    x = normal(jax.random.fold_in(key, 3), (16, 32), scale=50.0)
    grads = _grads(model, x, jnp.ones((16, 32)) * 100)
    new_model, _ = fp8jax.optax_step(opt, model, grads, opt_state)
    overwrites, true_grads = fp8jax.partition_for_grad_overwrite(grads)
    # state is exactly the overwrite: no weight decay, no clipping applied to it
    for a, b in zip(jax.tree_util.tree_leaves(new_model.dot_general), jax.tree_util.tree_leaves(overwrites), strict=True):
        np.testing.assert_array_equal(a, b)
    # parameter update equals the optimizer run on the parameters alone
    params = fp8jax.trainable(model)
    updates, _ = opt.update(true_grads, opt.init(params), params)
    np.testing.assert_allclose(new_model.weight, model.weight + updates.weight, rtol=1e-6)


# --- other transformations ---------------------------------------------------------------------
def test_ensemble_vmap_keeps_per_member_state(key):
    """Weights and state batched (an ensemble via eqx.filter_vmap): each member its own amax."""
    ens = eqx.filter_vmap(lambda k: _layer(k))(jax.random.split(key, 2))
    x = normal(key, (2, 16, 32)) * jnp.array([1.0, 10.0])[:, None, None]
    loss = lambda m, x: jnp.sum(eqx.filter_vmap(lambda m, x: m(x))(m, x))  # noqa: E731
    new = take_state(ens, eqx.filter_jit(eqx.filter_grad(loss))(ens, x)).dot_general
    np.testing.assert_array_equal(new.input_amax_history[:, 0], jnp.max(jnp.abs(x), axis=(1, 2)))
    np.testing.assert_array_equal(recorded(new), [1, 1])


def test_checkpoint_gives_the_same_state_and_grads(key):
    model, x = _layer(key), normal(key, (16, 32))
    remat = eqx.filter_grad(lambda m, x: jnp.sum(jax.checkpoint(lambda m, x: m(x))(m, x)))(model, x)
    plain = eqx.filter_grad(lambda m, x: jnp.sum(m(x)))(model, x)
    for a, b in zip(jax.tree_util.tree_leaves(remat), jax.tree_util.tree_leaves(plain), strict=True):
        np.testing.assert_array_equal(a, b)


def test_reuse_under_vmap_matches_plain(key):
    model, x = _layer(key), normal(key, (16, 32), scale=0.2)
    vmapped = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(jax.vmap(lambda r: m(m(r)))(x))))(model, x)
    plain = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(m(x)))))(model, x)
    for a, b in zip(jax.tree_util.tree_leaves(vmapped.dot_general), jax.tree_util.tree_leaves(plain.dot_general),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert recorded(vmapped.dot_general) == 1.0


@pytest.mark.parametrize("length", [1, 2, 3, 1024])
def test_record_is_flax_roll_then_set(length):
    """`record` (one concatenate) writes what flax's ``roll(h, -1).at[0].set(v)`` writes, for
    a plain history, a per-expert one ([L, E], axis 0) and per-slot values along axis -1."""
    rng = np.random.default_rng(length)
    h = jnp.asarray(rng.standard_normal(length), jnp.float32)
    np.testing.assert_array_equal(_state.record(h, 7.0), jnp.roll(h, -1).at[0].set(7.0))
    he = jnp.asarray(rng.standard_normal((length, 3)), jnp.float32)
    v = jnp.asarray([1.0, 2.0, 3.0])
    np.testing.assert_array_equal(_state.record(he, v), jnp.roll(he, -1, axis=0).at[0].set(v))
    hs = jnp.asarray(rng.standard_normal((4, length)), jnp.float32)
    v4 = jnp.arange(4.0)
    expected = jnp.roll(hs, -1, axis=-1).at[..., 0].set(v4)
    np.testing.assert_array_equal(_state.record(hs, v4, axis=-1), expected)
