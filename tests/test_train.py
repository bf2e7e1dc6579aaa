"""fp8jax-train: runs end to end, resumes bit for bit, checkpoints on Ctrl-C, writes its outputs."""

import json

import jax
import numpy as np
import pytest

import fp8jax
from conftest import DEFAULT_CPU_CODEGEN
from fp8jax.train import _cli as cli
from fp8jax.train._data import load_corpus

SMALL = ["--dim", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--ffn", "64", "--seq", "32",
         "--batch", "8", "--eval-batches", "2", "--max-bytes", "300000", "--quiet", "--lr", "3e-3"]


def _losses(result):
    return [h["loss"] for h in result["history"]]


@pytest.mark.skipif(jax.devices()[0].platform == "gpu",
                    reason="two identical GPU runs already differ (nondeterministic XLA reductions): "
                           "bit-for-bit comparisons are checked on CPU")
def test_compare_interleave_resume_and_ctrl_c_end_to_end(tmp_path):
    """The trainer end to end, in one test (each run compiles both models):

    - a sequential ``--compare`` trains, evaluates on schedule (the last step included) and
      writes its table, plot, metrics and records;
    - ``--interleave K`` only changes when each precision's steps run (K of each in turn,
      both models resident): every loss and val loss equals the sequential compare's;
    - Ctrl-C (simulated) writes a checkpoint off the ``--checkpoint-every`` schedule, in
      either mode, also before the second precision has started, and ``--resume``
      continues from it bit for bit (same data order, state and optimizer)."""
    args = SMALL + ["--steps", "7", "--eval-every", "3", "--checkpoint-every", "2"]
    seq, record = tmp_path / "seq", tmp_path / "train.jsonl"
    full = cli.main(args + ["--out", str(seq), "--record", str(record)])
    assert set(full) == {"bf16", "fp8"}
    args = args + ["--no-plot"]
    # --resume of a finished run trains nothing and records nothing (records are of runs)
    again = tmp_path / "again.jsonl"
    assert set(cli.main(args + ["--out", str(seq), "--resume", "--record", str(again)])) == {
        "bf16", "fp8"}  # fmt: skip
    assert not again.exists() or not again.read_text().strip()
    inter_record = tmp_path / "inter.jsonl"
    inter = cli.main(args + ["--interleave", "2", "--out", str(tmp_path / "inter"),
                             "--record", str(inter_record)])
    cut = cli.main(args + ["--interleave", "2", "--out", str(tmp_path / "cut")], interrupt_at=3)
    assert cut["bf16"]["steps"] == 3 and cut["fp8"]["steps"] == 2  # bf16 was in its second chunk
    assert cut["bf16"]["interrupted"] and cut["fp8"]["interrupted"]
    assert (tmp_path / "cut" / "ckpt-bf16" / "3").exists()  # on "Ctrl-C", off the save schedule
    resumed = cli.main(args + ["--interleave", "2", "--out", str(tmp_path / "cut"), "--resume"])
    seq_cut = cli.main(args + ["--out", str(tmp_path / "seq_cut")], interrupt_at=3)
    assert set(seq_cut) == {"bf16"} and not (tmp_path / "seq_cut" / "ckpt-fp8").exists()
    assert seq_cut["bf16"]["interrupted"] and seq_cut["bf16"]["steps"] == 3
    assert (tmp_path / "seq_cut" / "ckpt-bf16" / "3").exists()
    seq_resumed = cli.main(args + ["--out", str(tmp_path / "seq_cut"), "--resume"])
    for precision in ("bf16", "fp8"):
        want = _losses(full[precision])
        assert len(set(want)) > 1 and want[-1] < want[0], (precision, want)
        assert all(np.isfinite(want))
        history = full[precision]["history"]
        assert [h["step"] for h in history] == list(range(1, 8))
        assert [h["step"] for h in history if "val_loss" in h] == [3, 6, 7]
        assert full[precision]["tokens_per_s"] > 0  # steps 4-7 minus the one after the step-6 eval
        for other in (inter, resumed, seq_resumed):
            assert [h["step"] for h in other[precision]["history"]] == list(range(1, 8))
            assert _losses(other[precision]) == want, precision
            assert other[precision]["val_loss"] == full[precision]["val_loss"]
            assert not other[precision]["interrupted"] and other[precision]["steps"] == 7
        assert inter[precision]["tokens_per_s"] > 0 and inter[precision]["compile_s"] > 0
        assert inter[precision]["joules_per_step"] is None  # no NVML on CPU
        assert inter[precision]["gemms"] > 0
        # FP8 GEMM calls: on CPU counted in the lowered step (XLA's CPU runs FP8 dots upcast)
        assert (inter[precision]["fp8_gemms"] > 0) == (precision == "fp8"), inter[precision]
    recs = [json.loads(line) for line in inter_record.read_text().splitlines()]
    assert {r["variant"]: r["interleave"] for r in recs} == {"bf16": 2, "fp8": 2}
    # The sequential compare's outputs.
    for name in ("metrics.csv", "metrics.json", "summary.md", "loss.png"):
        assert (seq / name).stat().st_size > 0, name
    _check_tensorboard_matches_csv(seq)
    assert "| fp8 |" in (seq / "summary.md").read_text()
    recs = [json.loads(line) for line in record.read_text().splitlines()]
    assert {r["variant"] for r in recs} == {"bf16", "fp8"}
    for r in recs:
        assert r["bench"] == "train" and r["params"]["preset"] == "tiny" and r["tokens_per_s"] > 0
        assert np.isfinite(r["val_loss"]) and "val_loss_rel_gap" in r
    # Same seed and data: the two runs start from the same loss (to FP8 accuracy).
    assert abs(_losses(full["fp8"])[0] - _losses(full["bf16"])[0]) < 0.05
    _check_memory_fields(full, recs, seq)


