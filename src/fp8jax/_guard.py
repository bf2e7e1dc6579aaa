"""The guard of an FP8 state: a NaN loss or an error where an optimizer trained the state.

An FP8 layer's state (scales, amax histories) is written back, not trained: its
"gradient" is its new value (`fp8jax.optax_step`, `fp8jax.apply_updates`). The usual
equinox loop (``opt.init(eqx.filter(model, eqx.is_inexact_array))``, then
``eqx.apply_updates``) hands that "gradient" to the optimizer instead, which then trains
the scales and histories as if they were weights, silently.

No layout can hide the state from that loop and still return its new value: both
``eqx.filter_value_and_grad`` and the optimizer's filter select the same
``eqx.is_inexact_array`` leaves, and the new value must come back as a gradient. So the
loop is detected instead. Each FP8 state carries one more float32 leaf, last:
`fp8jax.Fp8DotGeneral` beside the seven `fp8jax._state.STATE_FIELDS` (whose layout the flax
and haliax peers pin), and so do `fp8jax.nn.Fp8GroupedState` and `fp8jax.nn.Fp8AttentionState`
(since 2026-11-28; a trainer checkpoint from before restores with fresh guards):
``guard``, shape ``[*stack, 1]``, one of `VALUES` (2**-20 ... 2**-17). Like the other
fields its "gradient" is its new value, `advance` of it (the next of the four, in a
cycle), combined by max over a step's uses, so `fp8jax.apply_updates` writes it exactly.
An optimizer update moves it off the four values (Adam by about its learning rate, SGD
and weight decay by a relative ``lr``; small powers of two are changed even by a warmup's
first learning rates), and the next forward fails (below). The cycle
also tells a model from its gradients (these are one step ahead): `fp8jax.apply_updates`,
`fp8jax.optax_step` and `fp8jax.accumulate_grads` reject swapped arguments and a model
passed as its own gradients.

What a failed check does depends on ``FP8JAX_GUARD`` (read when a function is traced):

* ``nan`` (the default): no check stops the program, and none costs a device->host sync.
  Each op adds a poison scalar to its GEMM output (``-0.0`` where its guard is valid, NaN
  where not; XLA fuses the add into the output's consumer), so a model whose state an
  optimizer trained gives a NaN output and loss from the first step after. Under ``jit``,
  `fp8jax.apply_updates` / `fp8jax.optax_step` / `fp8jax.accumulate_grads` write what they
  found (swapped arguments, a model passed as gradients) into the guards of the state they
  write back, as a negative code (`CODES`), so the state stays marked. Where the values are
  concrete (outside ``jit``, an op called outside any transformation) they raise at once.
  `check_state` (``fp8jax.check_state(model)``) reads the guards on the host and raises
  the message: run it to see why a loss became NaN.
* ``raise``: the forward checks the guards where the state is entered, with
  ``eqx.branched_error_if``: in `enter_tree` (``fp8jax.enter_state``), once
  for all the states of the tree (a scan over stacked layers: once for the stack); else in
  the op, the first time a guard is used in a trace (a layer used twice is checked once);
  under ``jit`` `fp8jax.apply_updates` (and so `fp8jax.optax_step`) adds one check,
  `fp8jax.accumulate_grads` one per call. Cost: each check is one ``lax.cond`` whose true
  branch raises through a host callback; on a GPU, XLA's conditional copies the predicate
  to the host and waits for it: one device->host sync per check, and the host can no longer
  run ahead of the device: a fixed cost per check per step, large next to a small step's
  (benchmarks/RESULTS.md, "The FP8 state guard's cost (issues 44 and 45)").
  ``EQX_ON_ERROR=off`` removes these checks.
* ``off``: no check and no poison (the guards still cycle).
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import core, lax

from . import _state

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
_ORDER = (
    "fp8jax.optax_step(optimizer, model, grads, opt_state) (or "
    "fp8jax.apply_updates(model, updates, overwrites))"
)


def step_messages(fn: str, order: str) -> tuple[str, str, str, str]:
    """What `fp8jax.apply_updates` / `fp8jax.optax_step` (``fn``, argument ``order``) found:
    the model's state trained, the model holds gradients, the model passed as its own
    gradients, the model one step ahead (indices 0..3; codes -1..-4 in `CODES`)."""
    return (
        f"{fn}: " + TRAINED.removeprefix("fp8jax: "),
        f"{fn}: the model holds gradients, not a model (its FP8 guard leaf is 0): model "
        f"and grads swapped? The order is {order}.",
        f"{fn}: the gradients hold the model's own FP8 state of this step (their guard leaf "
        "equals the model's, where gradients hold the next one): the model passed as its "
        f"gradients, or gradients of the previous step? The order is {order}, with grads "
        "from eqx.filter_value_and_grad(loss)(model, ...).",
        f"{fn}: the model's FP8 state is one step ahead of the gradients' (guard leaves): "
        f"model and grads swapped? The order is {order}.",
    )


ACCUMULATE = (
    "accumulate_grads: accumulated and grads hold FP8 state of different steps (their "
    "guard leaves differ): one of them is a model, not gradients. Pass "
    "accumulate_grads(accumulated, grads), both gradients of the same model, with "
    "accumulated=None for the first micro-batch."
)
# Negative guard values written under jit in ``nan`` mode (`mark`): code -> message.
_FOUND = "fp8jax.optax_step / fp8jax.apply_updates (under jit; the guard leaf holds its code)"
CODES = dict(zip((-1.0, -2.0, -3.0, -4.0, -5.0), (*step_messages(_FOUND, _ORDER), ACCUMULATE)))

ENV = "FP8JAX_GUARD"
MODES = ("nan", "raise", "off")


def mode() -> str:
    """The guard mode, ``$FP8JAX_GUARD`` (read at trace time): ``nan`` (default), ``raise``
    or ``off``."""
    value = os.environ.get(ENV, "").strip().lower() or "nan"
    if value not in MODES:
        raise ValueError(
            f"{ENV}={os.environ.get(ENV)!r} is not allowed; expected one of: nan (the "
            "default: a trained FP8 state makes the loss NaN, no device->host sync), raise "
            "(an error, one lax.cond + device->host sync per check, ~0.15 ms per step on an "
            "H200), off (no check)."
        )
    return value


def init(stack_shape: tuple[int, ...] = ()) -> jax.Array:
    """A fresh guard, shape ``[*stack, 1]``."""
    return jnp.full(tuple(stack_shape) + (1,), VALUES[0], F32)


def advance(guard):
    """The guard's next value: the next of `VALUES`, in a cycle (its "gradient"); a negative
    one (a code of `CODES`, or trained below 0) stays."""
    guard = jnp.asarray(guard)
    if guard.dtype != F32:
        next_ = jnp.where(guard < 0, guard, guard * 2)
        return jnp.where(guard == VALUES[-1], jnp.asarray(VALUES[0], F32), next_)
    # lax ops (a jnp.where is a nested jit to trace, per layer: issue 21)
    next_ = lax.select(lax.lt(guard, F32(0)), guard, lax.mul(guard, F32(2)))
    return lax.select(lax.eq(guard, F32(VALUES[-1])), lax.full_like(guard, VALUES[0]), next_)


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
    if not jnp.issubdtype(guard.dtype, jnp.floating):
        guard = guard.astype(F32)
    values = [np.array(v, guard.dtype) for v in VALUES]
    return functools.reduce(lax.bitwise_or, [lax.eq(guard, v) for v in values])


def verdict(guards) -> tuple[jax.Array, jax.Array]:
    """``(bad, index)`` for a sequence of guards (a pure function): ``bad``, whether any is
    not one of `VALUES` (NaN included); ``index`` into `MESSAGES`: 1 where one is 0 (what
    a gradient holds for a state no op entered), else 0 (changed by an optimizer)."""
    flat = [jnp.ravel(_float(g)) for g in guards]
    if not flat:
        return jnp.asarray(False), jnp.asarray(0, jnp.int32)
    values = lax.concatenate(flat, 0) if len(flat) > 1 else flat[0]
    bad = lax.bitwise_not(lax.reduce_and(valid(values), (0,)))
    zero = lax.reduce_or(lax.eq(values, lax.full_like(values, 0)), (0,))
    return bad, lax.convert_element_type(zero, jnp.int32)


# ----------------------------------------------------------------------------- the check
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _checked(sizes: tuple[int, ...], raising: bool, leaves: tuple, guards: tuple) -> tuple:
    """``leaves`` (entered state, `MAX_GRAD`; ``sizes[i]`` of them for ``guards[i]``) as
    they are, with the check of the (entered) ``guards`` attached where ``raising`` (mode
    ``raise``): every op using them depends on it. A guard's cotangent is its `advance` (its
    proposal) where an op proposed a new state for its leaves, else 0 (nothing proposed: the
    state stays as it was). In the other modes the forward is the identity; the backward,
    the same (the guards keep cycling)."""
    del sizes
    if not raising:
        return tuple(leaves)
    floats = eqx.branched_error_if(tuple(map(_float, leaves)), *verdict(guards), MESSAGES)
    return tuple(lax.convert_element_type(f, x.dtype) for f, x in zip(floats, leaves, strict=True))


def _checked_fwd(sizes, raising, leaves, guards):
    return _checked(sizes, raising, leaves, guards), tuple(map(_float, guards))


def _checked_bwd(sizes, raising, guards, cts):
    proposals, start = [], 0
    for size, guard in zip(sizes, guards, strict=True):
        stack = guard.ndim - 1
        # -inf: MAX_GRAD's zero, no use proposed. An op proposes all its state's leaves at
        # once, the first (a scale: the one used, always > 0) among them, so it alone tells:
        # one comparison (a program's size grows with each op per leaf), and no leaf split
        # over a mesh axis is read (an expert-parallel state's per-expert leaves: reshaping
        # them together moved them in all-to-alls).
        first = _float(cts[start]).reshape(guard.shape[:stack] + (-1,))
        proposed = lax.reduce_or(lax.ne(first, F32(-np.inf)), (stack,))
        proposed = lax.broadcast_in_dim(proposed, guard.shape, tuple(range(stack)))
        start += size
        advanced = advance(guard)
        proposals.append(lax.select(proposed, advanced, lax.full_like(advanced, 0)))
    return tuple(cts), _state.proposal(tuple(proposals))


_checked.defvjp(_checked_fwd, _checked_bwd)

# Entered guard -> a value of the trace that checked it (weak, as `fp8jax._state`'s cache).
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
    out = _checked(sizes, mode() == "raise", flat, tuple(g for _, g in groups))
    _remember([g for _, g in groups], out[0])
    return out


def poison_if(bad) -> jax.Array:
    """A float32 scalar to add to an output: NaN where ``bad``, else ``-0.0`` (``x + -0.0`` is
    ``x``, signed zeros included). A loud result without a device->host sync."""
    bad = jnp.asarray(bad, bool)
    return lax.select(bad, lax.full(bad.shape, np.nan, F32), lax.full(bad.shape, -0.0, F32))


def add_poison(y, poison):
    """``y`` plus ``poison`` (`poison_if`'s scalar) outside the gradient (the backward does
    no reduction for it); ``y`` as it is where ``poison`` is None."""
    if poison is None:
        return y
    poison = lax.convert_element_type(lax.stop_gradient(poison), y.dtype)
    return lax.add(y, poison) if jnp.ndim(poison) == 0 else y + poison


def _poison(guard) -> jax.Array:
    """`poison_if` of an invalid value in ``guard`` (float32 or `MAX_GRAD`). No cotangent:
    the guard is read as float32 behind a ``stop_gradient`` (no custom VJP to trace per op)."""
    ok = valid(lax.stop_gradient(_float(guard)))
    return poison_if(lax.bitwise_not(lax.reduce_and(ok, tuple(range(ok.ndim)))))


def _op_poison(entered, guard):
    """Mode ``nan``: the poison of the op's ``entered`` guard (`_poison`), raising now where
    ``guard`` is concrete and invalid; else None (nothing to add)."""
    if mode() != "nan":
        return None
    if _concrete(guard):
        _raise_first_invalid([np.asarray(_float(guard))], "")
    return _poison(entered)


def op_state(module: Any) -> tuple[tuple, jax.Array | None]:
    """``(state, poison)``: an `fp8jax.Fp8DotGeneral`'s seven state arrays, entered
    (`fp8jax._state.enter`) with its guard, and checked (mode ``raise``, once per trace),
    unless `enter_tree` entered (and checked) the guard already (a `MAX_GRAD`
    guard); ``poison`` (mode ``nan``, else None): a float32 scalar to add to the op's output,
    ``-0.0`` where the guard is valid, NaN where not (`_poison`)."""
    fields = module.state()
    guard = guard_of(module)
    if guard is None:
        return _state.enter(fields), None
    if guard.dtype == _state.MAX_GRAD:
        return _state.enter(fields), _op_poison(guard, guard)
    entered = _state.enter(fields + (guard,))
    if _seen(entered[-1]):
        return entered[:-1], _op_poison(entered[-1], guard)
    return check([(entered[:-1], entered[-1])]), _op_poison(entered[-1], guard)


def _is_state(x) -> bool:
    return isinstance(x, _state.OverwriteWithGradient)


def enter_tree(tree: Any) -> Any:
    """``tree`` with the leaves of every FP8 state in it `enter`ed (``fp8jax.enter_state``):
    what to pass into a ``jax.checkpoint`` region (a state passed in as float32 would become
    a new leaf inside, and its uses in two regions would add), and into a ``lax.scan`` over
    stacked layers: the conversion and its backward then run once on the ``[layers, ...]``
    arrays instead of once per layer, which an unrolled scan repeats per layer (fewer HLO
    instructions, faster compiles; same values). The guards of the states it enters are
    checked here, once, not again in each op (`check_entered_tree`).

    Arguments:
        tree: a model, or any pytree holding FP8 states (stacked ones included).

    Returns:
        ``tree`` with each FP8 state entered; other leaves as they were.
    """
    return check_entered_tree(_state.enter_states(tree))


def check_entered_tree(tree: Any) -> Any:
    """``tree``, entered by `fp8jax._state.enter_states`, with one check of the guards of all
    its states attached to their entered leaves (mode ``raise``; in mode ``nan`` no check:
    the ops poison their outputs from their entered guards)."""
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


def raise_or_attach(x, bad, index, messages: tuple[str, ...], keep_from=None):
    """Raise ``messages[index]`` now where ``bad`` and ``index`` are concrete (a ValueError).
    Else (under jit) by mode: ``raise``, attach the check to ``x`` (one ``lax.cond``, raised
    when the compiled program runs); ``nan``, `mark` ``x``'s guards with code
    ``-1 - index`` (a code already in ``x`` or ``keep_from`` stays); ``off``: ``x``."""
    if _concrete(bad, index):
        if bool(np.asarray(bad)):
            raise ValueError(messages[int(np.asarray(index))])
        return x
    how = mode()
    if how == "raise":
        return eqx.branched_error_if(x, bad, index, messages)
    if how == "off":
        return x
    return mark(x, bad, -1.0 - jnp.asarray(index, F32), keep_from)


def _code(guard):
    """Elementwise: ``guard`` where it holds a code of `CODES`, else 0."""
    guard = _float(guard)
    is_code = functools.reduce(jnp.logical_or, [guard == c for c in CODES])
    return jnp.where(is_code, guard, 0.0)


def mark(tree, bad, code, keep_from=None):
    """``tree`` with every guard of its guarded states set to ``code`` (a negative float of
    `CODES`) where ``bad``: the verdict of a check under jit in mode ``nan``, written back
    into the model by `fp8jax.apply_updates`. A code already in the guards of ``tree`` or
    ``keep_from`` (the model) stays (the lowest one): the first reason is kept."""
    code = jnp.asarray(code, F32)
    olds = [guard_of(s) for s in guarded_states(tree) + guarded_states(keep_from)]
    if olds:  # one pass over all guards (a program's size grows with each op per guard)
        prior = jnp.min(_code(jnp.concatenate([jnp.ravel(_float(g)) for g in olds])))
        code = jnp.where(prior < 0, prior, code)

    def visit(x):
        if not _is_state(x) or guard_of(x) is None:
            return x
        g = guard_of(x)
        if g.dtype == F32 and jnp.ndim(bad) == 0:  # lax: no nested jit to trace per layer
            new = lax.select(bad, lax.broadcast_in_dim(code, g.shape, ()), g)
        else:
            new = jnp.where(bad, code, g).astype(g.dtype)
        return eqx.tree_at(lambda s: s.guard, x, new)

    return jax.tree_util.tree_map(visit, tree, is_leaf=_is_state)


# ----------------------------------------------------------------------------- host side
def _message(value: float) -> str:
    """The message for an invalid guard value: its code's, 0's, else "trained"."""
    if value in CODES:
        return CODES[value]
    return GRADIENTS if value == 0 else TRAINED


def _raise_first_invalid(guards: list, where: str) -> None:
    """Raise the ValueError of the first invalid value of the host arrays ``guards``."""
    for guard in guards:
        values = np.ravel(np.asarray(guard, np.float32))
        bad = ~np.isin(values, np.asarray(VALUES, np.float32))
        if bad.any():
            value = float(values[np.argmax(bad)])
            text = _message(value).removeprefix("fp8jax: ")
            raise ValueError(f"{where}{text} (guard leaf: {value!r})")


def check_state(model: Any) -> None:
    """Check, on the host, the guards of the FP8 states of ``model`` (`fp8jax._guard`).

    With ``FP8JAX_GUARD=nan`` (the default) a model whose FP8 state an optimizer trained,
    or which `fp8jax.optax_step` / `fp8jax.apply_updates` / `fp8jax.accumulate_grads` got
    with swapped arguments under ``jit``, trains on with a NaN loss instead of raising (no
    device->host sync per step). Run ``fp8jax.check_state(model)`` to see why a loss became
    NaN; it reads every guard (one transfer: call it outside ``jit``, e.g. when a loss is
    not finite).

    Arguments:
        model: a model (any pytree) holding FP8 layers (`fp8jax.Fp8DotGeneral`); states
            without a guard (the adapters', older models') are not checked.

    Returns:
        None when every guard is valid.

    Raises:
        ValueError: for the first state whose guard is not valid, with what went wrong and
            what to do: its state was changed by an optimizer (use `fp8jax.optax_step`, or
            `fp8jax.partition_for_grad_overwrite` with `fp8jax.trainable`), or the model
            holds gradients, was passed as its own gradients, or was swapped with them.
        TypeError: if called under a JAX transformation (its values are not known there).
    """
    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_state)[0]
    states = [(p, x) for p, x in flat if _is_state(x) and guard_of(x) is not None]
    guards = [guard_of(x) for _, x in states]
    if not _concrete(*guards):
        raise TypeError(
            "fp8jax.check_state runs on the host: call it outside jit / grad / vmap, on the "
            "model a step returned."
        )
    guards = jax.device_get([_float(g) for g in guards])
    for (path, _), guard in zip(states, guards, strict=True):
        where = jax.tree_util.keystr(path) or "the model"
        _raise_first_invalid([guard], f"fp8jax.check_state: FP8 state at {where}: ")
