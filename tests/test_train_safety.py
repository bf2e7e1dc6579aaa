"""fp8jax-train keeps what is not its own and what it ran: a foreign or unwritable --out is
refused before anything is built, records are written atomically, Ctrl-C (a real SIGINT) and
a kill after a checkpoint lose no history step, --resume names every option that differs,
and bad inputs fail in one line leaving nothing behind."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from fp8jax.train import _census as census, _cli as cli, _rundir as rundir
from fp8jax.train import _resume as resume_
from fp8jax.train import _checkpoint as ckpt
from fp8jax.train._census import lowered_gemm_calls

# The smallest model that trains (8 host devices in the tests: the batch splits over data=8),
# on a small text file (listing the stdlib for the default corpus takes seconds).
TINY = ["--precision", "bf16", "--dim", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
        "--ffn", "32", "--seq", "16", "--batch", "8", "--eval-batches", "1", "--quiet",
        "--no-plot", "--no-tensorboard", "--no-compile-cache"]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n"
                            for i in range(1500)))  # fmt: skip
    return ["--data", str(path)]


def _steps(history):
    return [h["step"] for h in history]


def _csv_steps(out):
    rows = (out / "metrics.csv").read_text().splitlines()[1:]
    return [int(r.split(",")[1]) for r in rows]


def _usage_error(monkeypatch, capsys, argv) -> str:
    """``fp8jax-train ARGV`` on the command line: exit status 2, one line on stderr."""
    monkeypatch.setattr(sys, "argv", ["fp8jax-train", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.fixture
def no_corpus(monkeypatch):
    """Fail the test if the corpus is read (the check under test must come first)."""

    def load(*a, **k):
        raise AssertionError("the corpus was read")

    monkeypatch.setattr(cli, "load_corpus", load)


def test_foreign_out_is_refused_unless_overwrite(tmp_path, monkeypatch, capsys, no_corpus):
    out = tmp_path / "mine"
    (out / "ckpt-bf16").mkdir(parents=True)
    user = {"notes.txt": "mine", "summary.md": "my summary", "ckpt-bf16/keep.txt": "keep"}
    for name, text in user.items():
        (out / name).write_text(text)
    line = _usage_error(monkeypatch, capsys, TINY + ["--out", str(out)])
    assert f"--out {out} is not empty and not an fp8jax-train run" in line
    assert "--overwrite" in line
    with pytest.raises(ValueError, match="cannot go with --resume"):
        cli.main(TINY + ["--out", str(out), "--overwrite", "--resume"])
    assert {n: (out / n).read_text() for n in user} == user
    assert sorted(p.name for p in out.iterdir()) == ["ckpt-bf16", "notes.txt", "summary.md"]


def test_unwritable_out_fails_before_the_corpus(tmp_path, monkeypatch, capsys, no_corpus):
    """Root writes anywhere: the probe's open is made to fail as a read-only --out's does."""
    real_open = os.open

    def read_only(path, *args, **kwargs):
        if rundir.PROBE in os.fspath(path):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    out = tmp_path / "ro"
    out.mkdir()
    line = _usage_error(monkeypatch, capsys, TINY + ["--out", str(out)])
    assert line.endswith(f"--out {out}: not writable: Permission denied"), line
    new = tmp_path / "new" / "run"  # created for the probe, removed again
    with pytest.raises(ValueError, match="not writable"):
        cli.main(TINY + ["--out", str(new)])
    assert not (tmp_path / "new").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_read_only_out_fails_before_the_corpus(tmp_path, no_corpus):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        with pytest.raises(ValueError, match=f"--out {out}: not writable"):
            cli.main(TINY + ["--out", str(out)])
    finally:
        out.chmod(0o755)


def test_bad_inputs_fail_in_one_line_leaving_nothing(tmp_path, monkeypatch, capsys, data):
    out = tmp_path / "a" / "out"
    line = _usage_error(monkeypatch, capsys, TINY + ["--resume", "--out", str(out)])
    assert f"--resume: --out {out} does not exist" in line
    assert not (tmp_path / "a").exists()
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for path in ("/dev/null", str(empty)):
        line = _usage_error(monkeypatch, capsys, TINY + ["--data", path, "--out", str(out)])
        assert line.endswith(f"--data {path}: empty (0 bytes)"), line
    monkeypatch.setattr(cli, "train", lambda *a, **k: pytest.fail("a model was trained"))
    line = _usage_error(monkeypatch, capsys, TINY + data + ["--seq", "8192", "--out", str(out)])
    assert "--seq 8192: the corpus" in line and "81,393 bytes" in line, line
    assert not (tmp_path / "a").exists()


def test_resume_keeps_history_through_a_kill_and_names_option_changes(tmp_path, data, capsys):
    """A kill between a checkpoint's commit and the history file's write (here: the write
    raises), then a damaged history file: --resume takes the history inside the checkpoint.
    The run's config is stored: resuming with another model is refused, naming each option;
    schedule options are applied with a notice naming them."""
    out = tmp_path / "run"
    args = TINY + data + ["--steps", "4", "--eval-every", "4", "--checkpoint-every", "2",
                          "--out", str(out)]  # fmt: skip

    class Killed(BaseException):
        pass

    def killed(path, text):
        raise Killed

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ckpt, "atomic_write_text", killed)
        with pytest.raises(Killed):
            cli.main(args)
    assert (out / "ckpt-bf16" / "2").is_dir() and not (out / "history-bf16.json").exists()
    (out / "history-bf16.json").write_text('[{"step": 1, "loss": 5.5')  # cut mid-write
    # Resumed with other schedule options: applied, with a notice naming them.
    resumed = cli.main(args + ["--resume", "--steps", "5", "--lr", "1e-3"])["bf16"]
    assert "--lr 0.003 -> 0.001, --steps 4 -> 5" in capsys.readouterr().err
    assert _steps(resumed["history"]) == [1, 2, 3, 4, 5] == _csv_steps(out)
    assert _steps(json.loads((out / "history-bf16.json").read_text())) == [1, 2, 3, 4, 5]
    cpu = jax.devices()[0].platform == "cpu"  # on CPU the census shows what a GPU would run
    assert resumed["gemm_census"] == (census.LOWERED if cpu else census.COMPILED)
    marker = json.loads((out / rundir.MARKER).read_text())
    entry = marker["runs"]["bf16"]
    assert entry["steps"] == 5 and "--steps 5" in entry["command"]
    assert ckpt.stored_config(out, "bf16")["steps"] == 5
    # A finished run resumed with another model: refused, naming each option (not its result).
    bigger = ["--dim", "64", "--ffn", "64", "--scaling", "current"]  # --scaling: fp8 runs only
    with pytest.raises(ValueError) as e:
        cli.main(args + ["--resume", "--steps", "5", "--lr", "1e-3"] + bigger)
    assert "--dim 32 -> 64, --ffn 32 -> 64; resume with the run's options" in str(e.value)
    assert "scaling" not in str(e.value) and "| bf16 |" not in capsys.readouterr().out
    (out / "result-bf16.json").write_text('{"steps": 5, "interr')  # damaged: one clear line
    with pytest.raises(ValueError, match=f"{out / 'result-bf16.json'} is damaged"):
        cli.main(args + ["--resume", "--steps", "5", "--lr", "1e-3"])


def test_resume_of_a_run_from_before_stored_configs_names_the_misfit(tmp_path, data):
    """A checkpoint as the trainer wrote them before (one "default" item, no config): another
    --dim fails in one line naming the checkpoint and the shapes, not an orbax traceback."""
    import orbax.checkpoint as ocp

    from fp8jax.train._trainer import Trainer

    out = tmp_path / "old"
    run = cli.run_config(cli.parse_args(TINY))
    trainer = Trainer(cli.build_model(run, "bf16"), cli.make_optimizer(run))
    manager = ocp.CheckpointManager((out / "ckpt-bf16").resolve())
    manager.save(2, args=ocp.args.StandardSave(dict(params=trainer.params,
                                                    opt_state=trainer.opt_state)))  # fmt: skip
    manager.wait_until_finished()
    with pytest.raises(ValueError) as e:
        cli.main(TINY + data + ["--out", str(out), "--resume", "--dim", "64"])
    assert f"--resume: {out / 'ckpt-bf16' / '2'} holds a model of other shapes" in str(e.value)
    assert not (out / rundir.MARKER).exists()  # a failed attempt's options are not recorded


def _start(args):
    src = str(Path(cli.__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "fp8jax.train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _wait_for(stream, text: str) -> list[str]:
    lines = []
    for line in stream:
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"{text!r} never came: {''.join(lines)[-2000:]}")


def test_sigint_in_training_then_resume_keeps_every_step(tmp_path, data):
    """A real Ctrl-C after a few steps: exit status 130, one line, no traceback; the
    checkpoint holds every step that ran, and --resume completes the history gaplessly."""
    out = tmp_path / "run"
    loud = [a for a in TINY if a != "--quiet"]  # one stderr line per evaluation (not a tty)
    args = loud + data + ["--steps", "100", "--eval-every", "1", "--checkpoint-every", "40"]
    proc = _start(args + ["--out", str(out)])
    _wait_for(proc.stderr, "bf16 step 3/100")
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted: checkpoint of bf16 step ") and "--resume" in last, last
    cut = int(last.split("bf16 step ")[1].split(" ")[0])
    assert 3 <= cut < 100
    saved = json.loads((out / "history-bf16.json").read_text())
    assert _steps(saved) == list(range(1, cut + 1))
    result = cli.main(args + ["--quiet", "--out", str(out), "--resume"])["bf16"]
    assert _steps(result["history"]) == list(range(1, 101)) == _csv_steps(out)


def test_sigint_at_start_up_exits_130_in_one_line(tmp_path, data):
    proc = _start(TINY + data + ["--out", str(tmp_path / "run")])
    _wait_for(proc.stdout, "fp8jax-train: preset")  # the corpus is read; the model is next
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert "interrupted" in lines[-1] and sum("interrupted" in x for x in lines) == 1, stderr


def test_clear_outputs_deletes_only_the_trainers_files(tmp_path):
    for name in ("ckpt-fp8/3/state/x", "ckpt-fp8/5.orbax-checkpoint-tmp-9/y", "ckpt-fp8/mine/z",
                 "tb/fp8/events.out.tfevents.1.host", "tb/fp8/notes.txt", "result-fp8.json",
                 "history-fp8.json", "result-bf16.json", "ckpt-bf16/3/state/x",
                 "tb/bf16/e"):  # fmt: skip
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    rundir.clear_outputs(tmp_path, "fp8")
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["ckpt-bf16/3/state/x", "ckpt-fp8/mine/z", "result-bf16.json", "tb/bf16/e",
                    "tb/fp8/notes.txt"]  # fmt: skip


def test_atomic_write_leaves_old_or_new(tmp_path, monkeypatch):
    path = tmp_path / "summary.md"
    rundir.atomic_write_text(path, "old")

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        rundir.atomic_write_text(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["summary.md"]


def test_config_diff_sorts_model_options_from_schedule():
    run = cli.run_config(cli.parse_args(TINY))
    old = rundir.config_record(run, "fp8")
    new = dict(old, dim=64, steps=5, recipe="rowwise", cast_kernel=False)
    model, other = rundir.config_diff(old, new)
    assert model == ["--dim 32 -> 64", "--recipe tensor -> rowwise"]
    assert other == ["--cast-kernel True -> False", "--steps 300 -> 5"]
    bf16 = rundir.config_record(run, "bf16")
    assert rundir.config_diff(bf16, dict(bf16, recipe="rowwise")) == ([], [])


def test_help_texts_and_param_count(capsys):
    from fp8jax.train import _generate as generate

    text = " ".join(cli._parser().format_help().split())
    for option, default in (("--steps STEPS", "tiny 300"), ("--batch BATCH", "tiny 16"),
                            ("--lr LR", "tiny 0.003"), ("--seed SEED", "default 0")):  # fmt: skip
        assert default in text.split(option, 2)[2].split(" --")[0], option
    with pytest.raises(SystemExit):
        generate.parse_args(["--help"])
    assert "default: 0.0" in " ".join(capsys.readouterr().out.split())
    assert cli.millions(400_000) == "0.4M" and cli.millions(350e6) == "350M"


def test_fp8_census_counts_the_lowered_programs_calls():
    """On a CPU the census reads the lowered step (the trainer's run says so:
    test_resume_keeps_history_through_a_kill...), each call of a shared function counted."""
    text = """
  func.func public @main(%a: tensor<2x2xbf16>) -> tensor<2x2xf32> {
    %0 = call @fp8_gemm(%a) : (tensor<2x2xbf16>) -> tensor<2x2xf32>
    %1 = func.call @fp8_gemm(%a) : (tensor<2x2xbf16>) -> tensor<2x2xf32>
    %2 = stablehlo.dot_general %a, %a : (tensor<2x2xbf16>, tensor<2x2xbf16>) -> tensor<2x2xf32>
  }
  func.func private @fp8_gemm(%a: tensor<2x2xf8E4M3FN>) -> tensor<2x2xf32> {
    %0 = stablehlo.dot_general %a, %a : (tensor<2xf8E4M3FN>, tensor<2xf8E4M3FN>) -> tensor<f32>
  }
