"""`FusedMLP`'s two fused paths: the gated core (`fp8jax._ops.gated`, Pallas activation
kernels) and, for everything else, one checkpoint region through XLA's fusions. ``mlp``:
a `fp8jax.nn.FusedMLP` (not imported here: it imports these)."""

from __future__ import annotations

import functools

import equinox as eqx
import jax

from .. import _guard
from .._ops import gated as _gated
from .._ops import rows as _rows
from .._ops import traced as _traced
from ._elementwise import normalize
from ._linear import Linear
from ._remat import remat_policy

FC1_OUT = _gated.FC1_OUT
# `FusedMLP.recompute_input`'s region keeps fc1's output (or its FP8 copy), the FP8 weight
# copies and the scalars: the norm and the input's cast run again, not the GEMMs.
_ALL_BUT_INPUT_COPY = remat_policy(keep_inputs=False)


def _gated_core_runs(mlp: eqx.Module, x) -> bool:
    """Whether `fp8jax._ops.gated` (one custom VJP, Pallas activation kernels) runs this call:
    both linears FP8 without bias, one unstacked state per linear, not under ``jax.vmap``;
    the activation, scaling and sizes as `_gated.usable` says; not tensor or sequence
    parallel (`fp8jax._ops.rows.splits_features`: the core's Pallas kernels are custom calls
    without a partitioning rule, so such layers take XLA's path, which partitions)."""
    fc1, fc2 = mlp.fc1, mlp.fc2
    if not (isinstance(fc1, Linear) and isinstance(fc2, Linear)):
        return False
    sequence = _sequence_core(mlp)
    splits = any(_rows.splits_features(f.dot_general.weight_sharding) for f in (fc1, fc2))
    if splits and sequence is None:
        return False
    if fc1.bias is not None or fc2.bias is not None or _traced.under_vmap(x):
        return False
    states = (fc1.dot_general, fc2.dot_general)
    if any(s.input_scale.ndim != 1 for s in states):
        return False
    m = x.size // mlp.hidden
    cfg1, cfg2 = states[0].config, states[1].config
    if any(c.selective and m < c.min_tokens for c in (cfg1, cfg2)):
        return False
    if sequence is not None:  # x's tokens split over the batch and tensor axes for its cast;
        # the kernels see every token of a batch shard and 1/tp of the features
        tp = sequence.mesh.shape[sequence.axis]
        rows = _rows.sequence_splits(sequence)[1]  # the kernels' split: its token count
        if m % (rows.count * tp) or mlp.ffn % (tp * 2 * max(mlp.gate_block, _gated.BLOCK)):
            return False
        ffn = mlp.ffn // tp
        return _gated.usable(cfg1, cfg2, m, mlp.hidden, ffn, fc2.out_features, mlp.activation, rows)
    rows = _row_split(mlp)
    return _gated.usable(cfg1, cfg2, m, mlp.hidden, mlp.ffn, fc2.out_features, mlp.activation, rows)


def _sequence_core(mlp: eqx.Module):
    """fc1's column-parallel record (`fp8jax._ops.sequence_parallel.SequenceParallel`) where
    the gated core runs under Megatron sequence parallelism, per device
    (`fp8jax._kernels.gemm.Tuning.sequence_cast`, on by default):
    fc1 column- and fc2 row-parallel over one tensor axis, no FSDP split, no ring, delayed
    per-tensor scaling, fc1's rows interleaved (``gate_block``), fc1's output kept in bf16,
    a program over several devices (`fp8jax._ops.rows.sequence_casts` of both). Else None."""
    if mlp.gate_block is None or mlp.fc1_out_fp8:
        return None
    ws1, ws2 = (getattr(f.dot_general, "weight_sharding", None) for f in (mlp.fc1, mlp.fc2))
    if ws1 is None or ws2 is None or ws1.sequence is None or ws2.sequence is None:
        return None
    col, row = ws1.sequence, ws2.sequence
    if (col.kind, row.kind) != ("column", "row") or col._replace(kind="row") != row:
        return None
    if any(col.mesh.shape[a] > 1 for a in ws1.gather + ws2.gather):
        return None  # FSDP gathers (axes of size 1 gather nothing)
    recipes = (mlp.fc1.dot_general.config.recipe, mlp.fc2.dot_general.config.recipe)
    return col if all(_rows.sequence_casts(col, r) for r in recipes) else None


