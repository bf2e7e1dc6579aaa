"""``fp8jax-train``: train a byte-level decoder-only transformer in bf16 or FP8.

    fp8jax-train                          # tiny preset, FP8 vs bf16 (--compare), CPU-sized
    fp8jax-train --preset 1b --precision fp8 --out runs/1b
    fp8jax-train --data my_corpus.txt --steps 2000 --dim 512 --layers 8
    fp8jax-train --out runs/tiny --resume # continue from the newest checkpoint

Writes to ``--out``: ``loss.png`` (loss curves), ``metrics.csv`` / ``metrics.json``,
``summary.md`` (the table printed at the end), and orbax checkpoints under
``ckpt-<precision>/`` every ``--checkpoint-every`` steps and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import math
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..config import Fp8Config
from ..convert import fp8_linear_layers
from ..grad_overwrite import optax_step, trainable
from .. import compilation
from ..inspect import parse_gemms
from .data import load_corpus
from .model import ModelConfig, Transformer, cast_for_compute

PRESETS = {
    # CPU: a few minutes on 2 cores for both precisions. FP8 everywhere (the size
    # policy would skip layers this small, leaving nothing to compare).
    "tiny": dict(model=ModelConfig(dim=128, layers=2, heads=4, kv_heads=4, ffn=384, seq=128), batch=16,
                 steps=300, lr=3e-3, warmup=30, eval_every=50, checkpoint_every=100, selective=False),
    "350m": dict(model=ModelConfig(dim=1024, layers=24, heads=8, kv_heads=8, ffn=3072, seq=2048, scan_unroll=24),
                 batch=8, steps=1000, lr=6e-4, warmup=100, eval_every=100, checkpoint_every=500, selective=True),
    # GPU presets unroll the layer scan fully: on the H100 this removes the scan's residual
    # stacking (1b: bf16 241 -> 205 ms/step, fp8 189 -> 153 ms/step; benchmarks/RESULTS.md).
    # 1b runs FP8 on every block linear: at 16384 tokens per step the 2048-wide attention
    # projections gain in FP8 too (fp8 193 -> 189 ms/step with the policy off).
    "1b": dict(model=ModelConfig(dim=2048, layers=16, heads=16, kv_heads=8, ffn=8192, seq=2048, scan_unroll=16),
               batch=8, steps=1000, lr=3e-4, warmup=100, eval_every=100, checkpoint_every=500, selective=False),
}
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12}
RECORD_COMMAND = "fp8jax-train"


# ----------------------------------------------------------------------------- setup
@dataclasses.dataclass
class RunConfig:
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
    fast_accumulation: str = "forward"  # Fp8Config.fast_accumulation
    cast_kernel: bool = False  # Fp8Config.cast_kernel: one-pass Pallas cast + transpose + amax
    fp8_attention: bool = False  # the fp8 run also runs attention in FP8


def fp8_config(run: RunConfig) -> Fp8Config:
    """FP8 for the linears inside the blocks; embedding and LM head stay bf16 (as in TE)."""
    return Fp8Config(scaling=run.scaling, selective=run.selective, fast_accumulation=run.fast_accumulation,
                     cast_kernel=run.cast_kernel, targets=r"blocks\..*", on_unsupported="silent")


def build_model(run: RunConfig, precision: str):
    cfg = run.model
    if precision == "fp8" and run.fp8_attention:
        cfg = dataclasses.replace(cfg, attention="fp8_dpa")  # same weights: the FP8 core has no parameters
    if precision == "fp8" and cfg.experts:
        cfg = dataclasses.replace(cfg, moe_fp8=True)  # same weights: FP8 state is extra, keys are unchanged
    model = Transformer(cfg, key=jax.random.PRNGKey(run.seed))
    if precision == "fp8":
        model = fp8_linear_layers(model, fp8_config(run))
    return model


def make_optimizer(run: RunConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, run.lr, max(run.warmup, 1), max(run.steps, run.warmup + 1),
                                                  end_value=run.lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.0))


def compute_dtype() -> jnp.dtype:
    return jnp.bfloat16


def _loss(model, batch, with_aux: bool = True):
    """Next-byte cross-entropy, plus the MoE load-balancing loss when training."""
    logits, aux = cast_for_compute(model, compute_dtype()).forward(batch[:, :-1])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    return loss + aux if with_aux else loss


class Trainer:
    """Jitted train and eval steps for one model/optimizer (compiled once; the compiled
    step also gives the memory analysis)."""

    def __init__(self, model, optimizer):
        self.optimizer = optimizer
        self.static = static = eqx.partition(model, eqx.is_array)[1]
        self.load(model)

        def train_step(params, opt_state, batch):
            model = eqx.combine(params, static)
            loss, grads = eqx.filter_value_and_grad(_loss)(model, batch)
            model, opt_state = optax_step(optimizer, model, grads, opt_state)
            return eqx.filter(model, eqx.is_array), opt_state, loss

        self._train = jax.jit(train_step, donate_argnums=(0, 1))
        self._eval = jax.jit(lambda params, batch: _loss(eqx.combine(params, static), batch, with_aux=False))
        self.compiled = None
        self.compile_times: dict[str, float] | None = None

    def load(self, model) -> None:
        """Take ``model``'s arrays as the parameters, with a fresh optimizer state. The compiled
        step stays, so ``model`` must have the structure the trainer was built with."""
        self.params = eqx.filter(model, eqx.is_array)
        self.opt_state = self.optimizer.init(trainable(model))

    def compile(self, batch) -> None:
        """Lower and compile the train step for ``batch``'s shape; ``compile_times`` holds the
        seconds each took (compiling includes XLA's GEMM autotuning)."""
        t0 = time.perf_counter()
        lowered = self._train.lower(self.params, self.opt_state, batch)
        t1 = time.perf_counter()
        self.compiled = lowered.compile()
        self.compile_times = dict(lower_s=t1 - t0, compile_s=time.perf_counter() - t1)

    def step(self, batch):
        if self.compiled is None:
            self.compile(batch)
        self.params, self.opt_state, loss = self.compiled(self.params, self.opt_state, batch)
        return loss

    def eval(self, batches) -> float:
        return float(np.mean([float(self._eval(self.params, b)) for b in batches]))

    def peak_mem_mb(self) -> float | None:
        try:
            stats = self.compiled.memory_analysis()
            return (stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes) / 2**20
        except Exception:
            return None


# ----------------------------------------------------------------------------- checkpoints
def _manager(out: Path, precision: str):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        (out / f"ckpt-{precision}").resolve(), options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))


