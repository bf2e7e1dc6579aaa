"""The end-to-end example: a byte-level transformer trained in bf16 and FP8 (``fp8jax-train``)."""

from .cli import PRESETS, main
from .model import ModelConfig, Transformer

__all__ = ["PRESETS", "ModelConfig", "Transformer", "main"]
