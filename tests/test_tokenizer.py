"""fp8jax-train --tokenizer: a byte-level BPE trained on the corpus's training split (kept in
--out, reused by --resume and fp8jax-generate, recorded so another tokenizer is refused), a
user's tokenizer.json, the token-id cache, and the tokenizers library as an optional extra."""

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest

from fp8jax.train import _cli as cli, _tokenizer as tokenizer
from fp8jax.train import _generate as gen
from fp8jax.train._data import Corpus, load_corpus
from fp8jax.train._tokenizer import TextTokenizer

pytest.importorskip("tokenizers")

SMALL = ["--dim", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--ffn", "64", "--seq", "32",
         "--batch", "8", "--eval-batches", "2", "--max-bytes", "300000", "--quiet", "--lr", "3e-3",
         "--precision", "bf16", "--no-plot", "--no-tensorboard"]
TEXTS = ["def main(argv):\n    return 0  # plain ASCII\n\n\tx = [1, 2]\r\n",
         "héllo wörld, naïve café: 日本語のテキスト 🙂👍 Ωμέγα \u00a0\x00 end"]


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=300_000)


@pytest.fixture(scope="module")
def bpe(corpus):
    return tokenizer.train_bpe(corpus, 512)


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def test_round_trip_ascii_and_non_ascii(bpe, corpus):
    assert bpe.kind == "bpe" and bpe.vocab_size == 512
    for tok in (bpe, tokenizer.ByteTokenizer()):
        for text in TEXTS:
            ids = tok.encode(text)
            assert ids.dtype == np.int32 and ids.min() >= 0 and ids.max() < tok.vocab_size
            assert tok.decode(ids) == text, (tok.kind, text)
    assert len(bpe.encode(TEXTS[0])) < len(TEXTS[0].encode())  # merges: fewer tokens than bytes
    # The corpus, encoded in pieces, decodes to its text; the ids are the tokenizer's.
    tokens, cached = tokenizer.tokenize(corpus, bpe)
    assert not cached and tokens.unit == "tokens" and tokens.train.dtype == np.uint16
    assert bpe.decode(tokens.train) == corpus.train.tobytes().decode()
    assert tokens.text_bytes == (len(corpus.train), len(corpus.val))
    assert 2 < len(corpus.train) / len(tokens.train) < 4
    np.testing.assert_array_equal(tokens.batch(0, 7, 4, 32), tokens.batch(0, 7, 4, 32))
    assert tokens.batch(0, 7, 4, 32).shape == (4, 33) and tokens.batch(0, 7, 4, 32).max() < 512


def test_bpe_is_trained_on_the_training_split_only():
    """A word only the validation split holds gets no merges."""
    train = np.frombuffer(b"alpha beta gamma delta\n" * 400, np.uint8)
    val = np.frombuffer(b"zqxj zqxj zqxj\n" * 400, np.uint8)
    tok = tokenizer.train_bpe(Corpus(train=train, val=val, source="-", files=1), 300)
    assert len(tok.encode("alpha")) == 1 and len(tok.encode(" beta")) == 1
    assert len(tok.encode("zqxj")) == 4  # its four bytes


