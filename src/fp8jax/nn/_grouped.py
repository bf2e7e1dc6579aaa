"""Grouped experts for MoE: `GroupedLinear` and `GroupedMLP` (the `MoE` layer around them is
`fp8jax.nn._moe`).

All experts run as one grouped GEMM per projection (a Pallas Mosaic-GPU kernel on
Hopper, a plain-JAX reference elsewhere), in FP8 or in the input precision.
Rows travel in the *padded layout* of `GroupLayout`: each expert's rows start at a
multiple of 128 rows (the kernel's tile; also Megatron's ``moe_router_padding_for_fp8``
alignment), so the kernels need no masking and padding rows cost at most one tile
per expert. `fp8jax.nn.MoE` builds that layout directly while permuting tokens.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .. import _checks as checks
from .. import _guard, _state
from .._config import Fp8Config, resolve_config
from .._ops import grouped as gr
from .._ops.grouped import ROW_ALIGN, GroupLayout
from .._state import Fp8GemmState
from ._mlp import ACTIVATIONS, activate

F32 = jnp.float32


def _check_backend(owner: str, backend) -> str:
    """``backend`` if it is one of `_grouped.BACKENDS`, else a ValueError naming ``owner``."""
    gr.check_backend(backend, owner)
    return backend


class Fp8GroupedState(Fp8GemmState):
    """FP8 scaling state of one grouped projection (``num_experts`` GEMMs).

    Inputs and output gradients: one scale per tensor (``[*stack, 1]``, histories
    ``[*stack, history]``): all experts' rows form one operand, cast in one pass.
    Weights: one scale per expert (``kernel_scale [*stack, num_experts]``,
    ``kernel_amax_history [*stack, history, num_experts]``). Updated through the
    gradient like `fp8jax.Fp8DotGeneral`.

    Arguments:
        num_experts: the number of expert GEMMs (the kernel scales' last dim).
        config: the `Fp8Config` (None: the default one).
        stack_shape: leading dims of stacked layers, else ``()``.
    """

    input_scale: Float[Array, "*stack 1"]
    kernel_scale: Float[Array, "*stack experts"]
    output_grad_scale: Float[Array, "*stack 1"]
    input_amax_history: Float[Array, "*stack history"]
    kernel_amax_history: Float[Array, "*stack history experts"]
    output_grad_amax_history: Float[Array, "*stack history"]
    nonfinite_count: Float[Array, "*stack 1"]
    config: Fp8Config = eqx.field(static=True)
    # Last: the seven fields keep their leaf positions. Makes the usual equinox loop (which
    # trains the state) loud, as `fp8jax.Fp8DotGeneral`'s guard does (`fp8jax._guard`). None:
    # unchecked (a state built before it had one).
    guard: Float[Array, "*stack 1"] | None = None

    def __init__(
        self,
        num_experts: int,
        config: Fp8Config | None = None,
        *,
        stack_shape: tuple[int, ...] = (),
    ):
        config = resolve_config(config)
        config.recipe.check_grouped()
        fields = config.recipe.init_state(tuple(stack_shape), experts=num_experts)
        for name, value in fields.items():
            setattr(self, name, value)
        self.config = config
        self.guard = _guard.init(tuple(stack_shape))

    @property
    def num_experts(self) -> int:
        return int(self.kernel_scale.shape[-1])

    def ordered_amax_history(self, which: str = "input") -> Array:
        """``<which>_amax_history`` newest-first (kernel: ``[history, experts]``)."""
        history = getattr(self, f"{which}_amax_history")
        return _state.newest_first(history, axis=-2 if which == "kernel" else -1)


class GroupedLinear(eqx.Module):
    """``num_experts`` linear maps run as one grouped GEMM: row ``r`` of the input,
    which belongs to expert ``e``, gives ``x[r] @ weight[e]``.

    ``weight: [num_experts, in_features, out_features]`` (``x @ W`` per expert, no
    bias; Mixtral/Megatron experts have none). ``fp8``: FP8 GEMMs with state in
    ``fp8_state`` (`Fp8GroupedState`); otherwise the input precision through the
    same grouped kernel. ``backend``: ``"auto"`` (Pallas kernel on Hopper where the
    sizes allow, else the plain-JAX reference), ``"pallas"`` or ``"reference"``.
    """

    weight: Float[Array, "experts d_in d_out"]
    fp8_state: Fp8GroupedState | None
    backend: str = eqx.field(static=True)
    # Expert parallel (`fp8jax.shard_model`'s ``expert_axis``): the FP8 GEMMs run per
    # device on its experts. None: no constraint.
    expert_sharding: gr.ExpertSharding | None = eqx.field(static=True, default=None)

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        *,
        key: PRNGKeyArray | None = None,
        fp8: bool = True,
        config: Fp8Config | None = None,
        dtype=F32,
        backend: str = "auto",
        weight: Array | None = None,
        fp8_state: Fp8GroupedState | None = None,
        expert_sharding: gr.ExpertSharding | None = None,
    ):
        """``weight`` (``[*stack, experts, in, out]``) and ``fp8_state``: use these (shared,
        no ``key``) instead of initialising; ``fp8_state`` None with ``fp8``: a fresh one.

        Arguments:
            num_experts, in_features, out_features: the weight's ``[E, in, out]`` shape.
            key: initialises the weight (needed without ``weight``).
            fp8: FP8 GEMMs (else the input precision).
            config: the `Fp8Config` (None: the default one).
            dtype: the weight's dtype.
            backend: ``"auto"``, ``"pallas"`` or ``"reference"``.
            weight, fp8_state: arrays to use as they are instead.
            expert_sharding: expert parallelism (`fp8jax.shard_model` sets it), or None.
        """
        num_experts = checks.count("GroupedLinear", "num_experts", num_experts)
        in_features = checks.count("GroupedLinear", "in_features", in_features)
        out_features = checks.count("GroupedLinear", "out_features", out_features)
        backend = _check_backend("GroupedLinear", backend)
        config = checks.config("GroupedLinear", config)
        shape = (num_experts, in_features, out_features)
        if weight is None:
            if key is None:
                raise TypeError("GroupedLinear: pass key= (to initialise the weight) or weight=.")
            bound = 1.0 / math.sqrt(in_features)
            weight = jax.random.uniform(key, shape, dtype, -bound, bound)
        elif tuple(weight.shape[-3:]) != shape:
            raise ValueError(
                f"GroupedLinear: weight has shape {tuple(weight.shape)}; expected "
                f"[..., num_experts, in_features, out_features] = [..., {shape}]."
            )
        if fp8_state is None and fp8:
            fp8_state = Fp8GroupedState(num_experts, config)
        self.weight = weight
        self.fp8_state = fp8_state
        self.backend = gr.check_backend(backend)
        self.expert_sharding = expert_sharding

    @property
    def num_experts(self) -> int:
        return int(self.weight.shape[-3])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[-2])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[-1])

    def with_backend(self, backend: str) -> GroupedLinear:
        """The same layer (shared arrays) running on ``backend``."""
        return self._replace(backend=_check_backend("GroupedLinear.with_backend", backend))

    def with_expert_sharding(self, expert_sharding: gr.ExpertSharding | None) -> GroupedLinear:
        """The same layer (shared arrays) with ``expert_sharding`` recorded."""
        return self._replace(expert_sharding=expert_sharding)

    def _replace(self, **changes) -> GroupedLinear:
        """A layer built by ``__init__`` from this one's arrays and fields, ``changes`` applied."""
        fields = dict(
            weight=self.weight,
            fp8_state=self.fp8_state,
            fp8=self.fp8_state is not None,
            backend=self.backend,
            expert_sharding=self.expert_sharding,
        )
        sizes = (self.num_experts, self.in_features, self.out_features)
        return type(self)(*sizes, **(fields | changes))

    @jax.named_scope("fp8jax.nn.GroupedLinear")
    def __call__(
        self, x_sorted: Float[Array, "rows in"], group_sizes: Int[Array, " experts"]
    ) -> Array:
        """``x_sorted [rows, in]`` grouped by expert (``group_sizes[e]`` rows for expert
        ``e``, in order; groups may be empty) -> ``[rows, out]``. Rows past
        ``sum(group_sizes)`` get zeros. Sizes that sum past the rows raise when they are
        concrete; traced ones (under ``jit``) are cut at the last row, as if the groups
        ended there. A negative size raises, under ``jit`` too (``eqx.error_if``, when the
        call runs). Pads to the kernel layout and back."""
        return _apply_sorted(self, self, x_sorted, group_sizes)

    def apply_padded(
        self,
        x: Float[Array, "rows_pad in"],
        layout: GroupLayout | gr.BlockLayout,
        precast: gr.InputCast | None = None,
    ) -> Array:
        """The grouped GEMM on rows already in ``layout``'s padded layout (what `MoE`
        calls), or in a `fp8jax._ops.expert_parallel.BlockLayout`'s device blocks (`MoE`'s
        all-to-all dispatch). Output rows that are not ``layout.row_valid`` are undefined.
        ``precast``: the rows already cast with this layer's input scale (`MoE`'s FP8
        dispatch, per-tensor recipes); ``x`` then stands in for them (zeros carrying their
        gradient)."""
        x = self._check_input(x, "x")
        if x.shape[0] != layout.num_rows:
            raise ValueError(
                f"GroupedLinear: x has {x.shape[0]} rows, the layout {layout.num_rows}"
            )
        if layout.num_groups != self.num_experts:
            raise ValueError(
                f"GroupedLinear: the layout has {layout.num_groups} groups, the layer "
                f"{self.num_experts} experts"
            )
        if self.weight.ndim != 3:
            raise ValueError(
                f"GroupedLinear: weight has stack shape {self.weight.shape[:-3]}: run a stacked "
                "layer one slice at a time (jax.lax.scan or eqx.filter_vmap)."
            )
        blocks = isinstance(layout, gr.BlockLayout)  # each device's own rows (all-to-all)
        if blocks and self.expert_sharding is None:
            raise ValueError("GroupedLinear: a BlockLayout needs the experts sharded (shard_model)")
        backend = gr.resolve_backend(
            self.backend,
            layout.block_shape() if blocks else layout,
            self.in_features,
            self.out_features,
            x.dtype if self.fp8_state is None else jnp.float8_e4m3fn,
            per_device=blocks,
        )
        if self.fp8_state is None:
            return gr.grouped_plain(backend, x, self.weight, layout, self.expert_sharding)
        state = self.fp8_state
        spec = gr.Spec(
            state.config,
            backend,
            np.dtype(x.dtype),
            np.dtype(self.weight.dtype),
            self.expert_sharding,
        )
        # entered with its guard checked (raise) and its poison (nan), as Fp8DotGeneral's
        entered, poison = _guard.op_state(state)
        if precast is not None:
            if not state.config.recipe.per_tensor_scale:
                raise ValueError("GroupedLinear: a pre-cast input needs a per-tensor recipe")
            y = gr.grouped_fp8_precast(spec, x, precast, self.weight, layout, entered)
        else:
            y = gr.grouped_fp8(spec, x, self.weight, layout, entered)
        return _guard.add_poison(y, poison)

    def _check_input(self, x, name):
        x = checks.float_array("GroupedLinear", name, x)
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"GroupedLinear: {name} must have shape (rows, {self.in_features}), got {x.shape}"
            )
        return x