def _check_memory_fields(results, recs, out):
    """Each precision's result, record and ``metrics.json`` carry the step's peak memory (on
    CPU the compiled step's) and the residuals its backward keeps, by dtype (FP8 copies in
    the fp8 run only); the summary shows them."""
    saved = json.loads((out / "metrics.json").read_text())["results"]
    by_variant = {r["variant"]: r for r in recs}
    for precision, r in results.items():
        assert r["peak_mem_source"] == "compiled" and r["peak_mem_mb"] == r["compiled_mem_mb"] > 0
        by_dtype = r["saved_residuals"]
        assert r["saved_residual_mb"] == pytest.approx(sum(by_dtype.values()))
        assert r["saved_residual_mb"] > by_dtype.get("bfloat16", 0) > 0.1
        fp8 = {k: v for k, v in by_dtype.items() if k.startswith("float8")}
        assert (fp8.get("float8_e4m3fn", 0) > 0.1) if precision == "fp8" else not fp8, by_dtype
        for other in (saved[precision], by_variant[precision]):
            for key in ("peak_mem_mb", "peak_mem_source", "saved_residual_mb", "saved_residuals"):
                assert other[key] == r[key], (precision, key)
    table = (out / "summary.md").read_text()
    assert "| peak MiB | saved MiB |" in table
    (fp8_row,) = [line for line in table.splitlines() if line.startswith("| fp8 |")]
    assert "(e4m3 " in fp8_row and "(e4m3 " not in table.replace(fp8_row, "")


def test_peak_is_the_allocators_where_this_run_set_it(monkeypatch):
    """``peak_mem_mb`` is the allocator's peak where it grew during the run and no other run
    shared the device, else the compiled step's (marked in the table where others differ)."""
    from types import SimpleNamespace

    from fp8jax.train import _loop
    from fp8jax.train._memory import saved_cell
    from fp8jax.train._report import summarize

    trainer = SimpleNamespace(devices=lambda: [], compiled=object(), peak_mem_mb=lambda: 3.0)
    run = SimpleNamespace(trainer=trainer, peak_before=2**20)
    monkeypatch.setattr(_loop, "allocator_peak_bytes", lambda devices=None: 5 * 2**20)
    assert _loop.TrainRun.peak_mem(run, alone=True) == (5.0, "allocator")
    assert _loop.TrainRun.peak_mem(run, alone=False) == (3.0, "compiled")  # --interleave
    run.peak_before = 5 * 2**20  # an earlier run of the process set the peak
    assert _loop.TrainRun.peak_mem(run, alone=True) == (3.0, "compiled")
    monkeypatch.setattr(_loop, "allocator_peak_bytes", lambda devices=None: None)  # CPU
    assert _loop.TrainRun.peak_mem(run, alone=True) == (3.0, "compiled")
    result = dict(steps=1, final_loss=1.0, val_loss=1.0, tokens_per_s=None, mfu=None)
    results = {
        "bf16": dict(result, peak_mem_mb=5000.0, peak_mem_source="allocator",
                     saved_residual_mb=1234.4, saved_residuals={"bfloat16": 1234.4}),
        "fp8": dict(result, peak_mem_mb=3000.0, peak_mem_source="compiled",
                    saved_residual_mb=900.0,
                    saved_residuals={"bfloat16": 588.0, "float8_e4m3fn": 312.0}),
    }  # fmt: skip
    rows = summarize(results).splitlines()
    assert rows[2].endswith("| 5,000 | 1,234 |") and rows[3].endswith(
        "| 3,000 (compiled) | 900 (e4m3 312) |")  # fmt: skip
    assert saved_cell(None, None) == "-" and saved_cell(1.25, {"float8_e5m2": 0.5}) == "1.2 (e5m2 0.5)"