def test_bpe_run_writes_its_tokenizer_resume_reuses_it_and_the_cache(tmp_path, monkeypatch, capsys):
    """--tokenizer bpe: tokenizer.json and the ids' cache in --out; --resume (and a fresh run
    again) neither retrain the tokenizer's file nor re-encode; another tokenizer is refused with
    the options' diff; fp8jax-generate decodes through the run's tokenizer."""
    counts = dict(trained=0, encoded=0)
    train_bpe, encode = tokenizer.train_bpe, TextTokenizer.encode_pieces

    def counted_train(*a, **k):
        counts["trained"] += 1
        return train_bpe(*a, **k)

    def counted_encode(self, pieces):
        counts["encoded"] += 1
        return encode(self, pieces)

    monkeypatch.setattr(tokenizer, "train_bpe", counted_train)
    monkeypatch.setattr(TextTokenizer, "encode_pieces", counted_encode)
    out = tmp_path / "run"
    args = SMALL + ["--tokenizer", "bpe", "--vocab", "512", "--steps", "3", "--out", str(out)]
    cut = cli.main(args, interrupt_at=2)["bf16"]
    assert cut["interrupted"] and cut["steps"] == 2
    assert counts == dict(trained=1, encoded=2)  # the training and the validation split
    path = out / "tokenizer.json"
    caches = sorted(out.glob("tokens-*.npz"))
    assert len(caches) == 1
    stamp = (path.stat().st_mtime_ns, caches[0].stat().st_mtime_ns)
    record = dict(tokenizer="bpe", tokenizer_vocab=512, tokenizer_sha256=_sha(path))
    marker = json.loads((out / "fp8jax-run.json").read_text())["runs"]["bf16"]
    assert {k: marker[k] for k in record} == record and marker["vocab"] == 512
    meta = json.loads((out / "metrics.json").read_text())["meta"]
    assert {k: meta["tokenizer"][k] for k in record} == record
    assert meta["corpus"]["train_tokens"] < meta["corpus"]["train_bytes"] / 2
    capsys.readouterr()

    done = cli.main(args + ["--resume"])["bf16"]
    assert not done["interrupted"] and done["steps"] == 3
    assert all(np.isfinite([h["loss"] for h in done["history"]]))
    assert counts == dict(trained=1, encoded=2)  # its tokenizer.json and the cache: no work
    assert (path.stat().st_mtime_ns, caches[0].stat().st_mtime_ns) == stamp
    assert "tokenizer bpe: 512 tokens (loaded" in capsys.readouterr().out
    assert sorted(out.glob("tokens-*.npz")) == caches
    with pytest.raises(ValueError, match=r"--tokenizer bpe -> bytes.*512 -> 256"):
        cli.main(SMALL + ["--steps", "4", "--vocab", "512", "--out", str(out), "--resume"])
    # A fresh run again: the same merges (the file is left as it is) and the cached ids.
    cli.main(args)
    assert counts == dict(trained=2, encoded=2)
    assert (path.stat().st_mtime_ns, caches[0].stat().st_mtime_ns) == stamp
    capsys.readouterr()

    result = gen.main(["--run", str(out), "--new-tokens", "6", "--prompt", "def main("])
    printed = capsys.readouterr().out
    bpe = tokenizer.load(path, "bpe")
    assert result.tokens.shape == (1, 6) and result.tokens.max() < 512
    assert "def main(" + bpe.decode(result.tokens[0]) in printed
    path.write_bytes(tokenizer.train_bpe(load_corpus(max_bytes=20_000), 300).data)  # another
    with pytest.raises(ValueError, match="is not the tokenizer the bf16 checkpoint was trained"):
        gen.main(["--run", str(out), "--new-tokens", "2"])


