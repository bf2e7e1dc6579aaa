"""Issue 49: `FusedMLP.recompute_input` (and the trainer's ``--remat lean``): the gated core
keeps no FP8 copy of the normed input; the backward makes it again from the block's input
(norm and cast only: no GEMM runs again), bit for bit on the CPU."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU
from helpers import normal

import fp8jax
from fp8jax._kernels.gated_activation import tuning
from fp8jax._ops import dot
from fp8jax.nn import _mlp
from fp8jax.train import _cli as cli

CFG = fp8jax.Fp8Config(selective=False, amax_history_length=4)
M, HIDDEN, FFN = 256, 64, 128
# XLA's CPU excess precision off: a bf16 chain kept in f32 inside a fusion rounds where the
# fusions say, which a checkpoint region changes (tests/test_remat.py)
EXACT = {"xla_allow_excess_precision": False}


def _mlp_of(key, fc1_out_fp8: bool, recompute_input: bool):
    mlp = fp8jax.nn.FusedMLP(HIDDEN, FFN, activation="swiglu", norm="rmsnorm", residual=True,
                             fp8=False, fc1_out_fp8=fc1_out_fp8, key=key)  # fmt: skip
    return fp8jax.fp8_linear_layers(mlp, CFG).with_recompute_input(recompute_input)


@pytest.mark.skipif(ON_GPU, reason="CPU bits; tests/test_gpu.py holds the Hopper core to 40 dB")
@pytest.mark.parametrize("fc1_out_fp8", [False, True])
def test_core_recomputes_its_input_copy_bit_for_bit(key, fc1_out_fp8):
    """The residuals lose exactly the e4m3 input copy (``M x HIDDEN`` bytes) and keep fc1's
    output; loss, gradients and new FP8 state are the same bits; the compiled step has as
    many dots (fc1's GEMM does not run again)."""
    x = normal(jax.random.fold_in(key, 1), (M, HIDDEN), jnp.bfloat16)
    g = normal(jax.random.fold_in(key, 2), (M, HIDDEN), jnp.float32)

    def loss(m, x):
        return jnp.sum(fp8jax.enter_state(m)(x).astype(jnp.float32) * g)

    saved, results, dots = {}, [], []
    with tuning(activation="xla"):  # the core with its plain-JAX activation, on the CPU
        for recompute in (False, True):
            mlp = _mlp_of(key, fc1_out_fp8, recompute)
            assert _mlp._gated_core_runs(mlp, x)
            report = fp8jax.residuals_report(loss, mlp, x)
            kept = [r for r in report.residuals if r.kind == "activation"]
            saved[recompute] = sum(r.nbytes for r in kept)
            names = {r.name for r in kept}
            assert _mlp.FC1_OUT in names, names
            assert (dot.INPUT_RESIDUAL in names) is not recompute, names
            params, static = eqx.partition(mlp, eqx.is_array)
            step = jax.jit(jax.value_and_grad(lambda p, x, s=static: loss(eqx.combine(p, s), x)))
            compiled = step.lower(params, x).compile(EXACT)
            dots.append(compiled.as_text().count(" dot("))
            results.append(compiled(params, x))
    assert saved[False] - saved[True] == M * HIDDEN, saved  # one e4m3 byte an element
    assert dots[0] == dots[1] > 0, dots
    (l0, g0), (l1, g1) = results
    assert float(l0) == float(l1)
    for a, b in zip(jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_with_recompute_input_keeps_the_arrays(key):
    mlp = _mlp_of(key, False, False)
    lean = mlp.with_recompute_input(True)
    assert lean.recompute_input and not mlp.recompute_input
    assert lean.fc1.weight is mlp.fc1.weight and lean.norm_weight is mlp.norm_weight


def test_trainer_lean_drops_the_qkv_input_copy():
    """``--remat lean`` in the trainer's model: the qkv projection keeps no copy of its normed
    input (e4m3 in the fp8 run, bf16 in the bf16 run) nor its norm's float32 1/rms per row (the
    norm runs again); nothing else it keeps changes."""
    base = cli.RunConfig(**cli.PRESETS["tiny"])
    cfg = base.model
    batch = np.random.default_rng(0).integers(0, 256, (2, cfg.seq + 1), dtype=np.int32)
    for precision, nbytes in (("fp8", 1), ("bf16", 2)):
        saved = {}
        for remat in ("none", "lean"):
            model = cli.build_model(dataclasses.replace(base, remat=remat), precision)
            report = fp8jax.residuals_report(cli.lm_loss, model, jnp.asarray(batch))
            saved[remat] = sum(r.nbytes for r in report.residuals if r.kind != "argument")
        rows = cfg.layers * 2 * cfg.seq
        copy = rows * (cfg.dim * nbytes + 4)
        assert saved["none"] - saved["lean"] == copy, (precision, saved, copy)


def test_remat_policy_without_inputs_in_a_users_norm_linear_region(key):
    """``fp8jax.remat_policy(keep_inputs=False)`` around a user's norm -> FP8 linear: the
    backward keeps the FP8 weight copy but no input copy (its norm and cast run again), with
    the loss, gradients and new FP8 state of the region with the default policy, bit for bit
    (CPU), and the same number of dots (the GEMM does not run again)."""
    from fp8jax.nn._elementwise import normalize

    lin = fp8jax.fp8_linear_layers(eqx.nn.Linear(HIDDEN, FFN, key=key), CFG)
    x = normal(jax.random.fold_in(key, 1), (M, HIDDEN), jnp.float32)
    gamma = normal(jax.random.fold_in(key, 2), (HIDDEN,), jnp.float32)

    def loss(lin, gamma, x, policy):
        def region(lin, gamma, x):
            return lin(normalize(x, gamma, None, "rmsnorm", 1e-5))

        y = jax.checkpoint(region, policy=policy)(fp8jax.enter_state(lin), gamma, x)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    results, dots = [], []
    for keep in (True, False):
        policy = fp8jax.remat_policy(keep_inputs=keep)
        report = fp8jax.residuals_report(lambda m, g, x: loss(m, g, x, policy), lin, gamma, x)
        names = {r.name for r in report.residuals if r.kind == "activation"}
        assert dot.KERNEL_RESIDUAL in names and (dot.INPUT_RESIDUAL in names) is keep, names
        params, static = eqx.partition(lin, eqx.is_array)

        def step(p, gamma, x, static=static, policy=policy):
            return loss(eqx.combine(p, static), gamma, x, policy)

        compiled = jax.jit(jax.value_and_grad(step, (0, 1))).lower(params, gamma, x).compile(EXACT)
        dots.append(compiled.as_text().count(" dot("))
        results.append(compiled(params, gamma, x))
    assert dots[0] == dots[1] > 0, dots
    for a, b in zip(*(jax.tree_util.tree_leaves(r) for r in results), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
