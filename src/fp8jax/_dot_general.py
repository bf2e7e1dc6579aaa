"""`Fp8DotGeneral`: an FP8 stand-in for `jax.lax.dot_general` that carries its scaling state."""

from __future__ import annotations

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from . import _checks as checks
from . import _guard, _state
from ._config import Fp8Config, resolve_config
from ._ops import dot as _dot
from ._ops import fsdp as _fsdp
from ._ops import traced as _traced
from ._state import (
    STATE_FIELDS,
    Fp8GemmState,
    OverwriteWithGradient,  # noqa: F401  (re-exported: older imports)
)


class Fp8DotGeneral(Fp8GemmState):
    """Drop-in for ``jax.lax.dot_general`` running forward, dgrad and wgrad as FP8 GEMMs.

    ``lhs`` is the input (activations), ``rhs`` the kernel (weights), as in flax and
    haliax. State follows flax: ``*_scale`` are dequantization factors of shape
    ``(1,)``, ``*_amax_history`` hold the last ``amax_history_length`` amaxes, rolled
    each step with the newest at index 0 (flax's and haliax's layout);
    ``nonfinite_count`` counts steps that saw NaN/Inf. The new state is returned as the
    state's gradient (see `apply_updates`); uses of one layer in a step combine by max.
    ``guard`` (``[*stack, 1]``, not a `STATE_FIELDS` field) marks a state that an optimizer
    trained: the next call's output is NaN (``FP8JAX_GUARD=raise``: an error) and
    `fp8jax.check_state` says why (`fp8jax._guard`); None (adapters, older models): unchecked.
    """

    input_scale: Float[Array, "*stack 1"]
    kernel_scale: Float[Array, "*stack 1"]
    output_grad_scale: Float[Array, "*stack 1"]
    input_amax_history: Float[Array, "*stack history"]
    kernel_amax_history: Float[Array, "*stack history"]
    output_grad_amax_history: Float[Array, "*stack history"]
    nonfinite_count: Float[Array, "*stack 1"]
    config: Fp8Config = eqx.field(static=True)
    # FSDP: how the kernel is sharded and gathered (`fp8jax.shard_model` sets it); None:
    # no constraint, the single-device path.
    weight_sharding: _dot.WeightSharding | None = eqx.field(static=True, default=None)
    # Last: the seven fields keep their leaf positions. None: no guard (`from_state`).
    guard: Float[Array, "*stack 1"] | None = None

    def __init__(
        self,
        config: Fp8Config | None = None,
        *,
        stack_shape: tuple[int, ...] = (),
        state: dict[str, Array] | None = None,
        weight_sharding: _dot.WeightSharding | None = None,
    ):
        """Fresh state (scales 1, histories 0) with leading ``stack_shape`` dims; or, with
        ``state``, the arrays given (a dict of `STATE_FIELDS`, optionally a ``guard``: None
        without one), no new arrays made.

        Arguments:
            config: the `Fp8Config` (None: the default one).
            stack_shape: leading dims of stacked layers (``eqx.filter_vmap``), else ``()``.
            state: the state's arrays to use as they are, or None for a fresh state.
            weight_sharding: how the kernel is sharded and gathered (FSDP; `shard_model`
                and `record_fsdp` set it), None on one device.
        """
        config = resolve_config(config)
        if state is None:
            state = _fresh_state(config, stack_shape)
        missing = [name for name in STATE_FIELDS if name not in state]
        if missing:
            raise ValueError(f"Fp8DotGeneral: missing state fields {missing}")
        for name in STATE_FIELDS:
            setattr(self, name, state[name])
        self.config = config
        self.weight_sharding = weight_sharding
        self.guard = state.get("guard")

    @classmethod
    def from_state(cls, config: Fp8Config, state: dict[str, Array]) -> "Fp8DotGeneral":
        """An op over existing state arrays (a dict of `STATE_FIELDS`, optionally a
        ``guard``), e.g. an adapter's variables; no new arrays are made."""
        return cls(config, state=state)

    def with_weight_sharding(self, weight_sharding: _dot.WeightSharding | None) -> "Fp8DotGeneral":
        """The same op (shared state arrays) with ``weight_sharding`` recorded."""
        state = {name: getattr(self, name) for name in STATE_FIELDS + ("guard",)}
        return type(self)(self.config, state=state, weight_sharding=weight_sharding)

    # ------------------------------------------------------------------ inspection
    def ordered_amax_history(self, which: str = "input") -> Array:
        """``<which>_amax_history`` newest-first (``which``: input, kernel, output_grad)."""
        return _state.newest_first(getattr(self, f"{which}_amax_history"), axis=-1)

    # ------------------------------------------------------------------ call
    def __call__(
        self,
        lhs,
        rhs,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ):
        if out_sharding is not None:
            raise NotImplementedError(
                "Fp8DotGeneral: out_sharding is not supported; shard the operands."
            )
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        if self.input_scale.ndim != 1:
            raise ValueError(
                f"Fp8DotGeneral state has stack shape {self.input_scale.shape[:-1]}: "
                "a stacked layer "
                "must be run one slice at a time (jax.lax.scan over the stack or eqx.filter_vmap)."
            )
        _check_state_shapes(self)
        _fsdp.check_auto_axes("Fp8DotGeneral", lhs=lhs, rhs=rhs)
        out_dtype = _check_operands(lhs, rhs, dimension_numbers, preferred_element_type, precision)
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = map(lambda d: tuple(int(i) for i in d), (lc, rc, lb, rb))
        lf = tuple(i for i in range(lhs.ndim) if i not in lc and i not in lb)
        rf = tuple(i for i in range(rhs.ndim) if i not in rc and i not in rb)
        batch_shape = tuple(lhs.shape[i] for i in lb)
        m_shape = tuple(lhs.shape[i] for i in lf)
        n_shape = tuple(rhs.shape[i] for i in rf)
        b, m, k, n = (
            math.prod(batch_shape),
            math.prod(m_shape),
            math.prod(lhs.shape[i] for i in lc),
            math.prod(n_shape),
        )
        cfg = self.config

        def plain():
            return jax.lax.dot_general(
                lhs,
                rhs,
                dimension_numbers,
                precision=precision,
                preferred_element_type=preferred_element_type,
            )

        if k % cfg.alignment or n % cfg.alignment:
            _dot.unsupported(
                cfg,
                f"Fp8DotGeneral: contracting size K={k} and output size N={n} must be multiples "
                f"of {cfg.alignment} for FP8 (lhs {lhs.shape}, rhs {rhs.shape}).",
            )
            return plain()

        x3 = jnp.transpose(lhs, lb + lf + lc).reshape(b, m, k)
        # A kernel stored contracting-dims-first (flax's [in, out]) stays [B, K, N]: its
        # gradient then needs no transpose either.
        rhs_k_first = bool(rf) and max(rc) < min(rf)
        if rhs_k_first:
            w3 = jnp.transpose(rhs, rb + rc + rf).reshape(b, k, n)
        else:
            w3 = jnp.transpose(rhs, rb + rf + rc).reshape(b, n, k)
        # Rows pad to the alignment with zeros (no effect on the amax), except under vmap,
        # where the vmap rule makes the vmapped axis rows and checks the total.
        pad = -m % cfg.alignment if not _traced.under_vmap(x3) else 0
        if pad:
            x3 = jnp.pad(x3, ((0, 0), (0, pad), (0, 0)))
        ws = self.weight_sharding
        w_shardings = None  # FSDP, unrecorded: found when compiling (`fp8jax._ops.fsdp`)
        if ws is not None and ws.spec is not None:
            w_shardings = _dot.w3_shardings(ws, rb, rf, rc, rhs_k_first)
        spec = _dot.Spec(
            cfg,
            np.dtype(out_dtype),
            np.dtype(lhs.dtype),
            np.dtype(rhs.dtype),
            rhs_k_first,
            w_shardings,
            ws.sequence if ws and not pad else None,  # padded rows would move the token split
            _dot.row_split(cfg, ws),
        )
        state, poison = _guard.op_state(self)
        y3 = _dot.fp8_dot3(spec, x3, w3, state)
        y3 = _guard.add_poison(y3, poison)  # FP8JAX_GUARD=nan: NaN where the guard is invalid
        return y3[:, :m].reshape(batch_shape + m_shape + n_shape)


