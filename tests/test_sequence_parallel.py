"""Megatron sequence parallelism with FP8 linears (issue 24) on 8 host CPU devices: the
tokens outside the tensor-parallel pair are split over the tensor axis; the column-parallel
layer all-gathers its FP8 input, the row-parallel one reduce-scatters its output, and
training matches the single-device run (`fp8jax._ops.sequence_parallel`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
import test_distributed as td
from fp8jax import tuning

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs 8 devices (conftest's XLA_FLAGS)"
)

SP = {
    "tensor_axis": "tensor",
    "column_parallel": ["l1"],
    "row_parallel": ["l2"],
    "sequence_parallel": True,
}
TOKENS = P(("data", "fsdp", "tensor"), None)  # tokens split over every axis


@pytest.fixture(scope="module")
def reference():
    return td._train(td._model(), *td._data())


def _sp_model(mesh):
    fsdp = {} if mesh.shape["fsdp"] > 1 else {"fsdp_axis": None}
    return fp8jax.shard_model(td._model(), mesh, **SP, **fsdp)


@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 1, 4), (1, 2, 4)])
def test_sequence_parallel_matches_single_device(reference, shape):
    mesh = td._mesh(*shape)
    x, y = (jax.device_put(a, NamedSharding(mesh, TOKENS)) for a in td._data())
    run = td._train(_sp_model(mesh), x, y)
    td.check_matches(run, reference)
    assert run[0].l2.dot_general.weight_sharding.sequence.kind == "row"


@pytest.mark.parametrize("batch, seq", [(8, 16), (2, 64)])
def test_sequence_split_of_batched_activations(reference, batch, seq):
    """``[batch, seq, dim]`` activations placed by `fp8jax.distributed.sequence_sharding`:
    several sequences per batch shard split whole sequences over ``tensor``, one sequence
    per shard splits the sequence (Megatron's split). Either way the op's token split
    matches the activation's: no all-to-all, the same losses as one device."""
    mesh = td._mesh(2, 1, 4)
    x, y = (a.reshape(batch, seq, 64) for a in td._data())
    sharding = fp8jax.distributed.sequence_sharding(mesh, x.shape)
    want = (
        P(("data", "fsdp", "tensor"), None, None)
        if batch == 8
        else P(("data", "fsdp"), "tensor", None)
    )
    assert sharding.spec == want
    x, y = (jax.device_put(a, sharding) for a in (x, y))
    model = _sp_model(mesh)
    cs = fp8jax.distributed.hlo_collectives(
        td.step.lower(model, td.OPT.init(fp8jax.trainable(model)), x, y)
    )
    assert not [c for c in cs if c.kind == "all-to-all"], cs
    model, losses, _ = td._train(model, x, y)
    np.testing.assert_allclose(losses, reference[1], rtol=td.LOSS_RTOL)
    assert fp8jax.distributed.fp8_state_replicated(model)


def test_sequence_parallel_collectives_are_fp8_gathers_and_output_reductions():
    mesh = td._mesh(2, 1, 4)
    cs = td._collectives(_sp_model(mesh), mesh, TOKENS)
    fwd = [c for c in cs if "transpose(" not in c.op_name]
    bwd = [c for c in cs if "transpose(" in c.op_name]
    gathers = lambda part: sorted((c.dtype, c.shape) for c in part if c.kind == "all-gather")  # noqa: E731
    # forward: l1's FP8 input, its 16 tokens per device gathered to the data shard's 64
    assert gathers(fwd) == [("f8e4m3fn", "[1,64,64]")]
    # backward: l2's FP8 output gradient once (one scale: its wgrad copy is the gathered one
    # transposed on each device), l1's FP8 input's transposed copy
    assert gathers(bwd) == [("f8e4m3fn", "[1,64,64]"), ("f8e5m2", "[1,64,64]")]
    # l2's output: partial sums reduced in its dtype and each device keeps its tokens (the
    # partitioner's all-reduce + dynamic-slice; GPUs rewrite it into a reduce-scatter)
    out = [
        c for c in fwd if c.kind in ("all-reduce", "reduce-scatter") and "dot_general" in c.op_name
    ]
    assert [(c.dtype, c.shape) for c in out] == [("f32", "[64,64]")]
    # amaxes: scalars only, XLA's partitioned reduce_max or the per-device casts' pmax
    amax = [c for c in cs if "reduce_max" in c.op_name or c.op_name.endswith("pmax")]
    assert len(amax) >= 6 and all(c.kind == "all-reduce" and c.shape == "[]" for c in amax)


def test_without_sequence_parallel_nothing_moves_tokens():
    """The same tensor-parallel pair without sequence parallelism: its input arrives
    replicated over the tensor axis, so no activation is gathered."""
    mesh = td._mesh(2, 1, 4)
    kwargs = {k: v for k, v in SP.items() if k != "sequence_parallel"}
    model = fp8jax.shard_model(td._model(), mesh, fsdp_axis=None, **kwargs)
    assert model.l1.dot_general.weight_sharding.sequence is None
    cs = td._collectives(model, mesh, P(("data", "fsdp"), None))
    assert not [c for c in cs if c.kind == "all-gather"]


def test_sequence_parallel_bad_arguments():
    mesh = td._mesh(2, 1, 4)
    with pytest.raises(ValueError, match="needs tensor-parallel layers"):
        fp8jax.shard_model(td._model(), mesh, sequence_parallel=True)
    with pytest.raises(ValueError, match="must not hold the tensor axis"):
        fp8jax.shard_model(td._model(), mesh, **SP, batch_axes=("data", "tensor"))
    with pytest.raises(ValueError, match="no axis 'batch'"):
        fp8jax.shard_model(td._model(), mesh, **SP, batch_axes=("batch",))
    with pytest.raises(ValueError, match=r"sequence length 6 .* tensor axis 'tensor' of size 4"):
        fp8jax.distributed.sequence_sharding(mesh, (2, 6, 64))
    with pytest.raises(ValueError, match=r"2 sequences per batch shard .* size 4"):
        fp8jax.distributed.sequence_sharding(mesh, (4, 8, 64))


def _fresh_step():
    """`test_distributed.step` traced anew: the tuning in effect is read at trace time."""

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        model, opt_state = fp8jax.optax_step(td.OPT, model, grads, opt_state)
        return model, opt_state, loss, fp8jax.trainable(grads)

    return step


def test_op_traces_are_built_per_tuning_and_fsdp_context():
    """The FP8 dot's ``custom_vmap`` ops are built per `Spec` and per trace context (muted
    or not, the GEMM tuning, the FSDP axes): jax 0.11 caches a ``custom_vmap``'s trace by its function
    and shapes alone, so one object for every context replayed its first trace in the next
    (on 2 GPUs, ``tuning.gemm(sequence_cast=...)`` was ignored after the first trace; jax
    0.10 traces each call, so this checks the objects)."""
    from fp8jax._ops import dot, traced
    from fp8jax.distributed import fsdp_axes

    spec = dot.Spec(fp8jax.Fp8Config(), *(np.dtype(jnp.bfloat16),) * 3, False)
    for build in (dot.fwd_fn, dot.gemm_fn, dot.bwd_fn, lambda s: dot.cast_fn(s, 64)):
        first = build(spec)
        assert build(spec) is first  # cached within a context
        with tuning.gemm(sequence_cast=False):
            assert build(spec) is not first
            off = build(spec)
        with tuning.gemm(sequence_cast=False):
            assert build(spec) is off  # the same context again: the same object
        with fsdp_axes(("shard",)):
            assert build(spec) is not first
        token = traced.QUIET.set(1)  # a shape-only per-example trace under jax.vmap
        try:
            assert build(spec) is not first
        finally:
            traced.QUIET.reset(token)


@pytest.mark.parametrize(
    "shape, recipe", [((2, 1, 4), None), ((1, 1, 8), None), ((2, 1, 4), "rowwise")]
)
def test_sequence_casts_per_device_keep_the_bits(shape, recipe, monkeypatch):
    """`Tuning.sequence_cast`: the casts that write a transposed copy run per device under
    shard_map, where the Pallas cast kernel can run on a GPU (l1's input on its tokens,
    l1's output gradient and l2's input on their features over ``tensor``; l2's output
    gradient stays XLA's, gathered then transposed), each amax one scalar pmax over the
    split's axes. The cast is elementwise with a scale known before it: two steps give the
    same bits as XLA's partitioned casts, and the FP8 gathers are the same. The row-wise
    recipe keeps XLA's casts (a row's scale spans the features the tensor axis splits)."""
    if recipe is not None:
        monkeypatch.setattr(td, "CFG", fp8jax.Fp8Config(recipe=recipe, selective=False))
    mesh = td._mesh(*shape)
    x, y = (jax.device_put(a, NamedSharding(mesh, TOKENS)) for a in td._data())
    runs, gathers = [], []
    for on in (False, True):
        with tuning.gemm(sequence_cast=on):
            step, model = _fresh_step(), _sp_model(mesh)
            opt_state = td.OPT.init(fp8jax.trainable(model))
            cs = fp8jax.distributed.hlo_collectives(step.lower(model, opt_state, x, y))
            pmax = [c for c in cs if c.op_name == "pmax"]
            assert [c.shape for c in pmax] == (["[]"] * 3 if on and not recipe else []), pmax
            gathers.append(sorted((c.dtype, c.shape) for c in cs if c.kind == "all-gather"))
            out = []
            for _ in range(2):
                model, opt_state, loss, grads = step(model, opt_state, x, y)
                out.append((loss, grads))
            runs.append((out, fp8jax.fp8_state(model)))
    assert gathers[0] == gathers[1]
    for a, b in zip(jax.tree_util.tree_leaves(runs[0]), jax.tree_util.tree_leaves(runs[1])):
        np.testing.assert_array_equal(a, b)
