"""`FusedMLP`: norm -> fc1 -> activation -> fc2 (-> + residual) with FP8 GEMMs.

The block is one `jax.checkpoint` region whose policy saves only the block input,
fc1's output and the FP8 weights/scales. So, in the compiled step:

* forward: the norm is computed in the pass that writes its FP8 copy (XLA fuses the
  norm into fc1's quantize), fc1's dequantize + bias + activation + FP8 cast of fc2's
  input are one pass;
* backward: fc2's dgrad is followed by one pass computing the activation's gradient
  and writing it in FP8 for fc1's GEMMs; the FP8 copies of the normed input and of the
  activation that the weight gradients need are recomputed from the saved bf16 tensors
  inside passes that read them anyway, instead of being kept from the forward.

Saved for the backward per token: the input (bf16) and fc1's output (bf16), i.e. the
normed input and the activation output are not kept (25-40% less than bf16 autodiff).
``fused=False`` runs the same math op by op (no checkpoint) and can return the
intermediates for debugging.
"""

from __future__ import annotations

import copy
import functools
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, PRNGKeyArray

from .. import checks
from .. import state as _state
from ..config import Fp8Config, resolve_config
from ..ops import dot as _dot
from ..ops import gated as _gated
from .linear import Linear, apply_linear

F32 = jnp.float32
FC1_OUT = "fp8jax_mlp_fc1_out"


@jax.custom_jvp
def _gelu(x):
    """GELU, tanh approximation (``jax.nn.gelu(approximate=True)``), written as
    ``x * sigmoid(2k(x + 0.044715 x^3))`` with its derivative in closed form: with
    ``tanh`` XLA writes the activation in bf16 in a pass of its own and casts it to FP8
    in a second one; in this form it fuses the activation with its cast as it does for
    silu (H100, jax 0.11.2). Value and derivative are `_gated._gate`'s, the Pallas core's."""
    return _gated._gate("geglu", x)[0].astype(x.dtype)


@_gelu.defjvp
def _gelu_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    act, derivative = _gated._gate("geglu", x)
    return act.astype(x.dtype), (derivative * t).astype(t.dtype)


def _qgelu(x):
    return x * jax.nn.sigmoid(1.702 * x)


def _srelu(x):
    return jnp.square(jax.nn.relu(x))


# name -> (elementwise function, gated). Gated activations split fc1's output in two
# halves along the feature axis: act(first half) * second half (Megatron's convention:
# ``x0, x1 = chunk(x, 2, -1); act(x0) * x1``; TE's geglu/swiglu do the same).
ACTIVATIONS: dict[str, tuple[Callable, bool]] = {
    "gelu": (_gelu, False),
    "geglu": (_gelu, True),
    "qgelu": (_qgelu, False),
    "qgeglu": (_qgelu, True),
    "silu": (jax.nn.silu, False),
    "swiglu": (jax.nn.silu, True),
    "relu": (jax.nn.relu, False),
    "reglu": (jax.nn.relu, True),
    "srelu": (_srelu, False),
    "sreglu": (_srelu, True),
}
NORMS = ("layernorm", "rmsnorm")


def activate(h: Array, activation: str) -> Array:
    """Apply ``activation`` to fc1's output ``h`` (gated ones halve the last dim), in
    ``h.dtype`` as a plain bf16 model does (no f32 copies kept for the backward)."""
    fn, gated = ACTIVATIONS[activation]
    if gated:
        gate, up = jnp.split(h, 2, axis=-1)
        return fn(gate) * up
    return fn(h)


def normalize(
    x: Array,
    weight: Array | None,
    bias: Array | None,
    kind: str,
    eps: float,
    zero_centered_gamma: bool = False,
) -> Array:
    """LayerNorm or RMSNorm over the last dim, statistics in f32, output in ``x.dtype``.
    With ``zero_centered_gamma`` the scale applied is ``1 + weight`` (TE's option)."""
    x32 = x.astype(F32)
    if kind == "layernorm":
        x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    if weight is not None:
        gamma = weight.astype(F32)
        y = y * (1.0 + gamma if zero_centered_gamma else gamma)
    if bias is not None:
        y = y + bias.astype(F32)
    return y.astype(x.dtype)


