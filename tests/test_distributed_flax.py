"""Megatron sequence parallelism for a flax.linen model (issue 24), on 8 host CPU devices:
``fp8_dot_general_cls(sequence_parallel="column" | "row", mesh=...)`` with the kernels
placed by the user; training matches one device and the tokens move as FP8 (skipped
without flax)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fp8jax import Fp8Config, distributed
from test_distributed import check_sequence_moves

nn = pytest.importorskip("flax.linen")
from flax.training import train_state  # noqa: E402

import fp8jax.flax as fp8flax  # noqa: E402

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs 8 devices (conftest's XLA_FLAGS)"
)

CFG = Fp8Config(selective=False, amax_history_length=8)
OWG = "_overwrite_with_gradient"
MESH = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))


class Block(nn.Module):
    mesh: Mesh | None = None
    tp_overlap: str = "none"

    @nn.compact
    def __call__(self, x):
        def cls(kind):
            sp = dict(sequence_parallel=kind, mesh=self.mesh, tp_overlap=self.tp_overlap)
            return fp8flax.fp8_dot_general_cls(CFG, **(sp if self.mesh else {}))

        h = nn.Dense(256, dot_general_cls=cls("column"))(x)
        return nn.Dense(64, dot_general_cls=cls("row"))(nn.relu(h))


def _train(model, variables, x, y, steps=3):
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=variables, tx=optax.adam(1e-2)
    )

    @jax.jit
    def step(state, x, y):
        loss, grads = jax.value_and_grad(
            lambda v: jnp.mean((state.apply_fn(v, x) - y) ** 2)
        )(state.params)
        return state.apply_gradients(grads=grads), loss

    losses = []
    for _ in range(steps):
        state, loss = step(state, x, y)
        losses.append(float(loss))
    return state, losses, step


@pytest.mark.parametrize("tp_overlap", ["none", "ring", "chunks"])
def test_flax_sequence_parallel_matches_single_device(tp_overlap):
    """Each way of moving the tokens (``tp_overlap``): constraint pairs, collective matmul
    rings (`fp8jax._ops.tp_ring`; ring order sums float32 partials an ulp apart), or chunked
    collectives (two chunks of each device's 16 tokens)."""
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 32, 64)) * 3.0  # [batch, seq, embed]
    y = jax.random.normal(jax.random.PRNGKey(2), (4, 32, 64))
    variables = Block().init(jax.random.PRNGKey(0), x)
    ref_state, ref_losses, _ = _train(Block(), variables, x, y)

    # kernels: Megatron split over "tensor", FSDP over "fsdp"; FP8 state replicated
    kernels = {"Dense_0": P("fsdp", "tensor"), "Dense_1": P("tensor", "fsdp")}

    def place(path, a):
        names = [getattr(k, "key", None) for k in path]
        spec = kernels[names[1]] if "kernel" in names else P()
        return jax.device_put(a, NamedSharding(MESH, spec))

    placed = jax.tree_util.tree_map_with_path(place, variables)
    tokens = distributed.sequence_sharding(MESH, x.shape)
    assert tokens.spec == P(("data", "fsdp"), "tensor", None)  # one sequence per batch shard
    xs, ys = (jax.device_put(a, tokens) for a in (x, y))
    model = Block(mesh=MESH, tp_overlap=tp_overlap)
    state, losses, step = _train(model, placed, xs, ys)
    collectives = distributed.hlo_collectives(step.lower(state, xs, ys))
    if tp_overlap == "none":
        # Dense_0's input: each device's 16 tokens gathered to its sequence's 32; Dense_1's
        # output
        check_sequence_moves(collectives, "[1,32,64]", "[32,64]")
    elif tp_overlap == "chunks":  # Dense_0's FP8 input and Dense_1's output gradient in
        # chunks of 8 tokens gathered to 16; Dense_1's float32 partial sums scattered to 8
        moves = {(c.kind, c.dtype, c.shape) for c in collectives}
        assert {
            ("all-gather", "f8e4m3fn", "[1,16,64]"),
            ("all-gather", "f8e5m2", "[1,16,64]"),
            ("reduce-scatter", "f32", "[1,8,64]"),
        } <= moves, moves
        assert not [c for c in collectives if c.kind == "collective-permute"]
    else:  # one ring step per chunk: Dense_0's FP8 input, Dense_1's float32 partial sums
        permutes = {(c.dtype, c.shape) for c in collectives if c.kind == "collective-permute"}
        assert {("f8e4m3fn", "[1,16,64]"), ("f32", "[1,16,64]")} <= permutes, permutes
        assert ("f8e5m2", "[1,16,64]") in permutes, permutes  # Dense_1's output gradient
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for a, b in zip(
        jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(ref_state.params),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_flax_sequence_parallel_bad_options():
    with pytest.raises(ValueError, match="sequence_parallel must be 'column', 'row' or None"):
        fp8flax.fp8_dot_general_cls(CFG, sequence_parallel="col", mesh=MESH)
    with pytest.raises(ValueError, match="sequence_parallel needs mesh="):
        fp8flax.fp8_dot_general_cls(CFG, sequence_parallel="row")
    with pytest.raises(ValueError, match="fp8_dot_general_cls: mesh has no axis 'model'"):
        fp8flax.fp8_dot_general_cls(CFG, sequence_parallel="row", mesh=MESH, tensor_axis="model")
    with pytest.raises(ValueError, match="fp8_dot_general_cls: tp_overlap must be one of"):
        fp8flax.fp8_dot_general_cls(CFG, sequence_parallel="row", mesh=MESH, tp_overlap="on")
