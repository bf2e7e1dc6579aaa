"""Why the fp8 step slows down over a training run more than bf16 does: the GPU (heat, the
power cap) or the data (what the trained weights and activations look like)?

Trains bf16 and fp8 in one process, ``--chunk`` steps of each in turn for ``--rounds``
rounds on the trainer's corpus, then resets both to their initial weights (same seed:
the same tensors) and times ``--fresh-rounds`` more rounds on the now hot GPU. Each chunk
prints its median step time, joules per step and mean power. If the fp8 step gets its
early speed back on fresh weights while bf16 stays put, the slowdown is in the data.

    python -m benchmarks._probe_power --preset 1b --rounds 8 --chunk 50 --fresh-rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from fp8jax import skip_triton_gemm_autotuning
from fp8jax.train import cli
from fp8jax.train.data import load_corpus


def reset(trainer: cli.Trainer, run: cli.RunConfig, precision: str) -> None:
    """Put the initial weights (and a fresh optimizer state) back into the compiled trainer."""
    trainer.params = trainer.opt_state = None  # free the trained ones first
    trainer.load(cli.build_model(run, precision))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="1b", choices=sorted(cli.PRESETS))
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--fresh-rounds", type=int, default=2)
    p.add_argument("--chunk", type=int, default=50)
    p.add_argument("--max-bytes", type=int, default=64 * 2**20)
    args = p.parse_args(argv)
    skip_triton_gemm_autotuning()
    run = cli.RunConfig(**cli.PRESETS[args.preset])
    corpus = load_corpus(None, max_bytes=args.max_bytes)
    energy = cli.energy_counter()
    trainers = {prec: cli.Trainer(cli.build_model(run, prec), cli.make_optimizer(run)) for prec in ("bf16", "fp8")}
    steps = dict.fromkeys(trainers, 0)
    rows = []

    def chunk(prec: str, phase: str) -> None:
        trainer, times = trainers[prec], []
        mj0 = energy() if energy else None
        for _ in range(args.chunk):
            batch = jnp.asarray(corpus.batch(run.seed, steps[prec], run.batch, run.model.seq))
            t0 = time.perf_counter()
            jax.block_until_ready(trainer.step(batch))
            times.append(time.perf_counter() - t0)
            steps[prec] += 1
        timed = times[2:]  # the first compiles; the first after a switch follows the other's sync
        joules = (energy() - mj0) / 1e3 / args.chunk if energy else float("nan")
        ms = 1e3 * statistics.median(timed)
        rows.append((phase, prec, steps[prec], ms, joules, joules / (sum(times) / args.chunk)))
        print(f"{phase:<7} {prec:<5} step {steps[prec]:>5}  {ms:7.1f} ms  {joules:6.1f} J/step  "
              f"{rows[-1][5]:5.0f} W", flush=True)

    for _ in range(args.rounds):
        for prec in trainers:
            chunk(prec, "trained")
    for prec in trainers:
        reset(trainers[prec], run, prec)
        steps[prec] = 0
    for _ in range(args.fresh_rounds):
        for prec in trainers:
            chunk(prec, "fresh")
    last = {(ph, pr): ms for ph, pr, _, ms, _, _ in rows}  # the last chunk of each
    first = {}
    for ph, pr, _, ms, _, _ in rows:
        first.setdefault((ph, pr), ms)
    for phase in ("trained", "fresh"):
        print(f"{phase}: first chunk bf16/fp8 {first[(phase, 'bf16')] / first[(phase, 'fp8')]:.3f}x, "
              f"last chunk {last[(phase, 'bf16')] / last[(phase, 'fp8')]:.3f}x")
    return rows


if __name__ == "__main__":
    main()
