"""``--resume`` and an ``--out`` that holds an earlier run: which precisions are done, which
continue from a checkpoint, and whether the stored options allow it."""

from __future__ import annotations

from pathlib import Path

from ._checkpoint import has_checkpoint, stored_config
from ._config import RunConfig
from ._rundir import UsageError, config_diff, config_record, read_json


def stored_options(out: Path, precision: str, marker: dict) -> dict | None:
    """``precision``'s stored options: its newest checkpoint's, else the run marker's."""
    return stored_config(out, precision) or marker.get("runs", {}).get(precision)


def check_resume(out: Path, run: RunConfig, precisions, marker: dict) -> list[str]:
    """``--resume``: each precision's stored options against these. A model option that
    differs is refused, naming each (the checkpoint would not fit, or would continue
    another model); any other is applied from the resumed step on: returns those notices."""
    notices = []
    for precision in precisions:
        stored = stored_options(out, precision, marker)
        if not stored:
            continue  # not started, or a run from before configs were stored
        model, other = config_diff(stored, config_record(run, precision))
        if model:
            command = marker.get("runs", {}).get(precision, {}).get("command")
            ran = f"; it ran as: {command}" if command else ""
            raise UsageError(
                f"--resume: the {precision} run in {out} has other model options (run's -> "
                f"given): {', '.join(model)}; resume with the run's options{ran}"
            )
        if other:
            notices.append(
                f"fp8jax-train --resume: {precision} continues with changed options (run's -> "
                f"given, applied from its checkpoint on): {', '.join(other)}"
            )
    return notices


def earlier_results(precisions, out: Path, run: RunConfig, marker: dict) -> dict[str, dict]:
    """Results of the other precision from an earlier invocation into the same --out (of the
    same model: another model's would make a meaningless comparison)."""
    results: dict[str, dict] = {}
    for name in ("bf16", "fp8"):
        path = out / f"result-{name}.json"
        if name not in precisions and path.exists():
            stored = stored_options(out, name, marker)
            if stored and config_diff(stored, config_record(run, name))[0]:
                continue
            results[name] = read_json(path)
    return results


def todo(args, precisions, out, run, marker) -> tuple[dict, list[str], dict[str, bool]]:
    """Results of these precisions finished before, the precisions to train, and which of
    them resume."""
    results: dict[str, dict] = {}
    todo = []
    for precision in precisions:
        done = out / f"result-{precision}.json"
        if args.resume and done.exists():
            previous = read_json(done)
            if previous["steps"] >= run.steps and not previous["interrupted"]:
                results[precision] = previous  # finished before the interruption
                continue
        todo.append(precision)
    # --resume continues what has a checkpoint; a precision the interruption came before starts
    # fresh (unless nothing has one or finished: then there is nothing to resume).
    started = [p for p in todo if has_checkpoint(out, p)]
    if args.resume and todo and not started and len(todo) == len(precisions):
        raise UsageError(f"--resume: no checkpoint in {out / f'ckpt-{todo[0]}'} to continue from")
    resume = {p: args.resume and p in started for p in todo}
    return results, todo, resume