def save_checkpoint(out: Path, precision: str, step: int, trainer: Trainer, history: list[dict]) -> None:
    import orbax.checkpoint as ocp

    mngr = _manager(out, precision)
    if step in mngr.all_steps():  # e.g. interrupted right after a scheduled save
        return
    mngr.save(step, args=ocp.args.StandardSave(dict(params=trainer.params, opt_state=trainer.opt_state)), force=True)
    mngr.wait_until_finished()
    (out / f"history-{precision}.json").write_text(json.dumps(history))


def _has_checkpoint(out: Path, precision: str) -> bool:
    path = out / f"ckpt-{precision}"
    return path.is_dir() and any(child.name.isdigit() for child in path.iterdir())


def restore_checkpoint(out: Path, precision: str, trainer: Trainer) -> tuple[int, list[dict]]:
    """Restore the newest checkpoint into ``trainer``; returns (step, metric history)."""
    import orbax.checkpoint as ocp

    mngr = _manager(out, precision)
    step = mngr.latest_step()
    if step is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {out / f'ckpt-{precision}'}")
    target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct,
                                    dict(params=trainer.params, opt_state=trainer.opt_state))
    restored = mngr.restore(step, args=ocp.args.StandardRestore(target))
    trainer.params, trainer.opt_state = restored["params"], restored["opt_state"]
    path = out / f"history-{precision}.json"
    history = [h for h in json.loads(path.read_text()) if h["step"] <= step] if path.exists() else []
    return step, history


