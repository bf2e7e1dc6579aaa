"""`fp8jax.nn.remat_policy`: under ``jax.checkpoint`` the loss, gradients and new FP8 state are
those of the step without it, bit for bit (CPU); the region keeps only FP8 copies of the FP8
GEMMs' operands (and FusedMLP's fc1 output), none of their bf16 inputs."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEFAULT_CPU_CODEGEN
from helpers import normal

import fp8jax
from fp8jax.nn import remat_policy

EXACT = {"xla_allow_excess_precision": False, **DEFAULT_CPU_CODEGEN}

CFG = fp8jax.Fp8Config(selective=False, amax_history_length=4)


class Block(eqx.Module):
    up: eqx.Module
    down: eqx.Module
    mlp: fp8jax.nn.FusedMLP

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.up = eqx.nn.Linear(64, 128, key=k1)
        self.down = eqx.nn.Linear(128, 64, key=k2)
        self.mlp = fp8jax.nn.FusedMLP(64, 128, activation="swiglu", config=CFG, key=k3)

    def __call__(self, x):
        h = jax.nn.gelu(jax.vmap(self.up)(x))
        x = x + jax.vmap(self.down)(h)
        return self.mlp(x)


def _model(key):
    block = Block(key)
    return fp8jax.fp8_linear_layers(block, CFG)


def _loss(model, x, policy):
    def run(m, x):
        return jnp.mean(m(x).astype(jnp.float32) ** 2)

    entered = fp8jax.enter_state(model)
    if policy is None:
        return run(entered, x)
    return jax.checkpoint(run, policy=policy)(entered, x)


def test_remat_policy_gives_the_same_loss_gradients_and_state_bit_for_bit(key):
    model = _model(key)
    # f32 activations (the weights are f32): an FP8 layer's output takes its input's dtype, and
    # XLA may skip bf16 roundings inside a fusion (excess precision), which two programs fuse
    # differently; bit for bit holds where the compute is f32 around the FP8 GEMMs.
    x = normal(jax.random.fold_in(key, 1), (256, 64), jnp.float32)
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def run(policy):
        # Compiled as test_train_remat's EXACT: every op rounds as written, in XLA's default
        # CPU code (conftest's older emitters round some fused ops otherwise: the guard's
        # backward reading one state leaf instead of all of them moved a fusion there).
        f = jax.value_and_grad(lambda p, x: _loss(eqx.combine(p, static), x, policy))
        return jax.jit(f).lower(params, x).compile(EXACT)(params, x)

    (l0, g0), (l1, g1) = run(None), run(remat_policy())
    assert float(l0) == float(l1)
    leaves0, leaves1 = jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1)
    assert len(leaves0) == len(leaves1) > 10  # weights, biases and every FP8 state's fields
    for a, b in zip(leaves0, leaves1):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_remat_policy_keeps_fp8_copies_and_no_bf16_gemm_inputs(key):
    model = _model(key)
    x = normal(jax.random.fold_in(key, 2), (256, 64), jnp.bfloat16)
    plain = fp8jax.residuals_report(lambda m, x: _loss(m, x, None), model, x)
    remat = fp8jax.residuals_report(lambda m, x: _loss(m, x, remat_policy()), model, x)
    tokens = 256

    def by_dtype(report):
        out = {}
        for r in report.residuals:
            if r.kind == "activation" and tokens in r.shape:
                out[str(r.dtype)] = out.get(str(r.dtype), 0) + r.nbytes
        return out

    before, after = by_dtype(plain), by_dtype(remat)
    assert after.get("float8_e4m3fn", 0) > 0  # the FP8 inputs are what stays
    assert sum(after.values()) < sum(before.values())
    # no activation is kept in bf16 beside its FP8 copy (the weights are the step's arguments:
    # the caller holds them anyway)
    copies = [(f, h) for f, h in remat.bf16_copies_of_fp8_inputs() if h.kind == "activation"]
    assert not copies, copies


def test_remat_policy_takes_the_users_names_and_refuses_others():
    assert callable(remat_policy("my_residual"))
    with pytest.raises(TypeError, match="remat_policy: names must be strings"):
        remat_policy(3)


def test_remat_policy_keeps_the_gated_cores_residuals_bit_for_bit(key):
    """On Hopper `FusedMLP` runs its gated core (`fp8jax._ops.gated`: one custom VJP); its
    residuals carry the policy's names, so under ``remat_policy`` the region keeps the core's
    FP8 input and weight copies and fc1's output (its forward does not run again for the
    backward) and no bf16 input. Run here with the core's plain-JAX activation. The results
    are those without a checkpoint bit for bit once XLA's CPU excess precision is off (a bf16
    chain kept in f32 inside a fusion: where it is depends on the fusions, which the
    checkpoint changes, and the FP8 casts make a rounding a step)."""
    from fp8jax._kernels.gated_activation import tuning
    from fp8jax._ops import dot
    from fp8jax.nn import _mlp

    mlp = fp8jax.nn.FusedMLP(64, 128, activation="swiglu", norm="rmsnorm", residual=True,
                             fp8=False, key=key)  # fmt: skip
    mlp = fp8jax.fp8_linear_layers(mlp, CFG)
    x = normal(jax.random.fold_in(key, 3), (256, 64), jnp.bfloat16)
    exact = {"xla_allow_excess_precision": False}
    with tuning(activation="xla"):
        assert _mlp._gated_core_runs(mlp, x)
        report = fp8jax.residuals_report(lambda m, x: _loss(m, x, remat_policy()), mlp, x)
        named = {(r.name, str(r.dtype)) for r in report.residuals if r.kind == "activation"}
        assert {(dot.INPUT_RESIDUAL, "float8_e4m3fn"), (dot.KERNEL_RESIDUAL, "float8_e4m3fn"),
                (_mlp.FC1_OUT, "bfloat16")} <= named, named  # fmt: skip
        assert not [r for r in report.residuals if r.kind == "activation" and 256 in r.shape
                    and str(r.dtype) != "float8_e4m3fn" and r.name != _mlp.FC1_OUT]  # fmt: skip
        params, static = eqx.partition(mlp, eqx.is_array)
        # a linear loss: ``mean(y ** 2)``'s value moved by 2e-5 (its f32 sum added up in another
        # order) while every gradient stayed the same
        g = normal(jax.random.fold_in(key, 4), x.shape, jnp.float32)
        results = []
        for policy in (None, remat_policy()):
            def loss(p, x, policy=policy):
                def run(m, x):
                    return jnp.sum(m(x).astype(jnp.float32) * g)

                entered = fp8jax.enter_state(eqx.combine(p, static))
                region = run if policy is None else jax.checkpoint(run, policy=policy)
                return region(entered, x)

            step = jax.jit(jax.value_and_grad(loss))
            results.append(step.lower(params, x).compile(exact)(params, x))
    (l0, g0), (l1, g1) = results
    assert float(l0) == float(l1)
    for a, b in zip(jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