def test_user_tokenizer_json_loads_trains_and_generates(tmp_path, monkeypatch, capsys, corpus):
    """--tokenizer PATH.json: --vocab defaults to its size rounded up to 128; a smaller one is
    a usage error; the run keeps a copy (generate uses it after the file moved) and samples
    only the tokenizer's ids (the model has 84 rows more)."""
    user = tmp_path / "mine" / "tok.json"
    user.parent.mkdir()
    user.write_bytes(tokenizer.train_bpe(corpus, 300).data)
    run = cli.run_config(cli.parse_args(SMALL + ["--tokenizer", str(user)]))
    assert run.model.vocab == 384
    assert (run.tokenizer, run.tokenizer_vocab, run.tokenizer_sha256) == ("file", 300, _sha(user))
    small = tmp_path / "small"
    with pytest.raises(ValueError, match=r"--vocab 256 is smaller than the tokenizer's vocabula"
                                         r"ry \(.*tok.json: 300 tokens\): give --vocab >= 300"):
        cli.main(SMALL + ["--tokenizer", str(user), "--vocab", "256", "--out", str(small)])
    monkeypatch.setattr(sys, "argv", ["fp8jax-train", *SMALL, "--tokenizer", str(user),
                                      "--vocab", "299", "--out", str(small)])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert "--vocab 299 is smaller" in err.strip().splitlines()[-1]
    assert not small.exists()

    out = tmp_path / "run"
    cli.main(SMALL + ["--tokenizer", str(user), "--steps", "2", "--out", str(out)])
    assert (out / "tokenizer.json").read_bytes() == user.read_bytes()
    marker = json.loads((out / "fp8jax-run.json").read_text())["runs"]["bf16"]
    assert (marker["tokenizer"], marker["tokenizer_vocab"], marker["vocab"]) == ("file", 300, 384)
    user.rename(tmp_path / "moved.json")
    capsys.readouterr()
    result = gen.main(["--run", str(out), "--new-tokens", "8", "--batch", "4", "--temperature", "1",
                       "--prompt", "héllo"])
    printed = capsys.readouterr().out
    tok = tokenizer.load(out / "tokenizer.json")
    assert result.tokens.shape == (4, 8) and result.tokens.max() < 300  # not the 84 more rows
    for row in result.tokens:
        assert "héllo" + tok.decode(row) in printed
    # benchmarks.inference --run serves that run on its own tokens, not on bytes
    from benchmarks import inference

    seen = []

    def spy(corpus, tokenizer_, cache=None):
        seen.append(tokenizer_.vocab_size)
        return tokenizer.tokenize(corpus, tokenizer_, cache)

    monkeypatch.setattr(inference, "tokenize", spy)
    served = tmp_path / "served"  # a run with a checkpoint (fp8 only, 2 steps)
    cli.main(SMALL + ["--tokenizer", str(tmp_path / "moved.json"), "--steps", "2",
                      "--checkpoint-every", "2", "--precision", "fp8", "--out", str(served)])
    rows = inference.main(["--run", str(served), "--quick", "--out", str(tmp_path / "i.jsonl")])
    assert seen == [300] and all(r.get("error") is None for r in rows), rows


def test_the_token_cache_is_hit_and_keeps_other_files(tmp_path, corpus, bpe):
    path = tokenizer.cache_path(tmp_path, corpus, bpe)
    tokens, cached = tokenizer.tokenize(corpus, bpe, path)
    assert not cached and not path.exists()
    (tmp_path / "tokens-mine.npz").write_bytes(b"a user's")
    tokenizer.write_cache(path, tokens)
    again, cached = tokenizer.tokenize(corpus, bpe, path)
    assert cached
    np.testing.assert_array_equal(again.train, tokens.train)
    np.testing.assert_array_equal(again.val, tokens.val)
    # Another text: another key; its cache replaces the trainer's older one, not a user's file.
    other = Corpus(train=corpus.train[:-1000], val=corpus.val, source="-", files=1)
    other_path = tokenizer.cache_path(tmp_path, other, bpe)
    assert other_path != path
    tokenizer.write_cache(other_path, tokenizer.tokenize(other, bpe, other_path)[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["tokens-mine.npz", other_path.name])
    assert tokenizer.cache_path(tmp_path, corpus, tokenizer.ByteTokenizer()) is None


def test_without_tokenizers_installed_the_option_is_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` fails
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r'--tokenizer bpe needs the tokenizers library: '
                                         r'pip install "fp8jax\[text\]"'):
        cli.main(SMALL + ["--tokenizer", "bpe", "--out", str(out)])
    monkeypatch.setattr(sys, "argv", ["fp8jax-train", *SMALL, "--tokenizer", "bpe"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith('pip install "fp8jax[text]"')
    with pytest.raises(ValueError, match="--tokenizer .*missing.json: no such file"):
        cli.main(SMALL + ["--tokenizer", str(tmp_path / "missing.json"), "--out", str(out)])
    assert not out.exists()
    cli._check_options(cli.parse_args(SMALL))  # bytes: nothing to import


def test_the_byte_default_imports_no_tokenizers():
    code = ("import sys\nfrom fp8jax.train import _cli as cli, _generate as generate\n"
            "cli._check_options(cli.parse_args([]))\n"
            "assert 'tokenizers' not in sys.modules, 'imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
