import jax
import jax.numpy as jnp

from conftest import sqnr_db  # noqa: F401


def take_state(model, grads):
    """Apply only the FP8 state overwrites in ``grads`` to ``model``."""
    import fp8jax

    overwrites, _ = fp8jax.partition_for_grad_overwrite(grads)
    return fp8jax.apply_updates(model, None, overwrites)


def attention_loss(attn, q, k, v, g, **kw):
    """``sum(attn(q, k, v) * g)`` in float32: a fixed random projection of the output."""
    return jnp.sum(attn(q, k, v, **kw).astype(jnp.float32) * g)


def calibrated_attention(attn, q, k, v, g, steps=2, **kw):
    """Run the attention train step ``steps`` times, writing the state back (delayed
    scales of the gradients are unknown before the first backward)."""
    import equinox as eqx

    for _ in range(steps):
        attn = take_state(attn, eqx.filter_grad(attention_loss)(attn, q, k, v, g, **kw))
    return attn


def normal(key, shape, dtype=jnp.float32, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def recorded(state):
    """How many steps an FP8 state has recorded (while fewer than its history length):
    the nonzero entries of its input amax history (random inputs never have amax 0).
    Per layer for a stacked state."""
    import numpy as np

    history = getattr(state, "input_amax_history", None)
    if history is None:  # fp8jax.nn.Fp8AttentionState: q's history
        history = state.amax_history[..., 0, :]
    counts = np.count_nonzero(np.asarray(history), axis=-1)
    return int(counts) if counts.ndim == 0 else counts


# Sharded runs against the single-device run (float32 weights; the sharded run sums partial
# GEMMs and gradients in another order, and a rare FP8 rounding may flip). Measured on CPU:
# losses 2.3e-7 relative, gradients 1.3e-7 of their max, FP8 state equal.
LOSS_RTOL = 1e-6
GRAD_OF_MAX = 1e-5  # max |sharded - single| / max |single|, per gradient array
STATE_RTOL = 1e-6


def eight_device_mesh(data: int, fsdp: int, tensor: int):
    """A ``("data", "fsdp", "tensor")`` mesh over the first 8 devices."""
    import numpy as np
    from jax.sharding import Mesh

    devices = np.array(jax.devices()[:8]).reshape(data, fsdp, tensor)
    return Mesh(devices, ("data", "fsdp", "tensor"))


def assert_grads_match(grads, ref_grads):
    """The trainable gradients of a sharded run match one device's (`GRAD_OF_MAX`)."""
    import fp8jax
    import numpy as np

    pairs = zip(
        jax.tree_util.tree_leaves(fp8jax.trainable(grads)),
        jax.tree_util.tree_leaves(fp8jax.trainable(ref_grads)),
        strict=True,
    )
    for g, rg in pairs:
        np.testing.assert_allclose(g, rg, atol=GRAD_OF_MAX * float(jnp.max(jnp.abs(rg))))


def mosaic_calls_hlo(scope: str, operand_types) -> str:
    """Compiled-HLO text with two Mosaic GPU custom calls on parameters of
    ``operand_types``: one under the named ``scope``, one under another scope."""
    params = "\n".join(
        f"  %p{i} = {t}[256,128]{{1,0}} parameter({i})" for i, t in enumerate(operand_types)
    )
    args = ", ".join(f"%p{i}" for i in range(len(operand_types)))
    call = (
        f"  %{{}} = bf16[256,256]{{{{1,0}}}} custom-call({args}), "
        'custom_call_target="mosaic_gpu", metadata={{op_name="jit(f)/{}/pallas_call"}}'
    )
    return "\n".join([params, call.format("ours", scope), call.format("x", "y")])
