"""Dump and summarize the compiled HLO of one linear train step (bf16 or fp8jax).

    python -m benchmarks.hlo --shape 16384,4096,14336 --variant fp8jax-delayed --out /tmp/step.hlo

Prints the GEMMs (`fp8jax.fp8_gemm_report`) and the kernels XLA launches (fusions,
custom calls, copies/transposes), so that memory passes can be counted.
"""

from __future__ import annotations

import argparse
import collections
import math
import re

import jax

import fp8jax
from benchmarks import linear
from fp8jax.inspect import parse_gemms


def _entry(hlo_text: str) -> str:
    """The entry computation of an HLO module's text (all of it if it has none)."""
    entry = hlo_text[hlo_text.index("ENTRY") :] if "ENTRY" in hlo_text else hlo_text
    return entry.split("\n}\n")[0]


def kernel_summary(hlo_text: str) -> collections.Counter:
    """Count the top-level ops of the entry computation that launch work."""
    entry = _entry(hlo_text)
    counts = collections.Counter()
    for line in entry.splitlines():
        m = re.search(r"=\s*[^=]*?\s([a-z\-]+)\(", line)
        if not m:
            continue
        op = m.group(1)
        if op in ("parameter", "get-tuple-element", "tuple", "bitcast", "constant"):
            continue
        if op == "custom-call":
            op += ":" + re.search(r'custom_call_target="([^"]+)"', line).group(1)
        if op == "fusion":
            kind = re.search(r"kind=(\w+)", line)
            op += ":" + (kind.group(1) if kind else "?")
        counts[op] += 1
    return counts


_ARRAY = re.compile(r"(f8e4m3fn|f8e5m2|bf16|f16|f32)\[([\d,]*)\]")


def big_writes(hlo_text: str, min_elements: int) -> list[tuple[str, str, list[str]]]:
    """``(name, op, ["dtype[elements]", ...])`` for each top-level instruction of the
    entry computation that writes an array of at least ``min_elements`` elements:
    the memory passes over activation-sized data, and the dtype each one writes."""
    entry = _entry(hlo_text)
    out = []
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\(", line)
        if not m or m.group(3) in (
            "parameter",
            "get-tuple-element",
            "bitcast",
            "tuple",
            "constant",
        ):
            continue
        sizes = [
            (dtype, math.prod(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(m.group(2))
        ]
        big = [f"{dtype}[{n}]" for dtype, n in sizes if n >= min_elements]
        if big:
            target = re.search(r'custom_call_target="([^"]+)"', line)
            out.append((m.group(1), m.group(3) + (":" + target.group(1) if target else ""), big))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", type=linear.parse_shape, default=(16384, 4096, 14336))
    parser.add_argument("--variant", default="fp8jax-delayed", choices=linear.VARIANTS)
    parser.add_argument("--out", default=None, help="write the compiled HLO text here")
    args = parser.parse_args(argv)
    layer, xs, g = linear.make_inputs(args.shape)
    step = linear.BUILDERS[args.variant](layer, xs[0], g)
    text = step.hlo_text(xs[0], g)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(fp8jax.GemmReport(parse_gemms(text), jax.devices()[0].device_kind))
    counts = kernel_summary(text)
    device = jax.devices()[0].device_kind
    print(f"{sum(counts.values())} launches in the entry computation ({device}):")
    for op, n in counts.most_common():
        print(f"  {n:3d}  {op}")
    return counts


if __name__ == "__main__":
    main()
