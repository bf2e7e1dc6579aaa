"""Keep FP8 state out of the optimizer: split it off the gradients and write it back.

The gradient of every array inside an `OverwriteWithGradient` module (such as
`Fp8DotGeneral`) is that array's *new value*. These functions follow haliax's
``partition_for_grad_overwrite`` / ``apply_updates`` contract.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax import lax

from . import _guard
from ._state import OverwriteWithGradient


def _is_overwrite(x) -> bool:
    return isinstance(x, OverwriteWithGradient)


def _first_mismatch(ref: Any, tree: Any, path=()) -> tuple[str, str, str] | None:
    """``(path, ref's part, tree's part)`` where ``tree`` first departs from ``ref``'s
    structure or array shapes; ``None`` on either side stands for anything."""
    if ref is None or tree is None:
        return None
    ref_shape, tree_shape = getattr(ref, "shape", None), getattr(tree, "shape", None)
    ref_kids, ref_def = jax.tree_util.tree_flatten_with_path(ref, is_leaf=lambda y: y is not ref)
    kids, tree_def = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda y: y is not tree)
    ref_leaf = jax.tree_util.treedef_is_leaf(ref_def)
    tree_leaf = jax.tree_util.treedef_is_leaf(tree_def)
    where = jax.tree_util.keystr(path) or "the top level"
    if ref_leaf and tree_leaf:
        shapes_known = ref_shape is not None and tree_shape is not None
        if shapes_known and tuple(ref_shape) != tuple(tree_shape):
            return where, f"shape {tuple(ref_shape)}", f"shape {tuple(tree_shape)}"
        return None
    if ref_leaf or tree_leaf or ref_def != tree_def:
        if type(ref) is not type(tree):
            names = [type(x).__name__ for x in (ref, tree)]
            if names[0] == names[1]:  # two classes of one name: say which modules
                names = [f"{type(x).__module__}.{type(x).__qualname__}" for x in (ref, tree)]
            return where, f"type {names[0]}", f"type {names[1]}"
        return (where,) + _node_diff(ref, tree)
    for (key, r), (_, t) in zip(ref_kids, kids, strict=True):
        found = _first_mismatch(r, t, path + tuple(key))
        if found is not None:
            return found
    return None


def _node_diff(ref: Any, tree: Any, prefix: str = "") -> tuple[str, str]:
    """How two nodes of one type differ: a static field, dict keys or a length."""
    if dataclasses.is_dataclass(ref) and type(ref) is type(tree):
        for f in dataclasses.fields(ref):
            if isinstance(ref, eqx.Module) and not f.metadata.get("static", False):
                continue  # children: compared one by one by the caller
            r, t = getattr(ref, f.name, None), getattr(tree, f.name, None)
            if eqx.is_array(r) or eqx.is_array(t):
                continue
            try:
                same = bool(r == t)
            except Exception:  # noqa: BLE001 - values that cannot be compared
                same = r is t
            if not same:
                inner = prefix if f.metadata.get("inline") else f"{prefix}{f.name}."
                return (
                    _node_diff(r, t, inner)
                    if dataclasses.is_dataclass(r) and type(r) is type(t)
                    else (f"{prefix}{f.name}={_short(r)}", f"{prefix}{f.name}={_short(t)}")
                )
    if isinstance(ref, dict) and isinstance(tree, dict):
        return f"keys {sorted(map(str, ref))}"[:100], f"keys {sorted(map(str, tree))}"[:100]
    if isinstance(ref, (list, tuple)) and isinstance(tree, (list, tuple)):
        return f"length {len(ref)}", f"length {len(tree)}"
    return f"{prefix}{_short(ref)}", f"{prefix}{_short(tree)}"


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_like(fn: str, what: str, ref: Any, tree: Any, ref_name: str = "model") -> None:
    """Raise a ValueError naming the first path where ``tree`` does not fit ``ref``."""
    found = _first_mismatch(ref, tree)
    if found is not None:
        where, ref_part, tree_part = found
        raise ValueError(
            f"{fn}: the {what} do not match the {ref_name}: at {where}, "
            f"{ref_name}: {ref_part}; {what}: {tree_part} ({what} of another model?)."
        )


def partition_for_grad_overwrite(grads: Any) -> tuple[Any, Any]:
    """Split gradients into ``(overwrites, grads)``: the first holds only the new FP8
    state (``None`` elsewhere), the second the true gradients (``None`` at the state).

    Arguments:
        grads: the gradients of a model holding FP8 layers (``eqx.filter_grad``'s).

    Returns:
        ``(overwrites, grads)``: ``overwrites`` for `apply_updates`, ``grads`` for the
        optimizer (its state from ``opt.init(fp8jax.trainable(model))``).
    """
    return eqx.partition(grads, _is_overwrite, is_leaf=_is_overwrite)


def trainable(model: Any) -> Any:
    """The trainable parameters of ``model``: its floating-point arrays, with the FP8
    state (and everything else) replaced by ``None``. What an optimizer should see:
    ``opt.init(fp8jax.trainable(model))``.

    Arguments:
        model: a model (any pytree) holding FP8 layers.

    Returns:
        ``model``'s structure with only its trainable float arrays, ``None`` elsewhere.
    """
    without_state = eqx.filter(model, lambda x: not _is_overwrite(x), is_leaf=_is_overwrite)
    return eqx.filter(without_state, eqx.is_inexact_array)


def _merge_state(old: OverwriteWithGradient, new: OverwriteWithGradient) -> OverwriteWithGradient:
    """Take the new state of every (stacked) layer that ran this step; keep the old
    state of layers that did not (their "gradient" is all zeros: scale 0 is never valid).
    A non-finite new value (overwrites that went through arithmetic, a corrupted
    checkpoint) keeps the old one: NaN/Inf never reach a scale or a history."""
    old_leaves, treedef = jax.tree_util.tree_flatten(old)
    new_leaves = jax.tree_util.tree_leaves(new)
    if len(old_leaves) != len(new_leaves):
        raise ValueError("apply_updates: overwrite structure does not match the model's FP8 state.")
    ran = new.ran_mask()  # [*stack, 1] or None
    guard = _guard.guard_of(old)
    merged, masks = [], {}
    # One select per leaf, of the conditions above and'ed (lax ops: a jnp.where is a nested
    # jit to trace per leaf per layer, issue 21); ``ran`` broadcast once per leaf shape.
    for o, n in zip(old_leaves, new_leaves, strict=True):
        o = jnp.asarray(o)
        n = jnp.asarray(n).astype(o.dtype)
        keep = []
        if jnp.issubdtype(n.dtype, jnp.inexact):
            keep.append(lax.is_finite(n))
        if guard is not None and o is guard:  # 0: an op ran without entering the guard
            keep.append(lax.ne(n, lax.full_like(n, 0)))
        if ran is not None and n.shape not in masks:
            stack = ran.ndim - 1
            mask = ran.reshape(ran.shape[:stack] + (1,) * (n.ndim - stack))
            masks[n.shape] = lax.broadcast_in_dim(mask, n.shape, tuple(range(n.ndim)))
        if ran is not None:
            keep.append(masks[n.shape])
        if keep and n.shape == o.shape:
            n = lax.select(functools.reduce(lax.bitwise_and, keep), n, o)
        elif keep:
            n = jnp.where(functools.reduce(jnp.logical_and, keep), n, o)
        merged.append(n)
    return jax.tree_util.tree_unflatten(treedef, merged)


_SWAPPED = (
    "apply_updates: the {what}; the order is apply_updates(model, updates, overwrites), with "
    "(overwrites, grads) = fp8jax.partition_for_grad_overwrite(grads) and the updates from "
    "the optimizer applied to the grads."
)


def _guard_pairs(model: Any, other: Any) -> list[tuple[Any, Any]]:
    """``(model's guard, other's guard)`` of the FP8 states both trees have a guard for."""
    pairs = []

    def visit(m, o):
        if _is_overwrite(m) and _is_overwrite(o):
            gm, go = _guard.guard_of(m), _guard.guard_of(o)
            if gm is not None and go is not None:
                pairs.append((gm, go))
        return m

    jax.tree_util.tree_map(visit, model, other, is_leaf=lambda x: x is None or _is_overwrite(x))
    return pairs


def _check_guards(fn: str, model: Any, overwrites: Any, order: str):
    """Where the trees carry guards (`fp8jax._guard`): the model's must be valid, and the
    overwrites' not the model's own step (a model passed as gradients) nor one behind it
    (model and gradients swapped); 0 (not entered) passes. Returns ``overwrites``, raising
    now if the guards are concrete; else, by ``FP8JAX_GUARD``: ``nan`` (default), with the
    verdict written into their guards (a negative code, `fp8jax._guard.mark`: the model it
    is written into poisons its next forward; `fp8jax.check_state` says why); ``raise``,
    with the check attached (one ``lax.cond``); ``off``, as they are."""
    if _guard.mode() == "off":
        return overwrites
    pairs = _guard_pairs(model, overwrites) if overwrites is not None else []
    pairs = pairs or [(_guard.guard_of(x), None) for x in _guard.guarded_states(model)]
    if not pairs:
        return overwrites
    model_bad, model_index = _guard.verdict([m for m, _ in pairs])
    same, behind = jnp.asarray(False), jnp.asarray(False)
    both = [(m, o) for m, o in pairs if o is not None]
    if both:  # all guards in one vector: one comparison each, not one per layer
        m = jnp.concatenate([jnp.ravel(_guard._float(m)) for m, _ in both])
        o = jnp.concatenate([jnp.ravel(jnp.asarray(o, m.dtype)) for _, o in both])
        if m.dtype == jnp.float32:  # lax ops: no nested jit to trace (issue 21)
            written = lax.ne(o, lax.full_like(o, 0))
            same = lax.reduce_or(lax.bitwise_and(lax.eq(o, m), written), (0,))
            behind = lax.reduce_or(lax.bitwise_and(lax.eq(_guard.advance(o), m), written), (0,))
        else:
            same = jnp.any((o == m) & (o != 0))
            behind = jnp.any((_guard.advance(o) == m) & (o != 0))
    index = jnp.where(model_bad, model_index, jnp.where(same, 2, 3))
    bad = model_bad | same | behind
    messages = _guard.step_messages(fn, order)
    if overwrites is None and not _guard._concrete(bad, index):
        return overwrites  # nothing written back: the next forward checks the model
    # Under jit: one check (or mark) for the whole tree, on the state written back.
    return _guard.raise_or_attach(overwrites, bad, index, messages, keep_from=model)


def apply_updates(model: Any, updates: Any, overwrites: Any) -> Any:
    """Apply optimizer ``updates`` to the parameters and write ``overwrites`` (new FP8
    state from `partition_for_grad_overwrite`) into the state. Either may be ``None``.

    Arguments:
        model: the model the gradients were taken of.
        updates: the optimizer's updates of its parameters (``eqx.apply_updates``'s).
        overwrites: the new FP8 state; a layer that did not run this step keeps its state.

    Returns:
        The updated model.
    """
    return _apply_updates("apply_updates", model, updates, overwrites)


def _apply_updates(fn: str, model: Any, updates: Any, overwrites: Any) -> Any:
    _check_like("apply_updates", "updates", model, updates)
    _check_like("apply_updates", "overwrites", model, overwrites)
    order = (
        "fp8jax.optax_step(optimizer, model, grads, opt_state)"
        if fn == "optax_step"
        else "fp8jax.apply_updates(model, updates, overwrites)"
    )
    overwrites = _check_guards(fn, model, overwrites, order)
    if updates is None:
        updates = jax.tree_util.tree_map(lambda _: None, model, is_leaf=_is_overwrite)
    if overwrites is None:
        overwrites = jax.tree_util.tree_map(lambda _: None, model, is_leaf=_is_overwrite)

    def apply(leaf, update, overwrite):
        if _is_overwrite(leaf):
            if any(x is not None for x in jax.tree_util.tree_leaves(update)):
                raise ValueError(_SWAPPED.format(what="updates hold FP8 state"))
            return leaf if overwrite is None else _merge_state(leaf, overwrite)
        if overwrite is not None:
            raise ValueError(_SWAPPED.format(what="overwrites hold parameter updates"))
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

    Arguments:
        optimizer: an ``optax.GradientTransformation``.
        model: the model the gradients were taken of.
        grads: its gradients (``eqx.filter_grad``'s), the FP8 state's new values included.
        opt_state: the optimizer's state, from ``optimizer.init(fp8jax.trainable(model))``.

    Returns:
        ``(model, opt_state)``: the parameters updated, the FP8 state written, the new
        optimizer state.
    """
    if not callable(getattr(optimizer, "update", None)):
        raise TypeError(
            "optax_step: optimizer must be an optax.GradientTransformation, "
            f"got {type(optimizer).__name__}."
        )
    if grads is None:
        raise ValueError("optax_step: grads is None; expected the gradients of the model.")
    if opt_state is None:
        raise ValueError(
            "optax_step: opt_state is None; create it with optimizer.init(fp8jax.trainable(model))."
        )
    if grads is model:
        raise ValueError(
            "optax_step: grads is the model itself; expected its gradients: "
            "optax_step(optimizer, model, grads, opt_state) with grads from "
            "eqx.filter_value_and_grad(loss)(model, ...)."
        )
    _check_like("optax_step", "gradients", model, grads)
    if any(_is_overwrite(x) for x in jax.tree_util.tree_leaves(opt_state, is_leaf=_is_overwrite)):
        raise ValueError(
            "optax_step: opt_state holds FP8 state; create it with "
            "optimizer.init(fp8jax.trainable(model)), not optimizer.init(model)."
        )
    overwrites, grads = partition_for_grad_overwrite(grads)
    grads = eqx.filter(grads, eqx.is_inexact_array)
    params = trainable(model)
    try:
        updates, opt_state = optimizer.update(grads, opt_state, params)
    except (ValueError, TypeError, AttributeError, KeyError, IndexError) as e:
        structure = isinstance(e, ValueError) and "structure" in str(e)
        if not structure and not _state_mismatch(optimizer, params, opt_state):
            raise
        first = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise ValueError(
            "optax_step: opt_state does not fit this model's trainable parameters and this "
            "optimizer; expected optimizer.init(fp8jax.trainable(model)) with this optimizer "
            f"and model ({first[:200]})."
        ) from e
    return _apply_updates("optax_step", model, updates, overwrites), opt_state


