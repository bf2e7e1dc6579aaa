"""A partitioned program's collectives with the dtypes they move: how the tests and
`fp8jax.distributed` users check that weights and activations travel in FP8."""

from __future__ import annotations

import os
import re
import tempfile
from typing import Any, NamedTuple


class Collective(NamedTuple):
    """One collective of a partitioned program (`parse_collectives` makes them).

    Arguments:
        kind: ``all-gather``, ``all-reduce``, ``reduce-scatter``, ``all-to-all`` or
            ``collective-permute``.
        dtype: the element type(s) it moves, e.g. ``"f8e4m3fn"`` or ``"f32,f32"``.
        shape: its result shape(s), as HLO writes them.
        op_name: the JAX op it came from (HLO metadata), ``""`` if none.
    """

    kind: str  # all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute
    dtype: str  # element type(s) it moves, e.g. "f8e4m3fn" or "f32,f32"
    shape: str  # result shape(s) as HLO writes them
    op_name: str  # the JAX op it came from (metadata), "" if none


_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%?[\w.-]+ = (.*?) "
    r"(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


def parse_collectives(hlo_text: str) -> list[Collective]:
    """Collectives in HLO text, with the dtypes they move.

    Arguments:
        hlo_text: HLO text (a partitioned or compiled module).

    Returns:
        A list of `Collective`, in program order.
    """
    out = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        shapes = re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
        name = re.search(r'op_name="([^"]*)"', line)
        out.append(
            Collective(
                m.group(2),
                ",".join(d for d, _ in shapes),
                ",".join(f"[{s}]" for _, s in shapes),
                name.group(1) if name else "",
            )
        )
    return out


def hlo_collectives(lowered: Any) -> list[Collective]:
    """The collectives of a lowered program (``jax.jit(f).lower(...)`` or equinox's) as
    XLA's SPMD partitioner made them: their dtypes before a backend's own rewrites (the
    CPU backend carries FP8 collectives as f16; GPUs move FP8).

    Arguments:
        lowered: a lowered program (``jax.jit(step).lower(...)``), sharded over a mesh.

    Returns:
        A list of `Collective` (empty on one device).
    """
    return compile_with_collectives(lowered)[1]


def compile_with_collectives(lowered: Any) -> tuple[Any, list[Collective]]:
    """``lowered`` compiled, and its collectives as `hlo_collectives` lists them (one
    compilation for both).

    Arguments:
        lowered: a lowered program (jax's or equinox's ``.lower(...)``).

    Returns:
        ``(compiled, collectives)``: the compiled program and its list of `Collective`.
    """
    lowered = getattr(lowered, "lowered", lowered)
    with tempfile.TemporaryDirectory() as d:
        # A persistent-cache hit would skip the passes and write no dump. JAX leaves the
        # dump options out of the cache key but not xla_dump_emitter_re (dumps only): a
        # pattern naming this call's directory makes the key new.
        options = {"xla_dump_to": d, "xla_dump_hlo_pass_re": "spmd-partitioning"}
        options["xla_dump_emitter_re"] = "fp8jax-no-emitter-" + os.path.basename(d)
        try:
            compiled = lowered.compile(compiler_options=options)
        except Exception as e:  # an XLA without the option: compile as before
            if "xla_dump_emitter_re" not in str(e):
                raise
            del options["xla_dump_emitter_re"]
            compiled = lowered.compile(compiler_options=options)
        names = sorted(n for n in os.listdir(d) if "after_spmd-partitioning" in n)
        if not names:  # one device: nothing to partition
            return compiled, parse_collectives(compiled.as_text())
        with open(os.path.join(d, names[-1])) as f:
            return compiled, parse_collectives(f.read())
