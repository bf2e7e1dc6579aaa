"""Early, named checks of what users pass in: each raises one sentence naming the owner
(the class or function called), the argument, its value and what is expected."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ._config import Fp8Config, resolve_config


def float_array(owner: str, name: str, x) -> Array:
    """``x`` as a float16/bfloat16/float32 array, else a TypeError."""
    try:
        x = jnp.asarray(x)
    except (TypeError, ValueError):
        raise TypeError(f"{owner}: {name} must be an array, got {type(x).__name__}.") from None
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize < 2:
        raise TypeError(
            f"{owner}: {name} must be float16/bfloat16/float32, got dtype {x.dtype} "
            f"with shape {x.shape}."
        )
    if x.size == 0:
        raise ValueError(
            f"{owner}: {name} has shape {x.shape}, with no elements; FP8 scales come from "
            "an amax, which an empty array does not have."
        )
    return x


def count(owner: str, name: str, value) -> int:
    """``value`` if it is an int >= 1 (numpy ints too, not bools), else a ValueError."""
    is_int = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if not is_int or value < 1:
        raise ValueError(f"{owner}: {name}={value!r} is not allowed; expected an int >= 1.")
    return int(value)


def positive_number(owner: str, name: str, value) -> float:
    """``value`` as a float if it is a finite number > 0, else a ValueError."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not (ok and 0 < value < float("inf")):
        raise ValueError(f"{owner}: {name}={value!r} is not allowed; expected a finite number > 0.")
    return float(value)


def config(owner: str, value) -> Fp8Config:
    """`resolve_config` with ``owner`` named in its TypeError (the class itself caught too)."""
    if isinstance(value, type) and issubclass(value, Fp8Config):
        raise TypeError(
            f"{owner}: config is the class Fp8Config; expected an instance, e.g. Fp8Config()."
        )
    try:
        return resolve_config(value)
    except TypeError as e:
        raise TypeError(f"{owner}: {e}.") from None
