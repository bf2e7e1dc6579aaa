"""``fp8jax-train --processes N``: N trainer processes on this host, joined by
``jax.distributed`` (what ``--coordinator`` runs across hosts, started by one command).

The launcher starts no JAX backend itself. It picks a free localhost port for the
coordinator and starts ``python -m fp8jax.train <the same options> --coordinator
127.0.0.1:PORT --num-processes N --process-id i`` for each i < N: on a GPU host process i
on GPUs ``[i * G/N, (i + 1) * G/N)`` of the G visible (``$JAX_LOCAL_DEVICE_IDS``, read by
`mesh.initialize_distributed`: every GPU stays visible to CUDA, for NCCL's peer-to-peer
paths); on a host without GPUs, on the CPU (with ``$XLA_FLAGS``'s
``--xla_force_host_platform_device_count=K``, K devices each; jax's CPU collectives, gloo).

Output: process 0's stderr (the progress bar) passes through; the other lines come
prefixed ``[process i]``. A first Ctrl-C or SIGTERM is passed on as SIGTERM, JAX's
preemption notice: the processes agree on one step, checkpoint it and exit with status 130
(`interrupts.synchronize`); a second one kills them. When a process fails the others are
killed (they would wait for it in their next collective) and the launch fails naming it."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ._metering import gpu_count
from ._rundir import UsageError

COMMAND_ENV = "FP8JAX_LAUNCH_COMMAND"  # the launcher's command line, recorded by process 0
LAUNCHER_ENV = "FP8JAX_LAUNCHER_PID"  # `die_with_launcher`
INTERRUPTED = 130
# "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number ...": gloo (jax's CPU
# collectives) on stdout, for every communicator it connects; its threads' lines at times run
# into one another, hence a search for the end alone
_GLOO_NOISE = re.compile(r"is connected to \d+ peer ranks\. Expected number")


class LaunchError(RuntimeError):
    """A process of ``--processes`` failed; ``status`` is the launcher's exit status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def gpu_ids(processes: int) -> list[list[int]] | None:
    """Each process's GPU ordinals (None: no GPU to pin, the processes run on the CPU).
    The visible GPUs: ``$CUDA_VISIBLE_DEVICES``'s, else all NVML sees; none where
    ``$JAX_PLATFORMS`` names no GPU platform. Raises `UsageError` unless N divides them."""
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0  # CUDA stops at the first entry that is not a device
        for entry in visible.split(","):
            if not entry.strip() or entry.strip().startswith("-"):
                break
            count += 1
    else:
        count = gpu_count() or 0
    if not count:
        return None
    if count % processes:
        raise UsageError(
            f"--processes {processes}: {count} GPU{'s are' if count > 1 else ' is'} visible; "
            f"N must divide them (one process per GPU: --processes {count}; fewer GPUs: "
            "CUDA_VISIBLE_DEVICES)"
        )
    per = count // processes
    return [list(range(i * per, (i + 1) * per)) for i in range(processes)]


