"""FSDP memory (issue 49). `fp8jax.shard_model` splits embedding tables over the fsdp axis
(replicated, a table and its AdamW moments cost every device 12 bytes an entry), and training
matches one device. FSDP keeps each FP8 weight's shard for the backward, not its gathered copy: the
backward gathers the shard again. The saved copy (the weight's transposed FP8 layout) was
computed from the cast's unpinned output, and XLA transposed the gathered copy and sliced
the shard out of it where the backward read it, holding every layer's gathered weight from
the forward to the backward (8b fsdp=4: 1.3 GB a device; benchmarks/RESULTS.md,
twenty-fifth session). 8 host CPU devices."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from helpers import eight_device_mesh as _mesh
from test_distributed import CFG, OPT, _data, _model, step

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs 8 devices (conftest's XLA_FLAGS)"
)


def _gather_readers(hlo: str) -> dict[str, int]:
    """Each all-gather's result (the ``-done`` of an async one) -> how many instructions
    read it."""
    names = re.findall(r"%([\w.-]+) = [^=]*? all-gather(?:-done)?\(", hlo)
    assert names, "no all-gather in the compiled step"
    return {n: len(re.findall(rf"%{re.escape(n)}(?![\w.-])", hlo)) - 1 for n in names}


def test_fsdp_weight_gathers_feed_only_their_gemm():
    mesh = _mesh(1, 8, 1)
    model = fp8jax.shard_model(_model(), mesh)
    batch = NamedSharding(mesh, P(("data", "fsdp"), None))
    x, y = (jax.device_put(a, batch) for a in _data())
    compiled = step.lower(model, OPT.init(fp8jax.trainable(model)), x, y).compile()
    hlo = getattr(compiled, "compiled", compiled).as_text()  # equinox wraps jax's
    readers = _gather_readers(hlo)
    # forward: l1 and l2 gathered once each; backward: l2 again for its dgrad
    assert len(readers) == 3, readers
    assert all(n == 1 for n in readers.values()), readers


def test_gather_readers_counts_each_use():
    hlo = (
        "%ag.1 = f16[4]{0} all-gather(%p), dimensions={0}\n"
        "%f = f16[4]{0} fusion(%ag.1, %ag.10)\n"
        "%g = f16[1]{0} fusion(%ag.1)\n"
        "%ag.10 = f16[4]{0} all-gather(%q), dimensions={0}\n"
    )
    assert _gather_readers(hlo) == {"ag.1": 2, "ag.10": 1}


class _Tokens(eqx.Module):
    emb: eqx.nn.Embedding
    lin: eqx.nn.Linear

    def __init__(self, vocab, key):
        k1, k2 = jax.random.split(key)
        self.emb = eqx.nn.Embedding(vocab, 64, key=k1)
        self.lin = eqx.nn.Linear(64, 64, key=k2)

    def __call__(self, ids):
        return self.lin(jax.vmap(self.emb)(ids))


@eqx.filter_jit
def _token_step(model, opt_state, ids, y):
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(ids) - y) ** 2))(model)
    model, opt_state = fp8jax.optax_step(OPT, model, grads, opt_state)
    return model, opt_state, loss


def _train_tokens(model, ids, y):
    opt_state, losses = OPT.init(fp8jax.trainable(model)), []
    for _ in range(3):
        model, opt_state, loss = _token_step(model, opt_state, ids, y)
        losses.append(float(loss))
    return model, losses


@pytest.mark.parametrize("vocab, spec", [(256, P("fsdp", None)), (258, P(None, "fsdp"))])
def test_shard_model_splits_embedding_tables_and_trains_as_one_device(vocab, spec):
    ids = jax.random.randint(jax.random.PRNGKey(1), (128,), 0, vocab)
    y = jax.random.normal(jax.random.PRNGKey(2), (128, 64))
    model = fp8jax.fp8_linear_layers(_Tokens(vocab, jax.random.PRNGKey(0)), CFG)
    ref, ref_losses = _train_tokens(model, ids, y)
    mesh = _mesh(1, 8, 1)
    placed = fp8jax.shard_model(model, mesh)
    assert placed.emb.weight.sharding.spec == spec
    batch = NamedSharding(mesh, P(("data", "fsdp")))
    trained, losses = _train_tokens(placed, jax.device_put(ids, batch), y)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    np.testing.assert_allclose(trained.emb.weight, ref.emb.weight, rtol=1e-4, atol=1e-6)
    assert trained.emb.weight.sharding.spec == spec  # the update keeps the split
