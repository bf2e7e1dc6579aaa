"""haliax adapter: FP8 for ``haliax.nn.Linear`` by setting its ``dot_general``.

Used by `fp8jax.fp8_linear_layers` when haliax is installed (``pip install fp8jax[haliax]``).
The `Fp8DotGeneral` state is per layer; inside ``haliax.nn.Stacked`` it carries the
stack's leading dims, and haliax's scan slices it with the weights.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import warnings

import equinox as eqx
import jax

from .._config import Fp8Config
from .._dot_general import Fp8DotGeneral


def _check_jax_for_haliax() -> None:
    """An ImportError in one line when the installed haliax calls a JAX API that the installed
    jax no longer has: haliax 1.4.dev453 (the newest on PyPI) calls ``jax.core.is_constant_dim``
    in every ``haliax.dot``, removed in JAX 0.11.0. Without this check ``import haliax`` works
    and the first ``haliax.nn.Linear`` call fails inside haliax. Reads haliax's source, does
    not import it; a haliax that no longer calls it passes."""
    spec = importlib.util.find_spec("haliax")
    if spec is None or not spec.submodule_search_locations:
        return  # haliax not installed: nothing here needs it
    path = os.path.join(list(spec.submodule_search_locations)[0], "jax_utils.py")
    try:
        with open(path, encoding="utf-8") as f:
            uses = "jax.core.is_constant_dim" in f.read()
    except OSError:
        return
    with warnings.catch_warnings():  # deprecated (not yet removed) in JAX 0.10
        warnings.simplefilter("ignore")
        has = hasattr(jax.core, "is_constant_dim")
    if uses and not has:
        try:
            version = importlib.metadata.version("haliax")
        except importlib.metadata.PackageNotFoundError:
            version = "(unknown version)"
        raise ImportError(
            f"fp8jax.haliax: haliax {version} needs jax < 0.11 (it calls "
            f"jax.core.is_constant_dim, removed in JAX 0.11.0); installed jax {jax.__version__}; "
            "use jax<0.11 for the haliax front door, or the equinox/flax front doors "
            "(fp8jax.fp8_linear_layers on equinox models, fp8jax.flax, fp8jax.nnx)"
        )


_check_jax_for_haliax()


def _axes(spec) -> tuple:
    return tuple(spec) if isinstance(spec, (tuple, list)) else (spec,)


def haliax_linear_dims(layer) -> tuple[int, int, tuple[int, ...]]:
    """(in_features, out_features, stack shape) of a ``haliax.nn.Linear``: what the
    selection policy (`fp8jax.Fp8Config`) and a fresh state need.

    Arguments:
        layer: a ``haliax.nn.Linear`` (its ``In``/``Out`` may be several axes).

    Returns:
        ``(in_features, out_features, stack)``: the products of its In and Out axes'
        sizes, and the weight's leading dims (``hnn.Stacked``'s layers).
    """
    in_size = math.prod(axis.size for axis in _axes(layer.In))
    out_size = math.prod(axis.size for axis in _axes(layer.Out))
    weight = layer.weight.array if hasattr(layer.weight, "array") else layer.weight
    stack = tuple(weight.shape[: weight.ndim - len(_axes(layer.In)) - len(_axes(layer.Out))])
    return in_size, out_size, stack


def convert_haliax_linear(layer, config: Fp8Config, stack: tuple[int, ...]):
    """``layer`` with an `Fp8DotGeneral` as its ``dot_general`` (no-op if it has one);
    `fp8jax.fp8_linear_layers` calls it for each selected haliax layer.

    Arguments:
        layer: a ``haliax.nn.Linear``.
        config: the `Fp8Config`.
        stack: the weight's leading (stacked) dims, from `haliax_linear_dims`.

    Returns:
        ``(layer, reason)``: the converted layer and ``"converted (dot_general)"`` or
        ``"already FP8"``.
    """
    if isinstance(layer.dot_general, Fp8DotGeneral):
        return layer, "already FP8"
    new = eqx.tree_at(lambda lay: lay.dot_general, layer, Fp8DotGeneral(config, stack_shape=stack))
    return new, "converted (dot_general)"
