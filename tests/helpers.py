import jax
import jax.numpy as jnp

from conftest import sqnr_db  # noqa: F401


def take_state(model, grads):
    """Apply only the FP8 state overwrites in ``grads`` to ``model``."""
    import fp8jax

    overwrites, _ = fp8jax.partition_for_grad_overwrite(grads)
    return fp8jax.apply_updates(model, None, overwrites)


def normal(key, shape, dtype=jnp.float32, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)
