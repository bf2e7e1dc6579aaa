"""FP8 layers built on `fp8jax.Fp8DotGeneral`."""

from .linear import Linear

__all__ = ["Linear"]
