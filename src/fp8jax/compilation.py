"""Compile-time settings fp8jax applies for its users: no Triton GEMM autotuning of FP8
programs, and an opt-in persistent compilation cache.

**Triton GEMM autotuning.** With default XLA flags, XLA (jax 0.11.2) spent ~250 s compiling
a two-block FP8 train step on an H100 (6 s in bf16) trying Triton configs for its FP8 GEMMs,
then ran every one in cuBLASLt anyway. ``--xla_gpu_enable_triton_gemm=false`` brings the FP8
compile to seconds at the same step time. XLA reads ``XLA_FLAGS`` once, when JAX starts its
backend, and jax offers no per-computation default a library could set, so ``import fp8jax``
adds the flag to ``XLA_FLAGS`` when that is still possible (the backend not started yet),
unless ``XLA_FLAGS`` already mentions it or ``FP8JAX_KEEP_TRITON_GEMM=1`` is set. This also
applies to the process's bf16 GEMMs: they run in cuBLAS instead of Triton fusions (bf16 train
steps measured ~2% faster that way on the H100: ``benchmarks/RESULTS.md``). If JAX has
already run something when fp8jax is imported, the flag cannot act: fp8jax warns once.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

TRITON_GEMM_OFF = "--xla_gpu_enable_triton_gemm=false"
KEEP_ENV = "FP8JAX_KEEP_TRITON_GEMM"
CACHE_ENV = "FP8JAX_CACHE_DIR"
DEFAULT_CACHE = Path.home() / ".cache" / "fp8jax" / "jax-compile"


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except (ImportError, AttributeError):  # private API moved: assume not started
        return False


def skip_triton_gemm_autotuning(warn: bool = True) -> bool:
    """Turn XLA's Triton GEMM autotuning off (``XLA_FLAGS``) unless ``XLA_FLAGS`` already sets
    it; ``import fp8jax`` calls this itself. Returns whether it added the flag. Once JAX's
    backend has started the flag can no longer act: it then changes nothing and (with
    ``warn``) says so."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_triton_gemm" in flags:
        return False
    if _backend_started():
        if warn:
            warnings.warn(
                f"fp8jax: JAX's backend started before fp8jax was imported, so {TRITON_GEMM_OFF} "
                "cannot take effect and FP8 steps may take minutes to compile on a GPU. Import "
                "fp8jax before running any JAX computation, or set XLA_FLAGS="
                f"{TRITON_GEMM_OFF} (or {KEEP_ENV}=1 to keep XLA's default).",
                stacklevel=3,
            )
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {TRITON_GEMM_OFF}".strip()
    return True


def apply_at_import() -> bool:
    """What ``import fp8jax`` does: `skip_triton_gemm_autotuning` unless ``FP8JAX_KEEP_TRITON_GEMM``
    is set; it warns (once: a module is imported once) if it is too late to act."""
    if os.environ.get(KEEP_ENV, "") not in ("", "0"):
        return False
    return skip_triton_gemm_autotuning(warn=True)


def enable_compilation_cache(
    path: str | os.PathLike | None = None, *, min_compile_s: float = 0.5
) -> Path:
    """Turn on JAX's persistent compilation cache in ``path`` (default ``$FP8JAX_CACHE_DIR`` or
    ``~/.cache/fp8jax/jax-compile``): a second start of the same program loads its compiled
    executables instead of compiling them. Caches every program that took at least
    ``min_compile_s`` to compile. Call before the first compile; returns the directory."""
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
