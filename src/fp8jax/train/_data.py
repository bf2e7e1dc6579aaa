"""Byte-level corpus that needs no download: the Python standard library's own source
files (sorted paths, so the same on every machine with the same Python), or any text
file / directory given with ``--data``. `tokenizer.tokenize` turns its byte ids into a
tokenizer's."""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from pathlib import Path

import numpy as np

SEPARATOR = b"\n\x00\n"  # between files
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".toml", ".c", ".h", ".html", ".csv")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _files(root: Path) -> list[Path]:
    if not root.exists():
        raise FileNotFoundError(f"--data {root}: no such file or directory")
    if not root.is_dir():  # a file, or a device or pipe to read (/dev/stdin)
        return [root]
    default = root == stdlib_dir()
    files = []
    # os.walk without descending into what the default corpus skips: the stdlib directory
    # also holds site-packages, often many times the stdlib's own files.
    for dirpath, dirnames, filenames in os.walk(root):
        top = Path(dirpath) == root
        if default:
            dirnames[:] = [d for d in dirnames if not _skipped(d, top)]
        for name in filenames:
            path = Path(dirpath, name)
            if path.suffix in ((".py",) if default else TEXT_SUFFIXES) and path.is_file():
                files.append(path)
    if not files:
        raise ValueError(f"--data {root}: no text files ({', '.join(TEXT_SUFFIXES)}) found")
    return sorted(files)


def _skipped(directory: str, top: bool) -> bool:
    """Whether the default corpus leaves out a directory of the stdlib: installed packages,
    the stdlib's tests and IDLE at the top, any ``tests`` directory below."""
    return directory == "tests" or (
        top and directory in ("site-packages", "dist-packages", "test", "idlelib")
    )


@dataclasses.dataclass
class Corpus:
    train: np.ndarray  # token ids: uint8 (bytes), or a tokenizer's (uint16, uint32)
    val: np.ndarray
    source: str
    files: int
    unit: str = "bytes"  # what an id is: a byte, or a tokenizer's token ("tokens")
    text_bytes: tuple[int, int] | None = None  # (train, val) bytes of text, ids of tokens

    def batch(self, seed: int, step: int, batch: int, seq: int) -> np.ndarray:
        """Training windows ``[batch, seq + 1]`` for ``step``: a function of (seed, step)
        only, so a resumed run sees exactly the batches an uninterrupted one would."""
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, len(self.train) - seq - 1, size=batch)
        return np.stack([self.train[s : s + seq + 1] for s in starts]).astype(np.int32)

    def val_batches(self, batch: int, seq: int, count: int) -> list[np.ndarray]:
        """Fixed, evenly spaced validation windows (the same for every run)."""
        n = len(self.val) - seq - 1
        starts = np.linspace(0, n, num=batch * count, dtype=np.int64)
        windows = np.stack([self.val[s : s + seq + 1] for s in starts]).astype(np.int32)
        return [windows[i * batch : (i + 1) * batch] for i in range(count)]


def load_corpus(
    data: str | None = None,
    val_fraction: float = 0.05,
    max_bytes: int = 64 * 2**20,
    min_bytes: int = 0,
) -> Corpus:
    """Read the corpus (files in sorted order, joined), keep at most ``max_bytes``; the
    last ``val_fraction`` of it is the validation split."""
    root = stdlib_dir() if data is None else Path(data).expanduser()
    chunks, total, count = [], 0, 0
    for path in _files(root):
        raw = path.read_bytes()
        chunks.append(raw + SEPARATOR)
        total += len(raw) + len(SEPARATOR)
        count += 1
        if total >= max_bytes:
            break
    blob = np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
    if total == len(SEPARATOR) * count:
        raise ValueError(f"--data {root}: empty (0 bytes of text)")
    if len(blob) < max(min_bytes, 4096):
        raise ValueError(
            f"corpus {root} has only {len(blob)} bytes; need at least {max(min_bytes, 4096)}"
        )
    split = int(len(blob) * (1 - val_fraction))
    return Corpus(train=blob[:split], val=blob[split:], source=str(root), files=count)


def check_seq(corpus: Corpus, seq: int) -> None:
    """A window is ``seq + 1`` ids (bytes or tokens) of one split: refuse a ``--seq`` a
    split cannot hold (numpy's ``high <= 0`` at the first batch otherwise)."""
    if len(corpus.train) < seq + 2 or len(corpus.val) < seq + 1:
        size, unit = len(corpus.train) + len(corpus.val), corpus.unit
        raise ValueError(
            f"--seq {seq}: the corpus {corpus.source} is too small ({size:,} {unit}: "
            f"{len(corpus.train):,} train, {len(corpus.val):,} validation; a window is "
            f"--seq + 1 {unit} of each): give a smaller --seq, more --data or a larger "
            "--max-bytes"
        )
