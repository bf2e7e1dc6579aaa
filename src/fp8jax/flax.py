"""flax.linen adapter, at its public path: ``fp8jax.flax.fp8_dot_general_cls`` and friends
(the code is in `fp8jax._interop.flax`; ``pip install fp8jax[flax]``)."""

from ._interop.flax import FLAX_STATE, Fp8DotGeneralOp, Fp8Einsum, fp8_dot_general_cls

__all__ = ["FLAX_STATE", "Fp8DotGeneralOp", "Fp8Einsum", "fp8_dot_general_cls"]
