"""FP8 attention: `dot_product_attention` and `DotProductAttention` (`MultiHeadAttention`, the
block with its projections and rotary embedding, is `fp8jax.nn._mha`).

Modes (Transformer Engine's names):

* ``"bf16"``: no FP8; cuDNN flash attention on GPU (``jax.nn.dot_product_attention``),
  XLA elsewhere.
* ``"fp8_dpa"``: the attention core runs in FP8: Q.K^T and P.V (and the backward's GEMMs)
  are FP8 GEMMs inside a flash attention, fp8jax's own (``"mgpu"``, what ``"auto"`` runs
  for a causal call on one GPU) or cuDNN's FP8 one. Inputs and output are in
  the model's precision; the cast of Q, K, V to e4m3 and the dequantization of O
  are elementwise passes that XLA fuses into their neighbours.
* ``"fp8_mha"`` (`MultiHeadAttention` only; the same core as ``fp8_dpa`` for the bare
  function): the QKV and output projections are FP8 GEMMs too. The QKV GEMM writes
  bf16 (cuBLAS has no per-slice output scales); one pass then applies rotary and writes
  Q and K in e4m3 with their amax, and V's cast is a pass of its own (H100 profile in
  benchmarks/RESULTS.md). The output projection reads O's e4m3 copy (the
  dequantize/requantize pair fuses into one pass over FP8 data).

FP8 tensors are e4m3 with per-tensor scales kept in an `Fp8AttentionState` (see
`fp8jax._ops.attention` for the ten tensors and which scaling each uses). Softmax and
its statistics stay in float32. The state is updated through the gradient, so the
usual `partition_for_grad_overwrite` / `apply_updates` step works unchanged.
"""

from __future__ import annotations

import math
import warnings
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .. import _checks as checks
from .. import _guard, _state
from .._config import Fp8Config, resolve_config
from .._kernels import dispatch
from .._ops import attention as _attention
from .._ops import attention_mgpu as _attention_mgpu
from .._state import OverwriteWithGradient

MODES = ("bf16", "fp8_dpa", "fp8_mha")
BACKENDS = ("auto", "cudnn", "reference", "mgpu")
# Also accepted: "mgpu-interpret", the "mgpu" kernels in Pallas' interpreter (CPU tests).
_ACCEPTED = BACKENDS + ("mgpu-interpret",)
TENSORS = _attention.TENSORS
# "auto" runs the mgpu kernels where they can (causal, one device's arrays): their forward
# plus backward measured faster than cuDNN's FP8 path at every sequence length timed
# (benchmarks/RESULTS.md, twenty-ninth session). Under a `split` (several GPUs) auto keeps
# cuDNN: not yet measured there.
AUTO_MGPU = True


