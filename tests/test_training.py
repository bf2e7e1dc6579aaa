"""End to end: a converted eqx.nn.MLP trains like its bf16 twin."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fp8jax
from helpers import recorded


def _train(model, data, steps=50, lr=3e-3):
    x, y = data
    opt = optax.adam(lr)
    opt_state = opt.init(fp8jax.trainable(model))

    def loss_fn(model, x, y):
        pred = jax.vmap(model)(x.astype(jnp.bfloat16)).astype(jnp.float32)
        return jnp.mean((pred - y) ** 2)

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        model, opt_state = fp8jax.optax_step(opt, model, grads, opt_state)
        return model, opt_state, loss

    losses = []
    for i in range(steps):
        batch = slice((i % 4) * 64, (i % 4 + 1) * 64)
        model, opt_state, loss = step(model, opt_state, x[batch], y[batch])
        losses.append(float(loss))
    return model, np.array(losses)


def test_mlp_fp8_tracks_bf16(key):
    k_model, k_x, k_w = jax.random.split(key, 3)
    x = jax.random.normal(k_x, (256, 32))
    target_w = jax.random.normal(k_w, (32, 16)) / 4
    y = jnp.tanh(x @ target_w) + 0.1 * jnp.sin(3 * x[:, :16])
    mlp = eqx.nn.MLP(32, 16, 64, depth=2, key=k_model)
    mlp = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, mlp)
    fp8_mlp, report = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(selective=False, amax_history_length=16),
                                               return_report=True)
    assert len(report.converted) == 3
    _, bf16_losses = _train(mlp, (x, y))
    trained, fp8_losses = _train(fp8_mlp, (x, y))
    assert bf16_losses[-1] < 0.5 * bf16_losses[0]  # it does learn
    final_bf16, final_fp8 = bf16_losses[-5:].mean(), fp8_losses[-5:].mean()
    assert abs(final_fp8 - final_bf16) / final_bf16 < 0.05, (final_bf16, final_fp8)
    states = fp8jax.fp8_state(trained)
    assert len(states) == 3
    assert all(recorded(s) == 16 for _, s in states)  # 50 steps fill the 16-step history
    assert all(float(s.output_grad_scale[0]) != 1.0 for _, s in states)  # scales moved
