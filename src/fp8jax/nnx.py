"""flax nnx adapter, at its public path: ``fp8jax.nnx.fp8_linear_layers``, ``update`` and
friends (the code is in `fp8jax._interop.nnx`; ``pip install fp8jax[flax]``)."""

from ._interop.nnx import (
    WRT,
    Fp8DotGeneralOp,
    Fp8EinsumOp,
    Fp8State,
    diff_state,
    fp8_linear_layers,
    fp8_state,
    overwrite_state,
    update,
)

__all__ = [
    "WRT",
    "Fp8DotGeneralOp",
    "Fp8EinsumOp",
    "Fp8State",
    "diff_state",
    "fp8_linear_layers",
    "fp8_state",
    "overwrite_state",
    "update",
]
