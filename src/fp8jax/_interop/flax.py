"""flax.linen adapter: `Fp8DotGeneralOp` for ``nn.Dense(dot_general_cls=...)`` and
``nn.DenseGeneral``, and `Fp8Einsum` for ``nn.Einsum`` (``pip install fp8jax[flax]``).

The state is exactly flax's own (``Fp8DirectDotGeneralOp``, ``Fp8Einsum``): the same six
variables (names, shapes, order, initial values) in flax's ``"_overwrite_with_gradient"``
collection, and the same amax-history layout (rolled each step, newest at index 0). So
``flax.training.train_state.TrainState.apply_gradients`` writes the new state and keeps
it out of the optimizer, as it does for flax's ops, and a flax FP8 checkpoint means the
same here. fp8jax's non-finite step counter is not kept in flax's collection::

    dense = nn.Dense(4096, dot_general_cls=fp8jax.flax.fp8_dot_general_cls(Fp8Config()))

The GEMMs are fp8jax's (real FP8, K-major), not flax's. With f32 parameters and a
narrower compute dtype (``param_dtype=f32, dtype=bf16``, flax's defaults for mixed precision)
the kernel is cast to FP8 from its f32 value, once, not from the bf16 copy ``nn.Dense`` makes of
it (`_stored_kernel`); the output stays in the compute dtype and the kernel's gradient comes
out of its GEMM in f32.
"""

from __future__ import annotations

import functools
from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp
from flax.linen import dtypes as linen_dtypes
from flax.linen import meta
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from jax.sharding import Mesh

from .. import _checks as checks
from .._config import Fp8Config
from .._dot_general import Fp8DotGeneral, fp8_einsum
from .._ops.dot import WeightSharding
from .._ops.sequence_parallel import SequenceParallel
from .._sequence import _sequence_axes, check_overlap, check_overlap_recipe

# flax's Fp8DotGeneralBase.setup order.
FLAX_STATE = (
    "input_amax_history",
    "kernel_amax_history",
    "output_grad_amax_history",
    "input_scale",
    "kernel_scale",
    "output_grad_scale",
)


def _op(module: nn.Module, config: Fp8Config, sequence=None) -> Fp8DotGeneral:
    """An `Fp8DotGeneral` over ``module``'s flax variables (made on first use);
    ``sequence``: its `fp8jax._ops.sequence_parallel.SequenceParallel` role, if any."""
    template = Fp8DotGeneral(config)
    state = {
        name: module.variable(
            OVERWRITE_WITH_GRADIENT, name, lambda name=name: getattr(template, name)
        ).value
        for name in FLAX_STATE
    }
    # Not a flax variable: a fresh zero each call, its "gradient" dropped.
    state["nonfinite_count"] = jnp.zeros((1,), jnp.float32)
    # The weight's own sharding stays the partitioner's (spec None).
    ws = None if sequence is None else WeightSharding(sequence.mesh, None, (), sequence)
    return Fp8DotGeneral(template.config, state=state, weight_sharding=ws)


# The layers whose ``dot_general`` gets their kernel as ``promote_dtype`` made it from the
# stored "kernel" param, unreshaped.
_KERNEL_LAYERS = (nn.Dense, nn.DenseGeneral)


def _stored_kernel(module: nn.Module, rhs):
    """The parent layer's "kernel" param as stored, where ``rhs`` is that param cast to
    the compute dtype by flax's own ``promote_dtype`` (an ``nn.Dense`` or ``nn.DenseGeneral``,
    a kernel of ``rhs``'s shape in another float dtype); else None. The FP8 cast then reads
    the f32 kernel itself instead of its bf16 copy (one rounding, no bf16 pass)."""
    parent = module.parent
    if type(parent) not in _KERNEL_LAYERS:
        return None
    if getattr(parent, "promote_dtype", linen_dtypes.promote_dtype) is not (
        linen_dtypes.promote_dtype
    ) or not parent.has_variable("params", "kernel"):
        return None
    kernel = meta.unbox(parent.get_variable("params", "kernel"))
    if getattr(kernel, "shape", None) != rhs.shape or kernel.dtype == rhs.dtype:
        return None
    return kernel if jnp.issubdtype(kernel.dtype, jnp.floating) else None


class Fp8DotGeneralOp(nn.Module):
    """A linen module with ``jax.lax.dot_general``'s signature running `Fp8DotGeneral`.
    ``sequence``: Megatron sequence parallelism (`fp8_dot_general_cls`'s ``sequence_parallel``).

    Arguments:
        config: the `Fp8Config`.
        sequence: the layer's half of a sequence-parallel pair, or None.
        parent, name: linen's.
    """

    config: Fp8Config = Fp8Config()
    sequence: SequenceParallel | None = None

    def __post_init__(self):
        checks.config("Fp8DotGeneralOp", self.config)
        super().__post_init__()

    @nn.compact
    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        kernel = _stored_kernel(self, jnp.asarray(rhs))
        if kernel is not None:  # the output keeps the compute dtype flax promoted to
            preferred_element_type = preferred_element_type or jnp.asarray(rhs).dtype
            rhs = kernel
        return _op(self, self.config, self.sequence)(
            lhs,
            rhs,
            dimension_numbers,
            precision=precision,
            preferred_element_type=preferred_element_type,
        )


