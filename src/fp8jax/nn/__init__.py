"""FP8 layers built on `fp8jax.Fp8DotGeneral` and FP8 attention."""

from .attention import (
    DotProductAttention,
    Fp8AttentionState,
    MultiHeadAttention,
    dot_product_attention,
    rotary,
)
from .expert_shards import merge_experts, split_experts
from .grouped import (
    Fp8GroupedState,
    GroupedLinear,
    GroupedMLP,
    MoE,
    RoutingInfo,
    make_layout,
    row_align,
)
from .linear import Linear
from .losses import cross_entropy
from .mlp import ACTIVATIONS, FusedMLP

__all__ = [
    "ACTIVATIONS",
    "DotProductAttention",
    "Fp8AttentionState",
    "Fp8GroupedState",
    "GroupedLinear",
    "GroupedMLP",
    "MoE",
    "RoutingInfo",
    "FusedMLP",
    "Linear",
    "cross_entropy",
    "MultiHeadAttention",
    "dot_product_attention",
    "make_layout",
    "merge_experts",
    "rotary",
    "row_align",
    "split_experts",
]