def _state_mismatch(optimizer: Any, params: Any, opt_state: Any) -> bool:
    """Whether ``opt_state``'s structure differs from ``optimizer.init(params)``'s."""
    try:
        expected = jax.eval_shape(optimizer.init, params)
    except Exception:  # noqa: BLE001 - an init that cannot run here: say nothing
        return False
    return jax.tree_util.tree_structure(expected) != jax.tree_util.tree_structure(opt_state)


def accumulate_grads(accumulated: Any, grads: Any) -> Any:
    """Add ``grads`` into ``accumulated`` for gradient accumulation over micro-batches:
    true gradients are summed, FP8 state "gradients" are max-combined (each micro-batch
    proposes the same scales and index and its own amax; the max is the amax of the
    whole batch). ``accumulated=None`` starts a new accumulation.

    Arguments:
        accumulated: the sum so far (None: this is the first micro-batch).
        grads: this micro-batch's gradients.

    Returns:
        The accumulated gradients (scale them with `scale_grads` before the update).
    """
    if accumulated is None:
        return grads
    if grads is None:
        raise ValueError("accumulate_grads: grads is None; expected this micro-batch's gradients.")
    _check_like(
        "accumulate_grads", "gradients", accumulated, grads, ref_name="accumulated gradients"
    )
    accumulated, grads = _check_same_step(accumulated, grads)

    def combine(a, g):
        if _is_overwrite(a):
            return jax.tree_util.tree_map(jnp.maximum, a, g)
        if a is None or g is None:
            return a if g is None else g
        return jax.tree_util.tree_map(jnp.add, a, g)

    return jax.tree_util.tree_map(
        combine, accumulated, grads, is_leaf=lambda x: x is None or _is_overwrite(x)
    )


