"""Delayed scaling against outliers and corrupt state: one outlier batch is skipped (and
counted), a real shift of the distribution is still tracked, NaN/Inf/0/negative entries
of the state are repaired and counted (`fp8jax._recipe.PerTensor.screen`,
`fp8jax._state.needs_repair`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import normal, sqnr_db, take_state

import fp8jax

CFG = fp8jax.Fp8Config(selective=False)  # delayed, 1024-long histories
D = 128
ROWS = 64


def _layer(key, config=CFG):
    return fp8jax.fp8_linear_layers(eqx.nn.Linear(D, D, key=key), config)


@eqx.filter_jit
def _step(model, x, c):
    """The layer's output and its gradients (the new FP8 state among them)."""
    grads = eqx.filter_grad(lambda m, x: jnp.sum(m(x) * c))(model, x)
    return model(x), grads


def _reference(model, x):
    return x @ model.weight.T + model.bias


def _batch(key, t, scale=1.0):
    kx, kc = jax.random.split(jax.random.fold_in(key, t))
    return normal(kx, (ROWS, D), scale=scale), normal(kc, (ROWS, D))


def _run(model, batches):
    """Steps over ``batches`` (the state written back each step): outputs, final model."""
    outs = []
    for x, c in batches:
        y, grads = _step(model, x, c)
        outs.append(np.asarray(y))
        model = take_state(model, grads)
    return outs, model


def _count(model) -> float:
    return float(model.dot_general.nonfinite_count[0])


# --- outliers ---------------------------------------------------------------------------
def test_one_outlier_batch_recovers_within_16_steps(key):
    """A single 1e30 element in one batch: before, it went into the 1024-long history and
    every later output was 99.9% wrong for 1023 steps, uncounted. Now it is skipped and
    counted; measured: the first clean step after it matches the run without it."""
    model = _layer(key)
    spike_at, steps = 4, 24
    clean = [_batch(key, t) for t in range(steps)]
    spiked = list(clean)
    x, c = clean[spike_at]
    spiked[spike_at] = (x.at[3, 7].set(1e30), c)
    y_clean, m_clean = _run(model, clean)
    y_spike, m_spike = _run(model, spiked)
    assert np.all(np.isfinite(y_spike[spike_at][np.arange(ROWS) != 3]))  # saturated, not NaN
    recovered = None
    for t in range(spike_at + 1, steps):
        diff = np.linalg.norm(y_spike[t] - y_clean[t]) / np.linalg.norm(y_clean[t])
        if diff <= 0.01:
            recovered = t - spike_at
            break
    print(f"steps after the outlier batch until the output is within 1%: {recovered}")
    assert recovered is not None and recovered <= 16
    assert _count(m_spike) == 1.0 and _count(m_clean) == 0.0
    spiked_scale = float(m_spike.dot_general.input_scale[0])
    clean_scale = float(m_clean.dot_general.input_scale[0])
    assert clean_scale / 1.5 <= spiked_scale <= clean_scale
    assert float(jnp.max(m_spike.dot_general.input_amax_history)) < 100.0


def test_repeated_outliers_are_each_skipped(key):
    """Outliers every other step never reach the history (no ratchet)."""
    model = _layer(key)
    batches = [_batch(key, t) for t in range(9)]
    for t in (2, 4, 6):
        x, c = batches[t]
        batches[t] = (x.at[t, t].set(1e30), c)
    outs, model = _run(model, batches)
    assert _count(model) == 3.0
    assert float(jnp.max(model.dot_general.input_amax_history)) < 100.0
    ref = _reference(model, batches[8][0])
    assert sqnr_db(outs[8], ref) >= 25.0


def test_fresh_layer_records_its_first_amax_whatever_its_size(key):
    """A fresh history (all zeros) has nothing to compare with: a first amax of 1e5 (far
    above 64 x the fresh scale's 448) is recorded, not counted, and used next step."""
    model = _layer(key)
    batches = [_batch(key, t, scale=2e4) for t in range(3)]
    outs, model = _run(model, batches)
    dg = model.dot_general
    assert _count(model) == 0.0
    amaxes = [float(jnp.max(jnp.abs(x))) for x, _ in batches]
    np.testing.assert_allclose(dg.ordered_amax_history("input")[:3], amaxes[::-1], rtol=1e-6)
    np.testing.assert_allclose(dg.input_scale, max(amaxes[:2]) / 448.0, rtol=1e-6)
    assert sqnr_db(outs[2], _reference(model, batches[2][0])) >= 25.0


def test_doubling_activations_are_tracked_step_by_step(key):
    """Growth under the factor (here 2x per step) is recorded as it comes, never counted."""
    model = _layer(key)
    batches = [_batch(key, t, scale=2.0**t) for t in range(8)]
    outs, model = _run(model, batches)
    dg = model.dot_general
    assert _count(model) == 0.0
    amaxes = [float(jnp.max(jnp.abs(x))) for x, _ in batches]
    np.testing.assert_allclose(dg.ordered_amax_history("input")[:8], amaxes[::-1], rtol=1e-6)
    assert sqnr_db(outs[7], _reference(model, batches[7][0])) >= 15.0  # saturates a bit


