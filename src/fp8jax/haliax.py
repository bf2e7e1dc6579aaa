"""haliax adapter, at its public path (the code is in `fp8jax._interop.haliax`;
``pip install fp8jax[haliax]``)."""

from ._interop.haliax import convert_haliax_linear, haliax_linear_dims

__all__ = ["convert_haliax_linear", "haliax_linear_dims"]
