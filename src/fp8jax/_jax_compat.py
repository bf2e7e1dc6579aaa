"""Every JAX internal fp8jax relies on, reached in this one place.

fp8jax uses public JAX (``jax.core``, ``jax.dtypes``, ``jax.extend``) wherever it has the
name; `INTERNALS` lists what it has not, each with what it is and why fp8jax needs it
(``tests/test_compile.py`` resolves every entry, so an upgrade that moves one fails there,
by name). A *required* internal that this JAX lacks makes ``import fp8jax`` fail with an
ImportError naming it and the JAX version (not an AttributeError from deep inside); an
optional one gives its caller ``None``/``False`` and a fallback.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

SUPPORTED = "0.8.3 to 0.11.2"  # the JAX releases fp8jax is tested with


class Internal(NamedTuple):
    """One private JAX name fp8jax uses: ``module.attribute``; ``public``: a public module
    with the same name in some releases, tried first; ``required``: import fails without it;
    ``since``: the first JAX release that has it (older ones take the fallback)."""

    module: str
    attribute: str
    why: str
    required: bool = True
    public: str | None = None
    since: str = "0.8.3"


_ATTN = "jax._src.cudnn.fused_attention_stablehlo"
_ATTN_WHY = (
    "cuDNN's FP8 flash attention (fp8jax._kernels.cudnn_attention): the public "
    "jax.nn.dot_product_attention has no FP8 path, so fp8jax binds its primitives"
)
INTERNALS = (
    Internal(
        "jax._src.dtypes",
        "ExtendedDType",
        "base class of the FP8 state's MAX_GRAD dtype (fp8jax._state), whose cotangents add by "
        "max; JAX has no public way to define an extended dtype",
    ),
    Internal(
        "jax._src.core",
        "physical_aval",
        "the float32 storage of a MAX_GRAD array, for the handler of those a jit returns",
    ),
    Internal(
        "jax._src.interpreters.pxla",
        "global_result_handlers",
        "builds the arrays a jit returns; MAX_GRAD's handler wraps float32 ones",
    ),
    Internal(
        "jax._src.earray",
        "EArray",
        "the array type of a MAX_GRAD value outside jit (jax.Array of an extended dtype)",
    ),
    Internal(
        "jax._src.core",
        "set_current_trace",
        "converts an FP8 state leaf to MAX_GRAD in the trace the leaf lives in "
        "(fp8jax._state.enter); public as jax.extend.core.set_current_trace from jax 0.10",
        public="jax.extend.core",
    ),
    Internal(
        "jax._src.ad_util",
        "raw_jaxval_adders",
        "how JAX adds cotangents outside jit, by array type; fp8jax registers MAX_GRAD's "
        "max there (else MAX_GRAD cotangents add only under jit)",
        required=False,
    ),
    Internal(
        "jax._src.xla_bridge",
        "_backends",
        "whether JAX's backend started (read XLA_FLAGS) before fp8jax set its flags",
        required=False,
    ),
    Internal(
        "jax._src.compiler",
        "get_compile_options",
        "sets an XLA option per compile after the backend started (fp8jax._compilation)",
        required=False,
    ),
    Internal(_ATTN, "_dot_product_attention_fp8_fwd_p_wrapper", _ATTN_WHY, required=False),
    Internal(_ATTN, "_dot_product_attention_fp8_bwd_p_wrapper", _ATTN_WHY, required=False),
    Internal(_ATTN, "AttentionLayout", _ATTN_WHY, required=False),
    Internal(_ATTN, "check_cudnn_version", _ATTN_WHY, required=False),
    Internal(
        "jax._src.source_info_util",
        "summarize",
        "the user source line of a jaxpr equation (file:line (function)), as JAX's "
        "print_saved_residuals writes it, for fp8jax.inspect.residuals_report; without it "
        "the report's lines read 'unknown'",
        required=False,
    ),
    Internal(
        "jax._src.pallas.mosaic_gpu.interpret.params",
        "InterpretGPUParams",
        "runs the Mosaic-GPU block-scaled GEMM in Pallas' interpret mode (CPU tests)",
        required=False,
        since="0.10.0",
    ),
)
_BY_NAME = {(i.module, i.attribute): i for i in INTERNALS}


def resolve(internal: Internal) -> Any:
    """What ``internal`` names in this JAX (its public home first), or None if it has neither."""
    for module in (internal.public, internal.module):
        if module is None:
            continue
        try:
            value = getattr(importlib.import_module(module), internal.attribute, None)
        except ImportError:
            value = None
        if value is not None:
            return value
    return None


def missing_message(internal: Internal) -> str:
    """Why fp8jax cannot use this JAX: ``internal`` is gone, what it was for, what to do."""
    return (
        f"fp8jax needs JAX's internal {internal.module}.{internal.attribute} ({internal.why}), "
        f"which jax {jax.__version__} does not have. fp8jax is tested with jax {SUPPORTED}: "
        "install one of those, or report this JAX release to fp8jax."
    )


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def missing(internals: tuple[Internal, ...] | None = None) -> list[str]:
    """``module.attribute`` of each of ``internals`` (default `INTERNALS`) this JAX lacks,
    of those it should have (``since`` this JAX's release or earlier)."""
    internals = INTERNALS if internals is None else internals
    ours = _release(jax.__version__)
    return [
        f"{i.module}.{i.attribute}"
        for i in internals
        if _release(i.since) <= ours and resolve(i) is None
    ]


def _get(module: str, attribute: str) -> Any:
    """The `INTERNALS` entry ``module.attribute``; ImportError (`missing_message`) if gone."""
    internal = _BY_NAME[(module, attribute)]
    value = resolve(internal)
    if value is None:
        raise ImportError(missing_message(internal))
    return value


# Required: resolved when fp8jax is imported, so a JAX without one fails there, by name.
ExtendedDType = _get("jax._src.dtypes", "ExtendedDType")
physical_aval = _get("jax._src.core", "physical_aval")
global_result_handlers = _get("jax._src.interpreters.pxla", "global_result_handlers")
EArray = _get("jax._src.earray", "EArray")
set_current_trace = _get("jax._src.core", "set_current_trace")


def add_eager_adder(add: Callable) -> bool:
    """Have JAX add `EArray` cotangents outside ``jit`` with ``add`` (JAX adds them by the
    array's Python type and has none for an extended dtype's: jax 0.10-0.11). Returns
    False (nothing changed) where this JAX has no such table."""
    try:
        adders = _get("jax._src.ad_util", "raw_jaxval_adders")
    except ImportError:
        return False
    adders.setdefault(EArray, add)
    return True


def cudnn_attention():
    """JAX's private cuDNN fused-attention module with its FP8 primitives; ImportError
    (`missing_message`) where this JAX lacks one of the names fp8jax binds."""
    for internal in INTERNALS:
        if internal.module == _ATTN:
            _get(internal.module, internal.attribute)
    return importlib.import_module(_ATTN)


def interpret_gpu_params():
    """Pallas Mosaic-GPU's ``InterpretGPUParams`` class; ImportError where this JAX lacks it."""
    return _get("jax._src.pallas.mosaic_gpu.interpret.params", "InterpretGPUParams")


def source_line(eqn: Any) -> str:
    """``file:line:column (function)`` of the user code that bound the jaxpr equation
    ``eqn`` (the wording of JAX's ``print_saved_residuals``); ``""`` where it has none or
    this JAX has no such summary."""
    summarize = resolve(_BY_NAME[("jax._src.source_info_util", "summarize")])
    if summarize is None:
        return ""
    try:
        return str(summarize(eqn.source_info))
    except (AttributeError, TypeError):  # an equation without source info
        return ""


def backend_started() -> bool:
    """Whether JAX has started a backend (XLA has read ``XLA_FLAGS``) in this process."""
    backends = resolve(_BY_NAME[("jax._src.xla_bridge", "_backends")])
    return bool(backends)  # moved (None): assume not started


def add_compile_options(extra: Callable[[dict], dict]) -> bool:
    """Have every XLA compile of this process, from now on, take the options ``extra``
    returns for the options a caller passed (``jax.jit(..., compiler_options=...)``).

    This is how a library sets an XLA option after JAX's backend has started: XLA reads
    ``XLA_FLAGS`` once, but it applies each compile's ``env_option_overrides`` on top.
    Idempotent per ``extra``. Returns False (and changes nothing) if this JAX's compiler
    module has no ``get_compile_options`` of the expected form.

    Arguments:
        extra: maps the caller's options (a dict, possibly empty) to the options to compile
            with; it must return a new dict and leave keys the caller set alone.

    Returns:
        Whether the hook is installed.
    """
    try:
        compiler = importlib.import_module("jax._src.compiler")
    except ImportError:
        return False
    original = getattr(compiler, "get_compile_options", None)
    if original is None:
        return False
    if getattr(original, "_fp8jax_extra", None) is extra:
        return True

    @functools.wraps(original)
    def get_compile_options(*args, **kwargs):
        if len(args) < 4:  # env_options_overrides is the fourth parameter
            given = kwargs.get("env_options_overrides") or {}
            kwargs["env_options_overrides"] = extra(dict(given))
        return original(*args, **kwargs)

    get_compile_options._fp8jax_extra = extra
    compiler.get_compile_options = get_compile_options
    return True
