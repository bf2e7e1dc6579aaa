"""Orbax checkpoints of a `Trainer` (parameters, FP8 state and optimizer state) under
``<out>/ckpt-<precision>/<step>``. Each step also holds the metric history up to it and
the run's config (`rundir.config_record`), committed with the arrays: a kill at any moment
leaves a step with its whole history, and ``--resume`` compares its options with the
config. Arrays are saved sharded as they are placed, and restored onto the trainer's own
placement, which may be another mesh (``--mesh fsdp=8`` saved, ``data=2,fsdp=4``
restored) or another number of processes (each writes and reads its own shards). Steps
written before histories moved inside them (one ``default`` item, the history in
``history-<precision>.json``) still restore, and so do steps written before an FP8 state
carried a guard (`fp8jax._guard`: its guard starts fresh)."""

from __future__ import annotations

import json
from pathlib import Path

import jax

from ._rundir import UsageError, atomic_write_text, has_checkpoint, read_json

__all__ = ["has_checkpoint", "restore_checkpoint", "save_checkpoint", "stored_config"]


def _manager(out: Path, precision: str, create: bool = True):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        (out / f"ckpt-{precision}").resolve(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=create),
    )


def save_checkpoint(
    out: Path,
    precision: str,
    step: int,
    trainer,
    history: list[dict],
    config: dict | None = None,
) -> None:
    """Save ``trainer``'s state as ``step``, with ``history`` and the run's ``config``
    (every process takes part; process 0 also writes ``history-<precision>.json``)."""
    import orbax.checkpoint as ocp

    mngr = _manager(out, precision)
    if step in mngr.all_steps():  # e.g. interrupted right after a scheduled save
        return
    state = dict(params=trainer.params, opt_state=trainer.opt_state)
    items = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        history=ocp.args.JsonSave(list(history)),
        config=ocp.args.JsonSave(dict(config or {})),
    )
    mngr.save(step, args=items, force=True)
    mngr.wait_until_finished()
    if jax.process_index() == 0:  # a copy to read; --resume reads the checkpoint's own
        atomic_write_text(out / f"history-{precision}.json", json.dumps(history))


def _legacy(out: Path, precision: str, step: int) -> bool:
    return (out / f"ckpt-{precision}" / str(step) / "default").is_dir()


def stored_config(out: Path, precision: str) -> dict | None:
    """The config saved with ``precision``'s newest checkpoint (None: no checkpoint, or
    one written before configs were saved)."""
    import orbax.checkpoint as ocp

    if not has_checkpoint(out, precision):
        return None
    mngr = _manager(out, precision, create=False)
    step = mngr.latest_step()
    if step is None or _legacy(out, precision, step):
        return None
    restored = mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    return restored["config"] or None


def _stored_tree(path: Path):
    """The checkpoint's array metadata tree (nested dicts), or None where unreadable."""
    import orbax.checkpoint as ocp

    try:
        stored = ocp.StandardCheckpointHandler().metadata(path)
    except Exception:  # no readable metadata: let the restore say what is wrong
        return None
    return getattr(stored, "tree", stored)


def _names(path) -> tuple:
    """A key path as plain names (a module's attribute and a dict's key alike)."""
    return tuple(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


def _missing_guards(stored, target) -> set:
    """Paths of ``target``'s FP8 state guards that ``stored`` lacks: a checkpoint written
    before those states carried a guard (`fp8jax._guard`; attention's since 2026-11-28)."""
    if not isinstance(stored, dict):
        return set()
    have = {_names(p) for p, _ in jax.tree_util.tree_flatten_with_path(stored)[0]}
    want = [_names(p) for p, _ in jax.tree_util.tree_flatten_with_path(target)[0]]
    return {p for p in want if p[-1] == "guard" and p not in have}


def _check_shapes(path: Path, tree, target) -> None:
    """Refuse the checkpoint at ``path`` (its metadata ``tree``, `_stored_tree`'s) whose arrays
    have other shapes than ``target``'s, before orbax tries (it fails with a ValueError per
    array, logged again by asyncio as tracebacks)."""
    if tree is None:
        return

    def shapes(t):
        leaves = jax.tree_util.tree_leaves(t)
        return sorted(tuple(x.shape) for x in leaves if hasattr(x, "shape"))

    have, want = shapes(tree), shapes(target)
    if have and have != want:
        raise UsageError(
            f"--resume: {path.parent} holds a model of other shapes than these options give "
            "(a run from before configs were stored with checkpoints: give the options it "
            "was trained with)"
        )


def _target(x):
    """What to restore ``x`` as: its shape, dtype and sharding (the trainer's mesh)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def restore_checkpoint(out: Path, precision: str, trainer) -> tuple[int, list[dict]]:
    """Restore the newest checkpoint into ``trainer``, each array onto the sharding the
    trainer gave it; returns (step, metric history up to that step)."""
    import orbax.checkpoint as ocp

    mngr = _manager(out, precision)
    step = mngr.latest_step()
    if step is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {out / f'ckpt-{precision}'}")
    state = dict(params=trainer.params, opt_state=trainer.opt_state)
    target = jax.tree_util.tree_map(_target, state)
    where = out / f"ckpt-{precision}" / str(step)
    item = "default" if _legacy(out, precision, step) else "state"
    stored = _stored_tree((where / item).resolve())
    # FP8 state guards the checkpoint predates: restored without them, then fresh ones
    missing = _missing_guards(stored, target)
    if missing:
        target = jax.tree_util.tree_map_with_path(
            lambda p, x: None if _names(p) in missing else x, target
        )
    _check_shapes((where / item).resolve(), stored, target)
    try:
        if _legacy(out, precision, step):
            restored = mngr.restore(step, args=ocp.args.StandardRestore(target))
            path = out / f"history-{precision}.json"
            history = read_json(path) if path.exists() else []
        else:
            args = ocp.args.Composite(
                state=ocp.args.StandardRestore(target), history=ocp.args.JsonRestore()
            )
            restored = mngr.restore(step, args=args)
            history, restored = restored["history"], restored["state"]
    except ValueError as e:  # e.g. another --dim: "Requested shape ... is not compatible"
        if isinstance(e, UsageError):
            raise
        why = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
        raise UsageError(
            f"--resume: {where} does not fit the model of these options ({why})"
        ) from None
    params = restored["params"]
    if missing:  # the trainer's own fresh guards where the checkpoint has none
        fresh = {_names(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}

        def fill(p, x):
            key = ("params", *_names(p))
            return fresh[key] if x is None and key in missing else x

        params = jax.tree_util.tree_map_with_path(fill, params, is_leaf=lambda x: x is None)
    trainer.params, trainer.opt_state = params, restored["opt_state"]
    return step, [h for h in history if h["step"] <= step]
