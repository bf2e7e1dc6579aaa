"""Sharded FP8 training of a haliax model placed through its named axes (issue 24), on 8
host CPU devices: ``hax.shard`` with an axis mapping and a plain ``eqx.filter_jit`` step
match the single-device run, the FP8 state stays replicated, and the FSDP weight
all-gathers move FP8 (skipped without haliax)."""

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import fp8jax
from fp8jax import distributed
from test_distributed import (
    GRAD_OF_MAX,
    LOSS_RTOL,
    STATE_RTOL,
    STEPS,
    check_matches,
    check_sequence_moves,
)

hax = pytest.importorskip("haliax")
hnn = pytest.importorskip("haliax.nn")

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs 8 devices (conftest's XLA_FLAGS)"
)

Batch, Embed, Mlp = hax.Axis("batch", 128), hax.Axis("embed", 64), hax.Axis("mlp", 256)
# Parameters: FSDP over "embed", Megatron split over "mlp" (column- then row-parallel).
PARAMS = {"embed": "fsdp", "mlp": "tensor"}
OPT = optax.adam(1e-2)


class Block(eqx.Module):
    up: hnn.Linear
    down: hnn.Linear

    def __call__(self, x):
        return self.down(hax.nn.relu(self.up(x)))


def _model():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    block = Block(hnn.Linear.init(Embed, Mlp, key=k1), hnn.Linear.init(Mlp, Embed, key=k2))
    return fp8jax.fp8_linear_layers(block, fp8jax.Fp8Config(selective=False))


def _data():
    x = hax.random.normal(jax.random.PRNGKey(1), (Batch, Embed)) * 3.0
    return x, hax.random.normal(jax.random.PRNGKey(2), (Batch, Embed))


@eqx.filter_jit
def step(model, opt_state, x, y):
    def loss_fn(m):
        return hax.mean((m(x) - y) ** 2).scalar()

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    model, opt_state = fp8jax.optax_step(OPT, model, grads, opt_state)
    return model, opt_state, loss, fp8jax.trainable(grads)


def _train(model, x, y):
    opt_state = OPT.init(fp8jax.trainable(model))
    losses, grads = [], []
    for _ in range(STEPS):
        model, opt_state, loss, g = step(model, opt_state, x, y)
        losses.append(float(loss))
        grads.append(g)
    return model, losses, grads


def _state(model):
    return [np.asarray(a) for _, s in fp8jax.fp8_state(model) for a in s.state()]


def test_named_axis_sharding_matches_single_device():
    ref_model, ref_losses, ref_grads = _train(_model(), *_data())
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    with jax.set_mesh(mesh):
        model = hax.shard(_model(), PARAMS, mesh=mesh)
        x, y = (hax.shard(a, {"batch": ("data", "fsdp")}, mesh=mesh) for a in _data())
        assert model.up.weight.array.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
        lowered = step.lower(model, OPT.init(fp8jax.trainable(model)), x, y)
        collectives = distributed.hlo_collectives(lowered)
        model, losses, grads = _train(model, x, y)
    # The weights (2-D: [1, N, K] once canonical): forward, both over "fsdp"; backward,
    # down's again for its dgrad (up's dgrad, the input's gradient, is dead code).
    gathers = [c for c in collectives if c.kind == "all-gather" and "," in c.shape]
    assert len(gathers) == 3 and all(c.dtype == "f8e4m3fn" for c in gathers), collectives
    # every amax (input, weight, output gradient of both layers) is a scalar all-reduce
    amaxes = [c for c in collectives if "reduce_max" in c.op_name]
    assert len(amaxes) >= 6, collectives
    assert all(c.kind == "all-reduce" and c.shape == "[]" for c in amaxes), amaxes
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    for g, rg in zip(
        jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads), strict=True
    ):
        assert np.max(np.abs(g - rg)) <= GRAD_OF_MAX * np.max(np.abs(rg))
    for a, b in zip(_state(model), _state(ref_model), strict=True):
        np.testing.assert_allclose(a, b, rtol=STATE_RTOL)
    assert distributed.fp8_state_replicated(model)
    assert model.up.weight.array.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")


Pos = hax.Axis("position", 32)


def test_sequence_parallel_through_named_axes():
    """Megatron sequence parallelism for a haliax model (`fp8jax.distributed.sequence_parallel`
    on its ``hax.shard``-placed weights): tokens split over ``tensor`` between the layers
    (``position`` over it, one sequence per batch shard), ``up`` all-gathers its FP8
    input, ``down`` reduces its output to the tokens' split; training matches one device."""
    x = hax.random.normal(jax.random.PRNGKey(1), (Batch.resize(4), Pos, Embed)) * 3.0
    y = hax.random.normal(jax.random.PRNGKey(2), (Batch.resize(4), Pos, Embed))
    ref_model, ref_losses, ref_grads = _train(_model(), x, y)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    tokens = {"batch": ("data", "fsdp"), "position": "tensor"}
    with jax.set_mesh(mesh):
        model = hax.shard(_model(), PARAMS, mesh=mesh)
        model = distributed.sequence_parallel(model, mesh, ["up"], ["down"])
        assert model.down.dot_general.weight_sharding.sequence.kind == "row"
        xs, ys = (hax.shard(a, tokens, mesh=mesh) for a in (x, y))
        lowered = step.lower(model, OPT.init(fp8jax.trainable(model)), xs, ys)
        collectives = distributed.hlo_collectives(lowered)
        model, losses, grads = _train(model, xs, ys)
    # up's input: each device's 16 tokens gathered to its sequence's 32; down's output
    check_sequence_moves(collectives, "[1,32,64]", "[32,64]")
    check_matches((model, losses, grads), (ref_model, ref_losses, ref_grads))


def test_sequence_parallel_bad_layers_named():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    with pytest.raises(ValueError, match=r"pattern 'mlp' matches no FP8 layer; layers are: up"):
        distributed.sequence_parallel(_model(), mesh, ["mlp"], ["down"])
    with pytest.raises(ValueError, match=r"layer 'up': its weight \(256, 64\) is not placed"):
        distributed.sequence_parallel(_model(), mesh, ["up"], ["down"])
    with pytest.raises(ValueError, match="sequence_parallel: mesh has no axis 'model'"):
        distributed.sequence_parallel(_model(), mesh, ["up"], ["down"], tensor_axis="model")
    with jax.set_mesh(mesh):
        placed = hax.shard(_model(), PARAMS, mesh=mesh)
    # swapped: down's weight splits its inputs (mlp over tensor): row-parallel, not column
    with pytest.raises(ValueError, match=r"column-parallel layer 'down': its weight's output "):
        distributed.sequence_parallel(placed, mesh, ["down"], ["up"])
    other = Mesh(np.array(jax.devices()[:8])[::-1].reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    with pytest.raises(ValueError, match="is not placed on this mesh"):
        distributed.sequence_parallel(placed, other, ["up"], ["down"])
