"""The training loop: `TrainRun` (one precision's run: timing, evaluation, checkpoints,
progress, on a `fp8jax.train._trainer.Trainer`) and `train` / `train_interleaved`."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import jax
from jax.sharding import Mesh
from tqdm.auto import tqdm

from . import _interrupts as interrupts
from ._checkpoint import restore_checkpoint, save_checkpoint
from ._config import RunConfig, build_model, make_optimizer
from ._memory import NO_LIMIT, allocator_peak_bytes, choose_remat
from ._mesh import check_batch
from ._metering import energy_counter, peak_flops
from ._model import AUTO, AUTO_ORDER
from ._report import TensorBoardLog
from ._rundir import clear_outputs, config_record
from ._trainer import Trainer


class TrainRun:
    """One precision's training run, advanced in chunks: `train` runs it to the end, and
    ``--compare --interleave K`` alternates the precisions every K steps in one process, so
    both are timed on the same GPU state (clock, temperature, power cap) instead of one
    after the other on a GPU that heats up."""

    def __init__(
        self,
        run: RunConfig,
        precision: str,
        corpus,
        out: Path,
        *,
        resume: bool = False,
        quiet: bool = False,
        mesh: Mesh | None = None,
        tensorboard: bool = True,
        position: int = 0,
    ):
        if mesh is not None:
            check_batch(run.batch, mesh)
        main_process = jax.process_index() == 0
        if not resume and main_process:  # a fresh run: older outputs would mix runs
            clear_outputs(out, precision)
        self.run, self.precision, self.corpus, self.out = run, precision, corpus, out
        self.config = config_record(run, precision)
        # the allocator's peak before this run: where it does not grow, an earlier run of
        # this process set it, and `result` reports the compiled step's memory instead
        self.peak_before = allocator_peak_bytes()
        model = build_model(run, precision, mesh)  # on a mesh: each device its own shards
        self.trainer = Trainer(model, make_optimizer(run), mesh, run.sequence_parallel,
                               run.tp_overlap)  # fmt: skip
        self.start, self.history = (0, [])
        if resume:
            self.start, self.history = restore_checkpoint(out, precision, self.trainer)
        # --remat auto: chosen afresh (a resume too: on this device, at this batch), once the
        # checkpoint's arrays are in place
        self.remat, self.remat_tried = run.remat, None
        if run.remat == AUTO:
            self.remat, self.remat_tried, line = self._choose_remat()
            if main_process and NO_LIMIT not in line:  # a CPU run (the default): nothing to say
                print(f"{precision}: {line}", file=sys.stderr, flush=True)
        self.step = self.start
        host_val = corpus.val_batches(run.batch, run.model.seq, run.eval_batches)
        self.val_batches = [self.trainer.device_batch(b) for b in host_val]
        self.tokens = run.batch * run.model.seq
        devices = mesh.devices.size if mesh is not None else 1
        self.peak = peak_flops() * devices if peak_flops() else None
        self.quiet = quiet or not main_process
        # tqdm draws on a terminal only (disable=None): logs and pipes stay clean; there an
        # evaluation prints one plain line instead (`_report_eval`).
        self.bar = tqdm(
            total=run.steps,
            initial=self.start,
            desc=precision,
            position=position,
            disable=True if self.quiet else None,
            file=sys.stderr,
            dynamic_ncols=True,
            leave=True,
        )
        logdir = out / "tb" / precision if (tensorboard and main_process) else None
        self.tb = TensorBoardLog(logdir)
        self.timed_tokens, self.timed_s = 0, 0.0
        self.energy, self.timed_mj, self.energy_at = energy_counter(), 0.0, None
        self.interrupted = False
        # Step N+1 is dispatched before step N's loss is read, so the host's work (the batch,
        # the launch) overlaps the GPU's and no step waits on the previous one's readback.
        # A step's time is the time between two loss readbacks; steps right after a sync
        # (compile, eval, checkpoint, the other precision's chunk) are not timed.
        self.pending: tuple[int, jax.Array] | None = None
        self.last_ready: float | None = None

    def _choose_remat(self) -> tuple[str, dict, str]:
        """`choose_remat` with this run's trainer and batch shape."""
        trainer, spec = self.trainer, self.trainer.batch_spec(self.run.batch, self.run.model.seq)

        def compile_with(remat):
            trainer.set_remat(remat)
            trainer.compile(spec)
            return trainer.compiled

        return choose_remat(compile_with, trainer.devices(), AUTO_ORDER)

    @property
    def done(self) -> bool:
        return self.interrupted or self.step >= self.run.steps

    def _mfu(self, tps: float | None) -> float | None:
        if not (tps and self.peak):
            return None
        return tps * self.run.model.flops_per_token() / self.peak

    def _record(self, done_step: int, loss_array: jax.Array, timed: bool) -> None:
        loss = float(loss_array)
        now = time.perf_counter()
        mj = self.energy() if self.energy else None
        step_s = None
        # the first steps compile
        if timed and self.last_ready is not None and done_step - self.start > 2:
            step_s = now - self.last_ready
            self.timed_tokens, self.timed_s = self.timed_tokens + self.tokens, self.timed_s + step_s
            if mj is not None and self.energy_at is not None:
                self.timed_mj += mj - self.energy_at
        self.last_ready, self.energy_at = now, mj
        if not math.isfinite(loss):
            raise FloatingPointError(f"{self.precision}: loss is {loss} at step {done_step}")
        tps = self.timed_tokens / self.timed_s if self.timed_s else None
        mfu = self._mfu(tps)
        self.history.append(
            dict(step=done_step, loss=loss, tokens_per_s=tps, mfu=mfu, step_s=step_s)
        )
        self.tb.scalars(done_step, dict(loss=loss, tokens_per_s=tps, mfu=mfu, step_s=step_s))
        self._show(self.history[-1])

    def _show(self, h: dict) -> None:
        """The progress bar at ``h``'s step, with its metrics."""
        if self.bar.disable:
            return
        parts = [f"loss {h['loss']:.4f}"]
        if h.get("val_loss") is not None:
            parts.append(f"val {h['val_loss']:.4f}")
        if h.get("tokens_per_s"):
            parts.append(f"{h['tokens_per_s'] / 1e3:.1f}k tok/s")
        if h.get("mfu") is not None:
            parts.append(f"MFU {100 * h['mfu']:.1f}%")
        self.bar.set_postfix_str(" | ".join(parts), refresh=False)
        self.bar.update(h["step"] - self.bar.n)

    def _report_eval(self, h: dict) -> None:
        self.tb.scalars(h["step"], dict(val_loss=h["val_loss"]))
        if not self.bar.disable:
            self._show(h)
        elif not self.quiet:  # not a terminal: one plain line per evaluation
            tps = f", {h['tokens_per_s'] / 1e3:.1f}k tok/s" if h.get("tokens_per_s") else ""
            print(
                f"{self.precision} step {h['step']}/{self.run.steps}: loss {h['loss']:.4f}, "
                f"val {h['val_loss']:.4f}{tps}",
                file=sys.stderr,
                flush=True,
            )

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
            interrupts.check()  # Ctrl-C: stop here, between steps
            if interrupt_at is not None and self.step == interrupt_at:
                raise interrupts.Interrupted
            host = self.corpus.batch(run.seed, self.step, run.batch, run.model.seq)
            loss_array = self.trainer.step(self.trainer.device_batch(host))
            self.step += 1
            if self.pending is not None:
                self._record(*self.pending, timed=True)
            self.pending = (self.step, loss_array)
            evaluate = self.step % run.eval_every == 0 or self.step == run.steps
            save = (
                run.checkpoint_every
                and self.step % run.checkpoint_every == 0
                and self.step < run.steps
            )
            if evaluate or save:
                self._flush()
                if evaluate:
                    last = self.history[-1]
                    last["val_loss"] = self.trainer.eval(self.val_batches)
                    self._report_eval(last)
                if save:
                    self._save()
                self.last_ready = None  # the next step's time would include the eval / the save
        self._flush()

    def _save(self) -> None:
        """Checkpoint this step, its history and the run's config together."""
        args = (self.out, self.precision, self.step, self.trainer, self.history, self.config)
        save_checkpoint(*args)

    def interrupt(self) -> str | None:
        """Ctrl-C (between steps: `interrupts`): record every step that ran and checkpoint,
        so ``--resume`` continues from here with no step missing. Returns what was saved.
        A run that had finished is left as it is (its result is whole)."""
        if self.step >= self.run.steps and self.pending is None:
            return None
        self.interrupted = True
        pending = self.pending
        if pending is not None and not (self.history and self.history[-1]["step"] == pending[0]):
            self._record(*pending, timed=False)
        self.pending = None
        self.bar.close()
        if self.step == self.start:  # no step ran (--remat auto compiles before the first)
            return None
        self._save()
        return f"{self.precision} step {self.step}"

    def peak_mem(self, alone: bool) -> tuple[float | None, str]:
        """(peak MiB, its source): on a GPU the allocator's peak (the largest of this
        process's devices of the step) where it grew during this run and no other run's
        arrays shared the device (``alone``: not ``--interleave``d), else the compiled step's
        memory analysis (`Trainer.peak_mem_mb`)."""
        peak = allocator_peak_bytes(self.trainer.devices())
        if alone and peak is not None and (self.peak_before is None or peak > self.peak_before):
            return peak / 2**20, "allocator"
        compiled = self.trainer.peak_mem_mb() if self.trainer.compiled is not None else None
        return compiled, "compiled"

    def result(self, alone: bool = True) -> dict:
        """The run's result (`train`'s); ``alone``: no other run's arrays were on the device
        (for ``peak_mem_mb``: `peak_mem`)."""
        # --checkpoint-every 0: none (benchmarks)
        if not self.interrupted and self.run.checkpoint_every:
            self._save()
        self.bar.close()
        self.tb.close()
        trainer = self.trainer
        vals = [h["val_loss"] for h in self.history if "val_loss" in h]
        tps = self.timed_tokens / self.timed_s if self.timed_s else None
        steps_timed = self.timed_tokens / self.tokens
        joules = self.timed_mj / 1e3 / steps_timed if (self.energy and steps_timed) else None
        gemms = trainer.gemms
        peak, peak_source = self.peak_mem(alone)
        return dict(
            precision=self.precision,
            steps=self.step,
            interrupted=self.interrupted,
            history=self.history,
            final_loss=self.history[-1]["loss"] if self.history else None,
            val_loss=vals[-1] if vals else None,
            tokens_per_s=tps,
            mfu=self._mfu(tps),
            joules_per_step=joules,
            mean_power_w=(joules * tps / self.tokens) if (joules and tps) else None,
            compile_s=sum(trainer.compile_times.values()) if trainer.compile_times else None,
            lower_s=trainer.compile_times.get("lower_s") if trainer.compile_times else None,
            gemms=len(gemms),
            fp8_gemms=sum(g.is_fp8 for g in gemms),
            gemm_census=trainer.gemm_census,
            peak_mem_mb=peak,
            peak_mem_source=peak_source,
            compiled_mem_mb=trainer.peak_mem_mb() if trainer.compiled is not None else None,
            remat=self.remat,  # --remat auto: the choice
            remat_tried=self.remat_tried,  # --remat auto: the step's bytes of each choice tried
            **(trainer.residuals or dict(saved_residual_mb=None, saved_residuals=None)),
        )


