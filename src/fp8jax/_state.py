"""The FP8 state's combine rule: several uses of one layer in a step merge by max.

An FP8 op returns its layer's new state (scales, amax histories) as the state's
"gradient". JAX adds the gradients of a value used several times, which for the state
would add amaxes and scales. Here the state enters every op as `MAX_GRAD` values: a
float32 whose cotangents add by ``max`` (flax's ``fp32_max_grad`` idea). Each use
proposes the state it would write; autodiff, ``vmap``, ``scan`` and ``checkpoint``
then combine the proposals by max, by construction: the same scales and slots, and in
the newest history slot the largest amax any use saw.

A model stores its state as plain float32 (optimizers, checkpoints and ``jax.grad``
take no other dtype), so each state leaf is converted once per trace, in the trace the
leaf lives in (`enter`). Every use inside that trace, whether in a ``vmap``, the body of
a ``scan`` or a ``checkpoint`` closing over the layer, then shares one ``MAX_GRAD``
value, and the max happens before the float32 leaf gets its one cotangent.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import core, lax
from jaxtyping import Array

from . import _jax_compat

F32 = jnp.float32
# The per-tensor GEMM state, in this order in every op's state tuple.
STATE_FIELDS = (
    "input_scale",
    "kernel_scale",
    "output_grad_scale",
    "input_amax_history",
    "kernel_amax_history",
    "output_grad_amax_history",
    "nonfinite_count",
)


# ----------------------------------------------------------------------------- classes
class OverwriteWithGradient(eqx.Module):
    """Marker base class: every array leaf of such a module is *state* whose gradient is
    its new value (haliax's convention). `partition_for_grad_overwrite` pulls these
    out of the gradients; `apply_updates` writes them back.

    Arguments:
        none: subclass it; the subclass's array fields are the state.
    """

    def ran_mask(self) -> Array | None:
        """``[*stack, 1]`` bools: which (stacked) states hold a new value in a gradient
        (a state that did not run gets all-zero "gradients"); None: all of them."""
        return None


class Fp8GemmState(OverwriteWithGradient):
    """Base of the FP8 GEMM states (`Fp8DotGeneral`, `fp8jax.nn.Fp8GroupedState`): the
    seven fields of `STATE_FIELDS`, stacked layers along leading dims."""

    def ran_mask(self) -> Array:
        # A layer that did not run gets all-zero "gradients"; one that ran proposes the
        # scale it used, always positive: a 0, negative or non-finite scale in the state is
        # repaired before use (`fp8jax._quant.scale_from_limit`), so a state holding
        # ``input_scale=0`` is written again the next time its layer runs.
        return self.input_scale > 0

    def state(self) -> tuple[Array, ...]:
        return tuple(getattr(self, name) for name in STATE_FIELDS)


def init_fields(
    length: int, stack_shape: tuple[int, ...] = (), experts: int | None = None
) -> dict[str, Array]:
    """Fresh values of the seven `STATE_FIELDS`: scales 1, histories of ``length`` zeros
    (`fp8jax._recipe_base.Recipe.init_state` says how long). With ``experts``, the kernel's
    scale and history get a trailing ``[experts]`` dim (one per expert,
    `fp8jax.nn.Fp8GroupedState`)."""
    kernel = () if experts is None else (experts,)

    # A fresh buffer per field: shared ones could not be donated to a jitted step.
    def ones(shape):
        return jnp.ones(stack_shape + shape, jnp.float32)

    def zeros(shape):
        return jnp.zeros(stack_shape + shape, jnp.float32)

    return dict(
        input_scale=ones((1,)),
        kernel_scale=ones(kernel or (1,)),
        output_grad_scale=ones((1,)),
        input_amax_history=zeros((length,)),
        kernel_amax_history=zeros((length,) + kernel),
        output_grad_amax_history=zeros((length,)),
        nonfinite_count=zeros((1,)),
    )


# ----------------------------------------------------------------------------- combine rule


class _MaxGradRules:
    """JAX extended-dtype rules: float32 storage; cotangents add by max, zero is -inf."""

    @staticmethod
    def physical_element_aval(dtype) -> core.ShapedArray:
        return core.ShapedArray((), dtype.float_dtype)

    @staticmethod
    def convert_from(max_grad_dtype, other_dtype) -> bool:
        return max_grad_dtype.float_dtype == other_dtype

    @staticmethod
    def convert_to(other_dtype, max_grad_dtype) -> bool:
        return max_grad_dtype.float_dtype == other_dtype

    @staticmethod
    def add(dt, x, y):
        to_float = partial(lax.convert_element_type, new_dtype=dt.float_dtype)
        return lax.convert_element_type(lax.max(to_float(x), to_float(y)), dt)

    @staticmethod
    def zero(dt):
        return lax.convert_element_type(np.array(-np.inf, dt.float_dtype), dt)

    @staticmethod
    def tangent_dtype(dtype):
        return dtype

    @staticmethod
    def full(shape, fill_value, dtype):
        value = lax.convert_element_type(fill_value, dtype.float_dtype)
        return lax.convert_element_type(lax.full(shape, value, dtype.float_dtype), dtype)

    @staticmethod
    def global_sharded_result_handler(aval, out_sharding, committed):
        physical = _jax_compat.global_result_handlers[core.ShapedArray](
            _jax_compat.physical_aval(aval), out_sharding, committed
        )
        return lambda bufs: _jax_compat.EArray(aval, physical(bufs))


class max_grad(jax.dtypes.extended):  # noqa: N801  (a dtype's scalar type, as jax names them)
    """Scalar type of `MAX_GRAD` (for ``jnp.issubdtype``)."""


@dataclasses.dataclass(frozen=True)
class _MaxGradDType(_jax_compat.ExtendedDType):
    float_dtype: np.dtype
    _rules: type = _MaxGradRules
    type: type = max_grad

    @property
    def name(self) -> str:
        return "fp8jax_max_grad32"

    def __repr__(self) -> str:
        return self.name


MAX_GRAD = _MaxGradDType(np.dtype(np.float32))


@jax.jit
def _add_eagerly(x, y):
    return _MaxGradRules.add(x.dtype, x, y)


def _register_eager_add() -> None:
    """Outside ``jit`` JAX adds cotangents by the array's Python type; an extended-dtype
    array has none registered (jax 0.10-0.11), so add `MAX_GRAD` arrays under ``jit``
    (a JAX without that table: under ``jit`` only)."""
    _jax_compat.add_eager_adder(_add_eagerly)


_register_eager_add()

# Leaf -> its MAX_GRAD value, per trace (weak: entries go with their tracers).
_ENTERED: dict[int, tuple[weakref.ref, jax.Array]] = {}


@jax.custom_vjp
def _to_max_grad(leaves: tuple) -> tuple:
    """float32 leaves -> `MAX_GRAD` values: one custom VJP for all new leaves of a state
    (one per leaf meant seven per op to trace: about a tenth of a small FP8 step's lowering
    time on the CPU)."""
    return tuple(lax.convert_element_type(leaf, MAX_GRAD) for leaf in leaves)


def _to_max_grad_fwd(leaves):
    return _to_max_grad(leaves), leaves


def _to_max_grad_bwd(leaves, combined):
    # No use proposed (every use ran in the input precision): the gradient is the old state.
    grads = []
    for leaf, ct in zip(leaves, combined, strict=True):
        ct = lax.convert_element_type(ct, F32)
        grads.append(lax.select(lax.eq(ct, F32(-np.inf)), lax.convert_element_type(leaf, F32), ct))
    return (tuple(grads),)


_to_max_grad.defvjp(_to_max_grad_fwd, _to_max_grad_bwd)


def _valid(trace) -> bool:
    is_valid = getattr(trace, "is_valid", None)
    return is_valid() if callable(is_valid) else True


def _entered(leaf):
    """``leaf``'s `MAX_GRAD` value if it needs no conversion or has one in this trace."""
    if getattr(leaf, "dtype", None) == MAX_GRAD:
        return leaf
    entry = _ENTERED.get(id(leaf)) if isinstance(leaf, core.Tracer) else None
    if entry is not None and entry[0]() is leaf and _valid(getattr(entry[1], "_trace", None)):
        return entry[1]
    return None


def _convert(leaves: list) -> dict[int, jax.Array]:
    """``id(leaf) -> MAX_GRAD value`` for float32-able ``leaves``: one `_to_max_grad` call
    per trace they live in, recorded in `_ENTERED` (so every later use shares the value)."""
    groups: dict[int, list] = {}
    for leaf in leaves:
        groups.setdefault(id(getattr(leaf, "_trace", None)), []).append(leaf)
    converted = {}
    for group in groups.values():
        if not isinstance(group[0], core.Tracer):
            values = _to_max_grad(tuple(jnp.asarray(leaf, F32) for leaf in group))
        else:
            with _jax_compat.set_current_trace(group[0]._trace):
                values = _to_max_grad(tuple(leaf.astype(F32) for leaf in group))
            for leaf, value in zip(group, values, strict=True):
                key = id(leaf)
                _ENTERED[key] = (
                    weakref.ref(leaf, lambda _, key=key, entered=_ENTERED: entered.pop(key, None)),
                    value,
                )
        converted.update(zip(map(id, group), values))
    return converted


def _enter_leaves(leaves) -> list:
    """`MAX_GRAD` values of ``leaves``: cached ones as they are, the others converted in one
    call (a leaf listed twice once: its uses then combine by max)."""
    values = [_entered(leaf) for leaf in leaves]
    new = {id(leaf): leaf for leaf, value in zip(leaves, values) if value is None}
    converted = _convert(list(new.values()))
    return [converted[id(leaf)] if value is None else value for leaf, value in zip(leaves, values)]


def enter(state: tuple) -> tuple:
    """The float32 state leaves as `MAX_GRAD` values (one conversion per leaf per trace,
    all of a state's new leaves in one call): what every FP8 op takes as its state
    argument."""
    return tuple(_enter_leaves(list(state)))


def enter_states(tree):
    """``tree`` with the leaves of every FP8 state in it `enter`ed; `fp8jax._guard.enter_tree`
    (``fp8jax.enter_state``) adds the check of their guards."""

    def is_state(x):
        return isinstance(x, OverwriteWithGradient)

    def enter_state(x):
        if not is_state(x):
            return x
        leaves, treedef = jax.tree_util.tree_flatten(x)
        return jax.tree_util.tree_unflatten(treedef, _enter_leaves(leaves))

    return jax.tree_util.tree_map(enter_state, tree, is_leaf=is_state)


def values(state: tuple) -> tuple:
    """`MAX_GRAD` state -> float32, for the math inside an op."""
    return tuple(lax.convert_element_type(s, F32) if s.dtype == MAX_GRAD else s for s in state)


def proposal(new_state: tuple) -> tuple:
    """An op's new float32 state as the `MAX_GRAD` cotangent of its state argument.

    Behind an optimization barrier: in a model whose layers are stacked and unrolled, each
    layer's state math would otherwise be fused (and duplicated) into the few kernels that
    stack every layer's new state, and XLA's fusion passes slow down on those large
    kernels. The barrier keeps one layer's math in that layer's kernels: the 1b trainer's
    FP8 step compiles faster and runs as fast (benchmarks/RESULTS.md, tenth session, "the
    state barrier")."""
    new_state = lax.optimization_barrier(tuple(jnp.asarray(s, F32) for s in new_state))
    return tuple(lax.convert_element_type(s, MAX_GRAD) for s in new_state)


def no_proposal(state: tuple) -> tuple:
    """The cotangent of a use that leaves the state as it is (a GEMM that ran in the input
    precision): `MAX_GRAD`'s zero, -inf, which any other use's proposal outweighs. If no
    use proposes, the leaf's gradient is its old value: the state stays as it was."""
    return proposal(tuple(jnp.full(jnp.shape(s), -jnp.inf, F32) for s in state))


def valid_amax(x) -> Array:
    """Where ``x`` is a usable amax: finite and >= 0 (NaN, Inf and negative entries of a
    history are corrupt state, treated as missing)."""
    x = jnp.asarray(x, F32)
    return lax.bitwise_and(lax.ge(x, F32(0)), lax.lt(x, F32(np.inf)))


def clean_amax(x) -> Array:
    """``x`` with the entries `valid_amax` rejects set to 0 (a missing amax)."""
    return checked_amax(x)[1]


def checked_amax(x) -> tuple[Array, Array]:
    """``(valid_amax(x), clean_amax(x))``, the check computed once."""
    x = jnp.asarray(x, F32)
    valid = valid_amax(x)
    return valid, lax.select(valid, x, lax.full_like(x, 0))


def needs_repair(scales, histories, count) -> Array:
    """1.0 if any of a state's fields is corrupt, else 0.0: a scale that is not finite and
    positive, a history entry that is not finite and >= 0, a count that is not finite and
    >= 0 (a bad checkpoint, a state written by hand). The ops repair such fields
    (`clean_amax`, `fp8jax._quant.scale_from_limit`) and count the step (``nonfinite_count``).
    Scalar math plus one reduction over the histories, which XLA computes in the forward's
    reduction kernel (`from_history`): on an H200 a step has the same kernels as without it.
    """
    # Scalars: elementwise mins (a reduction would be a GPU kernel of its own). Histories:
    # one reduction each along the last axis, shaped like the forward's max over them
    # (`from_history`), which XLA can then compute in the same kernel.
    ok = [lax.bitwise_and(valid_amax(s), lax.gt(jnp.asarray(s, F32), F32(0))) for s in scales]
    ok.append(valid_amax(count))
    for h in histories:
        ok.append(lax.reduce_min(valid_amax(h).astype(F32), (h.ndim - 1,)))
    ok = (
        [x for o in ok for x in (jnp.ravel(o)[i] for i in range(o.size))]
        if all(o.size <= 4 for o in ok)
        else [jnp.min(o) for o in ok]
    )
    return F32(1) - functools.reduce(lax.min, [o.astype(F32) for o in ok])


def record(history, value, axis: int = 0):
    """flax's amax-history update: roll by one, newest value at index 0 along ``axis``.

    ``roll(h, -1).at[0].set(v)`` is ``[v, h[2:], h[0]]``: written as one concatenate, which
    XLA fuses with its neighbours, where the scatter of ``.at[].set`` is a kernel of its own.
    """
    axis %= history.ndim
    length = history.shape[axis]
    value = jnp.asarray(value, history.dtype)
    if value.ndim == history.ndim - 1:  # one value per slot along the other dims
        value = jnp.expand_dims(value, axis)
    value = jnp.broadcast_to(value, history.shape[:axis] + (1,) + history.shape[axis + 1 :])
    if length == 1:
        return value
    parts = [value, lax.slice_in_dim(history, 2, length, axis=axis)] if length > 2 else [value]
    return jnp.concatenate(parts + [lax.slice_in_dim(history, 0, 1, axis=axis)], axis=axis)


def from_history(history, algo: str, axis: int = 0):
    """The amax a delayed scale is computed from: ``"max"`` over the history, or
    ``"most_recent"`` (index 0); keeps ``axis`` as a dim of size 1. Corrupt entries (NaN,
    Inf, negative) count as missing (0): a scale is never computed from, nor frozen by, them.
    """
    # lt(h, inf): False for NaN and Inf (negative entries cannot raise the max above a
    # valid one, and a history of no positive entry keeps the old scale).
    history = jnp.asarray(history, F32)
    history = lax.select(lax.lt(history, F32(np.inf)), history, lax.full_like(history, 0))
    if algo == "max":
        return jnp.max(history, axis=axis, keepdims=True)
    return lax.slice_in_dim(history, 0, 1, axis=axis)


def history_stats(stacked, with_valid: bool = False):
    """``[..., L]`` histories -> ``[..., 2]``: the max over the last axis of the finite
    entries (NaN and Inf as 0: `from_history`'s ``"max"``) and 1.0 where an entry is corrupt
    (`valid_amax` rejects it; else 0.0). One reduction for both: the forward's delayed
    scales (`fp8jax._recipe.PerTensor.gemm_scales`) and the backward's repair check
    (`fp8jax._ops.state_update.new_state`) compute this same expression of the same histories, which
    XLA then computes once. ``with_valid``: ``(stats, valid_amax(stacked))``."""
    h = jnp.asarray(stacked, F32)
    below_inf = lax.lt(h, F32(np.inf))  # False for NaN too
    finite = lax.select(below_inf, h, lax.full_like(h, 0))
    valid = lax.bitwise_and(lax.ge(h, F32(0)), below_inf)  # `valid_amax`
    corrupt = lax.convert_element_type(lax.bitwise_not(valid), F32)
    # [..., 2, L], reduced along its last axis (a row reduction, as `from_history`'s)
    shape, dims = h.shape[:-1] + (1, h.shape[-1]), (*range(h.ndim - 1), h.ndim)
    both = [lax.broadcast_in_dim(x, shape, dims) for x in (finite, corrupt)]
    stats = lax.reduce_max(lax.concatenate(both, h.ndim - 1), (h.ndim,))
    return (stats, valid) if with_valid else stats


def newest_first(history, axis: int = 0):
    """The history in time order, newest first (index 0, then back from the end)."""
    length = history.shape[axis]
    order = (-np.arange(length)) % length
    return jnp.take(history, order, axis=axis)
