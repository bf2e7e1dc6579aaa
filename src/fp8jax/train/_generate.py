"""``fp8jax-generate``: text from the trainer's LM, prefill + KV-cache decode.

    fp8jax-generate --run runs/tiny --prompt "def main("        # the newest checkpoint of a run
    fp8jax-generate --run runs/tiny --precision fp8 --inference fp8 --weight-scaling channel
    fp8jax-generate --preset tiny --new-tokens 64                 # a fresh (untrained) tiny model

The model's own classes and weights (`fp8jax.train._model`) run the blocks; only attention is
rewritten here, to read and write a fixed-size KV cache. ``--inference fp8`` serves the FP8
checkpoint through `fp8jax.to_inference` (e4m3 weights, FP8 GEMMs); ``bf16`` serves the
weights in bf16 (an FP8 checkpoint's linears lose their FP8 state). Prints the text, the
prefill tokens/s and the decode ms per step (one token for each of the batch's sequences).
The prompt is encoded and the text decoded with the run's tokenizer: bytes, or the
``tokenizer.json`` of a run trained with ``--tokenizer bpe`` or ``PATH.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._inference import INPUT_SCALES, WEIGHT_SCALINGS, cast_compute, to_inference
from ..nn._linear import Linear, apply_linear
from ..nn._mha import rotary
from ..nn._mlp import normalize
from . import _cli as cli
from ._checkpoint import stored_config
from ._model import VOCAB, ModelConfig, MoE, Transformer, split_qkv
from ._tokenizer import BYTES, FILE, USER, ByteTokenizer, kind_of
from ._tokenizer import load as load_tokenizer

F32 = jnp.float32


class KVCache(NamedTuple):
    """Keys and values of every layer, ``[layers, batch, max_len, kv_heads, head_dim]``."""

    k: jax.Array
    v: jax.Array


@dataclasses.dataclass(frozen=True)
class Sampling:
    """``temperature`` 0: greedy (argmax); else softmax sampling at that temperature from
    the ``top_k`` most likely tokens (0: all of them), among the first ``vocab`` ids only
    (the tokenizer's: a model's vocabulary may have rows its data never trained)."""

    temperature: float = 0.0
    top_k: int = 0
    vocab: int = VOCAB  # the tokenizer's size (default: the 256 bytes)

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature!r} is not allowed; expected >= 0.")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} is not allowed; expected an int >= 0.")
        if isinstance(self.vocab, bool) or not isinstance(self.vocab, int) or self.vocab < 1:
            raise ValueError(f"vocab={self.vocab!r} is not allowed; expected an int >= 1.")


@dataclasses.dataclass
class Generation:
    tokens: np.ndarray  # [batch, new_tokens] int32
    prefill_s: float  # the prompt's forward and the first sampled token
    decode_s: float  # the remaining new_tokens - 1 steps
    prompt_tokens: int  # batch * prompt length

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s

    @property
    def decode_ms_per_token(self) -> float | None:
        """Milliseconds per decode step (each step adds one token to every sequence)."""
        steps = self.tokens.shape[1] - 1
        return self.decode_s / steps * 1e3 if steps else None


# ----------------------------------------------------------------------------- model
def strip_fp8(model):
    """``model`` with every training FP8 linear (`fp8jax.nn.Linear`) back to its plain
    `eqx.nn.Linear` (same arrays, FP8 state dropped): the bf16 serving model."""

    def plain(x):
        return x.to_linear() if isinstance(x, Linear) else x

    return jax.tree_util.tree_map(plain, model, is_leaf=lambda x: isinstance(x, Linear))


def empty_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> KVCache:
    shape = (cfg.layers, batch, max_len, cfg.kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def _attend(attn, x, cache_k, cache_v, pos):
    """The model's `Attention` for ``x`` at positions ``pos ..``, through the cache: this
    call's keys and values written at ``pos``, the queries attending to every cached
    position up to their own. Returns ``(x + attention, cache_k, cache_v)``."""
    cfg = attn.cfg
    b, t, _ = x.shape
    h = normalize(x, attn.norm, None, "rmsnorm", 1e-5)
    q, k, v = split_qkv(apply_linear(attn.qkv, h), cfg)
    positions = pos + jnp.arange(t)
    q, k = rotary(q, cfg.rope_base, positions), rotary(k, cfg.rope_base, positions)
    cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), (0, pos, 0, 0))
    cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), (0, pos, 0, 0))
    visible = jnp.arange(cache_k.shape[1])[None, :] <= positions[:, None]  # [T, max_len]
    out = jax.nn.dot_product_attention(
        q, cache_k.astype(q.dtype), cache_v.astype(q.dtype), mask=visible[None, None]
    )
    return x + apply_linear(attn.o, out.reshape(b, t, cfg.dim)), cache_k, cache_v


def forward_cached(model: Transformer, tokens, cache: KVCache, pos):
    """Logits ``[B, T, vocab]`` (float32) of ``tokens [B, T]`` at positions ``pos .. pos+T-1``
    and the cache with their keys and values added; the blocks' MLPs are the model's own."""
    x = model.embed[tokens]
    params, static = eqx.partition(model.blocks, eqx.is_array)

    def layer(x, inputs):
        p, ck, cv = inputs
        block = eqx.combine(p, static)
        x, ck, cv = _attend(block.attn, x, ck, cv, pos)
        y = block.mlp(x)
        return (y[0] if isinstance(block.mlp, MoE) else y), (ck, cv)

    x, (k, v) = jax.lax.scan(layer, x, (params, cache.k, cache.v))
    x = normalize(x, model.norm, None, "rmsnorm", 1e-5)
    return apply_linear(model.head, x).astype(F32), KVCache(k, v)


def sample(logits, key, sampling: Sampling):
    """Next tokens ``[B]`` from ``logits [B, vocab]``, among the tokenizer's ids only
    (``sampling.vocab``: a larger vocabulary has rows the data never trains)."""
    logits = logits[:, : sampling.vocab]
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = jax.lax.top_k(logits, min(sampling.top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@eqx.filter_jit
def _prefill(model, prompt, key, max_len: int, sampling: Sampling):
    dtype = model.embed.dtype
    cache = empty_cache(model.cfg, prompt.shape[0], max_len, dtype)
    logits, cache = forward_cached(model, prompt, cache, 0)
    return sample(logits[:, -1], key, sampling), cache


@eqx.filter_jit
def _decode(model, token, cache, pos, key, steps: int, sampling: Sampling):
    def step(carry, key):
        token, cache, pos = carry
        logits, cache = forward_cached(model, token[:, None], cache, pos)
        nxt = sample(logits[:, -1], key, sampling)
        return (nxt, cache, pos + 1), nxt

    (_, cache, _), tokens = jax.lax.scan(step, (token, cache, pos), jax.random.split(key, steps))
    return tokens.T, cache


def generate(
    model: Transformer,
    prompt,
    new_tokens: int,
    *,
    sampling: Sampling = Sampling(),
    key=None,
    warmup: bool = True,
) -> Generation:
    """``new_tokens`` tokens after each row of ``prompt [B, P]`` (all rows one length):
    one jitted prefill of the prompt into a cache of ``P + new_tokens`` positions, then one
    jitted ``lax.scan`` of decode steps. ``model`` is used as given (cast it first: see
    `prepare`). ``warmup`` compiles both before timing them."""
    prompt = jnp.asarray(prompt, jnp.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(
            f"generate: prompt must be [batch, length >= 1] tokens, got {prompt.shape}"
        )
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(
            f"generate: new_tokens={new_tokens!r} is not allowed; expected an int >= 1."
        )
    key = jax.random.PRNGKey(0) if key is None else key
    max_len = prompt.shape[1] + new_tokens
    steps = new_tokens - 1
    k_prefill, k_decode = jax.random.split(key)

    def run():
        t0 = time.perf_counter()
        first, cache = jax.block_until_ready(_prefill(model, prompt, k_prefill, max_len, sampling))
        t1 = time.perf_counter()
        rest = jnp.zeros((prompt.shape[0], 0), jnp.int32)
        if steps:
            pos = jnp.asarray(prompt.shape[1], jnp.int32)
            rest, _ = jax.block_until_ready(
                _decode(model, first, cache, pos, k_decode, steps, sampling)
            )
        t2 = time.perf_counter()
        return jnp.concatenate([first[:, None], rest], axis=1), t1 - t0, t2 - t1

    if warmup:
        run()
    tokens, prefill_s, decode_s = run()
    return Generation(np.asarray(tokens), prefill_s, decode_s, int(prompt.size))


def prepare(
    model: Transformer,
    mode: str,
    *,
    weight_scaling: str = "tensor",
    input_scale: str = "frozen",
    dtype=jnp.bfloat16,
) -> Transformer:
    """The serving model: ``mode="bf16"`` (FP8 linears stripped, everything in ``dtype``) or
    ``"fp8"`` (`fp8jax.to_inference` with these options, the rest in ``dtype``)."""
    if mode == "bf16":
        return cast_compute(strip_fp8(model), dtype)
    if mode == "fp8":
        inference = to_inference(model, weight_scaling=weight_scaling, input_scale=input_scale)
        return cast_compute(inference, dtype)
    raise ValueError(f"mode={mode!r} is not allowed; expected 'bf16' or 'fp8'.")


# ----------------------------------------------------------------------------- checkpoints
def run_config_of(run_dir: Path, argv: list[str] | None = None):
    """The trainer's `RunConfig` of a run: from its ``metrics.json`` (the command it ran),
    else from ``argv`` (trainer options)."""
    meta_path = run_dir / "metrics.json"
    if argv is None and meta_path.exists():
        command = json.loads(meta_path.read_text())["meta"]["command"]
        argv = shlex.split(command)[1:]
    args = cli.parse_args(argv or [])
    own = run_dir / FILE  # a user's tokenizer as the run keeps it (the path may have moved)
    if kind_of(args.tokenizer) == USER and own.is_file():
        return cli.run_config(args, load_tokenizer(own))
    return cli.run_config(args)


def run_tokenizer(run_dir: Path, run, precision: str):
    """The tokenizer ``run`` trained with: bytes, or ``run_dir``'s `FILE` (checked against
    the hash ``precision``'s checkpoint recorded)."""
    if run.tokenizer == BYTES:
        return ByteTokenizer()
    if not (run_dir / FILE).is_file():
        raise FileNotFoundError(
            f"no {FILE} in {run_dir}: the run's tokenizer (it trained with --tokenizer "
            f"{'bpe' if run.tokenizer == 'bpe' else 'PATH.json'})"
        )
    tokenizer = load_tokenizer(run_dir / FILE, run.tokenizer)
    want = (stored_config(run_dir, precision) or {}).get("tokenizer_sha256")
    if want and want != tokenizer.sha256:
        raise ValueError(
            f"{run_dir / FILE} is not the tokenizer the {precision} checkpoint was trained with "
            f"(sha256 {tokenizer.sha256}, the checkpoint's {want})"
        )
    return tokenizer


