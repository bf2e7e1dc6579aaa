"""A decoder-only transformer in plain equinox: RMSNorm, rotary attention (GQA),
SwiGLU MLP (`fp8jax.nn.FusedMLP`) or a top-k MoE (`fp8jax.nn.MoE`, grouped experts),
layers stacked and run with ``jax.lax.scan``. Vocabulary ``ModelConfig.vocab`` (256: bytes). FP8 is
applied from outside with `fp8jax.fp8_linear_layers`, like a user would; the MoE's
grouped experts carry their own FP8 state (``ModelConfig.moe_fp8``)."""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._guard import enter_tree
from .._ops.dot import INPUT_RESIDUAL
from .._state import OverwriteWithGradient
from ..distributed import sequence_sharding
from ..nn._attention import DotProductAttention
from ..nn._linear import apply_linear
from ..nn._mha import rotary
from ..nn._mlp import FusedMLP, normalize
from ..nn._moe import MoE as GroupedMoE
from ..nn._remat import remat_policy

VOCAB = 256  # bytes: the data pipeline's tokens and the default vocabulary
LLAMA3_VOCAB = 128256  # LLaMA-3's tokenizer (the 8b preset's vocabulary size)
# ``--remat``: what the backward keeps of each block (`remat_block`).
REMAT = ("none", "lean", "fc1-fp8", "fp8", "fp8-store", "fp8-min", "full")
# The choices that keep fc1's output in FP8 (`FusedMLP.fc1_out_fp8`).
FC1_OUT_FP8 = ("fc1-fp8", "fp8-store")
# The choices that keep no FP8 copy of a norm's output (`Attention.__call__`'s and
# `FusedMLP`'s ``recompute_input``): the norm and its cast run again in the backward.
RECOMPUTE_INPUT = ("lean", "fc1-fp8")
# ``--remat auto`` (the trainer's default): the first of `AUTO_ORDER`, in order, whose compiled
# step fits the device's memory (`fp8jax.train._memory.choose_remat`); the model is built with
# ``"none"`` and rebuilt only where that does not fit. Only the choices that keep the math:
# `FC1_OUT_FP8`'s round what the activation's backward reads (``fp8-store``, 300 steps of the
# 1b preset: validation loss within 0.35% of ``none``'s), so they are the user's choice.
AUTO = "auto"
AUTO_ORDER = ("none", "lean", "fp8", "fp8-min", "full")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The trainer's transformer: pre-norm blocks of grouped-query attention with rotary
    embeddings and a SwiGLU MLP (or an MoE), a byte-level vocabulary by default.

    Arguments:
        dim, layers, heads, kv_heads, ffn, seq: width, depth, query and key/value heads,
            the MLP's inner size, the context length.
        experts, top_k: 0 (a dense MLP) or the MoE's experts, and experts per token.
        moe_fp8: the experts' grouped GEMMs in FP8.
        aux_loss_coef: the MoE load-balancing loss weight.
        rope_base: the rotary embedding's base.
        attention: ``"bf16"`` or ``"fp8_dpa"`` (FP8 attention).
        scan_unroll: layers per scan iteration (same math).
        vocab: embedding rows and logits (>= 256, the byte tokens; >= a tokenizer's size).
    """

    dim: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    ffn: int = 384
    seq: int = 128
    experts: int = 0  # 0: dense SwiGLU MLP; >0: MoE with this many experts
    top_k: int = 2
    moe_fp8: bool = False  # the MoE's grouped expert GEMMs in FP8 (set for the fp8 run)
    aux_loss_coef: float = 0.01  # load-balancing loss weight (Switch Transformer's default)
    rope_base: float = 10000.0
    attention: str = "bf16"  # or "fp8_dpa": `fp8jax.nn.DotProductAttention` (cuDNN FP8 on Hopper)
    scan_unroll: int = 1  # layers per scan iteration (`jax.lax.scan(unroll=...)`); same math
    # Embedding rows and logits. Byte data (ids < 256) trains at any size >= 256, a tokenizer's
    # (`fp8jax.train._tokenizer`) at any size >= its own; a larger vocabulary than the data's
    # costs what a real tokenizer's would (embedding, head GEMMs, softmax).
    vocab: int = VOCAB

    def __post_init__(self):
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"dim ({self.dim}) must divide by heads ({self.heads}) and heads by kv_heads "
                f"({self.kv_heads})"
            )
        if self.attention not in ("bf16", "fp8_dpa"):
            raise ValueError(f"attention must be 'bf16' or 'fp8_dpa', got {self.attention!r}")
        if self.vocab < VOCAB:
            raise ValueError(f"vocab={self.vocab} must be >= {VOCAB} (the byte tokens)")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, experts={self.experts}]")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def non_embedding_params(self) -> int:
        kv = self.kv_heads * self.head_dim
        attn = self.dim * (self.dim + 2 * kv) + self.dim * self.dim
        mlp = 3 * self.dim * self.ffn * max(1, self.experts)
        return self.layers * (attn + mlp + 2 * self.dim)

    def flops_per_token(self) -> float:
        """Training FLOPs per token (6N for the GEMMs of active params + attention),
        as in the PaLM MFU definition (causal attention counted in full)."""
        kv = self.kv_heads * self.head_dim
        active_mlp = 3 * self.dim * self.ffn * (self.top_k if self.experts else 1)
        dense = self.layers * (self.dim * (self.dim + 2 * kv) + self.dim * self.dim + active_mlp)
        dense += self.dim * self.vocab
        return 6 * dense + 12 * self.layers * self.dim * self.seq


class Attention(eqx.Module):
    norm: Float[Array, " dim"]
    # One projection for q, k and v (one FP8 cast and transpose of its input, not three),
    # its outputs grouped per KV head (`split_qkv`).
    qkv: eqx.nn.Linear
    o: eqx.nn.Linear
    core: DotProductAttention | None  # FP8 attention with its state, or None (bf16 cuDNN/XLA)
    cfg: ModelConfig = eqx.field(static=True)

    def __init__(self, cfg: ModelConfig, *, key: PRNGKeyArray):
        kqkv, ko = jax.random.split(key)
        self.core = (
            None if cfg.attention == "bf16" else DotProductAttention(cfg.attention, is_causal=True)
        )
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.norm = jnp.ones((cfg.dim,))
        self.qkv = eqx.nn.Linear(cfg.dim, cfg.dim + 2 * kv_dim, use_bias=False, key=kqkv)
        self.o = eqx.nn.Linear(cfg.dim, cfg.dim, use_bias=False, key=ko)
        self.o = eqx.tree_at(
            lambda lin: lin.weight, self.o, self.o.weight / math.sqrt(2 * cfg.layers)
        )
        self.cfg = cfg

    def __call__(
        self, x: Float[Array, "B T C"], recompute_input: bool = False
    ) -> Float[Array, "B T C"]:
        """``recompute_input``: keep no copy of the norm's output (FP8 in the fp8 run) for
        qkv's weight gradient; the norm and the cast run again in the backward from ``x``,
        which the norm keeps anyway (`RECOMPUTE_INPUT`)."""
        cfg = self.cfg
        b, t, _ = x.shape
        project = _norm_qkv
        if recompute_input:
            project = eqx.filter_checkpoint(project, policy=_WEIGHTS_ONLY)
        q, k, v = split_qkv(project(self.norm, self.qkv, x), cfg)
        q, k = rotary(q, cfg.rope_base), rotary(k, cfg.rope_base)
        if self.core is not None:
            attn = self.core(q, k, v)
        else:
            attn = jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation=_attention_impl(q)
            )
        return x + apply_linear(self.o, gemm_input(self.o, attn.reshape(b, t, cfg.dim)))


# `RECOMPUTE_INPUT`'s qkv region keeps the FP8 weight copies and scalars only: the norm and
# the input's cast run again.
_WEIGHTS_ONLY = remat_policy(keep_inputs=False, keep_fc1_out=False)


def _norm_qkv(norm, qkv, x):
    """The qkv projection of the normed ``x``: `Attention`'s region under ``recompute_input``."""
    h = normalize(x, norm, None, "rmsnorm", 1e-5)
    return apply_linear(qkv, gemm_input(qkv, h))


def gemm_input(layer, x):
    """``x``, the input of ``layer``'s GEMM, named as fp8jax's op names an FP8 GEMM's input
    copy (`fp8jax.remat_policy` saves it) where ``layer`` is a bf16 ``eqx.nn.Linear``: under
    ``--remat fp8`` the bf16 run then keeps what its GEMMs read, in bf16, as the fp8 run keeps
    their FP8 copies. An FP8 layer's op names its own copy (the bf16 input is not kept)."""
    return checkpoint_name(x, INPUT_RESIDUAL) if isinstance(layer, eqx.nn.Linear) else x


def split_qkv(y: Float[Array, "B T F"], cfg: ModelConfig):
    """q ``[B, T, heads, hd]``, k and v ``[B, T, kv_heads, hd]`` from the qkv projection.
    Its outputs are grouped per KV head (that head's ``heads / kv_heads`` queries, its key,
    its value: Megatron's GQA layout), so a column split over a tensor axis that divides
    ``kv_heads`` gives each device whole groups and attention needs no reshuffle. Query
    heads come out group-major, as GQA pairs them with KV heads."""
    b, t, _ = y.shape
    group = cfg.heads // cfg.kv_heads
    y = y.reshape(b, t, cfg.kv_heads, group + 2, cfg.head_dim)
    q = y[:, :, :, :group].reshape(b, t, cfg.heads, cfg.head_dim)
    return q, y[:, :, :, group], y[:, :, :, group + 1]


def _attention_impl(q) -> str | None:
    """cuDNN flash attention on GPU for bf16/fp16 and supported head dims, else XLA."""
    ok = q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] in (64, 128)
    return "cudnn" if ok and jax.devices()[0].platform == "gpu" else None


