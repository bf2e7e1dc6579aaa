"""Compile-time settings fp8jax applies for its users: no Triton GEMM autotuning of FP8
programs, and an opt-in persistent compilation cache.

**Triton GEMM autotuning.** With default XLA flags, XLA (jax 0.11.2) spends minutes compiling
an FP8 train step (seconds in bf16) trying Triton configs for its FP8 GEMMs, and then picks
cuBLASLt for every one. Worse, with Triton GEMMs on, XLA does not rewrite the
``dot(convert(a) * sa, convert(b) * sb)`` pattern into a cuBLASLt FP8 call: a step compiled so
ran none of its GEMMs in FP8 (bf16 GEMMs on dequantized values, slower than plain bf16).
(`benchmarks/RESULTS.md`: "compile time with default flags (issue 21)", 2026-11-24; "Import
order (issue 44)", 2026-11-27.) ``xla_gpu_enable_triton_gemm=false`` fixes both.
``import fp8jax`` sets it two ways: in ``XLA_FLAGS`` while JAX's backend has not started
(child processes inherit it), and as a per-compile option on every XLA compile of the
process from then on (`_jax_compat.add_compile_options`), so the order of
imports does not matter. The user's own choice wins: ``XLA_FLAGS`` naming the flag, a
``jax.jit(..., compiler_options=...)`` naming it, or ``FP8JAX_KEEP_TRITON_GEMM=1``. bf16 GEMMs
then run in cuBLAS instead of Triton fusions too, which makes bf16 steps a little faster, so
the setting does not flatter FP8's ratio (``benchmarks/RESULTS.md``: "Compile time: XLA's Triton
GEMM autotuning", 2026-11-23, and "What `import fp8jax`'s compile setting costs at run time").
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

from . import _jax_compat

TRITON_GEMM_OPTION = "xla_gpu_enable_triton_gemm"
TRITON_GEMM_OFF = f"--{TRITON_GEMM_OPTION}=false"
KEEP_ENV = "FP8JAX_KEEP_TRITON_GEMM"
CACHE_ENV = "FP8JAX_CACHE_DIR"
DEFAULT_CACHE = Path.home() / ".cache" / "fp8jax" / "jax-compile"


def _users_choice() -> bool:
    """Whether the user chose the Triton GEMM setting: the opt-out variable, or ``XLA_FLAGS``
    naming the flag with another value than fp8jax's."""
    if os.environ.get(KEEP_ENV, "") not in ("", "0"):
        return True
    flags = os.environ.get("XLA_FLAGS", "")
    return TRITON_GEMM_OPTION in flags.replace(TRITON_GEMM_OFF, "")


def _triton_gemm_off(options: dict) -> dict:
    """Per-compile options: Triton GEMMs off unless the caller or the user chose."""
    if TRITON_GEMM_OPTION in options or _users_choice():
        return options
    return {**options, TRITON_GEMM_OPTION: False}


def skip_triton_gemm_autotuning(warn: bool = True) -> bool:
    """Turn XLA's Triton GEMMs (and their autotuning) off for every compile of this process,
    whatever JAX has run before; ``import fp8jax`` calls this itself.

    Arguments:
        warn: warn if neither way can act (a JAX without the per-compile hook, its backend
            already started).

    Returns:
        Whether the setting is in force (False where the user chose otherwise).
    """
    if _users_choice():
        return False
    hooked = _jax_compat.add_compile_options(_triton_gemm_off)
    if not _jax_compat.backend_started():
        flags = os.environ.get("XLA_FLAGS", "")
        if TRITON_GEMM_OFF not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} {TRITON_GEMM_OFF}".strip()
        return True
    if not hooked and warn:
        warnings.warn(
            f"fp8jax: JAX's backend started before fp8jax was imported and this JAX offers no "
            f"per-compile hook, so {TRITON_GEMM_OFF} cannot take effect: FP8 GEMMs may run in "
            "bf16 and take minutes to compile on a GPU. Import fp8jax before running any JAX "
            f"computation, or set XLA_FLAGS={TRITON_GEMM_OFF}.",
            stacklevel=3,
        )
    return hooked


def apply_at_import() -> bool:
    """What ``import fp8jax`` does: `skip_triton_gemm_autotuning`, warning if it cannot act."""
    return skip_triton_gemm_autotuning(warn=True)


def enable_compilation_cache(
    path: str | os.PathLike | None = None, *, min_compile_s: float = 0.5
) -> Path:
    """Turn on JAX's persistent compilation cache in ``path`` (default ``$FP8JAX_CACHE_DIR`` or
    ``~/.cache/fp8jax/jax-compile``): a second start of the same program loads its compiled
    executables instead of compiling them. Caches every program that took at least
    ``min_compile_s`` to compile. Call before the first compile; returns the directory.

    Arguments:
        path: the cache directory (created if missing), or None for the default.
        min_compile_s: compile time in seconds from which a program is cached.

    Returns:
        The cache directory, as a ``Path``.
    """
    import jax

    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"enable_compilation_cache: path={path!r} is not allowed; expected a directory "
            "(str or os.PathLike) or None."
        )
    if isinstance(min_compile_s, bool) or not (
        isinstance(min_compile_s, (int, float))
        and math.isfinite(min_compile_s)
        and min_compile_s >= 0
    ):
        raise ValueError(
            f"enable_compilation_cache: min_compile_s={min_compile_s!r} is not allowed; "
            "expected a number of seconds >= 0."
        )
    directory = Path(path or os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"enable_compilation_cache: cannot create {directory}: {e}") from None
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory
