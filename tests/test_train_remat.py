"""fp8jax-train ``--remat``: ``jax.checkpoint`` around each block changes what the step's
backward keeps, not what it computes (the same loss and gradients bit for bit, CPU), and
``--remat fp8`` lowers the compiled step's temporaries; the option is stored with a run and
a resume may change it (with a notice)."""

import dataclasses

import equinox as eqx
import jax
import numpy as np
import pytest
from conftest import DEFAULT_CPU_CODEGEN, ON_GPU, sqnr_db

import fp8jax
from fp8jax._ops.dot import INPUT_RESIDUAL, KERNEL_RESIDUAL
from fp8jax.nn._mlp import FC1_OUT
from fp8jax.train import _cli as cli
from fp8jax.train import _resume as resume
from fp8jax.train import _rundir as rundir
from fp8jax.train._model import REMAT, Transformer

BASE = cli.RunConfig(**cli.PRESETS["tiny"])
# XLA's CPU compiler may keep a chain of bf16 ops in f32 inside a fusion ("excess precision"),
# and where it does depends on the fusions, which a checkpoint changes: then the losses of
# none/fp8/full differed by 1e-6 (bf16) to 3e-4 (fp8, whose casts turn a rounding into a
# step). With it off every op rounds as written, and the three programs agree bit for bit
# (in XLA's default CPU code: conftest's older emitters round some fused ops otherwise).
EXACT = {"xla_allow_excess_precision": False, **DEFAULT_CPU_CODEGEN}
# jax.checkpoint's primitive (its name differs between JAX versions)
CHECKPOINT = jax.make_jaxpr(jax.checkpoint(lambda x: x))(1.0).jaxpr.eqns[0].primitive


def _batch(n: int):
    rng = np.random.default_rng(n)
    return jax.numpy.asarray(rng.integers(0, 256, (n, BASE.model.seq + 1), dtype=np.int32))


