"""`Fp8Config`: the FP8 recipe (scaling, formats) and the layer-selection policy."""

from __future__ import annotations

import dataclasses
import inspect
import numbers
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal, Union

import jax.numpy as jnp
import numpy as np

from . import _recipe
from ._recipe_base import Recipe

Targets = Union[None, str, Sequence[str], Callable[[str, Any], bool]]

MAX_HISTORY = 1 << 16  # amax history entries kept per tensor (flax and TE use 1024 or less)
# The recipe settings: `Fp8Config` keywords that the recipe object holds (`Recipe.SETTINGS`),
# with their defaults (the built-in recipes' own: what ``Fp8Config.<name>`` reads where its
# recipe has no such setting).
DEFAULTS: dict[str, Any] = {
    k: v for r in reversed(_recipe.BUILTIN) for k, v in r().settings().items()
}
# Settings only the block-wise recipe reads: set by hand for another, a warning says so.
BLOCKWISE_ONLY = ("block_size", "power_of_two_scales", "blockwise_backend")


class _Unset:
    """A recipe setting left out: the recipe's own value stays."""

    def __repr__(self) -> str:
        return "<the recipe's>"


UNSET: Any = _Unset()


class _Setting:
    """``Fp8Config.<name>``: a recipe setting, read from the recipe (where it has none:
    `DEFAULTS`)."""

    def __set_name__(self, owner, name: str):
        self.name = name

    def __get__(self, config, owner=None):
        if config is None:
            return self
        return config.recipe.settings().get(self.name, DEFAULTS[self.name])


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Stored:
    """The fields an `Fp8Config` stores, set by the dataclass's own ``__init__``, which
    `Fp8Config.__init__` calls once it has checked its keywords and built the recipe: no
    field is set behind a constructor's back, and the recipe is built once."""

    fp8_format: Literal["hybrid", "e4m3"] | None
    fast_accumulation: Literal["forward", "all", "none"]
    targets: Targets
    selective: bool
    alignment: int
    min_features: int
    min_weight_elements: int
    min_tokens: int
    on_unsupported: Literal["warn", "silent", "raise"]
    # The recipe object; its fields read as the config's (``config.margin``), also in the
    # messages that name a field two configs differ in (`fp8jax._grad_overwrite`).
    recipe: Recipe = dataclasses.field(metadata={"inline": True})


