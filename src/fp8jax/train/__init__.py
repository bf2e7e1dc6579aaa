"""The end-to-end example: a byte-level transformer trained in bf16 and FP8 (``fp8jax-train``).

Modules by job: `config` (presets, `RunConfig`), `model`, `data`, `mesh` (``--mesh``,
placement, multi-host), `loop` (`Trainer`, `TrainRun`), `checkpoint` (orbax, with the
history and config), `interrupts` (Ctrl-C between steps), `census` (FP8 GEMM count),
`metering` (peak FLOP/s, energy), `report` (table, CSV, plot, TensorBoard), `rundir`
(``--out``: ownership, atomic writes, stored options), `options`, `cli` and `launch`
(``--processes N``: one process per GPU)."""

from .cli import main
from .config import PRESETS, RunConfig
from .loop import Trainer, train
from .model import ModelConfig, Transformer

__all__ = ["PRESETS", "ModelConfig", "RunConfig", "Trainer", "Transformer", "main", "train"]
