"""The training loop: `Trainer` (the jitted train and eval steps of one model, on one
device or a mesh), `TrainRun` (one precision's run: timing, evaluation, checkpoints,
progress) and `train` / `train_interleaved`."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from .._grad_overwrite import optax_step, trainable
from ..nn._losses import cross_entropy
from . import _interrupts as interrupts
from ._census import step_gemms
from ._checkpoint import restore_checkpoint, save_checkpoint
from ._config import RunConfig, build_model, compute_dtype, make_optimizer
from ._memory import allocator_peak_bytes, choose_remat, compiled_bytes, saved_residuals
from ._mesh import batch_sharding, check_batch, place_model, put_batch
from ._metering import energy_counter, peak_flops
from ._model import AUTO, REMAT, cast_for_compute
from ._report import TensorBoardLog
from ._rundir import clear_outputs, config_record


def lm_loss(model, batch, with_aux: bool = True):
    """Next-byte cross-entropy, plus the MoE load-balancing loss when training."""
    logits, aux = cast_for_compute(model, compute_dtype()).forward(batch[:, :-1], None)
    loss = cross_entropy(logits, batch[:, 1:]).mean()
    return loss + aux if with_aux else loss


def _shardings(tree):
    return jax.tree_util.tree_map(lambda x: x.sharding, tree)


def _init_sharded(optimizer, trainable_params, mesh: Mesh):
    """``optimizer.init`` with each state array placed like the parameter it mirrors (a
    moment of ``blocks.mlp.fc1.weight`` like that weight: its key path ends with the
    parameter's); anything else (step counts) replicated. A plain jitted init leaves
    arrays that depend on no input on one device."""
    params = [
        (jax.tree_util.keystr(p), x)
        for p, x in jax.tree_util.tree_flatten_with_path(trainable_params)[0]
    ]
    replicated = NamedSharding(mesh, P())

    def sharding(path, leaf):
        key = jax.tree_util.keystr(path)
        match = [(p, x) for p, x in params if key.endswith(p) and x.shape == leaf.shape]
        if not match:
            return replicated
        return max(match, key=lambda m: len(m[0]))[1].sharding  # the longest path that fits

    shapes = jax.eval_shape(optimizer.init, trainable_params)
    out = jax.tree_util.tree_map_with_path(sharding, shapes)
    return jax.jit(optimizer.init, out_shardings=out)(trainable_params)


def _remat_loss(remat: str | None):
    """`lm_loss` keeping what ``remat`` says for the backward (None: the model's own ``remat``).
    The model's arrays and structure stay as they are: only the loss's trace changes."""
    if remat is None:
        return lm_loss
    return lambda model, batch: lm_loss(model.with_remat(remat), batch)


def make_train_step(optimizer, static, remat: str | None = None):
    """``(params, opt_state, batch) -> (params, opt_state, loss)``: one optimizer step of
    the language model whose non-array part is ``static`` (what `Trainer` jits; the compile
    benchmark lowers it from abstract shapes); ``remat``: what the backward keeps (`REMAT`;
    None: the model's own choice)."""
    loss_fn = _remat_loss(remat)

    def train_step(params, opt_state, batch):
        model = eqx.combine(params, static)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
        model, opt_state = optax_step(optimizer, model, grads, opt_state)
        return eqx.filter(model, eqx.is_array), opt_state, loss

    return train_step


class Trainer:
    """Jitted train and eval steps for one model/optimizer (compiled once; the compiled
    step also gives the memory analysis). With a ``mesh``, the model is placed on it
    (`place_model`) and batches are split over its data and fsdp axes; the step keeps
    every array where it was placed.

    Arguments:
        model: the `Transformer` (bf16 or converted to FP8).
        optimizer: an optax transformation (`make_optimizer`'s).
        mesh: the devices to train on (None: the default device, unsharded).
        sequence_parallel: Megatron sequence parallelism over the mesh's tensor axis.
        tp_overlap: its token moves whole (``"none"``) or as collective matmuls (``"ring"``).
    """

    def __init__(
        self, model, optimizer, mesh: Mesh | None = None, sequence_parallel=False, tp_overlap="none"
    ):
        self.optimizer, self.mesh, self.sequence_parallel = optimizer, mesh, sequence_parallel
        self.tp_overlap = tp_overlap
        self.batch_sharding = batch_sharding(mesh) if mesh is not None else None
        model = self._place(model)
        self.static = eqx.partition(model, eqx.is_array)[1]
        self.load(model)
        self.remat: str | None = None  # `set_remat`'s (None: the model's own)
        self._jit()
        self.compile_times: dict[str, float] | None = None
        self.gemms, self.gemm_census = [], None
        # `saved_residuals` of the step and the seconds its trace took, set by `compile`
        self.residuals: dict | None = None
        self.residuals_s: float | None = None

    def _jit(self) -> None:
        """The jitted steps of ``static`` (not compiled yet)."""
        static, mesh = self.static, self.mesh
        train_step = make_train_step(self.optimizer, static, self.remat)

        def eval_step(params, batch):
            return lm_loss(eqx.combine(params, static), batch, with_aux=False)

        if mesh is None:
            self._train = jax.jit(train_step, donate_argnums=(0, 1))
            self._eval = jax.jit(eval_step)
        else:  # outputs stay where the inputs are: the compiled step takes its own outputs
            scalar = NamedSharding(mesh, P())
            out = (_shardings(self.params), _shardings(self.opt_state), scalar)
            self._train = jax.jit(train_step, donate_argnums=(0, 1), out_shardings=out)
            self._eval = jax.jit(eval_step, out_shardings=scalar)
        self.compiled = None

    def set_remat(self, remat: str) -> None:
        """Rebuild the train step keeping what ``remat`` (`REMAT`) says for the backward
        (``--remat auto``: `choose_remat`); the parameters and optimizer state stay as they
        are (the model's own ``remat`` too: part of their tree structure)."""
        self.remat = remat
        self._jit()

    def batch_spec(self, batch: int, seq: int) -> jax.ShapeDtypeStruct:
        """The abstract token batch of ``batch`` sequences of ``seq`` tokens (and the next
        one), placed as `device_batch` places it: to compile the step before any batch."""
        sharding = {} if self.mesh is None else dict(sharding=self.batch_sharding)
        return jax.ShapeDtypeStruct((batch, seq + 1), np.int32, **sharding)

    def _place(self, model):
        if self.mesh is None:
            return model
        return place_model(model, self.mesh, self.sequence_parallel, self.tp_overlap)

    def load(self, model) -> None:
        """Take ``model``'s arrays as the parameters, with a fresh optimizer state. The compiled
        step stays, so ``model`` must have the structure the trainer was built with."""
        if self.mesh is None:
            self.params = eqx.filter(model, eqx.is_array)
            self.opt_state = self.optimizer.init(trainable(model))
            return
        model = self._place(model)
        self.params = eqx.filter(model, eqx.is_array)
        self.opt_state = _init_sharded(self.optimizer, trainable(model), self.mesh)

    def device_batch(self, batch: np.ndarray) -> jax.Array:
        """A host batch on the trainer's device(s)."""
        if self.mesh is None:
            return jax.numpy.asarray(batch)
        return put_batch(batch, self.batch_sharding)

    def lower(self, batch):
        """The train step lowered for ``batch`` (an array, or a ``jax.ShapeDtypeStruct`` with
        the trainer's `batch_sharding` on a mesh): compile it to read its memory analysis."""
        return self._train.lower(self.params, self.opt_state, batch)

    def compile(self, batch) -> None:
        """Lower and compile the train step for ``batch``'s shape; ``compile_times`` holds the
        seconds each took (compiling includes XLA's GEMM autotuning). Also traces the loss
        once for what its backward keeps (``residuals``: `saved_residuals`)."""
        t0 = time.perf_counter()
        self.residuals = self.saved_residuals(batch)
        self.residuals_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        lowered = self.lower(batch)
        t1 = time.perf_counter()
        self.compiled = lowered.compile()
        self.compile_times = dict(lower_s=t1 - t0, compile_s=time.perf_counter() - t1)
        # The step's GEMM calls, FP8 ones marked (cuDNN attention counts as one): `census`.
        platform = jax.devices()[0].platform
        self.gemms, self.gemm_census = step_gemms(lowered, self.compiled, platform)

    def step(self, batch):
        if self.compiled is None:
            self.compile(batch)
        self.params, self.opt_state, loss = self.compiled(self.params, self.opt_state, batch)
        return loss

    def eval(self, batches) -> float:
        return float(np.mean([float(self._eval(self.params, b)) for b in batches]))

    def saved_residuals(self, batch) -> dict:
        """`saved_residuals` of the step's loss on ``batch`` with the current parameters
        (traced only): ``saved_residual_mb`` and ``saved_residuals`` (MiB by dtype)."""
        if isinstance(batch, jax.ShapeDtypeStruct):  # traced with its shape only
            batch = np.zeros(batch.shape, batch.dtype)
        model = eqx.combine(self.params, self.static)
        return saved_residuals(_remat_loss(self.remat), model, batch)

    def devices(self) -> list:
        """The devices the step runs on (this process's)."""
        if self.mesh is None:
            return [jax.devices()[0]]
        return [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]

    def peak_mem_mb(self) -> float | None:
        """The compiled step's memory analysis (arguments + outputs + temporaries, per
        device) in MiB; None where the backend has none."""
        nbytes = compiled_bytes(self.compiled)
        return None if nbytes is None else nbytes / 2**20


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
        model, optimizer = build_model(run, precision), make_optimizer(run)
        self.trainer = Trainer(model, optimizer, mesh, run.sequence_parallel, run.tp_overlap)
        self.start, self.history = (0, [])
        if resume:
            self.start, self.history = restore_checkpoint(out, precision, self.trainer)
        # --remat auto: chosen afresh (a resume too: on this device, at this batch), once the
        # checkpoint's arrays are in place
        self.remat, self.remat_tried = run.remat, None
        if run.remat == AUTO:
            self.remat, self.remat_tried, line = self._choose_remat()
            if main_process:
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

        return choose_remat(compile_with, trainer.devices(), REMAT)

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
        memory analysis (arguments + outputs + temporaries per device)."""
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
