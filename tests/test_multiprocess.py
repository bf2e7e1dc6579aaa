"""``fp8jax-train --processes N`` on the CPU: two processes (jax.distributed over gloo, two host
devices each) train as one process on four devices does, a Ctrl-C to the launcher stops both at
one step with a checkpoint, which resumes in one process on another mesh; a process that fails
fails the launch, naming it."""

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from fp8jax.train import _cli as cli, _launch as launch, _loop as loop
from fp8jax.train._data import load_corpus
from fp8jax.train._mesh import make_mesh, parse_mesh

pytestmark = pytest.mark.skipif(
    jax.devices()[0].platform != "cpu" or len(jax.devices()) != 8,
    reason="CPU test (8 host devices: conftest's XLA_FLAGS): the launched processes run on host "
    "devices",
)

ARGS = ["--dim", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--ffn", "64",
        "--seq", "32", "--batch", "8", "--eval-batches", "2", "--max-bytes", "300000",
        "--lr", "3e-3", "--steps", "10", "--eval-every", "3", "--checkpoint-every", "2",
        "--precision", "fp8", "--quiet", "--no-plot", "--no-tensorboard",
        "--no-compile-cache"]  # fmt: skip
# Two processes against one, on the same data=2,fsdp=2 mesh: the same program, its collectives
# run by gloo across the processes instead of within one, summing in another order. Measured
# (jax 0.10.2, 2 cores): step 1's loss 8e-8 apart (relative), steps 2-3 equal, val loss 4e-8.
TWO_RTOL = 1e-6
# After the restore on fsdp=8 (one process) against data=2,fsdp=2: other partial sums in bf16
# compute, as tests/test_train_mesh.py's LOSS_RTOL.
MESH_RTOL = 1e-3


@pytest.fixture
def host_devices(monkeypatch):
    """The launched processes see ``k`` host devices each (this process keeps its 8) and no
    GPU."""

    def set_devices(k: int) -> None:
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                       os.environ.get("XLA_FLAGS", ""))
        # first: XLA stops reading the flags at conftest's bare intra_op_parallelism_threads=1
        monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count={k} {flags}")
        monkeypatch.setenv("JAX_PLATFORMS", "cpu")

    return set_devices


def _ctrl_c_when(path: Path, done: threading.Event) -> threading.Thread:
    """A thread that sends this process SIGINT (as a terminal's Ctrl-C) once ``path`` exists."""

    def watch():
        while not done.is_set():
            if path.exists():
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_two_processes_match_one_stop_together_and_resume_in_one(tmp_path, host_devices, capfd):
    """Two processes x 2 host devices (``--processes 2 --mesh data=2,fsdp=2``), Ctrl-C after
    the step-2 checkpoint: both stop after one step K (JAX's preemption service agrees on it),
    checkpoint it and exit 130; every loss up to K equals the one-process 4-device run's.
    Process 0 alone wrote the run's files. The checkpoint, written by two processes, restores
    in one process on fsdp=8 and continues as the one-process run continues from its own."""
    host_devices(2)
    out = tmp_path / "two"
    done = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *a: None)  # a late Ctrl-C: no KeyboardInterrupt
    try:
        _ctrl_c_when(out / "ckpt-fp8" / "2", done)
        two = cli.main(ARGS + ["--processes", "2", "--mesh", "data=2,fsdp=2", "--out", str(out)])
    finally:
        done.set()
        signal.signal(signal.SIGINT, previous)
    two = two["fp8"]
    stop = two["steps"]
    err = capfd.readouterr().err
    assert two["interrupted"] and 2 < stop < 10, (stop, err[-3000:])
    assert cli._interrupted_now  # the command line exits with 130
    assert f"interrupted: checkpoint of fp8 step {stop} written" in err, err[-3000:]
    assert "stopping the 2 processes" in err
    assert sorted(p.name for p in (out / "ckpt-fp8").iterdir())[-1] == str(stop)
    # the run's files, once each (no process's temporary file left), the command as launched
    names = sorted(p.name for p in out.iterdir())
    assert names == ["ckpt-fp8", "fp8jax-run.json", "history-fp8.json", "metrics.csv",
                     "metrics.json", "result-fp8.json", "summary.md"], names  # fmt: skip
    meta = json.loads((out / "metrics.json").read_text())["meta"]
    assert meta["processes"] == 2 and meta["devices"] == 4, meta
    assert meta["mesh"] == "data=2,fsdp=2,tensor=1" and "--processes 2" in meta["command"]
    assert "--process-id" not in json.loads((out / "fp8jax-run.json").read_text())["runs"]["fp8"][
        "command"]  # fmt: skip

    # One process, 4 of this process's devices, the same mesh.
    run = cli.run_config(cli.parse_args(ARGS))
    corpus = load_corpus(max_bytes=300_000)
    mesh = make_mesh(parse_mesh("data=2,fsdp=2", 4), devices=jax.devices()[:4])
    ref = loop.train(run, "fp8", corpus, tmp_path / "ref", quiet=True, tensorboard=False,
                     mesh=mesh, interrupt_at=stop)  # fmt: skip
    got, want = [h["loss"] for h in two["history"]], [h["loss"] for h in ref["history"]]
    assert [h["step"] for h in two["history"]] == list(range(1, stop + 1))
    np.testing.assert_allclose(got, want, rtol=TWO_RTOL)
    np.testing.assert_allclose(two["val_loss"], ref["val_loss"], rtol=TWO_RTOL)

    # Both checkpoints resume in one process on fsdp=8 (the two-process one through --resume).
    resumed = cli.main(ARGS + ["--mesh", "fsdp=8", "--out", str(out), "--resume"])["fp8"]
    fsdp8 = make_mesh(parse_mesh("fsdp=8"))
    ref_resumed = loop.train(run, "fp8", corpus, tmp_path / "ref", resume=True, quiet=True,
                             tensorboard=False, mesh=fsdp8)  # fmt: skip
    assert [h["step"] for h in resumed["history"]] == list(range(1, 11))
    assert [h["loss"] for h in resumed["history"]][:stop] == got  # the restored history
    np.testing.assert_allclose([h["loss"] for h in resumed["history"]],
                               [h["loss"] for h in ref_resumed["history"]], rtol=MESH_RTOL)
    np.testing.assert_allclose(resumed["val_loss"], ref_resumed["val_loss"], rtol=MESH_RTOL)
    assert not resumed["interrupted"] and resumed["steps"] == 10


