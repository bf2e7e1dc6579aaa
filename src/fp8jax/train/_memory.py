"""What the trainer's step holds in device memory: the residuals its backward keeps
(`saved_residuals`, by tracing the loss) and the allocator's peak (`allocator_peak_bytes`).
Shared by the trainer's report and the benchmarks (``memory``, ``distributed``,
``profile_train``)."""

from __future__ import annotations

from collections.abc import Callable

import jax

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
    report = residuals_report(lambda m, b: loss(m, b), model, batch)
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
