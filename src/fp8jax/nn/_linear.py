"""`Linear`: `eqx.nn.Linear` with its matmul routed through `Fp8DotGeneral`."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray

from .. import _checks as checks
from .._config import Fp8Config
from .._dot_general import Fp8DotGeneral


class Linear(eqx.Module):
    """``y = x @ weight.T + bias`` with FP8 GEMMs; same arrays and layout as
    `eqx.nn.Linear` (``weight: [out, in]``, already K-major for Hopper).

    Unlike `eqx.nn.Linear` it also takes inputs with leading dims ``(..., in)``;
    under ``jax.vmap`` all examples still run as one GEMM. The output takes the input's
    dtype, the compute dtype: f32 weights called on bf16 activations (mixed precision without
    a bf16 copy of the weights) are cast to FP8 from f32, once, the output is bf16 and the
    weight's gradient comes out of its GEMM in f32.
    """

    weight: Array
    bias: Array | None
    dot_general: Fp8DotGeneral
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        use_bias: bool = True,
        dtype=None,
        config: Fp8Config | None = None,
        *,
        key: PRNGKeyArray | None = None,
        weight: Array | None = None,
        bias: Array | None = None,
    ):
        """``weight`` (``[*stack, out, in]``) and ``bias`` (``[*stack, out]``, or None): use
        these arrays (shared, no ``key``) instead of initialising; a stacked weight gets
        state with the same leading ``stack`` dims.

        Arguments:
            in_features, out_features: the layer's input and output sizes.
            use_bias: whether it adds a bias.
            dtype: the weights' float dtype (None: float32).
            config: the `Fp8Config` (None: the default one).
            key: initialises the weights as `eqx.nn.Linear` does (needed without
                ``weight``).
            weight, bias: arrays to use as they are instead.
        """
        owner = "fp8jax.nn.Linear"
        in_features = checks.count(owner, "in_features", in_features)
        out_features = checks.count(owner, "out_features", out_features)
        if not isinstance(use_bias, (bool, np.bool_)):
            raise TypeError(
                f"{owner}: use_bias={use_bias!r} is not allowed; expected True or False."
            )
        use_bias = bool(use_bias)
        if dtype is not None and (
            not jnp.issubdtype(jnp.dtype(dtype), jnp.floating) or jnp.dtype(dtype).itemsize < 2
        ):
            raise TypeError(
                f"{owner}: dtype={jnp.dtype(dtype)} is not allowed; "
                "expected a floating dtype (bfloat16, float16 or float32) for the weights."
            )
        if weight is None:
            if key is None:
                raise TypeError(f"{owner}: pass key= (to initialise the weights) or weight=.")
            base = eqx.nn.Linear(in_features, out_features, use_bias, dtype=dtype, key=key)
            weight, bias = base.weight, base.bias
        else:
            _check_linear_arrays(owner, out_features, in_features, weight, bias)
        self.weight, self.bias = weight, bias
        self.in_features, self.out_features, self.use_bias = in_features, out_features, use_bias
        self.dot_general = Fp8DotGeneral(config, stack_shape=tuple(weight.shape[:-2]))

    @classmethod
    def from_linear(cls, linear: eqx.nn.Linear, config: Fp8Config | None = None) -> "Linear":
        """Wrap an existing `eqx.nn.Linear`, sharing its weight and bias arrays.

        A stacked linear (built with `eqx.filter_vmap`, weight ``[*stack, out, in]``)
        gets state with the same leading ``stack`` dims.
        """
        if not isinstance(linear, eqx.nn.Linear):
            raise TypeError(
                "fp8jax.nn.Linear.from_linear expects an eqx.nn.Linear, "
                f"got {type(linear).__name__}."
            )
        if linear.in_features == "scalar" or linear.out_features == "scalar":
            raise ValueError("fp8jax.nn.Linear does not support 'scalar' features.")
        owner = "fp8jax.nn.Linear.from_linear"
        _check_linear_arrays(
            owner, linear.out_features, linear.in_features, linear.weight, linear.bias
        )
        return cls(
            linear.in_features,
            linear.out_features,
            linear.use_bias,
            config=config,
            weight=linear.weight,
            bias=linear.bias,
        )

    def to_linear(self) -> eqx.nn.Linear:
        """The plain `eqx.nn.Linear` with the same arrays (drops the FP8 state)."""
        base = eqx.nn.Linear(
            self.in_features, self.out_features, self.use_bias, key=jax.random.PRNGKey(0)
        )
        return eqx.tree_at(
            lambda lin: (lin.weight, lin.bias),
            base,
            (self.weight, self.bias),
            is_leaf=lambda x: x is None,
        )

    @jax.named_scope("fp8jax.nn.Linear")
    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        del key
        x = checks.float_array("fp8jax.nn.Linear", "x", x)
        if x.ndim == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"fp8jax.nn.Linear expects inputs of shape (..., {self.in_features}), "
                f"got {x.shape}."
            )
        dn = (((x.ndim - 1,), (1,)), ((), ()))
        y = self.dot_general(x, self.weight, dn, preferred_element_type=x.dtype)
        if self.bias is not None:
            y = y + self.bias.astype(y.dtype)
        return y


def _check_linear_arrays(owner: str, out_f: int, in_f: int, w, b) -> None:
    """Weight ``[*stack, out, in]`` and bias ``[*stack, out]`` of a floating dtype."""
    if not hasattr(w, "shape"):  # e.g. a partitioned-out (None) weight: nothing to check
        return
    if len(w.shape) < 2 or tuple(w.shape[-2:]) != (out_f, in_f):
        raise ValueError(
            f"{owner}: weight has shape {tuple(w.shape)}; expected "
            f"[..., out_features={out_f}, in_features={in_f}] (eqx.nn.Linear's layout)."
        )
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(
            f"{owner}: weight dtype {w.dtype} is not allowed; expected a floating dtype."
        )
    expected_bias = tuple(w.shape[:-2]) + (out_f,)
    if hasattr(b, "shape") and tuple(b.shape) != expected_bias:
        raise ValueError(f"{owner}: bias has shape {tuple(b.shape)}; expected {expected_bias}.")


def apply_linear(layer: "Linear | eqx.nn.Linear", x: Array) -> Array:
    """An fp8jax or eqx linear on ``x: [..., in]`` (``eqx.nn.Linear`` takes one vector; any
    other layer, e.g. `fp8jax._inference.Fp8InferenceLinear`, is called on ``x``)."""
    if not isinstance(layer, eqx.nn.Linear):
        return layer(x)
    y = jnp.einsum("...i,oi->...o", x, layer.weight.astype(x.dtype))
    return y if layer.bias is None else y + layer.bias.astype(y.dtype)
