"""Expert shards of a model's grouped experts, for checkpoints: `split_experts` cuts every
`GroupedLinear` into consecutive expert shards (Megatron's sharded expert checkpoints),
`merge_experts` puts them back together (e.g. before splitting for another degree)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ._grouped import GroupedLinear


def _is_grouped(x) -> bool:
    return isinstance(x, GroupedLinear)


def _slice_grouped(layer: GroupedLinear, lo: int, hi: int) -> GroupedLinear:
    weight = layer.weight[..., lo:hi, :, :]
    state = layer.fp8_state
    if state is not None:
        state = eqx.tree_at(
            lambda s: (s.kernel_scale, s.kernel_amax_history),
            state,
            (state.kernel_scale[..., lo:hi], state.kernel_amax_history[..., lo:hi]),
        )
    return eqx.tree_at(
        lambda lay: (lay.weight, lay.fp8_state), layer, (weight, state), is_leaf=lambda x: x is None
    )


def split_experts(tree: Any, num_shards: int) -> list[Any]:
    """Split every `GroupedLinear` in ``tree`` (a `MoE`, `GroupedMLP`, model, ...)
    into ``num_shards`` consecutive expert shards: weights ``[E, ...]`` and per-expert
    FP8 state (``kernel_scale``, ``kernel_amax_history``) are sliced, per-tensor state
    and every other leaf is copied. Like Megatron's sharded state dict for experts:
    save each shard on its own, load as another expert-parallel degree with
    `merge_experts` (and `split_experts` again).

    Arguments:
        tree: a pytree holding `GroupedLinear` layers, all with the same number of experts.
        num_shards: how many shards; it must divide that number.

    Returns:
        A list of ``num_shards`` trees of ``tree``'s structure, shard ``i`` holding the
        ``i``-th run of experts.
    """
    layers = [x for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_grouped) if _is_grouped(x)]
    if not layers:
        raise ValueError("split_experts: no fp8jax.nn.GroupedLinear in the tree")
    num = {layer.num_experts for layer in layers}
    if len(num) != 1 or next(iter(num)) % num_shards:
        raise ValueError(
            f"split_experts: expert counts {sorted(num)} cannot be split into {num_shards} "
            "equal shards"
        )
    per = next(iter(num)) // num_shards
    return [
        jax.tree_util.tree_map(
            lambda x, i=i: _slice_grouped(x, i * per, (i + 1) * per) if _is_grouped(x) else x,
            tree,
            is_leaf=_is_grouped,
        )
        for i in range(num_shards)
    ]


def merge_experts(shards: Sequence[Any]) -> Any:
    """Inverse of `split_experts`: concatenate the expert shards (in order). Per-tensor
    FP8 state (input / output-gradient scales and histories, index, counters) must
    agree across shards -- it does when they trained in lockstep -- and is taken
    elementwise max (the conservative amax) otherwise.

    Arguments:
        shards: `split_experts`'s trees, in order.

    Returns:
        One tree with every `GroupedLinear`'s experts concatenated.
    """
    if not shards:
        raise ValueError("merge_experts: no shards")

    def merge(*layers):
        if not _is_grouped(layers[0]):
            return layers[0]
        weight = jnp.concatenate([lay.weight for lay in layers], axis=-3)
        state = layers[0].fp8_state
        if state is not None:
            states = [lay.fp8_state for lay in layers]
            per_tensor = (
                "input_scale",
                "output_grad_scale",
                "input_amax_history",
                "output_grad_amax_history",
                "nonfinite_count",
            )
            values = [
                jnp.max(jnp.stack([getattr(s, f) for s in states]), axis=0) for f in per_tensor
            ]
            state = eqx.tree_at(
                lambda s: tuple(getattr(s, f) for f in per_tensor), state, tuple(values)
            )
            state = eqx.tree_at(
                lambda s: (s.kernel_scale, s.kernel_amax_history),
                state,
                (
                    jnp.concatenate([s.kernel_scale for s in states], axis=-1),
                    jnp.concatenate([s.kernel_amax_history for s in states], axis=-1),
                ),
            )
        return eqx.tree_at(
            lambda lay: (lay.weight, lay.fp8_state),
            layers[0],
            (weight, state),
            is_leaf=lambda x: x is None,
        )

    return jax.tree_util.tree_map(merge, *shards, is_leaf=_is_grouped)