class MoE(eqx.Module):
    """Pre-norm top-k MoE feed-forward block: RMSNorm, then `fp8jax.nn.MoE` (softmax
    router, renormalized top-k weights, dropless, SwiGLU experts run as grouped GEMMs)
    with the residual added. Returns the load-balancing loss beside the output."""

    norm: Float[Array, " dim"]
    moe: GroupedMoE

    def __init__(self, cfg: ModelConfig, *, key: PRNGKeyArray):
        self.norm = jnp.ones((cfg.dim,))
        self.moe = GroupedMoE(
            cfg.dim,
            cfg.ffn,
            cfg.experts,
            top_k=cfg.top_k,
            activation="swiglu",
            fp8=cfg.moe_fp8,
            key=key,
        )

    def __call__(self, x):
        h = normalize(x, self.norm, None, "rmsnorm", 1e-5)
        y, info = self.moe(h)
        return x + y.astype(x.dtype), info.load_balancing_loss


def _gate_block(ffn: int) -> int | None:
    """fc1's gate/up interleaving (`FusedMLP.gate_block`): the largest block (128 down to 1)
    that splits into whole pairs over up to 8 tensor shards. 128, the block-wise recipe's
    block, keeps gate and up rows in separate 128 x 128 weight scales and 1 x 128 gradient
    tiles (with 64 each held both). A function of ``ffn`` alone, so that checkpoints move
    between meshes and recipes."""
    return next((b for b in (128, 64, 32, 16, 8, 4, 2, 1) if ffn % (8 * b) == 0), None)