def train(
    run: RunConfig,
    precision: str,
    corpus,
    out: Path,
    *,
    resume: bool = False,
    quiet: bool = False,
    interrupt_at: int | None = None,
    mesh: Mesh | None = None,
    tensorboard: bool = True,
) -> dict:
    """Train one precision to the end; returns its result dict (``history`` holds per-step
    metrics). ``interrupt_at`` simulates Ctrl-C at that step (for tests); ``mesh``: the
    devices to train on (None: the default device, unsharded).

    Arguments:
        run: the `RunConfig`.
        precision: ``"bf16"`` or ``"fp8"``.
        corpus: the `fp8jax.train._data.Corpus` (`load_corpus`): train and val bytes.
        out: the run directory (checkpoints, metrics, result JSON).
        resume: continue from the newest checkpoint in ``out``.
        quiet: print nothing per step.
        interrupt_at, mesh: as above.
        tensorboard: write TensorBoard events too.

    Returns:
        The result dict: the final metrics, timings and ``history``.
    """
    return train_interleaved(
        run,
        [precision],
        corpus,
        out,
        chunk=0,
        resume={precision: resume},
        quiet=quiet,
        interrupt_at=interrupt_at,
        mesh=mesh,
        tensorboard=tensorboard,
    )[precision]


def train_interleaved(
    run: RunConfig,
    precisions: list[str],
    corpus,
    out: Path,
    *,
    chunk: int,
    resume: dict[str, bool] | None = None,
    quiet: bool = False,
    interrupt_at: int | None = None,
    mesh: Mesh | None = None,
    tensorboard: bool = True,
) -> dict[str, dict]:
    """Train the precisions together, ``chunk`` steps of each in turn (0: each to the end in
    one go), same seed and data order; the models and optimizer states of all of them stay
    on the device. ``resume[p]`` continues precision ``p`` from its newest checkpoint."""
    resume = resume or {}
    runs = [
        TrainRun(
            run,
            p,
            corpus,
            out,
            resume=resume.get(p, False),
            quiet=quiet,
            mesh=mesh,
            tensorboard=tensorboard,
            position=i,
        )
        for i, p in enumerate(precisions)
    ]
    chunk = chunk or run.steps
    with interrupts.deferred():  # Ctrl-C stops between steps; a second one raises at once
        try:
            while not all(r.done for r in runs):
                for r in runs:
                    if not r.done:
                        r.advance(r.step + chunk, interrupt_at)
            # one that came in the last step's eval or save stays requested (`cli` stops there)
        except interrupts.Interrupted:
            saved = [s for s in (r.interrupt() for r in runs) if s]
            if jax.process_index() == 0 and any(r.interrupted for r in runs):
                print(
                    f"\ninterrupted: checkpoint of {', '.join(saved)} written to {out}; continue "
                    "with --resume"
                    if saved
                    else "\ninterrupted before the first step: nothing to checkpoint",
                    file=sys.stderr,
                )
    return {r.precision: r.result(alone=len(runs) == 1) for r in runs}
