"""The guard of an FP8 state: a loud error where an optimizer trained the state.

An FP8 layer's state (scales, amax histories) is written back, not trained: its
"gradient" is its new value (`fp8jax.optax_step`, `fp8jax.apply_updates`). The usual
equinox loop (``opt.init(eqx.filter(model, eqx.is_inexact_array))``, then
``eqx.apply_updates``) hands that "gradient" to the optimizer instead, which then trains
the scales and histories as if they were weights, silently.

No layout can hide the state from that loop and still return its new value: both
``eqx.filter_value_and_grad`` and the optimizer's filter select the same
``eqx.is_inexact_array`` leaves, and the new value must come back as a gradient. So the
loop is detected instead. Each `fp8jax.Fp8DotGeneral` carries one more float32 leaf
beside the seven `fp8jax.state.STATE_FIELDS` (whose layout the flax and haliax peers pin):
``guard``, shape ``[*stack, 1]``, one of `VALUES` (2**-20 ... 2**-17). Like the other
fields its "gradient" is its new value, `advance` of it (the next of the four, in a
cycle), combined by max over a step's uses, so `fp8jax.apply_updates` writes it exactly.
An optimizer update moves it off the four values (Adam by about its learning rate, SGD
and weight decay by a relative ``lr``; small powers of two are changed even by a warmup's
first learning rates), and the next forward fails, naming `fp8jax.optax_step`. The cycle
also tells a model from its gradients (these are one step ahead): `fp8jax.apply_updates`,
`fp8jax.optax_step` and `fp8jax.accumulate_grads` reject swapped arguments and a model
passed as its own gradients.

The forward checks the guards where the state is entered, with ``eqx.branched_error_if``:

* in `fp8jax.state.enter_tree` (``fp8jax.enter_state``): once for all the states of the
  tree (a scan over stacked layers: once for the stack, not once per layer);
* else in the op, the first time a guard is used in a trace (a layer used twice in a step
  is checked once).

Cost: each check is one ``lax.cond`` on a scalar predicate (an ``any`` over the guards)
whose true branch raises through a host callback. On a GPU, XLA's conditional copies the
predicate to the host and waits for it: one device->host sync per check, of the order of
10 us each (the GPU's queue drains there). A model whose forward enters its state once
(`fp8jax.enter_state` on the model or on its stacked blocks, as `fp8jax.train` does) pays
one check per step; a model of ``n`` FP8 layers called one by one pays ``n``; under ``jit``
`fp8jax.apply_updates` (and so `fp8jax.optax_step`) adds one, `fp8jax.accumulate_grads`
one per call. ``EQX_ON_ERROR=off`` removes every check.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core

from . import state as _state

F32 = jnp.float32
VALUES = (2.0**-20, 2.0**-19, 2.0**-18, 2.0**-17)  # exact in float32, bfloat16, float16

_HOW = (
    "Use fp8jax.optax_step(optimizer, model, grads, opt_state) with opt_state = "
    "optimizer.init(fp8jax.trainable(model)); or split the gradients with "
    "(overwrites, grads) = fp8jax.partition_for_grad_overwrite(grads), run the optimizer on "
    "grads and fp8jax.trainable(model), and apply both with "
    "fp8jax.apply_updates(model, updates, overwrites)."
)
TRAINED = (
    "fp8jax: the FP8 scaling state (scales, amax histories) of this model was changed by an "
    "optimizer: its guard leaf is no longer one of 2**-20 ... 2**-17. The state's "
    "gradient is its new value, to be written back, not trained (eqx.apply_updates after "
    "optimizer.init(eqx.filter(model, eqx.is_inexact_array)) trains it). " + _HOW + " This "
    "model's FP8 state is corrupted: restore it from a checkpoint or convert the model again."
)
GRADIENTS = (
    "fp8jax: this model's FP8 state looks like a gradient's (its guard leaf is 0): a "
    "gradient tree is used as the model, e.g. model and grads swapped in "
    "fp8jax.optax_step(optimizer, model, grads, opt_state). " + _HOW
)
MESSAGES = (TRAINED, GRADIENTS)


def init(stack_shape: tuple[int, ...] = ()) -> jax.Array:
    """A fresh guard, shape ``[*stack, 1]``."""
    return jnp.full(tuple(stack_shape) + (1,), VALUES[0], F32)


def advance(guard):
    """The guard's next value: the next of `VALUES`, in a cycle (its "gradient")."""
    return jnp.where(guard == VALUES[-1], jnp.asarray(VALUES[0], F32), guard * 2)


def guard_of(module: Any):
    """``module``'s guard array (float32, or `MAX_GRAD` once entered); None if it has none
    (a state of the flax adapters, of a model saved before guards, or of another kind)."""
    guard = getattr(module, "guard", None)
    return guard if hasattr(guard, "dtype") else None


def _float(x):
    x = jnp.asarray(x)
    return lax.convert_element_type(x, F32) if x.dtype == _state.MAX_GRAD else x


def valid(guard):
    """Elementwise: whether ``guard`` is one of `VALUES` (a pure function)."""
    guard = _float(guard)
    return functools.reduce(jnp.logical_or, [guard == v for v in VALUES])


def verdict(guards) -> tuple[jax.Array, jax.Array]:
    """``(bad, index)`` for a sequence of guards (a pure function): ``bad``, whether any is
    not one of `VALUES` (NaN included); ``index`` into `MESSAGES`: 1 where one is 0 (what
    a gradient holds for a state no op entered), else 0 (changed by an optimizer)."""
    flat = [jnp.ravel(_float(g)) for g in guards]
    if not flat:
        return jnp.asarray(False), jnp.asarray(0, jnp.int32)
    values = jnp.concatenate(flat)
    return jnp.any(~valid(values)), jnp.any(values == 0).astype(jnp.int32)


