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

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, PRNGKeyArray

from .. import _checks as checks
from .._config import Fp8Config, resolve_config
from .._ops import gated as _gated
from .._ops import saved_fp8 as _saved
from ._elementwise import (
    ACTIVATIONS,
    NORMS,
    activate,
    check_gate_block,
    check_kinds,
    normalize,
    relayout_rows,
)
from ._linear import Linear, apply_linear
from ._mlp_paths import (  # noqa: F401  (_gated_core_runs: tests reach it here)
    _checkpointed_call,
    _gated_call,
    _gated_core_runs,
    _stores_fp8,
)

F32 = jnp.float32
FC1_OUT = _gated.FC1_OUT
__all__ = ["ACTIVATIONS", "NORMS", "FusedMLP", "activate", "normalize", "relayout_rows"]


class FusedMLP(eqx.Module):
    """``y = fc2(act(fc1(norm(x)))) (+ x)`` with FP8 fc1/fc2 and fused elementwise passes.

    ``norm``: ``"layernorm"`` | ``"rmsnorm"`` (``eps``, ``zero_centered_gamma``).
    ``activation``: one of `ACTIVATIONS` (gated ones -- ``geglu``, ``swiglu``, ``reglu``,
    ``qgeglu``, ``sreglu`` -- make fc1 ``2 * ffn`` wide; its first half is activated
    and gates the second, as in Megatron). ``fc1``/``fc2`` are `fp8jax.nn.Linear`
    (``eqx.nn.Linear`` with ``fp8=False``); inputs may have any leading dims.

    ``gate_block``: how a gated fc1 lays out its output rows. ``None`` (default): ``[gate |
    up]``, as Megatron and Hugging Face checkpoints store them. An int ``b``: ``[g0 u0 g1 u1
    ...]`` in blocks of ``b`` rows, so that a tensor-parallel (column) split of fc1 into
    shards of a multiple of ``2 * b`` rows keeps each gate row on the device of its up row:
    the activation then needs no communication (with ``None`` XLA reshuffles the halves at
    every step). ``64`` is also the core's own layout; with the block-wise recipe a multiple of
    its block (128) keeps gate and up rows in separate scale blocks. `with_gate_block`
    converts a block.

    ``fc1_out_fp8``: with FP8 fc1 and fc2, keep fc1's output for the backward as e4m3 with one
    float32 scale (`fp8jax._ops.saved_fp8`; current scaling from its amax: one more read of
    it, and its cast, in the forward) instead of bf16: half the bytes of the largest tensor
    the block keeps, no GEMM run again (DeepSeek-V3's FP8 cache of the SwiGLU input). The
    forward is unchanged; the rounding enters the activation's gradient (and on the gated
    core fc2's weight gradient, whose FP8 input the backward recomputes from it; the XLA
    path keeps that input's FP8 copy instead, as its recomputation would need the bf16
    output). The copy carries fc1's output's checkpoint name (`fp8jax.remat_policy` keeps
    it). Bf16 linears keep bf16 (their fc2 reads the bf16 activation, which keeping would
    cost what the copy saves). `with_fc1_out_fp8` switches it.

    ``recompute_input``: on the gated core, keep no FP8 copy of the normed input for fc1's
    weight gradient: the norm and its cast run again in the backward from the block's input,
    which the norm's backward keeps anyway (one pass over ``[tokens, hidden]``; the same bits:
    the cast's scale is the forward's). The XLA path recomputes it already, but with
    ``fc1_out_fp8``. `with_recompute_input` switches it.

    On Hopper, a gated activation (those in `_gated.GPU_TESTED`) with both linears FP8
    (delayed scaling, no biases, tokens and ffn multiples of 64) runs `fp8jax._ops.gated`: one
    custom VJP whose Pallas kernels write the activation and its gradient straight to FP8,
    in both layouts, with their amax. Over several devices it needs the model placed with
    `fp8jax.shard_model` (data parallel / FSDP): its kernels then run per device on their
    own token rows; tensor- and sequence-parallel layers take the XLA path.
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
    gate_block: int | None = eqx.field(static=True)
    fc1_out_fp8: bool = eqx.field(static=True)
    recompute_input: bool = eqx.field(static=True)

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
        gate_block: int | None = None,
        fc1_out_fp8: bool = False,
        recompute_input: bool = False,
        dtype=None,
        key: PRNGKeyArray | None = None,
        parts: tuple | None = None,
    ):
        """``parts``: ``(norm_weight, norm_bias, fc1, fc2)`` to use as they are (shared, no
        copies; ``norm_bias`` may be None) instead of initialising, which needs ``key``;
        ``norm_bias``, ``fc1_bias``, ``fc2_bias`` and ``dtype`` are then unused.

        Arguments:
            hidden, ffn: the block's width and fc1's output size (per half when gated).
            activation: a name in `ACTIVATIONS`.
            norm: ``"layernorm"`` or ``"rmsnorm"``; ``eps``, ``zero_centered_gamma`` its
                options; ``norm_bias``: a LayerNorm bias (None: with ``"layernorm"``).
            fc1_bias, fc2_bias: biases of the two linears.
            residual: add the input to the output.
            fused: one checkpoint region (else op by op, for debugging).
            fp8: FP8 linears (else ``eqx.nn.Linear``).
            config: the `Fp8Config` (None: the default one).
            gate_block: the gated fc1's row layout (None: ``[gate | up]``).
            fc1_out_fp8: keep fc1's output for the backward in FP8 (see the class).
            recompute_input: recompute the normed input's FP8 copy in the backward (see the
                class).
            dtype: the parameters' dtype.
            key: initialises the parameters (needed without ``parts``).
            parts: the parameters to use as they are instead.
        """
        hidden = checks.count("FusedMLP", "hidden", hidden)
        ffn = checks.count("FusedMLP", "ffn", ffn)
        check_kinds(norm, activation)
        if parts is None:
            if key is None:
                raise TypeError("FusedMLP: pass key= (to initialise the weights) or parts=.")
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
            parts = (weight, bias, fc1, fc2)
        weight, bias, fc1, fc2 = parts
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
            hidden=hidden,
            gate_block=gate_block,
            fc1_out_fp8=fc1_out_fp8,
            recompute_input=recompute_input,
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
        gate_block: int | None = None,
    ) -> "FusedMLP":
        """Build from an existing norm and two linears (``eqx.nn.Linear`` or
        `fp8jax.nn.Linear`), sharing their arrays: no copies are made. ``gate_block`` says
        how fc1's rows are laid out already (see the class); use `with_gate_block` to
        change it."""
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
        return cls(
            shape[0],
            fc2.in_features,
            activation=activation,
            norm=kind,
            eps=norm.eps,
            zero_centered_gamma=zero_centered_gamma,
            residual=residual,
            fused=fused,
            fp8=fp8,
            config=config,
            gate_block=gate_block,
            parts=(norm.weight, norm.bias, fc1, fc2),
        )

    def with_gate_block(self, gate_block: int | None) -> "FusedMLP":
        """The same block with fc1's rows (weight, bias) moved to layout ``gate_block``
        (see the class): the same function of its input. The FP8 state is unchanged (a
        row permutation keeps every amax)."""
        check_gate_block(gate_block, self.ffn, self.activation)
        src = self.gate_block
        fc1 = eqx.tree_at(
            lambda f: f.weight, self.fc1, relayout_rows(self.fc1.weight, -2, src, gate_block)
        )
        if fc1.bias is not None:
            fc1 = eqx.tree_at(lambda f: f.bias, fc1, relayout_rows(fc1.bias, -1, src, gate_block))
        return self._replace(fc1=fc1, gate_block=gate_block)

    def with_fused(self, fused: bool) -> "FusedMLP":
        """The same block (same arrays and state) with fusion on or off."""
        return self._replace(fused=fused)

    def with_fc1_out_fp8(self, fc1_out_fp8: bool) -> "FusedMLP":
        """The same block (same arrays and state) keeping fc1's output for the backward in
        FP8 or not (see the class)."""
        return self._replace(fc1_out_fp8=fc1_out_fp8)

    def with_recompute_input(self, recompute_input: bool) -> "FusedMLP":
        """The same block (same arrays and state) recomputing the normed input's FP8 copy in
        the backward or keeping it (see the class)."""
        return self._replace(recompute_input=recompute_input)

    def _replace(self, *, fc1=None, **changes) -> "FusedMLP":
        """A block built by ``__init__`` from this one's arrays and fields (``fc1``, if
        given, in place of its own), ``changes`` applied. Its linears are kept as they are
        (``fp8=False``: no conversion, no alignment check)."""
        parts = (self.norm_weight, self.norm_bias, self.fc1 if fc1 is None else fc1, self.fc2)
        fields = dict(
            activation=self.activation,
            norm=self.norm,
            eps=self.eps,
            zero_centered_gamma=self.zero_centered_gamma,
            residual=self.residual,
            fused=self.fused,
            fp8=False,
            gate_block=self.gate_block,
            fc1_out_fp8=self.fc1_out_fp8,
            recompute_input=self.recompute_input,
            parts=parts,
        )
        return type(self)(self.hidden, self.ffn, **(fields | changes))

    # ------------------------------------------------------------------ math
    def _unfused(self, x):
        normed = normalize(
            x, self.norm_weight, self.norm_bias, self.norm, self.eps, self.zero_centered_gamma
        )
        fc1_out = apply_linear(self.fc1, normed)
        act_fn = functools.partial(activate, activation=self.activation, gate_block=self.gate_block)
        if _stores_fp8(self):  # the backward reads fc1_out from an FP8 copy named FC1_OUT
            margin = _saved.margin(self.fc1.dot_general.config)
            act = _saved.through_fp8_residual(act_fn, fc1_out, FC1_OUT, margin)
        else:
            act = act_fn(checkpoint_name(fc1_out, FC1_OUT))
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
    gate_block=None,
    fc1_out_fp8=False,
    recompute_input=False,
):
    """Validate shapes and set the fields (``__init__``'s body)."""
    check_kinds(norm, activation)
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
    check_gate_block(gate_block, ffn, activation)
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
    # A stacked block (`eqx.filter_vmap`) has fc1's leading dims on its norm arrays too.
    expected = tuple(getattr(fc1.weight, "shape", ())[:-2]) + (hidden,)
    for name, arr in (("norm weight", weight), ("norm bias", bias)):
        if arr is not None and arr.shape != expected:
            raise ValueError(f"FusedMLP: {name} has shape {arr.shape}, expected {expected}")
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
        gate_block=gate_block,
        fc1_out_fp8=bool(fc1_out_fp8),
        recompute_input=bool(recompute_input),
    ).items():
        setattr(self, name, value)