class Block(eqx.Module):
    attn: Attention
    mlp: FusedMLP | MoE

    def __init__(self, cfg: ModelConfig, *, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        self.attn = Attention(cfg, key=ka)
        if cfg.experts:
            self.mlp = MoE(cfg, key=km)
        else:
            mlp = FusedMLP(
                cfg.dim,
                cfg.ffn,
                activation="swiglu",
                norm="rmsnorm",
                residual=True,
                fp8=False,
                gate_block=_gate_block(cfg.ffn),
                key=km,
            )
            self.mlp = eqx.tree_at(
                lambda m: m.fc2.weight, mlp, mlp.fc2.weight / math.sqrt(2 * cfg.layers)
            )

    def __call__(self, x, recompute_input: bool = False):
        """``(x_out, auxiliary loss)``: the MoE's load-balancing loss, 0 for a dense MLP.
        ``recompute_input``: the attention's (`Attention.__call__`); the MLP's is its own
        field (`FusedMLP.recompute_input`)."""
        x = self.attn(x, recompute_input)
        if isinstance(self.mlp, MoE):
            return self.mlp(x)
        return self.mlp(x), jnp.zeros((), jnp.float32)


def _check_remat(remat: str) -> None:
    if remat not in REMAT:
        raise ValueError(f"remat must be one of {REMAT}, got {remat!r}")


def remat_block(block, remat: str):
    """``block`` (a function of a block's arrays and its input) under ``jax.checkpoint`` as
    ``remat`` (`REMAT`) says: ``"none"``, as it is (the backward keeps what it reads);
    ``"lean"``, as it is too, but no copy of a norm's output is kept (FP8 in the fp8 run): the
    qkv projection's and the MLP's norm and cast run again in the backward from the block's
    input and the residual, which the norms keep anyway (`RECOMPUTE_INPUT`: small regions,
    set by `Transformer.forward`; the same bits); ``"fc1-fp8"``, ``"lean"`` with the gated
    MLP's fc1 output kept in FP8 (`Transformer.forward` sets `FusedMLP.fc1_out_fp8`, as for
    ``"fp8-store"``); ``"fp8"``, `fp8jax.remat_policy`: the FP8 GEMMs' input copies,
    weights and scales, the bf16 attention projections' inputs (`gemm_input`: the bf16 run
    keeps in bf16 what the fp8 run keeps in FP8; a bf16 `FusedMLP` keeps its fc1 output
    only, as it does anyway) and the MLP's fc1 output are kept; the norms, rotary embedding,
    attention and activations are recomputed, and so is each GEMM whose output a recomputed
    op reads (qkv, o); ``"fp8-store"``, the same with fc1's output kept in FP8 in the fp8 run
    (`FusedMLP.fc1_out_fp8`, set by `Transformer.forward`: half its bytes, no GEMM run again;
    the backward reads it rounded to e4m3, so the gradients differ slightly); ``"fp8-min"``,
    ``"fp8"`` but fc1's output, whose GEMM runs again too (``remat_policy(keep_fc1_out=False)``);
    ``"full"``, nothing is kept but the block's input. The values, and but for ``"fc1-fp8"``
    and ``"fp8-store"`` the gradients, are those of ``"none"``. The MoE's grouped GEMMs name
    no residual: under ``"fp8"`` they run again too."""
    _check_remat(remat)
    if remat in ("none", "lean", "fc1-fp8"):
        return block
    # prevent_cse stays on (JAX's default; JAX allows it off inside a scan's loop): the GPU
    # presets unroll the layer scan, where XLA could merge the recomputation into the forward.
    keep_fc1_out = {"fp8": True, "fp8-store": True, "fp8-min": False}
    policy = remat_policy(keep_fc1_out=keep_fc1_out[remat]) if remat in keep_fc1_out else None
    return jax.checkpoint(block, policy=policy)


@eqx.filter_jit
def _init_blocks(cfg: ModelConfig, keys) -> "Block":
    """The stacked blocks, initialised in one compiled program, without the full-size
    temporaries (random bits, unscaled draws) eager `eqx.filter_vmap` holds op by op (8b:
    device 0 peaked at 55 GB building a 31 GB model; benchmarks/RESULTS.md, twenty-fifth
    session). The same values as eager, but for the MoE router's normal draws, which XLA's
    fusion rounds differently in the last bit (about 3e-8)."""
    return eqx.filter_vmap(lambda k: Block(cfg, key=k))(keys)


class Transformer(eqx.Module):
    embed: Float[Array, "vocab dim"]
    blocks: Block  # stacked: every array has a leading [layers] dim
    norm: Float[Array, " dim"]
    head: eqx.nn.Linear
    cfg: ModelConfig = eqx.field(static=True)
    # Sequence parallelism: (mesh, batch axes, tensor axis) splitting the residual stream's
    # tokens between the blocks (`fp8jax.train._mesh.place_model`), or None.
    token_split: tuple | None = eqx.field(static=True)
    remat: str = eqx.field(static=True)  # `REMAT`: what the backward keeps (`remat_block`)

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        key: PRNGKeyArray | None = None,
        token_split: tuple | None = None,
        parts: tuple | None = None,
        remat: str = "none",
    ):
        """``parts``: ``(embed, blocks, norm, head)`` to use as they are instead of
        initialising them from ``key``.

        Arguments:
            cfg: the `ModelConfig`.
            key: initialises the parameters (needed without ``parts``).
            token_split: sequence parallelism's (mesh, batch axes, tensor axis), or None.
            parts: the parameters to use as they are instead.
            remat: what the backward keeps of each block (`remat_block`; ``--remat``).
        """
        _check_remat(remat)
        if parts is None:
            if key is None:
                raise TypeError("Transformer: pass key= (to initialise the weights) or parts=.")
            ke, kb, kh = jax.random.split(key, 3)
            parts = (
                jax.random.normal(ke, (cfg.vocab, cfg.dim)) * 0.02,
                _init_blocks(cfg, jax.random.split(kb, cfg.layers)),
                jnp.ones((cfg.dim,)),
                eqx.nn.Linear(cfg.dim, cfg.vocab, use_bias=False, key=kh),
            )
        self.embed, self.blocks, self.norm, self.head = parts
        self.cfg = cfg
        self.token_split = token_split
        self.remat = remat

    def with_token_split(self, token_split: tuple | None) -> "Transformer":
        """The same model (shared arrays) splitting its tokens by ``token_split``."""
        parts = (self.embed, self.blocks, self.norm, self.head)
        return type(self)(self.cfg, token_split=token_split, parts=parts, remat=self.remat)

    def with_remat(self, remat: str) -> "Transformer":
        """The same model (shared arrays) keeping what ``remat`` says for the backward
        (``--remat auto`` tries one choice after another on the trainer's partitioned model)."""
        parts = (self.embed, self.blocks, self.norm, self.head)
        return type(self)(self.cfg, token_split=self.token_split, parts=parts, remat=remat)

    def __call__(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T vocab"]:
        return self.forward(tokens)[0]

    def _split_tokens(self, x):
        if self.token_split is None:
            return x
        mesh, batch, axis = self.token_split
        return jax.lax.with_sharding_constraint(x, sequence_sharding(mesh, x.shape, batch, axis))

    def forward(
        self, tokens: Int[Array, "B T"], logits_dtype=jnp.float32
    ) -> tuple[Float[Array, "B T vocab"], Float[Array, ""]]:
        """Logits (in ``logits_dtype``; None: the head's compute dtype, what
        `fp8jax.nn.cross_entropy` wants) and the auxiliary loss summed over layers (MoE load
        balancing, already weighted by ``aux_loss_coef``; 0 without experts)."""
        x = self._split_tokens(self.embed[tokens])
        # The stacked FP8 state enters once, outside the scan, instead of once per layer
        # inside it: its float32 -> MAX_GRAD conversion and the backward's keep-or-replace
        # select then run on [layers, ...] arrays: fewer HLO instructions and a shorter
        # compile (issue 21; benchmarks/RESULTS.md, fourteenth session, "Two changes").
        blocks = self.blocks
        if self.remat in FC1_OUT_FP8:
            blocks = _fc1_out_fp8(blocks)
        if self.remat in RECOMPUTE_INPUT:
            blocks = _recompute_input(blocks)
        params, static = eqx.partition(enter_tree(blocks), eqx.is_array)
        lean = self.remat in RECOMPUTE_INPUT
        block = remat_block(lambda p, x: eqx.combine(p, static)(x, lean), self.remat)

        def layer(carry, p):
            x, aux = carry
            x, layer_aux = block(p, x)
            return (self._split_tokens(x), aux + layer_aux.astype(jnp.float32)), None

        (x, aux), _ = jax.lax.scan(
            layer, (x, jnp.zeros((), jnp.float32)), params, unroll=self.cfg.scan_unroll
        )
        x = normalize(x, self.norm, None, "rmsnorm", 1e-5)
        logits = apply_linear(self.head, x)
        if logits_dtype is not None:
            logits = logits.astype(logits_dtype)
        return logits, self.cfg.aux_loss_coef * aux


def _recompute_input(blocks):
    """``blocks`` whose `FusedMLP` keeps no copy of its norm's output (``--remat lean`` or
    ``fc1-fp8``: `RECOMPUTE_INPUT`; `Block.__call__` tells the attention)."""
    if not isinstance(blocks.mlp, FusedMLP):
        return blocks
    return eqx.tree_at(lambda b: b.mlp, blocks, blocks.mlp.with_recompute_input(True))


def _fc1_out_fp8(blocks):
    """``blocks`` whose `FusedMLP` keeps fc1's output in FP8 for the backward (``--remat
    fc1-fp8`` or ``fp8-store``; it does where its linears are FP8: the fp8 run)."""
    if not isinstance(blocks.mlp, FusedMLP):
        return blocks
    return eqx.tree_at(lambda b: b.mlp, blocks, blocks.mlp.with_fc1_out_fp8(True))


def cast_for_compute(model, dtype):
    """Floating parameters in ``dtype`` for the forward (f32 master copies stay in the
    optimizer); FP8 scaling state is left in float32."""

    def cast(x):
        if isinstance(x, OverwriteWithGradient):
            return x
        if eqx.is_inexact_array(x):
            return x.astype(dtype)
        return x

    return jax.tree_util.tree_map(
        cast, model, is_leaf=lambda x: isinstance(x, OverwriteWithGradient)
    )
