"""Presets and the run configuration of ``fp8jax-train``: what to train (model shape,
batch, schedule, FP8 options), and the model and optimizer built from it."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from .._config import Fp8Config
from .._convert import fp8_linear_layers
from ._mesh import build_placed
from ._model import AUTO, LLAMA3_VOCAB, ModelConfig, Transformer

PRESETS = {
    # CPU: a few minutes on 2 cores for both precisions. FP8 everywhere (the size
    # policy would skip layers this small, leaving nothing to compare).
    "tiny": dict(
        model=ModelConfig(dim=128, layers=2, heads=4, kv_heads=4, ffn=384, seq=128),
        batch=16,
        steps=300,
        lr=3e-3,
        warmup=30,
        eval_every=50,
        checkpoint_every=100,
        selective=False,
    ),
    "350m": dict(
        model=ModelConfig(
            dim=1024, layers=24, heads=8, kv_heads=8, ffn=3072, seq=2048, scan_unroll=24
        ),
        batch=8,
        steps=1000,
        lr=6e-4,
        warmup=100,
        eval_every=100,
        checkpoint_every=500,
        selective=True,
    ),
    # GPU presets unroll the layer scan fully: this removes the scan's residual stacking,
    # making both precisions' steps faster and FP8's ratio larger. 1b runs FP8 on every block
    # linear: at 16384 tokens per step the 2048-wide attention projections gain in FP8 too
    # (benchmarks/RESULTS.md, "Where the 1b step goes", 2026-11-23 fourth session).
    "1b": dict(
        model=ModelConfig(
            dim=2048, layers=16, heads=16, kv_heads=8, ffn=8192, seq=2048, scan_unroll=16
        ),
        batch=8,
        steps=1000,
        lr=3e-4,
        warmup=100,
        eval_every=100,
        checkpoint_every=500,
        selective=False,
    ),
    # LLaMA-3-8B: dim 4096, 32 layers, ffn 14336, GQA 32/8 heads, rope base 5e5 and its
    # 128,256-entry vocabulary (the embedding and head are 1.05B of the 8.0B parameters; byte
    # tokens use the first 256 rows, --tokenizer bpe all). A multi-GPU config (4x H200: --mesh
    # fsdp=4).
    # The layer scan is unrolled as on the other GPU presets: rolled, the FSDP step of both
    # precisions ran slower, bf16's by far the most (benchmarks/RESULTS.md, twenty-fifth
    # session, "The 8b preset unrolled"); it compiles in about a minute.
    "8b": dict(
        model=ModelConfig(
            dim=4096,
            layers=32,
            heads=32,
            kv_heads=8,
            ffn=14336,
            seq=4096,
            rope_base=500000.0,
            vocab=LLAMA3_VOCAB,
            scan_unroll=32,
        ),
        batch=16,
        steps=1000,
        lr=3e-4,
        warmup=100,
        eval_every=100,
        checkpoint_every=500,
        selective=False,
    ),
}


@dataclasses.dataclass
class RunConfig:
    """One training run: the model, the batch (global, over all devices), the schedule.
    `PRESETS` holds the named ones; ``fp8jax-train``'s options override their fields.

    Arguments:
        model: the `ModelConfig`.
        batch: sequences per step, over all devices.
        steps, lr, warmup: the schedule (AdamW, linear warmup then cosine decay).
        eval_every, checkpoint_every: in steps (0: never checkpoint).
        selective: `Fp8Config.selective` for the fp8 run.
        eval_batches: batches per evaluation.
        seed: the model's and the data's seed.
        scaling, recipe, fast_accumulation, cast_kernel: the `Fp8Config` fields.
        fp8_attention, fp8_head: also run attention / the LM head in FP8 (fp8 run).
        sequence_parallel: Megatron sequence parallelism over the mesh's tensor axis.
        tp_overlap: with it, ``"none"`` (each token collective whole), ``"ring"`` or
            ``"chunks"`` (collective matmul: `fp8jax._ops.tp_ring`).
        tokenizer, tokenizer_vocab, tokenizer_sha256: the data's tokens (``--tokenizer``):
            ``"bytes"``, ``"bpe"`` or ``"file"`` (a user's tokenizer.json), its vocabulary
            and its tokenizer.json's hash (None: bytes, or a BPE not trained yet).
        remat: what the backward keeps of each block, ``"none"``, ``"fc1-fp8"``, ``"fp8"``,
            ``"fp8-store"``, ``"fp8-min"`` or ``"full"`` (`fp8jax.train._model.remat_block`;
            the same values and, but for the FP8 copy of fc1's output that ``"fc1-fp8"`` and
            ``"fp8-store"`` keep, gradients),
            or ``"auto"`` (``fp8jax-train``'s default): the first of them whose step fits the
            device's memory (`fp8jax.train._memory.choose_remat`; `TrainRun` chooses).
    """

    model: ModelConfig
    batch: int
    steps: int
    lr: float
    warmup: int
    eval_every: int
    checkpoint_every: int
    selective: bool
    eval_batches: int = 8
    seed: int = 0
    scaling: str = "delayed"
    recipe: str = "tensor"  # Fp8Config.recipe: "tensor", "rowwise" or "blockwise"
    fast_accumulation: str = "forward"  # Fp8Config.fast_accumulation
    cast_kernel: bool = True  # Fp8Config.cast_kernel: one-pass Pallas cast + transpose + amax
    fp8_attention: bool = False  # the fp8 run also runs attention in FP8
    fp8_head: bool = False  # the fp8 run also runs the LM head's GEMMs in FP8
    sequence_parallel: bool = False  # Megatron sequence parallelism over the mesh's tensor axis
    tp_overlap: str = "none"  # ``--tp-overlap``: "none", "ring" or "chunks" (collective matmul)
    tokenizer: str = "bytes"  # `tokenizer.BYTES`, `BPE` or `USER`
    tokenizer_vocab: int | None = 256
    tokenizer_sha256: str | None = None
    remat: str = "auto"  # ``--remat``: one of `_model.REMAT` (`_model.remat_block`), or "auto"


def fp8_config(run: RunConfig) -> Fp8Config:
    """FP8 for the linears inside the blocks; embedding and LM head stay bf16 (as in TE)
    unless ``run.fp8_head``: the head is the one linear whose output is the loss's input, and
    at a 128k vocabulary also the largest GEMM (1.05B parameters at 8b)."""
    return Fp8Config(
        scaling=run.scaling,
        recipe=run.recipe,
        selective=run.selective,
        fast_accumulation=run.fast_accumulation,
        cast_kernel=run.cast_kernel,
        targets=r"blocks\..*|head" if run.fp8_head else r"blocks\..*",
        on_unsupported="silent",
    )


def build_model(run: RunConfig, precision: str, mesh=None):
    """The run's transformer, converted to FP8 for ``precision == "fp8"``; same weights
    (same seed) in both precisions. With ``mesh``: made already placed on it as the trainer
    places it, each device computing only its own shards (`fp8jax.train._mesh.build_placed`;
    the model is never whole on one device)."""
    if mesh is not None:
        build = functools.partial(build_model, run, precision)
        return build_placed(build, mesh, run.sequence_parallel, run.tp_overlap)
    cfg = run.model
    if precision == "fp8" and run.fp8_attention:
        # same weights: the FP8 core has no parameters
        cfg = dataclasses.replace(cfg, attention="fp8_dpa")
    if precision == "fp8" and cfg.experts:
        # same weights: FP8 state is extra, keys are unchanged
        cfg = dataclasses.replace(cfg, moe_fp8=True)
    # --remat auto: built as "none"; the trainer rebuilds the step where it does not fit
    remat = "none" if run.remat == AUTO else run.remat
    model = Transformer(cfg, key=jax.random.PRNGKey(run.seed), remat=remat)
    if precision == "fp8":
        model = fp8_linear_layers(model, fp8_config(run))
    return model


def make_optimizer(run: RunConfig) -> optax.GradientTransformation:
    """AdamW with warmup and cosine decay to a tenth, gradients clipped to norm 1."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        run.lr,
        max(run.warmup, 1),
        max(run.steps, run.warmup + 1),
        end_value=run.lr * 0.1,
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.0),
    )


def compute_dtype() -> jnp.dtype:
    return jnp.bfloat16
