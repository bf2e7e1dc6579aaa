"""Trace-time lowering choices, for benchmarks and for stepping around a lowering: each is a
context manager whose value is read when an FP8 op is traced and keys that op's cached trace.

- `gemm` (`GemmTuning`, `current_gemm`): the per-tensor linear path's GEMM lowering (scales
  handed to cuBLASLt, f32 GEMM output, how the transposed FP8 copies are made);
  ``benchmarks/linear_tuning.py`` compares them.
- `activation` (`ActivationTuning`, `current_activation`): how `fp8jax.nn.FusedMLP`'s gated
  activation runs (Pallas kernels, interpret mode, plain JAX) and the kernels' tiles.

``with fp8jax.tuning.gemm(scaled_gemm=False): step = eqx.filter_jit(...)`` traces the step
with the scales applied after the GEMM; outside the block the defaults hold again.
"""

from ._kernels.gated_activation import Tuning as ActivationTuning
from ._kernels.gated_activation import current_tuning as current_activation
from ._kernels.gated_activation import tuning as activation
from ._kernels.gemm import Tuning as GemmTuning
from ._kernels.gemm import current_tuning as current_gemm
from ._kernels.gemm import tuning as gemm

__all__ = [
    "ActivationTuning",
    "GemmTuning",
    "activation",
    "current_activation",
    "current_gemm",
    "gemm",
]
