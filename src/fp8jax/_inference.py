"""FP8 inference weights: a trained fp8jax model as a forward-only model whose FP8 linear
layers hold their weights in e4m3 with their scales (half the weight memory of bf16).

`to_inference` swaps every FP8-trained linear for its inference twin: `fp8jax.nn.Linear`
(equinox, what `fp8_linear_layers` made) -> `Fp8InferenceLinear`; haliax and flax nnx
linears with fp8jax's dot_general -> an e4m3 kernel and an `Fp8InferenceDot`
(`fp8jax._interop.inference`, `fp8jax._interop.nnx_inference`). Every other layer stays as it
is. Each GEMM is one FP8 ``dot_general`` (e4m3 activations x e4m3 weights, both contracting
on their minor dim, bf16 or f32 out) with the scales applied to its output afterwards, so
XLA runs it as a cuBLASLt FP8 GEMM on Hopper. `save_inference` / `load_inference` write and
read the model with orbax.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray

from . import _checks as checks
from ._convert import _foreign_module, _haliax_linear_type, _path_str
from ._dot_general import Fp8DotGeneral
from ._inference_dot import F32, Fp8InferenceDot, _frozen_input_scale, fp8_matmul, quantize_kernel
from ._interop.inference import HaliaxInferenceLinear, haliax_linear
from ._state import OverwriteWithGradient
from .nn._linear import Linear

WEIGHT_SCALINGS = ("tensor", "channel")
INPUT_SCALES = ("frozen", "dynamic")


class Fp8InferenceLinear(eqx.Module):
    """``y = x @ dequant(weight).T + bias`` as one FP8 GEMM, forward only.

    ``weight``: e4m3 ``[out, in]`` (K-major, as Hopper's FP8 GEMM wants); ``weight_scale``:
    dequantization factor(s), ``[1]`` (``"tensor"``) or ``[out]`` (``"channel"``: one per
    output channel, applied to the GEMM's output columns); ``input_scale``: the frozen
    activation scale ``[1]``, or None to compute it from each call's amax (``"dynamic"``).
    Stacked layers (``eqx.filter_vmap``) carry leading stack dims and run one slice at a
    time (``lax.scan``), as training ran them. `to_inference` builds them.

    Arguments:
        weight: the e4m3 weight ``[*stack, out, in]``.
        weight_scale: its dequantization factor(s), ``[*stack, 1]`` or ``[*stack, out]``.
        input_scale: the frozen input scale ``[*stack, 1]``, or None (``"dynamic"``).
        bias: ``[*stack, out]`` in the output dtype, or None.
        in_features, out_features: the GEMM's K and N.
        weight_scaling: ``"tensor"`` or ``"channel"``, as ``weight_scale`` holds.
        margin: the dynamic input scale's headroom (`fp8jax.Fp8Config.margin`).
        fast_accumulation: the GEMM keeps Hopper's fast FP8 partial sums.
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
        x2 = x.reshape(-1, self.in_features)
        y = fp8_matmul(
            x2,
            self.weight,
            self.weight_scale,
            self.input_scale,
            self.margin,
            self.fast_accumulation,
            x.dtype,
        )
        if self.bias is not None:
            y = y + self.bias.astype(x.dtype)
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
    w = layer.weight  # [*stack, out, in]
    weight, w_scale = quantize_kernel(w, w.ndim - 2, (w.ndim - 1,), weight_scaling, cfg.margin)
    return Fp8InferenceLinear(
        weight=weight,
        weight_scale=w_scale,
        input_scale=_frozen_input_scale(layer) if input_scale == "frozen" else None,
        bias=layer.bias,
        in_features=layer.in_features,
        out_features=layer.out_features,
        weight_scaling=weight_scaling,
        margin=float(cfg.margin),
        fast_accumulation=cfg.fast_forward,
    )


def _haliax_linear():
    return _haliax_linear_type()


def _kinds(hlinear) -> tuple[type, ...]:
    return (Linear, Fp8InferenceLinear, HaliaxInferenceLinear) + (
        (hlinear,) if hlinear is not None else ()
    )


def _trained(x, hlinear) -> bool:
    """An FP8-trained layer: `fp8jax.nn.Linear`, or a haliax Linear with an Fp8DotGeneral."""
    if isinstance(x, Linear):
        return True
    return (
        hlinear is not None and isinstance(x, hlinear) and isinstance(x.dot_general, Fp8DotGeneral)
    )


def _served(x) -> bool:
    return isinstance(x, (Fp8InferenceLinear, HaliaxInferenceLinear))


def _no_layer_error(model, already: bool) -> ValueError:
    return ValueError(
        f"to_inference: {type(model).__name__} has no FP8 layer (fp8jax.nn.Linear, or a "
        "haliax/nnx Linear with fp8jax's dot_general) to convert; "
        + (
            "it is already an inference model."
            if already
            else "convert it with fp8jax.fp8_linear_layers (fp8jax.nnx.fp8_linear_layers for "
            "nnx) and train it first."
        )
    )


def _warn_unseen(layers) -> None:
    unseen = [name for name, layer in layers if _never_ran(layer)]
    if unseen:
        warnings.warn(
            "to_inference: no input amax recorded for "
            + ", ".join(unseen)
            + " (never trained in FP8?); their frozen input scale stays at its initial "
            "value. Use input_scale='dynamic', or run the FP8 model on data first.",
            stacklevel=3,
        )


def to_inference(model: Any, *, weight_scaling: str = "tensor", input_scale: str = "frozen"):
    """``model`` for inference: every FP8-trained linear becomes a forward-only layer with
    its weight in e4m3 and its scales; every other layer and array stays as it is.

    * equinox: each `fp8jax.nn.Linear` (what `fp8_linear_layers` makes) becomes an
      `Fp8InferenceLinear`; a new model is returned.
    * haliax: each ``haliax.nn.Linear`` with an `Fp8DotGeneral` gets an e4m3 weight and an
      `Fp8InferenceDot`; a new model is returned.
    * flax nnx: each ``nnx.Linear`` with an `fp8jax.nnx.Fp8DotGeneralOp` is changed **in
      place** (e4m3 kernel, `Fp8InferenceDotOp`); ``model`` is returned.

    ``weight_scaling``: ``"tensor"`` (one scale per weight) or ``"channel"`` (one per
    output channel, applied to the GEMM's output columns). ``input_scale``: ``"frozen"``
    (from the training amax history, as delayed scaling would use next; a layer that never
    recorded an amax keeps its scale and is named in a warning) or ``"dynamic"`` (each
    call's own amax: one more reduction).

    Arguments:
        model: a trained equinox, haliax or flax nnx model holding FP8 linears.
        weight_scaling: ``"tensor"`` or ``"channel"``.
        input_scale: ``"frozen"`` or ``"dynamic"``.

    Returns:
        The inference model (nnx: ``model`` itself, changed in place).

    Raises ``ValueError`` for another option value, or when ``model`` has no FP8 layer.
    """
    _check_option("weight_scaling", weight_scaling, WEIGHT_SCALINGS)
    _check_option("input_scale", input_scale, INPUT_SCALES)
    if _foreign_module(model) == "flax.nnx":
        return _nnx_to_inference(model, weight_scaling, input_scale)
    hlinear = _haliax_linear()
    kinds = _kinds(hlinear)
    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, kinds))[0]
    layers = [(_path_str(p), x) for p, x in flat if _trained(x, hlinear)]
    if not layers:
        raise _no_layer_error(model, any(_served(x) for _, x in flat))
    if input_scale == "frozen":
        _warn_unseen(layers)

    def convert(x):
        if isinstance(x, Linear):
            return inference_linear(x, weight_scaling, input_scale)
        if _trained(x, hlinear):
            return haliax_linear(x, weight_scaling, input_scale)
        return x

    return jax.tree_util.tree_map(convert, model, is_leaf=lambda x: isinstance(x, kinds))


