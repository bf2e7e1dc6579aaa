"""Keep FP8 state out of the optimizer: split it off the gradients and write it back.

The gradient of every array inside an `OverwriteWithGradient` module (such as
`Fp8DotGeneral`) is that array's *new value*. These functions follow haliax's
``partition_for_grad_overwrite`` / ``apply_updates`` contract.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from .dot_general import OverwriteWithGradient


def _is_overwrite(x) -> bool:
    return isinstance(x, OverwriteWithGradient)


def partition_for_grad_overwrite(grads: Any) -> tuple[Any, Any]:
    """Split gradients into ``(overwrites, grads)``: the first holds only the new FP8
    state (``None`` elsewhere), the second the true gradients (``None`` at the state)."""
    return eqx.partition(grads, _is_overwrite, is_leaf=_is_overwrite)


def trainable(model: Any) -> Any:
    """The trainable parameters of ``model``: its floating-point arrays, with the FP8
    state (and everything else) replaced by ``None``. What an optimizer should see:
    ``opt.init(fp8jax.trainable(model))``."""
    without_state = eqx.filter(model, lambda x: not _is_overwrite(x), is_leaf=_is_overwrite)
    return eqx.filter(without_state, eqx.is_inexact_array)


def _merge_state(old: OverwriteWithGradient, new: OverwriteWithGradient) -> OverwriteWithGradient:
    """Take the new state of every (stacked) layer that ran this step; keep the old
    state of layers that did not (their "gradient" is all zeros: scale 0 is never valid)."""
    old_leaves, treedef = jax.tree_util.tree_flatten(old)
    new_leaves = jax.tree_util.tree_leaves(new)
    if len(old_leaves) != len(new_leaves):
        raise ValueError("apply_updates: overwrite structure does not match the model's FP8 state.")
    ran = new.ran_mask()  # [*stack, 1] or None
    merged = []
    for o, n in zip(old_leaves, new_leaves, strict=True):
        n = jnp.asarray(n).astype(jnp.asarray(o).dtype)
        if ran is not None:
            stack = ran.ndim - 1
            n = jnp.where(ran.reshape(ran.shape[:stack] + (1,) * (n.ndim - stack)), n, o)
        merged.append(n)
    return jax.tree_util.tree_unflatten(treedef, merged)


def apply_updates(model: Any, updates: Any, overwrites: Any) -> Any:
    """Apply optimizer ``updates`` to the parameters and write ``overwrites`` (new FP8
    state from `partition_for_grad_overwrite`) into the state. Either may be ``None``."""
    if updates is None:
        updates = jax.tree_util.tree_map(lambda _: None, model, is_leaf=_is_overwrite)
    if overwrites is None:
        overwrites = jax.tree_util.tree_map(lambda _: None, model, is_leaf=_is_overwrite)

    def apply(leaf, update, overwrite):
        if _is_overwrite(leaf):
            return leaf if overwrite is None else _merge_state(leaf, overwrite)
        if update is None:
            return leaf
        return eqx.apply_updates(leaf, update)

    return jax.tree_util.tree_map(
        apply, model, updates, overwrites, is_leaf=lambda x: x is None or _is_overwrite(x)
    )


def optax_step(optimizer: optax.GradientTransformation, model: Any, grads: Any, opt_state: Any):
    """One optimizer step with the FP8 state handled: returns ``(model, opt_state)``.

    ``opt_state`` must come from ``optimizer.init(fp8jax.trainable(model))``.
    Works with any optax transformation, including ``optax.MultiSteps`` (the FP8
    state then advances every micro-step, like a forward pass in TE).
    """
    overwrites, grads = partition_for_grad_overwrite(grads)
    grads = eqx.filter(grads, eqx.is_inexact_array)
    updates, opt_state = optimizer.update(grads, opt_state, trainable(model))
    return apply_updates(model, updates, overwrites), opt_state


def accumulate_grads(accumulated: Any, grads: Any) -> Any:
    """Add ``grads`` into ``accumulated`` for gradient accumulation over micro-batches:
    true gradients are summed, FP8 state "gradients" are max-combined (each micro-batch
    proposes the same scales and index and its own amax; the max is the amax of the
    whole batch). ``accumulated=None`` starts a new accumulation."""
    if accumulated is None:
        return grads

    def combine(a, g):
        if _is_overwrite(a):
            return jax.tree_util.tree_map(jnp.maximum, a, g)
        if a is None or g is None:
            return a if g is None else g
        return jax.tree_util.tree_map(jnp.add, a, g)

    return jax.tree_util.tree_map(combine, accumulated, grads, is_leaf=lambda x: x is None or _is_overwrite(x))


def scale_grads(grads: Any, factor: float) -> Any:
    """Multiply the true gradients by ``factor`` (e.g. 1/num_microbatches), leaving
    the FP8 state untouched."""
    overwrites, true_grads = partition_for_grad_overwrite(grads)
    true_grads = jax.tree_util.tree_map(lambda g: g * factor, true_grads)
    return eqx.combine(overwrites, true_grads, is_leaf=_is_overwrite)