def _check_tensorboard_matches_csv(out):
    """The TensorBoard event files under ``out/tb/<precision>`` hold the CSV's losses."""
    import csv

    from fp8jax.train._report import read_tensorboard_scalars

    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    for precision in ("bf16", "fp8"):
        tb = read_tensorboard_scalars(out / "tb" / precision)
        want = [(int(r["step"]), float(r["loss"])) for r in rows if r["precision"] == precision]
        assert len(want) == 7
        # TensorBoard stores float32
        assert [s for s, _ in tb["loss"]] == [s for s, _ in want], precision
        np.testing.assert_allclose([v for _, v in tb["loss"]], [v for _, v in want], rtol=1e-6)
        val = [(int(r["step"]), float(r["val_loss"])) for r in rows
               if r["precision"] == precision and r["val_loss"]]
        assert [s for s, _ in tb["val_loss"]] == [s for s, _ in val] == [3, 6, 7]
        np.testing.assert_allclose([v for _, v in tb["val_loss"]], [v for _, v in val], rtol=1e-6)


def test_bad_interleave_raises(tmp_path):
    with pytest.raises(ValueError, match="--interleave -1"):
        cli.main(SMALL + ["--interleave", "-1", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="both precisions"):
        cli.main(SMALL + ["--precision", "fp8", "--interleave", "2", "--out", str(tmp_path)])


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_unrolled_layer_scan_is_the_same_model(precision):
    """``scan_unroll`` only changes how XLA runs the layer loop: same loss and gradients,
    and with every layer unrolled the compiled step has no loop left (no residual stacking)."""
    base = cli.RunConfig(**cli.PRESETS["tiny"])
    batch = jax.numpy.asarray(np.random.default_rng(0).integers(0, 256, (2, base.model.seq + 1), dtype=np.int32))

    def loss_and_grad(unroll):
        import dataclasses

        import equinox as eqx
        run = dataclasses.replace(base, model=dataclasses.replace(base.model, scan_unroll=unroll))
        params, static = eqx.partition(cli.build_model(run, precision), eqx.is_array)
        fn = jax.jit(jax.value_and_grad(lambda p: cli.lm_loss(eqx.combine(p, static), batch)))
        compiled = fn.lower(params).compile(DEFAULT_CPU_CODEGEN)  # XLA's default CPU code
        return compiled(params), compiled.as_text()

    (loss1, grads1), hlo1 = loss_and_grad(1)
    (loss2, grads2), hlo2 = loss_and_grad(base.model.layers)
    assert " while(" in hlo1 and " while(" not in hlo2
    # CPU runs both programs to the same bits. On an H100 XLA fuses and reduces the two in a
    # different order: the loss moved by 6e-5 and 17 of 32768 bf16 gradient elements by up to
    # 1.2e-4 (tensors up to 0.05). The GPU bounds are bf16's rounding range; a wrong layer
    # order or a dropped layer gives errors of order 1.
    gpu = jax.devices()[0].platform == "gpu"
    np.testing.assert_allclose(loss2, loss1, rtol=1e-3 if gpu else 1e-6)
    for g1, g2 in zip(jax.tree_util.tree_leaves(grads1), jax.tree_util.tree_leaves(grads2), strict=True):
        g1, g2 = np.asarray(g1, np.float64), np.asarray(g2, np.float64)
        error = np.linalg.norm(g2 - g1) / max(np.linalg.norm(g1), 1e-30)
        assert error <= (1e-2 if gpu else 1e-6), (g1.shape, error)


def test_stacked_fp8_state_enters_once_outside_the_layer_scan():
    """The blocks' stacked FP8 state converts to `MAX_GRAD` once, on the ``[layers, ...]``
    arrays, before the layer scan (`fp8jax._guard.enter_tree`), not per layer inside it
    (issue 21: with every layer unrolled, per-layer entering cost the 1b step about 9% of its
    HLO and 1.5 s of compile)."""
    import dataclasses

    import equinox as eqx
    from jax.extend import core

    base = cli.RunConfig(**cli.PRESETS["tiny"])
    layers = base.model.layers
    run = dataclasses.replace(base, model=dataclasses.replace(base.model, scan_unroll=layers))
    params, static = eqx.partition(cli.build_model(run, "fp8"), eqx.is_array)
    batch = jax.numpy.zeros((2, base.model.seq + 1), jax.numpy.int32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: cli.lm_loss(eqx.combine(p, static), batch)))(params)
    entered, inside_scan = [], []

    def walk(j, in_scan):
        for e in j.eqns:
            if e.primitive.name == "custom_vjp_call" and "_to_max_grad" in str(e.params):
                (inside_scan if in_scan else entered).append(e)
            for v in e.params.values():
                for sub in v if isinstance(v, (list, tuple)) else [v]:
                    if isinstance(sub, (core.Jaxpr, core.ClosedJaxpr)):
                        walk(getattr(sub, "jaxpr", sub), in_scan or e.primitive.name == "scan")

    walk(jaxpr.jaxpr, False)
    states = [x for x in jax.tree_util.tree_leaves(
        params.blocks, is_leaf=lambda x: isinstance(x, fp8jax.OverwriteWithGradient))
        if isinstance(x, fp8jax.OverwriteWithGradient)]
    assert states and not inside_scan, (len(states), len(inside_scan))
    assert len(entered) == len(states)  # one conversion per state, of all its leaves
    assert all(v.aval.shape[0] == layers for e in entered for v in e.invars)


