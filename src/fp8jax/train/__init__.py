"""The end-to-end example: a transformer trained in bf16 and FP8 (``fp8jax-train``), on bytes
or a tokenizer's tokens.

Import from `fp8jax.train` itself (its ``__all__``); the modules are its implementation:

- `_config`: the presets and `RunConfig`; the model and optimizer built from them.
- `_model`: the decoder-only transformer (`ModelConfig`, `Transformer`).
- `_data`: the byte-level corpus (the standard library's sources, or ``--data``).
- `_tokenizer`: ``--tokenizer``: bytes, a BPE trained on the corpus, or a tokenizer.json.
- `_mesh`: ``--mesh``: the device mesh, the model's placement, multi-host start.
- `_trainer`: `Trainer` (a model's jitted train and eval steps, on one device or a mesh).
- `_loop`: `TrainRun` (one precision's run) and `train`.
- `_checkpoint`: orbax checkpoints, with the metric history and the config.
- `_interrupts`: Ctrl-C, acted on between steps.
- `_census`: how many of the step's GEMM calls run in FP8.
- `_metering`: peak FLOP/s (for MFU) and the GPU's energy counter.
- `_memory`: the residuals the step's backward keeps (by dtype) and the allocator's peak.
- `_report`: the summary table, CSV/JSON metrics, loss plot, TensorBoard events.
- `_resume`: ``--resume``: which precisions are done or continue, and the options check.
- `_rundir`: ``--out``: ownership, atomic writes, the stored options.
- `_options`: the command-line options (``--help``).
- `_cli`: ``fp8jax-train``'s `main`.
- `_launch`: ``--processes N``: one process per GPU on one host.
- `_generate`: ``fp8jax-generate``: prefill + KV-cache decode of a trained model.
- `__main__`: ``python -m fp8jax.train``.
"""

from ._cli import main
from ._config import PRESETS, RunConfig
from ._loop import train
from ._model import ModelConfig, Transformer
from ._trainer import Trainer

__all__ = ["PRESETS", "ModelConfig", "RunConfig", "Trainer", "Transformer", "main", "train"]
