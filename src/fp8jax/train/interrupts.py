"""Ctrl-C (SIGINT) during training, acted on between steps.

Python raises KeyboardInterrupt wherever the main thread happens to be: inside the read of
a step's loss (that step's metrics were then lost from the history) or between a step and
its bookkeeping. While `deferred` is active, SIGINT only sets a flag; the training loop
checks it before each step (`check`) and stops there, with every step it ran recorded.
A second Ctrl-C raises at once (for a loop that does not reach its next step)."""

from __future__ import annotations

import contextlib
import signal
import threading


class Interrupted(KeyboardInterrupt):
    """Raised by `check` between steps: the run's state is whole, so it is checkpointed."""


_requested = False


def _handle(signum, frame) -> None:
    global _requested
    _requested = True
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the second one raises


def check() -> None:
    """Raise `Interrupted` if SIGINT came since `deferred` began."""
    global _requested
    if _requested:
        _requested = False
        raise Interrupted


def clear() -> None:
    """Forget a request (one left by an earlier run in this process)."""
    global _requested
    _requested = False


def requested() -> bool:
    """Whether SIGINT came and `check` has not raised for it yet."""
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
