"""FP8 layers built on `fp8jax.Fp8DotGeneral`."""

from .linear import Linear
from .mlp import ACTIVATIONS, FusedMLP

__all__ = ["ACTIVATIONS", "FusedMLP", "Linear"]
