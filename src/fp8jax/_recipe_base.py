"""The recipe protocol: what an FP8 op asks of a recipe (`Recipe`), what a cast gives
back (`Cast`), and the error a recipe raises for what it does not do
(`UnsupportedByRecipe`). The recipes themselves are in `fp8jax._recipe`."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

import jax.numpy as jnp
from jaxtyping import Array

from . import _state

F32 = jnp.float32
# `fp8jax._ops.rows.on_rows` bound to a token split: ``(fn, args, in_dims, out_dims)``
OnRows = Callable[[Callable, tuple, tuple, Any], Any]


class Cast(NamedTuple):
    """A tensor in FP8, in both layouts, with the scale it was cast with and its amax."""

    data: Array  # [B, P, C]
    data_t: Array  # [B, C, P]
    # dequantization factor(s) of ``data``: real ~ data * scale (per-tensor recipe:
    # data * gemm_scale(scale), the state keeping flax's exact scale)
    scale: Array
    # max |t| this step (non-finite if t held NaN/Inf); per tensor from the cast kernel,
    # its per-tile maxima instead, reduced where the state records them (`q.combined_max`)
    amax: Array
    scale_t: Array  # those of ``data_t`` (the same array for per-tensor scaling)


class UnsupportedByRecipe(ValueError):
    """An op asked a recipe for something it does not do (the message says what and why)."""


@dataclasses.dataclass(frozen=True)
class Recipe(abc.ABC):
    """What an FP8 op asks of a recipe. Subclasses are frozen dataclasses (hashable: a
    recipe is part of a jitted op's static `Fp8Config`)."""

    kind: ClassVar[str]  # its name: ``Fp8Config(recipe=kind)``, reports and records
    # The `Fp8Config` settings it reads, each with the field that holds it here.
    SETTINGS: ClassVar[Mapping[str, str]] = {}
    # `Fp8Config.fp8_format` when None: "hybrid" (e5m2 gradients) or "e4m3"
    default_format: ClassVar[str] = "e4m3"
    # How it scales ("one scale per tensor"), for the errors that say why it cannot do
    # something.
    granularity: ClassVar[str] = ""

    @property
    def name(self) -> str:
        return self.kind

    # --- settings: the one place they live ------------------------------------------
    def configure(self, settings: Mapping[str, Any]) -> Recipe:
        """This recipe with the `Fp8Config` ``settings`` it reads applied (others ignored);
        itself where none changes a value."""
        changes = {field: settings[k] for k, field in self.SETTINGS.items() if k in settings}
        return self._changed(**changes)

    def _changed(self, **changes) -> Recipe:
        """`dataclasses.replace` of the fields whose value (or its type) differs."""
        changes = {
            name: value
            for name, value in changes.items()
            if (old := getattr(self, name)) != value or type(old) is not type(value)
        }
        return dataclasses.replace(self, **changes) if changes else self

    def settings(self) -> dict[str, Any]:
        """The `Fp8Config` settings it holds, by their config names (``Fp8Config.margin``
        reads them)."""
        return {k: getattr(self, field) for k, field in self.SETTINGS.items()}

    def _unsupported(self, what: str) -> UnsupportedByRecipe:
        return UnsupportedByRecipe(
            f"the {self.kind!r} recipe has no {what}: it uses {self.granularity}."
        )

    # --- a layer's state -------------------------------------------------------------
    @property
    def history_length(self) -> int:
        """Amax entries per tensor the state keeps (current scaling: the last one)."""
        return 1

    def init_state(
        self, stack_shape: tuple[int, ...] = (), experts: int | None = None
    ) -> dict[str, Array]:
        """Fresh values of a layer's state (`fp8jax._state.STATE_FIELDS`), ``experts``: one
        weight scale per expert (`fp8jax.nn.Fp8GroupedState`)."""
        return _state.init_fields(self.history_length, stack_shape, experts)

    def summary(self, scale: Array) -> Array:
        """The scale a layer's ``(1,)`` state field records for the ``scale`` it used."""
        return scale

    def screen(self, amaxes: Array, newest: Array, dtypes) -> tuple[Array, Array]:
        """Which observed ``amaxes`` go into the histories, and 1.0 if one was rejected:
        all of them, unless the recipe's scales come from its history (`PerTensor`)."""
        del newest, dtypes
        return amaxes, jnp.zeros((), F32)

    # --- casts and the GEMM ----------------------------------------------------------
    @abc.abstractmethod
    def scale_shape(self, shape: tuple[int, ...], weight: bool = False) -> tuple[int, ...]:
        """The shape of the scales `quantize_both` gives a tensor of ``shape``."""

    @abc.abstractmethod
    def quantize_both(
        self,
        t: Array,
        old_scale: Array,
        history: Array,
        dtype,
        weight: bool = False,
        scale: Array | None = None,
    ) -> Cast:
        """``t: [B, P, C]`` in FP8 in both layouts; ``weight``: a GEMM's weight (the
        block-wise recipe's blocks); ``scale``: one chosen before the cast (`gemm_scales`)."""

    @abc.abstractmethod
    def quantize(self, t: Array, scale: Array, dtype) -> Array:
        """``t`` cast with the given scale(s)."""

    @abc.abstractmethod
    def dequantize(self, data: Array, scale: Array, dtype) -> Array:
        """FP8 ``data`` times its scale(s), in ``dtype``."""

    @abc.abstractmethod
    def gemm(
        self, a: Array, a_scale: Array, b: Array, b_scale: Array, out_dtype, fast_accumulation: bool
    ) -> Array:
        """``a [B,P,C] . b [B,Q,C]`` in FP8, dequantized by the two operands' scales."""

    # --- a scale known before the cast (delayed per-tensor scaling) ----------------------
    @property
    def scale_known_before_cast(self) -> bool:
        """Whether the scale is fixed before the tensor is read: fused kernels need it
        (`fp8jax._ops.gated`), and the linear op then chooses all its scales in the forward
        (`gemm_scales`)."""
        return False

    def gemm_scales(self, histories, old_scales, dtypes) -> Array:
        """The ``[3]`` scales of a GEMM's operands, chosen before the casts."""
        raise self._unsupported("scales known before the cast")

    # --- one scale per tensor ------------------------------------------------------------
    @property
    def per_tensor_scale(self) -> bool:
        """Whether one scale covers a tensor (`scale`, `history_scale`): the grouped GEMM's
        per-tensor path and FP8 attention need it."""
        return False

    def scale(
        self, history: Array, old_scale: Array, dtype, amax: Array | None = None, axis: int = -1
    ) -> Array:
        """The one scale of a tensor this step."""
        raise self._unsupported("per-tensor scale")

    def history_scale(self, history: Array, old_scale: Array, dtype, axis: int = -1) -> Array:
        """A tensor's scale from its amax history (what a kernel that needs its scales
        before it runs takes, whatever the recipe does otherwise)."""
        raise self._unsupported("per-tensor scale")

    def check_attention(self) -> None:
        """Raise `UnsupportedByRecipe` unless FP8 attention can run this recipe (the cuDNN
        kernels take one scale per tensor)."""
        if not self.per_tensor_scale:
            raise UnsupportedByRecipe(
                "FP8 attention (modes 'fp8_dpa', 'fp8_mha') takes one scale per tensor: "
                f"Fp8Config(recipe='tensor') only, got recipe={self.kind!r}, which uses "
                f"{self.granularity}: use mode='bf16' and convert the projections with "
                "fp8jax.fp8_linear_layers (linears honour every recipe)."
            )

    # --- grouped experts and meshes -------------------------------------------------------
    def check_grouped(self) -> None:
        """Raise `UnsupportedByRecipe` unless the grouped expert GEMMs can run this recipe:
        per tensor (`per_tensor_scale`: one weight scale per expert, `fp8jax._ops.grouped`)
        or per tile of each expert's operands (`fp8jax._ops.grouped_tiled`)."""
        if not self.per_tensor_scale:
            raise UnsupportedByRecipe(
                f"FP8 grouped GEMMs (fp8jax.nn.GroupedLinear) have no path for the "
                f"{self.kind!r} recipe, which uses {self.granularity}: they take one scale "
                "per tensor or per tile of each expert."
            )

    def grouped_kernel_reason(self) -> str | None:
        """Why the block-scaled grouped kernels (`fp8jax._kernels.blockwise_grouped_mgpu`)
        cannot run this recipe's expert GEMMs, None when they can (shapes aside)."""
        return f"the {self.kind!r} recipe has no grouped kernel"

    @property
    def weight_block(self) -> int | None:
        """The side of the square blocks a weight is scaled in: a shard should hold whole
        ones (`fp8jax.shard_model`). None: no such blocks."""
        return None

    @property
    def per_device_rows(self) -> bool:
        """Whether on a mesh the casts and GEMMs run per device on its token rows
        (`quantize_rows`, `gemm_rows`; `fp8jax._ops.rows`). Otherwise XLA partitions them."""
        return False

    @property
    def per_device_casts(self) -> bool:
        """Whether on a mesh the activations' and output gradients' casts run per device on
        its token rows (`quantize_rows`), the GEMMs too where `per_device_rows`."""
        return self.per_device_rows

    @property
    def row_tile(self) -> int:
        """Token rows each device's share must be a multiple of, for `quantize_rows`."""
        return 128

    def quantize_rows(self, on_rows: OnRows, t: Array, dtype, scale: Array | None = None) -> Cast:
        """`quantize_both` of an activation or output gradient ``[B, M, K]``, per device on
        its tokens (``on_rows``); ``scale``: one chosen before the cast (`gemm_scales`)."""
        raise self._unsupported("per-device cast over a token split")

    def gemm_rows(
        self, on_rows: OnRows, a, a_scale, b, b_scale, out_dtype, fast: bool, wgrad: bool
    ) -> Array:
        """`gemm` per device on its tokens: the rows of ``a`` (forward, dgrad), or for the
        ``wgrad`` the contracted tokens of both, summed over the devices."""
        raise self._unsupported("per-device GEMM over a token split")