# Average rows per expert from which block-wise layers lay groups out on 256 rows. The 256-row
# blocks run faster; the padding grows from about 64 to 128 rows a group, and from this many
# rows per expert the speed outweighs it, with equal and random routing (benchmarks/RESULTS.md,
# "Grouped experts: 256-row blocks on 256-aligned groups", 2026-11-26 thirteenth session).
ALIGN_256_MIN_ROWS = 512


def row_align(layer: GroupedLinear, num_rows: int) -> int:
    """Group alignment of the padded layout for ``num_rows`` rows into ``layer``: 256 where
    the block-wise grouped kernels then take 256-row blocks and the groups average
    `ALIGN_256_MIN_ROWS` rows or more (the speed outweighs the extra padding); else
    `ROW_ALIGN` (128). For a layout of one's own: ``make_layout(sizes, rows,
    row_align(layer, rows))``.

    Arguments:
        layer: the `GroupedLinear` that takes the rows.
        num_rows: the real rows (tokens times top-k).

    Returns:
        The alignment, 128 or 256.
    """
    state = layer.fp8_state
    if state is None or state.config.recipe.grouped_kernel_reason() is not None:
        return ROW_ALIGN
    big = num_rows >= ALIGN_256_MIN_ROWS * layer.num_experts
    return 2 * ROW_ALIGN if big else ROW_ALIGN