def test_moe_blocks_and_custom_data(tmp_path, capsys):
    """MoE blocks train on a custom text; output that is not a terminal (here captured) gets
    no progress bar, one plain line per evaluation instead."""
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(3000)))
    loud = [a for a in SMALL if a != "--quiet"]
    results = cli.main(loud + ["--experts", "4", "--top-k", "2", "--steps", "3", "--eval-every", "3",
                                "--precision", "fp8", "--data", str(text), "--out", str(tmp_path / "moe"),
                                "--no-plot"])
    assert np.isfinite(results["fp8"]["val_loss"])
    err = capsys.readouterr().err
    assert "fp8 step 3/3: loss" in err and "\r" not in err and "it/s" not in err, err


def test_moe_blocks_use_grouped_experts_with_fp8_state():
    """MoE blocks are `fp8jax.nn.MoE` (grouped experts): FP8 state only in the fp8
    run, same weights in both, and a positive load-balancing loss in the objective."""
    import jax.numpy as jnp

    from fp8jax.nn import MoE

    run = cli.run_config(cli.parse_args(SMALL + ["--experts", "4", "--top-k", "2"]))
    bf16, fp8 = cli.build_model(run, "bf16"), cli.build_model(run, "fp8")
    assert isinstance(fp8.blocks.mlp.moe, MoE)
    assert bf16.blocks.mlp.moe.experts.fc1.fp8_state is None
    state = fp8.blocks.mlp.moe.experts.fc1.fp8_state
    assert state is not None and state.kernel_scale.shape[-1] == 4
    np.testing.assert_array_equal(bf16.blocks.mlp.moe.experts.fc1.weight, fp8.blocks.mlp.moe.experts.fc1.weight)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 33)))
    _, aux = cli.cast_for_compute(fp8, cli.compute_dtype()).forward(tokens[:, :-1])
    assert float(aux) > 0.0
    with_aux, without = cli.lm_loss(fp8, tokens), cli.lm_loss(fp8, tokens, with_aux=False)
    assert float(with_aux) == pytest.approx(float(without) + float(aux), rel=1e-5)
    dense = cli.build_model(cli.run_config(cli.parse_args(SMALL)), "fp8")
    assert float(dense.forward(tokens[:, :-1])[1]) == 0.0
    # fp8_state lists the grouped experts' state beside the linear layers'.
    from fp8jax import Fp8DotGeneral
    from fp8jax.nn._grouped import Fp8GroupedState

    kinds = {type(s) for _, s in fp8jax.fp8_state(fp8)}
    paths = [p for p, s in fp8jax.fp8_state(fp8) if isinstance(s, Fp8GroupedState)]
    assert kinds == {Fp8DotGeneral, Fp8GroupedState}, kinds
    assert paths == ["blocks.mlp.moe.experts.fc1.fp8_state", "blocks.mlp.moe.experts.fc2.fp8_state"], paths
    assert fp8jax.fp8_state(bf16) == []


