"""What fp8jax tells the user: conversion reports (FP8 / bf16 below N tokens / skipped), the
token-policy warning at trace time, GEMM reports on ordinary equinox steps, residuals of a
``jax.vmap``-ed model, traced group-size checks, and the lazily imported adapters."""

import re
import subprocess
import sys
import textwrap
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import fp8jax
from fp8jax import _config

SMALL_FP8 = fp8jax.Fp8Config(min_features=0, min_weight_elements=0)  # min_tokens stays 4096
ALL = fp8jax.Fp8Config(selective=False)


def _token_warnings(fn):
    """The token-policy warnings ``fn()`` emits (the once-only record cleared first)."""
    _config._WARNED_TOKENS.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "Fp8Config.min_tokens" in str(w.message)]


@pytest.mark.parametrize("sizes", [(64, 128, 64, 1), (256, 1024, 256, 2)])
def test_default_config_converts_no_small_mlp_and_says_so(sizes):
    in_f, width, out_f, depth = sizes
    # shapes only (the policy reads nothing else; random init would compile for seconds)
    model = eqx.filter_eval_shape(eqx.nn.MLP, in_f, out_f, width, depth, key=jax.random.PRNGKey(0))
    with pytest.warns(UserWarning, match="converted no layer: nothing will run in FP8"):
        _, report = fp8jax.fp8_linear_layers(model, return_report=True)
    with pytest.warns(UserWarning, match=r"Fp8Config\(selective=False\)"):
        fp8jax.fp8_linear_layers(model)  # without the report too
    text = str(report)
    assert text.startswith("fp8jax: NOTHING will run in FP8: 0 of")
    assert "Fp8Config(min_features=0, min_weight_elements=0, min_tokens=0)" in text
    assert all(lay.tier == "skipped" for lay in report.layers)
    small = min(in_f, width)
    assert f"skipped (too small to gain: min(in, out)={small} < min_features=2048)" in text


def test_report_tells_the_three_tiers_apart(key):
    model = {"big": eqx.nn.Linear(64, 64, key=key), "odd": eqx.nn.Linear(64, 40, key=key)}
    _, report = fp8jax.fp8_linear_layers(model, SMALL_FP8, return_report=True)
    assert report.fp8_from_tokens == {"big": 4096} and report.fp8 == []
    assert report.converted == ["big"] and "multiples of 16" in report.skipped["odd"]
    assert report.fp8_at(64) == [] and report.fp8_at(4096) == ["big"]
    text = str(report)
    assert "converted, but bf16 below 4096 tokens per call (FP8 from 4096)" in text
    assert "1 of 2 linear layers in FP8, but 1 of them only on calls with at least 4096" in text
    assert "skipped (in=64, out=40 not multiples of 16)" in text
    _, report = fp8jax.fp8_linear_layers(
        model, fp8jax.Fp8Config(selective=False), return_report=True
    )
    assert report.fp8 == ["big"] and report.fp8_from_tokens == {}
    assert re.search(r"\n  big +64 +64  FP8\n", str(report))
    converted = fp8jax.fp8_linear_layers(model, SMALL_FP8)  # "already FP8" keeps its floor
    _, again = fp8jax.fp8_linear_layers(converted, SMALL_FP8, return_report=True)
    assert again.fp8_from_tokens == {"big": 4096} and "already FP8" in str(again)


def test_token_policy_warns_once_at_trace_time(key):
    layer = fp8jax.fp8_linear_layers(eqx.nn.Linear(4096, 4096, key=key))  # the default config
    x = jax.ShapeDtypeStruct((64, 4096), jnp.float32)

    def twice():
        jax.eval_shape(layer, x)
        jax.eval_shape(eqx.filter_grad(lambda m, x: jnp.sum(m(x))), layer, x)

    messages = _token_warnings(twice)
    assert len(messages) == 1, messages
    assert "(4096->4096 features) is called on 64 tokens" in messages[0]
    assert "fewer than Fp8Config.min_tokens=4096" in messages[0]
    assert "runs in float32, not FP8" in messages[0]
    # vmapped: the merged rows decide, and no per-example warning
    xs = jax.ShapeDtypeStruct((4, 8, 4096), jnp.float32)
    messages = _token_warnings(lambda: jax.eval_shape(jax.vmap(layer), xs))
    assert len(messages) == 1 and "called on 32 tokens" in messages[0], messages
    big = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    assert _token_warnings(lambda: jax.eval_shape(layer, big)) == []