def _nnx_to_inference(model, weight_scaling: str, input_scale: str):
    from flax import nnx

    from ._interop import nnx_inference as nnx_inf

    layers = nnx_inf.fp8_layers(model)
    if not layers:
        served = any(nnx_inf.is_inference_layer(m) for _, m in nnx.iter_modules(model))
        raise _no_layer_error(model, served)
    if input_scale == "frozen":
        _warn_unseen([(name, nnx_inf.Trained(layer)) for name, layer in layers])
    nnx_inf.convert_in_place(model, weight_scaling, input_scale)
    return model


# ----------------------------------------------------------------------------- utilities
def cast_compute(model: Any, dtype) -> Any:
    """Floating arrays of ``model`` in ``dtype`` (e.g. bfloat16 for serving), except what
    must stay: FP8 weights and their scales, and training FP8 state (equinox and haliax
    models; an nnx model is cast with ``nnx`` itself)."""

    def keep(x):
        return isinstance(x, (Fp8InferenceLinear, Fp8InferenceDot, OverwriteWithGradient))

    def cast(x):
        if isinstance(x, Fp8InferenceLinear):
            bias = None if x.bias is None else x.bias.astype(dtype)
            return eqx.tree_at(lambda m: m.bias, x, bias, is_leaf=lambda v: v is None)
        if keep(x) or not eqx.is_inexact_array(x) or x.dtype.itemsize == 1:  # e4m3 stays
            return x
        return x.astype(dtype)

    return jax.tree_util.tree_map(cast, model, is_leaf=keep)


def weight_bytes(model: Any) -> int:
    """Bytes of every array in ``model`` (its weights, scales and any state)."""
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)))


def _is_nnx(model) -> bool:
    return _foreign_module(model) == "flax.nnx"


