"""`remat_policy`: a ``jax.checkpoint`` policy for models with FP8 layers that keeps for the
backward what the FP8 GEMMs read (their FP8 input and weight copies, 1 byte an element, and
their scales) and `FusedMLP`'s fc1 output, and recomputes everything else in the region
(norms, activations, residual adds: elementwise passes) from the region's inputs."""

from __future__ import annotations

from typing import Callable

import jax

from .._ops import dot as _dot
from .._ops.gated import FC1_OUT

__all__ = ["remat_policy", "SAVED_NAMES"]

# The checkpoint names the policy saves (`jax.ad_checkpoint.checkpoint_name` in the ops).
SAVED_NAMES = (_dot.INPUT_RESIDUAL, *_dot.SAVED_RESIDUAL_NAMES, FC1_OUT)


def remat_policy(
    *extra_names: str, keep_fc1_out: bool = True, keep_inputs: bool = True
) -> Callable:
    """A ``jax.checkpoint`` policy (``jax.checkpoint(block, policy=fp8jax.remat_policy())``)
    that saves the FP8 GEMMs' operand copies and scales and `FusedMLP`'s fc1 output, and
    recomputes the rest of the region. The values, gradients and FP8 state are those of the
    step without ``jax.checkpoint`` (bit for bit on the CPU: `tests/test_remat.py`); what it
    saves can be read with `fp8jax.residuals_report`. A GEMM output that a nonlinear op's
    backward needs is recomputed (its GEMM runs again) unless it is named: `FusedMLP` names
    its fc1 output. Enter the FP8 states before the region (``fp8jax.enter_state(model)``),
    so that a layer used in two regions still combines its state by max. Whether it pays in
    time is the model's question (not measured on a GPU yet).

    Arguments:
        extra_names: further ``checkpoint_name`` names of the user's own to save too.
        keep_fc1_out: keep `FusedMLP`'s fc1 output (bf16, ``[tokens, 2 * hidden]`` gated:
            most of what the policy keeps; its e4m3 copy and scale with ``fc1_out_fp8``).
            False recomputes it from the kept FP8 copies (fc1's forward GEMM runs again in
            the backward): less memory for one more GEMM.
        keep_inputs: keep the FP8 GEMMs' input copies. False recomputes them from the
            region's inputs: for a region from a norm (or any cheap op) to the GEMMs it
            feeds, whose input the norm's backward keeps anyway, the backward runs the norm
            and the cast again and no GEMM (``fp8jax-train --remat lean``; `FusedMLP`'s
            ``recompute_input``). A region whose GEMM input comes from another GEMM would
            run that GEMM again.

    Returns:
        The policy, for ``jax.checkpoint(..., policy=...)``.
    """
    if not all(isinstance(n, str) for n in extra_names):
        raise TypeError(f"remat_policy: names must be strings, got {extra_names!r}.")
    drop = set() if keep_fc1_out else {FC1_OUT}
    drop |= set() if keep_inputs else {_dot.INPUT_RESIDUAL}
    names = tuple(n for n in SAVED_NAMES if n not in drop)
    return jax.checkpoint_policies.save_only_these_names(*names, *extra_names)
