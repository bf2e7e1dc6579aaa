"""Exposed communication from a profile: the time per step when a collective (NCCL) kernel
runs on a GPU and no compute kernel runs beside it on any of that GPU's streams.

A step whose all-gathers and reduce-scatters run under GEMMs has ~0 exposed communication;
one that waits for them has their whole duration exposed. `profile_step` traces a few
steps with `jax.profiler` and reads the device planes of the trace (``*.xplane.pb``) into
`breakdown_ms`: that, and where the rest of the step's time goes.
"""

from __future__ import annotations

import collections
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


KINDS = ("gemm", "attention", "collective", "other")


def kernel_kind(kernel: str) -> str:
    """``"collective"`` (NCCL), ``"gemm"`` (cuBLAS(Lt)/CUTLASS/nvjet GEMMs; our own GEMM
    kernels are named ``*gemm*``), ``"attention"`` (cuDNN's flash attention) or ``"other"``
    (elementwise, reductions, casts, copies)."""
    name = kernel.lower()
    if is_collective(name):
        return "collective"
    if any(k in name for k in ("sdpa", "flash", "fmha", "attention")):
        return "attention"
    if any(k in name for k in ("gemm", "nvjet", "xmma", "cutlass", "matmul")):
        return "gemm"
    return "other"


def breakdown_ms(kernels_by_gpu: dict, steps: int) -> dict[str, float] | None:
    """Where a step's time goes on its GPUs (mean over them, ms per step): ``gemm``,
    ``attention``, ``other`` (each the union of its kernels' intervals), ``exposed_comm``
    (collectives under no compute), ``comm`` (all collective time), ``idle`` (no kernel at
    all between the trace's first and last kernel) and ``span``, from `device_kernels`'
    ``kernels_by_gpu``. None without GPU planes (a CPU run)."""
    rows = []
    for kernels in kernels_by_gpu.values():
        by = {k: merge((s, e) for n, s, e in kernels if kernel_kind(n) == k) for k in KINDS}
        compute = merge(iv for k in ("gemm", "attention", "other") for iv in by[k])
        start, end = min(s for _, s, _ in kernels), max(e for _, _, e in kernels)
        busy = covered(merge(compute + by["collective"]))
        row = {k: covered(by[k]) for k in ("gemm", "attention", "other")}
        row["exposed_comm"], row["comm"] = exposed(by["collective"], compute)
        row["idle"], row["span"] = end - start - busy, end - start
        rows.append(row)
    if not rows:
        return None
    return {k: sum(r[k] for r in rows) / len(rows) / steps / 1e6 for k in rows[0]}


def top_kernels(
    kernels_by_gpu: dict, steps: int, kind: str | None = "other", n: int = 20
) -> list[tuple[str, float, float]]:
    """The ``n`` kernels of `kernel_kind` ``kind`` (None: of every kind) that take the most
    time, by name: ``(name, ms per step, launches per step)``, the mean over
    `device_kernels`' ``kernels_by_gpu``."""
    per_device = kernels_by_gpu
    ns, calls = collections.Counter(), collections.Counter()
    for kernels in per_device.values():
        for name, start, end in kernels:
            if kind is None or kernel_kind(name) == kind:
                ns[name] += end - start
                calls[name] += 1
    d = max(len(per_device), 1) * steps
    return [(name, t / d / 1e6, calls[name] / d) for name, t in ns.most_common(n)]


def collective_exposure(
    kernels_by_gpu: dict, steps: int, n: int = 20
) -> list[tuple[str, float, float, float]]:
    """The ``n`` collective kernels (by name, without their argument list) that take the most
    time: ``(name, ms per step, exposed ms per step, launches per step)``, the mean over
    `device_kernels`' ``kernels_by_gpu``. A kernel's exposed part is the time no compute
    kernel of its GPU covers (`exposed` of that kernel alone): which collectives the step
    waits for (a reduce-scatter feeding the next norm, say), not only how long all take."""
    total, shown, calls = collections.Counter(), collections.Counter(), collections.Counter()
    for kernels in kernels_by_gpu.values():
        compute = merge((s, e) for name, s, e in kernels if kernel_kind(name) != "collective")
        for name, start, end in kernels:
            if kernel_kind(name) == "collective":
                key = name.split("(")[0]
                total[key] += end - start
                shown[key] += exposed([(start, end)], compute)[0]
                calls[key] += 1
    d = max(len(kernels_by_gpu), 1) * steps
    return [
        (name, t / d / 1e6, shown[name] / d / 1e6, calls[name] / d)
        for name, t in total.most_common(n)
    ]


def profile_step(
    run_step: Callable[[], object], steps: int = 3, top: int = 0, kind: str | None = "other"
) -> dict[str, float] | None:
    """``run_step()`` ``steps`` times under the profiler (it must block until its step is
    done); returns `breakdown_ms` of the trace, and prints the ``top`` costliest kernels of
    ``kind`` (`top_kernels`; None: every kind) and the collectives with their exposed time
    (`collective_exposure`) when ``top`` > 0."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                run_step()
        kernels = device_kernels(trace_dir)  # the trace read once for both
    for name, ms, calls in top_kernels(kernels, steps, kind, n=top) if top else ():
        label = kind or kernel_kind(name)
        print(f"  {label} {ms:8.3f} ms/step  x{calls:<6.1f} {name[:110]}", flush=True)
    for name, ms, shown, calls in collective_exposure(kernels, steps, n=top) if top else ():
        print(f"  collective {ms:8.3f} ms/step, {shown:8.3f} exposed  x{calls:<6.1f} {name[:90]}")
    return breakdown_ms(kernels, steps)