@pytest.mark.parametrize("jump", [100.0, 1e4])
def test_distribution_shift_is_tracked_one_step_late(key, jump):
    """The whole distribution jumps ``jump`` times and stays: the first large amax is
    rejected (counted once), the next one recorded; from the third step on the scale
    follows the new distribution and the output is accurate again."""
    model = _layer(key)
    shift_at = 3
    batches = [_batch(key, t, scale=1.0 if t < shift_at else jump) for t in range(shift_at + 4)]
    outs, model = _run(model, batches)
    dg = model.dot_general
    assert _count(model) == 1.0
    new_amax = max(float(jnp.max(jnp.abs(x))) for x, _ in batches[shift_at + 1 : -1])
    np.testing.assert_allclose(dg.input_scale, new_amax / 448.0, rtol=1e-6)
    for t in range(shift_at + 2, len(batches)):
        assert sqnr_db(outs[t], _reference(model, batches[t][0])) >= 25.0, t


def test_current_scaling_records_every_amax(key):
    """Current scaling scales each tensor by its own amax: nothing to skip or count."""
    cfg = fp8jax.Fp8Config(selective=False, scaling="current")
    model = _layer(key, cfg)
    x, c = _batch(key, 0)
    _, model = _run(model, [(x, c), (x.at[0, 0].set(1e30), c)])
    assert _count(model) == 0.0
    assert float(model.dot_general.input_amax_history[0]) == pytest.approx(1e30)


# --- corrupt state ------------------------------------------------------------------------
def _with(model, **fields):
    dg = model.dot_general
    names = list(fields)
    return eqx.tree_at(
        lambda m: [getattr(m.dot_general, n) for n in names],
        model,
        [jnp.asarray(fields[n], jnp.float32).reshape(getattr(dg, n).shape) for n in names],
    )


def _warm(key, steps=2):
    model = _layer(key)
    _, model = _run(model, [_batch(key, 100 + t) for t in range(steps)])
    return model


def test_nan_history_is_repaired_and_counted(key):
    """A NaN-filled input history (and Infs in the kernel's): the step runs as on a fresh
    history, every NaN/Inf is written as 0 at once (not rolled out one per step) and the
    step is counted once; the next step's scale comes from the new amax."""
    model = _layer(key)
    length = CFG.amax_history_length
    kernel_history = jnp.zeros((length,)).at[::7].set(jnp.inf).at[5].set(-3.0)
    model = _with(model, input_amax_history=jnp.full((length,), jnp.nan),
                  kernel_amax_history=kernel_history)  # fmt: skip
    batches = [_batch(key, t) for t in range(2)]
    outs, model = _run(model, batches)
    dg = model.dot_general
    assert _count(model) == 1.0
    for name in ("input_amax_history", "kernel_amax_history", "output_grad_amax_history"):
        history = np.asarray(getattr(dg, name))
        assert np.all(np.isfinite(history)) and np.all(history >= 0), name
    assert np.count_nonzero(np.asarray(dg.input_amax_history)) == 2
    np.testing.assert_allclose(
        dg.input_scale, max(float(jnp.max(jnp.abs(x))) for x, _ in batches) / 448.0, rtol=1e-6
    )
    for out, (x, _) in zip(outs, batches, strict=True):
        assert sqnr_db(out, _reference(model, x)) >= 25.0


def test_partly_nan_history_gives_the_scale_of_its_finite_entries(key):
    """A few NaN entries among real amaxes: the scale comes from the others at once."""
    model = _warm(key)
    dg = model.dot_general
    finite_max = float(jnp.max(dg.input_amax_history))
    model = _with(model, input_amax_history=dg.input_amax_history.at[10:20].set(jnp.nan))
    x, c = _batch(key, 0)
    (out,), after = _run(model, [(x, c)])
    assert _count(after) == 1.0
    np.testing.assert_allclose(after.dot_general.input_scale, finite_max / 448.0, rtol=1e-6)
    assert sqnr_db(out, _reference(model, x)) >= 25.0


@pytest.mark.parametrize("value", [0.0, -1.0, np.inf, np.nan])
@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm"])
def test_bad_scale_is_repaired_and_counted(key, value, warm):
    """A scale of 0, -1, Inf or NaN in the state: the output stays finite and accurate,
    the scale is recomputed from the history (1 for an empty one), the step counted, and
    the repaired state is written back (``input_scale=0`` is not "never ran")."""
    model = _warm(key) if warm else _layer(key)
    before = model.dot_general
    model = _with(model, input_scale=value, kernel_scale=value, output_grad_scale=value)
    x, c = _batch(key, 0)
    (out,), after = _run(model, [(x, c)])
    assert np.all(np.isfinite(out))
    assert sqnr_db(out, _reference(model, x)) >= 25.0
    dg = after.dot_general
    assert _count(after) == 1.0
    for name, limit in (("input", 448.0), ("kernel", 448.0), ("output_grad", 57344.0)):
        scale = float(getattr(dg, f"{name}_scale")[0])
        expected = float(jnp.max(getattr(before, f"{name}_amax_history"))) / limit
        assert scale == pytest.approx(expected if warm else 1.0, rel=1e-6), name
    assert bool(dg.ran_mask()[0])
    assert float(dg.ordered_amax_history("input")[0]) == float(jnp.max(jnp.abs(x)))


def test_nonfinite_count_itself_repaired(key):
    model = _with(_layer(key), nonfinite_count=jnp.nan)
    _, after = _run(model, [_batch(key, 0)])
    assert _count(after) == 1.0