@dataclasses.dataclass(frozen=True, init=False)
class Fp8Config(_Stored):
    """How FP8 is applied.

    Arguments (the recipe):
      recipe: how tensors are scaled (`fp8jax._recipe`): ``"tensor"`` (one scale per
        tensor, delayed or current by ``scaling``; the default), ``"rowwise"`` (one scale
        per row of each GEMM operand along its contracting dim, current scaling) or
        ``"blockwise"`` (DeepSeek-V3: activations and gradients per ``1 x block_size``
        tile along the contracting dim, weights per ``block_size x block_size`` block,
        current scaling, the scales applied in the GEMM's float32 accumulator every
        ``block_size`` K). Row- and block-wise ignore ``scaling``, the amax-history
        fields and ``cast_kernel``; they keep no history. Or a recipe object
        (`fp8jax._recipe`: `PerTensor`, `RowWise`, `BlockWise`, or a `Recipe` of one's
        own), used as it is (the settings given with it change it). After construction
        this field holds the recipe object the ops use, the one place the settings below
        live: the keywords build it, once, ``config.margin`` etc. read it back, and
        ``dataclasses.replace(config, margin=1)`` gives the recipe the new value.
      block_size: tile size of ``"blockwise"`` (a multiple of 16; 128 as DeepSeek-V3 and
        the Hopper kernel).
      power_of_two_scales: ``"blockwise"`` scales rounded up to powers of two (exact to
        apply; TE's option).
      blockwise_backend: the block-scaled GEMM's backend, ``"auto"`` (the Hopper kernel
        where it can run the call, else the plain-JAX reference), ``"kernel"`` or
        ``"reference"`` (`fp8jax._kernels.blockwise_gemm`).
      scaling: ``"delayed"`` (scale from an amax history, flax/TE convention) or
        ``"current"`` (just-in-time per-tensor amax of the tensor being cast).
      fp8_format: ``"hybrid"`` (e4m3 for inputs and weights, e5m2 for output
        gradients) or ``"e4m3"`` (e4m3 everywhere). None (default): hybrid for the
        per-tensor recipe, e4m3 for row- and block-wise (DeepSeek-V3's choice).
      amax_history_length: ring-buffer length for delayed scaling.
      amax_compute_algo: ``"max"`` over the history, or ``"most_recent"`` entry.
      margin: scale = amax * 2**margin / fp8_max (headroom in powers of two).
      fast_accumulation: which FP8 GEMMs may use Hopper's fast FP8 accumulation
        (partial sums kept in the tensor cores' reduced precision): ``"forward"``
        (the Transformer Engine / flax recipe: the forward GEMM fast, dgrad and
        wgrad with the promoted accumulator), ``"all"`` (fastest) or ``"none"``.
        Where the products share a sign the fast accumulator's error is an order of
        magnitude above the promoted one's, for a few percent less GEMM time
        (`benchmarks/RESULTS.md`, "FP8 accumulation, the one-pass cast kernel, and the
        trainer").
      cast_kernel: write each tensor's two FP8 layouts and its amax in one Pallas
        Triton pass (Hopper; elsewhere, on a mesh, or for shapes it cannot tile,
        XLA's cast and transpose). On by default: it made the linear and the two-block
        train steps faster (a gelu between the layers too) and their compile shorter
        (XLA compiles fewer cast/transpose/reduction fusions; `benchmarks/RESULTS.md`,
        "the Pallas cast kernel by default", ninth session). It is a
        custom call, so XLA cannot fuse the tensor's producer (a norm, an activation)
        into it; ``False`` gives XLA's fused casts back.

    Arguments (the selection of layers, used by `fp8_linear_layers`):
      targets: ``None`` (every linear); a regex string, which must match the whole
        dotted path (``"layers\\.\\d+\\.mlp.*"``); a list (a layer is in when an
        entry equals its whole path or fullmatches it as a regex); or a predicate
        ``(path, module) -> bool``. For ``haliax.nn.Linear`` layers haliax's rules
        apply too: a string may match a prefix of the path (``re.match``, so
        ``"layers.0"`` is an MLP's first layer) and a list entry may equal the last
        path component (``["up_proj"]``; inside ``hnn.Stacked`` the path is
        ``"blocks.stacked.up_proj"``). See `matches`. `fp8_linear_layers` raises if
        the targets select no layer, and warns naming a list entry that selects none.
      selective: skip layers where FP8 cannot pay off (size thresholds below).
        ``False`` converts every layer whose dims allow FP8 at all.
      alignment: every FP8 GEMM dim must be a multiple of this (Hopper: 16).
      min_features: a layer with ``min(in, out)`` below this stays bf16.
      min_weight_elements: a layer with ``in * out`` below this stays bf16.
      min_tokens: at call time, a GEMM whose rows (M) fall below this runs in the
        input precision and leaves the FP8 state alone (``selective`` only; a warning
        says so, once per layer shape, when such a call is traced).

    Arguments (the fallback):
      on_unsupported: what a `Fp8DotGeneral` does with a call it cannot run in
        FP8 (rows not aligned, non-float dtypes are always errors):
        ``"warn"`` (plain dot, one warning), ``"silent"`` or ``"raise"``.
    """

    # Recipe settings: constructor keywords held by the recipe, read back from it.
    scaling = _Setting()
    amax_history_length = _Setting()
    amax_compute_algo = _Setting()
    margin = _Setting()
    cast_kernel = _Setting()
    block_size = _Setting()
    power_of_two_scales = _Setting()
    blockwise_backend = _Setting()

    def __init__(
        self,
        # The order of the keywords is that of the earlier dataclass fields: positional
        # construction keeps its meaning.
        scaling: Literal["delayed", "current"] = UNSET,
        fp8_format: Literal["hybrid", "e4m3"] | None = None,
        amax_history_length: int = UNSET,
        amax_compute_algo: Literal["max", "most_recent"] = UNSET,
        margin: float = UNSET,
        fast_accumulation: Literal["forward", "all", "none"] = "forward",
        cast_kernel: bool = UNSET,
        targets: Targets = None,
        selective: bool = True,
        alignment: int = 16,
        # Defaults from the H100 crossover sweep (benchmarks/RESULTS.md): FP8 loses at
        # K = N <= 2048 for M <= 8192, and at K = N = 4096 it wins from M = 4096 on.
        min_features: int = 2048,
        min_weight_elements: int = 4096 * 4096,
        min_tokens: int = 4096,
        on_unsupported: Literal["warn", "silent", "raise"] = "warn",
        recipe: str | Recipe = "tensor",
        block_size: int = UNSET,
        power_of_two_scales: bool = UNSET,
        blockwise_backend: Literal["auto", "kernel", "reference"] = UNSET,
    ):
        fields = dict(
            fp8_format=fp8_format,
            fast_accumulation=fast_accumulation,
            targets=targets,
            selective=selective,
            alignment=alignment,
            min_features=min_features,
            min_weight_elements=min_weight_elements,
            min_tokens=min_tokens,
            on_unsupported=on_unsupported,
        )
        given = dict(
            scaling=scaling,
            amax_history_length=amax_history_length,
            amax_compute_algo=amax_compute_algo,
            margin=margin,
            cast_kernel=cast_kernel,
            block_size=block_size,
            power_of_two_scales=power_of_two_scales,
            blockwise_backend=blockwise_backend,
        )
        given = {k: v for k, v in given.items() if v is not UNSET}
        fields = _checked(fields)
        given = _checked(given)
        fields["targets"] = self._checked_targets(targets, _bad)
        if isinstance(recipe, Recipe):
            base = recipe
        else:
            base = _recipe.named(recipe) if isinstance(recipe, str) else None
            if base is None:
                expected = " or ".join(repr(r) for r in _recipe.RECIPES)
                _bad("recipe", recipe, f"{expected} or an fp8jax._recipe_base.Recipe")
        built = base.configure(given)
        # A recipe object passed in is checked (and its numpy scalars made Python's) too.
        super().__init__(**fields, recipe=built.configure(_checked(built.settings())))
        held = built.settings()
        unused = [  # given by hand, not at its default, and not a setting of this recipe
            name
            for name, value in given.items()
            if name not in held
            and value != DEFAULTS[name]
            and not (name == "scaling" and value == "current")  # row/block-wise: always
        ]
        if unused:  # set by hand, they would do nothing: say so
            blockwise = any(name in BLOCKWISE_ONLY for name in unused)
            warnings.warn(
                f"Fp8Config: recipe={built.kind!r} ignores "
                f"{', '.join(f'{n}={given[n]!r}' for n in unused)} (its settings: "
                f"{', '.join(sorted(held)) or 'none'})"
                + (
                    "; block_size, power_of_two_scales and blockwise_backend apply "
                    "to recipe='blockwise' only."
                    if blockwise
                    else "."
                ),
                stacklevel=2,
            )

    @staticmethod
    def _checked_targets(targets: Targets, bad) -> Targets:
        """``targets`` checked (`bad` names what is wrong), a list of names as a tuple."""
        if targets is None or isinstance(targets, str):
            pass
        elif isinstance(targets, type):
            bad("targets", targets, "a predicate (path, module) -> bool, not a class")
        elif callable(targets):
            try:
                inspect.signature(targets).bind("path", None)
            except TypeError:
                bad("targets", targets, "a predicate taking two arguments (path, module)")
            except ValueError:  # no signature (a builtin): let the call decide
                pass
        elif isinstance(targets, (list, tuple)):
            if not targets:
                bad("targets", targets, "at least one name or regex (None selects every layer)")
            for i, t in enumerate(targets):
                if not isinstance(t, str):
                    bad(f"targets[{i}]", t, "a string (an exact dotted path or a regex)")
            targets = tuple(targets)
        else:
            bad(
                "targets",
                targets,
                "None, a regex string, a list of names/regexes or a predicate (path, module)",
            )
        for pattern in _patterns(targets):
            try:
                re.compile(pattern)
            except re.error as e:
                bad("targets", pattern, f"a valid regex ({e})")
        return targets

    # --- derived, used by the kernels -------------------------------------------------
    @property
    def recipe_name(self) -> str:
        """``"tensor"``, ``"rowwise"`` or ``"blockwise"``."""
        return self.recipe.kind

    @property
    def history_length(self) -> int:
        """Amax-history length actually stored (1 for current scaling: the last amax)."""
        return self.recipe.history_length

    @property
    def fast_forward(self) -> bool:
        """Whether the forward GEMM may use fast FP8 accumulation (`fast_accumulation`)."""
        return self.fast_accumulation in ("forward", "all")

    @property
    def fast_backward(self) -> bool:
        """Whether the dgrad and wgrad GEMMs may use fast FP8 accumulation."""
        return self.fast_accumulation == "all"

    @property
    def input_dtype(self):
        return jnp.float8_e4m3fn

    @property
    def kernel_dtype(self):
        return jnp.float8_e4m3fn

    @property
    def grad_dtype(self):
        fmt = self.fp8_format or self.recipe.default_format
        return jnp.float8_e5m2 if fmt == "hybrid" else jnp.float8_e4m3fn

    def matches(self, path: str, module: Any) -> bool:
        """Whether ``targets`` selects the layer at dotted ``path`` (e.g. ``"blocks.0.mlp.up"``).

        A regex string must match the whole path; a list entry must equal the whole path or
        match it as a regex. For haliax layers haliax's own rules apply too (as in
        ``haliax.quantization``): a regex string may match a prefix of the path
        (``re.match``) and a list entry may equal the path's last component, so
        ``targets=["up_proj"]`` selects every ``...up_proj`` and ``"layers.0"`` the first
        layer. A predicate gets ``(path, module)``."""
        if self.targets is None:
            return True
        if callable(self.targets) and not isinstance(self.targets, str):
            return bool(self.targets(path, module))
        haliax = type(module).__module__.startswith("haliax")
        if isinstance(self.targets, str):
            found = re.match if haliax else re.fullmatch
            return found(self.targets, path) is not None
        return any(self.entry_matches(p, path, module) for p in self.targets)

    @staticmethod
    def entry_matches(entry: str, path: str, module: Any) -> bool:
        """Whether one entry of a list ``targets`` selects the layer at ``path``: equal to
        the whole path, a regex matching all of it, or (haliax layers) its last component."""
        if path == entry or re.fullmatch(entry, path):
            return True
        haliax = type(module).__module__.startswith("haliax")
        return haliax and path.rsplit(".", 1)[-1] == entry


