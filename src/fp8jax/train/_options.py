"""The command-line options of ``fp8jax-train`` (`build_parser`), each with its default
in ``--help``."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import _compilation as compilation
from .._ops.tp_ring import OVERLAPS
from .._recipe import RECIPES
from ._config import PRESETS
from ._model import AUTO, REMAT
from ._tokenizer import BPE_VOCAB, FILE, INSTALL


def _at_least(low: int):
    """An argparse type: an int >= ``low`` (argparse names the option in its error)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is not allowed; expected an int >= {low}")
        return value

    parse.__name__ = "int"
    return parse


def _positive(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is not allowed; expected a number > 0")
    return value


def _preset_default(key: str) -> str:
    """``default: the preset's (tiny 300, 350m 1000, ...)`` for a preset's ``key``."""
    key = key.replace("-", "_")
    values = [
        f"{name} {p[key] if key in p else getattr(p['model'], key)}" for name, p in PRESETS.items()
    ]
    return f"default: the preset's ({', '.join(values)})"


def millions(count: int) -> str:
    """A parameter count in millions, with a decimal below 10M (0.4M, not 0M)."""
    m = count / 1e6
    return f"{m:.0f}M" if m >= 10 else f"{m:.1f}M" if m >= 0.1 else f"{m:.2g}M"


def build_parser(doc: str) -> argparse.ArgumentParser:
    """``fp8jax-train``'s options (``doc``: the command's docstring, for --help)."""
    p = argparse.ArgumentParser(
        prog="fp8jax-train",
        description=doc.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=doc,
    )
    add = p.add_argument
    add(
        "--preset",
        choices=sorted(PRESETS),
        default="tiny",
        help="model size and schedule (default: %(default)s, CPU-sized)",
    )
    add(
        "--precision",
        choices=["bf16", "fp8"],
        default=None,
        help="train one precision (default: --compare both)",
    )
    add("--compare", action="store_true", help="bf16 then fp8, same seed and data order (default)")
    add(
        "--interleave",
        type=int,
        default=0,
        metavar="K",
        help="with --compare: train both in one process, K steps of each in turn, so both are "
        "timed on the same GPU state (a GPU at its power cap runs slower than a cool one); "
        "needs memory for both models",
    )
    add("--data", default=None, help="text file or directory (default: the Python stdlib sources)")
    add(
        "--tokenizer",
        default="bytes",
        metavar="bytes|bpe|PATH.json",
        help="the data's tokens: bytes (the default: ids 0..255); bpe: a byte-level BPE of "
        f"--vocab tokens (left out: the preset's if larger than 256, else {BPE_VOCAB}) trained "
        f"on the corpus's training split and kept as --out/{FILE} (--resume and "
        "fp8jax-generate use it); or PATH.json, your tokenizers tokenizer (--vocab left out: "
        "its size rounded up to a multiple of 128). The corpus's ids are cached in --out "
        f"(tokens-<hash>.npz). bpe and PATH.json need {INSTALL}",
    )
    add("--out", type=Path, default=None, help="output directory (default runs/<preset>)")
    add(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --out (model options must be the run's)",
    )
    add(
        "--overwrite",
        action="store_true",
        help="a fresh run into a non-empty --out that is not a run of this trainer (only the "
        "trainer's own files there are replaced)",
    )
    for name, typ, what in (
        ("steps", _at_least(1), "training steps"),
        ("batch", _at_least(1), "sequences per step (global, over all devices)"),
        ("lr", _positive, "peak learning rate (AdamW, warmup then cosine decay to a tenth)"),
        ("warmup", _at_least(0), "learning-rate warmup steps"),
        ("eval-every", _at_least(1), "validation loss every N steps (and at the last)"),
        ("checkpoint-every", _at_least(0), "checkpoint every N steps (0: none, not at the end)"),
    ):
        add(f"--{name}", type=typ, default=None, help=f"{what}; {_preset_default(name)}")
    add("--eval-batches", type=_at_least(1), default=None, help="validation batches (default 8)")
    add("--seed", type=int, default=None, help="weights and data order (default 0)")
    for name, what in (
        ("dim", "model width"),
        ("layers", "transformer blocks"),
        ("heads", "attention heads"),
        ("kv-heads", "key/value heads (GQA)"),
        ("ffn", "MLP hidden width"),
        ("seq", "tokens per training sequence (bytes with --tokenizer bytes)"),
        ("experts", "MoE experts per block (0: a dense MLP)"),
        ("top-k", "MoE experts per token"),
        ("vocab", "embedding rows and logits (>= 256 and the tokenizer's size); BPE's size"),
    ):
        add(f"--{name}", type=_at_least(1), default=None, help=f"{what}; {_preset_default(name)}")
    add(
        "--scaling",
        choices=["delayed", "current"],
        default="delayed",
        help="FP8 scales from the amax history or from this step's tensor (default: %(default)s)",
    )
    add(
        "--recipe",
        choices=list(RECIPES),
        default="tensor",
        help="FP8 scaling granularity: per tensor, per row, or DeepSeek-V3 1x128/128x128 blocks",
    )
    add(
        "--fast-accumulation",
        choices=["forward", "all", "none"],
        default="forward",
        help="FP8 GEMMs allowed Hopper's fast accumulation (default: forward only, as TE)",
    )
    add(
        "--cast-kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="FP8 casts through the one-pass Pallas cast + transpose + amax kernel (Hopper; "
        "the default; --no-cast-kernel: XLA's fused casts)",
    )
    add(
        "--scan-unroll",
        type=_at_least(1),
        default=None,
        help="layers per scan iteration; = --layers unrolls fully (no residual stacking between "
        "layers)",
    )
    add(
        "--remat",
        choices=[AUTO, *REMAT],
        default=AUTO,
        help="what the backward keeps of each block (jax.checkpoint): auto (the default: the "
        "first of none, lean, fp8, fp8-min, full whose compiled step fits the "
        "GPU's memory limit less 5%%, said in one line with each try's bytes; none where no "
        "limit is known, as on a CPU); none (all it reads: the fastest where it fits); lean (none, "
        "but no copy of a norm's output: the qkv projection's and the MLP's norm and FP8 cast "
        "run again in the backward; the same bits); fc1-fp8 "
        "(lean, and the MLP's fc1 output kept as e4m3 + one scale in the fp8 run: half its "
        "bytes for a cast in the forward, nothing run again; the backward reads it rounded); fp8 "
        "(fp8jax.remat_policy: the GEMMs' input copies, FP8 in the fp8 run and bf16 in the bf16 "
        "run, and the MLP's fc1 output; norms, attention, activations and the "
        "qkv and o GEMMs run again in the backward); fp8-store (fp8 with fc1's output kept as "
        "e4m3 + one scale in the fp8 run, bf16 in the bf16 run: half its bytes for a cast in the "
        "forward, no GEMM run again; the backward reads it rounded); fp8-min (fp8 without fc1's "
        "output: its GEMM runs again too); full (only the block's input). Same math but "
        "fc1-fp8's and fp8-store's rounding of what the activation's backward reads",
    )
    add(
        "--fp8-everywhere",
        action="store_true",
        help="turn the size policy off (FP8 on every block linear)",
    )
    add(
        "--fp8-attention",
        action="store_true",
        help="the fp8 run also runs attention in FP8 (on one Hopper GPU fp8jax's own FP8 flash "
        "attention, over several cuDNN's FP8 one; forward + backward 1.15x bf16's at seq 4096, "
        "1.23x at 8192; seq a multiple of 128 on GPU)",
    )
    add(
        "--fp8-head",
        action="store_true",
        help="the fp8 run also runs the LM head's GEMMs in FP8 (default bf16: its output, the "
        "logits, feeds the loss directly)",
    )
    add(
        "--mesh",
        default=None,
        metavar="AXIS=N,...",
        help="device mesh over axes data, fsdp, tensor (e.g. data=2,fsdp=4; axes left out are 1); "
        "the sizes must multiply to the number of visible devices. The batch is split over data "
        "and fsdp, weights sharded over fsdp (FP8 all-gather) and tensor (Megatron). Default: "
        "fsdp over all visible GPUs (faster than data parallel there, in less memory), data "
        "parallel over other devices",
    )
    add(
        "--sequence-parallel",
        action="store_true",
        help="Megatron sequence parallelism (needs --mesh with tensor > 1, dense blocks): "
        "between the tensor-parallel layers the tokens are split over tensor; FP8 layers "
        "all-gather their FP8 inputs and reduce-scatter their outputs",
    )
    add(
        "--tp-overlap",
        choices=OVERLAPS,
        default="none",
        help="with --sequence-parallel: 'ring' runs the FP8 layers' token gathers and "
        "reduce-scatters as collective matmuls (ppermute rings, each chunk moved under the "
        "GEMM of another; --recipe tensor); 'chunks' moves each device's tokens in two "
        "chunked all-gathers or reduce-scatters beside the chunks' GEMMs; 'none' moves "
        "each whole (default, the fastest measured)",
    )
    add(
        "--processes",
        type=_at_least(1),
        default=None,
        metavar="N",
        help="one-host multi-process run: start N trainer processes joined by jax.distributed, "
        "each on its own GPU (N dividing the visible GPUs: a block of GPUs each), or on a host "
        "without GPUs on the CPU (XLA_FLAGS=--xla_force_host_platform_device_count=K: K devices "
        "each); --mesh spans all their devices. Process 0 prints and writes the run's files; "
        "Ctrl-C checkpoints all at one step (exit 130); a failed process stops the others",
    )
    add(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="multi-host: jax.distributed.initialize's coordinator address (process 0's host); "
        "with --num-processes and --process-id, on every host",
    )
    add("--num-processes", type=_at_least(1), default=None, help="multi-host: number of processes")
    add("--process-id", type=_at_least(0), default=None, help="multi-host: this process's index")
    add(
        "--xla-triton-gemm",
        action="store_true",
        help="keep XLA's Triton GEMM autotuning (off by default here: on an H100 it spent ~190 s "
        "compiling the fp8 step, then chose cuBLASLt for every FP8 GEMM anyway)",
    )
    add(
        "--compile-cache",
        type=Path,
        default=None,
        metavar="DIR",
        help="JAX's persistent compilation cache: a restart loads the compiled steps "
        f"(default {compilation.DEFAULT_CACHE}, or $FP8JAX_CACHE_DIR)",
    )
    add("--no-compile-cache", action="store_true", help="compile from scratch")
    add(
        "--max-bytes",
        type=_at_least(1),
        default=64 * 2**20,
        help="corpus size cap (default: %(default)s = 64 MiB)",
    )
    add("--record", type=Path, default=None, help="append benchmark records (JSON lines) here")
    add("--no-plot", action="store_true", help="no loss.png")
    add("--no-tensorboard", action="store_true", help="no TensorBoard event files (tb/<precision>)")
    add("--quiet", action="store_true", help="no progress bar")
    return p