def _fresh_state(config: Fp8Config, stack_shape) -> dict[str, Array]:
    """New state arrays (and a guard) with leading ``stack_shape`` dims."""
    if not isinstance(stack_shape, (tuple, list)) or not all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 1 for d in stack_shape
    ):
        raise ValueError(
            f"Fp8DotGeneral: stack_shape={stack_shape!r} is not allowed; expected a tuple "
            "of ints >= 1 (the leading dims of a stacked layer's weight), e.g. () or (4,)."
        )
    stack_shape = tuple(stack_shape)
    return dict(config.recipe.init_state(stack_shape), guard=_guard.init(stack_shape))


def _check_state_shapes(op: Fp8DotGeneral) -> None:
    """Each state field of one (unstacked) layer has its shape: the scales, the count and
    the guard ``(1,)``, the histories ``(history_length,)`` (static shapes: free)."""
    length = op.config.history_length
    for name in STATE_FIELDS + ("guard",):
        value = getattr(op, name)
        if value is None and name == "guard":
            continue
        expected = (length,) if name.endswith("_amax_history") else (1,)
        shape = tuple(getattr(value, "shape", ()))
        if shape != expected:
            raise ValueError(
                f"Fp8DotGeneral: state field {name} has shape {shape}; expected {expected} "
                f"(history_length={length}). A state from another config or model?"
            )


