"""haliax adapter: Linear and Stacked models get an Fp8DotGeneral (skipped without haliax)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from helpers import sqnr_db, recorded

hax = pytest.importorskip("haliax")
hnn = pytest.importorskip("haliax.nn")

Batch, Embed, Mlp, Layers = hax.Axis("batch", 64), hax.Axis("embed", 32), hax.Axis("mlp", 64), hax.Axis("layers", 3)
ALL = fp8jax.Fp8Config(selective=False)


class Block(eqx.Module):
    up: hnn.Linear
    down: hnn.Linear

    @staticmethod
    def init(key):
        k1, k2 = jax.random.split(key)
        return Block(hnn.Linear.init(Embed, Mlp, key=k1), hnn.Linear.init(Mlp, Embed, key=k2))

    def __call__(self, x):
        return x + self.down(hax.nn.relu(self.up(x)))


def test_linear_sets_dot_general(key):
    layer = hnn.Linear.init(Embed, Mlp, key=key)
    model, report = fp8jax.fp8_linear_layers(layer, ALL, return_report=True)
    assert isinstance(model.dot_general, fp8jax.Fp8DotGeneral)
    assert model.weight.array is layer.weight.array  # same arrays, no copy
    x = hax.random.normal(jax.random.fold_in(key, 1), (Batch, Embed))
    assert sqnr_db(model(x).array, layer(x).array) >= 25.0
    again, report = fp8jax.fp8_linear_layers(model, ALL, return_report=True)
    assert again.dot_general is model.dot_general and "already FP8" in str(report)


def test_stacked_scan_has_per_layer_state(key):
    stack = hnn.Stacked.init(Layers, Block)(key=jax.random.split(key, 3))
    model, report = fp8jax.fp8_linear_layers(stack, ALL, return_report=True)
    assert report.converted == ["stacked.up", "stacked.down"]
    assert model.stacked.up.dot_general.input_amax_history.shape == (3, ALL.amax_history_length)
    x = hax.random.normal(jax.random.fold_in(key, 1), (Batch, Embed))
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: hax.sum(m.fold(x)).scalar()))(model)
    overwrites, _ = fp8jax.partition_for_grad_overwrite(grads)
    new = fp8jax.apply_updates(model, None, overwrites).stacked.up.dot_general
    np.testing.assert_array_equal(recorded(new), [1, 1, 1])
    assert float(new.input_amax_history[0, 0]) == float(jnp.max(jnp.abs(x.array)))
    assert len(set(np.asarray(new.input_amax_history[:, 0]).tolist())) == 3  # each layer its own amax
    report = fp8jax.fp8_gemm_report(lambda m, x: eqx.filter_grad(lambda m: hax.sum(m.fold(x)).scalar())(m),
                                    model, x, stage="lowered")
    assert report.all_fp8 and len(report.gemms) == 6
