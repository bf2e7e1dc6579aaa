"""XLA settings for FP8 programs; XLA reads them once, when JAX starts its backend."""

from __future__ import annotations

import os
import warnings

TRITON_GEMM_OFF = "--xla_gpu_enable_triton_gemm=false"


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except (ImportError, AttributeError):  # private API moved: assume not started
        return False


def skip_triton_gemm_autotuning(warn: bool = True) -> bool:
    """Turn XLA's Triton GEMM autotuning off (``XLA_FLAGS``) unless ``XLA_FLAGS`` already sets it.

    On an H100 XLA spent ~190 s compiling a model's FP8 train step on trying Triton configs
    for its FP8 GEMMs, then ran every one of them in cuBLASLt anyway. With it off the step
    compiles in seconds and runs as fast; bf16 steps ran ~2% faster (benchmarks/RESULTS.md).
    Call it before the first JAX computation: once JAX's backend has started the flag can
    no longer act, so it changes nothing and (with ``warn``) says so. Returns whether it
    added the flag.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_triton_gemm" in flags:
        return False
    if _backend_started():
        if warn:
            warnings.warn(f"skip_triton_gemm_autotuning: JAX's backend has already started, so {TRITON_GEMM_OFF} "
                          "cannot take effect; call it before the first JAX computation", stacklevel=2)
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {TRITON_GEMM_OFF}".strip()
    return True
