"""Sharded FP8 training on 8 host CPU devices (issue 24): DP, FSDP, TP and a 2-D mesh
match the single-device run; FSDP all-gathers weights in FP8; amaxes are scalar
all-reduces; `fp8jax.shard_model`'s errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax import distributed
from helpers import GRAD_OF_MAX, LOSS_RTOL, STATE_RTOL
from helpers import eight_device_mesh as _mesh

CFG = fp8jax.Fp8Config(selective=False)
STEPS = 3

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs 8 devices (conftest's XLA_FLAGS)"
)


class MLP(eqx.Module):
    l1: eqx.nn.Linear
    l2: eqx.nn.Linear

    def __init__(self, key, dim=64, hidden=256):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(dim, hidden, key=k1)
        self.l2 = eqx.nn.Linear(hidden, dim, key=k2)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


OPT = optax.adam(1e-2)


@eqx.filter_jit
def step(model, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    model, opt_state = fp8jax.optax_step(OPT, model, grads, opt_state)
    return model, opt_state, loss, fp8jax.trainable(grads)


def _model():
    return fp8jax.fp8_linear_layers(MLP(jax.random.PRNGKey(0)), CFG)


def _data():
    x = jax.random.normal(jax.random.PRNGKey(1), (128, 64)) * 3.0
    y = jax.random.normal(jax.random.PRNGKey(2), (128, 64))
    return x, y


def _train(model, x, y):
    opt_state = OPT.init(fp8jax.trainable(model))
    losses, grads = [], []
    for _ in range(STEPS):
        model, opt_state, loss, g = step(model, opt_state, x, y)
        losses.append(float(loss))
        grads.append(g)
    return model, losses, grads


@pytest.fixture(scope="module")
def reference():
    return _train(_model(), *_data())


def _state(model):
    return [np.asarray(a) for _, s in fp8jax.fp8_state(model) for a in s.state()]


def check_sequence_moves(collectives, tokens: str, out: str):
    """A sequence-parallel pair's forward: the column layer's input gathered in FP8 (its
    tokens, shape ``tokens``), the row layer's output partial sums reduced in float32
    (``out``; the partitioner's all-reduce, a reduce-scatter on GPUs), no all-to-all."""
    fwd = [c for c in collectives if "transpose(" not in c.op_name]
    gathered = [c for c in fwd if c.kind == "all-gather" and c.shape == tokens]
    assert [c.dtype for c in gathered] == ["f8e4m3fn"], collectives
    sums = [c for c in fwd if c.kind == "all-reduce" and "dot_general" in c.op_name]
    assert [(c.dtype, c.shape) for c in sums] == [("f32", out)], collectives
    assert not [c for c in collectives if c.kind == "all-to-all"], collectives


def check_matches(run, reference):
    """A sharded run ``(model, losses, grads)`` against the single-device one: losses,
    gradients and FP8 state within the tolerances above, the state replicated bit-identically."""
    (model, losses, grads), (ref_model, ref_losses, ref_grads) = run, reference
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    for g, rg in zip(
        jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads), strict=True
    ):
        assert np.max(np.abs(g - rg)) <= GRAD_OF_MAX * np.max(np.abs(rg))
    for a, b in zip(_state(model), _state(ref_model), strict=True):
        np.testing.assert_allclose(a, b, rtol=STATE_RTOL)
    assert distributed.fp8_state_replicated(model)


