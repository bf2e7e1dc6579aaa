"""See whether the GEMMs of a function really run in FP8, from its compiled HLO, and what
its backward keeps (`residuals_report`, `saved_activation_bytes`)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any, Callable

import equinox as eqx

from ._kernels.blockwise_gemm import BLOCKWISE_SCOPE
from ._ops.attention_mgpu import FLASH_SCOPE
from ._ops.grouped import GROUPED_SCOPE
from ._residuals import Residual, ResidualsReport, _nbytes, residuals_report

__all__ = [
    "GemmInfo",
    "GemmReport",
    "Residual",
    "ResidualsReport",
    "assert_fp8",
    "fp8_gemm_report",
    "parse_gemms",
    "parse_stablehlo_gemms",
    "residuals_report",
    "saved_activation_bytes",
]

_F8 = re.compile(r"\bf8e\w+")
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
_GEMM_TARGET = re.compile(r"cublas|gemm|matmul|triton_gemm|__cudnn\$", re.I)
_OUR_KERNEL = re.compile(r"fp8jax", re.I)


@dataclasses.dataclass(frozen=True)
class GemmInfo:
    """One matrix multiplication in a compiled program (`parse_gemms` makes them).

    Arguments:
        op: the HLO op: ``"custom-call"``, ``"dot"`` or ``"convolution"``.
        target: the custom call's target (``""`` for a plain dot).
        operand_types: the element types of its two operands (``"f8e4m3fn"``, ``"bf16"``).
        result_type: the element type of its result.
        is_fp8: whether it runs in FP8.
        line: its HLO line (the first 300 characters).
    """

    op: str  # "custom-call" or "dot" / "convolution"
    target: str  # custom-call target ("" for a plain dot)
    operand_types: tuple[str, ...]
    result_type: str
    is_fp8: bool
    line: str


@dataclasses.dataclass
class GemmReport:
    """Each GEMM of a compiled (or lowered) program, FP8 or not: what `fp8_gemm_report`
    returns; printing it gives one line per GEMM.

    Arguments:
        gemms: the program's GEMMs, in program order.
        platform: the backend it was compiled for (``"gpu"``, ``"cpu (lowered)"``, ...).
    """

    gemms: list[GemmInfo]
    platform: str

    @property
    def num_fp8(self) -> int:
        return sum(g.is_fp8 for g in self.gemms)

    @property
    def all_fp8(self) -> bool:
        return bool(self.gemms) and all(g.is_fp8 for g in self.gemms)

    def __str__(self) -> str:
        lines = [f"{len(self.gemms)} GEMMs on {self.platform}, {self.num_fp8} in FP8"]
        for g in self.gemms:
            kind = g.target or g.op
            lines.append(
                f"  {'FP8 ' if g.is_fp8 else 'HIGH'}  {kind:<28} "
                f"{', '.join(g.operand_types)} -> {g.result_type}"
            )
        return "\n".join(lines)

    __repr__ = __str__


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(\([^)]*\)|\S+)\s+([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"^\(?((?:f8e\w+|bf16|f16|f32|f64|s8|s32|u8|pred)\[[^\]]*\])")


def _element(shape: str) -> str:
    return shape.split("[", 1)[0]


def parse_gemms(hlo_text: str) -> list[GemmInfo]:
    """GEMMs in compiled HLO text: cuBLAS/cuBLASLt custom calls, XLA-generated GEMM
    fusions (Triton / cuDNN) and plain dots, with operand types resolved by name.

    Arguments:
        hlo_text: a compiled program's HLO (``compiled.as_text()``).

    Returns:
        A list of `GemmInfo`, in program order.
    """
    shapes: dict[str, str] = {}
    instrs = []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        first = _SHAPE.match(shape)
        shapes[name] = first.group(1) if first else shape
        instrs.append((name, op, rest, line.strip()))
    gemms = []
    for name, op, rest, line in instrs:
        args = rest.split(")")[0]
        operands = tuple(
            _element(shapes.get(a.strip(), "?"))
            for a in args.split(",")
            if a.strip().startswith("%")
        )
        f8_operands = sum(t.startswith("f8") for t in operands)
        if op == "custom-call":
            target_match = _CUSTOM_CALL.search(line)
            target = target_match.group(1) if target_match else ""
            # fp8jax's Pallas kernels (grouped and block-scaled GEMMs, flash attention), told
            # apart by their named scopes
            ours = "mosaic_gpu" in target and any(
                scope in line for scope in (GROUPED_SCOPE, BLOCKWISE_SCOPE, FLASH_SCOPE)
            )
            if not (_GEMM_TARGET.search(target) or _OUR_KERNEL.search(target) or ours):
                continue
            if ours:  # drop the small int32/f32 side inputs (group table, scales)
                operands = tuple(t for t in operands if t not in ("s32", "f32")) or operands
                f8_operands = sum(t.startswith("f8") for t in operands)
            is_fp8 = (
                "f8" in target.lower()
                or (bool(_OUR_KERNEL.search(target)) and not ours)
                or f8_operands >= 2
            )
            gemms.append(
                GemmInfo(op, target, operands[:2], _element(shapes[name]), is_fp8, line[:300])
            )
        elif op in ("dot", "convolution"):
            gemms.append(
                GemmInfo(op, "", operands[:2], _element(shapes[name]), f8_operands >= 2, line[:300])
            )
    return gemms


def parse_stablehlo_gemms(text: str) -> list[GemmInfo]:
    """Dots in StableHLO text (the lowered, pre-optimization program): what a CPU can
    show, where XLA runs FP8 dots as float32 ones after its optimizations.

    Arguments:
        text: a lowered program's StableHLO (``lowered.as_text()``).

    Returns:
        A list of `GemmInfo` (FP8: both operands float8), in program order.
    """
    gemms = []
    for line in text.splitlines():
        if "stablehlo.dot_general" not in line and "stablehlo.dot " not in line:
            continue
        sig = line.rsplit(" : ", 1)[-1]
        types = re.findall(r"tensor<([^>]*)>", sig)
        elems = [t.rsplit("x", 1)[-1] if "x" in t else t for t in types]
        operands, result = tuple(elems[:-1]), (elems[-1] if elems else "?")
        is_fp8 = sum(e.lower().startswith("f8") for e in operands) >= 2
        gemms.append(GemmInfo("dot", "", operands, result, is_fp8, line.strip()[:300]))
    return gemms


def fp8_gemm_report(
    fn: Callable, *args: Any, stage: str | None = None, **kwargs: Any
) -> GemmReport:
    """Compile ``fn(*args, **kwargs)`` and list each GEMM it runs, marking the FP8 ones.

    On a GPU, FP8 means a cuBLASLt FP8 call (``__cublas$lt$matmul$f8``) or one of
    fp8jax's kernels. ``stage="lowered"`` inspects the program before XLA's
    optimizations instead (dots on float8 operands), which is what a CPU can show: a
    CPU's XLA runs FP8 dots as float32 ones. ``fn`` may also be an already lowered or
    compiled program (``jax.jit(f).lower(...)``, ``.compile()``), given without arguments.

    Arguments:
        fn: the function (a step, a model call) or a lowered/compiled program.
        args, kwargs: what to call ``fn`` with (non-array leaves are static, as in
            ``eqx.filter_jit``).
        stage: ``"compiled"``, ``"lowered"``, or None (the default): compiled on a GPU,
            lowered on a CPU; the report says which.

    Returns:
        A `GemmReport`: each GEMM, whether it is FP8, and the platform (and stage).
    """
    import jax

    if stage is None:
        on_cpu = jax.devices()[0].platform == "cpu"
        compiled = isinstance(getattr(fn, "compiled", None) or fn, jax.stages.Compiled)
        stage = "lowered" if on_cpu and not compiled else "compiled"
    if stage not in ("compiled", "lowered"):
        raise ValueError(
            f"fp8_gemm_report: stage={stage!r} is not allowed; expected 'compiled' or 'lowered'."
        )
    platform = jax.devices()[0].platform
    # equinox's filter_jit(...).lower(...) / .compile() wrap jax's stages
    fn = getattr(fn, "compiled", None) or getattr(fn, "lowered", None) or fn
    if isinstance(fn, (jax.stages.Lowered, jax.stages.Compiled)):
        if args or kwargs:
            raise TypeError(
                f"fp8_gemm_report: fn is a jax {type(fn).__name__} program, which "
                "takes no arguments; pass the function and its arguments instead."
            )
        if isinstance(fn, jax.stages.Compiled):
            if stage == "lowered":
                raise ValueError(
                    "fp8_gemm_report: stage='lowered' needs a function or a jax "
                    "Lowered program, got a Compiled one."
                )
            return GemmReport(parse_gemms(fn.as_text()), platform)
        if stage == "lowered":
            return GemmReport(parse_stablehlo_gemms(fn.as_text()), platform + " (lowered)")
        return GemmReport(parse_gemms(fn.compile().as_text()), platform)
    _check_callable("fp8_gemm_report", fn, args, kwargs)

    # As eqx.filter_jit: arrays are traced, everything else is static, in and out (a step
    # may return a model holding functions, such as eqx.nn.MLP's activation).
    dynamic, static = eqx.partition((args, kwargs), eqx.is_array)

    def flat_fn(dynamic):
        call_args, call_kwargs = eqx.combine(dynamic, static)
        return eqx.filter(fn(*call_args, **call_kwargs), eqx.is_array)

    lowered = jax.jit(flat_fn).lower(dynamic)
    if stage == "lowered":
        return GemmReport(parse_stablehlo_gemms(lowered.as_text()), platform + " (lowered)")
    return GemmReport(parse_gemms(lowered.compile().as_text()), platform)


def _check_callable(where: str, fn: Any, args: tuple, kwargs: dict, arg: str = "fn") -> None:
    """A TypeError, before any tracing, if ``fn`` is not callable or cannot take ``args``."""
    if not callable(fn):
        what = "a callable" + (" (or a jax Lowered/Compiled program)" if arg == "fn" else "")
        raise TypeError(f"{where}: {arg} must be {what}, got {type(fn).__name__}.")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to check (a builtin, some wrappers)
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise TypeError(
            f"{where}: {name} cannot be called with the {len(args)} positional and "
            f"{len(kwargs)} keyword arguments given ({e})."
        ) from None


def saved_activation_bytes(model: Any, *inputs: Any, dim: int | None = None) -> int:
    """Bytes of the residuals ``jax.vjp`` keeps for the backward of ``model(*inputs)``
    (nothing is run: shapes only).

    ``model`` is any callable: a pytree (an equinox module, or ``eqx.filter_vmap`` of one),
    whose arrays are its parameters, or a function closing over a model
    (``jax.vmap(model)``, a lambda), whose closed-over float arrays count as parameters.

    Arguments:
        model: the callable whose backward is measured.
        inputs: its positional arguments (arrays or pytrees of them).
        dim: count only residuals with an axis of this size (e.g. the token or
            sequence length: the activations, not the weights). None: all of them.

    Returns:
        The residuals' size in bytes.
    """
    import jax

    _check_callable("saved_activation_bytes", model, inputs, {}, arg="model")
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
        raise TypeError(
            f"saved_activation_bytes: dim={dim!r} is not allowed; expected an int or None."
        )
    params, static = eqx.partition(model, eqx.is_array)
    if jax.tree_util.tree_leaves(params):

        def residuals(params, inputs):
            return jax.vjp(lambda p, i: eqx.combine(p, static)(*i), params, inputs)[1]

        res = jax.eval_shape(residuals, params, inputs)
    else:
        res = _closure_residuals(model, inputs)
    return sum(_nbytes(r) for r in jax.tree_util.tree_leaves(res) if dim is None or dim in r.shape)


def _closure_residuals(fn: Callable, inputs: tuple):
    """Residual shapes of ``fn(*inputs)``'s backward for a callable holding no arrays
    itself (``jax.vmap(model)``): the float arrays it closes over (the jaxpr's constants)
    are differentiated as the parameters are, so the activations the weight gradients
    need count too."""
    import jax
    import jax.numpy as jnp

    dynamic, static = eqx.partition(inputs, eqx.is_array)
    closed = jax.make_jaxpr(lambda d: fn(*eqx.combine(d, static)))(dynamic)
    consts = list(closed.consts)
    floats = [
        i
        for i, c in enumerate(consts)
        if hasattr(c, "dtype") and jnp.issubdtype(c.dtype, jnp.inexact)
    ]
    if not floats and not jax.tree_util.tree_leaves(dynamic):
        raise ValueError(
            "saved_activation_bytes: model holds no arrays and closes over none, and the "
            "inputs hold none: nothing to differentiate."
        )

    def run(weights, d):
        values = list(consts)
        for i, w in zip(floats, weights):
            values[i] = w
        return jax.core.eval_jaxpr(closed.jaxpr, values, *jax.tree_util.tree_leaves(d))

    weights = [consts[i] for i in floats]
    return jax.eval_shape(lambda w, d: jax.vjp(run, w, d)[1], weights, dynamic)


def assert_fp8(fn: Callable, *args: Any, expected: int | None = None, **kwargs: Any) -> GemmReport:
    """Raise ``AssertionError`` unless every GEMM of ``fn`` runs in FP8 (and, if given,
    there are exactly ``expected`` of them): a test's check that a step really is FP8.

    Arguments:
        fn, args, kwargs, stage: as `fp8_gemm_report` takes them.
        expected: the number of GEMMs the program must have (None: any, at least one).

    Returns:
        The `GemmReport` (the AssertionError's message prints it).
    """
    if expected is not None and (
        isinstance(expected, bool) or not isinstance(expected, int) or expected < 0
    ):
        raise ValueError(
            f"assert_fp8: expected={expected!r} is not allowed; expected None or an int >= 0."
        )
    report = fp8_gemm_report(fn, *args, **kwargs)
    if not report.all_fp8 or (expected is not None and len(report.gemms) != expected):
        raise AssertionError(
            f"expected {expected if expected is not None else 'all'} FP8 GEMMs:\n{report}"
        )
    return report