def _apply_sorted(module, first: GroupedLinear, x_sorted, group_sizes):
    """``module.apply_padded`` on sorted rows: validate against ``first`` (the layer
    that takes the input), pad to the kernel layout, run, unpad."""
    x_sorted = first._check_input(x_sorted, "x_sorted")
    group_sizes = gr.check_group_sizes(group_sizes, x_sorted.shape[0], first.num_experts)
    sizes = gr.clip_group_sizes(group_sizes, x_sorted.shape[0])
    layout = make_layout(sizes, x_sorted.shape[0], row_align(first, x_sorted.shape[0]))
    y = module.apply_padded(gr.pad_rows(x_sorted, layout), layout)
    y = gr.unpad_rows(y, layout, x_sorted.shape[0])
    if isinstance(group_sizes, jax.core.Tracer) and _guard.mode() == "nan":
        y = _guard.add_poison(y, _guard.poison_if(jnp.any(group_sizes < 0)))
    return y


def make_layout(
    group_sizes: Int[Array, " experts"], num_rows: int, align: int = ROW_ALIGN
) -> GroupLayout:
    """The padded layout for ``num_rows`` real rows split into ``group_sizes``: each group
    starts on a multiple of ``align`` rows, as the grouped kernels read them.

    Arguments:
        group_sizes: rows per expert (an int array, may be traced).
        num_rows: the real rows (static).
        align: the group alignment (`row_align` picks it for a layer).

    Returns:
        The `GroupLayout` for `GroupedLinear.apply_padded` and its padding helpers.
    """
    return gr.layout_from_sizes(
        group_sizes, gr.padded_rows(num_rows, group_sizes.shape[0], align), align
    )