def fp8_einsum(op: Fp8DotGeneral, eqn: str, lhs, rhs, precision=None, preferred_element_type=None):
    """``jnp.einsum`` with ``op`` as its dot_general (the adapters' ``Fp8Einsum``: ``rhs`` is
    the kernel). ``op`` goes in as a ``functools.partial``: einsum hashes its dot_general,
    and an equinox module's hash would read its arrays."""
    return jnp.einsum(
        eqn,
        lhs,
        rhs,
        precision=precision,
        preferred_element_type=preferred_element_type,
        _dot_general=functools.partial(op),
    )


def _out_shape(lhs, rhs, dimension_numbers, precision, preferred_element_type):
    """``lax.dot_general``'s output of ``lhs`` and ``rhs`` (shapes), traced once per
    signature: the layers of a model that share one skip a trace each (issue 21)."""
    key = (lhs, rhs, dimension_numbers, precision, preferred_element_type)
    try:
        hash(key)
    except TypeError:  # lists in dimension_numbers, say: no cache
        return _eval_out_shape(*key)
    return _cached_out_shape(*key)


def _eval_out_shape(lhs, rhs, dimension_numbers, precision, preferred_element_type):
    return jax.eval_shape(
        lambda a, b: jax.lax.dot_general(
            a,
            b,
            dimension_numbers,
            precision=precision,
            preferred_element_type=preferred_element_type,
        ),
        lhs,
        rhs,
    )


_cached_out_shape = functools.lru_cache(maxsize=256)(_eval_out_shape)


def _check_operands(lhs, rhs, dimension_numbers, preferred_element_type, precision=None):
    """Validate dtypes and shapes early, naming the offending operand; return the output dtype."""
    for name, arr in (("lhs", lhs), ("rhs", rhs)):
        checks.float_array("Fp8DotGeneral", name, arr)
    try:
        (lc, rc), (lb, rb) = dimension_numbers
    except (TypeError, ValueError):
        raise ValueError(
            "Fp8DotGeneral: dimension_numbers must be ((lhs_contract, rhs_contract), "
            "(lhs_batch, rhs_batch)), "
            f"got {dimension_numbers!r}"
        ) from None
    if preferred_element_type is not None and not jnp.issubdtype(
        preferred_element_type, jnp.floating
    ):
        raise TypeError(
            "Fp8DotGeneral: preferred_element_type must be a float dtype (an FP8 GEMM's output "
            f"is dequantized), got {jnp.dtype(preferred_element_type)}."
        )
    try:
        out = _out_shape(
            jax.ShapeDtypeStruct(lhs.shape, lhs.dtype),
            jax.ShapeDtypeStruct(rhs.shape, rhs.dtype),
            dimension_numbers,
            precision,
            preferred_element_type,
        )
    except ValueError as e:
        if "Precision" not in str(e):
            raise
        first = str(e).splitlines()[0]
        raise ValueError(
            f"Fp8DotGeneral: precision={precision!r} is not allowed: {first}"
        ) from None
    except TypeError as e:
        raise ValueError(
            f"Fp8DotGeneral: shapes lhs {lhs.shape} and rhs {rhs.shape} do not fit "
            "dimension_numbers "
            f"{dimension_numbers}: {e}"
        ) from None
    if not (lc and rc):
        raise ValueError(
            f"Fp8DotGeneral: no contracting dimension in {dimension_numbers}; "
            "an outer product is not a GEMM."
        )
    return out.dtype
