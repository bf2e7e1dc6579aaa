"""The largest batch that fits, found by compiling only (`benchmarks.distributed` and
`benchmarks.memory`'s ``--max-batch``): a secant and bisection search over a step's
compiled bytes, and the record of a search that was cut short."""

from __future__ import annotations

import signal

import jax

from fp8jax.train._memory import compiled_bytes
from fp8jax.train._mesh import batch_size_per_shard

MAX_BATCH_STEPS = 2**16  # --max-batch gives up above this many sequences per rank


def batch_bytes(compile_batch, dp: int):
    """``batch -> bytes`` for `search_row`: `compiled_bytes` of ``compile_batch(batch)``
    (the step compiled for that global batch; the donated state counted once). It gives up
    above `MAX_BATCH_STEPS` sequences per rank and where the backend has no memory
    analysis."""

    def nbytes(batch: int) -> int:
        if batch > dp * MAX_BATCH_STEPS:
            raise RuntimeError(f"--max-batch: {batch} sequences would fit; raise the limit")
        found = compiled_bytes(compile_batch(batch), donated=True)
        if found is None:
            raise RuntimeError("--max-batch: this backend has no compiled memory analysis")
        return found

    return nbytes


class SearchCut(Exception):
    """`search_batch` interrupted (Ctrl-C; SIGTERM, as ``timeout`` sends it, under
    ``--max-batch``): what it had found (``fit``, ``over``: None where nothing was over yet,
    ``found``)."""

    def __init__(self, fit: int, over: int | None, found: dict[int, int]):
        super().__init__(f"--max-batch: cut after {len(found)} compiles: at least {fit} fit")
        self.fit, self.over, self.found = fit, over, found


def search_row(nbytes, dp: int, limit: int, start: int | None = None) -> dict:
    """`search_batch` as a record's fields. A search that was cut (`SearchCut`) still gives
    its row, with ``max_batch`` the largest batch that fit so far (a lower bound) and
    ``max_batch_complete`` False: a long probe cut by a timeout keeps what it measured."""
    try:
        (fit, over, found), complete = search_batch(nbytes, dp, limit, start), True
    except SearchCut as cut:
        print(cut, flush=True)
        fit, over, found, complete = cut.fit, cut.over, cut.found, False
    return dict(
        max_batch=fit,
        max_batch_mem_mb=found[fit] / 2**20 if fit else None,
        next_mem_mb=None if over is None else found[over] / 2**20,
        compiles=len(found),
        max_batch_complete=complete,
    )


def interrupt_on_sigterm() -> None:
    """SIGTERM (``timeout``'s signal) raises KeyboardInterrupt in this process, once the
    current compile returns: a cut ``--max-batch`` search then writes its row."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def search_batch(
    nbytes, dp: int, limit: int, start: int | None = None
) -> tuple[int, int, dict[int, int]]:
    """The largest multiple of ``dp`` whose ``nbytes(batch)`` is at most ``limit``, that
    plus ``dp`` (over it), and the bytes of each batch tried; by the search `max_batch`
    describes, from ``start`` (rounded down to a multiple of ``dp``; None: ``dp``)."""
    found: dict[int, int] = {}

    def fits(batch: int) -> bool:
        found[batch] = nbytes(batch)
        verdict = "fits" if found[batch] <= limit else "over"
        print(f"--max-batch: batch {batch}: {found[batch] / 2**20:,.0f} MiB, {verdict}", flush=True)
        return found[batch] <= limit

    batch = dp if start is None else max(dp, start // dp * dp)
    fit, over, bisected = 0, None, False
    while True:
        width = None if over is None else over - fit
        try:
            fit, over = (batch, over) if fits(batch) else (fit, batch)
        except KeyboardInterrupt:
            raise SearchCut(fit, over, dict(found)) from None
        if over is not None and over - fit <= dp:  # over == dp: not even dp fits
            return fit, over, found
        bisected = width is not None and not bisected and 2 * (over - fit) > width
        batch = _middle(fit, over, dp) if bisected else _secant(found, fit, over, dp, limit)


def _middle(fit: int, over: int, dp: int) -> int:
    return fit + (over - fit) // (2 * dp) * dp


def _secant(found: dict[int, int], fit: int, over: int | None, dp: int, limit: int) -> int:
    """The multiple of ``dp`` strictly between ``fit`` and ``over`` (or above ``fit``)
    where the line through ``fit``'s bytes and ``over``'s (or the two largest batches that
    fit) meets ``limit``; twice ``fit`` where no rising line is known (the middle of ``0,
    over`` where nothing fits yet: a search that started above the answer)."""
    if fit == 0:
        return _middle(fit, over, dp)
    if over is not None:
        (b1, m1), (b2, m2) = (fit, found[fit]), (over, found[over])
    else:
        fitting = sorted(b for b in found if found[b] <= limit)
        if len(fitting) < 2:
            return 2 * fit
        (b1, m1), (b2, m2) = ((b, found[b]) for b in fitting[-2:])
    if m2 <= m1:
        return _middle(fit, over, dp) if over is not None else 2 * fit
    target = int(b1 + (limit - m1) * (b2 - b1) / (m2 - m1)) // dp * dp
    return max(target, fit + dp) if over is None else min(max(target, fit + dp), over - dp)


def memory_limit(gb: float | None) -> int:
    """Bytes of one device's memory: ``gb`` GiB if given, else the GPU's ``bytes_limit``."""
    if gb is not None:
        return int(gb * 2**30)
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        raise ValueError("--max-batch: this device reports no memory limit; give --memory-limit-gb")
    return int(stats["bytes_limit"])


def batch_unit(mesh, sequence_parallel: bool) -> int:
    """The step of a search on ``mesh`` (None: one device): one sequence per batch shard,
    times the tensor axis under sequence parallelism, where more than one sequence per batch
    shard splits over it as whole sequences (`fp8jax.sequence_sharding`)."""
    if mesh is None:
        return 1
    dp = batch_size_per_shard(mesh)
    return dp * mesh.shape["tensor"] if sequence_parallel else dp