SETUPS = {
    "dp": ((8, 1, 1), {"fsdp_axis": None}),
    "fsdp": ((1, 8, 1), {}),
    "tp": (
        (1, 1, 8),
        {
            "fsdp_axis": None,
            "tensor_axis": "tensor",
            "column_parallel": ["l1"],
            "row_parallel": ["l2"],
        },
    ),
    "2d": ((2, 4, 1), {}),
    "fsdp+tp": (
        (1, 2, 4),
        {"tensor_axis": "tensor", "column_parallel": ["l1"], "row_parallel": ["l2"]},
    ),
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_sharded_training_matches_single_device(reference, setup):
    shape, kwargs = SETUPS[setup]
    mesh = _mesh(*shape)
    model = fp8jax.shard_model(_model(), mesh, **kwargs)
    batch = NamedSharding(mesh, P(("data", "fsdp"), None))
    x, y = (jax.device_put(a, batch) for a in _data())
    model, losses, grads = _train(model, x, y)
    check_matches((model, losses, grads), reference)  # state: the same bytes on every device
    for _, s in fp8jax.fp8_state(model):
        assert all(leaf.sharding.is_fully_replicated for leaf in s.state())
    assert (
        model.l1.weight.sharding.spec
        == fp8jax.shard_model(_model(), mesh, **kwargs).l1.weight.sharding.spec
    )


def _user_placed(mesh):
    """The model with its weights placed by hand (FSDP, no fp8jax helper), as a user
    would with `eqx.filter_shard`."""
    model = _model()
    specs = eqx.tree_at(
        lambda m: (m.l1.weight, m.l2.weight),
        jax.tree_util.tree_map(lambda _: P(), model),
        (P("fsdp", None), P(None, "fsdp")),
    )
    shardings = jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), specs)
    return eqx.filter_shard(model, shardings)


def test_user_placed_weights_zero_configuration(reference):
    """Weights placed by the user and a plain `eqx.filter_jit` step: the weights are
    all-gathered in FP8 (found when compiling, `fp8jax._ops.fsdp`) and the run matches
    the single-device one; `record_fsdp` (recorded shardings) gives the same."""
    mesh = _mesh(1, 8, 1)
    model = _user_placed(mesh)
    assert model.l1.dot_general.weight_sharding is None
    batch = NamedSharding(mesh, P("fsdp", None))
    x, y = (jax.device_put(a, batch) for a in _data())
    cs = _collectives(model, mesh, P("fsdp", None))
    gathers = [c for c in cs if c.kind == "all-gather"]
    # forward: both weights; backward: l2's for its dgrad; nothing else is gathered
    assert sorted(c.shape for c in gathers) == ["[1,256,64]", "[1,256,64]", "[1,64,256]"]
    assert all(c.dtype == "f8e4m3fn" for c in gathers), gathers
    _amaxes_are_scalar_all_reduces(cs)
    trained, losses, grads = _train(model, x, y)
    np.testing.assert_allclose(losses, reference[1], rtol=LOSS_RTOL)
    for g, rg in zip(
        jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(reference[2]), strict=True
    ):
        assert np.max(np.abs(g - rg)) <= GRAD_OF_MAX * np.max(np.abs(rg))
    assert distributed.fp8_state_replicated(trained)
    assert trained.l1.weight.sharding.spec == P("fsdp", None)  # stays sharded
    recorded = distributed.record_fsdp(model)
    assert recorded.l2.dot_general.weight_sharding.spec == (None, "fsdp")
    _, losses, _ = _train(recorded, x, y)
    np.testing.assert_allclose(losses, reference[1], rtol=LOSS_RTOL)


