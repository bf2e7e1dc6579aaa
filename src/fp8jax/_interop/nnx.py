"""flax nnx adapter: FP8 GEMMs in ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum``
(``pip install fp8jax[flax]``).

`fp8_linear_layers` converts a model in place: it sets each selected layer's
``dot_general`` (``einsum_op`` for ``nnx.Einsum``) to an `Fp8DotGeneralOp`, a small nnx
module whose FP8 state (the seven fields of `fp8jax._state.STATE_FIELDS`: scales, amax
histories rolled each step with the newest at index 0, the non-finite counter) is held
as `Fp8State` variables. `Fp8State` is not an ``nnx.Param``, so
``nnx.Optimizer(model, tx, wrt=nnx.Param)`` never sees it. The state's new value comes
back as its gradient (several uses of a layer in a step combine by max), so a train
step differentiates with respect to both and writes the state by overwriting::

    fp8jax.nnx.fp8_linear_layers(model, Fp8Config())
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=fp8jax.nnx.diff_state(0))(
            model, x, y)
        fp8jax.nnx.update(model, optimizer, grads)  # Params: optimizer; Fp8State: overwrite
        return loss

The GEMMs are fp8jax's (`fp8jax.Fp8DotGeneral`); flax ships no nnx FP8 op to compare with
(its ``flax.linen.fp8_ops`` are linen modules). A converted ``nnx.Linear`` /
``nnx.LinearGeneral`` hands its kernel to the op as stored (`_kernel_as_stored`): with f32
parameters and ``dtype=bf16`` the FP8 cast reads the f32 kernel, once, instead of a bf16 copy;
the output stays in the compute dtype.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .. import _checks as checks
from .._config import Fp8Config
from .._convert import (
    ConversionReport,
    LayerDecision,
    _decide,
    _warn_unmatched_entries,
    token_floor,
    warn_if_none_converted,
)
from .._dot_general import Fp8DotGeneral, fp8_einsum
from .._state import STATE_FIELDS


class Fp8State(nnx.Variable):
    """FP8 scaling state (scales, amax histories, non-finite counter): its "gradient"
    is its new value. Not an ``nnx.Param``: optimizers built with ``wrt=nnx.Param``
    leave it alone; `update` (or `overwrite_state`) writes it.

    Arguments:
        value: the state array (as ``nnx.Variable`` takes it, with its metadata keywords).
    """


WRT = nnx.Any(nnx.Param, Fp8State)
"""The filter to differentiate with: the parameters and the FP8 state."""


def diff_state(argnum: int = 0) -> nnx.DiffState:
    """``argnums`` for ``nnx.grad`` / ``nnx.value_and_grad``: differentiate argument
    ``argnum`` (the model) with respect to its ``nnx.Param``s and its `Fp8State`.

    Arguments:
        argnum: the position of the model among the loss function's arguments.

    Returns:
        An ``nnx.DiffState`` for ``argnums=``.
    """
    return nnx.DiffState(argnum, WRT)


class _Fp8StateModule(nnx.Module):
    """An nnx module holding the seven FP8 state fields as `Fp8State` variables."""

    def __init__(self, config: Fp8Config | None = None, *, stack_shape: tuple[int, ...] = ()):
        config = checks.config(type(self).__name__, config)
        template = Fp8DotGeneral(config, stack_shape=tuple(stack_shape))
        for name in STATE_FIELDS:
            setattr(self, name, Fp8State(getattr(template, name)))
        self.config = template.config

    def op(self) -> Fp8DotGeneral:
        """An `fp8jax.Fp8DotGeneral` over this module's current state values."""
        state = {name: getattr(self, name)[...] for name in STATE_FIELDS}
        return Fp8DotGeneral.from_state(self.config, state)

    def ordered_amax_history(self, which: str = "input") -> jax.Array:
        """``<which>_amax_history`` newest-first (``which``: input, kernel, output_grad)."""
        return self.op().ordered_amax_history(which)


class Fp8DotGeneralOp(_Fp8StateModule):
    """``jax.lax.dot_general``'s signature running `fp8jax.Fp8DotGeneral`: what
    `fp8_linear_layers` puts in ``nnx.Linear.dot_general`` (or pass it yourself:
    ``nnx.Linear(..., dot_general=Fp8DotGeneralOp(config))``). A kernel in another dtype
    than the input (f32 parameters, bf16 compute: `_kernel_as_stored`) is cast to FP8 from
    its own dtype and the output takes the input's dtype (the compute dtype), unless
    ``preferred_element_type`` says otherwise.

    Arguments:
        config: the `Fp8Config` (None: the default one).
        stack_shape: leading dims of stacked layers (``nnx.vmap``), else ``()``.
    """

    def __call__(
        self,
        lhs,
        rhs,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ):
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        if preferred_element_type is None and lhs.dtype != rhs.dtype:
            preferred_element_type = lhs.dtype
        return self.op()(
            lhs,
            rhs,
            dimension_numbers,
            precision=precision,
            preferred_element_type=preferred_element_type,
            out_sharding=out_sharding,
        )