class Fp8AttentionState(OverwriteWithGradient):
    """FP8 scaling state of one attention: for each tensor in `TENSORS` (q, k, v, s,
    o, do, dp, dq, dk, dv) a dequantization scale and an amax history (newest at 0).

    Arguments:
        config: the `Fp8Config` (None: the default one; the per-tensor recipe only).
        stack_shape: leading dims of stacked layers, else ``()``.
    """

    # The tensors' names, in the order of the scales (``state.scale(name)`` takes one).
    TENSORS: ClassVar[tuple[str, ...]] = TENSORS
    scales: Float[Array, "*stack 10"]
    amax_history: Float[Array, "*stack 10 history"]
    nonfinite_count: Float[Array, "*stack 1"]
    config: Fp8Config = eqx.field(static=True)
    # Last: the three fields keep their leaf positions. The usual equinox loop (an optimizer
    # over every inexact array) trains the state; its guard makes that loud (`fp8jax._guard`,
    # as `fp8jax.Fp8DotGeneral`'s). None: unchecked (a state built before it had one).
    guard: Float[Array, "*stack 1"] | None = None

    def __init__(self, config: Fp8Config | None = None, *, stack_shape: tuple[int, ...] = ()):
        config = resolve_config(config)
        config.recipe.check_attention()
        stack_shape = tuple(stack_shape)
        self.scales = jnp.broadcast_to(
            jnp.asarray(_attention.INITIAL_SCALES, jnp.float32), stack_shape + (len(TENSORS),)
        ).copy()
        self.amax_history = jnp.zeros(
            stack_shape + (len(TENSORS), config.history_length), jnp.float32
        )
        self.nonfinite_count = jnp.zeros(stack_shape + (1,), jnp.float32)
        self.config = config
        self.guard = _guard.init(stack_shape)

    def ran_mask(self) -> Array:
        """[*stack, 1]: which (stacked) states a step produced (scales are never 0)."""
        return self.scales[..., :1] > 0

    def state(self) -> tuple[Array, ...]:
        return (self.scales, self.amax_history, self.nonfinite_count)

    def scale(self, tensor: str) -> Array:
        """The scale last used for ``tensor`` (one of `TENSORS`, also ``self.TENSORS``)."""
        return self.scales[..., _index(tensor)]

    def ordered_amax_history(self, tensor: str) -> Array:
        """``tensor``'s amax history, newest first."""
        return _state.newest_first(self.amax_history[..., _index(tensor), :], axis=-1)


def _index(tensor: str) -> int:
    if tensor not in _attention.IDX:
        raise ValueError(f"unknown attention tensor {tensor!r}; expected one of {TENSORS}")
    return _attention.IDX[tensor]


# ----------------------------------------------------------------------------- checks
def _check_scale(owner: str, scale) -> float | None:
    """``scale`` as a float if it is a finite number > 0, None if None, else a ValueError."""
    if scale is None:
        return None
    number = isinstance(scale, (int, float, np.integer, np.floating)) and not isinstance(
        scale, bool
    )
    if not (number and 0 < scale < float("inf")):
        raise ValueError(
            f"{owner}: scale={scale!r} is not allowed; expected a finite number > 0 "
            "or None (1/sqrt(head_dim))."
        )
    return float(scale)


def _check_inputs(query, key, value, mode, backend, lengths):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    dispatch.check("fp8jax attention", backend, _ACCEPTED)
    if mode == "bf16" and backend in _attention_mgpu.BACKENDS:
        raise ValueError(
            f"fp8jax attention: backend={backend!r} runs the FP8 modes (fp8_dpa, fp8_mha) "
            "only; mode='bf16' takes backend='auto', 'cudnn' or 'reference'."
        )
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 4:
            raise ValueError(
                f"dot_product_attention expects BTNH arrays [batch, seq, heads, head_dim]; "
                f"{name} has shape {x.shape}"
            )
        checks.float_array("fp8jax attention", name, x)
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, "
            f"{value.dtype}"
        )
    if key.shape != value.shape:
        raise ValueError(
            f"key and value must have the same shape, got {key.shape} and {value.shape}"
        )
    b, _, n, h = query.shape
    if key.shape[3] != h:
        raise ValueError(
            f"query head_dim ({h}) and key head_dim ({key.shape[3]}) must be equal; "
            f"got query {query.shape} and key {key.shape}"
        )
    if key.shape[0] != b:
        raise ValueError(
            f"query {query.shape} and key {key.shape} must agree on batch and head_dim"
        )
    if n % key.shape[2]:
        raise ValueError(
            f"query heads ({n}) must be a multiple of key/value heads ({key.shape[2]}) for GQA"
        )
    checked = {}
    for (name, x), most in zip(lengths.items(), (query.shape[1], key.shape[1])):
        checked[name] = None if x is None else _check_lengths(name, x, b, most)
    return checked