def _bad(field, value, allowed):
    raise ValueError(f"Fp8Config.{field}={value!r} is not allowed; expected {allowed}.")


_CHOICES = {
    "scaling": (("delayed", "current"), "'delayed' or 'current'"),
    "fp8_format": (("hybrid", "e4m3", None), "'hybrid', 'e4m3' or None"),
    "blockwise_backend": (("auto", "kernel", "reference"), "'auto', 'kernel' or 'reference'"),
    "amax_compute_algo": (("max", "most_recent"), "'max' or 'most_recent'"),
    "fast_accumulation": (("forward", "all", "none"), "'forward', 'all' or 'none'"),
    "on_unsupported": (("warn", "silent", "raise"), "'warn', 'silent' or 'raise'"),
}
_BOOLS = ("cast_kernel", "selective", "power_of_two_scales")
_INTS = {
    "amax_history_length": 1,
    "alignment": 1,
    "min_features": 0,
    "min_weight_elements": 0,
    "min_tokens": 0,
    "block_size": 16,
}


def _checked(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (`Fp8Config` keywords) checked, numpy scalars made Python's; a ValueError
    naming the first one that is not allowed. Names it does not know pass as they are."""
    out = dict(values)
    for name, value in values.items():
        if name in _CHOICES and value not in _CHOICES[name][0]:
            _bad(name, value, _CHOICES[name][1])
        if name in _BOOLS:
            if isinstance(value, np.bool_):
                out[name] = bool(value)
            elif not isinstance(value, bool):
                _bad(name, value, "True or False")
        if name in _INTS:
            low = _INTS[name]
            if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)):
                _bad(name, value, f"an int >= {low}")
            if value < low:
                _bad(name, value, f"an int >= {low}")
            out[name] = int(value)
    if out.get("amax_history_length", 1) > MAX_HISTORY:  # a float per step, tensor and layer
        _bad("amax_history_length", out["amax_history_length"], f"an int in [1, {MAX_HISTORY}]")
    if "margin" in values:
        margin = values["margin"]
        if not isinstance(margin, numbers.Real) or isinstance(margin, (bool, np.bool_)):
            _bad("margin", margin, "a number in [0, 8]")
        if not 0 <= margin <= 8:  # also rejects nan
            _bad("margin", margin, "a number in [0, 8]")
        if isinstance(margin, np.generic):
            out["margin"] = float(margin)
    if out.get("block_size", 16) % 16:
        _bad("block_size", out["block_size"], "a multiple of 16 (the FP8 GEMMs' alignment)")
    return out


def resolve_config(config: "Fp8Config | None") -> Fp8Config:
    """``config``, or the default `Fp8Config` for None; a TypeError for anything else."""
    if config is None:
        return Fp8Config()
    if not isinstance(config, Fp8Config):
        raise TypeError(f"config must be an fp8jax.Fp8Config, got {type(config).__name__}")
    return config


_WARNED_TOKENS: set[tuple] = set()
_LIBRARIES = ("jax", "jaxlib", "equinox", "fp8jax", "flax", "haliax", "contextlib", "functools")


def warn_below_min_tokens(config: Fp8Config, m: int, k: int, n: int, dtype) -> None:
    """Warn once per layer shape, token count and config (when a call is traced: no
    runtime cost) that a converted ``k -> n`` layer called on ``m`` rows runs in ``dtype``
    (its input precision), not FP8, because of ``config.min_tokens``."""
    key = (config, m, k, n, np.dtype(dtype).name)
    if key in _WARNED_TOKENS:
        return
    _WARNED_TOKENS.add(key)
    frame, level = sys._getframe(1), 2  # the first frame outside JAX and the libraries
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _LIBRARIES:
        frame, level = frame.f_back, level + 1
    warnings.warn(
        f"fp8jax: an FP8 layer ({k}->{n} features) is called on {m} tokens (GEMM rows), "
        f"fewer than Fp8Config.min_tokens={config.min_tokens}: the call runs in "
        f"{np.dtype(dtype).name}, not FP8, and leaves the layer's FP8 state unchanged. Call "
        f"it on at least {config.min_tokens} tokens, or use Fp8Config(min_tokens=0) (or "
        "selective=False) to run FP8 at any size.",
        stacklevel=level if frame is not None else 2,
    )


def _patterns(targets) -> tuple[str, ...]:
    if isinstance(targets, str):
        return (targets,)
    if isinstance(targets, tuple):
        return targets
    return ()
