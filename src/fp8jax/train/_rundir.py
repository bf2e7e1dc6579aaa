"""``--out`` of ``fp8jax-train``: whose it is, what may be written or deleted there, and
the run config a ``--resume`` is compared with.

A directory is one of the trainer's runs when it holds `MARKER` (``fp8jax-run.json``: the
config of each precision's run). A fresh run into any other non-empty directory is refused
(unless ``--overwrite``), and even then only the files the trainer knows by name are
replaced: a user's files are never deleted. Records are written atomically (temporary file,
then `os.replace`), so a kill leaves the old file or the new one, never half of one."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
from pathlib import Path

MARKER = "fp8jax-run.json"
PROBE = ".fp8jax-probe"


class UsageError(ValueError):
    """A bad option value, found before anything is written: `main` raises it to callers in
    Python; on the command line it is a usage error (message on stderr, exit status 2)."""


def atomic_write_text(path: Path, text: str) -> None:
    """``path`` holds ``text``, written to a temporary file beside it first: readers (and a
    ``--resume`` after a kill) see the old content or the new, never a truncated file."""
    _atomic_write(path, text, dict(mode="w", newline=""))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """``path`` holds ``data``, written as `atomic_write_text` writes."""
    _atomic_write(path, data, dict(mode="wb"))


def _atomic_write(path: Path, data, mode: dict) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, **mode) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_json(path: Path):
    """``path``'s JSON; a damaged file is one line naming it (not a JSONDecodeError)."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path} is damaged (not valid JSON: {e}); move it away") from None


# ----------------------------------------------------------------------------- --out
def is_run(out: Path) -> bool:
    return (out / MARKER).is_file()


def has_checkpoint(out: Path, precision: str) -> bool:
    path = out / f"ckpt-{precision}"
    return path.is_dir() and any(child.name.isdigit() for child in path.iterdir())


def _legacy_run(out: Path) -> bool:
    """A run written before `MARKER` existed: its checkpoints or results."""
    names = ("ckpt-bf16", "ckpt-fp8", "result-bf16.json", "result-fp8.json")
    return any((out / name).exists() for name in names)


def prepare_out(out: Path, *, resume: bool, overwrite: bool) -> list[Path]:
    """Check ``out`` before the corpus is read or a model built: ``--resume`` needs one of
    the trainer's runs there; a fresh run needs an absent or empty directory or a run
    (else ``--overwrite``). Creates it and checks it is writable (a probe file, removed).
    Returns the directories created, for `remove_created` should a later check fail."""
    if resume:
        if not out.exists():
            raise UsageError(f"--resume: --out {out} does not exist (no checkpoint to resume)")
        if not out.is_dir():
            raise UsageError(f"--resume: --out {out} is not a directory")
        if not (is_run(out) or _legacy_run(out)):
            raise UsageError(
                f"--resume: --out {out} is not an fp8jax-train run (no {MARKER}, no checkpoint)"
            )
    elif out.exists():
        if not out.is_dir():
            raise UsageError(f"--out {out}: exists and is not a directory")
        try:
            entries = [p for p in out.iterdir() if not p.name.startswith(PROBE)]
        except OSError as e:
            raise UsageError(f"--out {out}: cannot read the directory: {e.strerror}") from None
        if entries and not is_run(out) and not overwrite:
            raise UsageError(
                f"--out {out} is not empty and not an fp8jax-train run (no {MARKER}): "
                "refusing to write there; choose a new or empty directory, or pass "
                "--overwrite (only the trainer's own files are then replaced)"
            )
    created = _make_dirs(out)
    try:
        _probe(out)
    except UsageError:
        remove_created(created)
        raise
    return created


def _make_dirs(out: Path) -> list[Path]:
    missing, path = [], out.absolute()
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = e.strerror or e
        raise UsageError(f"--out {out}: cannot create the output directory: {why}") from None
    return missing[::-1]


def _probe(out: Path) -> None:
    """Write and remove a file in ``out``: a read-only ``--out`` fails here, not after
    training (at the first checkpoint, or in TensorBoard's writer)."""
    probe = out / f"{PROBE}-{socket.gethostname()}-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"--out {out}: not writable: {e.strerror or e}") from None


