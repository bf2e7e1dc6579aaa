"""Exposed communication from a profile: the time per step when a collective (NCCL) kernel
runs on a GPU and no compute kernel runs beside it on any of that GPU's streams.

A step whose all-gathers and reduce-scatters run under GEMMs has ~0 exposed communication;
one that waits for them has their whole duration exposed. `profile_exposed_comm` traces a
few steps with `jax.profiler` and reads the device planes of the trace (``*.xplane.pb``).
"""

from __future__ import annotations

import glob
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax

Interval = tuple[int, int]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, non-overlapping intervals covering exactly the union of ``intervals``."""
    out: list[list[int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def covered(merged: list[Interval]) -> int:
    """Total length of merged intervals."""
    return sum(e - s for s, e in merged)


def intersection(a: list[Interval], b: list[Interval]) -> int:
    """Length of the intersection of two merged interval lists."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def exposed(comm: Iterable[Interval], compute: Iterable[Interval]) -> tuple[int, int]:
    """(exposed, total) communication time: the part of the collectives' union that no
    compute interval covers, and the whole union."""
    comm_m, compute_m = merge(comm), merge(compute)
    total = covered(comm_m)
    return total - intersection(comm_m, compute_m), total


def is_collective(kernel: str) -> bool:
    """Whether a GPU kernel is a collective's (NCCL's kernels: ``ncclDevKernel_*``,
    ``ncclKernel_*``)."""
    return "nccl" in kernel.lower()


def gpu_stream_events(trace_dir: str) -> Iterator[tuple[str, Any]]:
    """``(GPU plane name, event)`` of every kernel on the GPUs' streams in the trace under
    ``trace_dir`` (its ``*.xplane.pb`` files)."""
    for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
        for plane in jax.profiler.ProfileData.from_file(path).planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                if "stream" in line.name.lower():
                    for event in line.events:
                        yield plane.name, event


def device_kernels(trace_dir: str) -> dict[str, list[tuple[str, int, int]]]:
    """``{GPU plane: [(kernel, start ns, end ns)]}`` of every kernel on the GPUs' streams."""
    out: dict[str, list[tuple[str, int, int]]] = {}
    for plane, e in gpu_stream_events(trace_dir):
        start = int(e.start_ns)
        out.setdefault(plane, []).append((e.name, start, start + int(e.duration_ns)))
    return out


def exposed_comm_ms(trace_dir: str, steps: int) -> tuple[float, float] | None:
    """(exposed, total) collective ms per step, the mean over the trace's GPUs; None without
    GPU planes (a CPU run)."""
    per_device = []
    for kernels in device_kernels(trace_dir).values():
        comm = [(s, e) for name, s, e in kernels if is_collective(name)]
        compute = [(s, e) for name, s, e in kernels if not is_collective(name)]
        per_device.append(exposed(comm, compute))
    if not per_device:
        return None
    mean = [sum(v[i] for v in per_device) / len(per_device) / steps / 1e6 for i in (0, 1)]
    return mean[0], mean[1]


def profile_exposed_comm(run_step: Callable[[], object], steps: int = 3):
    """``run_step()`` ``steps`` times under the profiler (it must block until its step is
    done); returns `exposed_comm_ms` of the trace."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                run_step()
        return exposed_comm_ms(trace_dir, steps)