def _gathered_over(model) -> set:
    """The axes each FP8 weight gather of a newly traced step gathers over (a new function:
    no outer trace to reuse; `fp8jax._ops.fsdp.gather_fsdp`'s static argument)."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "custom_partitioning":
                yield eqn.params["static_args"][0]
            for p in eqn.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        yield from walk(sub)

    fresh = lambda m, x: eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(m)  # noqa: E731
    return set(walk(eqx.filter_make_jaxpr(fresh)(model, _data()[0])[0].jaxpr))


def test_set_fsdp_axes_after_a_trace_is_not_served_a_stale_trace():
    """`set_fsdp_axes` after a step was traced under other axes: the next trace gathers over
    the new ones. The op's cached trace (`fp8jax._ops.traced.traced_once`) is keyed by the FSDP
    axes; it used to be reused, gathering over the old axes."""
    model = _model()
    assert _gathered_over(model) == {("fsdp",)}
    try:
        distributed.set_fsdp_axes(["shard", "fsdp"])
        assert _gathered_over(model) == {("shard", "fsdp")}
    finally:
        distributed.set_fsdp_axes(["fsdp"])
    assert _gathered_over(model) == {("fsdp",)}
    with distributed.fsdp_axes(("shard",)):  # for one block
        assert _gathered_over(model) == {("shard",)}
    assert _gathered_over(model) == {("fsdp",)}
    with pytest.raises(TypeError, match="set_fsdp_axes: expected a sequence of axis names"):
        distributed.set_fsdp_axes("shard")


def test_set_fsdp_axes_holds_for_the_whole_process():
    """A notebook sets the axes in one cell and traces in the next (ipykernel runs cells in
    copies of a context), or another thread traces: `set_fsdp_axes` holds for all of them;
    a ``with fsdp_axes`` block overrides it inside."""
    import contextvars
    import threading

    from fp8jax._ops import fsdp

    seen = []
    try:
        distributed.set_fsdp_axes(["shard"])
        contextvars.Context().run(lambda: seen.append(fsdp.current_axes()))
        t = threading.Thread(target=lambda: seen.append(fsdp.current_axes()))
        t.start()
        t.join()
        with distributed.fsdp_axes(["block"]):
            seen.append(fsdp.current_axes())
        seen.append(fsdp.current_axes())
    finally:
        distributed.set_fsdp_axes(["fsdp"])
    assert seen == [("shard",), ("shard",), ("block",), ("shard",)]


def _collectives(model, mesh, batch_spec=P(("data", "fsdp"), None)):
    batch = NamedSharding(mesh, batch_spec)
    x, y = (jax.device_put(a, batch) for a in _data())
    lowered = step.lower(model, OPT.init(fp8jax.trainable(model)), x, y)
    return distributed.hlo_collectives(lowered)


def test_fsdp_all_gathers_weights_in_fp8():
    mesh = _mesh(1, 8, 1)
    cs = _collectives(fp8jax.shard_model(_model(), mesh), mesh)
    gathers = [c for c in cs if c.kind == "all-gather"]
    assert gathers and all(c.dtype == "f8e4m3fn" for c in gathers), gathers
    fwd = [c for c in gathers if "transpose(" not in c.op_name]
    bwd = [c for c in gathers if "transpose(" in c.op_name]
    # forward: one per layer, the whole weight; backward: one for l2's dgrad (l1's
    # dgrad, the input's gradient, is dead code)
    assert sorted(c.shape for c in fwd) == ["[1,256,64]", "[1,64,256]"]
    assert [c.shape for c in bwd] == ["[1,256,64]"]
    _amaxes_are_scalar_all_reduces(cs)
    # the weight gradients are reduced in float32 (the weights' dtype), not FP8
    grads = [
        c for c in cs if c.kind in ("all-reduce", "reduce-scatter") and "dot_general" in c.op_name
    ]
    assert grads and all(c.dtype == "f32" for c in grads)


def _amaxes_are_scalar_all_reduces(cs, count=6):
    """``count``: the amaxes of sharded tensors (an amax of a replicated one is local): XLA's
    partitioned reductions, or the pmax of casts run per device on their tokens (delayed
    per-tensor scaling's activations and output gradients, `fp8jax._ops.rows`)."""
    amax = [c for c in cs if "reduce_max" in c.op_name or c.op_name == "pmax"]
    assert len(amax) == count, amax
    assert all(c.kind == "all-reduce" and c.shape == "[]" and c.dtype == "f32" for c in amax)


# DP: the input and output-gradient amaxes of both layers (the weights are replicated);
# TP: both weights, l2's input (sharded along K), l1's output gradient (sharded along N)
@pytest.mark.parametrize("setup, amaxes", [("dp", 4), ("tp", 4)])
def test_no_weight_gather_without_fsdp(setup, amaxes):
    shape, kwargs = SETUPS[setup]
    mesh = _mesh(*shape)
    cs = _collectives(fp8jax.shard_model(_model(), mesh, **kwargs), mesh)
    assert fp8jax.shard_model(_model(), mesh, **kwargs).l1.dot_general.weight_sharding.gather == ()
    assert not [c for c in cs if c.kind == "all-gather" and c.dtype not in ("f8e4m3fn", "f8e5m2")]
    _amaxes_are_scalar_all_reduces(cs, amaxes)


def test_single_device_path_has_no_constraint():
    model = _model()
    assert model.l1.dot_general.weight_sharding is None
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    sharded = fp8jax.shard_model(model, mesh)
    assert not _collectives(sharded, mesh)
    ws = sharded.l1.dot_general.weight_sharding
    assert fp8jax._ops.dot.w3_shardings(ws, (), (0,), (1,), False) == ()  # nothing to gather


# --- errors --------------------------------------------------------------------------------------
def test_axis_not_dividing_dim_names_layer_dim_and_axis():
    mesh = Mesh(np.array(jax.devices()[:6]).reshape(1, 6, 1), ("data", "fsdp", "tensor"))
    with pytest.raises(ValueError, match=r"'l1'.*out_features=256.*'fsdp' of size 6"):
        fp8jax.shard_model(_model(), mesh)
    mesh = Mesh(np.array(jax.devices()[:6]).reshape(1, 1, 6), ("data", "fsdp", "tensor"))
    with pytest.raises(ValueError, match=r"'l2'.*in_features=256.*'tensor' of size 6"):
        fp8jax.shard_model(
            _model(), mesh, fsdp_axis=None, tensor_axis="tensor", row_parallel=["l2"]
        )


def test_shard_model_bad_arguments():
    mesh = _mesh(1, 8, 1)
    with pytest.raises(ValueError, match="need a tensor_axis"):
        fp8jax.shard_model(_model(), mesh, column_parallel=["l1"])
    with pytest.raises(ValueError, match=r"pattern 'l3' matches no linear layer.*l1, l2"):
        fp8jax.shard_model(_model(), mesh, tensor_axis="tensor", column_parallel=["l3"])
    with pytest.raises(ValueError, match="no axis 'model'"):
        fp8jax.shard_model(_model(), mesh, fsdp_axis="model")
    with pytest.raises(ValueError, match="both column- and row-parallel"):
        fp8jax.shard_model(
            _model(), mesh, tensor_axis="tensor", column_parallel=["l*"], row_parallel=["l2"]
        )
    explicit = jax.make_mesh((1, 8, 1), ("data", "fsdp", "tensor"),
                             axis_types=(jax.sharding.AxisType.Explicit,) * 3)
    with pytest.raises(ValueError, match="mesh axes must be Auto"):
        fp8jax.shard_model(_model(), explicit)
    with pytest.raises(TypeError, match="Mesh"):
        fp8jax.shard_model(_model(), "fsdp=8")


# --- blocks: FusedMLP, MultiHeadAttention, MoE -------------------------------------------------
# Each block trained 3 steps on a (2, 2, 2) mesh against one device. Measured on CPU:
# losses within 3e-7 relative, gradients within 5e-7 of their max, the state equal but
# for MoE's output-gradient amaxes (the combine's sums in another order: 1.6e-7).
BLOCK_MESH = ("data", "fsdp", "tensor")


def _block(kind):
    k = jax.random.PRNGKey(3)
    if kind.startswith("mlp"):  # "mlp-halves": fc1 rows [gate | up] (reshuffled under TP)
        gate_block = None if kind == "mlp-halves" else 64
        return fp8jax.nn.FusedMLP(
            64, 128, activation="swiglu", residual=True, config=CFG, gate_block=gate_block, key=k
        )
    if kind == "mha":
        return fp8jax.nn.MultiHeadAttention(
            64, 4, mode="fp8_mha", backend="reference", config=CFG, key=k
        )
    fp8 = kind == "moe"  # "moe-bf16": the same grouped GEMMs in the input precision
    return fp8jax.nn.MoE(  # the replicated dispatch (test_expert_dispatch: the all-to-all)
        64, 64, 8, top_k=2, backend="reference", fp8=fp8, config=CFG, dispatch="replicated", key=k
    )


BLOCK_SHARDING = {  # shard_model keyword arguments per block
    "mlp": dict(tensor_axis="tensor", column_parallel=["fc1"], row_parallel=["fc2"]),
    "mha": dict(tensor_axis="tensor", column_parallel=["qkv"], row_parallel=["out"]),
    "moe": dict(fsdp_axis=None, expert_axis="tensor"),  # replicated experts: plain DP
    "moe-bf16": dict(fsdp_axis=None, expert_axis="tensor"),
}


@eqx.filter_jit
def _block_step(model, opt_state, x, y):
    def loss(m):
        out = m(x)
        return jnp.mean(((out[0] if isinstance(out, tuple) else out) - y) ** 2)

    value, grads = eqx.filter_value_and_grad(loss)(model)
    model, opt_state = fp8jax.optax_step(OPT, model, grads, opt_state)
    return model, opt_state, value, fp8jax.trainable(grads)


def _train_block(model, x, y):
    opt_state = OPT.init(fp8jax.trainable(model))
    losses = []
    for _ in range(STEPS):
        model, opt_state, loss, grads = _block_step(model, opt_state, x, y)
        losses.append(float(loss))
    return model, losses, grads


@pytest.mark.parametrize("setup", list(BLOCK_SHARDING))
def test_blocks_sharded_match_single_device(setup):
    kind = setup
    x = jax.random.normal(jax.random.PRNGKey(4), (8, 16, 64))
    y = jax.random.normal(jax.random.PRNGKey(5), (8, 16, 64))
    ref_model, ref_losses, ref_grads = _train_block(_block(kind), x, y)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), BLOCK_MESH)
    model = fp8jax.shard_model(_block(kind), mesh, **BLOCK_SHARDING[setup])
    batch = NamedSharding(mesh, P(("data", "fsdp")))
    xs, ys = jax.device_put(x, batch), jax.device_put(y, batch)
    if setup.startswith("moe"):  # each device runs the grouped GEMMs on its own 4 experts
        cs = _block_collectives(model, xs, ys)
        # rows GEMMs' outputs summed over the expert axis: fc1 and fc2 forward, fc2's
        # dgrad (fc1's, the tokens' gradient, is dead code); no expert weight gathered
        psums = sorted(c.shape for c in cs if c.op_name == "psum")
        assert psums == ["[1280,128]", "[1280,64]", "[1280,64]"], cs
        assert not [c for c in cs if c.kind == "all-gather" and c.shape.startswith("[8,64")]
    if setup == "mlp":  # fc1's interleaved gate/up rows split in pairs: nothing reshuffled
        cs = _block_collectives(model, xs, ys)
        assert not [c for c in cs if c.kind in ("all-to-all", "collective-permute")], cs
    model, losses, grads = _train_block(model, xs, ys)
    check_matches((model, losses, grads), (ref_model, ref_losses, ref_grads))