class Fp8EinsumOp(_Fp8StateModule):
    """``jnp.einsum``'s signature for ``nnx.Einsum(einsum_op=...)``: ``(eqn, lhs, rhs)``,
    ``rhs`` the kernel, ``lhs`` cast to its dtype (flax's convention).

    Arguments:
        config: the `Fp8Config` (None: the default one).
        stack_shape: leading dims of stacked layers, else ``()``.
    """

    def __call__(
        self, eqn: str, lhs, rhs, precision=None, preferred_element_type=None, out_sharding=None
    ):
        if not isinstance(eqn, str) or eqn.split("->")[0].count(",") != 1:
            raise ValueError(
                f"Fp8EinsumOp: eqn={eqn!r} is not allowed; expected an einsum string with "
                "two operands (input, kernel), such as 'bd,df->bf'."
            )
        if out_sharding is not None:
            raise NotImplementedError("Fp8EinsumOp: out_sharding is not supported.")
        rhs = checks.float_array("Fp8EinsumOp", "rhs (the kernel)", rhs)
        lhs = checks.float_array("Fp8EinsumOp", "lhs (the input)", lhs).astype(rhs.dtype)
        return fp8_einsum(self.op(), eqn, lhs, rhs, precision, preferred_element_type)


_OPS = (Fp8DotGeneralOp, Fp8EinsumOp)


# ----------------------------------------------------------------------------- conversion
def _einsum_dims(eqn: str | None, kernel_shape) -> tuple[int, int] | str:
    """``(K, N)`` of an ``nnx.Einsum`` (contracted and output-feature sizes of the kernel),
    or why it cannot be told."""
    if not eqn:
        return "einsum_str given at call time"
    operands, out = eqn.replace(" ", "").split("->")
    lhs, rhs = operands.split(",")
    if "." in rhs:
        return "ellipsis in the kernel's subscripts"
    if len(rhs) != len(kernel_shape):
        return f"kernel subscripts {rhs!r} do not fit kernel shape {tuple(kernel_shape)}"
    k = n = 1
    has_k = has_n = False
    for letter, size in zip(rhs, kernel_shape, strict=True):
        if letter in lhs and letter not in out:
            k, has_k = k * size, True
        elif letter in out and letter not in lhs:
            n, has_n = n * size, True
        elif letter not in lhs:
            return f"kernel dim {letter!r} is summed over alone"
    if not (has_k and has_n):
        return "no contracting or no output-feature dim in the kernel"
    return k, n


def _prod(shape) -> int:
    return int(math.prod(shape))


def _layer_info(layer) -> tuple[str, Any, Any, tuple[int, ...], str | None]:
    """``(kind, in_features, out_features, stack, why_not)`` of an nnx layer; ``why_not``
    is None when it can take an FP8 op, else the reason it cannot."""
    kernel_shape = tuple(layer.kernel.shape)
    if isinstance(layer, nnx.Linear):
        extra = len(kernel_shape) - 2
        in_f, out_f = layer.in_features, layer.out_features
        custom = layer.dot_general is not jax.lax.dot_general
        return "nnx.Linear", in_f, out_f, kernel_shape[:extra], custom and "custom dot_general"
    if isinstance(layer, nnx.LinearGeneral):
        n_in, n_out = len(layer.in_features), len(layer.out_features)
        extra = len(kernel_shape) - len(layer.batch_axis) - n_in - n_out
        in_f, out_f = _prod(layer.in_features), _prod(layer.out_features)
        custom = layer.dot_general_cls is not None or layer.dot_general not in (
            None,
            jax.lax.dot_general,
        )
        why = "custom dot_general" if custom else None
        return "nnx.LinearGeneral", in_f, out_f, kernel_shape[:extra], why
    extra = len(kernel_shape) - len(tuple(layer.kernel_shape))
    dims = _einsum_dims(layer.einsum_str, kernel_shape[extra:])
    why = dims if isinstance(dims, str) else None
    if layer.einsum_op is not jnp.einsum:
        why = "custom einsum_op"
    in_f, out_f = dims if not isinstance(dims, str) else ("?", "?")
    return "nnx.Einsum", in_f, out_f, kernel_shape[:extra], why