def _checkpoints(jaxpr) -> int:
    """The ``jax.checkpoint`` regions in ``jaxpr`` and the jaxprs inside it."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive is CHECKPOINT
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                    count += _checkpoints(getattr(sub, "jaxpr", sub))
    return count


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_remat_gives_the_same_loss_and_gradients(precision):
    """Bit for bit on the CPU. On a GPU the recomputed forward fuses differently, so bf16
    (and the FP8 casts fed by it) round differently: the loss within 1e-3 relative, every
    gradient within 30 dB SQNR of the no-remat step's. ``fc1-fp8`` and ``fp8-store`` keep fc1's
    output in FP8 in the fp8 run: the same loss (the forward is unchanged), every gradient
    within 17 dB SQNR of none's; ``fc1-fp8``'s gradients are ``fp8-store``'s bit for bit on
    the CPU (the same rounded copy, no checkpoint) (measured 19.8 dB at the least: this first step's FP8 gradients round to e5m2
    with uncalibrated scales, and the rounded copy moves some roundings)."""
    batch = _batch(2)
    results, regions = {}, {}
    for remat in REMAT:
        model = cli.build_model(dataclasses.replace(BASE, remat=remat), precision)
        params, static = eqx.partition(model, eqx.is_array)

        def loss(p, static=static):
            return cli.lm_loss(eqx.combine(p, static), batch)

        step = jax.jit(jax.value_and_grad(loss))
        regions[remat] = _checkpoints(jax.make_jaxpr(loss)(params).jaxpr)
        results[remat] = step.lower(params).compile(EXACT)(params)
    # FusedMLP checkpoints its own core in either precision; --remat adds one around the block
    assert regions["fp8"] == regions["fp8-store"] == regions["fp8-min"] == regions["full"], regions
    # lean and fc1-fp8: a region around the qkv projection (the MLP's is its core's, on a GPU)
    assert regions["fp8"] == regions["none"] + 1 == regions["fc1-fp8"] == regions["lean"], regions
    loss0, grads0 = results["none"]
    leaves0 = jax.tree_util.tree_leaves(grads0)
    assert len(leaves0) > (30 if precision == "fp8" else 8)  # weights (and every FP8 state)
    stored = ("fc1-fp8", "fp8-store")
    exact = ("lean", "fp8", "fp8-min", "full") + (stored if precision == "bf16" else ())
    for remat in exact:
        loss1, grads1 = results[remat]
        pairs = list(zip(leaves0, jax.tree_util.tree_leaves(grads1), strict=True))
        if ON_GPU:
            assert abs(float(loss1) - float(loss0)) <= 1e-3 * abs(float(loss0)), remat
            for a, b in pairs:
                a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
                assert np.array_equal(a, b) or sqnr_db(b, a) > 30, (remat, sqnr_db(b, a))
            continue
        assert float(loss1) == float(loss0), remat
        for a, b in pairs:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=remat)
    if precision == "fp8":
        for remat in stored:
            loss1, grads1 = results[remat]
            limit = 1e-3 * abs(float(loss0)) if ON_GPU else 0.0
            assert abs(float(loss1) - float(loss0)) <= limit, remat
            for a, b in zip(leaves0, jax.tree_util.tree_leaves(grads1), strict=True):
                a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
                assert np.array_equal(a, b) or sqnr_db(b, a) > 17, (remat, sqnr_db(b, a))
        some_differ = False
        for a, b in zip(*(jax.tree_util.tree_leaves(results[r][1]) for r in stored)):
            a, b = np.asarray(a), np.asarray(b)
            if not ON_GPU:
                np.testing.assert_array_equal(a, b)
        for a, b in zip(leaves0, jax.tree_util.tree_leaves(results["fc1-fp8"][1])):
            some_differ |= not np.array_equal(np.asarray(a), np.asarray(b))
        assert some_differ  # the rounded copy reaches the gradients


@pytest.mark.skipif(ON_GPU, reason="CPU memory analysis; the GPU's peak is benchmarks.memory's")
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_remat_fp8_lowers_the_steps_temporaries_and_keeps_what_the_gemms_read(precision):
    """The trainer's compiled step needs less temporary memory under ``--remat fp8`` (measured
    on the CPU: 0.67x in bf16, 0.63x in fp8); its backward keeps the GEMMs' input copies
    (FP8 in the fp8 run, bf16 in the bf16 run) and fc1's output; ``fp8-min`` keeps the same
    but fc1's output, and less than ``fp8``; ``fp8-store`` keeps fc1's output as e4m3 (and a
    scale) in the fp8 run, half the bytes, with no more GEMMs in the step than ``fp8``'s
    (``fp8-min``'s has more: fc1's forward again), and in the bf16 run what ``fp8`` keeps.
    Issue 49: no FP8 GEMM's operand, activation or weight, is also kept in bf16 (before,
    `FusedMLP`'s checkpoint kept fc1's and fc2's bf16 weights to recompute their FP8 input
    copies); under a remat policy only the weights of the GEMMs it runs again are."""
    batch = _batch(4)
    temp, kept, dots = {}, {}, {}
    cfg = BASE.model
    rerun = {(cfg.dim, cfg.dim + 2 * cfg.kv_heads * cfg.head_dim), (cfg.dim, cfg.dim)}  # qkv, o
    rerun = {"fp8": rerun, "fp8-store": rerun, "fp8-min": rerun | {(cfg.dim, 2 * cfg.ffn)}}
    for remat in ("none", "lean", "fc1-fp8", "fp8", "fp8-store", "fp8-min"):
        run = dataclasses.replace(BASE, remat=remat, batch=4)
        model = cli.build_model(run, precision)
        report = fp8jax.residuals_report(lambda m, b: cli.lm_loss(m, b), model, batch)
        kept[remat] = [r for r in report.residuals if r.kind != "argument"]
        twice = report.bf16_copies_of_fp8_inputs()  # (FP8 copy, bf16 copy) pairs
        assert all(f.name == KERNEL_RESIDUAL for f, _ in twice), (remat, twice)
        assert {f.shape[-2:] for f, _ in twice} <= rerun.get(remat, set()), (remat, twice)
        trainer = cli.Trainer(model, cli.make_optimizer(run))
        trainer.compile(batch)
        temp[remat] = trainer.compiled.memory_analysis().temp_size_in_bytes
        dots[remat] = trainer.compiled.as_text().count(" dot(")
    assert temp["fp8"] < 0.75 * temp["none"], temp
    saved = {remat: sum(r.nbytes for r in rs) for remat, rs in kept.items()}
    assert saved["fp8"] < 0.6 * saved["none"], saved
    inputs = {str(r.dtype) for r in kept["fp8"] if r.name == INPUT_RESIDUAL}
    assert inputs == ({"float8_e4m3fn"} if precision == "fp8" else {"bfloat16"}), inputs
    # fp8-min keeps less; the CPU's temporaries (its scheduling of the recomputed GEMM) need
    # not drop below fp8's (measured 1.06x in fp8, lower in bf16): the GPU's peak is measured
    assert temp["fp8-min"] < 0.75 * temp["none"], temp
    assert saved["fp8-min"] < 0.8 * saved["fp8"], saved  # 0.71x in fp8
    names = {remat: {r.name for r in kept[remat]} for remat in ("fp8", "fp8-min")}
    assert FC1_OUT in names["fp8"] and FC1_OUT not in names["fp8-min"], names
    fc1_out = {
        remat: [(str(r.dtype), r.nbytes) for r in kept[remat] if r.name == FC1_OUT and len(r.shape) > 1]
        for remat in ("none", "fc1-fp8", "fp8", "fp8-store")
    }
    ((dtype, nbytes),) = fc1_out["fp8"]
    assert dtype == "bfloat16", fc1_out
    assert fc1_out["none"] == fc1_out["fp8"], fc1_out
    # lean and fc1-fp8 keep no copy of the qkv projection's normed input nor its 1/rms per row
    rows = cfg.layers * 4 * cfg.seq
    assert saved["none"] - saved["lean"] == rows * (cfg.dim * (1 if precision == "fp8" else 2) + 4)
    if precision == "bf16":
        assert fc1_out["fp8-store"] == fc1_out["fp8"] and saved["fp8-store"] == saved["fp8"]
        assert fc1_out["fc1-fp8"] == fc1_out["none"] and saved["fc1-fp8"] == saved["lean"]
    else:
        scales = 4 * BASE.model.layers  # one float32 scale a layer
        # without a block checkpoint, the CPU's unfused FusedMLP (its own checkpoint) keeps
        # its FP8 input copies when fc1's output is FP8 (fc2's would need fc1's GEMM again);
        # the Pallas core (GPU) keeps x's either way and recomputes fc2's from fc1's output
        copies = cfg.layers * 4 * cfg.seq * (cfg.dim + cfg.ffn)
        extra = {"fp8-store": 0, "fc1-fp8": copies}
        for stored, base in (("fp8-store", "fp8"), ("fc1-fp8", "lean")):
            assert fc1_out[stored] == [("float8_e4m3fn", nbytes // 2)], (stored, fc1_out)
            want = saved[base] - nbytes // 2 + scales + extra[stored]
            assert saved[stored] == want, (stored, saved)
    assert dots["fp8-store"] == dots["fp8"] < dots["fp8-min"], dots
    assert dots["fc1-fp8"] == dots["lean"] == dots["none"], dots  # no GEMM runs again


@pytest.mark.skipif(ON_GPU, reason="CPU memory analysis; the GPU's peak is benchmarks.memory's")
def test_fc1_fp8_lowers_the_compiled_temporaries():
    """Issue 49: ``--remat fc1-fp8`` lowers the compiled fp8 step's temporaries by at least half
    the bytes its e4m3 copy of fc1's output saves (measured 0.75x of them: the peak is not
    all at the forward/backward boundary; 0.0x when XLA fused the cast into the backward's
    reader of the copy, which then kept the bf16 output). XLA:CPU removes optimization
    barriers before fusion and XLA:GPU only after scheduling: the step is compiled with the
    CPU's barrier pass off, as the GPU compiles it."""
    cfg = dataclasses.replace(BASE.model, ffn=768, seq=512, layers=4, scan_unroll=4)
    batch = np.random.default_rng(0).integers(0, 256, (2, cfg.seq + 1), dtype=np.int32)
    batch, temp = jax.numpy.asarray(batch), {}
    for remat in ("none", "fc1-fp8"):
        model = cli.build_model(dataclasses.replace(BASE, model=cfg, remat=remat), "fp8")
        params, static = eqx.partition(model, eqx.is_array)
        step = jax.jit(jax.value_and_grad(lambda p, s=static: cli.lm_loss(eqx.combine(p, s), batch)))
        options = {"xla_disable_hlo_passes": "cse_barrier_expander"}
        temp[remat] = step.lower(params).compile(options).memory_analysis().temp_size_in_bytes
    saved = cfg.layers * batch.shape[0] * cfg.seq * 2 * cfg.ffn  # bf16 -> e4m3: a byte each
    assert temp["none"] - temp["fc1-fp8"] >= 0.5 * saved, (temp, saved)