def _block_collectives(model, x, y):
    lowered = _block_step.lower(model, OPT.init(fp8jax.trainable(model)), x, y)
    return distributed.hlo_collectives(lowered)


def test_fused_mlp_tensor_split_of_gate_and_up_rows():
    """A column-parallel gated fc1 stored as ``[gate | up]`` warns (XLA reshuffles the
    halves); an interleaved one whose pairs do not split over the axis is refused."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 1, 8), BLOCK_MESH)
    with pytest.warns(UserWarning, match=r"with_gate_block\(64\)"):
        fp8jax.shard_model(_block("mlp-halves"), mesh, **BLOCK_SHARDING["mlp"])
    with pytest.raises(ValueError, match=r"'fc1': ffn=128 .* gate_block=64 .* 'tensor' of size 8"):
        fp8jax.shard_model(_block("mlp"), mesh, **BLOCK_SHARDING["mlp"])
    fp8jax.shard_model(_block("mlp-halves").with_gate_block(16), mesh, **BLOCK_SHARDING["mlp"])


def test_expert_axis_not_dividing_experts():
    mesh = Mesh(np.array(jax.devices()[:6]).reshape(1, 1, 6), BLOCK_MESH)
    with pytest.raises(ValueError, match=r"num_experts=8.*'tensor' of size 6"):
        fp8jax.shard_model(_block("moe"), mesh, fsdp_axis=None, expert_axis="tensor")
    with pytest.raises(ValueError, match="no GroupedLinear"):
        fp8jax.shard_model(_model(), mesh, fsdp_axis=None, expert_axis="tensor")


# --- current scaling -------------------------------------------------------------------------
def test_current_scaling_one_scalar_all_reduce_per_amax():
    """Current scaling under FSDP: each tensor's amax is one scalar all-reduce (max),
    and every device computes the same scales (the replicated state is equal bytes)."""
    cfg = fp8jax.Fp8Config(selective=False, scaling="current")
    mesh = _mesh(2, 4, 1)
    model = fp8jax.fp8_linear_layers(MLP(jax.random.PRNGKey(0)), cfg)
    model = fp8jax.shard_model(model, mesh)
    cs = _collectives(model, mesh)
    _amaxes_are_scalar_all_reduces(cs)
    assert all(c.dtype == "f8e4m3fn" for c in cs if c.kind == "all-gather")
    x, y = (jax.device_put(a, NamedSharding(mesh, P(("data", "fsdp")))) for a in _data())
    trained, losses, _ = _train(model, x, y)
    single = fp8jax.fp8_linear_layers(MLP(jax.random.PRNGKey(0)), cfg)
    single, ref_losses, _ = _train(single, *_data())
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert distributed.fp8_state_replicated(trained)
    for a, b in zip(_state(trained), _state(single), strict=True):
        np.testing.assert_allclose(a, b, rtol=STATE_RTOL)


def test_explicit_mesh_weights_get_a_clear_error():
    """Explicit axes (``jax.make_mesh``'s default in newer JAX) are refused by shard_model
    (test above) and, for weights placed by hand, by the op itself, naming the axis."""
    explicit = jax.make_mesh(
        (1, 8, 1), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 3
    )
    model = _model()
    w = jax.device_put(model.l1.weight, NamedSharding(explicit, P("fsdp", None)))
    model = eqx.tree_at(lambda m: m.l1.weight, model, w)
    with pytest.raises(ValueError, match=r"rhs float32\[256@fsdp,64\].*Explicit mesh axes"):
        eqx.filter_jit(lambda m, x: m(x))(model, _data()[0])


def test_collectives_listed_with_the_compilation_cache_on(tmp_path):
    """With the persistent cache on (the trainer turns it on), a second listing of the same
    program compiles afresh and still reads the partitioned HLO (FP8 gathers), not a cache
    hit's optimized HLO (where the CPU carries FP8 as f16)."""
    fp8jax.enable_compilation_cache(tmp_path, min_compile_s=0)
    mesh = _mesh(1, 8, 1)
    for _ in range(2):
        cs = _collectives(fp8jax.shard_model(_model(), mesh), mesh)
        assert {c.dtype for c in cs if c.kind == "all-gather"} == {"f8e4m3fn"}


def test_fsdp_shards_the_dim_the_axis_divides():
    """FSDP splits a weight's out dim (the major one: contiguous shards, gathers and
    reduce-scatters) where the axis divides it, else the in dim (a head of 50,257
    vocabulary rows splits its 4,096 columns), also where in is the larger (an MLP's fc2);
    where neither divides it refuses, naming the layer."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 8, 1), BLOCK_MESH)
    model = eqx.nn.Linear(16, 20, key=jax.random.PRNGKey(0))  # weight [20, 16]: 20 % 8 != 0
    placed = fp8jax.shard_model(model, mesh)
    assert placed.weight.sharding.spec == P(None, "fsdp")
    wide = fp8jax.shard_model(eqx.nn.Linear(16, 24, key=jax.random.PRNGKey(0)), mesh)
    assert wide.weight.sharding.spec == P("fsdp", None)  # both divide: out
    fc2 = fp8jax.shard_model(eqx.nn.Linear(64, 16, key=jax.random.PRNGKey(0)), mesh)
    assert fc2.weight.sharding.spec == P("fsdp", None)  # out, though in is the larger
    with pytest.raises(ValueError, match=r"out_features=20 .* not divisible by mesh axis 'fsdp'"):
        fp8jax.shard_model(eqx.nn.Linear(12, 20, key=jax.random.PRNGKey(0)), mesh)


class _AttnBlock(eqx.Module):
    qkv: eqx.nn.Linear
    o: eqx.nn.Linear
    attn: fp8jax.nn.DotProductAttention
    heads: int = eqx.field(static=True)

    def __init__(self, key, dim=64, heads=4):
        k1, k2 = jax.random.split(key)
        self.qkv = eqx.nn.Linear(dim, 3 * dim, key=k1)
        self.o = eqx.nn.Linear(dim, dim, key=k2)
        self.attn = fp8jax.nn.DotProductAttention("fp8_dpa", is_causal=True, backend="reference")
        self.heads = heads

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(jax.vmap(jax.vmap(self.qkv))(x), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in (q, k, v))
        return jax.vmap(jax.vmap(self.o))(self.attn(q, k, v).reshape(b, t, d))


@pytest.mark.parametrize(
    "shape,tp", [((1, 8, 1), False), ((2, 2, 2), True), ((2, 1, 4), True)]
)
def test_fp8_attention_runs_per_device_and_matches_one_device(shape, tp):
    """`shard_model` records where FP8 attention runs (`AttnSplit`: sequences over the
    batch axes, heads over the tensor axis); each device then runs the kernel on its part
    under ``shard_map`` and the amaxes combine by ``pmax`` (cuDNN's own partitioning rule
    failed to compile with the batch split over 4 GPUs). Losses, gradients and FP8 state
    match one device; the state stays replicated."""
    model = fp8jax.fp8_linear_layers(_AttnBlock(jax.random.PRNGKey(0)), CFG)
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 32, 64)) * 2.0
    y = jax.random.normal(jax.random.PRNGKey(2), (8, 32, 64))
    mesh = _mesh(*shape)
    kw = dict(tensor_axis="tensor", column_parallel=["qkv"], row_parallel=["o"]) if tp else {}
    sharded = distributed.shard_model(model, mesh, **kw)
    split = sharded.attn.split
    assert split.batch_axes == tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1)
    assert split.head_axis == ("tensor" if tp else None)
    xs = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"))))
    text = jax.make_jaxpr(lambda m: m(xs))(sharded)
    assert "shard_map" in str(text)
    check_matches(_train(sharded, xs, y), _train(model, x, y))


def test_fp8_attention_split_keeps_heads_whole_where_the_axis_does_not_divide_them():
    """Two KV heads over a tensor axis of 4: each device runs all heads of its sequences
    (the output still matches one device); a batch the split does not divide is refused
    with the axes named."""
    from fp8jax._ops.attention import AttnSplit

    mesh = _mesh(2, 1, 4)
    attn = fp8jax.nn.DotProductAttention("fp8_dpa", is_causal=True, backend="reference")
    ks = jax.random.split(jax.random.PRNGKey(3), 3)
    q = jax.random.normal(ks[0], (4, 32, 8, 16))
    k, v = (jax.random.normal(kk, (4, 32, 2, 16)) for kk in ks[1:])
    split = attn.with_split(AttnSplit(mesh, ("data",), "tensor"))
    want = jax.jit(lambda q, k, v: attn(q, k, v))(q, k, v)
    got = jax.jit(lambda q, k, v: split(q, k, v))(q, k, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="3 sequences do not split over the mesh axes"):
        jax.jit(lambda q, k, v: split(q, k, v))(q[:3], k[:3], v[:3])
