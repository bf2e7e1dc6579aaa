"""`Fp8Config`: the FP8 recipe (scaling, formats) and the layer-selection policy."""

from __future__ import annotations

import dataclasses
import inspect
import numbers
import re
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal, Union

import jax.numpy as jnp
import numpy as np

from .recipe import RECIPES, BlockWise, PerTensor, RowWise

Targets = Union[None, str, Sequence[str], Callable[[str, Any], bool]]

# Fields only the block-wise recipe reads, with their defaults.
BLOCKWISE_ONLY = (
    ("block_size", 128),
    ("power_of_two_scales", False),
    ("blockwise_backend", "auto"),
)
MAX_HISTORY = 1 << 16  # amax history entries kept per tensor (flax and TE use 1024 or less)


class _Normalising(type):
    """`Fp8Config`'s constructor: numpy scalars become Python ones, a list of targets a
    tuple and the recipe's name its object (`Fp8Config._normalised`) before the frozen
    dataclass stores the arguments; its ``__post_init__`` then validates them."""

    def __call__(cls, *args, **kwargs):
        names = [f.name for f in dataclasses.fields(cls)]
        if len(args) <= len(names) and not set(names[: len(args)]) & set(kwargs):
            args, kwargs = (), cls._normalised({**dict(zip(names, args)), **kwargs})
        return super().__call__(*args, **kwargs)  # anything else: __init__'s own TypeError

    @property
    def __signature__(cls) -> inspect.Signature:  # the dataclass's, not __call__'s
        sig = inspect.signature(cls.__init__)
        return sig.replace(parameters=list(sig.parameters.values())[1:])