def _arrays(model):
    """What is saved: an nnx model's state as a pure dict, else the pytree's arrays."""
    if _is_nnx(model):
        from flax import nnx

        return nnx.to_pure_dict(nnx.state(model))
    return eqx.filter(model, eqx.is_array)


def save_inference(path: str | Path, model: Any) -> Path:
    """Write ``model``'s arrays (e4m3 weights as they are; an nnx model's state) to the
    orbax checkpoint ``path`` (a new directory); returns its absolute path.

    Arguments:
        path: a directory that does not exist yet (FileExistsError otherwise).
        model: an inference model from `to_inference` (any pytree or nnx module works).

    Returns:
        The checkpoint's absolute path.
    """
    import orbax.checkpoint as ocp

    path = Path(path).expanduser().resolve()
    if path.exists():
        raise FileExistsError(f"save_inference: {path} exists; pass a new directory.")
    checkpointer = ocp.StandardCheckpointer()
    try:
        checkpointer.save(path, _arrays(model))
        checkpointer.wait_until_finished()
    finally:
        checkpointer.close()  # else orbax's async threads print tracebacks at exit
    return path


def _is_array_like(x) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def load_inference(path: str | Path, like: Any) -> Any:
    """Read a `save_inference` checkpoint into a model shaped like ``like``: an inference
    model of the same structure and options (equinox/haliax: e.g. ``eqx.filter_eval_shape``
    of the `to_inference` call, a new model is returned; nnx: a converted model, e.g. from
    ``nnx.eval_shape``, updated in place and returned). Arrays come back bit for bit.

    Arguments:
        path: the directory `save_inference` wrote (FileNotFoundError if absent).
        like: a model of the saved one's structure; its arrays may be abstract.

    Returns:
        The model with the saved arrays (nnx: ``like`` itself, updated in place).
    """
    import orbax.checkpoint as ocp

    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"load_inference: no checkpoint at {path}.")

    def spec(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    checkpointer = ocp.StandardCheckpointer()
    try:
        if _is_nnx(like):
            from flax import nnx

            state = nnx.state(like)
            pure = nnx.to_pure_dict(state)
            target = jax.tree_util.tree_map(spec, pure)
            _check_saved(checkpointer, path, target)
            restored = checkpointer.restore(path, target)
            nnx.replace_by_pure_dict(state, restored)
            nnx.update(like, state)
            return like
        params, static = eqx.partition(like, _is_array_like)
        target = jax.tree_util.tree_map(spec, params)
        _check_saved(checkpointer, path, target)
        restored = checkpointer.restore(path, target)
        return eqx.combine(restored, static)
    finally:
        checkpointer.close()  # else orbax's async threads print tracebacks at exit


def _key_name(key) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _named(tree, is_leaf=None) -> dict[str, Any]:
    """``{"a.b.0": leaf}`` for the leaves of ``tree`` (orbax's names of saved arrays)."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return {".".join(_key_name(k) for k in path): leaf for path, leaf in flat}


def _check_saved(checkpointer, path: Path, target: Any) -> None:
    """Compare the checkpoint's arrays (names, shapes, dtypes) with ``target``'s before
    restoring: a ValueError naming the first layer and field that differ."""
    try:
        meta = checkpointer.metadata(path).item_metadata
        saved = _named(getattr(meta, "tree", meta), is_leaf=lambda x: hasattr(x, "shape"))
    except Exception:  # noqa: BLE001 - no metadata to compare: orbax's own checks apply
        return
    wanted = _named(target)

    def where(name: str) -> str:
        layer, _, field = name.rpartition(".")
        return f"layer {layer or '(top level)'}, field {field}"

    problem = None
    for name, spec in wanted.items():
        if name not in saved:
            problem = f"{where(name)}: in `like` ({tuple(spec.shape)}), not in the checkpoint"
        elif tuple(saved[name].shape) != tuple(spec.shape):
            problem = (
                f"{where(name)}: shape {tuple(saved[name].shape)} in the checkpoint, "
                f"{tuple(spec.shape)} in `like`"
            )
        elif np.dtype(saved[name].dtype) != np.dtype(spec.dtype):
            problem = (
                f"{where(name)}: dtype {np.dtype(saved[name].dtype)} in the checkpoint, "
                f"{np.dtype(spec.dtype)} in `like`"
            )
        if problem:
            break
    extra = [name for name in saved if name not in wanted]
    if problem is None and extra:
        problem = f"{where(extra[0])}: in the checkpoint ({len(extra)} arrays), not in `like`"
    if problem is not None:
        raise ValueError(
            f"load_inference: the checkpoint at {path} does not match `like`: {problem}. "
            "`like` must be the same model converted with the same options (to_inference's "
            "weight_scaling and input_scale), e.g. "
            "eqx.filter_eval_shape(fp8jax.to_inference, model, weight_scaling=...)."
        )
