"""JAX internals fp8jax relies on for its compile settings, reached in this one place.

Each use names the private attribute it needs; if a JAX release moves one, the caller gets
``None``/``False`` and a clear fallback rather than an ``AttributeError`` from deep inside.
``INTERNALS`` lists them for the test that guards an upgrade.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

# (module, attribute) pairs used below; tests/test_compile.py checks each still exists.
INTERNALS = (
    ("jax._src.xla_bridge", "_backends"),
    ("jax._src.compiler", "get_compile_options"),
)


def backend_started() -> bool:
    """Whether JAX has started a backend (XLA has read ``XLA_FLAGS``) in this process."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except (ImportError, AttributeError):  # moved: assume not started
        return False


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
        from jax._src import compiler
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