def _check_same_step(accumulated: Any, grads: Any) -> tuple[Any, Any]:
    """Gradients of one step hold the same FP8 guard (or 0: not entered); a model's is one
    step behind its gradients'. Raises now if concrete; else, by ``FP8JAX_GUARD``: ``nan``
    (default), marks the guards of both trees with code -5 (`fp8jax._guard.mark`: both, as
    the accumulation takes their max), ``raise``, attaches the check; ``off``, nothing."""
    pairs = _guard_pairs(accumulated, grads)
    if not pairs or _guard.mode() == "off":
        return accumulated, grads
    same = [jnp.all((a == g) | (a == 0) | (g == 0)) for a, g in pairs]
    bad = ~jnp.all(jnp.stack(same))
    if _guard.mode() == "nan" and not _guard._concrete(bad):
        return _guard.mark(accumulated, bad, -5.0), _guard.mark(grads, bad, -5.0)
    return _guard.raise_or_attach(accumulated, bad, 0, (_guard.ACCUMULATE,)), grads


def scale_grads(grads: Any, factor: float) -> Any:
    """Multiply the true gradients by ``factor`` (e.g. 1/num_microbatches), leaving
    the FP8 state untouched.

    Arguments:
        grads: gradients of a model holding FP8 layers.
        factor: a finite number (or a scalar array).

    Returns:
        ``grads`` with the true gradients scaled and the FP8 state as it was.
    """
    if isinstance(factor, (str, bytes)) or not (
        isinstance(factor, (int, float)) or hasattr(factor, "dtype")
    ):
        raise TypeError(f"scale_grads: factor={factor!r} is not allowed; expected a number.")
    if isinstance(factor, (int, float)) and not math.isfinite(factor):
        raise ValueError(
            f"scale_grads: factor={factor!r} is not allowed; expected a finite number "
            "(it would make every gradient non-finite)."
        )
    overwrites, true_grads = partition_for_grad_overwrite(grads)
    true_grads = jax.tree_util.tree_map(lambda g: g * factor, true_grads)
    return eqx.combine(overwrites, true_grads, is_leaf=_is_overwrite)
