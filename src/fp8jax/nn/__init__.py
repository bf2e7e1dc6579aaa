"""FP8 layers built on `fp8jax.Fp8DotGeneral` and FP8 attention (equinox modules). Import
from `fp8jax.nn` itself (its ``__all__``); the modules are its implementation.

- `linear`: `Linear`, ``eqx.nn.Linear`` with FP8 GEMMs.
- `mlp`: `FusedMLP`, norm -> fc1 -> activation -> fc2 with FP8 GEMMs and fused passes.
- `elementwise`: the activations, norms and gated-row layouts the MLPs share.
- `attention`: `dot_product_attention`, `DotProductAttention` (the attention core).
- `mha`: `MultiHeadAttention` (projections, `rotary`, the core).
- `grouped`: MoE experts: `GroupedLinear`, `GroupedMLP`.
- `moe`: the `MoE` layer (router, top-k, the grouped experts) and its `RoutingInfo`.
- `expert_shards`: `split_experts` / `merge_experts` for expert checkpoints.
- `losses`: `cross_entropy` that keeps bf16 logits for its backward.
- `remat`: `remat_policy`, a ``jax.checkpoint`` policy that keeps the FP8 copies only.
"""

from .attention import DotProductAttention, Fp8AttentionState, dot_product_attention
from .expert_shards import merge_experts, split_experts
from .grouped import (
    Fp8GroupedState,
    GroupedLinear,
    GroupedMLP,
    make_layout,
    row_align,
)
from .linear import Linear
from .losses import cross_entropy
from .mha import MultiHeadAttention, rotary
from .mlp import ACTIVATIONS, FusedMLP
from .moe import MoE, RoutingInfo
from .remat import remat_policy

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
    "remat_policy",
    "rotary",
    "row_align",
    "split_experts",
]
