"""`fp8jax.nn.cross_entropy`: value and gradient against optax on float64 logits; bf16 logits
kept in bf16 for the backward (no float32 [tokens, vocab] residual); sharded logits."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import sqnr_db

from fp8jax.nn import cross_entropy


def test_value_and_gradient_match_optax_in_float64():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(3), 3)
    logits = jax.random.normal(k1, (4, 9, 300)) * 4
    labels = jax.random.randint(k2, (4, 9), 0, 300)
    g = jax.random.normal(k3, (4, 9))
    x64 = np.asarray(logits, np.float64)
    ref = optax.softmax_cross_entropy_with_integer_labels(x64, np.asarray(labels))
    np.testing.assert_allclose(cross_entropy(logits, labels), ref, rtol=2e-6, atol=2e-6)
    got = jax.grad(lambda x: jnp.sum(cross_entropy(x, labels) * g))(logits)
    probs = np.exp(x64 - np.log(np.sum(np.exp(x64), -1, keepdims=True)))
    want = np.asarray(g, np.float64)[..., None] * (probs - np.eye(300)[np.asarray(labels)])
    assert sqnr_db(got, want) > 100


def test_bf16_logits_give_bf16_gradients_and_keep_no_float32_logits():
    tokens, vocab = 256, 4096
    logits = jax.random.normal(jax.random.PRNGKey(0), (tokens, vocab), jnp.bfloat16)
    labels = jax.random.randint(jax.random.PRNGKey(1), (tokens,), 0, vocab)
    loss, vjp = jax.vjp(lambda x: cross_entropy(x, labels).mean(), logits)
    (grad,) = vjp(jnp.ones((), jnp.float32))
    assert loss.dtype == jnp.float32 and grad.dtype == jnp.bfloat16
    saved = [a for a in jax.tree_util.tree_leaves(vjp) if getattr(a, "ndim", 0) == 2]
    assert sum(a.size * a.dtype.itemsize for a in saved) == tokens * vocab * 2  # the bf16 logits
    ref = jax.grad(lambda x: optax.softmax_cross_entropy_with_integer_labels(
        x.astype(jnp.float32), labels).mean())(logits)
    assert sqnr_db(grad, ref) > 40  # bf16 output: ~50 dB
    _, plain = jax.vjp(lambda x: optax.softmax_cross_entropy_with_integer_labels(
        x.astype(jnp.float32), labels).mean(), logits)
    f32 = [a for a in jax.tree_util.tree_leaves(plain)
           if getattr(a, "ndim", 0) == 2 and a.dtype == jnp.float32]
    assert f32, "optax on float32 logits keeps float32 [tokens, vocab] arrays (what this avoids)"


def test_sharded_logits_match_unsharded():
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(jax.devices())
    if n < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
    logits = jax.random.normal(jax.random.PRNGKey(0), (8, 16, 512), jnp.float32)
    labels = jax.random.randint(jax.random.PRNGKey(1), (8, 16), 0, 512)
    f = jax.jit(jax.value_and_grad(lambda x, y: cross_entropy(x, y).mean()))
    want = f(logits, labels)
    got = f(jax.device_put(logits, NamedSharding(mesh, P("data", None, "tensor"))),
            jax.device_put(labels, NamedSharding(mesh, P("data", None))))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-9)


def test_labels_shape_must_match():
    with pytest.raises(ValueError, match=r"labels \(4,\) must be logits' \(4, 3, 10\)"):
        cross_entropy(jnp.zeros((4, 3, 10)), jnp.zeros((4,), jnp.int32))