def child_argv(argv: list[str], option_strings: list[str]) -> list[str]:
    """``argv`` without ``--processes N`` (also ``--processes=N`` and the abbreviations
    argparse accepts, such as ``--processe N``)."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        name, eq, _ = token.partition("=")
        if name.startswith("--") and len(name) > 2:
            matches = [o for o in option_strings if o.startswith(name)]
            if name == "--processes" or matches == ["--processes"]:
                skip = not eq
                continue
        out.append(token)
    return out


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_launcher() -> None:
    """In a process the launcher started (Linux): be killed (SIGKILL) when the launcher dies,
    so that a killed launcher leaves no process holding a GPU. (Set here, not between fork
    and exec: JAX's threads make a fork that runs Python before exec unsafe.)"""
    launcher = os.environ.get(LAUNCHER_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(launcher):  # it died before that
        os.kill(os.getpid(), signal.SIGKILL)


def _env(gpus: list[int] | None, command: str) -> dict[str, str]:
    env = dict(os.environ)
    env[COMMAND_ENV], env[LAUNCHER_ENV] = command, str(os.getpid())
    if gpus is not None:
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(map(str, gpus))
    # the children import this fp8jax (a source checkout on sys.path included)
    root = str(Path(__file__).resolve().parents[2])
    if Path(root).name not in ("site-packages", "dist-packages"):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _forward(stream, prefix: str, out, lock: threading.Lock) -> None:
    """Copy ``stream``'s lines to ``out`` (``prefix`` before each), gloo's noise left out.
    Reads to the end even when ``out`` is closed (``| head``): a full pipe would stop the
    process writing to it."""
    for line in stream:
        if _GLOO_NOISE.search(line):
            continue
        with lock, contextlib.suppress(OSError, ValueError):
            out.write(prefix + line)
            out.flush()
    stream.close()


def _describe(status: int) -> str:
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


def launch(argv: list[str], processes: int, option_strings: list[str], command: str) -> int:
    """Run the trainer as ``processes`` processes (``argv``: the command line's options,
    ``--processes`` among them) and wait for them. Returns 0, or 130 when interrupted
    (Ctrl-C or SIGTERM: each process checkpointed); raises `LaunchError` when a process
    failed (the others are then killed), `UsageError` when N does not fit the GPUs."""
    gpus = gpu_ids(processes)
    port = _free_port()
    base = [sys.executable, "-m", "fp8jax.train", *child_argv(argv, option_strings)]
    base += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes)]
    children = [
        subprocess.Popen(
            [*base, "--process-id", str(i)],
            env=_env(gpus[i] if gpus else None, command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=None if i == 0 else subprocess.PIPE,  # process 0's bar draws on a terminal
            text=True,
            errors="replace",
            process_group=0,  # a terminal's Ctrl-C reaches the launcher only: it passes it on
        )
        for i in range(processes)
    ]
    lock, readers = threading.Lock(), []
    for i, child in enumerate(children):
        prefix = "" if i == 0 else f"[process {i}] "
        pipes = [(child.stdout, sys.stdout)] + ([(child.stderr, sys.stderr)] if i else [])
        for stream, out in pipes:
            reader = threading.Thread(target=_forward, args=(stream, prefix, out, lock))
            reader.daemon = True
            reader.start()
            readers.append(reader)
    signals = []  # the signals the launcher got

    def on_signal(signum, frame) -> None:
        signals.append(signum)
        how = signal.SIGTERM if len(signals) == 1 else signal.SIGKILL
        if len(signals) == 1:
            print(
                f"\nfp8jax-train: stopping the {processes} processes (each checkpoints the "
                "step they agree on; again to kill them)",
                file=sys.stderr,
                flush=True,
            )
        for c in children:
            with contextlib.suppress(ProcessLookupError):
                c.send_signal(how)  # (none to one that exited)

    try:
        with _handling(on_signal):
            failed = _wait(children)
    finally:
        for c in children:  # whatever happened (a KeyboardInterrupt elsewhere): none stays
            if c.poll() is None:
                c.kill()
                c.wait()
        for r in readers:
            r.join(timeout=5)
    if failed is None:  # 130: the processes agreed on a step to stop at (a SIGTERM to one)
        interrupted = signals or any(c.returncode == INTERRUPTED for c in children)
        return INTERRUPTED if interrupted else 0
    i, status, stopped = failed
    if signals and -status in (signal.SIGTERM, signal.SIGKILL):
        return INTERRUPTED  # stopped as asked (SIGTERM before JAX's service listened)
    message = f"fp8jax-train --processes {processes}: process {i} {_describe(status)}"
    if i:
        message += f" (its output: the lines marked [process {i}])"
    if stopped:
        ids = ", ".join(map(str, stopped))
        message += f"; stopped process{'es' if len(stopped) > 1 else ''} {ids}"
    raise LaunchError(message, status if status > 0 else 128 - status)


@contextlib.contextmanager
def _handling(handler):
    """``handler`` for SIGINT and SIGTERM (main thread only: elsewhere none can be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _wait(children: list[subprocess.Popen]) -> tuple[int, int, list[int]] | None:
    """Wait for every child; at the first that fails, kill the others. Returns that one's
    process id and exit status and the ids of those killed, or None when all exited with
    status 0 or 130 (stopped at the step they agreed on: the others may still be writing)."""
    while True:
        statuses = [c.poll() for c in children]
        bad = [(i, s) for i, s in enumerate(statuses) if s not in (None, 0, INTERRUPTED)]
        if bad:
            stopped = [i for i, c in enumerate(children) if c.poll() is None]
            for i in stopped:
                children[i].kill()
            for c in children:
                c.wait()
            return (*bad[0], stopped)
        if None not in statuses:
            return None
        time.sleep(0.05)
