"""fp8jax: FP8 training for JAX on NVIDIA Hopper GPUs."""

# First, before anything can start JAX's backend: no Triton GEMM autotuning (see compilation).
from ._compilation import apply_at_import as _apply_at_import

_apply_at_import()


from . import nn
from ._compilation import enable_compilation_cache, skip_triton_gemm_autotuning
from ._config import Fp8Config
from ._convert import ConversionReport, fp8_linear_layers, fp8_state
from ._dot_general import Fp8DotGeneral
from ._grad_overwrite import (
    accumulate_grads,
    apply_updates,
    optax_step,
    partition_for_grad_overwrite,
    scale_grads,
    trainable,
)
from ._guard import check_state
from ._guard import enter_tree as enter_state
from ._inference import Fp8InferenceLinear, load_inference, save_inference, to_inference
from ._state import OverwriteWithGradient
from .distributed import record_fsdp, shard_model
from .inspect import (
    GemmReport,
    ResidualsReport,
    assert_fp8,
    fp8_gemm_report,
    residuals_report,
    saved_activation_bytes,
)
from .nn import remat_policy

__version__ = "0.1.0"

__all__ = [
    "ConversionReport",
    "Fp8Config",
    "Fp8DotGeneral",
    "Fp8InferenceLinear",
    "GemmReport",
    "OverwriteWithGradient",
    "ResidualsReport",
    "accumulate_grads",
    "apply_updates",
    "assert_fp8",
    "check_state",
    "enable_compilation_cache",
    "enter_state",
    "fp8_gemm_report",
    "fp8_linear_layers",
    "fp8_state",
    "load_inference",
    "nn",
    "optax_step",
    "partition_for_grad_overwrite",
    "record_fsdp",
    "remat_policy",
    "residuals_report",
    "save_inference",
    "saved_activation_bytes",
    "scale_grads",
    "shard_model",
    "skip_triton_gemm_autotuning",
    "to_inference",
    "trainable",
]

# The framework adapters, imported on first use (flax and haliax are optional extras):
# ``import fp8jax; fp8jax.flax.fp8_dot_general_cls(...)`` works without ``import fp8jax.flax``.
_ADAPTERS = {"flax": ("flax", "flax"), "nnx": ("flax", "flax"), "haliax": ("haliax", "haliax")}


def __getattr__(name: str):
    """``fp8jax.flax``, ``fp8jax.nnx``, ``fp8jax.haliax``: the adapter module, imported now;
    an ImportError naming the pip extra when its framework is not installed."""
    if name not in _ADAPTERS:
        raise AttributeError(f"module 'fp8jax' has no attribute {name!r}")
    import importlib

    dependency, extra = _ADAPTERS[name]
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError as e:
        if (e.name or "").split(".")[0] != dependency:
            raise
        raise ImportError(
            f"fp8jax.{name} needs {dependency}, which is not installed: "
            f"pip install 'fp8jax[{extra}]'"
        ) from e
