"""`benchmarks.mlp`'s block through the flax front doors: the math of ``FusedMLP(fused=False)``
(`fp8jax.nn._elementwise.normalize` -> fc1 -> ``activate`` -> fc2) as a linen module whose
``nn.Dense`` layers take ``dot_general_cls=fp8jax.flax.fp8_dot_general_cls(config)`` and as an
nnx module whose ``nnx.Linear`` layers `fp8jax.nnx.fp8_linear_layers` converts, each holding a
given equinox block's arrays (so every door computes the same function of the same weights).
Parameters are stored in the block's dtype and the compute is ``dtype`` (flax's
``param_dtype`` / ``dtype``). Needs flax (`benchmarks.flax_steps.require_flax`)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

import fp8jax
from benchmarks.flax_steps import require_flax
from fp8jax.nn import FusedMLP
from fp8jax.nn._elementwise import activate, normalize

BF16 = jnp.bfloat16


def _check(block: FusedMLP) -> None:
    if block.zero_centered_gamma or block.gate_block is not None or block.residual:
        raise ValueError("mlp_flax: a block without zero_centered_gamma, gate_block, residual")


def _kernel(linear):
    """An equinox linear's weight ``[out, in]`` as flax's kernel ``[in, out]``."""
    return jnp.asarray(linear.weight.T)


def linen_mlp(block: FusedMLP, config: fp8jax.Fp8Config, dtype=BF16):
    """``(module, variables)``: ``block`` as a linen module with FP8 ``nn.Dense`` layers
    (``module.apply(variables, x)``), its FP8 state flax's ``_overwrite_with_gradient``."""
    require_flax()
    import flax.linen as nn

    _check(block)
    cls = fp8jax.flax.fp8_dot_general_cls(config)
    param_dtype = block.fc1.weight.dtype

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            ones = nn.initializers.ones
            weight = self.param("norm_weight", ones, (block.hidden,), param_dtype)
            bias = None
            if block.norm_bias is not None:
                bias = self.param("norm_bias", nn.initializers.zeros, (block.hidden,), param_dtype)
            h = normalize(x, weight, bias, block.norm, block.eps)
            for name, linear in (("fc1", block.fc1), ("fc2", block.fc2)):
                dense = nn.Dense(
                    linear.out_features,
                    use_bias=linear.bias is not None,
                    dtype=dtype,
                    param_dtype=param_dtype,
                    dot_general_cls=cls,
                    name=name,
                )
                h = dense(h)
                if name == "fc1":
                    h = activate(h, block.activation)
            return h

    module = MLP()
    with warnings.catch_warnings():  # a few rows: below a selective config's min_tokens
        warnings.simplefilter("ignore")
        initial = module.init(jax.random.PRNGKey(0), jnp.ones((16, block.hidden), dtype))
    params = {"norm_weight": block.norm_weight}
    if block.norm_bias is not None:
        params["norm_bias"] = block.norm_bias
    for name, linear in (("fc1", block.fc1), ("fc2", block.fc2)):
        params[name] = {"kernel": _kernel(linear)}
        if linear.bias is not None:
            params[name]["bias"] = linear.bias
    return module, {**initial, "params": params}  # flax's initial FP8 state, block's arrays


def nnx_mlp(block: FusedMLP, config: fp8jax.Fp8Config, dtype=BF16):
    """``block`` as an nnx module whose ``nnx.Linear`` layers `fp8jax.nnx.fp8_linear_layers`
    converted (in place, as its README shows); ``model(x)``."""
    require_flax()
    from flax import nnx

    import fp8jax.nnx as fnnx

    _check(block)
    param_dtype = block.fc1.weight.dtype

    def linear(layer, rngs):
        out = nnx.Linear(
            layer.in_features,
            layer.out_features,
            use_bias=layer.bias is not None,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        out.kernel[...] = _kernel(layer)
        if layer.bias is not None:
            out.bias[...] = layer.bias
        return out

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.norm_weight = nnx.Param(block.norm_weight)
            self.norm_bias = None if block.norm_bias is None else nnx.Param(block.norm_bias)
            self.fc1, self.fc2 = linear(block.fc1, rngs), linear(block.fc2, rngs)

        def __call__(self, x):
            bias = None if self.norm_bias is None else self.norm_bias[...]
            h = normalize(x, self.norm_weight[...], bias, block.norm, block.eps)
            return self.fc2(activate(self.fc1(h), block.activation))

    return fnnx.fp8_linear_layers(MLP(nnx.Rngs(0)), config)