class FusedMLP(eqx.Module):
    """``y = fc2(act(fc1(norm(x)))) (+ x)`` with FP8 fc1/fc2 and fused elementwise passes.

    ``norm``: ``"layernorm"`` | ``"rmsnorm"`` (``eps``, ``zero_centered_gamma``).
    ``activation``: one of `ACTIVATIONS` (gated ones -- ``geglu``, ``swiglu``, ``reglu``,
    ``qgeglu``, ``sreglu`` -- make fc1 ``2 * ffn`` wide; its first half is activated
    and gates the second, as in Megatron). ``fc1``/``fc2`` are `fp8jax.nn.Linear`
    (``eqx.nn.Linear`` with ``fp8=False``); inputs may have any leading dims.

    On Hopper, a gated activation (those in `_gated.GPU_TESTED`) with both linears FP8
    (delayed scaling, no biases, tokens and ffn multiples of 64) runs `fp8jax.ops.gated`: one
    custom VJP whose Pallas kernels write the activation and its gradient straight to FP8,
    in both layouts, with their amax.
    Everything else runs as one checkpoint region through XLA's fusions.
    """

    norm_weight: Float[Array, " hidden"] | None
    norm_bias: Float[Array, " hidden"] | None
    fc1: Linear | eqx.nn.Linear
    fc2: Linear | eqx.nn.Linear
    hidden: int = eqx.field(static=True)
    ffn: int = eqx.field(static=True)
    norm: str = eqx.field(static=True)
    activation: str = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    zero_centered_gamma: bool = eqx.field(static=True)
    residual: bool = eqx.field(static=True)
    fused: bool = eqx.field(static=True)

    def __init__(
        self,
        hidden: int,
        ffn: int,
        *,
        activation: str = "swiglu",
        norm: str = "rmsnorm",
        eps: float = 1e-5,
        zero_centered_gamma: bool = False,
        norm_bias: bool | None = None,
        fc1_bias: bool = False,
        fc2_bias: bool = False,
        residual: bool = False,
        fused: bool = True,
        fp8: bool = True,
        config: Fp8Config | None = None,
        dtype=None,
        key: PRNGKeyArray,
    ):
        hidden = checks.count("FusedMLP", "hidden", hidden)
        ffn = checks.count("FusedMLP", "ffn", ffn)
        _check_kinds(norm, activation)
        gated = ACTIVATIONS[activation][1]
        k1, k2 = jax.random.split(key)
        fc1 = eqx.nn.Linear(
            hidden, ffn * (2 if gated else 1), use_bias=fc1_bias, dtype=dtype, key=k1
        )
        fc2 = eqx.nn.Linear(ffn, hidden, use_bias=fc2_bias, dtype=dtype, key=k2)
        param_dtype = fc1.weight.dtype
        gamma = jnp.zeros if zero_centered_gamma else jnp.ones
        weight = gamma((hidden,), param_dtype)
        use_norm_bias = norm == "layernorm" if norm_bias is None else norm_bias
        bias = jnp.zeros((hidden,), param_dtype) if use_norm_bias else None
        _init(
            self,
            weight,
            bias,
            fc1,
            fc2,
            norm=norm,
            activation=activation,
            eps=eps,
            zero_centered_gamma=zero_centered_gamma,
            residual=residual,
            fused=fused,
            fp8=fp8,
            config=config,
        )

    @classmethod
    def from_modules(
        cls,
        norm: eqx.nn.LayerNorm | eqx.nn.RMSNorm,
        fc1,
        fc2,
        *,
        activation: str,
        residual: bool = False,
        fused: bool = True,
        fp8: bool = True,
        config: Fp8Config | None = None,
        zero_centered_gamma: bool = False,
    ) -> "FusedMLP":
        """Build from an existing norm and two linears (``eqx.nn.Linear`` or
        `fp8jax.nn.Linear`), sharing their arrays: no copies are made."""
        if isinstance(norm, eqx.nn.LayerNorm):
            kind = "layernorm"
        elif isinstance(norm, eqx.nn.RMSNorm):
            kind = "rmsnorm"
        else:
            raise TypeError(
                f"FusedMLP.from_modules: norm must be eqx.nn.LayerNorm or eqx.nn.RMSNorm, "
                f"got {type(norm).__name__}"
            )
        shape = norm.shape if isinstance(norm.shape, tuple) else (norm.shape,)
        if len(shape) != 1:
            raise ValueError(
                f"FusedMLP.from_modules: the norm must normalize one (the last) dim, "
                f"got shape {shape}"
            )
        for name, layer in (("fc1", fc1), ("fc2", fc2)):
            if not isinstance(layer, (eqx.nn.Linear, Linear)):
                raise TypeError(
                    f"FusedMLP.from_modules: {name} must be eqx.nn.Linear or fp8jax.nn.Linear, "
                    f"got {type(layer).__name__}"
                )
        self = object.__new__(cls)
        _init(
            self,
            norm.weight,
            norm.bias,
            fc1,
            fc2,
            norm=kind,
            activation=activation,
            eps=float(norm.eps),
            zero_centered_gamma=zero_centered_gamma,
            residual=residual,
            fused=fused,
            fp8=fp8,
            config=config,
            hidden=shape[0],
        )
        return self

    def with_fused(self, fused: bool) -> "FusedMLP":
        """The same block (same arrays and state) with fusion on or off."""
        new = copy.copy(self)
        object.__setattr__(new, "fused", bool(fused))
        return new

    # ------------------------------------------------------------------ math
    def _unfused(self, x):
        normed = normalize(
            x, self.norm_weight, self.norm_bias, self.norm, self.eps, self.zero_centered_gamma
        )
        fc1_out = apply_linear(self.fc1, normed)
        act = activate(checkpoint_name(fc1_out, FC1_OUT), self.activation)
        y = apply_linear(self.fc2, act)
        if self.residual:
            y = y + x.astype(y.dtype)
        return y, dict(normed=normed, fc1_out=fc1_out, activation=act)

    @jax.named_scope("fp8jax.nn.FusedMLP")
    def __call__(
        self,
        x: Float[Array, "*batch hidden"],
        *,
        return_intermediates: bool = False,
        key: PRNGKeyArray | None = None,
    ):
        """``x: [..., hidden]`` -> ``[..., hidden]`` (and a dict of intermediates when
        ``return_intermediates``, which needs ``fused=False``)."""
        del key
        x = checks.float_array("FusedMLP", "x", x)
        if x.ndim == 0 or x.shape[-1] != self.hidden:
            raise ValueError(
                f"FusedMLP expects inputs of shape (..., {self.hidden}), got {x.shape}"
            )
        if return_intermediates:
            if self.fused:
                raise ValueError(
                    "FusedMLP: return_intermediates needs fused=False (fusion does not keep "
                    "the intermediates); call mlp.with_fused(False)(x, return_intermediates=True)."
                )
            return self._unfused(x)
        if not self.fused:
            return self._unfused(x)[0]
        if _gated_core_runs(self, x):
            return _gated_call(self, x)
        return _checkpointed_call(self, x)