def _check_lengths(name: str, x, b: int, most: int):
    """``x`` as an int array ``(b,)``; concrete (not traced) values in ``[0, most]``."""
    try:
        x = jnp.asarray(x)
    except (TypeError, ValueError):
        raise TypeError(
            f"{name} must be an int array of shape ({b},), got {type(x).__name__} {x!r}"
        ) from None
    if x.shape != (b,) or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(
            f"{name} must be an int array of shape ({b},), got {x.dtype}{list(x.shape)}"
        )
    try:  # concrete values only (under jit they are traced: shape and dtype checked above)
        values = np.asarray(x)
    except jax.errors.JAXTypeError:
        return x
    bad = values[(values < 0) | (values > most)]
    if bad.size:
        raise ValueError(
            f"{name} must be in [0, {most}] (the sequence length), got {values.tolist()}: "
            f"{bad.tolist()} out of range"
        )
    return x


_WARNED: set[str] = set()


def _mgpu_reason(backend: str, query, key, has_lengths: bool, causal: bool, split) -> str | None:
    """Why the ``"mgpu"`` kernels cannot run this call (None: they can)."""
    if has_lengths:
        return "the mgpu kernels have no padding mask (sequence lengths)"
    interpret = backend == "mgpu-interpret"  # plain JAX ops there: XLA partitions them
    why = _attention_mgpu.reason(query.shape, key.shape, causal, interpret)
    if why is None and not interpret and split is None:
        why = dispatch.unpartitioned_reason()
    return why


def _choose_backend(
    backend: str, query, key, has_lengths: bool, causal: bool = False, split=None
) -> str:
    """The backend of one call. ``"auto"``: fp8jax's ``"mgpu"`` kernels for a causal call
    they can run on one device's arrays (``split`` None: one device, or inside a shard_map),
    where their forward plus backward measured faster than cuDNN's FP8 (`AUTO_MGPU`);
    else ``"cudnn"`` by `fp8jax._kernels.dispatch.choose` where it can run the call, else
    the reference (with one warning per reason on a GPU, where cuDNN was expected).
    ``"mgpu"`` (``"mgpu-interpret"``) as asked, else a ValueError saying why it cannot run:
    it never falls back."""
    if backend == "auto" and causal and split is None and AUTO_MGPU:
        if _mgpu_reason("mgpu", query, key, has_lengths, causal, split) is None:
            return "mgpu"
    if backend in _attention_mgpu.BACKENDS:
        why = _mgpu_reason(backend, query, key, has_lengths, causal, split)
        if why is not None:
            raise ValueError(
                f"fp8jax attention: backend={backend!r} cannot run this call ({why}); "
                "use backend='auto', 'cudnn' or 'reference'."
            )
        return backend
    ok, why = _attention.cudnn.availability()
    if ok and has_lengths:
        why = (
            "cuDNN's FP8 attention has no padding mask: sequence lengths need mode='bf16' "
            "or backend='reference'"
        )
    elif ok:
        why = _attention.cudnn.limits(query.shape[-1], query.shape[1], key.shape[1])
    auto = dispatch.check("fp8jax attention", backend, BACKENDS) == "auto"
    if auto and ok and why is not None and why not in _WARNED:  # on a GPU cuDNN was expected
        _WARNED.add(why)
        warnings.warn(
            f"fp8jax attention: {why}; running the plain-JAX reference backend (slow).",
            stacklevel=4,
        )
    chosen = dispatch.choose("fp8jax attention", backend, why, _ACCEPTED)
    return "cudnn" if chosen == "kernel" else "reference"


