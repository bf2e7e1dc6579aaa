"""`fp8_linear_layers`: turn the linear layers of an existing model into FP8 ones."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import equinox as eqx
import jax

from ._config import Fp8Config, resolve_config
from ._dot_general import Fp8DotGeneral, OverwriteWithGradient
from .nn._linear import Linear


@dataclasses.dataclass
class LayerDecision:
    """One layer's fate: ``converted`` or not (``reason``), and for a converted layer the
    ``min_tokens`` below which a call still runs in the input precision (0: never)."""

    path: str
    kind: str
    in_features: int
    out_features: int
    stack: tuple[int, ...]
    converted: bool
    reason: str
    min_tokens: int = 0

    @property
    def tier(self) -> str:
        """``"fp8"`` (every call FP8), ``"fp8_from_tokens"`` (FP8 from ``min_tokens``
        rows per call, bf16 below) or ``"skipped"``."""
        if not self.converted:
            return "skipped"
        return "fp8_from_tokens" if self.min_tokens > 0 else "fp8"

    @property
    def verdict(self) -> str:
        """The decision in words, as the report prints it."""
        note = "" if self.reason == "converted" else f" ({self.reason})"
        if self.tier == "fp8":
            return "FP8" + note
        if self.tier == "fp8_from_tokens":
            n = self.min_tokens
            return f"converted, but bf16 below {n} tokens per call (FP8 from {n}){note}"
        return f"skipped ({self.reason})"


SMALL_MODEL_HINT = (
    "To run every layer in FP8 whatever its size and the tokens per call (small models, "
    "tests), use Fp8Config(selective=False), or lower the thresholds: "
    "Fp8Config(min_features=0, min_weight_elements=0, min_tokens=0)."
)


@dataclasses.dataclass
class ConversionReport:
    """Which layers became FP8 and which were skipped, with the reason for each.

    Three tiers (`LayerDecision.tier`): ``fp8`` layers run every call in FP8;
    ``fp8_from_tokens`` layers are converted but a call with fewer than their
    ``min_tokens`` rows (tokens) runs in the input precision (bf16) and leaves their FP8
    state unchanged; ``skipped`` layers stay as they were. `fp8_linear_layers` makes it
    (``return_report=True``); printing it gives the table.

    Arguments:
        layers: one `LayerDecision` per linear layer found, in the model's order.
    """

    layers: list[LayerDecision]

    @property
    def converted(self) -> list[str]:
        """Paths of the converted layers (both FP8 tiers)."""
        return [lay.path for lay in self.layers if lay.converted]

    @property
    def fp8(self) -> list[str]:
        """Paths of the layers whose every call runs in FP8."""
        return [lay.path for lay in self.layers if lay.tier == "fp8"]

    @property
    def fp8_from_tokens(self) -> dict[str, int]:
        """Converted layers that run bf16 below some tokens per call: path -> that count."""
        return {lay.path: lay.min_tokens for lay in self.layers if lay.tier == "fp8_from_tokens"}

    @property
    def skipped(self) -> dict[str, str]:
        """Layers left as they were: path -> why."""
        return {lay.path: lay.reason for lay in self.layers if not lay.converted}

    def fp8_at(self, tokens: int) -> list[str]:
        """Paths of the layers that run in FP8 on a call with ``tokens`` rows (tokens).

        Arguments:
            tokens: rows per call (batch times sequence length, for a transformer).

        Returns:
            The dotted paths, in the report's order.
        """
        return [lay.path for lay in self.layers if lay.converted and tokens >= lay.min_tokens]

    def headline(self) -> str:
        """How many layers will run in FP8, and from how many tokens per call."""
        n, total = len(self.converted), len(self.layers)
        if not n:
            return (
                f"fp8jax: NOTHING will run in FP8: 0 of {total} linear layers converted "
                "(every one skipped, see below).\n  " + SMALL_MODEL_HINT
            )
        line = f"fp8jax: {n} of {total} linear layers in FP8"
        gated = sorted(set(self.fp8_from_tokens.values()))
        if gated:
            line += (
                f", but {len(self.fp8_from_tokens)} of them only on calls with at least "
                f"{' / '.join(map(str, gated))} tokens (Fp8Config.min_tokens): bf16 below"
            )
        return line

    def __str__(self) -> str:
        width = max([len(lay.path) for lay in self.layers] + [5])
        lines = [self.headline(), f"  {'layer':<{width}}  {'in':>6} {'out':>6}  decision"]
        for lay in self.layers:
            stack = f" x{'x'.join(map(str, lay.stack))} stacked" if lay.stack else ""
            lines.append(
                f"  {lay.path:<{width}}  {lay.in_features:>6} {lay.out_features:>6}  "
                f"{lay.verdict}{stack}"
            )
        return "\n".join(lines)

    __repr__ = __str__


def token_floor(config: Fp8Config | None) -> int:
    """Rows per call below which a converted layer with ``config`` runs in the input
    precision (`fp8jax._ops.dot.uses_fp8`): ``min_tokens`` with ``selective``, else 0."""
    if config is None or not config.selective:
        return 0
    return config.min_tokens


def warn_if_none_converted(owner: str, report: ConversionReport, stacklevel: int = 3) -> None:
    """Warn, with the report, when ``report`` converted no layer at all."""
    if not report.converted:
        warnings.warn(
            f"{owner} converted no layer: nothing will run in FP8.\n{report}", stacklevel=stacklevel
        )


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
            small = min(in_f, out_f)
            return (
                False,
                f"too small to gain: min(in, out)={small} < min_features={config.min_features}",
            )
        if in_f * out_f < config.min_weight_elements:
            size, floor = in_f * out_f, config.min_weight_elements
            return False, f"too small to gain: in*out={size} < min_weight_elements={floor}"
    return True, "converted"


def _floor(layer) -> int:
    """`token_floor` of an already converted layer (its `Fp8DotGeneral`'s config)."""
    return token_floor(getattr(getattr(layer, "dot_general", None), "config", None))


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

    With the default (``selective``) config, small layers stay as they are
    (``min_features``, ``min_weight_elements``) and a converted layer called on fewer
    than ``min_tokens`` rows runs in bf16 (a warning names the layer when such a call is
    traced); ``Fp8Config(selective=False)`` runs every layer in FP8 at any size. The
    report (``return_report``) tells the three apart: FP8, converted but bf16 below N
    tokens per call, skipped (why).

    Arguments:
        model: an equinox/haliax module or a pytree holding linear layers.
        config: the `Fp8Config` (None: the default one).
        return_report: also return the `ConversionReport`.

    Returns:
        The converted model, or ``(model, report)`` with ``return_report``.

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
            in_f, out_f, floor = layer.in_features, layer.out_features, _floor(layer)
            decisions.append(
                LayerDecision(
                    name, "fp8jax.nn.Linear", in_f, out_f, stack, True, "already FP8", floor
                )
            )
            continue
        if hlinear is not None and isinstance(layer, hlinear):
            from ._interop.haliax import convert_haliax_linear, haliax_linear_dims

            in_f, out_f, stack = haliax_linear_dims(layer)
            if isinstance(layer.dot_general, Fp8DotGeneral):
                matched_targets |= config.matches(name, layer)
                floor = _floor(layer)
                decisions.append(
                    LayerDecision(
                        name, "haliax.nn.Linear", in_f, out_f, stack, True, "already FP8", floor
                    )
                )
                continue
            ok, reason = _decide(name, in_f, out_f, layer, config)
            matched_targets |= reason != "not in targets"
            if ok:
                new, reason = convert_haliax_linear(layer, config, stack)
                replace_where.append(layer)
                replace_with.append(new)
            floor = token_floor(config) if ok else 0
            decisions.append(
                LayerDecision(name, "haliax.nn.Linear", in_f, out_f, stack, ok, reason, floor)
            )
            continue
        in_f, out_f = layer.in_features, layer.out_features
        stack = tuple(layer.weight.shape[:-2])
        ok, reason = _decide(name, in_f, out_f, layer, config)
        matched_targets |= reason != "not in targets"
        floor = token_floor(config) if ok else 0
        decisions.append(
            LayerDecision(name, "eqx.nn.Linear", in_f, out_f, stack, ok, reason, floor)
        )
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
    warn_if_none_converted("fp8_linear_layers", report)
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
    attention's ``Fp8AttentionState``.

    Arguments:
        model: a model (any pytree) holding FP8 layers.

    Returns:
        A list of ``(dotted path, state)`` pairs, in the model's leaf order.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(
        model, is_leaf=lambda x: isinstance(x, OverwriteWithGradient)
    )
    return [(_path_str(p), x) for p, x in flat if isinstance(x, OverwriteWithGradient)]