def _current_op(layer):
    if isinstance(layer, nnx.Einsum):
        return layer.einsum_op
    return layer.dot_general


# flax's own ``promote_dtype`` (the default of ``nnx.Linear`` and ``nnx.LinearGeneral``).
_FLAX_PROMOTE = inspect.signature(nnx.Linear.__init__).parameters["promote_dtype"].default


def _kernel_as_stored(args, /, *, dtype=None, inexact=True):
    """``promote_dtype`` of a converted ``nnx.Linear`` / ``nnx.LinearGeneral``: the inputs
    and bias as flax promotes them, the kernel as stored, so that the FP8 cast reads an f32
    kernel itself rather than the bf16 copy flax would make of it (one rounding, no pass)."""
    inputs, _, bias = _FLAX_PROMOTE(args, dtype=dtype, inexact=inexact)
    return inputs, args[1], bias


def _set_op(layer, stack: tuple[int, ...], config: Fp8Config) -> None:
    if isinstance(layer, nnx.Einsum):
        # nnx.data: the attribute was static (a function); now it holds state.
        layer.einsum_op = nnx.data(Fp8EinsumOp(config, stack_shape=stack))
        return
    layer.dot_general = nnx.data(Fp8DotGeneralOp(config, stack_shape=stack))
    if getattr(layer, "promote_dtype", None) is _FLAX_PROMOTE:  # not a promotion of the user's
        layer.promote_dtype = _kernel_as_stored


def _path_str(path) -> str:
    return ".".join(str(p) for p in path)


_KINDS = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)


def fp8_linear_layers(model: nnx.Module, config: Fp8Config | None = None, *, return_report=False):
    """Convert ``model``'s ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum`` layers
    to FP8 **in place** (nnx modules are mutable) and return ``model`` (with
    ``return_report``: ``(model, report)``, a `fp8jax.ConversionReport`).

    The selection policy is `fp8jax.fp8_linear_layers`'s: ``config.targets`` against the
    dotted nnx path (``"blocks.0.mlp.up"``), then alignment and, with ``selective``,
    ``min_features`` / ``min_weight_elements`` on the GEMM's K (input features) and N
    (output features). Layers with a ``dot_general`` / ``einsum_op`` of their own are
    skipped; converted ones report "already FP8". Stacked layers (a kernel with leading
    dims, e.g. made under ``nnx.vmap``) get per-layer state of the same leading dims.
    The report tells the same three tiers apart (FP8; converted, but bf16 below
    ``min_tokens`` tokens per call; skipped, why), and a warning says when no layer was
    converted.

    Arguments:
        model: the ``nnx.Module`` to convert in place.
        config: the `Fp8Config` (None: the default one).
        return_report: also return the `fp8jax.ConversionReport`.

    Returns:
        ``model``, or ``(model, report)`` with ``return_report``.
    """
    config = checks.config("fp8jax.nnx.fp8_linear_layers", config)
    if not isinstance(model, nnx.Module):
        raise TypeError(
            "fp8jax.nnx.fp8_linear_layers: model must be a flax.nnx.Module, got "
            f"{type(model).__name__}."
        )
    found = [(p, m) for p, m in nnx.iter_modules(model) if isinstance(m, _KINDS)]
    if not found:
        raise ValueError(
            "fp8jax.nnx.fp8_linear_layers: no nnx.Linear, nnx.LinearGeneral or nnx.Einsum "
            f"found in {type(model).__name__}."
        )
    decisions, to_convert, named, matched = [], [], [], False
    for path, layer in sorted(found, key=lambda item: tuple(map(str, item[0]))):
        name = _path_str(path)
        named.append((name, layer))
        kind, in_f, out_f, stack, why_not = _layer_info(layer)
        if isinstance(_current_op(layer), _OPS):
            matched |= config.matches(name, layer)
            floor = token_floor(_current_op(layer).config)
            decisions.append(
                LayerDecision(name, kind, in_f, out_f, stack, True, "already FP8", floor)
            )
            continue
        if why_not:
            matched |= config.matches(name, layer)
            decisions.append(LayerDecision(name, kind, in_f, out_f, stack, False, why_not))
            continue
        ok, reason = _decide(name, in_f, out_f, layer, config)
        matched |= reason != "not in targets"
        floor = token_floor(config) if ok else 0
        decisions.append(LayerDecision(name, kind, in_f, out_f, stack, ok, reason, floor))
        if ok:
            to_convert.append((layer, stack))
    if config.targets is not None and not matched:
        raise ValueError(
            f"fp8jax.nnx.fp8_linear_layers: targets={config.targets!r} match no layer; "
            "layers are: " + ", ".join(d.path for d in decisions)
        )
    _warn_unmatched_entries("fp8jax.nnx.fp8_linear_layers", "layer", config, named)
    for layer, stack in to_convert:
        _set_op(layer, stack, config)
    report = ConversionReport(decisions)
    warn_if_none_converted("fp8jax.nnx.fp8_linear_layers", report)
    return (model, report) if return_report else model


