"""FP8 layers built on `fp8jax.Fp8DotGeneral` and FP8 attention (equinox modules). Import
from `fp8jax.nn` itself (its ``__all__``); the modules are its implementation.

- `_linear`: `Linear`, ``eqx.nn.Linear`` with FP8 GEMMs.
- `_mlp`: `FusedMLP`, norm -> fc1 -> activation -> fc2 with FP8 GEMMs and fused passes.
- `_mlp_paths`: `FusedMLP`'s two fused paths (the gated Pallas core, the XLA region).
- `_elementwise`: the activations, norms and gated-row layouts the MLPs share.
- `_attention`: `dot_product_attention`, `DotProductAttention` (the attention core).
- `_mha`: `MultiHeadAttention` (projections, `rotary`, the core).
- `_grouped`: MoE experts: `GroupedLinear`, `GroupedMLP`.
- `_moe`: the `MoE` layer (router, top-k, the grouped experts) and its `RoutingInfo`.
- `_expert_shards`: `split_experts` / `merge_experts` for expert checkpoints.
- `_losses`: `cross_entropy` that keeps bf16 logits for its backward.
- `_remat`: `remat_policy`, a ``jax.checkpoint`` policy that keeps the FP8 copies only.
"""

from ._attention import DotProductAttention, Fp8AttentionState, dot_product_attention
from ._expert_shards import merge_experts, split_experts
from ._grouped import (
    Fp8GroupedState,
    GroupedLinear,
    GroupedMLP,
    make_layout,
    row_align,
)
from ._linear import Linear
from ._losses import cross_entropy
from ._mha import MultiHeadAttention, rotary
from ._mlp import ACTIVATIONS, FusedMLP
from ._moe import MoE, RoutingInfo
from ._remat import remat_policy

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
