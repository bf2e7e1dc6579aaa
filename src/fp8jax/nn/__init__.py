"""FP8 layers built on `fp8jax.Fp8DotGeneral` and FP8 attention."""

from .attention import (
    DotProductAttention,
    Fp8AttentionState,
    MultiHeadAttention,
    dot_product_attention,
    rotary,
)
from .linear import Linear
from .mlp import ACTIVATIONS, FusedMLP

__all__ = [
    "ACTIVATIONS",
    "DotProductAttention",
    "Fp8AttentionState",
    "FusedMLP",
    "Linear",
    "MultiHeadAttention",
    "dot_product_attention",
    "rotary",
]
