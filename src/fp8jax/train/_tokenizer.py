"""The tokenizer of ``fp8jax-train`` (``--tokenizer``): bytes (the default: ids 0..255,
nothing to train or load), a byte-level BPE trained on the corpus's training split
(``bpe``), or a user's ``tokenizer.json``. The last two are `tokenizers` tokenizers (the
optional extra ``fp8jax[text]``, imported only for them), kept in the run directory as
`FILE`; the corpus's token ids are cached beside it (`tokenize`), so a restart neither
retrains nor re-encodes."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import re
import time
from pathlib import Path

import numpy as np

from ._data import Corpus
from ._model import VOCAB
from ._rundir import UsageError, atomic_write_bytes

BYTES, BPE, USER = "bytes", "bpe", "file"  # the kinds a run records
FILE = "tokenizer.json"  # the run's tokenizer, in --out
BPE_VOCAB = 8192  # --tokenizer bpe's size when neither --vocab nor the preset gives one
INSTALL = 'pip install "fp8jax[text]"'
_CACHE = re.compile(r"^tokens-[0-9a-f]{16}\.npz$")
_PIECE = 1 << 16  # characters per encoded piece (cut after a newline): encode_batch's unit


def require_tokenizers(option: str):
    """The `tokenizers` module; not installed: a usage error naming the extra."""
    try:
        import tokenizers
    except ImportError:
        raise UsageError(f"--tokenizer {option} needs the tokenizers library: {INSTALL}") from None
    return tokenizers


def kind_of(option: str) -> str:
    """``--tokenizer``'s kind: `BYTES`, `BPE`, or `USER` (any other value: a file's path)."""
    return option if option in (BYTES, BPE) else USER


class ByteTokenizer:
    """Text as its UTF-8 bytes: token ``i`` is byte ``i``."""

    kind, vocab_size, sha256 = BYTES, VOCAB, None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode(), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, np.uint8)).decode("utf-8", errors="replace")


class TextTokenizer:
    """A `tokenizers.Tokenizer` and the JSON it was read from (the run's `FILE`; its hash
    names the tokenizer in the run's records). ``vocab_size``: its largest id + 1."""

    def __init__(self, data: bytes, kind: str, source: str = FILE):
        tk = require_tokenizers(source if kind == USER else kind)
        try:
            self.tokenizer = tk.Tokenizer.from_str(data.decode())
        except Exception as e:  # tokenizers raises its own Exception for a bad file
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UsageError(f"--tokenizer {source}: not a tokenizer.json ({why})") from None
        self.data, self.kind, self.source = data, kind, source
        self.sha256 = hashlib.sha256(data).hexdigest()[:16]
        ids = self.tokenizer.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(ids, default=-1) + 1

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def encode_pieces(self, pieces: list[str], group: int = 64) -> np.ndarray:
        """The pieces' ids, concatenated: ``group`` pieces at a time encoded in parallel by
        `tokenizers` (an `Encoding` holds far more than its ids: not all at once)."""
        dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32
        ids = [np.zeros(0, dtype)]
        for i in range(0, len(pieces), group):
            encoded = self.tokenizer.encode_batch(pieces[i : i + group], add_special_tokens=False)
            ids += [np.asarray(e.ids, dtype) for e in encoded]
        return np.concatenate(ids)


def load(path: Path, kind: str = USER) -> TextTokenizer:
    """A tokenizer.json (a user's: ``--tokenizer PATH``, or a run's `FILE`)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UsageError(
            f"--tokenizer {path}: no such file (expected bytes, bpe or a tokenizer.json)"
        )
    return TextTokenizer(path.read_bytes(), kind, str(path))


def pieces(text: str, size: int = _PIECE) -> list[str]:
    """``text`` cut after a newline every ``size`` characters or so (the units encoded in
    parallel; a run of whitespace across a cut is tokenized as two)."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end])
        start = end
    return out


def _text(ids: np.ndarray) -> str:
    return ids.tobytes().decode("utf-8", errors="replace")  # a non-UTF-8 byte: U+FFFD


def train_bpe(corpus: Corpus, vocab: int) -> TextTokenizer:
    """A byte-level BPE of at most ``vocab`` tokens (GPT-2's pre-tokenizer and decoder: any
    text round-trips), trained on ``corpus``'s training split only (byte ids)."""
    tk = require_tokenizers(BPE)
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tk.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(pieces(_text(corpus.train)), trainer=trainer)
    return TextTokenizer(tok.to_str().encode(), BPE)


# ----------------------------------------------------------------------------- the options
def from_option(option: str):
    """``--tokenizer``'s tokenizer before the corpus is read: bytes, a user's file (loaded),
    or None: a BPE to train (or the run's, on --resume: `of_run`), `tokenizers` installed."""
    kind = kind_of(option)
    if kind == BPE:
        require_tokenizers(BPE)
        return None
    return ByteTokenizer() if kind == BYTES else load(option)


def run_fields(option: str, tokenizer) -> dict:
    """`RunConfig`'s tokenizer fields for ``--tokenizer option``: ``tokenizer``'s record, or a
    BPE's before it is trained (vocabulary and hash still unknown)."""
    if kind_of(option) == BPE and tokenizer is None:
        return dict(tokenizer=BPE, tokenizer_vocab=None, tokenizer_sha256=None)
    return record(tokenizer)


def model_vocab(option: str, tokenizer, preset_vocab: int) -> int | None:
    """The model's vocabulary when ``--vocab`` is not given (None: the preset's): a user's
    tokenizer's size rounded up to a multiple of 128; a BPE's `BPE_VOCAB` if the preset's is
    the byte one."""
    kind = kind_of(option)
    if kind == USER:
        return default_vocab(tokenizer)
    return BPE_VOCAB if kind == BPE and preset_vocab == VOCAB else None


def of_run(out: Path):
    """``--resume --tokenizer bpe``: the run's BPE, not trained again."""
    if not (Path(out) / FILE).is_file():
        raise UsageError(
            f"--resume --tokenizer bpe: no {FILE} in {out} (the run's BPE); resume with the "
            "run's --tokenizer"
        )
    return load(Path(out) / FILE, BPE)


def check_vocab(vocab: int, tokenizer) -> None:
    """The model's ``vocab`` must hold every id of ``tokenizer``."""
    if vocab < tokenizer.vocab_size:
        raise UsageError(
            f"--vocab {vocab} is smaller than the tokenizer's vocabulary ({tokenizer.source}: "
            f"{tokenizer.vocab_size:,} tokens): give --vocab >= {tokenizer.vocab_size}, or "
            f"leave it out ({default_vocab(tokenizer)}: its size rounded up to a multiple of 128)"
        )


def default_vocab(tokenizer) -> int:
    """The model's vocabulary for ``tokenizer``: its size rounded up to a multiple of 128."""
    return max(VOCAB, -(-tokenizer.vocab_size // 128) * 128)


def record(tokenizer) -> dict:
    """What a run records of its tokenizer (`rundir.config_record` keys)."""
    return dict(
        tokenizer=tokenizer.kind,
        tokenizer_vocab=tokenizer.vocab_size,
        tokenizer_sha256=tokenizer.sha256,
    )


# ----------------------------------------------------------------------------- the token cache
def cache_path(out: Path, corpus: Corpus, tokenizer) -> Path | None:
    """Where ``corpus``'s ids by ``tokenizer`` are cached in ``out`` (None: bytes, no cache):
    ``tokens-<key>.npz``, the key a hash of what the ids are a function of (the splits' bytes
    and the tokenizer's JSON)."""
    if tokenizer.kind == BYTES:
        return None
    h = hashlib.sha256(b"fp8jax tokens 1\0" + tokenizer.data)
    h.update(len(corpus.train).to_bytes(8, "little"))
    h.update(corpus.train.tobytes())
    h.update(corpus.val.tobytes())
    return Path(out) / f"tokens-{h.hexdigest()[:16]}.npz"


def _read_cache(path: Path, vocab: int) -> tuple[np.ndarray, np.ndarray] | None:
    try:
        with np.load(path) as f:
            train, val = f["train"], f["val"]
    except (OSError, KeyError, ValueError):
        return None  # absent or damaged: encode again
    for ids in (train, val):
        if ids.ndim != 1 or ids.dtype.kind != "u" or (ids.size and ids.max() >= vocab):
            return None
    return train, val


def tokenize(corpus: Corpus, tokenizer, cache: Path | None = None) -> tuple[Corpus, bool]:
    """``corpus`` (byte ids) as ``tokenizer``'s ids, each split encoded separately, or read
    from ``cache`` (`cache_path`) when it holds them. Returns the corpus (``corpus`` itself
    for bytes) and whether it came from the cache."""
    if tokenizer.kind == BYTES:
        return corpus, False
    cached = None if cache is None else _read_cache(cache, tokenizer.vocab_size)
    if cached is not None:
        train, val = cached
    else:
        train = tokenizer.encode_pieces(pieces(_text(corpus.train)))
        val = tokenizer.encode_pieces(pieces(_text(corpus.val)))
    tokens = Corpus(
        train=train,
        val=val,
        source=corpus.source,
        files=corpus.files,
        unit="tokens",
        text_bytes=(len(corpus.train), len(corpus.val)),
    )
    return tokens, cached is not None


def write_cache(path: Path, tokens: Corpus) -> None:
    """``tokens``'s ids as ``path`` (written whole or not at all); the other caches in its
    directory (``tokens-<key>.npz``, the trainer's by name: other texts' or tokenizers') go."""
    buffer = io.BytesIO()
    np.savez(buffer, train=tokens.train, val=tokens.val)
    atomic_write_bytes(path, buffer.getvalue())
    for old in path.parent.iterdir():
        if _CACHE.match(old.name) and old != path and old.is_file():
            old.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- fp8jax-train
@dataclasses.dataclass
class Tokens:
    """The corpus as ``tokenizer``'s ids (``corpus``: the byte corpus itself for bytes), and
    how they came: trained (seconds) or given, encoded (seconds) or read from ``cache``."""

    tokenizer: object
    corpus: Corpus
    cache: Path | None
    cached: bool
    trained_s: float | None
    encoded_s: float

    def describe(self, out: Path) -> str:
        """One line: the tokenizer, and the training split in its tokens."""
        tok, ids = self.tokenizer, self.corpus.train
        how = "loaded" if self.trained_s is None else f"trained in {self.trained_s:.1f} s"
        enc = "from the cache" if self.cached else f"encoded in {self.encoded_s:.1f} s"
        per = self.corpus.text_bytes[0] / max(len(ids), 1)
        return (
            f"tokenizer {tok.kind}: {tok.vocab_size:,} tokens ({how}, {Path(out) / FILE}); "
            f"{len(ids):,} train tokens ({per:.2f} bytes/token, {enc})"
        )

    def keep(self, out: Path) -> None:
        """The run's `FILE` (written unless the same bytes are there: a resumed run's, or a
        BPE trained again to the same merges) and the ids' cache, in ``out``."""
        if self.tokenizer.kind == BYTES:
            return
        path, data = Path(out) / FILE, self.tokenizer.data
        if not (path.is_file() and path.read_bytes() == data):
            atomic_write_bytes(path, data)
        if not self.cached:
            write_cache(self.cache, self.corpus)


def tokens(text: Corpus, tokenizer, out: Path, vocab: int) -> Tokens:
    """``text``'s ids by ``tokenizer`` (None: a BPE of ``vocab`` trained on ``text``'s
    training split, the same on every process), read from ``out``'s cache when there;
    nothing written (`Tokens.keep`)."""
    trained_s = None
    if tokenizer is None:
        t0 = time.perf_counter()
        tokenizer = train_bpe(text, vocab)
        trained_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cache = cache_path(out, text, tokenizer)
    corpus, cached = tokenize(text, tokenizer, cache)
    return Tokens(tokenizer, corpus, cache, cached, trained_s, time.perf_counter() - t0)