def _kill_process_1(parent: int, done: threading.Event) -> threading.Thread:
    """A thread that SIGKILLs ``parent``'s child started with ``--process-id 1``."""

    def find():
        for proc in Path("/proc").iterdir():
            try:
                stat = (proc / "stat").read_text()
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == parent and b"--process-id" in argv:
                if argv[argv.index(b"--process-id") + 1] == b"1":
                    return int(proc.name)
        return None

    def kill():
        while not done.is_set():
            pid = find()
            if pid is not None:
                time.sleep(1.0)  # started: now kill it
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def test_a_failed_process_fails_the_launch_naming_it(tmp_path, host_devices, capfd):
    """A process that exits non-zero (here: a --mesh its processes' 4 devices cannot take, found
    only once JAX has started) or is killed ends the launch: the others are killed and the
    launcher fails naming the process (on the command line: that status, or 128 + signal)."""
    host_devices(2)
    with pytest.raises(launch.LaunchError, match=r"--processes 2: process [01] exited with status "
                                                 "2") as failed:  # fmt: skip
        cli.main(ARGS + ["--processes", "2", "--mesh", "data=3", "--out", str(tmp_path / "a")])
    assert failed.value.status == 2
    err = capfd.readouterr().err
    assert "error: --mesh 'data=3': the axis sizes multiply to 3, but 4 devices" in err
    done = threading.Event()
    _kill_process_1(os.getpid(), done)
    try:
        message = r"process 1 was killed by SIGKILL \(its output: the lines marked \[process 1\]\)"
        with pytest.raises(launch.LaunchError, match=message + "; stopped process 0$") as killed:
            cli.main(ARGS + ["--processes", "2", "--out", str(tmp_path / "b")])
    finally:
        done.set()
    assert killed.value.status == 128 + signal.SIGKILL


def test_processes_options_checked_before_any_process_starts(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="--processes 2 starts and joins its processes itself"):
        cli.main(ARGS + ["--processes", "2", "--process-id", "0", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--interleave"):  # the trainer's own checks, once
        cli.main(ARGS + ["--processes", "2", "--interleave", "-1", "--out", str(tmp_path)])
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(ValueError, match="--processes 2: 3 GPUs are visible; N must divide them"):
        cli.main(ARGS + ["--processes", "2", "--out", str(tmp_path)])
    assert launch.gpu_ids(3) == [[0], [1], [2]]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert launch.gpu_ids(2) == [[0, 1], [2, 3]]  # ordinals among the visible GPUs
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert launch.gpu_ids(2) is None
    options = list(cli._parser()._option_string_actions)
    for argv in (["--processes", "2", "--steps", "3"], ["--processes=2", "--steps", "3"],
                 ["--processe", "2", "--steps", "3"]):  # fmt: skip
        assert launch.child_argv(argv, options) == ["--steps", "3"], argv
    assert not list(tmp_path.iterdir())