# ----------------------------------------------------------------------------- state
def fp8_state(model: nnx.Module) -> list[tuple[str, _Fp8StateModule]]:
    """Every FP8 op in ``model`` with its dotted path (for inspection).

    Arguments:
        model: an nnx module.

    Returns:
        A list of ``(dotted path, op)`` pairs: the `Fp8DotGeneralOp` and `Fp8EinsumOp`
        modules, whose variables are the state.
    """
    return [(_path_str(p), m) for p, m in nnx.iter_modules(model) if isinstance(m, _OPS)]


def _has_state(tree) -> bool:
    return bool(nnx.to_flat_state(nnx.state(tree, Fp8State)))


def overwrite_state(model: nnx.Module, grads) -> None:
    """Write the new FP8 state, the `Fp8State` part of ``grads`` (from ``nnx.grad`` with
    ``argnums=diff_state(0)``), into ``model``. A layer that did not run this step (its
    "gradient" is all zeros: a scale is never 0) keeps its state.

    Arguments:
        model: the nnx module the gradients were taken of (changed in place).
        grads: its gradients, with the `Fp8State` part.

    Returns:
        None.
    """
    merged = _merged_state(model, grads)
    if merged is not None:
        nnx.update(model, merged)


def _merged_state(model, grads):
    """The model's new `Fp8State` (None: the model has none), checked against ``grads``."""
    new = nnx.to_flat_state(nnx.state(grads, Fp8State))
    if not new:
        if _has_state(model):
            raise ValueError(
                "fp8jax.nnx: the gradients hold no FP8 state; differentiate with "
                "nnx.grad(loss_fn, argnums=fp8jax.nnx.diff_state(0)) so that the FP8 "
                "state's new value comes back with the parameters' gradients."
            )
        return None
    old = dict(nnx.to_flat_state(nnx.state(model, Fp8State)))
    new = dict(new)
    missing = sorted(set(old) - set(new), key=str)
    if missing or set(new) - set(old):
        extra = sorted(set(new) - set(old), key=str)
        raise ValueError(
            "fp8jax.nnx: the gradients' FP8 state does not match the model's "
            f"(missing {missing[:3]}, unknown {extra[:3]}): gradients of another model?"
        )
    merged = []
    for path, variable in new.items():
        scale = new[path[:-1] + ("input_scale",)]
        ran = jnp.asarray(scale[...]) > 0  # [*stack, 1]
        value = jnp.asarray(variable[...]).astype(old[path][...].dtype)
        stack = ran.ndim - 1
        ran = ran.reshape(ran.shape[:stack] + (1,) * (value.ndim - stack))
        merged.append((path, old[path].replace(jnp.where(ran, value, old[path][...]))))
    return nnx.from_flat_state(merged)


def update(model: nnx.Module, optimizer: nnx.Optimizer, grads, /, **kwargs):
    """One training update: the parameters through ``optimizer`` (its ``wrt`` part of
    ``grads``), the FP8 state by overwriting (`overwrite_state`). Returns the optimizer's
    updates. ``grads`` come from ``nnx.grad(..., argnums=diff_state(0))``; the optimizer
    must not include `Fp8State` (``nnx.Optimizer(model, tx, wrt=nnx.Param)``).

    Arguments:
        model: the nnx module (changed in place).
        optimizer: an ``nnx.Optimizer`` over its ``nnx.Param``s.
        grads: from ``nnx.grad(..., argnums=diff_state(0))``.
        kwargs: passed on to ``optimizer.update``.

    Returns:
        What ``optimizer.update`` returns.
    """
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(
            "fp8jax.nnx.update: optimizer must be an nnx.Optimizer, got "
            f"{type(optimizer).__name__}."
        )
    if nnx.to_flat_state(nnx.state(model, nnx.All(optimizer.wrt, Fp8State))):
        raise ValueError(
            f"fp8jax.nnx.update: the optimizer's wrt={optimizer.wrt!r} includes the FP8 state; "
            "build it with nnx.Optimizer(model, tx, wrt=nnx.Param)."
        )
    merged = _merged_state(model, grads)  # checked before anything is written
    updates = optimizer.update(model, grads, **kwargs)
    if merged is not None:
        nnx.update(model, merged)
    return updates