def _check_kinds(norm: str, activation: str) -> None:
    if norm not in NORMS:
        raise ValueError(f"FusedMLP: unknown norm {norm!r}; choose from {NORMS}")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"FusedMLP: unknown activation {activation!r}; choose from {tuple(ACTIVATIONS)}"
        )


def _init(
    self,
    weight,
    bias,
    fc1,
    fc2,
    *,
    norm,
    activation,
    eps,
    zero_centered_gamma,
    residual,
    fused,
    fp8,
    config,
    hidden=None,
):
    """Validate shapes and set the fields (shared by ``__init__`` and ``from_modules``)."""
    _check_kinds(norm, activation)
    eps = checks.positive_number("FusedMLP", "eps", eps)
    try:
        config = resolve_config(config)
    except TypeError as e:
        raise TypeError(f"FusedMLP: {e}.") from None
    gated = ACTIVATIONS[activation][1]
    hidden = fc1.in_features if hidden is None else hidden
    if fc1.in_features != hidden:
        raise ValueError(
            f"FusedMLP: fc1 takes {fc1.in_features} features but the norm has {hidden}"
        )
    width = fc1.out_features
    if gated and width % 2:
        raise ValueError(
            f"FusedMLP: gated activation {activation!r} splits fc1's output in two halves, "
            f"but fc1 has an odd number of outputs ({width})"
        )
    ffn = width // 2 if gated else width
    if fc2.in_features != ffn:
        raise ValueError(
            f"FusedMLP: fc2 takes {fc2.in_features} features but {activation!r} gives {ffn} "
            f"(fc1 outputs {width})"
        )
    if residual and fc2.out_features != hidden:
        raise ValueError(
            f"FusedMLP: residual=True needs fc2 to output hidden={hidden} features, "
            f"got {fc2.out_features}"
        )
    for name, arr in (("norm weight", weight), ("norm bias", bias)):
        if arr is not None and arr.shape != (hidden,):
            raise ValueError(f"FusedMLP: {name} has shape {arr.shape}, expected ({hidden},)")
    if fp8:
        dims = dict(hidden=hidden, fc1_out=width, ffn=ffn, fc2_out=fc2.out_features)
        bad = {k: v for k, v in dims.items() if v % config.alignment}
        if bad:
            raise ValueError(
                f"FusedMLP: with FP8 on, feature dims must be multiples of {config.alignment}; "
                f"got {bad}. Pad the dims or pass fp8=False."
            )
        fc1 = fc1 if isinstance(fc1, Linear) else Linear.from_linear(fc1, config)
        fc2 = fc2 if isinstance(fc2, Linear) else Linear.from_linear(fc2, config)
    for name, value in dict(
        norm_weight=weight,
        norm_bias=bias,
        fc1=fc1,
        fc2=fc2,
        hidden=hidden,
        ffn=ffn,
        norm=norm,
        activation=activation,
        eps=float(eps),
        zero_centered_gamma=bool(zero_centered_gamma),
        residual=bool(residual),
        fused=bool(fused),
    ).items():
        object.__setattr__(self, name, value)


