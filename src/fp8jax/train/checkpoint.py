"""Orbax checkpoints of a `Trainer` (parameters, FP8 state and optimizer state) under
``<out>/ckpt-<precision>/<step>``, with the metric history beside them. Arrays are saved
sharded as they are placed, and restored onto the trainer's own placement, which may be
another mesh (``--mesh fsdp=8`` saved, ``--mesh data=2,fsdp=4`` restored)."""

from __future__ import annotations

import json
from pathlib import Path

import jax


def _manager(out: Path, precision: str):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        (out / f"ckpt-{precision}").resolve(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True),
    )


def save_checkpoint(out: Path, precision: str, step: int, trainer, history: list[dict]) -> None:
    """Save ``trainer``'s state as ``step`` (every process takes part; process 0 writes
    the history)."""
    import orbax.checkpoint as ocp

    mngr = _manager(out, precision)
    if step in mngr.all_steps():  # e.g. interrupted right after a scheduled save
        return
    state = dict(params=trainer.params, opt_state=trainer.opt_state)
    mngr.save(step, args=ocp.args.StandardSave(state), force=True)
    mngr.wait_until_finished()
    if jax.process_index() == 0:
        (out / f"history-{precision}.json").write_text(json.dumps(history))


def has_checkpoint(out: Path, precision: str) -> bool:
    path = out / f"ckpt-{precision}"
    return path.is_dir() and any(child.name.isdigit() for child in path.iterdir())


def _target(x):
    """What to restore ``x`` as: its shape, dtype and sharding (the trainer's mesh)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def restore_checkpoint(out: Path, precision: str, trainer) -> tuple[int, list[dict]]:
    """Restore the newest checkpoint into ``trainer``, each array onto the sharding the
    trainer gave it; returns (step, metric history)."""
    import orbax.checkpoint as ocp

    mngr = _manager(out, precision)
    step = mngr.latest_step()
    if step is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {out / f'ckpt-{precision}'}")
    state = dict(params=trainer.params, opt_state=trainer.opt_state)
    target = jax.tree_util.tree_map(_target, state)
    restored = mngr.restore(step, args=ocp.args.StandardRestore(target))
    trainer.params, trainer.opt_state = restored["params"], restored["opt_state"]
    path = out / f"history-{precision}.json"
    history = json.loads(path.read_text()) if path.exists() else []
    return step, [h for h in history if h["step"] <= step]