def remove_created(created: list[Path]) -> None:
    """Remove the directories `prepare_out` created, innermost first, if still empty."""
    for path in reversed(created):
        try:
            path.rmdir()
        except OSError:
            return


_STEP_DIR = re.compile(r"^\d+(\.orbax-checkpoint-tmp.*)?$")
_EVENTS = re.compile(r"^events\.out\.tfevents\.")


def clear_outputs(out: Path, precision: str) -> None:
    """Before a fresh run of ``precision``: delete what an earlier run of it wrote (its
    checkpoint steps, TensorBoard events, result and history), known by name; any other
    file stays, and so do directories left non-empty."""
    for name in (f"result-{precision}.json", f"history-{precision}.json"):
        (out / name).unlink(missing_ok=True)
    ckpt, tb = out / f"ckpt-{precision}", out / "tb" / precision
    if ckpt.is_dir():
        for child in ckpt.iterdir():
            if _STEP_DIR.match(child.name) and child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
    if tb.is_dir():
        for child in tb.iterdir():
            if _EVENTS.match(child.name) and child.is_file():
                child.unlink()
    for path in (ckpt, tb, out / "tb"):
        try:
            path.rmdir()
        except OSError:
            pass


# ----------------------------------------------------------------------------- run config
# Options a checkpoint cannot be resumed with another value of: the parameters' shapes, the
# model's function, the tokens it reads, the FP8 state (the last four: fp8 runs only). Any
# other option (schedule, batch, seed, kernels, placement) is applied from the resumed step on,
# with a notice.
MODEL_KEYS = (
    "dim", "layers", "heads", "kv_heads", "ffn", "seq", "experts", "top_k",
    "aux_loss_coef", "rope_base", "vocab", "precision",
    "tokenizer", "tokenizer_vocab", "tokenizer_sha256",
)  # fmt: skip
FP8_KEYS = ("scaling", "recipe", "selective", "fp8_attention")
FP8_ONLY = (*FP8_KEYS, "fast_accumulation", "cast_kernel", "fp8_head")
_OPTION = dict(
    selective="--fp8-everywhere (selective)",
    cast_kernel="--cast-kernel",
    tokenizer_vocab="the tokenizer's vocabulary",
    tokenizer_sha256="the tokenizer's sha256",
)
_NO_OPTION = ("aux_loss_coef", "rope_base")


def config_record(run, precision: str) -> dict:
    """``run``'s options as one flat JSON object (what a checkpoint and `MARKER` store)."""
    record = {k: v for k, v in dataclasses.asdict(run).items() if k != "model"}
    record.update(dataclasses.asdict(run.model))
    for derived in ("moe_fp8", "attention"):  # set by build_model from the options above
        record.pop(derived, None)
    record.update(precision=precision)
    return record


def option_name(key: str) -> str:
    if key in _OPTION:
        return _OPTION[key]
    if key in _NO_OPTION:
        return f"{key} (of --preset)"
    return "--" + key.replace("_", "-")


def config_diff(stored: dict, now: dict) -> tuple[list[str], list[str]]:
    """(model options, other options) whose values differ, each as ``--opt OLD -> NEW``."""
    fp8 = now.get("precision") == "fp8"
    model, other = [], []
    for key in sorted(set(stored) | set(now), key=lambda k: (k not in MODEL_KEYS, k)):
        if key in FP8_ONLY and not fp8:
            continue
        if key not in stored or key not in now:  # an option newer than the record
            continue
        if stored[key] != now[key]:
            text = f"{option_name(key)} {stored[key]} -> {now[key]}"
            (model if key in MODEL_KEYS or key in FP8_KEYS else other).append(text)
    return model, other


def read_marker(out: Path) -> dict:
    path = out / MARKER
    return read_json(path) if path.is_file() else {}


def write_marker(out: Path, configs: dict[str, dict], command: str) -> None:
    """Record ``configs`` (precision -> `config_record`) in ``out``'s `MARKER`, keeping the
    other precisions' entries."""
    marker = read_marker(out)
    runs = marker.get("runs", {})
    for precision, config in configs.items():
        runs[precision] = dict(config, command=command)
    text = json.dumps({"fp8jax-train": 1, "runs": runs}, indent=1, sort_keys=True)
    atomic_write_text(out / MARKER, text + "\n")