class GroupedMLP(eqx.Module):
    """Every expert's MLP at once: ``fc2(activation(fc1(x)))`` with grouped GEMMs.

    ``activation``: one of `fp8jax.nn.ACTIVATIONS`; the gated ones (``swiglu``,
    ``geglu``, ...) make fc1 ``2 * ffn`` wide (first half activated, gating the
    second, as in `FusedMLP` and Megatron).

    Arguments:
        num_experts: the number of experts.
        hidden, ffn: each expert's input/output size and inner size.
        key: initialises the weights.
        activation: a name in `ACTIVATIONS`.
        fp8: FP8 GEMMs (else the input precision).
        config: the `Fp8Config` (None: the default one).
        dtype: the weights' dtype.
        backend: ``"auto"``, ``"pallas"`` or ``"reference"``.
    """

    fc1: GroupedLinear
    fc2: GroupedLinear
    activation: str = eqx.field(static=True)

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        ffn: int,
        *,
        key: PRNGKeyArray,
        activation: str = "swiglu",
        fp8: bool = True,
        config: Fp8Config | None = None,
        dtype=F32,
        backend: str = "auto",
    ):
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"GroupedMLP: unknown activation {activation!r}; choose from {tuple(ACTIVATIONS)}"
            )
        num_experts = checks.count("GroupedMLP", "num_experts", num_experts)
        hidden = checks.count("GroupedMLP", "hidden", hidden)
        ffn = checks.count("GroupedMLP", "ffn", ffn)
        backend = _check_backend("GroupedMLP", backend)
        config = checks.config("GroupedMLP", config)
        gated = ACTIVATIONS[activation][1]
        k1, k2 = jax.random.split(key)
        self.fc1 = GroupedLinear(
            num_experts,
            hidden,
            ffn * (2 if gated else 1),
            key=k1,
            fp8=fp8,
            config=config,
            dtype=dtype,
            backend=backend,
        )
        self.fc2 = GroupedLinear(
            num_experts, ffn, hidden, key=k2, fp8=fp8, config=config, dtype=dtype, backend=backend
        )
        self.activation = activation

    def __call__(self, x_sorted: Array, group_sizes: Array) -> Array:
        """Like `GroupedLinear.__call__`: sorted rows and per-expert group sizes."""
        return _apply_sorted(self, self.fc1, x_sorted, group_sizes)

    @jax.named_scope("fp8jax.nn.GroupedMLP")
    def apply_padded(
        self, x: Array, layout: GroupLayout, precast: gr.InputCast | None = None
    ) -> Array:
        """`GroupedLinear.apply_padded` through both layers (``precast``: fc1's)."""
        h = self.fc1.apply_padded(x, layout, precast)
        return self.fc2.apply_padded(activate(h, self.activation), layout)
