"""The end-to-end example: a transformer trained in bf16 and FP8 (``fp8jax-train``), on bytes
or a tokenizer's tokens.

Import from `fp8jax.train` itself (its ``__all__``); the modules are its implementation:

- `config`: the presets and `RunConfig`; the model and optimizer built from them.
- `model`: the decoder-only transformer (`ModelConfig`, `Transformer`).
- `data`: the byte-level corpus (the standard library's sources, or ``--data``).
- `tokenizer`: ``--tokenizer``: bytes, a BPE trained on the corpus, or a tokenizer.json.
- `mesh`: ``--mesh``: the device mesh, the model's placement, multi-host start.
- `loop`: `Trainer` (jitted steps), `TrainRun` (one precision's run) and `train`.
- `checkpoint`: orbax checkpoints, with the metric history and the config.
- `interrupts`: Ctrl-C, acted on between steps.
- `census`: how many of the step's GEMM calls run in FP8.
- `metering`: peak FLOP/s (for MFU) and the GPU's energy counter.
- `report`: the summary table, CSV/JSON metrics, loss plot, TensorBoard events.
- `resume`: ``--resume``: which precisions are done or continue, and the options check.
- `rundir`: ``--out``: ownership, atomic writes, the stored options.
- `options`: the command-line options (``--help``).
- `cli`: ``fp8jax-train``'s `main`.
- `launch`: ``--processes N``: one process per GPU on one host.
- `generate`: ``fp8jax-generate``: prefill + KV-cache decode of a trained model.
- `__main__`: ``python -m fp8jax.train``.
"""

from .cli import main
from .config import PRESETS, RunConfig
from .loop import Trainer, train
from .model import ModelConfig, Transformer

__all__ = ["PRESETS", "ModelConfig", "RunConfig", "Trainer", "Transformer", "main", "train"]