@dataclasses.dataclass(frozen=True)
class Fp8Config(metaclass=_Normalising):
    """How FP8 is applied: every field is a constructor keyword, with a default.

    Arguments (the recipe):
      recipe: how tensors are scaled (`fp8jax.recipe`): ``"tensor"`` (one scale per
        tensor, delayed or current by ``scaling``; the default), ``"rowwise"`` (one scale
        per row of each GEMM operand along its contracting dim, current scaling) or
        ``"blockwise"`` (DeepSeek-V3: activations and gradients per ``1 x block_size``
        tile along the contracting dim, weights per ``block_size x block_size`` block,
        current scaling, the scales applied in the GEMM's float32 accumulator every
        ``block_size`` K). Row- and block-wise ignore ``scaling``, the amax-history
        fields and ``cast_kernel``; they keep no history. After construction this
        field holds the recipe object the ops use (`PerTensor`, `RowWise`, `BlockWise`);
        a recipe object passed in counts by its kind only (its parameters come from
        the fields here, so that ``dataclasses.replace`` stays consistent).
      block_size: tile size of ``"blockwise"`` (a multiple of 16; 128 as DeepSeek-V3 and
        the Hopper kernel).
      power_of_two_scales: ``"blockwise"`` scales rounded up to powers of two (exact to
        apply; TE's option).
      blockwise_backend: the block-scaled GEMM's backend, ``"auto"`` (the Hopper kernel
        where it can run the call, else the plain-JAX reference), ``"kernel"`` or
        ``"reference"`` (`fp8jax.kernels.blockwise_gemm`).
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

    scaling: Literal["delayed", "current"] = "delayed"
    fp8_format: Literal["hybrid", "e4m3"] | None = None
    amax_history_length: int = 1024
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    margin: float = 0.0
    fast_accumulation: Literal["forward", "all", "none"] = "forward"
    cast_kernel: bool = True
    targets: Targets = None
    selective: bool = True
    alignment: int = 16
    # Defaults from the H100 crossover sweep (benchmarks/RESULTS.md): FP8 loses at
    # K = N <= 2048 for M <= 8192, and at K = N = 4096 it wins from M = 4096 on.
    min_features: int = 2048
    min_weight_elements: int = 4096 * 4096
    min_tokens: int = 4096
    on_unsupported: Literal["warn", "silent", "raise"] = "warn"
    # Last, so that positional construction keeps its meaning.
    recipe: Any = "tensor"  # a name in `RECIPES`; the recipe object after __post_init__
    block_size: int = 128
    power_of_two_scales: bool = False
    blockwise_backend: Literal["auto", "kernel", "reference"] = "auto"

    def __post_init__(self):
        def bad(field, value, allowed):
            raise ValueError(f"Fp8Config.{field}={value!r} is not allowed; expected {allowed}.")

        if self.scaling not in ("delayed", "current"):
            bad("scaling", self.scaling, "'delayed' or 'current'")
        if self.fp8_format not in ("hybrid", "e4m3", None):
            bad("fp8_format", self.fp8_format, "'hybrid', 'e4m3' or None")
        if self.blockwise_backend not in ("auto", "kernel", "reference"):
            bad("blockwise_backend", self.blockwise_backend, "'auto', 'kernel' or 'reference'")
        if self.amax_compute_algo not in ("max", "most_recent"):
            bad("amax_compute_algo", self.amax_compute_algo, "'max' or 'most_recent'")
        if self.fast_accumulation not in ("forward", "all", "none"):
            bad("fast_accumulation", self.fast_accumulation, "'forward', 'all' or 'none'")
        for name in ("cast_kernel", "selective", "power_of_two_scales"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                bad(name, value, "True or False")
        if self.on_unsupported not in ("warn", "silent", "raise"):
            bad("on_unsupported", self.on_unsupported, "'warn', 'silent' or 'raise'")
        int_fields = (
            ("amax_history_length", 1),
            ("alignment", 1),
            ("min_features", 0),
            ("min_weight_elements", 0),
            ("min_tokens", 0),
            ("block_size", 16),
        )
        for name, low in int_fields:
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)):
                bad(name, value, f"an int >= {low}")
            if value < low:
                bad(name, value, f"an int >= {low}")
        if self.amax_history_length > MAX_HISTORY:  # one float per step per tensor and layer
            bad("amax_history_length", self.amax_history_length, f"an int in [1, {MAX_HISTORY}]")
        margin = self.margin
        if not isinstance(margin, numbers.Real) or isinstance(margin, (bool, np.bool_)):
            bad("margin", margin, "a number in [0, 8]")
        if not 0 <= margin <= 8:  # also rejects nan
            bad("margin", margin, "a number in [0, 8]")
        if self.block_size % 16:
            bad("block_size", self.block_size, "a multiple of 16 (the FP8 GEMMs' alignment)")
        self._check_targets(bad)
        kind = getattr(self.recipe, "kind", self.recipe)
        if kind not in RECIPES:
            bad("recipe", self.recipe, " or ".join(repr(r) for r in RECIPES))
        if kind != "blockwise":  # set by hand, they would do nothing: say so
            unused = [
                f"{name}={getattr(self, name)!r}"
                for name, default in BLOCKWISE_ONLY
                if getattr(self, name) != default
            ]
            if unused:
                warnings.warn(
                    f"Fp8Config: {', '.join(unused)} apply to recipe='blockwise' only; "
                    f"recipe={kind!r} ignores them.",
                    stacklevel=4,  # the caller of Fp8Config(...), through _Normalising
                )

    @classmethod
    def _normalised(cls, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` (keyword arguments) with numpy bools, ints and floats as Python ones
        (a numpy ``margin`` a float), a list of targets (names) as a tuple and the recipe's
        name (or object) as the recipe object built from the fields; invalid values are
        left for ``__post_init__`` to name."""
        out = dict(values)
        for name, value in values.items():
            if isinstance(value, np.bool_):
                out[name] = bool(value)
            elif isinstance(value, np.floating) or (
                name == "margin" and isinstance(value, np.integer)
            ):
                out[name] = float(value)
            elif isinstance(value, np.integer):
                out[name] = int(value)
        targets = out.get("targets")
        if isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
            out["targets"] = tuple(targets)
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        fields = types.SimpleNamespace(**{**defaults, **out})
        kind = getattr(fields.recipe, "kind", fields.recipe)
        if isinstance(kind, str) and kind in RECIPES:
            out["recipe"] = cls._build_recipe(fields, kind)
        return out

    def _build_recipe(self, kind: str):
        """The recipe object of ``kind``, from this config's fields."""
        if kind == "rowwise":
            return RowWise(margin=self.margin)
        if kind == "blockwise":
            return BlockWise(
                margin=self.margin,
                block_size=self.block_size,
                power_of_two=self.power_of_two_scales,
                backend=self.blockwise_backend,
            )
        return PerTensor(
            delayed=self.scaling == "delayed",
            algo=self.amax_compute_algo,
            margin=self.margin,
            cast_kernel=self.cast_kernel,
        )

    def _check_targets(self, bad):
        targets = self.targets
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
        else:
            bad(
                "targets",
                targets,
                "None, a regex string, a list of names/regexes or a predicate (path, module)",
            )
        for pattern in _patterns(self.targets):
            try:
                re.compile(pattern)
            except re.error as e:
                bad("targets", pattern, f"a valid regex ({e})")

    # --- derived, used by the kernels -------------------------------------------------
    @property
    def recipe_name(self) -> str:
        """``"tensor"``, ``"rowwise"`` or ``"blockwise"``."""
        return self.recipe.kind

    @property
    def history_length(self) -> int:
        """Amax-history length actually stored (1 for current scaling: the last amax)."""
        return self.recipe.history_length(self.amax_history_length)

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
        fmt = self.fp8_format or ("hybrid" if self.recipe.kind == "tensor" else "e4m3")
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