def load_trained(run_dir: Path, precision: str, run) -> tuple[Transformer, int]:
    """The model of ``fp8jax-train``'s newest checkpoint under ``run_dir/ckpt-<precision>``
    (the trainer's layout, read only): float32 parameters (and FP8 state), step."""
    import orbax.checkpoint as ocp

    model = cli.build_model(run, precision)
    path = (run_dir / f"ckpt-{precision}").resolve()
    manager = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(create=False))
    step = manager.latest_step() if path.is_dir() else None
    if step is None:
        raise FileNotFoundError(f"no fp8jax-train checkpoint in {path}")
    params, static = eqx.partition(model, eqx.is_array)
    target = dict(params=jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, params))
    args = ocp.args.PyTreeRestore(
        item=target,
        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True,
    )  # the parameters only: the optimizer state stays on disk
    # "state": the trainer's checkpoints since they hold their history; "default" before
    item = "state" if (path / str(step) / "state").is_dir() else "default"
    restored = ocp.PyTreeCheckpointer().restore(path / str(step) / item, args=args)
    return eqx.combine(restored["params"], static), step


# ----------------------------------------------------------------------------- CLI
def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="fp8jax-generate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument(
        "--run",
        type=Path,
        default=None,
        help="an fp8jax-train --out directory (default: a fresh model of --preset)",
    )
    p.add_argument(
        "--precision",
        choices=["bf16", "fp8"],
        default=None,
        help="which checkpoint of --run (default: fp8 if it has one, else bf16)",
    )
    p.add_argument(
        "--inference",
        choices=["bf16", "fp8"],
        default=None,
        help="serve in bf16 or with FP8 inference weights (default: the precision)",
    )
    p.add_argument("--weight-scaling", choices=WEIGHT_SCALINGS, default="tensor")
    p.add_argument(
        "--input-scale",
        choices=INPUT_SCALES,
        default=None,
        help="FP8 activation scales (default: frozen for a trained run, else dynamic)",
    )
    p.add_argument("--preset", default="tiny", help="model preset without --run")
    p.add_argument(
        "--train-args",
        default=None,
        help="the run's fp8jax-train options, when --run has no metrics.json",
    )
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--batch", type=cli._at_least(1), default=1, help="sequences generated at once")
    p.add_argument(
        "--new-tokens", type=cli._at_least(1), default=128, help="tokens to generate (default 128)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature (default: %(default)s, greedy: the likeliest token)",
    )
    p.add_argument(
        "--top-k", type=cli._at_least(0), default=0, help="sample from the k likeliest (0: all)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Generation:
    args = parse_args(sys.argv[1:] if argv is None else argv)

    if args.run is not None:
        run = run_config_of(args.run, shlex.split(args.train_args) if args.train_args else None)
        precision = args.precision or ("fp8" if (args.run / "ckpt-fp8").is_dir() else "bf16")
        model, step = load_trained(args.run, precision, run)
        source = f"{args.run / f'ckpt-{precision}'} step {step}"
        tokenizer = run_tokenizer(args.run, run, precision)
    else:
        run = cli.run_config(cli.parse_args(["--preset", args.preset]))
        precision = args.precision or "fp8"
        model, source = cli.build_model(run, precision), f"fresh {args.preset} model"
        tokenizer = ByteTokenizer()
    sampling = Sampling(args.temperature, args.top_k, tokenizer.vocab_size)
    mode = args.inference or precision
    if mode == "fp8" and precision != "fp8":
        raise ValueError("--inference fp8 needs an FP8 model (--precision fp8)")
    input_scale = args.input_scale or ("frozen" if args.run is not None else "dynamic")
    served = prepare(model, mode, weight_scaling=args.weight_scaling, input_scale=input_scale)
    prompt = np.tile(tokenizer.encode(args.prompt)[None], (args.batch, 1))
    out = generate(
        served, prompt, args.new_tokens, sampling=sampling, key=jax.random.PRNGKey(args.seed)
    )
    detail = f"{args.weight_scaling} weights, {input_scale} inputs" if mode == "fp8" else "bf16"
    print(f"fp8jax-generate: {source}, served {mode} ({detail}) on {jax.devices()[0].device_kind}")
    for row in out.tokens:
        text = tokenizer.decode(row)
        print("-" * 40 + f"\n{args.prompt}{text}")
    decode = out.decode_ms_per_token
    print(
        "-" * 40
        + f"\nprefill {out.prefill_tokens_per_s:,.0f} tokens/s"
        + ("" if decode is None else f", decode {decode:.2f} ms/token (batch {args.batch})")
    )
    return out


def console_main() -> int:
    """``fp8jax-generate``'s entry point."""
    main()
    return 0


if __name__ == "__main__":
    main()