class Fp8Einsum(nn.Module):
    """flax's ``Fp8Einsum`` on fp8jax's GEMM: ``(eqn, lhs, rhs)``, ``rhs`` the kernel,
    ``lhs`` cast to its dtype (flax's convention).

    Arguments:
        config: the `Fp8Config`.
        parent, name: linen's.
    """

    config: Fp8Config = Fp8Config()

    def __post_init__(self):
        checks.config("Fp8Einsum", self.config)
        super().__post_init__()

    @nn.compact
    def __call__(self, eqn: str, lhs, rhs, precision=None, preferred_element_type=None):
        if not isinstance(eqn, str):
            raise TypeError(
                f"Fp8Einsum: eqn={eqn!r} is not allowed; expected an einsum string "
                "such as 'bd,df->bf'."
            )
        if eqn.split("->")[0].count(",") != 1:
            raise ValueError(
                f"Fp8Einsum: eqn={eqn!r} is not allowed; expected two operands "
                "(lhs, kernel), such as 'bd,df->bf'."
            )
        rhs = checks.float_array("Fp8Einsum", "rhs (the kernel)", rhs)
        try:
            lhs = jnp.asarray(lhs).astype(rhs.dtype)
        except (TypeError, ValueError):
            kind = type(lhs).__name__
            raise TypeError(f"Fp8Einsum: lhs must be an array, got {kind}.") from None
        return fp8_einsum(_op(self, self.config), eqn, lhs, rhs, precision, preferred_element_type)


def fp8_dot_general_cls(
    config: Fp8Config | None = None,
    *,
    sequence_parallel: str | None = None,
    mesh: Mesh | None = None,
    tensor_axis: str = "tensor",
    batch_axes: Sequence[str] | None = None,
    tp_overlap: str = "none",
):
    """What to pass as ``dot_general_cls`` to ``nn.Dense`` / ``nn.DenseGeneral``.

    ``sequence_parallel="column"`` or ``"row"`` (with ``mesh``): the layer is that half of a
    Megatron tensor-parallel pair with sequence parallelism (`fp8jax._ops.sequence_parallel`):
    a column-parallel layer (kernel split over ``tensor_axis`` along its outputs) all-gathers
    its FP8 input's tokens, a row-parallel one (split along its inputs) reduce-scatters its
    output. Between the pair the tokens are split as
    `fp8jax.distributed.sequence_sharding` says (same ``batch_axes``; default: every mesh
    axis but ``tensor_axis``). ``tp_overlap="ring"`` or ``"chunks"``: those moves as
    collective matmuls, in chunks beside the GEMMs (`fp8jax._ops.tp_ring`).

    Linen layers are not converted after the fact, so there is no conversion report: every
    layer given this class is FP8, but with the default (``selective``) config a call on
    fewer than ``config.min_tokens`` rows runs in the input precision (bf16); a warning
    names the layer's shape when such a call is traced. ``Fp8Config(selective=False)``
    runs FP8 at any size.

    Arguments:
        config: the `Fp8Config` (None: the default one).
        sequence_parallel: ``"column"``, ``"row"`` or None (no sequence parallelism).
        mesh: the Auto-axes mesh (needed with ``sequence_parallel``).
        tensor_axis: the mesh axis the pair splits its kernels over.
        batch_axes: the mesh axes the tokens are split over outside the pair.
        tp_overlap: ``"none"`` (each move whole), ``"ring"`` or ``"chunks"`` (collective
            matmul).

    Returns:
        A `Fp8DotGeneralOp` constructor (a ``functools.partial``).
    """
    name = "fp8_dot_general_cls"
    config = checks.config(name, config)
    check_overlap(name, tp_overlap, sequence_parallel is not None)
    if sequence_parallel is None:
        return functools.partial(Fp8DotGeneralOp, config=config)
    if sequence_parallel not in ("column", "row"):
        raise ValueError(
            f"{name}: sequence_parallel must be 'column', 'row' or None, got {sequence_parallel!r}."
        )
    if not isinstance(mesh, Mesh):
        raise ValueError(
            f"{name}: sequence_parallel needs mesh=, a jax.sharding.Mesh; got {mesh!r}."
        )
    check_overlap_recipe(name, tp_overlap, config.recipe, "its config")
    batch = _sequence_axes(name, mesh, tensor_axis, batch_axes)
    sp = SequenceParallel(mesh, sequence_parallel, batch, tensor_axis, tp_overlap)
    return functools.partial(Fp8DotGeneralOp, config=config, sequence=sp)
