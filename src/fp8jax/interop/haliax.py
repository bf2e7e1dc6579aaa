"""haliax adapter: FP8 for ``haliax.nn.Linear`` by setting its ``dot_general``.

Used by `fp8jax.fp8_linear_layers` when haliax is installed (``pip install fp8jax[haliax]``).
The `Fp8DotGeneral` state is per layer; inside ``haliax.nn.Stacked`` it carries the
stack's leading dims, and haliax's scan slices it with the weights.
"""

from __future__ import annotations

import math

import equinox as eqx

from ..config import Fp8Config
from ..dot_general import Fp8DotGeneral


def _axes(spec) -> tuple:
    return tuple(spec) if isinstance(spec, (tuple, list)) else (spec,)


def haliax_linear_dims(layer) -> tuple[int, int, tuple[int, ...]]:
    """(in_features, out_features, stack shape) of a ``haliax.nn.Linear``."""
    in_size = math.prod(axis.size for axis in _axes(layer.In))
    out_size = math.prod(axis.size for axis in _axes(layer.Out))
    weight = layer.weight.array if hasattr(layer.weight, "array") else layer.weight
    stack = tuple(weight.shape[: weight.ndim - len(_axes(layer.In)) - len(_axes(layer.Out))])
    return in_size, out_size, stack


def convert_haliax_linear(layer, config: Fp8Config, stack: tuple[int, ...]):
    """``layer`` with an `Fp8DotGeneral` as its ``dot_general`` (no-op if it has one)."""
    if isinstance(layer.dot_general, Fp8DotGeneral):
        return layer, "already FP8"
    new = eqx.tree_at(lambda lay: lay.dot_general, layer, Fp8DotGeneral(config, stack_shape=stack))
    return new, "converted (dot_general)"
