"""A layer used several times in one step records one update: the max over its uses.

Each use proposes the state it would write; the proposals combine by max under every
transform (`fp8jax._state`). Two uses with amaxes ``a < b`` must leave the newest
history entry at ``b`` (a sum would give ``a + b``), the history rolled once, and the
scales those of one use.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from helpers import normal, recorded, take_state

CFG = fp8jax.Fp8Config(selective=False, amax_history_length=4)


def _amax(x) -> float:
    return float(jnp.max(jnp.abs(x)))


@pytest.fixture
def setup(key):
    layer = fp8jax.fp8_linear_layers(eqx.nn.Linear(32, 32, key=key), CFG)
    # warm the state so that the scales are not 1 and a summed scale would show
    k1, k2, k3 = jax.random.split(jax.random.fold_in(key, 1), 3)
    warm = eqx.filter_grad(lambda m: jnp.sum(m(normal(k1, (16, 32)))))(layer)
    layer = take_state(layer, warm)
    return layer, normal(k2, (16, 32)), normal(k3, (16, 32), scale=10.0)


def _scanned(m, x1, x2):
    out, _ = jax.lax.scan(lambda c, x: (c + jnp.sum(m(x)), None), 0.0, jnp.stack([x1, x2]))
    return out


TWO_USES = {
    "same trace": lambda m, x1, x2: jnp.sum(m(x1)) + jnp.sum(m(x2)),
    "separate vmaps": lambda m, x1, x2: jnp.sum(jax.vmap(m)(x1)) + jnp.sum(jax.vmap(m)(x2)),
    "nested vmaps": lambda m, x1, x2: jnp.sum(jax.vmap(jax.vmap(m))(jnp.stack([x1, x2]))),
    "scan": _scanned,
    "jax.checkpoint": lambda m, x1, x2: (jnp.sum(jax.checkpoint(lambda x: m(x))(x1))
                                         + jnp.sum(jax.checkpoint(lambda x: m(x))(x2))),
    "eqx.filter_checkpoint": lambda m, x1, x2: (jnp.sum(eqx.filter_checkpoint(m)(x1))
                                                + jnp.sum(eqx.filter_checkpoint(m)(x2))),
    "tied inside one vmap": lambda m, x1, x2: jnp.sum(
        jax.vmap(lambda a, b: m(a) + m(b))(x1, x2)),
    "eqx.filter_vmap": lambda m, x1, x2: (jnp.sum(eqx.filter_vmap(m)(x1))
                                          + jnp.sum(eqx.filter_vmap(m)(x2))),
}


@pytest.mark.parametrize("transform", list(TWO_USES))
def test_two_uses_combine_by_max(setup, transform):
    layer, x1, x2 = setup
    old = layer.dot_general
    grads = eqx.filter_jit(eqx.filter_grad(TWO_USES[transform]))(layer, x1, x2)
    new = take_state(layer, grads).dot_general
    assert recorded(new) == recorded(old) + 1  # rolled once, not twice
    assert float(new.input_amax_history[0]) == pytest.approx(max(_amax(x1), _amax(x2)), rel=1e-6)
    assert float(new.kernel_amax_history[0]) == pytest.approx(_amax(layer.weight), rel=1e-6)
    np.testing.assert_array_equal(new.input_amax_history[1:], np.roll(old.input_amax_history, -1)[1:])
    # the scales one use computes from the old history (a sum would double them)
    np.testing.assert_allclose(new.input_scale, _amax(old.input_amax_history) / 448.0, rtol=1e-6)
    assert float(new.nonfinite_count[0]) == 0.0


def test_three_uses_in_one_scan_body_and_outside(setup):
    layer, x1, x2 = setup
    x3 = 3.0 * x2

    def loss(m):
        return _scanned(m, x1, x2) + jnp.sum(jax.vmap(m)(x3))

    new = take_state(layer, eqx.filter_jit(eqx.filter_grad(loss))(layer)).dot_general
    assert recorded(new) == recorded(layer.dot_general) + 1
    assert float(new.input_amax_history[0]) == pytest.approx(_amax(x3), rel=1e-6)


def test_gemm_below_min_tokens_leaves_the_state_alone(key):
    """Under the selection policy a GEMM with fewer rows than ``min_tokens`` runs in the
    input precision and proposes nothing: alone it leaves the state as it was; next to an
    FP8 use of the same layer, the FP8 use's proposal is the update."""
    cfg = fp8jax.Fp8Config(amax_history_length=4, min_tokens=64, min_features=0,
                           min_weight_elements=0)
    layer = fp8jax.fp8_linear_layers(eqx.nn.Linear(32, 32, key=key), cfg)
    small, big = normal(key, (16, 32), scale=50.0), normal(jax.random.fold_in(key, 1), (64, 32))
    grads = eqx.filter_grad(lambda m: jnp.sum(m(small)))(layer)
    alone = take_state(layer, grads).dot_general
    for a, b in zip(jax.tree_util.tree_leaves(alone), jax.tree_util.tree_leaves(layer.dot_general)):
        np.testing.assert_array_equal(a, b)
    grads = eqx.filter_grad(lambda m: jnp.sum(m(small)) + jnp.sum(m(big)))(layer)
    both = take_state(layer, grads).dot_general
    assert float(both.input_amax_history[0]) == pytest.approx(_amax(big), rel=1e-6)  # not small's
    assert recorded(both) == 1


def test_fused_mlp_used_twice_records_once(key):
    mlp = fp8jax.nn.FusedMLP(32, 64, key=key, config=CFG)
    x1, x2 = normal(key, (16, 32)), normal(jax.random.fold_in(key, 1), (16, 32), scale=8.0)
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(x1)) + jnp.sum(m(x2))))(mlp)
    new = take_state(mlp, grads)
    assert recorded(new.fc1.dot_general) == 1
    singles = [take_state(mlp, eqx.filter_grad(lambda m, x=x: jnp.sum(m(x)))(mlp)) for x in (x1, x2)]
    for which in ("fc1", "fc2"):
        alone = [float(getattr(s, which).dot_general.input_amax_history[0]) for s in singles]
        both = float(getattr(new, which).dot_general.input_amax_history[0])
        assert both == pytest.approx(max(alone), rel=1e-5) and alone[0] != alone[1]