"""  # fmt: skip
    gemms = lowered_gemm_calls(text)
    assert (len(gemms), sum(g.is_fp8 for g in gemms)) == (3, 2)


def test_resume_after_one_precision_finished_starts_the_other(tmp_path):
    """Ctrl-C after bf16's last step, before fp8 started: --resume keeps bf16's result and
    trains fp8 from scratch; with nothing finished or checkpointed it says so in one line."""
    args = cli.parse_args(TINY + ["--compare", "--resume", "--steps", "2"])
    run = cli.run_config(args)
    (tmp_path / "result-bf16.json").write_text(json.dumps(dict(steps=2, interrupted=False)))
    results, todo, resume = resume_.todo(args, ["bf16", "fp8"], tmp_path, run, {})
    assert list(results) == ["bf16"] and todo == ["fp8"] and resume == {"fp8": False}
    (tmp_path / "result-bf16.json").unlink()
    with pytest.raises(ValueError, match="no checkpoint in .*ckpt-bf16 to continue from"):
        resume_.todo(args, ["bf16", "fp8"], tmp_path, run, {})


def test_resume_of_a_checkpoint_from_before_attention_guards(tmp_path, data):
    """A run with ``--fp8-attention`` saved before `Fp8AttentionState` carried a guard: the
    checkpoint restores (every saved array as saved), the guards start fresh, and the run
    resumes."""
    import equinox as eqx
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from fp8jax.train._checkpoint import restore_checkpoint
    from fp8jax.train._trainer import Trainer

    args = [a if a != "bf16" else "fp8" for a in TINY] + data + ["--fp8-attention"]
    run = cli.run_config(cli.parse_args(args))
    trainer = Trainer(cli.build_model(run, "fp8"), cli.make_optimizer(run))
    core = lambda p: p.blocks.attn.core.state.guard  # noqa: E731
    fresh = np.asarray(core(trainer.params))
    old = eqx.tree_at(core, trainer.params, None, is_leaf=lambda x: x is None)
    old = jax.tree_util.tree_map(lambda x: x + 1 if x.dtype == np.float32 else x, old)
    out = tmp_path / "old"
    manager = ocp.CheckpointManager((out / "ckpt-fp8").resolve())
    items = ocp.args.Composite(
        state=ocp.args.StandardSave(dict(params=old, opt_state=trainer.opt_state)),
        history=ocp.args.JsonSave([]),
        config=ocp.args.JsonSave({}),
    )
    manager.save(2, args=items)
    manager.wait_until_finished()
    step, _ = restore_checkpoint(out, "fp8", trainer)
    assert step == 2
    np.testing.assert_array_equal(np.asarray(core(trainer.params)), fresh)
    saved = jax.tree_util.tree_leaves(old)
    restored = jax.tree_util.tree_leaves(eqx.tree_at(core, trainer.params, None))
    assert len(saved) == len(restored)
    for a, b in zip(saved, restored, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    trainer.step(trainer.device_batch(np.zeros((run.batch, run.model.seq + 1), np.int32)))
