"""What XLA scheduled beside each collective of a compiled step (its ``compiled.as_text()``).

A profile (`benchmarks.comm_profile`) says how long the step waits for its collectives; the
scheduled program says why. On a GPU, XLA makes every collective asynchronous (a ``*-start``
and a ``*-done``), its latency-hiding scheduler moves independent work between the two, and a
pair with nothing between them becomes a synchronous collective again. `collective_schedule`
sorts each collective of the program into:

- ``sync``: a synchronous collective (nothing could run beside it);
- ``alone``: async, with only bookkeeping (tuples, bitcasts, parameters) between;
- ``other``: async, with XLA's own fusions between, but no library call;
- ``kernel``: async, with a library call between: a cuBLAS GEMM, a cuDNN call, or one of
  our Pallas / Mosaic GPU kernels.

In the twenty-eighth session's 1b ``tensor=2`` FP8 step, 50 of 64 reduce-scatters were
``sync``, where 38 of bf16's 40 were ``kernel`` (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import collections
import re

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
CLASSES = ("sync", "alone", "other", "kernel")
# what fills no time on the GPU between a start and its done
_BOOKKEEPING = {
    "get-tuple-element",
    "tuple",
    "bitcast",
    "parameter",
    "constant",
    "copy-start",
    "copy-done",
}
_LIBRARY = ("__cublas", "__cudnn", "__gpu$xla.gpu.triton", "mosaic_gpu")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OP = re.compile(r"[\]\}\)]\s+([a-z][a-z0-9\-]*)\(")


def _op(rhs: str) -> str:
    """The opcode of an instruction's right-hand side (after its shape)."""
    m = _OP.search(rhs)
    return m.group(1) if m else ""


def _computations(text: str) -> dict[str, list[tuple[str, str]]]:
    """``name -> [(instruction, right-hand side), ...]`` in program (schedule) order."""
    comps: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if (
            stripped.endswith("{")
            and not line.startswith(" ")
            and "=" not in stripped.split("(")[0]
        ):
            current = stripped.split()[1 if stripped.startswith("ENTRY") else 0].lstrip("%")
            comps[current] = []
        elif stripped == "}":
            current = None
        elif current is not None:
            m = _INSTR.match(line)
            if m:
                comps[current].append((m.group(1), m.group(2)))
    return comps


def _callee(rhs: str) -> str | None:
    """The computation an ``async-start`` wraps (its ``calls=``)."""
    m = re.search(r"calls=%?([\w.\-]+)", rhs)
    return m.group(1) if m else None


def _kind(op: str, rhs: str, comps: dict) -> str | None:
    """The collective kind of a ``*-start`` (an ``async-start``: of the op it wraps)."""
    base = op.removesuffix("-start")
    if base in KINDS:
        return base
    if op == "async-start":
        body = comps.get(_callee(rhs) or "", [])
        return next((k for _, r in body if (k := _op(r)) in KINDS), None)
    return None


def _between(body: list[tuple[str, str]]) -> str:
    """The class of what lies between a start and its done."""
    ops = [(_op(rhs), rhs) for _, rhs in body]
    if any(op == "custom-call" and any(t in rhs for t in _LIBRARY) for op, rhs in ops):
        return "kernel"
    if any(op not in _BOOKKEEPING and not op.endswith(("-start", "-done")) for op, _ in ops):
        return "other"
    return "alone"


def collective_schedule(text: str) -> dict[str, dict[str, int]]:
    """Per collective kind, how many of the scheduled program's collectives fall in each of
    `CLASSES` (kinds with none are left out).

    Arguments:
        text: a compiled step's ``as_text()`` (a scheduled HLO module).

    Returns:
        ``{"reduce-scatter": {"sync": 50, "alone": 0, "other": 8, "kernel": 6}, ...}``.
    """
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    comps = _computations(text)
    wrapped = {
        _callee(rhs) for body in comps.values() for _, rhs in body if _op(rhs) == "async-start"
    }
    for name, body in comps.items():
        if name in wrapped:  # an async op's body: counted at its start and done
            continue
        starts: dict[str, tuple[int, str]] = {}
        for i, (inst, rhs) in enumerate(body):
            op = _op(rhs)
            if op in KINDS:
                counts[op]["sync"] += 1
            elif op.endswith("-start") and (kind := _kind(op, rhs, comps)):
                starts[inst] = (i, kind)
            elif op.endswith("-done"):
                m = re.search(r"-done\(\s*%([\w.\-]+)", rhs)
                if m and m.group(1) in starts:
                    j, kind = starts.pop(m.group(1))
                    counts[kind][_between(body[j + 1 : i])] += 1
    return {k: {c: counts[k][c] for c in CLASSES} for k in KINDS if counts[k]}
