"""What the trainer's step holds in device memory: the residuals its backward keeps
(`saved_residuals`, by tracing the loss), the allocator's peak (`allocator_peak_bytes`) and,
for ``--remat auto``, the compiled step's bytes against the device's limit (`choose_remat`).
Shared by the trainer's report and the benchmarks (``memory``, ``distributed``,
``profile_train``)."""

from __future__ import annotations

import os
from collections.abc import Callable

import jax
import numpy as np

from .._residuals import residuals_report

FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")


def saved_residuals(loss: Callable, model, batch) -> dict:
    """What the backward of ``loss(model, batch)`` keeps besides the parameters (held
    whatever the backward keeps), by tracing it (`fp8jax.residuals_report`: nothing is
    compiled or run). On a mesh the sizes are the global arrays' (all devices).

    Arguments:
        loss: ``(model, batch) -> scalar`` (the trainer's `lm_loss`).
        model: the model whose parameters are differentiated.
        batch: a token batch (an array).

    Returns:
        ``saved_residual_mb``: the total in MiB, and ``saved_residuals``: MiB by dtype name
        (largest first; they sum to the total).
    """
    report = residuals_report(loss, model, batch)
    by_dtype: dict[str, float] = {}
    for r in report.residuals:
        if r.kind != "argument":  # the parameters themselves
            by_dtype[str(r.dtype)] = by_dtype.get(str(r.dtype), 0.0) + r.nbytes / 2**20
    by_dtype = dict(sorted(by_dtype.items(), key=lambda kv: -kv[1]))
    return dict(saved_residual_mb=sum(by_dtype.values()), saved_residuals=by_dtype)


def saved_cell(total_mb: float | None, by_dtype: dict | None) -> str:
    """A table cell: the residuals' total MiB with the FP8 part, e.g. ``"1,234 (e4m3 312)"``
    (``"-"`` where unknown)."""
    if total_mb is None:
        return "-"
    fp8 = [
        f"{d.removeprefix('float8_').removesuffix('fn')} {_mb(mb)}"
        for d, mb in (by_dtype or {}).items()
        if d in FP8_DTYPES and mb > 0
    ]
    return _mb(total_mb) + (f" ({', '.join(fp8)})" if fp8 else "")


def _mb(v: float) -> str:
    return f"{v:,.0f}" if v >= 10 else f"{v:.1f}"


def allocator_peak_bytes(devices=None) -> int | None:
    """The allocator's peak bytes in use (``peak_bytes_in_use``), the largest over
    ``devices`` (default: this process's); None where the backend keeps no such count (the
    CPU). It is the process's peak so far: JAX cannot reset it."""
    devices = jax.local_devices() if devices is None else devices
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    return max(peaks) if peaks and None not in peaks else None


# ----------------------------------------------------------------------------- --remat auto
# The part of the device's memory limit ``--remat auto`` leaves free: the allocator's
# fragmentation and what the step's analysis does not count (the eval step's temporaries,
# the validation batches).
MARGIN = 0.05
# The limit's test hook, in GB (1e9 bytes): where set, the bytes a step may use as they are
# (no margin; nothing held is subtracted), on any backend. Read by `step_limit` only.
LIMIT_ENV = "FP8JAX_MEMORY_LIMIT_GB"


def compiled_bytes(compiled, donated: bool = False) -> int | None:
    """Device bytes a compiled step needs (XLA's memory analysis, per device): its
    arguments, outputs and temporaries, less the outputs that reuse a donated argument's
    buffer where ``donated`` (what it holds at its peak); None where the backend gives no
    analysis. Where this JAX's analysis names no aliased bytes they count twice (too high:
    ``--remat auto`` then recomputes sooner, never runs out)."""
    try:
        stats = compiled.memory_analysis()
        total = stats.argument_size_in_bytes + stats.output_size_in_bytes
        total += stats.temp_size_in_bytes
    except Exception:  # not every backend implements it
        return None
    aliased = (getattr(stats, "alias_size_in_bytes", 0) or 0) if donated else 0
    return int(total - aliased)


NO_LIMIT = "no device memory limit known"  # `step_limit`'s reason where it finds none


def step_limit(devices, argument_bytes: int) -> tuple[int | None, str]:
    """(the bytes a step may use per device, how it was found): the allocator's
    ``bytes_limit`` (the smallest of ``devices``) less `MARGIN` and less what other arrays
    already hold there (bytes in use beyond the step's own ``argument_bytes``: another
    precision's run under ``--interleave``); (None, why) where the backend knows no limit
    (the CPU). `LIMIT_ENV` overrides it. With several processes, the smallest of theirs."""
    hook = os.environ.get(LIMIT_ENV)
    if hook:
        return int(float(hook) * 1e9), f"{LIMIT_ENV}={hook}"
    stats = [d.memory_stats() or {} for d in devices]
    if not stats or any("bytes_limit" not in s for s in stats):
        return None, NO_LIMIT
    limit = min(s["bytes_limit"] for s in stats)
    held = max(max(s.get("bytes_in_use", 0) for s in stats) - argument_bytes, 0)
    usable = int(limit * (1 - MARGIN)) - held
    if jax.process_count() > 1:  # every process must choose the same program
        from jax.experimental import multihost_utils

        usable = int(np.min(multihost_utils.process_allgather(np.int64(usable))))
    how = f"{_gb(limit)} bytes_limit less {MARGIN:.0%}" + (
        f" and {_gb(held)} held by other arrays" if held >= 1e8 else ""
    )
    return usable, how


def choose_remat(compile_with: Callable, devices, choices) -> tuple[str, dict, str]:
    """``--remat auto``: the first of ``choices`` (`REMAT`'s order: less kept, more recomputed)
    whose compiled step fits `step_limit`; the last where none does.

    Arguments:
        compile_with: ``remat -> compiled step`` (the trainer rebuilt and compiled with it).
        devices: the devices the step runs on.
        choices: the choices to try in order, ``"none"`` first.

    Returns:
        (the choice, ``{choice: step bytes}`` of each one tried, one line saying why). With
        no limit known the first choice, not compiled here.
    """
    first = choices[0]
    tried: dict[str, int | None] = {}
    compiled = compile_with(first)
    tried[first] = compiled_bytes(compiled, donated=True)
    try:
        arguments = compiled.memory_analysis().argument_size_in_bytes
    except Exception:
        arguments = 0
    limit, how = step_limit(devices, arguments)
    if limit is None or tried[first] is None:
        why = how if limit is None else "no memory analysis of the step"
        return first, tried, f"--remat auto: {first} ({why})"
    chosen = first
    for remat in choices[1:]:
        if tried[chosen] is None or tried[chosen] <= limit:
            break
        chosen = remat  # the trainer is left compiled with the last one tried
        tried[remat] = compiled_bytes(compile_with(remat), donated=True)
    steps = ", ".join(f"{r} {_gb(b)}" for r, b in tried.items())
    line = f"--remat auto: {chosen} (step: {steps}; limit {_gb(limit)}: {how})"
    if tried[chosen] is None or tried[chosen] > limit:
        line += f"; even {chosen} does not fit: the step will likely run out of memory"
    return chosen, tried, line


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.1f} GB" if nbytes >= 1e8 else f"{int(nbytes):,} B"
