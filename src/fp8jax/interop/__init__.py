"""Adapters that put fp8jax's FP8 GEMMs into other frameworks' layers: flax linen, haliax."""