# ----------------------------------------------------------------------------- the check
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _checked(sizes: tuple[int, ...], leaves: tuple, guards: tuple) -> tuple:
    """``leaves`` (entered state, `MAX_GRAD`; ``sizes[i]`` of them for ``guards[i]``) as
    they are, with the check of the (entered) ``guards`` attached: every op using them
    depends on it. A guard's cotangent is its `advance` (its proposal) where an op proposed
    a new state for its leaves, else 0 (nothing proposed: the state stays as it was)."""
    del sizes
    floats = eqx.branched_error_if(tuple(map(_float, leaves)), *verdict(guards), MESSAGES)
    return tuple(lax.convert_element_type(f, x.dtype) for f, x in zip(floats, leaves, strict=True))


def _checked_fwd(sizes, leaves, guards):
    return _checked(sizes, leaves, guards), tuple(map(_float, guards))


def _checked_bwd(sizes, guards, cts):
    proposals, start = [], 0
    for size, guard in zip(sizes, guards, strict=True):
        stack = guard.ndim - 1
        proposed = jnp.zeros(guard.shape[:stack], bool)
        for ct in cts[start : start + size]:  # -inf: MAX_GRAD's zero, no use proposed
            ct = _float(ct)
            proposed = proposed | jnp.any(ct != -jnp.inf, axis=tuple(range(stack, ct.ndim)))
        start += size
        proposals.append(jnp.where(proposed[..., None], advance(guard), 0.0))
    return tuple(cts), _state.proposal(tuple(proposals))


_checked.defvjp(_checked_fwd, _checked_bwd)

# Entered guard -> a value of the trace that checked it (weak, as `fp8jax.state`'s cache).
_CHECKED: dict[int, tuple[weakref.ref, Any]] = {}


def _seen(guard) -> bool:
    """Whether ``guard`` was checked in this trace already (a layer used twice)."""
    entry = _CHECKED.get(id(guard)) if isinstance(guard, core.Tracer) else None
    if entry is None or entry[0]() is not guard:
        return False
    return _state._valid(getattr(entry[1], "_trace", None))


def _remember(guards, token) -> None:
    for guard in guards:
        if isinstance(guard, core.Tracer):
            key = id(guard)
            ref = weakref.ref(guard, lambda _, key=key, checked=_CHECKED: checked.pop(key, None))
            _CHECKED[key] = (ref, token)


def check(groups: list[tuple[tuple, Any]]) -> tuple:
    """The entered state leaves of ``groups`` (``(leaves, entered guard)`` pairs), all in
    one tuple, with one check of the guards not checked in this trace yet attached."""
    groups = [(tuple(leaves), g) for leaves, g in groups if not _seen(g) and leaves]
    flat = tuple(x for leaves, _ in groups for x in leaves)
    if not groups:
        return flat
    sizes = tuple(len(leaves) for leaves, _ in groups)
    out = _checked(sizes, flat, tuple(g for _, g in groups))
    _remember([g for _, g in groups], out[0])
    return out


def op_state(module: Any) -> tuple:
    """An `fp8jax.Fp8DotGeneral`'s seven state arrays, entered (`fp8jax.state.enter`) with
    its guard, and checked (once per trace), unless `fp8jax.state.enter_tree` entered and
    checked the guard already (a `MAX_GRAD` guard)."""
    fields = module.state()
    guard = guard_of(module)
    if guard is None or guard.dtype == _state.MAX_GRAD:
        return _state.enter(fields)
    entered = _state.enter(fields + (guard,))
    if _seen(entered[-1]):
        return entered[:-1]
    return check([(entered[:-1], entered[-1])])


def _is_state(x) -> bool:
    return isinstance(x, _state.OverwriteWithGradient)


def check_entered_tree(tree: Any) -> Any:
    """``tree``, entered by `fp8jax.state.enter_tree`, with one check of the guards of all
    its states attached to their entered leaves."""
    states = [x for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_state) if _is_state(x)]
    guarded = [s for s in states if guard_of(s) is not None and not _seen(guard_of(s))]
    if not guarded:
        return tree
    groups = [
        (tuple(x for x in jax.tree_util.tree_leaves(s) if x is not guard_of(s)), guard_of(s))
        for s in guarded
    ]
    out = iter(check(groups))
    replaced = {}
    for s in guarded:
        flat, treedef = jax.tree_util.tree_flatten(s)
        guard = guard_of(s)
        new = [x if x is guard else next(out) for x in flat]
        replaced[id(s)] = jax.tree_util.tree_unflatten(treedef, new)
    return jax.tree_util.tree_map(lambda x: replaced.get(id(x), x), tree, is_leaf=_is_state)


# ----------------------------------------------------------------------------- trees
def guarded_states(tree: Any) -> list:
    """The FP8 states with a guard in ``tree`` (a model, or gradients of one), in order."""
    states = jax.tree_util.tree_leaves(tree, is_leaf=_is_state)
    return [x for x in states if _is_state(x) and guard_of(x) is not None]


def _concrete(*arrays) -> bool:
    return not any(isinstance(a, core.Tracer) for a in arrays)


def raise_or_attach(x, bad, index: int, messages: tuple[str, ...]):
    """Raise ``messages[index]`` now where ``bad`` is concrete (a ValueError), else attach
    the check to ``x`` (raised when the compiled program runs)."""
    if _concrete(bad):
        if bool(np.asarray(bad)):
            raise ValueError(messages[index])
        return x
    return eqx.error_if(x, bad, messages[index])