# ----------------------------------------------------------------------------- progress
def _peak_flops() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in kind), None)


class Progress:
    """A one-line progress bar on stderr: step, loss, tokens/s and (on GPU) MFU."""

    def __init__(self, total: int, label: str, quiet: bool = False):
        self.total, self.label, self.quiet = total, label, quiet
        self.tty = sys.stderr.isatty()
        self.last_print = 0.0

    def update(self, step: int, loss: float, tokens_per_s: float | None, mfu: float | None, val: float | None):
        if self.quiet:
            return
        now = time.perf_counter()
        final = step == self.total
        if not final and now - self.last_print < (0.2 if self.tty else 10.0):
            return
        self.last_print = now
        width = 24
        filled = int(width * step / max(self.total, 1))
        parts = [f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {step}/{self.total}", f"loss {loss:.4f}"]
        if val is not None:
            parts.append(f"val {val:.4f}")
        if tokens_per_s:
            parts.append(f"{tokens_per_s / 1e3:.1f}k tok/s")
        if mfu is not None:
            parts.append(f"MFU {100 * mfu:.1f}%")
        line = " | ".join(parts)
        sys.stderr.write(("\r" + line + " " * 4) if self.tty else line + "\n")
        if final and self.tty:
            sys.stderr.write("\n")
        sys.stderr.flush()


# ----------------------------------------------------------------------------- training
def energy_counter():
    """A function returning GPU 0's energy counter in mJ (NVML, through ctypes), or None
    where NVML is missing (CPU, other vendors): on a power-capped GPU the joules a step
    takes, not its time on a cool chip, set its sustained speed."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        handle = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) != 0:
            return None
    except (OSError, AttributeError):
        return None

    def read() -> float | None:
        value = ctypes.c_ulonglong()
        ok = nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(value)) == 0
        return float(value.value) if ok else None

    return read if read() is not None else None


class TrainRun:
    """One precision's training run, advanced in chunks: `train` runs it to the end, and
    ``--compare --interleave K`` alternates the precisions every K steps in one process, so
    both are timed on the same GPU state (clock, temperature, power cap) instead of one
    after the other on a GPU that heats up."""

    def __init__(self, run: RunConfig, precision: str, corpus, out: Path, *, resume: bool = False,
                 quiet: bool = False):
        if not resume:  # a fresh run: older checkpoints of this precision would mix runs
            shutil.rmtree(out / f"ckpt-{precision}", ignore_errors=True)
        self.run, self.precision, self.corpus, self.out = run, precision, corpus, out
        self.trainer = Trainer(build_model(run, precision), make_optimizer(run))
        self.start, self.history = restore_checkpoint(out, precision, self.trainer) if resume else (0, [])
        self.step = self.start
        self.val_batches = corpus.val_batches(run.batch, run.model.seq, run.eval_batches)
        self.tokens = run.batch * run.model.seq
        self.peak = _peak_flops()
        self.progress = Progress(run.steps, precision, quiet)
        self.timed_tokens, self.timed_s = 0, 0.0
        self.energy, self.timed_mj, self.energy_at = energy_counter(), 0.0, None
        self.interrupted = False
        # Step N+1 is dispatched before step N's loss is read, so the host's work (the batch,
        # the launch) overlaps the GPU's and no step waits on the previous one's readback.
        # A step's time is the time between two loss readbacks; steps right after a sync
        # (compile, eval, checkpoint, the other precision's chunk) are not timed.
        self.pending: tuple[int, jax.Array] | None = None
        self.last_ready: float | None = None

    @property
    def done(self) -> bool:
        return self.interrupted or self.step >= self.run.steps

    def _record(self, done_step: int, loss_array: jax.Array, timed: bool) -> None:
        run = self.run
        loss = float(loss_array)
        now = time.perf_counter()
        mj = self.energy() if self.energy else None
        step_s = None
        if timed and self.last_ready is not None and done_step - self.start > 2:  # the first steps compile
            step_s = now - self.last_ready
            self.timed_tokens, self.timed_s = self.timed_tokens + self.tokens, self.timed_s + step_s
            if mj is not None and self.energy_at is not None:
                self.timed_mj += mj - self.energy_at
        self.last_ready, self.energy_at = now, mj
        if not math.isfinite(loss):
            raise FloatingPointError(f"{self.precision}: loss is {loss} at step {done_step}")
        tps = self.timed_tokens / self.timed_s if self.timed_s else None
        mfu = tps * run.model.flops_per_token() / self.peak if (tps and self.peak) else None
        self.history.append(dict(step=done_step, loss=loss, tokens_per_s=tps, mfu=mfu, step_s=step_s))
        if done_step % run.eval_every and done_step != run.steps:  # eval steps print with their val loss
            self.progress.update(done_step, loss, tps, mfu, None)

    def _flush(self) -> None:
        """Read the pending step's loss; the next step is then not timed (it follows a sync)."""
        if self.pending is not None:
            self._record(*self.pending, timed=True)
            self.pending = None
        self.last_ready = None

    def advance(self, until: int, interrupt_at: int | None = None) -> None:
        """Train up to step ``until`` (at most ``run.steps``), then sync. Raises KeyboardInterrupt
        (real or simulated at ``interrupt_at``, for tests); `interrupt` then checkpoints."""
        run = self.run
        until = min(until, run.steps)
        while self.step < until:
            if interrupt_at is not None and self.step == interrupt_at:
                raise KeyboardInterrupt
            batch = jnp.asarray(self.corpus.batch(run.seed, self.step, run.batch, run.model.seq))
            loss_array = self.trainer.step(batch)
            self.step += 1
            if self.pending is not None:
                self._record(*self.pending, timed=True)
            self.pending = (self.step, loss_array)
            evaluate = self.step % run.eval_every == 0 or self.step == run.steps
            save = run.checkpoint_every and self.step % run.checkpoint_every == 0 and self.step < run.steps
            if evaluate or save:
                self._flush()
                if evaluate:
                    last = self.history[-1]
                    last["val_loss"] = self.trainer.eval(self.val_batches)
                    self.progress.update(self.step, last["loss"], last["tokens_per_s"], last["mfu"], last["val_loss"])
                if save:
                    save_checkpoint(self.out, self.precision, self.step, self.trainer, self.history)
                self.last_ready = None  # the next step's time would include the eval / the save
        self._flush()

    def interrupt(self) -> None:
        """Ctrl-C: keep what ran and checkpoint it, so ``--resume`` continues from here."""
        self.interrupted = True
        if self.pending is not None and not (self.history and self.history[-1]["step"] == self.pending[0]):
            self._record(*self.pending, timed=False)
        self.pending = None
        if self.trainer.compiled is not None or self.step > self.start:
            save_checkpoint(self.out, self.precision, self.step, self.trainer, self.history)
            print(f"\ninterrupted: checkpoint of step {self.step} written to {self.out / f'ckpt-{self.precision}'}; "
                  f"continue with --resume", file=sys.stderr)

    def result(self) -> dict:
        if not self.interrupted and self.run.checkpoint_every:  # --checkpoint-every 0: none (benchmarks)
            save_checkpoint(self.out, self.precision, self.step, self.trainer, self.history)
        vals = [h["val_loss"] for h in self.history if "val_loss" in h]
        tps = self.timed_tokens / self.timed_s if self.timed_s else None
        steps_timed = self.timed_tokens / self.tokens
        joules = self.timed_mj / 1e3 / steps_timed if (self.energy and steps_timed) else None
        # What the compiled step runs: FP8 GEMMs / all GEMM calls (cuDNN attention counts as one).
        gemms = parse_gemms(self.trainer.compiled.as_text()) if self.trainer.compiled is not None else []
        return dict(precision=self.precision, steps=self.step, interrupted=self.interrupted, history=self.history,
                    final_loss=self.history[-1]["loss"] if self.history else None,
                    val_loss=vals[-1] if vals else None, tokens_per_s=tps,
                    mfu=(tps * self.run.model.flops_per_token() / self.peak) if (tps and self.peak) else None,
                    joules_per_step=joules, mean_power_w=(joules * tps / self.tokens) if (joules and tps) else None,
                    compile_s=sum(self.trainer.compile_times.values()) if self.trainer.compile_times else None,
                    gemms=len(gemms), fp8_gemms=sum(g.is_fp8 for g in gemms),
                    peak_mem_mb=self.trainer.peak_mem_mb() if self.trainer.compiled is not None else None)


def train(run: RunConfig, precision: str, corpus, out: Path, *, resume: bool = False, quiet: bool = False,
          interrupt_at: int | None = None) -> dict:
    """Train one precision to the end; returns its result dict (``history`` holds per-step
    metrics). ``interrupt_at`` simulates Ctrl-C at that step (for tests)."""
    return train_interleaved(run, [precision], corpus, out, chunk=0, resume={precision: resume}, quiet=quiet,
                             interrupt_at=interrupt_at)[precision]


def train_interleaved(run: RunConfig, precisions: list[str], corpus, out: Path, *, chunk: int,
                      resume: dict[str, bool] | None = None, quiet: bool = False,
                      interrupt_at: int | None = None) -> dict[str, dict]:
    """Train the precisions together, ``chunk`` steps of each in turn (0: each to the end in
    one go), same seed and data order; the models and optimizer states of all of them stay
    on the device. ``resume[p]`` continues precision ``p`` from its newest checkpoint."""
    resume = resume or {}
    runs = [TrainRun(run, p, corpus, out, resume=resume.get(p, False), quiet=quiet) for p in precisions]
    chunk = chunk or run.steps
    try:
        while not all(r.done for r in runs):
            for r in runs:
                if not r.done:
                    r.advance(r.step + chunk, interrupt_at)
    except KeyboardInterrupt:
        for r in runs:
            r.interrupt()
    return {r.precision: r.result() for r in runs}


# ----------------------------------------------------------------------------- reporting
def summarize(results: dict[str, dict]) -> str:
    """The markdown summary table (bf16 first; speedup and val-loss gap vs bf16)."""
    base = results.get("bf16")
    energy = all(r.get("joules_per_step") for r in results.values())
    lines = ["| precision | steps | train loss | val loss | val gap vs bf16 | tokens/s | speedup | MFU | peak MiB |"
             + (" J/step | mean W |" if energy else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if energy else "")]
    for name in sorted(results, key=lambda n: n != "bf16"):
        r = results[name]
        gap = speed = None
        if base and r["val_loss"] is not None and base["val_loss"]:
            gap = (r["val_loss"] - base["val_loss"]) / base["val_loss"]
        if base and r["tokens_per_s"] and base["tokens_per_s"]:
            speed = r["tokens_per_s"] / base["tokens_per_s"]
        r["val_loss_rel_gap"], r["speedup_vs_bf16"] = gap, speed
        f = lambda v, s: "-" if v is None else format(v, s)  # noqa: E731
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        gap_s = "-" if gap is None else f"{100 * gap:+.2f}%"
        speed_s = "-" if speed is None else f"{speed:.2f}x"
        lines.append(f"| {name} | {r['steps']} | {f(r['final_loss'], '.4f')} | {f(r['val_loss'], '.4f')} | "
                     f"{gap_s} | {f(r['tokens_per_s'], ',.0f')} | "
                     f"{speed_s} | "
                     f"{mfu} | {f(r['peak_mem_mb'], ',.0f')} |"
                     + (f" {r['joules_per_step']:.1f} | {f(r.get('mean_power_w'), '.0f')} |" if energy else ""))
    return "\n".join(lines)


def write_metrics(results: dict[str, dict], out: Path, meta: dict) -> None:
    with open(out / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["precision", "step", "loss", "val_loss", "tokens_per_s", "mfu", "step_s"])
        for name, r in results.items():
            for h in r["history"]:
                w.writerow([name, h["step"], h["loss"], h.get("val_loss", ""), h.get("tokens_per_s") or "",
                            h.get("mfu") or "", h.get("step_s") or ""])
    (out / "metrics.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))


def plot(results: dict[str, dict], out: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot; pip install 'fp8jax[train]')", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, r in sorted(results.items()):
        steps = np.array([h["step"] for h in r["history"]])
        loss = np.array([h["loss"] for h in r["history"]])
        ema, smooth = loss[0] if len(loss) else 0.0, []
        for v in loss:
            ema = 0.9 * ema + 0.1 * v
            smooth.append(ema)
        (line,) = ax.plot(steps, smooth, label=f"{name} train (EMA)", lw=1.2)
        val = [(h["step"], h["val_loss"]) for h in r["history"] if "val_loss" in h]
        if val:
            ax.plot(*zip(*val, strict=True), "o--", color=line.get_color(), label=f"{name} val", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    path = out / "loss.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def to_records(results: dict[str, dict], run: RunConfig, preset: str, meta: dict, interleave: int = 0) -> list[dict]:
    """`benchmarks/results/train.jsonl` records (names from BENCHMARKS.md); ``interleave``: the
    precisions alternated every that many steps in one process (0: one after the other)."""
    recs = []
    for name, r in results.items():
        recs.append(dict(bench="train", params=dict(preset=preset, seq=run.model.seq, steps=r["steps"],
                                                    batch=run.batch), variant=name,
                         device=meta["device"], date=meta["date"], jax=meta["jax"], command=meta["command"],
                         xla_flags=meta.get("xla_flags", ""),
                         ms=(run.batch * run.model.seq / r["tokens_per_s"] * 1e3) if r["tokens_per_s"] else None,
                         tokens_per_s=r["tokens_per_s"], mfu=r["mfu"], val_loss=r["val_loss"],
                         val_loss_rel_gap=r.get("val_loss_rel_gap"), speedup_vs_bf16=r.get("speedup_vs_bf16"),
                         peak_mem_mb=r["peak_mem_mb"], interleave=interleave,
                         joules_per_step=r.get("joules_per_step"), mean_power_w=r.get("mean_power_w"),
                         compile_s=r.get("compile_s"), fp8_gemms=bool(r.get("fp8_gemms")),
                         fp8_gemm_count=r.get("fp8_gemms"), gemm_count=r.get("gemms")))
    return recs


# ----------------------------------------------------------------------------- CLI
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


def parse_args(argv):
    p = argparse.ArgumentParser(prog="fp8jax-train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--precision", choices=["bf16", "fp8"], default=None,
                   help="train one precision (default: --compare both)")
    p.add_argument("--compare", action="store_true", help="bf16 then fp8, same seed and data order (default)")
    p.add_argument("--interleave", type=int, default=0, metavar="K",
                   help="with --compare: train both in one process, K steps of each in turn, so both are timed on "
                        "the same GPU state (a GPU at its power cap runs slower than a cool one); needs memory "
                        "for both models")
    p.add_argument("--data", default=None, help="text file or directory (default: the Python stdlib sources)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default runs/<preset>)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    for name, typ in (("steps", _at_least(1)), ("batch", _at_least(1)), ("lr", _positive),
                      ("warmup", _at_least(0)), ("eval-every", _at_least(1)),
                      ("eval-batches", _at_least(1)), ("checkpoint-every", _at_least(0)),
                      ("seed", int)):
        p.add_argument(f"--{name}", type=typ, default=None)
    for name in ("dim", "layers", "heads", "kv-heads", "ffn", "seq", "experts", "top-k"):
        p.add_argument(f"--{name}", type=_at_least(1), default=None, help="model size override")
    p.add_argument("--scaling", choices=["delayed", "current"], default="delayed")
    p.add_argument("--fast-accumulation", choices=["forward", "all", "none"], default="forward",
                   help="FP8 GEMMs allowed Hopper's fast accumulation (default: forward only, as TE)")
    p.add_argument("--cast-kernel", action="store_true",
                   help="FP8 casts through the one-pass Pallas cast + transpose + amax kernel (Hopper)")
    p.add_argument("--scan-unroll", type=_at_least(1), default=None,
                   help="layers per scan iteration; = --layers unrolls fully (no residual stacking between layers)")
    p.add_argument("--fp8-everywhere", action="store_true", help="turn the size policy off (FP8 on every block linear)")
    p.add_argument("--fp8-attention", action="store_true",
                   help="the fp8 run also runs attention in FP8 (cuDNN FP8 flash attention on H100: pays from "
                        "seq 8192 on, slower below; needs head_dim 128 and seq a multiple of 128 on GPU)")
    p.add_argument("--xla-triton-gemm", action="store_true",
                   help="keep XLA's Triton GEMM autotuning (off by default here: on an H100 it spent ~190 s "
                        "compiling the fp8 step, then chose cuBLASLt for every FP8 GEMM anyway)")
    p.add_argument("--compile-cache", type=Path, default=None, metavar="DIR",
                   help="JAX's persistent compilation cache: a restart loads the compiled steps "
                        f"(default {compilation.DEFAULT_CACHE}, or $FP8JAX_CACHE_DIR)")
    p.add_argument("--no-compile-cache", action="store_true", help="compile from scratch")
    p.add_argument("--max-bytes", type=_at_least(1), default=64 * 2**20, help="corpus size cap")
    p.add_argument("--record", type=Path, default=None, help="append benchmark records (JSON lines) here")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def run_config(args) -> RunConfig:
    preset = dict(PRESETS[args.preset])
    model = preset.pop("model")
    overrides = {k: getattr(args, k) for k in ("dim", "layers", "heads", "kv_heads", "ffn", "seq", "experts",
                                               "top_k", "scan_unroll") if getattr(args, k) is not None}
    model = dataclasses.replace(model, **overrides)
    for k in ("steps", "batch", "lr", "warmup", "eval_every", "checkpoint_every"):
        if getattr(args, k) is not None:
            preset[k] = getattr(args, k)
    if args.fp8_everywhere:
        preset["selective"] = False
    run = RunConfig(model=model, scaling=args.scaling, fast_accumulation=args.fast_accumulation,
                    cast_kernel=args.cast_kernel, fp8_attention=args.fp8_attention, **preset)
    if args.eval_batches is not None:
        run.eval_batches = args.eval_batches
    if args.seed is not None:
        run.seed = args.seed
    return run


def main(argv: list[str] | None = None, *, interrupt_at: int | None = None) -> dict[str, dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.xla_triton_gemm:  # undo what importing fp8jax set, while the backend has not started
        flags = os.environ.get("XLA_FLAGS", "").replace(compilation.TRITON_GEMM_OFF, "")
        os.environ["XLA_FLAGS"] = " ".join(flags.split())
    if not args.no_compile_cache:
        compilation.enable_compilation_cache(args.compile_cache)
    run = run_config(args)
    precisions = [args.precision] if (args.precision and not args.compare) else ["bf16", "fp8"]
    if args.interleave < 0 or (args.interleave and len(precisions) < 2):
        raise ValueError(f"--interleave {args.interleave}: needs K > 0 and both precisions (--compare, not "
                         f"--precision {args.precision})")
    out = args.out or Path("runs") / args.preset
    out.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(args.data, max_bytes=args.max_bytes)
    device = jax.devices()[0]
    meta = dict(device=device.device_kind, platform=device.platform, jax=jax.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                xla_flags=os.environ.get("XLA_FLAGS", ""),
                command=" ".join([RECORD_COMMAND, *map(shlex.quote, argv)]), preset=args.preset,
                model=dataclasses.asdict(run.model), batch=run.batch, steps=run.steps, lr=run.lr,
                corpus=dict(source=corpus.source, files=corpus.files, train_bytes=len(corpus.train),
                            val_bytes=len(corpus.val)))
    print(f"fp8jax-train: preset {args.preset}, {run.model.non_embedding_params() / 1e6:.1f}M params, "
          f"{run.steps} steps x {run.batch} x {run.model.seq} tokens, on {device.device_kind}; corpus "
          f"{corpus.source} ({corpus.files} files, {len(corpus.train) / 1e6:.1f} MB train)", flush=True)
    results: dict[str, dict] = {}
    # Results of the other precision from an earlier invocation into the same --out.
    for name in ("bf16", "fp8"):
        path = out / f"result-{name}.json"
        if name not in precisions and path.exists():
            results[name] = json.loads(path.read_text())
    todo = []
    for precision in precisions:
        done = out / f"result-{precision}.json"
        if args.resume and done.exists():
            previous = json.loads(done.read_text())
            if previous["steps"] >= run.steps and not previous["interrupted"]:
                results[precision] = previous  # finished before the interruption
                continue
        todo.append(precision)
    # --resume continues what has a checkpoint; a precision the interruption came before starts
    # fresh (unless nothing has one: then there is nothing to resume, and restoring says so).
    started = [p for p in todo if _has_checkpoint(out, p)]
    resume = {p: args.resume and (p in started or not started) for p in todo}
    if args.interleave and len(todo) > 1:
        new = train_interleaved(run, todo, corpus, out, chunk=args.interleave, resume=resume, quiet=args.quiet,
                                interrupt_at=interrupt_at)
    else:
        new = {}
        for precision in todo:
            new[precision] = train(run, precision, corpus, out, resume=resume[precision], quiet=args.quiet,
                                   interrupt_at=interrupt_at)
            if new[precision]["interrupted"]:
                break
    for precision, r in new.items():
        results[precision] = r
        (out / f"result-{precision}.json").write_text(json.dumps(r))
    table = summarize(results)
    (out / "summary.md").write_text(f"{meta['command']} on {meta['device']} ({meta['date']})\n\n{table}\n")
    write_metrics(results, out, meta)
    png = None if args.no_plot else plot(
        results, out, f"{args.preset}: {run.model.non_embedding_params() / 1e6:.0f}M params, {meta['device']}")
    if args.record:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        with open(args.record, "a") as f:
            for rec in to_records(results, run, args.preset, meta, args.interleave):
                f.write(json.dumps(rec) + "\n")
    print("\n" + table)
    for name, r in results.items():
        if r.get("compile_s") is not None:
            print(f"{name}: compiled in {r['compile_s']:.0f} s; the step runs {r['fp8_gemms']} of its "
                  f"{r['gemms']} GEMM calls in FP8")
    print(f"\nwrote {out}/metrics.csv, metrics.json, summary.md" + (f", {png.name}" if png else ""))
    return results


def console_main() -> int:
    """``fp8jax-train``'s entry point. `main` returns its results for callers in Python, which
    a console script would hand to ``sys.exit`` (printing them and exiting with status 1)."""
    main()
    return 0


if __name__ == "__main__":
    main()
