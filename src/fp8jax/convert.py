"""`fp8_linear_layers`: turn the linear layers of an existing model into FP8 ones."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import equinox as eqx
import jax

from .config import Fp8Config, resolve_config
from .dot_general import Fp8DotGeneral, OverwriteWithGradient
from .nn.linear import Linear


@dataclasses.dataclass
class LayerDecision:
    path: str
    kind: str
    in_features: int
    out_features: int
    stack: tuple[int, ...]
    converted: bool
    reason: str


@dataclasses.dataclass
class ConversionReport:
    """Which layers became FP8 and which were skipped, with the reason for each."""

    layers: list[LayerDecision]

    @property
    def converted(self) -> list[str]:
        return [lay.path for lay in self.layers if lay.converted]

    @property
    def skipped(self) -> dict[str, str]:
        return {lay.path: lay.reason for lay in self.layers if not lay.converted}

    def __str__(self) -> str:
        width = max([len(lay.path) for lay in self.layers] + [5])
        lines = [
            f"fp8jax: {len(self.converted)} of {len(self.layers)} linear layers in FP8",
            f"  {'layer':<{width}}  {'in':>6} {'out':>6}  decision",
        ]
        for lay in self.layers:
            stack = f" x{'x'.join(map(str, lay.stack))} stacked" if lay.stack else ""
            verdict = "FP8" if lay.converted else "skipped"
            lines.append(
                f"  {lay.path:<{width}}  {lay.in_features:>6} {lay.out_features:>6}  "
                f"{verdict}: {lay.reason}{stack}"
            )
        return "\n".join(lines)

    __repr__ = __str__


def _path_str(path) -> str:
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    return ".".join(parts)


def _decide(path: str, in_f, out_f, module, config: Fp8Config) -> tuple[bool, str]:
    """Selection policy for one layer: (convert?, reason)."""
    if in_f == "scalar" or out_f == "scalar":
        return False, "scalar features"
    if not config.matches(path, module):
        return False, "not in targets"
    a = config.alignment
    if in_f % a or out_f % a:
        return False, f"in={in_f}, out={out_f} not multiples of {a}"
    if config.selective:
        if min(in_f, out_f) < config.min_features:
            return False, f"too small to gain: min(in, out) < min_features={config.min_features}"
        if in_f * out_f < config.min_weight_elements:
            return (
                False,
                f"too small to gain: in*out < min_weight_elements={config.min_weight_elements}",
            )
    return True, "converted"


def _foreign_module(model) -> str | None:
    """'flax.linen', 'flax.nnx' or 'torch' when ``model`` is a module of that framework."""
    for cls in type(model).__mro__:
        mod = cls.__module__ or ""
        if cls.__name__ == "Module":
            for prefix in ("flax.linen", "flax.nnx", "torch"):
                if mod.startswith(prefix + "."):
                    return prefix
    return None


def _check_model(model, is_layer) -> None:
    """A TypeError naming ``model``'s kind when it cannot hold equinox/haliax linear layers."""
    kind = type(model).__name__
    foreign = _foreign_module(model)
    if foreign == "flax.linen":
        raise TypeError(
            f"fp8_linear_layers: got a flax.linen module ({kind}); linen modules are not "
            "converted after the fact. Build the dense layers with FP8 instead (import "
            "fp8jax.flax): nn.Dense(..., dot_general_cls=fp8jax.flax.fp8_dot_general_cls())."
        )
    if foreign == "flax.nnx":
        raise TypeError(
            f"fp8_linear_layers: got a flax.nnx module ({kind}); convert it with "
            "fp8jax.nnx.fp8_linear_layers (import fp8jax.nnx), which works in place."
        )
    if foreign == "torch":
        raise TypeError(
            f"fp8_linear_layers: got a PyTorch module ({kind}); fp8jax converts JAX models "
            "(equinox or haliax modules, or pytrees holding their linear layers)."
        )
    if isinstance(model, type):
        raise TypeError(
            f"fp8_linear_layers: got the class {model.__name__}, not a model; pass an instance."
        )
    leaves = jax.tree_util.tree_leaves(model, is_leaf=is_layer)
    if model is None or (len(leaves) == 1 and leaves[0] is model and not is_layer(model)):
        raise TypeError(
            "fp8_linear_layers: model must be an equinox/haliax module or a pytree holding "
            f"eqx.nn.Linear / haliax.nn.Linear layers, got {kind}."
        )


def _haliax_linear_type():
    try:
        import haliax.nn as hnn  # noqa: F401
    except Exception:  # haliax is an optional extra
        return None
    return hnn.Linear