def test_remat_option_reaches_the_model_and_a_resume_may_change_it(tmp_path):
    """``--remat`` is a `RunConfig` field the model takes (and keeps when its tokens are
    split); it is stored with the run like ``--scan-unroll``, and like it (the same math) a
    resume with another value continues with a notice naming the change (the reason to
    change it is a run that ran out of memory)."""
    run = cli.run_config(cli.parse_args(["--remat", "fp8"]))
    model = cli.build_model(run, "fp8")
    assert run.remat == model.remat == model.with_token_split(None).remat == "fp8"
    store = cli.run_config(cli.parse_args(["--remat", "fp8-store"]))
    assert store.remat == cli.build_model(store, "fp8").with_remat("fp8-store").remat
    # the default, auto (tests/test_train_remat_auto.py), builds the model as none
    default = cli.run_config(cli.parse_args([]))
    assert default.remat == "auto" and cli.build_model(default, "bf16").remat == "none"
    assert cli.RunConfig(**cli.PRESETS["tiny"]).remat == "auto"
    off = cli.run_config(cli.parse_args(["--remat", "none"]))
    stored = rundir.config_record(off, "fp8")
    assert stored["remat"] == "none"
    changed = rundir.config_record(run, "fp8")
    assert rundir.config_diff(stored, changed) == ([], ["--remat none -> fp8"])
    marker = {"runs": {"fp8": stored}}
    notices = resume.check_resume(tmp_path, run, ["fp8"], marker)
    assert len(notices) == 1 and "--remat none -> fp8" in notices[0], notices
    # a train record names --remat when it is on (records from before it ran without)
    (on,), (no,) = (cli.to_records({"fp8": RESULT}, r, "tiny", META) for r in (run, off))
    assert on["params"]["remat"] == "fp8" and "remat" not in no["params"]
    with pytest.raises(ValueError, match="remat must be one of"):
        Transformer(BASE.model, key=jax.random.PRNGKey(0), remat="selective")
    with pytest.raises(SystemExit):
        cli.parse_args(["--remat", "selective"])


META = dict(device="cpu", date="2026-01-01", jax=jax.__version__, command="fp8jax-train")
RESULT = dict(tokens_per_s=None, mfu=None, val_loss=None, steps=1, peak_mem_mb=None)
