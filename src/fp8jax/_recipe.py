"""FP8 recipes: how a tensor's scale is chosen, how the tensor is cast, and how the GEMM
of two cast tensors is dequantized. Ops ask their config's recipe (`Fp8Config.recipe`)
instead of branching on config fields or on the recipe's name.

* `PerTensor`: one scale per tensor, delayed or current (``Fp8Config(recipe="tensor")``).
* `RowWise`: one scale per row of each GEMM operand along its contracting dim (torchao's
  row-wise recipe), current scaling; the GEMM is XLA's FP8 GEMM, the two scale vectors
  applied to its float32 output (``recipe="rowwise"``).
* `BlockWise`: DeepSeek-V3's recipe: activations and output gradients per ``1 x 128``
  tile along the contracting dim, weights per ``128 x 128`` block, float32 scales
  (optionally powers of two), current scaling; the GEMM applies the scales to the float32
  accumulator at every 128-K step (`fp8jax._kernels.blockwise_gemm`) (``recipe="blockwise"``).

Every recipe is a frozen dataclass deriving from `fp8jax._recipe_base.Recipe`, which
declares what the ops ask of one: the casts and the GEMM, the state a layer keeps, the
per-tensor scale where there is one, the variants that run per device on a token split
(`fp8jax._ops.rows`), and what FP8 attention and the grouped GEMMs support. What a recipe
does not do raises `UnsupportedByRecipe`, saying why. A new recipe is one subclass (and its
tests): ``Fp8Config(recipe=MyRecipe(...))`` takes it as is; listed in `BUILTIN` it has a
name too.

The three GEMMs of a train step contract along different dims (forward along K, dgrad along
N, wgrad along M), so every operand is needed in two layouts, each scaled along its own
contracting dim. As Transformer Engine's ``Float8BlockScaling`` does, both layouts of an
activation or gradient are cast from the high-precision tensor in one pass (the transposed
copy gets its own ``1 x 128`` tiles along M, DeepSeek's ``128 x 1`` tiles), rather than
re-quantizing the FP8 copy (DeepSeek-V3 converts its cached FP8 activations 1x128 ->
128x1, which rounds twice). A weight's ``128 x 128`` blocks are the same blocks in both
layouts: its transposed copy is the FP8 copy transposed, with its scales transposed (both
TE and DeepSeek).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

from . import _quant as q
from ._kernels import blockwise_gemm as _bgemm
from ._kernels import gemm as _gemm
from ._kernels import tile_cast as _tile_kernel
from ._recipe_base import Cast, OnRows, Recipe, UnsupportedByRecipe
from ._state import from_history, history_stats

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class PerTensor(Recipe):
    """One scale per tensor (flax's and Transformer Engine's default recipe).

    ``delayed``: the scale comes from the amax history of earlier steps, so the cast
    needs one pass and the amax is its by-product. Otherwise ("current") the scale
    comes from this step's amax, one extra reduction before the cast.
    """

    delayed: bool = True
    algo: str = "max"  # over the history: "max" or "most_recent"
    margin: float = 0.0
    cast_kernel: bool = True  # the one-pass Pallas cast where it runs (`Fp8Config.cast_kernel`)
    amax_history_length: int = 1024  # the history delayed scaling keeps
    kind = "tensor"
    SETTINGS = {
        "amax_history_length": "amax_history_length",
        "amax_compute_algo": "algo",
        "margin": "margin",
        "cast_kernel": "cast_kernel",
    }
    default_format = "hybrid"
    granularity = "one scale per tensor"
    per_tensor_scale = True

    @property
    def name(self) -> str:
        return "per-tensor-" + ("delayed" if self.delayed else "current")

    def configure(self, settings) -> PerTensor:
        """`Recipe.configure`; ``scaling`` ("delayed" or "current") sets ``delayed``."""
        recipe = super().configure(settings)
        if "scaling" in settings:
            recipe = recipe._changed(delayed=settings["scaling"] == "delayed")
        return recipe

    def settings(self) -> dict:
        return dict(super().settings(), scaling="delayed" if self.delayed else "current")

    @property
    def scale_known_before_cast(self) -> bool:
        return self.delayed

    @property
    def history_length(self) -> int:
        """Amax entries the state keeps (current scaling keeps the last one only)."""
        return self.amax_history_length if self.delayed else 1

    def scale_shape(self, shape: tuple[int, ...], weight: bool = False) -> tuple[int, ...]:
        del shape, weight
        return (1,)

    def scale(
        self, history: Array, old_scale: Array, dtype, amax: Array | None = None, axis: int = -1
    ) -> Array:
        """The scale to cast with this step: from ``history`` along ``axis`` (delayed) or
        from ``amax``, the tensor's own (current); ``old_scale`` where neither is usable."""
        if self.delayed:
            return self.history_scale(history, old_scale, dtype, axis)
        return q.scale_from_amax(amax, old_scale, dtype, self.margin)

    def history_scale(self, history: Array, old_scale: Array, dtype, axis: int = -1) -> Array:
        """The delayed scale: from the amax of ``history`` along ``axis`` (``algo``)."""
        amax = jnp.squeeze(from_history(history, self.algo, axis=axis), axis)
        return q.scale_from_amax(amax, old_scale, dtype, self.margin)

    def gemm_scales(self, histories, old_scales, dtypes) -> Array:
        """Delayed scaling: the ``[3]`` scales of a GEMM's operands (input, kernel, output
        gradient), from their ``[L]`` histories in one reduction over the stacked ``[3, L]``.

        Same values as three `scale` calls. One reduction instead of three lets XLA compile
        a few small kernels per layer where it compiled about ten (issue 21: compile time
        grows with the number of kernels)."""
        if not self.delayed:
            raise UnsupportedByRecipe(
                f"the {self.kind!r} recipe with current scaling has no scale before the "
                "cast: it scales by the tensor's own amax."
            )
        stacked = jnp.stack(histories)
        if self.algo == "max":  # the reduction the backward's repair check shares
            stats = history_stats(stacked)  # [..., 2]: the max, the corrupt flag
            amax = lax.index_in_dim(stats, 0, axis=stats.ndim - 1, keepdims=False)
        else:
            amax = from_history(stacked, self.algo, axis=-1)[..., 0]  # [3]
        limits = np.array([q.fp8_max(d) for d in dtypes], np.float32)
        return q.scale_from_limit(amax, jnp.concatenate(old_scales), limits, self.margin)

    def screen(self, amaxes: Array, newest: Array, dtypes) -> tuple[Array, Array]:
        """Delayed scaling's outlier rule: which observed ``amaxes`` go into the histories.
        Returns ``(amaxes to record, 1.0 if one was rejected else 0.0)``.

        ``amaxes`` and ``newest`` (each history's newest entry, corrupt ones as 0) hold one
        entry per tensor, of FP8 ``dtypes``. An amax above ``q.outlier_factor(dtype)``
        (e4m3: 64, e5m2: 2**21) times the newest recorded one is an outlier: recorded as 0,
        a missing amax, so the scales of the next steps are those of a run without it. This
        step's cast saturated it (to ``fp8_max * scale``), as delayed scaling does with any
        amax above its history. Only when the newest entry is positive: an amax that
        follows a rejected one (or a fresh history, a non-finite or all-zero step) is
        recorded whatever its size. So one outlier batch is skipped, and a real shift of the
        distribution, which persists, is recorded one step late: it saturates for two steps
        instead of one (a 100x jump of the activations is tracked from the third step on);
        growth under the factor per step (doubling every step) is recorded as it comes.
        The factor is where recording starts to cost precision (`q.outlier_factor`): a 1e30
        element recorded made every output of the next 1023 steps 99.9% wrong; skipped,
        the next step's output matches a run without it. The reference is the newest entry,
        not the history's max (the scale's amax, about the same in a steady state): the
        backward's history update then needs no reduction and no scale from the forward
        (the same GPU kernels as without the rule). Current scaling records every amax (its
        scale is this step's own)."""
        if not self.delayed:
            return amaxes, jnp.zeros((), F32)
        # lax ops, the flags split into [1] pieces: few ops to trace per layer (issue 21).
        factors = np.array([q.outlier_factor(d) for d in dtypes], np.float32)
        amaxes, newest = jnp.asarray(amaxes, F32), jnp.asarray(newest, F32)
        limit = lax.mul(newest, factors)
        outlier = lax.bitwise_and(lax.gt(amaxes, limit), lax.gt(newest, F32(0)))
        flags = lax.split(lax.convert_element_type(outlier, F32), (1,) * amaxes.shape[0])
        rejected = functools.reduce(lax.max, flags).reshape(())
        return lax.select(outlier, lax.full_like(amaxes, 0), amaxes), rejected

    def quantize_both(
        self,
        t: Array,
        old_scale: Array,
        history: Array,
        dtype,
        weight: bool = False,
        scale: Array | None = None,
    ) -> Cast:
        """``t: [B, P, C]`` cast to FP8 in both layouts (`fp8jax._kernels.gemm.quantize_both`);
        with ``scale`` (delayed scaling, from `gemm_scales`) that scale is used as is."""
        del weight
        # Delayed: the amax is the cast's by-product; current: a reduction before the cast.
        amax = None if self.delayed else q.amax(t)
        if scale is None:
            scale = self.scale(history, old_scale, dtype, amax)
        data, data_t, cast_amax = _gemm.quantize_both(
            t, _gemm.gemm_scale(scale), dtype, self.cast_kernel
        )
        return Cast(data, data_t, scale, cast_amax if self.delayed else amax, scale)

    @property
    def per_device_casts(self) -> bool:
        """Delayed scaling with the cast kernel (and `fp8jax._kernels.gemm.Tuning.
        per_device_cast`): on a mesh each device casts its own tokens with the scale known
        before the cast, where the Pallas kernel can run (XLA cannot partition it). The cast
        is elementwise, so its bits are the whole tensor's; XLA partitions the GEMMs."""
        return self.delayed and self.cast_kernel and _gemm.current_tuning().per_device_cast

    @property
    def row_tile(self) -> int:
        """Any token split: the cast is elementwise (the kernel runs where it fits a shard)."""
        return 1

    def quantize_rows(self, on_rows: OnRows, t: Array, dtype, scale: Array | None = None) -> Cast:
        """`quantize_both` with a ``scale`` chosen before the cast (delayed scaling), per
        device on its tokens: each device casts its rows (the Pallas kernel where the shard
        fits it), its amax one scalar pmax. Without ``scale`` (current scaling) it raises:
        the scale would need the amax of every device's tokens first."""
        if scale is None:
            raise UnsupportedByRecipe(
                f"the {self.kind!r} recipe casts per device only with a scale chosen before "
                "the cast (delayed scaling)."
            )

        def cast(t: Array, scale: Array) -> tuple[Array, Array, Array]:
            c = self.quantize_both(t, None, None, dtype, scale=scale)
            return c.data, c.data_t, jnp.max(c.amax)  # the kernel's tile maxima: one scalar

        data, data_t, amax = on_rows(cast, (t, scale), (1, None), (1, 2, "max"))
        return Cast(data, data_t, scale, amax, scale)

    def quantize(self, t: Array, scale: Array, dtype) -> Array:
        return q.quantize(t, scale, dtype)

    def dequantize(self, data: Array, scale: Array, dtype) -> Array:
        return (data.astype(F32) * scale.astype(F32)).astype(dtype)

    def gemm(
        self, a: Array, a_scale: Array, b: Array, b_scale: Array, out_dtype, fast_accumulation: bool
    ) -> Array:
        """``a [B,P,C] . b [B,Q,C]`` in FP8, dequantized by the two scales (by cuBLASLt where
        `fp8jax._kernels.gemm.takes_scales`: the operands were cast with `gemm_scale` of them)."""
        a_scale, b_scale = _gemm.gemm_scale(a_scale), _gemm.gemm_scale(b_scale)
        return _gemm.scaled_fp8_gemm(
            a, a_scale, b, b_scale, out_dtype, fast_accumulation, self.cast_kernel
        )


