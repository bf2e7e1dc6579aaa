"""FP8 inference weights for haliax layers (`fp8jax.to_inference` calls these), and the
inference dot the haliax and nnx paths share.

A ``haliax.nn.Linear`` with an `fp8jax.Fp8DotGeneral` (what `fp8_linear_layers` made) becomes
a `HaliaxInferenceLinear`: its weight a NamedArray of e4m3 values, its ``dot_general`` an
`fp8jax._inference_dot.Fp8InferenceDot` holding the scales.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx

from .._inference_dot import Fp8InferenceDot, _frozen_input_scale, quantize_kernel


class HaliaxInferenceLinear(eqx.Module):
    """A haliax ``Linear`` for inference: ``inputs.dot(weight)`` over ``In`` through an
    `Fp8InferenceDot`, output in the inputs' dtype (an e4m3 operand has no implicit dtype
    promotion, so haliax's dot is told the output dtype), plus the bias."""

    weight: Any  # NamedArray, e4m3
    bias: Any  # NamedArray or None
    dot_general: Fp8InferenceDot
    In: Any = eqx.field(static=True)
    Out: Any = eqx.field(static=True)

    def __call__(self, inputs, *, key=None):
        import haliax as hax

        del key
        out = hax.dot(
            inputs,
            self.weight,
            axis=self.In,
            dot_general=self.dot_general,
            preferred_element_type=inputs.dtype,
        )
        return out if self.bias is None else out + self.bias.astype(out.dtype)


def inference_dot(layer, scale, input_scale: str) -> Fp8InferenceDot:
    """The `Fp8InferenceDot` of an FP8-trained ``layer`` (it has ``.dot_general``, an
    `fp8jax.Fp8DotGeneral`) with kernel scale(s) ``scale``."""
    cfg = layer.dot_general.config
    frozen = _frozen_input_scale(layer) if input_scale == "frozen" else None
    return Fp8InferenceDot(scale, frozen, float(cfg.margin), cfg.fast_forward)


def haliax_linear(layer, weight_scaling: str, input_scale: str):
    """A haliax ``Linear`` (FP8-trained) as its inference twin."""
    import haliax as hax

    from .haliax import _axes, haliax_linear_dims

    active = getattr(layer.reparam, "active_scale", 1)
    if active != 1:
        raise ValueError(
            "to_inference: a haliax Linear whose reparam scales its weight "
            f"(active_scale={active}) cannot keep an e4m3 weight."
        )
    _, _, stack = haliax_linear_dims(layer)
    names = [ax.name for ax in layer.weight.axes]
    in_axes = tuple(names.index(ax.name) for ax in _axes(layer.In))
    cfg = layer.dot_general.config
    data, scale = quantize_kernel(
        layer.weight.array, len(stack), in_axes, weight_scaling, cfg.margin
    )
    dot = inference_dot(layer, scale, input_scale)
    weight = hax.named(data, layer.weight.axes)
    return HaliaxInferenceLinear(weight, layer.bias, dot, layer.In, layer.Out)
