"""Benchmark: serving the trainer's byte-level LM with FP8 inference weights vs bf16.

One FP8-trained model (an ``fp8jax-train --out`` run's ``ckpt-fp8`` with ``--run``, else a
fresh model of ``--preset`` trained ``--train-steps`` steps by the trainer's own step, so
its amax histories are real) is served two ways, in one process:

* ``bf16``  its weights in bf16 (`fp8jax.train._generate.prepare(model, "bf16")`)
* ``fp8``   `fp8jax.to_inference`: block linears in e4m3 with their scales, input scales
            frozen from the training history (``--input-scale``), one FP8 GEMM each

For each case ``(batch, prompt)`` it measures the served weights' size (``weight_mb``, all
arrays), prefill tokens/s (``ms``: the prompt's forward and the first token) and decode ms
per step (one token for every sequence of the batch; median of ``--reps`` runs, compiled
before), the validation loss of the served model on the trainer's validation windows
(``val_loss``) and, for ``fp8``, that of the training model (its FP8 training forward,
``val_loss_train``) and the change (``val_loss_delta``); on a GPU, the FP8 GEMMs in the
compiled prefill (``fp8_gemm_count``).

    python -m benchmarks.inference                          # 1b preset, batch 1 and 8 (H100)
    python -m benchmarks.inference --run runs/1b --cases 8,1024
    python -m benchmarks.inference --quick                  # CPU smoke run, writes nothing

Records (GPU, not ``--quick``) go to ``benchmarks/results/inference.jsonl``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optax

import fp8jax
from benchmarks import common
from fp8jax._inference import weight_bytes
from fp8jax.train import _cli as cli
from fp8jax.train import _generate as gen
from fp8jax.train._data import load_corpus
from fp8jax.train._model import cast_for_compute
from fp8jax.train._tokenizer import tokenize

VARIANTS = ("bf16", "fp8")
DEFAULT_CASES = [(1, 1024), (8, 1024)]  # (batch, prompt length)
QUICK_CASES = [(2, 16)]
DEFAULT_OUT = common.results_path("inference")
COMMAND_PREFIX = "python -m benchmarks.inference"
RECORD_FIELDS = (
    *common.META_FIELDS,
    "ms",
    "weight_mb",
    "prefill_tokens_per_s",
    "decode_ms_per_token",
    "val_loss",
    "val_loss_train",
    "val_loss_delta",
    "fp8_gemm_count",
    "weight_scaling",
    "input_scale",
    "source",
)


def parse_case(text: str) -> tuple[int, int]:
    """``"batch,prompt"``."""
    try:
        batch, prompt = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"case must be batch,prompt, got {text!r}") from None
    if batch < 1 or prompt < 1:
        raise argparse.ArgumentTypeError(f"case {text!r}: batch and prompt must be >= 1")
    return batch, prompt


@eqx.filter_jit
def _val_loss(model, batch):
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def val_loss(model, batches) -> float:
    return float(np.mean([float(_val_loss(model, jnp.asarray(b))) for b in batches]))


def trained_model(args, run, corpus):
    """The FP8-trained model to serve and where it came from."""
    if args.run is not None:
        model, step = gen.load_trained(args.run, "fp8", run)
        return model, f"{args.run} step {step}"
    trainer = cli.Trainer(cli.build_model(run, "fp8"), cli.make_optimizer(run))
    for step in range(args.train_steps):
        batch = corpus.batch(run.seed, step, run.batch, run.model.seq)
        trainer.step(jnp.asarray(batch))
    return eqx.combine(trainer.params, trainer.static), f"fresh, {args.train_steps} steps"


def _fp8_gemm_count(model, prompt) -> int | None:
    if not common.on_gpu():
        return None
    return fp8jax.fp8_gemm_report(lambda m, t: m(t), model, prompt).num_fp8


def run_case(case, served, corpus, args, meta, val_batches, train_val) -> list[dict]:
    batch, prompt_len = case
    need = batch * prompt_len
    if len(corpus.val) < need:
        raise ValueError(
            f"case {case}: the validation split has {len(corpus.val)} {corpus.unit} < {need}"
        )
    prompt = jnp.asarray(corpus.val[:need].reshape(batch, prompt_len).astype(np.int32))
    rows = []
    for variant in VARIANTS:
        params = dict(
            preset=args.preset if args.run is None else "run",
            batch=batch,
            prompt=prompt_len,
            new_tokens=args.new_tokens,
        )
        row = dict(meta, params=params, variant=variant, source=args.source)
        try:
            m = served[variant]
            runs = [
                gen.generate(m, prompt, args.new_tokens, warmup=i == 0) for i in range(args.reps)
            ]
            prefill_s = statistics.median(r.prefill_s for r in runs)
            decode = [r.decode_ms_per_token for r in runs if r.decode_ms_per_token is not None]
            row.update(
                ms=prefill_s * 1e3,
                weight_mb=weight_bytes(m) / 2**20,
                prefill_tokens_per_s=need / prefill_s,
                decode_ms_per_token=statistics.median(decode) if decode else None,
                val_loss=val_loss(m, val_batches),
                fp8_gemm_count=_fp8_gemm_count(m, prompt),
                error=None,
            )
            if variant == "fp8":
                row.update(
                    weight_scaling=args.weight_scaling,
                    input_scale=args.input_scale,
                    val_loss_train=train_val,
                    val_loss_delta=row["val_loss"] - train_val,
                )
        except Exception as e:  # keep the other variant's numbers
            row.update(ms=None, error=common.error_text(e))
        rows.append(row)
    return rows


def markdown_table(rows: list[dict]) -> str:
    columns = [
        ("weight MiB", lambda r: common.fmt(r.get("weight_mb"), ",.1f")),
        ("prefill tok/s", lambda r: common.fmt(r.get("prefill_tokens_per_s"), ",.0f")),
        ("decode ms/step", lambda r: common.fmt(r.get("decode_ms_per_token"), ".3f")),
        ("val loss", lambda r: common.fmt(r.get("val_loss"), ".4f")),
        ("vs training", lambda r: common.fmt(r.get("val_loss_delta"), "+.4f")),
        ("FP8 GEMMs", lambda r: common.fmt(r.get("fp8_gemm_count"), "d")),
    ]

    def case(r):
        p = r["params"]
        return f"{p['batch']} | {p['prompt']} | {p['new_tokens']}"

    return "\n".join(
        common.markdown_rows(rows, "batch | prompt | new tokens", case, columns, error_chars=200)
    )


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=COMMAND_PREFIX, description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny CPU-sized model; no records")
    ap.add_argument("--preset", choices=sorted(cli.PRESETS), default="1b")
    ap.add_argument("--run", type=Path, default=None, help="an fp8jax-train --out directory")
    ap.add_argument("--cases", type=parse_case, nargs="+", help="batch,prompt ...")
    ap.add_argument("--new-tokens", type=cli._at_least(1), default=None)
    ap.add_argument(
        "--train-steps",
        type=cli._at_least(0),
        default=None,
        help="without --run: trainer steps before serving (default 20; quick 1)",
    )
    ap.add_argument("--weight-scaling", choices=fp8jax._inference.WEIGHT_SCALINGS, default="tensor")
    ap.add_argument("--input-scale", choices=fp8jax._inference.INPUT_SCALES, default="frozen")
    ap.add_argument("--val-batches", type=cli._at_least(1), default=None)
    ap.add_argument("--reps", type=cli._at_least(1), default=None)
    ap.add_argument("--data", default=None, help="corpus (default: the Python stdlib sources)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    quick = args.quick
    if args.run is not None:
        run = gen.run_config_of(args.run)
    else:
        train_argv = ["--preset", "tiny" if quick else args.preset]
        if quick:
            train_argv += ["--dim", "64", "--ffn", "128", "--seq", "32", "--batch", "2"]
        run = cli.run_config(cli.parse_args(train_argv))
    args.train_steps = args.train_steps if args.train_steps is not None else (1 if quick else 20)
    args.new_tokens = args.new_tokens or (4 if quick else 128)
    args.reps = args.reps or (1 if quick else 3)
    cases = args.cases or (QUICK_CASES if quick else DEFAULT_CASES)
    corpus = load_corpus(args.data, max_bytes=300_000 if quick else 64 * 2**20)
    if args.run is not None:  # the run's own tokens (a BPE or user tokenizer), not bytes
        corpus = tokenize(corpus, gen.run_tokenizer(args.run, run, "fp8"))[0]
    model, args.source = trained_model(args, run, corpus)
    val_batches = corpus.val_batches(
        run.batch, run.model.seq, args.val_batches or (1 if quick else 8)
    )
    compute = cli.compute_dtype()
    train_val = val_loss(cast_for_compute(model, compute), val_batches)
    served = dict(
        bf16=gen.prepare(model, "bf16", dtype=compute),
        fp8=gen.prepare(
            model,
            "fp8",
            weight_scaling=args.weight_scaling,
            input_scale=args.input_scale,
            dtype=compute,
        ),
    )
    del model
    meta = common.run_meta(argv, bench="inference", prefix=COMMAND_PREFIX)
    return common.run_cases(
        cases,
        lambda case: run_case(case, served, corpus, args, meta, val_batches, train_val),
        markdown_table,
        args.out,
        RECORD_FIELDS,
        record=not quick,
    )


if __name__ == "__main__":
    main()
