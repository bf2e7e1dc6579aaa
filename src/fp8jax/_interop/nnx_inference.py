"""FP8 inference weights for flax nnx (`fp8jax.to_inference` on an nnx model): each
``nnx.Linear`` with an `fp8jax.nnx.Fp8DotGeneralOp` is changed in place (nnx modules are
mutable). Its kernel keeps its ``[in, out]`` shape in e4m3, its ``dot_general`` becomes an
`Fp8InferenceDotOp` whose scales are `Fp8InferenceScale` variables (in ``nnx.state``, so
orbax saves them), and its ``promote_dtype`` leaves the e4m3 kernel as it is.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from .._inference_dot import Fp8InferenceDot, quantize_kernel
from .inference import inference_dot
from .nnx import Fp8DotGeneralOp


class Fp8InferenceScale(nnx.Variable):
    """An FP8 inference layer's kernel or input scale (fixed: not trained)."""


class Fp8InferenceDotOp(nnx.Module):
    """`fp8jax._inference_dot.Fp8InferenceDot` as an nnx module (its scales nnx variables)."""

    def __init__(self, dot: Fp8InferenceDot):
        self.weight_scale = Fp8InferenceScale(dot.weight_scale)
        self.input_scale = None if dot.input_scale is None else Fp8InferenceScale(dot.input_scale)
        self.margin = dot.margin
        self.fast_accumulation = dot.fast_accumulation

    def __call__(
        self,
        lhs,
        rhs,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ):
        x_scale = None if self.input_scale is None else self.input_scale[...]
        dot = Fp8InferenceDot(self.weight_scale[...], x_scale, self.margin, self.fast_accumulation)
        return dot(lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding)


def _keep_fp8_kernel(args, /, *, dtype=None, inexact=True):
    """``nnx.Linear.promote_dtype`` for an e4m3 kernel: the inputs and bias in ``dtype``
    (or the inputs' dtype), the kernel untouched (e4m3 has no implicit promotion)."""
    del inexact
    inputs, kernel, bias = args
    if dtype is not None:
        inputs = jnp.asarray(inputs, dtype)
    if bias is not None:
        bias = jnp.asarray(bias, dtype or inputs.dtype)
    return inputs, kernel, bias


def fp8_layers(model: nnx.Module) -> list[tuple[str, nnx.Linear]]:
    """``model``'s FP8-trained ``nnx.Linear`` layers with their dotted paths."""
    return [
        (".".join(map(str, path)), layer)
        for path, layer in nnx.iter_modules(model)
        if isinstance(layer, nnx.Linear) and isinstance(layer.dot_general, Fp8DotGeneralOp)
    ]


class Trained:
    """A layer-like view (``.dot_general``: the `Fp8DotGeneral` over the nnx state)."""

    def __init__(self, layer: nnx.Linear):
        self.dot_general = layer.dot_general.op()


def convert_in_place(model: nnx.Module, weight_scaling: str, input_scale: str) -> None:
    """Every FP8 ``nnx.Linear`` of ``model`` as an inference layer, in place."""
    for _, layer in fp8_layers(model):
        trained = Trained(layer)
        kernel = layer.kernel[...]
        stack = kernel.ndim - 2
        margin = trained.dot_general.config.margin
        data, scale = quantize_kernel(kernel, stack, (stack,), weight_scaling, margin)
        layer.kernel = nnx.Param(data)
        layer.dot_general = nnx.data(Fp8InferenceDotOp(inference_dot(trained, scale, input_scale)))
        layer.promote_dtype = _keep_fp8_kernel


def is_inference_layer(layer) -> bool:
    return isinstance(layer, nnx.Linear) and isinstance(layer.dot_general, Fp8InferenceDotOp)
