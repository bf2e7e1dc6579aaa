"""The trainer's FP8 census: how many of the train step's GEMM calls run in FP8.

On a CPU, XLA runs FP8 dots as upcasts to f32: the compiled program has no FP8 GEMM left
(the trainer used to report "0 of 21"). There the census reads the lowered program, as
``fp8jax-demo`` does, which shows what a GPU compiles; elsewhere the compiled one. The
lowered program calls shared private functions (one ``fp8_gemm_forward`` for several
layers): each call counts, as it does once XLA inlines them."""

from __future__ import annotations

import functools
import re

from ..inspect import GemmInfo, parse_gemms, parse_stablehlo_gemms

LOWERED = "lowered program: on CPU, XLA runs FP8 as upcasts"
COMPILED = "compiled program"

_FUNC = re.compile(r"^\s*func\.func\s+(?:public\s+|private\s+)?@([\w.$\-]+)", re.M)
_CALL = re.compile(r"\bcall @([\w.$\-]+)")


def lowered_gemm_calls(text: str) -> list[GemmInfo]:
    """The GEMMs a lowered (StableHLO) program runs from ``main``, each function's dots
    once per call of it (a loop body once, as in compiled HLO)."""
    starts = list(_FUNC.finditer(text))
    bodies = {
        m.group(1): text[m.start() : starts[i + 1].start() if i + 1 < len(starts) else len(text)]
        for i, m in enumerate(starts)
    }

    @functools.cache
    def gemms(name: str, depth: int = 0) -> tuple[GemmInfo, ...]:
        body = bodies.get(name, "")
        found = list(parse_stablehlo_gemms(body))
        if depth < 64:  # no recursion in jax's output; a guard all the same
            for callee in _CALL.findall(body):
                if callee in bodies and callee != name:
                    found += gemms(callee, depth + 1)
        return tuple(found)

    if "main" not in bodies:
        return parse_stablehlo_gemms(text)
    return list(gemms("main"))


def step_gemms(lowered, compiled, platform: str) -> tuple[list[GemmInfo], str]:
    """(the step's GEMM calls, which program they were counted in)."""
    if platform == "cpu":
        return lowered_gemm_calls(lowered.as_text()), LOWERED
    return parse_gemms(compiled.as_text()), COMPILED