def test_flax_adapters_report_and_warn():
    from flax import linen, nnx

    rngs = nnx.Rngs(0)
    model = nnx.Sequential(nnx.Linear(64, 64, rngs=rngs), nnx.Linear(64, 40, rngs=rngs))
    with pytest.warns(UserWarning, match="fp8jax.nnx.fp8_linear_layers converted no layer"):
        _, report = fp8jax.nnx.fp8_linear_layers(model, return_report=True)
    assert str(report).startswith("fp8jax: NOTHING will run in FP8")
    _, report = fp8jax.nnx.fp8_linear_layers(model, SMALL_FP8, return_report=True)
    assert report.fp8_from_tokens == {"layers.0": 4096} and "layers.1" in report.skipped
    assert "converted, but bf16 below 4096 tokens per call" in str(report)
    x = jnp.ones((16, 64))
    messages = _token_warnings(lambda: model(x))
    assert any("(64->64 features) is called on 16 tokens" in m for m in messages)

    dense = linen.Dense(64, dot_general_cls=fp8jax.flax.fp8_dot_general_cls(SMALL_FP8))
    x = jnp.ones((16, 32))
    init = lambda: jax.eval_shape(dense.init_with_output, jax.random.PRNGKey(0), x)  # noqa: E731
    messages = _token_warnings(init)
    assert len(messages) == 1 and "(32->64 features) is called on 16 tokens" in messages[0]


def test_gemm_report_takes_a_step_returning_an_equinox_model(key):
    """``eqx.nn.MLP`` holds its activation (a custom_jvp function) and ``eqx.nn.Lambda`` a
    function: a step returning the model must not trip the report."""
    k1, k2 = jax.random.split(key)
    model = {
        "mlp": eqx.nn.MLP(32, 32, 64, depth=2, key=k1),
        "head": eqx.nn.Sequential([eqx.nn.Linear(32, 32, key=k2), eqx.nn.Lambda(jax.nn.gelu)]),
    }
    model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(selective=False))

    def step(model, x, lr=1e-3):
        loss_fn = lambda m: jnp.mean(m["head"](jax.vmap(m["mlp"])(x)))  # noqa: E731
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
        updates = jax.tree_util.tree_map(lambda g: -lr * g, grads)
        return fp8jax.apply_updates(model, updates, overwrites), loss

    x = jnp.ones((64, 32))
    report = fp8jax.fp8_gemm_report(step, model, x, stage="lowered")
    assert len(report.gemms) == 12 and report.num_fp8 == 12  # 4 layers x (fwd, dgrad, wgrad)
    fp8jax.assert_fp8(step, model, x, stage="lowered", expected=12)


def test_saved_activation_bytes_of_a_vmapped_model(key):
    x = jnp.ones((32, 64))  # 32 tokens, vmapped
    for model in (
        eqx.nn.MLP(64, 64, 128, depth=1, key=key),
        fp8jax.fp8_linear_layers(eqx.nn.Linear(64, 64, key=key), ALL),
    ):
        wrapped = fp8jax.saved_activation_bytes(eqx.filter_vmap(model), x, dim=32)
        assert wrapped > 0
        assert fp8jax.saved_activation_bytes(jax.vmap(model), x, dim=32) == wrapped
        assert fp8jax.saved_activation_bytes(lambda x: jax.vmap(model)(x), x) == (
            fp8jax.saved_activation_bytes(eqx.filter_vmap(model), x)
        )


def test_traced_negative_group_sizes_are_loud(key, monkeypatch):
    """Under jit a negative group size makes the output NaN by default (no device->host
    sync), and raises with ``FP8JAX_GUARD=raise``."""
    layer = fp8jax.nn.GroupedLinear(4, 32, 64, key=key, fp8=False)
    x = jnp.ones((50, 32))
    apply = eqx.filter_jit(lambda layer, x, sizes: layer(x, sizes))
    good = apply(layer, x, jnp.array([10, 0, 20, 5]))
    assert good.shape == (50, 64) and bool(jnp.all(jnp.isfinite(good)))  # rows past: zeros
    assert bool(jnp.all(jnp.isnan(apply(layer, x, jnp.array([10, -1, 20, 5])))))
    monkeypatch.setenv("FP8JAX_GUARD", "raise")
    apply = eqx.filter_jit(lambda layer, x, sizes: layer(x, sizes))
    with pytest.raises(Exception, match=r"group_sizes must be >= 0 .*at most the 50 rows"):
        jax.block_until_ready(apply(layer, x, jnp.array([10, -1, 20, 5])))


def test_adapters_reachable_after_import_fp8jax():
    code = textwrap.dedent("""
        import sys
        import fp8jax
        assert "flax" not in sys.modules  # imported on first use only
        sys.modules["flax"] = None  # as if flax were not installed
        try:
            fp8jax.nnx
        except ImportError as e:
            print("ImportError", e)
        del sys.modules["flax"]
        cls = fp8jax.flax.fp8_dot_general_cls(fp8jax.Fp8Config())
        print(cls.func.__name__, fp8jax.nnx.fp8_linear_layers.__name__,
              fp8jax.haliax.haliax_linear_dims.__name__)
        try:
            fp8jax.no_such_thing
        except AttributeError as e:
            print("AttributeError", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ImportError fp8jax.nnx")
    assert "pip install 'fp8jax[flax]'" in lines[0]
    assert lines[1] == "Fp8DotGeneralOp fp8_linear_layers haliax_linear_dims"
    assert lines[2] == "AttributeError module 'fp8jax' has no attribute 'no_such_thing'"
