"""`Trainer`: the jitted train and eval steps of one model, on one device or a mesh (its
parameters and optimizer state placed, its batches put, its step compiled and measured), and
the loss and step it jits (`lm_loss`, `make_train_step`)."""

from __future__ import annotations

import time

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._grad_overwrite import optax_step, trainable
from ..nn._losses import cross_entropy
from ._census import step_gemms
from ._config import compute_dtype
from ._memory import compiled_bytes, saved_residuals
from ._mesh import batch_sharding, place_model, put_batch
from ._model import cast_for_compute


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
        tp_overlap: its token moves whole (``"none"``) or as collective matmuls (``"ring"``,
            ``"chunks"``).
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
        """The compiled step's memory analysis (arguments + outputs + temporaries, less the
        outputs that reuse the donated parameters and optimizer state, per device) in MiB;
        None where the backend has none."""
        nbytes = compiled_bytes(self.compiled, donated=True)
        return None if nbytes is None else nbytes / 2**20