def fp8_linear_layers(model: Any, config: Fp8Config | None = None, *, return_report: bool = False):
    """Return ``model`` with its linear layers running FP8 GEMMs.

    Converts every `eqx.nn.Linear` (and so `eqx.nn.MLP`, `eqx.nn.MultiheadAttention`
    projections, stacks built with `eqx.filter_vmap`) into `fp8jax.nn.Linear` sharing
    the same weight and bias arrays, and, when haliax is installed, sets the
    ``dot_general`` of every ``haliax.nn.Linear`` to an `Fp8DotGeneral`. Layers the
    config's targets or selection policy leave out are listed in the report with the
    reason (a warning says so when no layer at all was converted). Converting an
    already converted model is a no-op.

    Raises ``TypeError`` if ``model`` is not a pytree that can hold such layers (an
    array, a scalar, None, a class, a flax or PyTorch module) or ``config`` is not an
    `Fp8Config`; ``ValueError`` if the model has no linear layer, or if ``config.targets``
    matches none.
    """
    config = resolve_config(config)
    hlinear = _haliax_linear_type()
    kinds = (eqx.nn.Linear, Linear) + ((hlinear,) if hlinear is not None else ())

    def is_layer(x):
        return isinstance(x, kinds)

    _check_model(model, is_layer)
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_layer)
    found = [(path, leaf) for path, leaf in flat if is_layer(leaf)]
    if not found:
        raise ValueError(
            "fp8_linear_layers: no linear layer (eqx.nn.Linear"
            f"{' or haliax.nn.Linear' if hlinear else ''}) found in {type(model).__name__}."
        )
    decisions, replace_where, replace_with = [], [], []
    matched_targets = False
    named = [(_path_str(path), layer) for path, layer in found]
    for name, layer in named:
        if isinstance(layer, Linear):
            stack = tuple(layer.weight.shape[:-2])
            matched_targets |= config.matches(name, layer)
            decisions.append(
                LayerDecision(
                    name,
                    "fp8jax.nn.Linear",
                    layer.in_features,
                    layer.out_features,
                    stack,
                    True,
                    "already FP8",
                )
            )
            continue
        if hlinear is not None and isinstance(layer, hlinear):
            from .interop.haliax import convert_haliax_linear, haliax_linear_dims

            in_f, out_f, stack = haliax_linear_dims(layer)
            if isinstance(layer.dot_general, Fp8DotGeneral):
                matched_targets |= config.matches(name, layer)
                decisions.append(
                    LayerDecision(name, "haliax.nn.Linear", in_f, out_f, stack, True, "already FP8")
                )
                continue
            ok, reason = _decide(name, in_f, out_f, layer, config)
            matched_targets |= reason != "not in targets"
            if ok:
                new, reason = convert_haliax_linear(layer, config, stack)
                replace_where.append(layer)
                replace_with.append(new)
            decisions.append(
                LayerDecision(name, "haliax.nn.Linear", in_f, out_f, stack, ok, reason)
            )
            continue
        in_f, out_f = layer.in_features, layer.out_features
        stack = tuple(layer.weight.shape[:-2])
        ok, reason = _decide(name, in_f, out_f, layer, config)
        matched_targets |= reason != "not in targets"
        decisions.append(LayerDecision(name, "eqx.nn.Linear", in_f, out_f, stack, ok, reason))
        if ok:
            replace_where.append(layer)
            replace_with.append(Linear.from_linear(layer, config))
    if config.targets is not None and not matched_targets:
        raise ValueError(
            f"fp8_linear_layers: targets={config.targets!r} match no linear layer; layers are: "
            + ", ".join(d.path for d in decisions)
        )
    _warn_unmatched_entries("fp8_linear_layers", "linear layer", config, named)
    if replace_where:
        ids = {id(layer): i for i, layer in enumerate(replace_where)}
        model = jax.tree_util.tree_map(
            lambda x: replace_with[ids[id(x)]] if id(x) in ids else x, model, is_leaf=is_layer
        )
    report = ConversionReport(decisions)
    if not report.converted:
        warnings.warn(
            f"fp8_linear_layers converted no layer; every one was skipped:\n{report}", stacklevel=2
        )
    return (model, report) if return_report else model


def _warn_unmatched_entries(owner: str, kind: str, config: Fp8Config, layers) -> None:
    """Warn naming the entries of a list ``config.targets`` that select none of ``layers``
    (``(path, module)`` pairs, by `Fp8Config.entry_matches`): a typo in one entry would
    otherwise leave its layers in bf16 silently. Nothing for other kinds of targets."""
    targets = config.targets
    if targets is None or isinstance(targets, str) or callable(targets):
        return
    unmatched = [
        entry
        for entry in targets
        if not any(config.entry_matches(entry, path, layer) for path, layer in layers)
    ]
    if unmatched:
        warnings.warn(
            f"{owner}: targets entries {unmatched} match no {kind}; layers are: "
            + ", ".join(path for path, _ in layers),
            stacklevel=3,
        )


def fp8_state(model: Any) -> list[tuple[str, OverwriteWithGradient]]:
    """Every FP8 scaling state in ``model`` with its dotted path (for inspection):
    linear layers' `Fp8DotGeneral`, grouped experts' ``Fp8GroupedState`` and FP8
    attention's ``Fp8AttentionState``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(
        model, is_leaf=lambda x: isinstance(x, OverwriteWithGradient)
    )
    return [(_path_str(p), x) for p, x in flat if isinstance(x, OverwriteWithGradient)]