# ----------------------------------------------------------------------------- fused path
def _gated_core_runs(mlp: FusedMLP, x) -> bool:
    """Whether `fp8jax.ops.gated` (one custom VJP, Pallas activation kernels) runs this call:
    both linears FP8 without bias, one unstacked state per linear, not under ``jax.vmap``;
    the activation, scaling and sizes as `_gated.usable` says; not sequence parallel (its
    token gathers and scatters are the linear op's)."""
    fc1, fc2 = mlp.fc1, mlp.fc2
    if not (isinstance(fc1, Linear) and isinstance(fc2, Linear)):
        return False
    if any(getattr(f.dot_general.weight_sharding, "sequence", None) for f in (fc1, fc2)):
        return False
    if fc1.bias is not None or fc2.bias is not None or _dot._under_vmap(x):
        return False
    states = (fc1.dot_general, fc2.dot_general)
    if any(s.input_scale.ndim != 1 for s in states):
        return False
    m = x.size // mlp.hidden
    cfg1, cfg2 = states[0].config, states[1].config
    if any(c.selective and m < c.min_tokens for c in (cfg1, cfg2)):
        return False
    return _gated.usable(cfg1, cfg2, m, mlp.hidden, mlp.ffn, fc2.out_features, mlp.activation)


def _gated_call(mlp: FusedMLP, x):
    # The norm is recomputed in the backward (one cheap pass) rather than keeping its output.
    norm = jax.checkpoint(
        functools.partial(
            normalize, kind=mlp.norm, eps=mlp.eps, zero_centered_gamma=mlp.zero_centered_gamma
        )
    )
    normed = norm(x, mlp.norm_weight, mlp.norm_bias)
    x2 = normed.reshape(-1, mlp.hidden)
    fc1, fc2 = mlp.fc1, mlp.fc2
    spec = _gated.Spec(
        fc1.dot_general.config,
        fc2.dot_general.config,
        x2.dtype,
        fc1.weight.dtype,
        fc2.weight.dtype,
        mlp.activation,
    )
    y = _gated.gated_mlp(
        spec,
        x2,
        fc1.weight,
        _state.enter(fc1.dot_general.state()),
        fc2.weight,
        _state.enter(fc2.dot_general.state()),
    )
    y = y.reshape(*x.shape[:-1], fc2.out_features)
    return y + x.astype(y.dtype) if mlp.residual else y


def _policy():
    """Save fc1's output and the GEMMs' FP8 weights/scales; recompute the norm, the
    activation and the FP8 input copies (elementwise, fused into passes that run anyway)."""
    return jax.checkpoint_policies.save_only_these_names(FC1_OUT, *_dot.SAVED_RESIDUAL_NAMES)


def _checkpointed_call(mlp: FusedMLP, x):
    """Run the block as one checkpoint region. The FP8 states enter (`fp8jax.state.enter`)
    outside it, so that uses of one block in several regions still combine by max."""
    params, static = eqx.partition(_state.enter_tree(mlp), eqx.is_array)

    def block(params, x):
        return eqx.combine(params, static)._unfused(x)[0]

    return jax.checkpoint(block, policy=_policy())(params, x)