# ----------------------------------------------------------------------------- tiled recipes
def tile_cast(t: Array, dtype, rows: int, cols: int, margin: float = 0.0, power_of_two=False):
    """``t: [B, P, C]`` cast to FP8 with one scale per ``rows x cols`` tile (a last partial
    tile is scaled by its own elements). Returns ``(data [B, P, C], scale [B, ceil(P/rows),
    ceil(C/cols)], amax)``; ``amax`` is non-finite if ``t`` held a NaN/Inf."""
    b, p, c = t.shape
    nr, nc = -(-p // rows), -(-c // cols)
    tf = t.astype(F32)
    if nr * rows != p or nc * cols != c:
        tf = jnp.pad(tf, ((0, 0), (0, nr * rows - p), (0, nc * cols - c)))
    tf = tf.reshape(b, nr, rows, nc, cols)
    tile_amax = q.tile_amax(tf, axis=(2, 4))
    scale = q.tile_scales(tile_amax, dtype, margin, power_of_two)
    data = _cast_divided(tf, scale[:, :, None, :, None], dtype)
    data = data.reshape(b, nr * rows, nc * cols)[:, :p, :c]
    return data, scale, jnp.max(tile_amax)


def _cast_divided(t: Array, scale: Array, dtype) -> Array:
    """``t / scale`` saturated to ``dtype`` (the tiled recipes divide by each tile's scale)."""
    limit = q.fp8_max(dtype)
    return jnp.clip(t.astype(F32) / scale, -limit, limit).astype(dtype)


def expand_scale(scale: Array, shape: tuple[int, ...], rows: int, cols: int) -> Array:
    """Per-tile ``scale [..., ceil(P/rows), ceil(C/cols)]`` -> one per element ``[..., P, C]``."""
    p, c = shape[-2:]
    full = jnp.repeat(jnp.repeat(scale, rows, axis=-2), cols, axis=-1)
    return full[..., :p, :c]


@dataclasses.dataclass(frozen=True)
class _Tiled(Recipe):
    """What row-wise and block-wise share: current scaling per tile, no amax history
    (the state keeps the step's largest scale and amax, for inspection, and counts
    non-finite steps), scales unknown before the cast (so `fp8jax._ops.gated`'s fused core,
    which needs them, leaves such layers to the unfused path). A tile's scale depends on
    its own elements only, so on a mesh each device casts its own tokens' tiles
    (`quantize_rows`)."""

    margin: float = 0.0
    SETTINGS = {"margin": "margin"}
    per_device_rows = True
    # The token dim of the wgrad operands' scales (None: one scale spans all tokens).
    _wgrad_scale_tokens: ClassVar[int | None] = None

    def summary(self, scale: Array) -> Array:
        """The scale a layer's ``(1,)`` state field records: the largest tile scale."""
        return jnp.max(scale).reshape(1)

    def check_grouped(self) -> None:
        """Grouped experts cast per tile like the linear (`fp8jax._ops.grouped_tiled`)."""

    @abc.abstractmethod
    def _tile(self, shape, scale) -> tuple[int, int]:
        """The ``(rows, cols)`` tile of ``scale``, the scales of a tensor of ``shape``."""

    def quantize_rows(self, on_rows: OnRows, t: Array, dtype, scale: None = None) -> Cast:
        """Per device on its tokens: data ``[B, M, K]`` with its tile scales along K, the
        transposed copy ``[B, K, M]`` with its own, all local; the amax by pmax."""
        del scale  # tiles are scaled by their own amax
        cast = lambda t: self.quantize_both(t, None, None, dtype)  # noqa: E731
        dims = Cast(data=1, data_t=2, scale=1, amax="max", scale_t=2)
        return on_rows(cast, (t,), (1,), dims)

    def gemm_rows(
        self, on_rows: OnRows, a, a_scale, b, b_scale, out_dtype, fast: bool, wgrad: bool
    ) -> Array:
        fn = lambda a, sa, b, sb: self.gemm(a, sa, b, sb, out_dtype, fast)  # noqa: E731
        ts = self._wgrad_scale_tokens
        dims = ((2, ts, 2, ts), "sum") if wgrad else ((1, 1, None, None), 1)
        return on_rows(fn, (a, a_scale, b, b_scale), *dims)

    def quantize(self, t: Array, scale: Array, dtype) -> Array:
        """``t`` cast with given tile scales (the tile shape read from ``scale``'s shape)."""
        rows, cols = self._tile(t.shape, scale)
        return _cast_divided(t, expand_scale(scale.astype(F32), t.shape, rows, cols), dtype)

    def dequantize(self, data: Array, scale: Array, dtype) -> Array:
        rows, cols = self._tile(data.shape, scale)
        full = expand_scale(scale.astype(F32), data.shape, rows, cols)
        return (data.astype(F32) * full).astype(dtype)


@dataclasses.dataclass(frozen=True)
class RowWise(_Tiled):
    """One scale per row of each GEMM operand along its contracting dim (torchao's
    row-wise recipe): ``x [M, K]`` per row of K, ``w [N, K]`` per row; the dgrad's and
    wgrad's operands are cast again along their own contracting dim from the
    high-precision tensor. The GEMM is one FP8 GEMM with float32 output, times
    ``a_scale[i] * b_scale[j]`` (a real FP8 GEMM in XLA: cuBLASLt on Hopper)."""

    kind = "rowwise"
    granularity = "one scale per row of each GEMM operand, from the row's own amax"

    def scale_shape(self, shape: tuple[int, ...], weight: bool = False) -> tuple[int, ...]:
        del weight
        return tuple(shape[:-1]) + (1,)

    def _tile(self, shape, scale):
        return 1, shape[-1]

    def quantize_both(
        self,
        t: Array,
        old_scale: Array,
        history: Array,
        dtype,
        weight: bool = False,
        scale: None = None,  # tiles are scaled by their own amax: no scale to pass
    ) -> Cast:
        """``t: [B, P, C]`` per row along C, and ``t^T: [B, C, P]`` per row along P."""
        del old_scale, history, weight, scale
        row_amax, col_amax = self.amaxes(t)
        scale, scale_t = self.scales(row_amax, col_amax, dtype)
        data, data_t = self.cast_with(t, scale, scale_t, dtype)
        return Cast(data, data_t, scale, jnp.max(row_amax), scale_t)

    def quantize_rows(self, on_rows: OnRows, t: Array, dtype, scale: None = None) -> Cast:
        """Per device on its tokens; the transposed copy's scale per column of ``t`` spans
        every device's tokens, so the column amaxes are one ``[B, K]`` pmax before the
        cast."""
        del scale  # rows are scaled by their own amax
        row_amax, col_amax = on_rows(self.amaxes, (t,), (1,), (1, "max"))
        scale, scale_t = self.scales(row_amax, col_amax, dtype)
        amax = jnp.max(col_amax)  # the whole tensor's: no further collective
        cast = lambda t, s, st: self.cast_with(t, s, st, dtype)  # noqa: E731
        data, data_t = on_rows(cast, (t, scale, scale_t), (1, 1, None), (1, 2))
        return Cast(data, data_t, scale, amax, scale_t)

    @staticmethod
    def amaxes(t: Array) -> tuple[Array, Array]:
        """Per-row ``[B, P]`` and per-column ``[B, C]`` amaxes of ``t [B, P, C]``. Over a
        token split (`fp8jax._ops.rows`) the rows' are local and the columns' a ``pmax``."""
        return q.tile_amax(t, axis=2), q.tile_amax(t, axis=1)

    def scales(self, row_amax: Array, col_amax: Array, dtype) -> tuple[Array, Array]:
        """The scales of ``t`` per row ``[B, P, 1]`` and of ``t^T`` per row ``[B, C, 1]``."""
        return tuple(q.tile_scales(a, dtype, self.margin)[:, :, None] for a in (row_amax, col_amax))

    @staticmethod
    def cast_with(t: Array, scale: Array, scale_t: Array, dtype) -> tuple[Array, Array]:
        """``(t [B, P, C], t^T)`` cast with the given row scales: one read of ``t`` in the
        Pallas kernel (`fp8jax._kernels.tile_cast`) on Hopper, two XLA casts elsewhere."""
        if _tile_kernel.reason(t.shape, 128) is None:
            return _tile_kernel.cast_rows_with(t, scale, scale_t, dtype)
        return _cast_divided(t, scale, dtype), _cast_divided(jnp.swapaxes(t, 1, 2), scale_t, dtype)

    def gemm(
        self, a: Array, a_scale: Array, b: Array, b_scale: Array, out_dtype, fast_accumulation: bool
    ) -> Array:
        """``a [B,P,C] . b [B,Q,C]`` in FP8 (float32 out), times ``a_scale [B,P,1]`` and
        ``b_scale [B,Q,1]`` per row and column."""
        y = _gemm.gemm(a, b, F32, _gemm.gemm_precision(fast_accumulation))
        return (y * a_scale.astype(F32) * jnp.swapaxes(b_scale, 1, 2).astype(F32)).astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class BlockWise(_Tiled):
    """DeepSeek-V3's fine-grained recipe (TE's ``Float8BlockScaling``): activations and
    output gradients per ``1 x block_size`` tile along the contracting dim, weights per
    ``block_size x block_size`` block; float32 scales, rounded up to powers of two with
    ``power_of_two``. The GEMM promotes every ``block_size``-long K chunk's partial sum
    into a float32 accumulator, times its two scales (`fp8jax._kernels.blockwise_gemm`:
    the Hopper kernel, or the plain-JAX reference, by ``backend``)."""

    block_size: int = 128
    power_of_two: bool = False
    backend: str = "auto"
    kind = "blockwise"
    SETTINGS = {
        "margin": "margin",
        "block_size": "block_size",
        "power_of_two_scales": "power_of_two",
        "blockwise_backend": "backend",
    }
    granularity = "one scale per 1 x block_size tile (weights: block), from its own amax"
    _wgrad_scale_tokens = 2  # the 1 x bs tiles of x^T and g^T run along the tokens

    @property
    def name(self) -> str:
        return f"blockwise-{self.block_size}"

    @property
    def weight_block(self) -> int:
        return self.block_size

    @property
    def row_tile(self) -> int:
        return self.block_size

    def grouped_kernel_reason(self) -> str | None:
        return None

    def scale_shape(self, shape: tuple[int, ...], weight: bool = False) -> tuple[int, ...]:
        """``[P, C/bs]`` for ``1 x bs`` tiles, ``[P/bs, C/bs]`` for weights (rounded up)."""
        *lead, p, c = shape
        bs = self.block_size
        return (*lead, -(-p // bs) if weight else p, -(-c // bs))

    def _tile(self, shape, scale):
        p = shape[-2]
        return (1 if scale.shape[-2] == p else self.block_size), self.block_size

    def quantize_both(
        self,
        t: Array,
        old_scale: Array,
        history: Array,
        dtype,
        weight: bool = False,
        scale: None = None,  # tiles are scaled by their own amax: no scale to pass
    ) -> Cast:
        """``t: [B, P, C]`` in both layouts: a weight's blocks once (the transposed copy is
        the same blocks transposed), an activation's tiles along C and, from ``t`` again,
        along P. One read of ``t`` in the Pallas kernel (`fp8jax._kernels.tile_cast`) where
        ``backend`` allows it and the shape tiles, two XLA passes elsewhere."""
        del old_scale, history, scale
        bs, pow2 = self.block_size, self.power_of_two
        if self._use_cast_kernel(t.shape):
            data, s, data_t, s_t, amax = _tile_kernel.cast_both(
                t, dtype, bs, self.margin, pow2, weight=weight
            )
            return Cast(data, data_t, s, amax, s_t)
        if weight:
            data, scale, amax = tile_cast(t, dtype, bs, bs, self.margin, pow2)
            return Cast(data, jnp.swapaxes(data, 1, 2), scale, amax, jnp.swapaxes(scale, 1, 2))
        data, scale, amax = tile_cast(t, dtype, 1, bs, self.margin, pow2)
        data_t, scale_t, _ = tile_cast(jnp.swapaxes(t, 1, 2), dtype, 1, bs, self.margin, pow2)
        return Cast(data, data_t, scale, amax, scale_t)

    def _use_cast_kernel(self, shape: tuple[int, ...]) -> bool:
        """Whether the cast runs the Pallas kernel: on a Hopper GPU, for shapes that tile
        into squares, unless ``backend="reference"`` (the GEMM's ``"kernel"`` does not
        force the cast: an unaligned cast falls back to XLA)."""
        if self.backend == "reference":
            return False
        return _tile_kernel.reason(shape, self.block_size) is None

    def gemm(
        self, a: Array, a_scale: Array, b: Array, b_scale: Array, out_dtype, fast_accumulation: bool
    ) -> Array:
        """``a [B,P,C] . b [B,Q,C]`` with per-tile scales (either operand ``1 x bs`` or
        ``bs x bs``); ``fast_accumulation`` is moot: every K chunk is promoted to float32."""
        del fast_accumulation
        nk = -(-a.shape[-1] // self.block_size)
        if a_scale.shape[-1] != nk or b_scale.shape[-1] != nk:
            # Only in the shape-only trace `jax.custom_vmap` makes of the per-example
            # backward (`fp8jax._ops.dot`): its x^T residual holds one example's rows but
            # the scales of the 1 x bs tiles along all examples' rows (the vmap rule runs
            # the real GEMM on the merged rows). The trace needs the output's shape only.
            return jnp.zeros((a.shape[0], a.shape[1], b.shape[1]), out_dtype)
        return _bgemm.blockwise_gemm(
            a, a_scale, b, b_scale, out_dtype, block_size=self.block_size, backend=self.backend
        )


# The recipes `Fp8Config(recipe=name)` takes by name, and their names.
BUILTIN: tuple[type[Recipe], ...] = (PerTensor, RowWise, BlockWise)
RECIPES = tuple(r.kind for r in BUILTIN)


def named(kind: str) -> Recipe | None:
    """The built-in recipe called ``kind``, with its defaults; None for another name."""
    for recipe in BUILTIN:
        if recipe.kind == kind:
            return recipe()
    return None