def dot_product_attention(
    query: Float[Array, "B T N H"],
    key: Float[Array, "B S K H"],
    value: Float[Array, "B S K H"],
    state: Fp8AttentionState | None = None,
    *,
    mode: str = "fp8_dpa",
    is_causal: bool = False,
    scale: float | None = None,
    query_seq_lengths: Int[Array, " B"] | None = None,
    key_value_seq_lengths: Int[Array, " B"] | None = None,
    backend: str = "auto",
    split: _attention.AttnSplit | None = None,
) -> Float[Array, "B T N H"]:
    """Scaled dot-product attention on BTNH arrays, in FP8 for ``mode="fp8_dpa"`` /
    ``"fp8_mha"`` (``state`` required) or in the input precision for ``"bf16"``.

    ``key``/``value`` may have fewer heads than ``query`` (grouped-query attention).
    ``backend``: ``"cudnn"`` (Hopper; head_dim 128 with sequence lengths that are
    multiples of 128), ``"reference"`` (plain JAX with the same quantization:
    any size, on any device, materializes the [T, S] scores) or ``"auto"`` (cuDNN
    where it can run this call, else the reference, with a warning on a GPU; a causal call
    on one device's arrays runs ``"mgpu"`` where it can); ``"kernel"`` is
    `fp8jax._kernels.dispatch`'s name for ``"cudnn"``. Sequence lengths (padding) work in
    ``"bf16"`` mode and on the reference backend; cuDNN's FP8 kernel has no padding mask.
    ``"mgpu"`` (FP8 modes): fp8jax's own Hopper FP8 flash attention (Pallas Mosaic GPU;
    head_dim 64 or 128, sequence lengths multiples of 128, no padding mask), its forward
    and backward on e4m3 ``wgmma``; a call it cannot run raises a ValueError saying why.

    Arguments:
        query: ``[B, T, N, H]``.
        key, value: ``[B, S, K, H]`` with ``K`` dividing ``N``.
        state: the `Fp8AttentionState` (FP8 modes), else None.
        mode: ``"fp8_dpa"``, ``"fp8_mha"`` or ``"bf16"``.
        is_causal: mask the future (a query attends to keys at or before it).
        scale: the scores' scale (None: ``1 / sqrt(H)``).
        query_seq_lengths, key_value_seq_lengths: ``[B]`` valid lengths, or None.
        backend: ``"auto"``, ``"cudnn"`` (``"kernel"``), ``"reference"`` or ``"mgpu"``.
        split: FP8 modes over several devices: the mesh axes that split the sequences and
            the heads (`fp8jax.shard_model` records it in `DotProductAttention`); each
            device then runs the kernel on its own part. None: one call, as XLA places it.

    Returns:
        The attention output ``[B, T, N, H]`` in the query's dtype; in FP8 modes the
        state's new value comes back as ``state``'s gradient.
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    scale = _check_scale("dot_product_attention", scale)
    lengths = {
        "query_seq_lengths": query_seq_lengths,
        "key_value_seq_lengths": key_value_seq_lengths,
    }
    lengths = _check_inputs(query, key, value, mode, backend, lengths)
    query_seq_lengths, key_value_seq_lengths = lengths.values()
    if mode == "bf16":
        on_gpu = jax.devices()[0].platform == "gpu"
        fast = on_gpu and backend != "reference" and query.dtype in (jnp.bfloat16, jnp.float16)
        return jax.nn.dot_product_attention(
            query,
            key,
            value,
            scale=scale,
            is_causal=is_causal,
            query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths,
            implementation="cudnn" if fast else None,
        )
    if not isinstance(state, Fp8AttentionState):
        raise TypeError(
            f"mode={mode!r} needs an Fp8AttentionState (got {type(state).__name__}); "
            "keep one in your model, or use fp8jax.nn.DotProductAttention."
        )
    if state.scales.ndim != 1:
        raise ValueError(
            f"Fp8AttentionState has stack shape {state.scales.shape[:-1]}: run a stacked state one "
            "slice at a time (jax.lax.scan or eqx.filter_vmap)."
        )
    has_lengths = query_seq_lengths is not None or key_value_seq_lengths is not None
    chosen = _choose_backend(backend, query, key, has_lengths, bool(is_causal), split)
    softmax_scale = float(scale) if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    spec = _attention.AttnSpec(
        state.config,
        chosen,
        bool(is_causal),
        softmax_scale,
        np.dtype(query.dtype),
        np.dtype(query.dtype),
        split,
    )
    q_len = None if query_seq_lengths is None else jnp.asarray(query_seq_lengths, jnp.int32)
    kv_len = (
        None if key_value_seq_lengths is None else jnp.asarray(key_value_seq_lengths, jnp.int32)
    )
    # The state entered with its guard checked (FP8JAX_GUARD=raise) and its poison (nan: NaN
    # output where an optimizer trained the state), as `fp8jax.Fp8DotGeneral` takes its own.
    fields, poison = _guard.op_state(state)
    out = _attention.fp8_attention(spec, query, key, value, q_len, kv_len, fields)
    return _guard.add_poison(out, poison)


class DotProductAttention(eqx.Module):
    """`dot_product_attention` with its FP8 state: ``attn(q, k, v)`` on BTNH arrays, or
    on TNH arrays (one example, e.g. under ``jax.vmap``).

    Arguments:
        mode: ``"fp8_dpa"`` (FP8, with a state), ``"fp8_mha"`` or ``"bf16"`` (no state).
        is_causal, scale, backend: as `dot_product_attention` takes them.
        config: the `Fp8Config` (None: the default one).
        stack_shape: leading dims of stacked layers, else ``()``.
        split: where the layer runs over several devices (`dot_product_attention`'s
            ``split``; `fp8jax.shard_model` records it), else None.
        state: an existing `Fp8AttentionState` to keep (its arrays shared; FP8 modes),
            instead of a fresh one from ``config`` and ``stack_shape``.
    """

    state: Fp8AttentionState | None
    mode: str = eqx.field(static=True)
    is_causal: bool = eqx.field(static=True)
    scale: float | None = eqx.field(static=True)
    backend: str = eqx.field(static=True)
    split: _attention.AttnSplit | None = eqx.field(static=True)

    def __init__(
        self,
        mode: str = "fp8_dpa",
        *,
        is_causal: bool = False,
        scale: float | None = None,
        backend: str = "auto",
        config: Fp8Config | None = None,
        stack_shape: tuple[int, ...] = (),
        split: _attention.AttnSplit | None = None,
        state: Fp8AttentionState | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"DotProductAttention: mode must be one of {MODES}, got {mode!r}")
        dispatch.check("DotProductAttention", backend, _ACCEPTED)
        scale = _check_scale("DotProductAttention", scale)
        try:
            config = resolve_config(config)
        except TypeError as e:
            raise TypeError(f"DotProductAttention: {e}.") from None
        if mode == "bf16":
            state = None
        elif state is None:
            state = Fp8AttentionState(config, stack_shape=stack_shape)
        elif not isinstance(state, Fp8AttentionState):
            raise TypeError(
                f"DotProductAttention: state must be an Fp8AttentionState, got {type(state)}"
            )
        self.state = state
        self.mode, self.is_causal, self.scale, self.backend = mode, bool(is_causal), scale, backend
        self.split = split

    def with_split(self, split: _attention.AttnSplit | None) -> "DotProductAttention":
        """The same layer (shared state arrays) run per device on ``split``'s sequences and
        heads (`fp8jax.shard_model` records it when it places a model)."""
        return type(self)(
            self.mode,
            is_causal=self.is_causal,
            scale=self.scale,
            backend=self.backend,
            split=split,
            state=self.state,
        )

    @jax.named_scope("fp8jax.nn.DotProductAttention")
    def __call__(self, query, key, value, *, query_seq_lengths=None, key_value_seq_lengths=None):
        single = jnp.ndim(query) == 3
        if single:
            query, key, value = query[None], key[None], value[None]
            query_seq_lengths = (
                None if query_seq_lengths is None else jnp.reshape(query_seq_lengths, (1,))
            )
            key_value_seq_lengths = (
                None if key_value_seq_lengths is None else jnp.reshape(key_value_seq_lengths, (1,))
            )
        out = dot_product_attention(
            query,
            key,
            value,
            self.state,
            mode=self.mode,
            is_causal=self.is_causal,
            scale=self.scale,
            query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths,
            backend=self.backend,
            split=self.split,
        )
        return out[0] if single else out