def test_corpus_is_deterministic_and_split():
    a, b = load_corpus(max_bytes=200_000), load_corpus(max_bytes=200_000)
    np.testing.assert_array_equal(a.train, b.train)
    assert len(a.val) > 0 and len(a.train) + len(a.val) == 200_000
    np.testing.assert_array_equal(a.batch(0, 7, 4, 32), b.batch(0, 7, 4, 32))
    assert not np.array_equal(a.batch(0, 7, 4, 32), a.batch(0, 8, 4, 32))


def test_bad_arguments_raise(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_corpus(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="heads"):
        cli.main(SMALL + ["--heads", "3", "--out", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="does not exist .no checkpoint to resume"):
        cli.main(SMALL + ["--precision", "bf16", "--resume", "--out", str(tmp_path / "empty")])
    assert not (tmp_path / "empty").exists()


def test_fp8_attention_option_trains_and_updates_its_state(tmp_path):
    args = SMALL + ["--precision", "fp8", "--fp8-attention", "--steps", "8", "--eval-every", "4", "--no-plot",
                    "--checkpoint-every", "0", "--out", str(tmp_path)]
    result = cli.main(args)["fp8"]
    losses = _losses(result)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    run = cli.run_config(cli.parse_args(args))
    model = cli.build_model(run, "fp8")
    assert model.blocks.attn.core.state.scales.shape == (2, 10)  # one state per layer
    assert cli.build_model(run, "bf16").blocks.attn.core is None


def test_console_script_exits_zero_after_training(tmp_path):
    """``fp8jax-train`` as installed: trains, writes its outputs and exits with status 0
    (it used to hand main's results to sys.exit: a dump of them and status 1)."""
    import shutil
    import subprocess

    script = shutil.which("fp8jax-train")
    if script is None:
        pytest.skip("fp8jax-train is not installed (pip install -e .)")
    args = SMALL + ["--dim", "32", "--layers", "1", "--ffn", "32", "--seq", "16", "--steps", "3", "--eval-every", "3",
                    "--checkpoint-every", "0", "--no-plot", "--out", str(tmp_path)]
    out = subprocess.run([script, *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| fp8 |" in out.stdout and "'history'" not in out.stdout + out.stderr
    assert (tmp_path / "summary.md").exists()


def test_tensorboard_log_without_tensorboardx_says_so_once(tmp_path, monkeypatch, capsys):
    import sys

    from fp8jax.train import _report as report

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import raises ImportError
    monkeypatch.setattr(report, "_warned_no_tensorboard", False)
    for _ in range(2):
        log = report.TensorBoardLog(tmp_path / "tb")
        log.scalars(1, dict(loss=1.0))
        log.close()
    assert capsys.readouterr().err.count("tensorboardX not installed") == 1
    assert not (tmp_path / "tb").exists()


def test_8b_preset_is_llama3_8b_shaped():
    """Config only (a multi-GPU run): LLaMA-3-8B's 6.98B non-embedding parameters."""
    model = cli.PRESETS["8b"]["model"]
    assert (model.dim, model.layers, model.ffn, model.heads, model.kv_heads) == (4096, 32, 14336, 32, 8)
    assert model.non_embedding_params() == pytest.approx(6.98e9, rel=1e-3)
    assert model.vocab == 128256  # LLaMA-3's tokenizer (issue 48)
    # unrolled as the other GPU presets: rolled, its FSDP bf16 step took 40% longer (issue 48)
    assert model.scan_unroll == model.layers


def test_vocab_sizes_embedding_and_head_and_fp8_head_converts_the_head():
    """``--vocab``: embedding rows and logits (byte data uses the first 256); ``--fp8-head``:
    the fp8 run's head GEMMs in FP8 too (bf16 head by default; the bf16 run never)."""
    import jax.numpy as jnp

    run = cli.run_config(cli.parse_args(SMALL + ["--vocab", "512", "--fp8-head"]))
    bf16, fp8 = cli.build_model(run, "bf16"), cli.build_model(run, "fp8")
    assert bf16.embed.shape == (512, 64) and fp8.head.weight.shape == (512, 64)
    paths = [p for p, _ in fp8jax.fp8_state(fp8)]
    assert any(p.startswith("head") for p in paths), paths
    assert fp8jax.fp8_state(bf16) == []
    default = cli.build_model(cli.run_config(cli.parse_args(SMALL + ["--vocab", "512"])), "fp8")
    assert not any(p.startswith("head") for p, _ in fp8jax.fp8_state(default))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 33)))
    logits = cli.cast_for_compute(fp8, cli.compute_dtype())(tokens[:, :-1])
    assert logits.shape == (2, 32, 512) and bool(jnp.isfinite(logits).all())
    loss_fp8, loss_bf16 = cli.lm_loss(fp8, tokens), cli.lm_loss(bf16, tokens)
    assert float(loss_fp8) == pytest.approx(float(loss_bf16), rel=0.02)


# --steps 1, no compile cache: cheap (and no side effects) should a check be missing and it train.
QUICK = SMALL + ["--steps", "1", "--eval-every", "1", "--no-plot", "--no-tensorboard", "--no-compile-cache"]


@pytest.mark.parametrize("args,message", [
    (["--mesh", "data=3"], "--mesh 'data=3': the axis sizes multiply to 3"),
    (["--mesh", "foo=1"], "--mesh 'foo=1': unknown axis 'foo'"),
    (["--mesh", ""], "--mesh '': expected AXIS=SIZE"),
    (["--data", "/nonexistent/corpus.txt"], "--data /nonexistent/corpus.txt: no such file or directory"),
    (["--interleave", "-1"], "--interleave -1: K must be > 0"),
    (["--heads", "3"], "--heads 3 --kv-heads 1 --ffn 64 --seq 32: dim (64) must divide by heads (3)"),
    (["--warmup", "5", "--steps", "2"], "--warmup 5 is larger than --steps 2"),
    (["--vocab", "100"], "vocab=100 must be >= 256 (the byte tokens)"),
])
def test_bad_option_values_are_usage_errors(tmp_path, monkeypatch, capsys, args, message):
    """On the command line (`main` reading sys.argv, as ``python -m fp8jax.train`` and the console
    script do) a bad option value is argparse's usage error: its message on stderr, exit status 2,
    and --out not created. Called with a list of arguments, `main` raises ValueError instead."""
    import re
    import sys

    out = tmp_path / "out"
    argv = QUICK + ["--out", str(out), *args]
    monkeypatch.setattr(sys, "argv", ["fp8jax-train", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "fp8jax-train: error: " in err and message in err, err
    assert not out.exists()
    with pytest.raises(ValueError, match=re.escape(message)):
        cli.main(argv)
    assert not out.exists()


def test_out_that_cannot_be_created_is_a_usage_error(tmp_path, monkeypatch, capsys):
    import sys

    (tmp_path / "file").write_text("not a directory")
    out = tmp_path / "file" / "out"
    with pytest.raises(ValueError, match=f"--out {out}: cannot create the output directory"):
        cli.main(QUICK + ["--out", str(out)])
    monkeypatch.setattr(sys, "argv", ["fp8jax-train", *QUICK, "--out", str(out)])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 2 and "--out" in capsys.readouterr().err


def test_python_m_fp8jax_train_bad_option_exits_2_without_traceback(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(cli.__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "fp8jax.train", "--mesh", "foo=1", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "fp8jax-train: error: --mesh 'foo=1': unknown axis 'foo'" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "o").exists()
