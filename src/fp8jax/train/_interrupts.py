"""Ctrl-C (SIGINT) during training, acted on between steps.

Python raises KeyboardInterrupt wherever the main thread happens to be: inside the read of
a step's loss (that step's metrics were then lost from the history) or between a step and
its bookkeeping. While `deferred` is active, SIGINT only sets a flag; the training loop
checks it before each step (`check`) and stops there, with every step it ran recorded.
A second Ctrl-C raises at once (for a loop that does not reach its next step).

Several processes training one model (``jax.distributed``) must all stop after the same
step, or one would wait forever in a collective the others left: there (`synchronize`)
SIGINT becomes SIGTERM, JAX's preemption notice, and `check` asks JAX's preemption
service, which agrees on one step for all processes, whichever of them got the signal."""

from __future__ import annotations

import contextlib
import os
import signal
import threading


class Interrupted(KeyboardInterrupt):
    """Raised by `check` between steps: the run's state is whole, so it is checkpointed."""


_requested = False
_sync_point = None  # `synchronize`: several processes stop at one agreed step
_calls = 0  # `check` calls in this process (the same sequence in every process)


def _handle(signum, frame) -> None:
    global _requested
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the second one raises
    if _sync_point is not None:  # a preemption notice for all processes (`synchronize`)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    _requested = True


def synchronize() -> None:
    """This process trains with others (``jax.distributed``): from now on `check` stops
    where JAX's preemption service says (``reached_preemption_sync_point``: once any process
    got SIGTERM, the step after the furthest one's, the same in all), and SIGINT is sent on
    as SIGTERM. Without the service (``jax_enable_preemption_service`` off) SIGTERM ends
    the process, and with it the run (``--processes``: all its processes)."""
    global _sync_point
    from jax.experimental import multihost_utils

    try:
        multihost_utils.reached_preemption_sync_point(0)
        _sync_point = multihost_utils.reached_preemption_sync_point
    except RuntimeError:  # the service is off: no step is agreed on
        _sync_point = lambda call: False  # noqa: E731


def check() -> None:
    """Raise `Interrupted` if SIGINT came since `deferred` began (several processes: once
    all have reached the step JAX's preemption service agreed on)."""
    global _requested, _calls
    if _sync_point is not None:
        _calls += 1  # step ids must grow by one per call, in every process alike
        if _sync_point(_calls):
            raise Interrupted
        return
    if _requested:
        _requested = False
        raise Interrupted


def clear() -> None:
    """Forget a request (one left by an earlier run in this process)."""
    global _requested
    _requested = False


def requested() -> bool:
    """Whether SIGINT came and `check` has not raised for it yet (several processes: False;
    only `check` knows, at the agreed step)."""
    return _requested


@contextlib.contextmanager
def deferred():
    """SIGINT sets a flag `check` reads (main thread only: elsewhere signals cannot be
    handled, and nothing changes). A request that no `check` met stays `requested` after."""
    global _requested
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _requested = False
    previous = signal.signal(signal.SIGINT, _handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous or signal.default_int_handler)
