"""Adapters that put fp8jax's FP8 GEMMs into other frameworks' layers. Users import them
from their public paths, `fp8jax.flax`, `fp8jax.nnx` and `fp8jax.haliax`.

- `flax`: flax linen: `Fp8DotGeneralOp` for ``nn.Dense``, `Fp8Einsum` for ``nn.Einsum``.
- `nnx`: flax nnx: FP8 ``nnx.Linear`` / ``LinearGeneral`` / ``Einsum``, in place.
- `haliax`: haliax's ``Linear`` with an FP8 ``dot_general``.
- `inference`: haliax layers' FP8 inference weights, and the inference dot shared with nnx.
- `nnx_inference`: flax nnx models for FP8 inference (`fp8jax.to_inference`, in place).
"""
