"""Bad inputs to the public API's modules (FusedMLP, MoE and the grouped layers, attention,
the flax adapter, distributed helpers) fail early with a ValueError/TypeError naming the
offending option, shape or dtype (CPU; the core's checks are in `test_errors.py`)."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax
from fp8jax import Fp8Config

CFG = Fp8Config(selective=False, amax_history_length=4)


# --- checks that live in other modules (already in place) ------------------------------
def test_fused_mlp_moe_and_grouped_reject(key):
    nn = fp8jax.nn
    with pytest.raises(ValueError, match=r"FusedMLP: unknown activation 'swish'"):
        nn.FusedMLP(64, 128, activation="swish", key=key)
    with pytest.raises(ValueError, match=r"FusedMLP: unknown norm 'batchnorm'"):
        nn.FusedMLP(64, 128, norm="batchnorm", key=key)
    with pytest.raises(ValueError, match=r"FusedMLP expects inputs of shape \(\.\.\., 64\), "
                                         r"got \(16, 32\)"):
        nn.FusedMLP(64, 128, config=CFG, key=key)(jnp.ones((16, 32)))
    with pytest.raises(ValueError, match=r"MoE: top_k must be an int in \[1, num_experts=4\], "
                                         r"got 5"):
        nn.MoE(64, 128, 4, top_k=5, key=key)
    with pytest.raises(ValueError, match=r"MoE: capacity_factor must be > 0 or None, got -1.0"):
        nn.MoE(64, 128, 4, capacity_factor=-1.0, key=key)
    with pytest.raises(ValueError, match=r"MoE: x must have shape \(\.\.\., 64\), got \(16, 32\)"):
        nn.MoE(64, 128, 4, config=CFG, key=key)(jnp.ones((16, 32)))
    grouped = nn.GroupedLinear(4, 64, 32, key=key)
    with pytest.raises(ValueError, match=r"x_sorted must have shape \(rows, 64\), got \(64, 32\)"):
        grouped(jnp.ones((64, 32)), jnp.array([16] * 4))
    with pytest.raises(ValueError, match=r"group_sizes must have shape \(4,\)"):
        grouped(jnp.ones((64, 64)), jnp.array([16] * 3))
    with pytest.raises(TypeError, match=r"group_sizes must be integers, got dtype float32"):
        grouped(jnp.ones((64, 64)), jnp.array([16.0] * 4))


def test_attention_and_dot_general_reject():
    nn = fp8jax.nn
    with pytest.raises(ValueError, match=r"mode must be one of .*got 'fp8'"):
        nn.DotProductAttention(mode="fp8")
    with pytest.raises(ValueError, match=r"backend must be one of .*got 'flash'"):
        nn.DotProductAttention(backend="flash")
    attn = nn.DotProductAttention(config=CFG)
    q = jnp.ones((2, 128, 4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"BTNH arrays .*query has shape \(128, 64\)"):
        attn(jnp.ones((128, 64)), q, q)
    with pytest.raises(TypeError, match=r"query must be float16/bfloat16/float32, got dtype int32"):
        attn(q.astype(jnp.int32), q, q)
    with pytest.raises(TypeError, match=r"config must be an fp8jax.Fp8Config, got str"):
        fp8jax.Fp8DotGeneral("delayed")
    dot = fp8jax.Fp8DotGeneral(CFG)
    with pytest.raises(ValueError, match=r"shapes lhs \(16, 32\) and rhs \(16, 32\) do not fit"):
        dot(jnp.ones((16, 32)), jnp.ones((16, 32)), (((1,), (0,)), ((), ())))


def test_trainer_rejects_inconsistent_model_options():
    from fp8jax.train import _cli as cli

    with pytest.raises(ValueError, match=r"dim \(100\) must divide by heads \(3\)"):
        cli.run_config(cli.parse_args(["--dim", "100", "--heads", "3"]))
    with pytest.raises(ValueError, match=r"top_k=9 must be in \[1, experts=4\]"):
        cli.run_config(cli.parse_args(["--top-k", "9", "--experts", "4"]))
    with pytest.raises(SystemExit):
        cli.parse_args(["--precision", "fp16"])


# --- FusedMLP (nn/mlp.py) ----------------------------------------------------------------
@pytest.mark.parametrize("args, kwargs, match", [
    ((0, 128), {}, r"FusedMLP: hidden=0 is not allowed; expected an int >= 1"),
    ((64, -5), {}, r"FusedMLP: ffn=-5 is not allowed"),
    ((64.0, 128), {}, r"FusedMLP: hidden=64\.0 is not allowed"),
    ((True, 128), {}, r"FusedMLP: hidden=True is not allowed"),
    ((64, 128), dict(eps=-1), r"FusedMLP: eps=-1 is not allowed; expected a finite number > 0"),
    ((64, 128), dict(eps=0), r"FusedMLP: eps=0 is not allowed"),
    ((64, 128), dict(eps="1e-5"), r"FusedMLP: eps='1e-5' is not allowed"),
])
def test_fused_mlp_rejects_sizes_and_eps(key, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fp8jax.nn.FusedMLP(*args, key=key, **kwargs)


def test_fused_mlp_rejects_config_inputs_and_norm_eps(key):
    nn = fp8jax.nn
    for fp8 in (True, False):
        with pytest.raises(TypeError, match=r"FusedMLP: config must be an fp8jax.Fp8Config, "
                                            r"got dict"):
            nn.FusedMLP(64, 128, config={}, fp8=fp8, key=key)
    mlp = nn.FusedMLP(64, 128, config=CFG, key=key)
    with pytest.raises(TypeError, match=r"FusedMLP: x must be float16/bfloat16/float32, "
                                        r"got dtype int32 with shape \(2, 8, 64\)"):
        mlp(jnp.ones((2, 8, 64), jnp.int32))
    with pytest.raises(TypeError, match=r"FusedMLP: x must be an array, got NoneType"):
        mlp(None)
    with pytest.raises(ValueError, match=r"FusedMLP: eps=-1\.0 is not allowed"):
        nn.FusedMLP.from_modules(eqx.nn.RMSNorm(64, eps=-1.0), eqx.nn.Linear(64, 256, key=key),
                                 eqx.nn.Linear(128, 64, key=key), activation="swiglu")


# --- MoE / GroupedMLP / GroupedLinear (nn/grouped.py) -------------------------------------
@pytest.mark.parametrize("make, match", [
    (lambda k: fp8jax.nn.MoE(64, 128, 0, key=k), r"MoE: num_experts=0 is not allowed; "
                                                 r"expected an int >= 1"),
    (lambda k: fp8jax.nn.MoE(64, 128, 4.0, key=k), r"MoE: num_experts=4\.0 is not allowed"),
    (lambda k: fp8jax.nn.MoE(0, 128, 4, key=k), r"MoE: hidden=0 is not allowed"),
    (lambda k: fp8jax.nn.MoE(64, 0, 4, key=k), r"MoE: ffn=0 is not allowed"),
    (lambda k: fp8jax.nn.MoE(64, 128, 4, top_k=True, key=k), r"MoE: top_k must be .*got True"),
    (lambda k: fp8jax.nn.MoE(64, 128, 4, capacity_factor="1", key=k),
     r"MoE: capacity_factor must be > 0 or None, got '1'"),
    (lambda k: fp8jax.nn.MoE(64, 128, 4, backend="cuda", key=k),
     r"MoE: backend must be one of \('auto', 'pallas', 'reference'\), got 'cuda'"),
    (lambda k: fp8jax.nn.GroupedMLP(0, 64, 128, key=k), r"GroupedMLP: num_experts=0 is not"),
    (lambda k: fp8jax.nn.GroupedMLP(4, 64, 128, backend="cuda", key=k),
     r"GroupedMLP: backend must be one of .*got 'cuda'"),
    (lambda k: fp8jax.nn.GroupedLinear(-1, 64, 128, key=k), r"GroupedLinear: num_experts=-1 is"),
    (lambda k: fp8jax.nn.GroupedLinear(4, 64, 128, backend="cuda", key=k),
     r"GroupedLinear: backend must be one of .*got 'cuda'"),
    (lambda k: fp8jax.nn.GroupedLinear(4, 64, 128, key=k).with_backend("cuda"),
     r"GroupedLinear.with_backend: backend must be one of .*got 'cuda'"),
])
def test_grouped_rejects_options(key, make, match):
    with pytest.raises(ValueError, match=match):
        make(key)


def test_moe_names_itself_and_the_callers_input(key):
    with pytest.raises(TypeError, match=r"MoE: config must be an fp8jax.Fp8Config, got str"):
        fp8jax.nn.MoE(64, 128, 4, config="delayed", key=key)
    with pytest.raises(TypeError, match=r"GroupedLinear: config must be .*, got dict"):
        fp8jax.nn.GroupedLinear(4, 64, 128, config={}, key=key)
    moe = fp8jax.nn.MoE(64, 128, 4, config=CFG, key=key)
    for dtype in (jnp.int32, jnp.float8_e4m3fn):
        name = jnp.dtype(dtype).name
        with pytest.raises(TypeError, match=rf"MoE: x must be float16/bfloat16/float32, got "
                                            rf"dtype {name} with shape \(2, 8, 64\)"):
            moe(jnp.ones((2, 8, 64), dtype))
    with pytest.raises(TypeError, match=r"MoE: x must be an array, got NoneType"):
        moe(None)


# --- DotProductAttention / MultiHeadAttention (nn/attention.py) --------------------------
@pytest.mark.parametrize("scale", ["x", -1.0, 0, float("nan"), float("inf"), True])
def test_attention_rejects_scale_at_construction(scale):
    with pytest.raises(ValueError, match=rf"DotProductAttention: scale={re.escape(repr(scale))} "
                                         r"is not allowed; expected a finite number > 0 or None"):
        fp8jax.nn.DotProductAttention(scale=scale)


def test_attention_rejects_head_dim_mismatch_config_and_scale():
    nn = fp8jax.nn
    assert nn.DotProductAttention(scale=np.float32(0.125)).scale == 0.125
    q = jnp.ones((2, 128, 4, 64), jnp.bfloat16)
    k = jnp.ones((2, 128, 4, 32), jnp.bfloat16)
    for mode in ("bf16", "fp8_dpa"):
        with pytest.raises(ValueError, match=r"query head_dim \(64\) and key head_dim \(32\) must "
                                             r"be equal; got query \(2, 128, 4, 64\)"):
            nn.DotProductAttention(mode, config=CFG)(q, k, k)
    with pytest.raises(ValueError, match=r"dot_product_attention: scale='x' is not allowed"):
        nn.dot_product_attention(q, q, q, mode="bf16", scale="x")
    for mode in ("bf16", "fp8_dpa"):
        with pytest.raises(TypeError, match=r"DotProductAttention: config must be an "
                                            r"fp8jax.Fp8Config, got dict"):
            nn.DotProductAttention(mode, config={})


@pytest.mark.parametrize("args, kwargs, match", [
    ((64, 0), {}, r"MultiHeadAttention: num_heads=0 is not allowed; expected an int >= 1"),
    ((64, 4), dict(num_kv_heads=0), r"MultiHeadAttention: num_kv_heads=0 is not allowed"),
    ((0, 4), {}, r"MultiHeadAttention: dim=0 is not allowed"),
    ((64, 4), dict(head_dim=-8), r"MultiHeadAttention: head_dim=-8 is not allowed"),
    ((64, 4), dict(num_kv_heads=3), r"MultiHeadAttention: num_heads \(4\) must be a multiple"),
    ((64, 4), dict(mode="fp8"), r"MultiHeadAttention: mode must be one of .*got 'fp8'"),
])
def test_multi_head_attention_rejects_options(key, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fp8jax.nn.MultiHeadAttention(*args, key=key, **kwargs)


def test_multi_head_attention_rejects_config_and_input_width(key):
    with pytest.raises(TypeError, match=r"MultiHeadAttention: config must be .*, got dict"):
        fp8jax.nn.MultiHeadAttention(64, 4, config={}, key=key)
    mha = fp8jax.nn.MultiHeadAttention(64, 4, mode="bf16", key=key)
    with pytest.raises(ValueError, match=r"MultiHeadAttention expects inputs of shape "
                                         r"\(\.\.\., T, 64\), got \(16, 32\)"):
        mha(jnp.ones((16, 32)))


# --- flax adapter (flax.py) ---------------------------------------------------------------
def test_flax_adapter_rejects_config_early():
    ff = pytest.importorskip("fp8jax.flax")
    with pytest.raises(TypeError, match=r"fp8_dot_general_cls: config must be an "
                                        r"fp8jax.Fp8Config, got dict"):
        ff.fp8_dot_general_cls({"scaling": "current"})
    with pytest.raises(TypeError, match=r"fp8_dot_general_cls: config is the class Fp8Config; "
                                        r"expected an instance"):
        ff.fp8_dot_general_cls(Fp8Config)
    with pytest.raises(TypeError, match=r"Fp8DotGeneralOp: config must be .*, got dict"):
        ff.Fp8DotGeneralOp(config={"scaling": "current"})
    with pytest.raises(TypeError, match=r"Fp8Einsum: config must be .*, got str"):
        ff.Fp8Einsum(config="delayed")


def test_flax_einsum_rejects_eqn_and_kernel(key):
    ff = pytest.importorskip("fp8jax.flax")
    einsum = ff.Fp8Einsum(CFG)
    x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
    with pytest.raises(TypeError, match=r"Fp8Einsum: eqn=3 is not allowed; expected an einsum"):
        einsum.init(key, 3, x, w)
    with pytest.raises(ValueError, match=r"Fp8Einsum: eqn='ab,bc,cd->ad' is not allowed; "
                                         r"expected two operands"):
        einsum.init(key, "ab,bc,cd->ad", x, w)
    with pytest.raises(TypeError, match=r"Fp8Einsum: rhs \(the kernel\) must be float16/bfloat16"
                                        r"/float32, got dtype int32 with shape \(32, 16\)"):
        einsum.init(key, "ab,bc->ac", x, w.astype(jnp.int32))
    with pytest.raises(TypeError, match=r"Fp8Einsum: lhs must be an array, got NoneType"):
        einsum.init(key, "ab,bc->ac", None, w)
    assert einsum.apply(einsum.init(key, "ab,bc->ac", x, w), "ab,bc->ac", x, w).shape == (16, 16)


# --- found by this session's audit --------------------------------------------------------
def test_empty_inputs_name_their_shape():
    key = jax.random.PRNGKey(0)
    layer = fp8jax.fp8_linear_layers(eqx.nn.Linear(32, 64, key=key), CFG)
    with pytest.raises(ValueError, match=r"x has shape \(0, 32\), with no elements"):
        layer(jnp.ones((0, 32)))
    with pytest.raises(ValueError, match=r"vmapped over an axis of size 0"):
        jax.vmap(layer)(jnp.ones((0, 32)))
    mlp = fp8jax.nn.FusedMLP(32, 64, config=CFG, key=key)
    with pytest.raises(ValueError, match=r"FusedMLP: x has shape \(0, 32\)"):
        mlp(jnp.ones((0, 32)))
    moe = fp8jax.nn.MoE(32, 64, num_experts=4, top_k=2, config=CFG, key=key)
    with pytest.raises(ValueError, match=r"MoE: x has shape \(0, 32\)"):
        moe(jnp.ones((0, 32)))


def test_nan_weight_is_counted_not_recorded_as_the_finite_max():
    """A NaN in a per-tensor layer's weight is a non-finite step on every backend (XLA's
    vectorized CPU max drops NaN at this size): counted, kept out of the history."""
    layer = fp8jax.fp8_linear_layers(eqx.nn.Linear(256, 256, key=jax.random.PRNGKey(0)), CFG)
    layer = eqx.tree_at(lambda m: m.weight, layer, layer.weight.at[1, 2].set(jnp.nan))
    x = jax.random.normal(jax.random.PRNGKey(1), (512, 256))
    loss = lambda m: jnp.sum(jnp.nan_to_num(jax.vmap(m)(x)))  # noqa: E731
    grads = eqx.filter_jit(eqx.filter_grad(loss))(layer)
    op = fp8jax.apply_updates(layer, None, fp8jax.partition_for_grad_overwrite(grads)[0])
    op = op.dot_general
    assert float(op.nonfinite_count[0]) == 1.0
    assert float(op.kernel_amax_history[0]) == 0.0  # the step's weight amax was not recorded
    assert np.all(np.isfinite(np.asarray(op.kernel_scale)))


def test_dot_general_bad_call_options():
    op = fp8jax.Fp8DotGeneral(CFG)
    x, w = jnp.ones((16, 32)), jnp.ones((64, 32))
    dims = (((1,), (1,)), ((), ()))
    with pytest.raises(TypeError, match="preferred_element_type must be a float dtype.*int32"):
        op(x, w, dims, preferred_element_type=jnp.int32)
    with pytest.raises(ValueError, match="precision='nope' is not allowed"):
        op(x, w, dims, precision="nope")
    for bad in ((-1,), 3, (2.0,)):
        with pytest.raises(ValueError, match=r"stack_shape=.* expected a tuple of ints >= 1"):
            fp8jax.Fp8DotGeneral(CFG, stack_shape=bad)
    stacked = fp8jax.Fp8DotGeneral(CFG, stack_shape=(3,))
    with pytest.raises(ValueError, match=r"stack shape \(3,\): a stacked layer"):
        stacked(x, jnp.ones((3, 64, 32)), dims)


def test_optimizer_helpers_with_none():
    model = fp8jax.fp8_linear_layers(eqx.nn.Linear(32, 32, key=jax.random.PRNGKey(0)), CFG)
    grads = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(jnp.ones((16, 32)))))(model)
    with pytest.raises(ValueError, match="opt_state is None; create it with"):
        fp8jax.optax_step(optax.sgd(0.1), model, grads, None)
    with pytest.raises(ValueError, match="accumulate_grads: grads is None"):
        fp8jax.accumulate_grads(grads, None)


def test_same_named_classes_are_told_apart():
    """Gradients of the unconverted model: both are a class named Linear."""
    plain = eqx.nn.Linear(32, 32, key=jax.random.PRNGKey(0))
    model = fp8jax.fp8_linear_layers(plain, CFG)
    grads = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(jnp.ones((16, 32)))))(plain)
    opt = optax.sgd(0.1)
    with pytest.raises(ValueError, match=r"fp8jax\.nn\._linear\.Linear.*equinox"):
        fp8jax.optax_step(opt, model, grads, opt.init(fp8jax.trainable(model)))


def test_distributed_names_and_meshes():
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))
    model = fp8jax.fp8_linear_layers([eqx.nn.Linear(32, 32, key=jax.random.PRNGKey(0))], CFG)
    with pytest.raises(TypeError, match=r"column_parallel must be a list of names, e.g. \['0'\]"):
        fp8jax.shard_model(model, mesh, tensor_axis="tensor", column_parallel="0")
    with pytest.raises(ValueError, match="fsdp_axis and tensor_axis are both 'fsdp'"):
        fp8jax.shard_model(model, mesh, "fsdp", "fsdp")
    with pytest.raises(TypeError, match="fsdp_axes must be a list of names"):
        fp8jax.record_fsdp(model, "fsdp")
    with pytest.raises(TypeError, match="sequence_sharding: mesh must be a jax.sharding.Mesh"):
        fp8jax.distributed.sequence_sharding(None, (2, 8, 32))
    with pytest.raises(ValueError, match="sequence_sharding: mesh has no axis 'model'"):
        fp8jax.distributed.sequence_sharding(mesh, (2, 8, 32), ["fsdp"], tensor_axis="model")
    with pytest.raises(TypeError, match="sequence_parallel: mesh must be a jax.sharding.Mesh"):
        fp8jax.distributed.sequence_parallel(model, None, ["0"], [])


def test_apply_updates_with_its_arguments_swapped():
    model = fp8jax.fp8_linear_layers(eqx.nn.Linear(32, 32, key=jax.random.PRNGKey(0)), CFG)
    grads = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(jnp.ones((16, 32)))))(model)
    overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
    with pytest.raises(ValueError, match=r"the order is apply_updates\(model, updates, overw"):
        fp8jax.apply_updates(model, overwrites, grads)
    with pytest.raises(ValueError, match=r"the updates hold FP8 state"):
        fp8jax.apply_updates(model, model, None)
    with pytest.raises(ValueError, match=r"the overwrites hold parameter updates"):
        fp8jax.apply_updates(model, None, grads)
    fp8jax.apply_updates(model, grads, overwrites)  # the right order still works


@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_sizes_past_the_rows(key, fp8):
    """Group sizes that sum past the rows raise when concrete; traced ones (under ``jit``)
    are cut at the last row, as the docstring says."""
    layer = fp8jax.nn.GroupedLinear(4, 64, 128, key=key, fp8=fp8, config=CFG)
    x = jax.random.normal(key, (16, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="sum to 23, more than the 16 rows"):
        layer(x, jnp.array([10, 10, 0, 3]))
    apply = jax.jit(layer.__call__)
    np.testing.assert_array_equal(
        np.asarray(apply(x, jnp.array([10, 10, 0, 3])), np.float32),
        np.asarray(apply(x, jnp.array([10, 6, 0, 0])), np.float32),
    )
