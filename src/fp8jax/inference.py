"""FP8 inference weights: a trained fp8jax model as a forward-only model whose FP8 linear
layers hold their weights in e4m3 with their scales (half the weight memory of bf16).

`to_inference` swaps every `fp8jax.nn.Linear` (what `fp8_linear_layers` made) for an
`Fp8InferenceLinear`; every other layer stays as it is. The layer's GEMM is one FP8
``dot_general`` (e4m3 activations x e4m3 weights, both contracting on their minor dim, bf16
or f32 out), the scales applied to its output afterwards, so XLA runs it as a cuBLASLt FP8
GEMM on Hopper. `save_inference` / `load_inference` write and read it with orbax.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from . import checks
from . import quant as q
from .convert import _path_str
from .kernels import gemm as _gemm
from .nn.linear import Linear
from .ops.dot import _under_vmap
from .state import from_history

E4M3 = jnp.float8_e4m3fn
F32 = jnp.float32
WEIGHT_SCALINGS = ("tensor", "channel")
INPUT_SCALES = ("frozen", "dynamic")
_ROW_ALIGNMENT = 16  # cuBLASLt FP8 GEMMs want every dim a multiple of 16


class Fp8InferenceLinear(eqx.Module):
    """``y = x @ dequant(weight).T + bias`` as one FP8 GEMM, forward only.

    ``weight``: e4m3 ``[out, in]`` (K-major, as Hopper's FP8 GEMM wants); ``weight_scale``:
    dequantization factor(s), ``[1]`` (``"tensor"``) or ``[out]`` (``"channel"``: one per
    output channel, applied to the GEMM's output columns); ``input_scale``: the frozen
    activation scale ``[1]``, or None to compute it from each call's amax (``"dynamic"``).
    Stacked layers (``eqx.filter_vmap``) carry leading stack dims and run one slice at a
    time (``lax.scan``), as training ran them.
    """

    weight: Array
    weight_scale: Array
    input_scale: Array | None
    bias: Array | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    weight_scaling: str = eqx.field(static=True)
    margin: float = eqx.field(static=True)
    fast_accumulation: bool = eqx.field(static=True)

    @property
    def input_scaling(self) -> str:
        return "dynamic" if self.input_scale is None else "frozen"

    @jax.named_scope("fp8jax.Fp8InferenceLinear")
    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        del key
        x = checks.float_array("Fp8InferenceLinear", "x", x)
        if x.ndim == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"Fp8InferenceLinear expects inputs of shape (..., {self.in_features}), "
                f"got {x.shape}."
            )
        if self.weight.ndim != 2:
            raise ValueError(
                f"Fp8InferenceLinear: stacked weight {self.weight.shape}; run a stacked layer one "
                "slice at a time (jax.lax.scan over the stack or eqx.filter_vmap)."
            )
        out_dtype = x.dtype
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        x_scale = self.input_scale
        if x_scale is None:  # current scaling: this call's amax
            x_scale = q.scale_from_amax(q.amax(x2), jnp.ones((1,), F32), E4M3, self.margin)
        xq = q.quantize(x2, x_scale, E4M3)
        pad = 0 if _under_vmap(x2) else -m % _ROW_ALIGNMENT
        if pad:
            xq = jnp.pad(xq, ((0, pad), (0, 0)))
        precision = _gemm.gemm_precision(self.fast_accumulation)
        y = _gemm.gemm(xq[None], self.weight[None], out_dtype, precision)[0, :m]
        scale = x_scale.astype(F32).reshape(()) * self.weight_scale.astype(F32)
        y = (y.astype(F32) * scale).astype(out_dtype)
        if self.bias is not None:
            y = y + self.bias.astype(out_dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self, dtype=F32) -> Array:
        """The weight as ``dtype`` (``weight * weight_scale``), for checks and references."""
        scale = self.weight_scale.astype(F32)[..., None]
        return (self.weight.astype(F32) * scale).astype(dtype)


# ----------------------------------------------------------------------------- conversion
def _check_option(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(
            f"to_inference: {name}={value!r} is not allowed; expected one of "
            + ", ".join(repr(a) for a in allowed)
            + "."
        )


def _weight_fp8(weight: Array, weight_scaling: str, margin: float) -> tuple[Array, Array]:
    """``weight [*stack, out, in]`` in e4m3 and its dequantization scale(s): ``[*stack, 1]``
    (amax over the whole matrix) or ``[*stack, out]`` (amax over each output row)."""
    w = jnp.asarray(weight, F32)
    if weight_scaling == "tensor":
        amax = jnp.max(jnp.abs(w), axis=(-2, -1))[..., None]
    else:
        amax = jnp.max(jnp.abs(w), axis=-1)
    scale = q.scale_from_amax(amax, jnp.ones_like(amax), E4M3, margin)
    return q.saturate(w, (1.0 / scale)[..., None], E4M3), scale


def _frozen_input_scale(layer: Linear) -> Array:
    """The input scale delayed scaling would use next: from the amax history with the
    layer's algorithm and margin (its current scale where the history holds no amax)."""
    op = layer.dot_general
    cfg = op.config
    amax = from_history(op.input_amax_history, cfg.amax_compute_algo, axis=-1)
    return q.scale_from_amax(amax, op.input_scale, E4M3, cfg.margin)


def _never_ran(layer: Linear) -> bool:
    """Whether the layer's input amax history is all zero (a traced one: unknown, False)."""
    history = layer.dot_general.input_amax_history
    return not isinstance(history, jax.core.Tracer) and not bool(jnp.any(history > 0))


def inference_linear(
    layer: Linear, weight_scaling: str = "tensor", input_scale: str = "frozen"
) -> Fp8InferenceLinear:
    """One trained `fp8jax.nn.Linear` as an `Fp8InferenceLinear` (see `to_inference`)."""
    _check_option("weight_scaling", weight_scaling, WEIGHT_SCALINGS)
    _check_option("input_scale", input_scale, INPUT_SCALES)
    cfg = layer.dot_general.config
    weight, w_scale = _weight_fp8(layer.weight, weight_scaling, cfg.margin)
    x_scale = _frozen_input_scale(layer) if input_scale == "frozen" else None
    new = object.__new__(Fp8InferenceLinear)
    for name, value in dict(
        weight=weight,
        weight_scale=w_scale,
        input_scale=x_scale,
        bias=layer.bias,
        in_features=layer.in_features,
        out_features=layer.out_features,
        weight_scaling=weight_scaling,
        margin=float(cfg.margin),
        fast_accumulation=cfg.fast_forward,
    ).items():
        object.__setattr__(new, name, value)
    return new


def _is_layer(x) -> bool:
    return isinstance(x, (Linear, Fp8InferenceLinear))


def to_inference(model: Any, *, weight_scaling: str = "tensor", input_scale: str = "frozen"):
    """``model`` for inference: every FP8 linear (`fp8jax.nn.Linear`, as
    `fp8_linear_layers` makes them) becomes an `Fp8InferenceLinear` with its weight in
    e4m3; every other layer and array stays as it is.

    ``weight_scaling``: ``"tensor"`` (one scale per weight) or ``"channel"`` (one per
    output channel). ``input_scale``: ``"frozen"`` (from the training amax history, as
    delayed scaling would use next; a layer that never recorded an amax keeps its scale
    and is named in a warning) or ``"dynamic"`` (each call's own amax: one more reduction).

    Raises ``ValueError`` for another option value, or when ``model`` has no FP8 linear
    layer (convert and train it with `fp8_linear_layers` first).
    """
    _check_option("weight_scaling", weight_scaling, WEIGHT_SCALINGS)
    _check_option("input_scale", input_scale, INPUT_SCALES)
    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_layer)[0]
    layers = [(_path_str(p), x) for p, x in flat if isinstance(x, Linear)]
    if not layers:
        done = any(isinstance(x, Fp8InferenceLinear) for _, x in flat)
        raise ValueError(
            f"to_inference: {type(model).__name__} has no FP8 layer (fp8jax.nn.Linear) to "
            + (
                "convert; it is already an inference model."
                if done
                else "convert; build it with fp8jax.fp8_linear_layers and train it first."
            )
        )
    if input_scale == "frozen":
        unseen = [name for name, layer in layers if _never_ran(layer)]
        if unseen:
            warnings.warn(
                "to_inference: no input amax recorded for "
                + ", ".join(unseen)
                + " (never trained in FP8?); their frozen input scale stays at its initial "
                "value. Use input_scale='dynamic', or run the FP8 model on data first.",
                stacklevel=2,
            )

    def convert(x):
        if isinstance(x, Linear):
            return inference_linear(x, weight_scaling, input_scale)
        return x

    return jax.tree_util.tree_map(convert, model, is_leaf=_is_layer)


# ----------------------------------------------------------------------------- utilities
def cast_compute(model: Any, dtype) -> Any:
    """Floating arrays of ``model`` in ``dtype`` (e.g. bfloat16 for serving), except what
    must stay: FP8 weights and their scales, and training FP8 state."""
    from .state import OverwriteWithGradient

    def keep(x):
        return isinstance(x, (Fp8InferenceLinear, OverwriteWithGradient))

    def cast(x):
        if isinstance(x, Fp8InferenceLinear):
            bias = None if x.bias is None else x.bias.astype(dtype)
            return eqx.tree_at(lambda m: m.bias, x, bias, is_leaf=lambda v: v is None)
        if keep(x) or not eqx.is_inexact_array(x):
            return x
        return x.astype(dtype)

    return jax.tree_util.tree_map(cast, model, is_leaf=keep)


def weight_bytes(model: Any) -> int:
    """Bytes of every array in ``model`` (its weights, scales and any state)."""
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)))


def save_inference(path: str | Path, model: Any) -> Path:
    """Write ``model``'s arrays (e4m3 weights as they are) to the orbax checkpoint ``path``
    (a new directory); returns its absolute path."""
    import orbax.checkpoint as ocp

    path = Path(path).expanduser().resolve()
    if path.exists():
        raise FileExistsError(f"save_inference: {path} exists; pass a new directory.")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, eqx.filter(model, eqx.is_array))
    checkpointer.wait_until_finished()
    return path


def _is_array_like(x) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def load_inference(path: str | Path, like: Any) -> Any:
    """Read a `save_inference` checkpoint into a model shaped like ``like`` (an inference
    model of the same structure and options, e.g. ``eqx.filter_eval_shape`` of the
    `to_inference` call); arrays come back bit for bit."""
    import orbax.checkpoint as ocp

    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"load_inference: no checkpoint at {path}.")
    params, static = eqx.partition(like, _is_array_like)
    target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    restored = ocp.StandardCheckpointer().restore(path, target)
    return eqx.combine(restored, static)