def _row_split(mlp: eqx.Module) -> _rows.RowSplit | None:
    """How the core's kernels split the tokens (`fp8jax._ops.rows.of_weight` of fc1): None
    on one device, inside a ``shard_map``, or with no mesh known (then, over several
    devices, `_gated.usable` says no)."""
    return _rows.of_weight(mlp.fc1.dot_general.weight_sharding)


def _gated_call(mlp: eqx.Module, x):
    """The gated core's call (`_core_call`); with `FusedMLP.recompute_input`, one checkpoint
    region that keeps what the core keeps but the normed input's FP8 copy, which the
    backward makes again from ``x`` (its norm and cast; the GEMMs and activation do not run
    again: their outputs are not needed). The states enter outside it, as in
    `_checkpointed_call`."""
    if not mlp.recompute_input:
        return _core_call(mlp, x)
    params, static = eqx.partition(_guard.enter_tree(mlp), eqx.is_array)

    def block(params, x):
        return _core_call(eqx.combine(params, static), x)

    return jax.checkpoint(block, policy=_ALL_BUT_INPUT_COPY)(params, x)


def _core_call(mlp: eqx.Module, x):
    # The norm is recomputed in the backward (one cheap pass) rather than keeping its output.
    norm = jax.checkpoint(
        functools.partial(
            normalize, norm=mlp.norm, eps=mlp.eps, zero_centered_gamma=mlp.zero_centered_gamma
        )
    )
    normed = norm(x, mlp.norm_weight, mlp.norm_bias)
    x2 = normed.reshape(-1, mlp.hidden)
    fc1, fc2 = mlp.fc1, mlp.fc2
    spec = _gated.Spec(
        fc1.dot_general.config,
        fc2.dot_general.config,
        x2.dtype,
        fc1.weight.dtype,
        fc2.weight.dtype,
        mlp.activation,
        mlp.gate_block,
        _row_split(mlp),
        mlp.fc1_out_fp8,
        _sequence_core(mlp),
    )
    # Each linear's state with its guard, as `fp8jax.Fp8DotGeneral` takes it: checked, cycled
    # through the gradient, and (FP8JAX_GUARD=nan) a NaN output where an optimizer moved it
    (state1, poison1), (state2, poison2) = map(_guard.op_state, (fc1.dot_general, fc2.dot_general))
    y = _gated.gated_mlp(spec, x2, fc1.weight, state1, fc2.weight, state2)
    y = _guard.add_poison(_guard.add_poison(y, poison1), poison2)
    y = y.reshape(*x.shape[:-1], fc2.out_features)
    return y + x.astype(y.dtype) if mlp.residual else y


def _stores_fp8(mlp: eqx.Module) -> bool:
    """Whether the block keeps fc1's output in FP8 (`FusedMLP.fc1_out_fp8`, FP8 linears)."""
    return mlp.fc1_out_fp8 and isinstance(mlp.fc1, Linear) and isinstance(mlp.fc2, Linear)


def _policy(mlp: eqx.Module):
    """`remat_policy`: save fc1's output and the GEMMs' FP8 weights/scales; recompute the
    norm, the activation and the FP8 input copies (elementwise, fused into passes that run
    anyway). With fc1's output in FP8 the input copies are kept too: fc2's would be
    recomputed from the bf16 output, whose GEMM would run again."""
    return remat_policy(keep_inputs=_stores_fp8(mlp))


def _checkpointed_call(mlp: eqx.Module, x):
    """Run the block as one checkpoint region. The FP8 states enter (`fp8jax._state.enter`)
    outside it, so that uses of one block in several regions still combine by max."""
    params, static = eqx.partition(_guard.enter_tree(mlp), eqx.is_array)

    def block(params, x):
        return eqx.combine(params, static)._unfused(x)[0]

    return jax.checkpoint(block, policy=_policy(mlp))(params, x)
