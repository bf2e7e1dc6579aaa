"""fp8jax-train ``--remat auto`` (the default): the step is compiled with ``none``
and, where its bytes (arguments + outputs - aliased + temporaries) exceed the device's limit, with
``fp8``, ``fp8-min``, ``full`` in turn until one fits (``full`` where none does, with a
warning); one printed line names each try's bytes and the limit. No limit known (the CPU):
``none``. The limit is forced here by ``FP8JAX_MEMORY_LIMIT_GB``. Explicit choices are as
before."""

import json
from types import SimpleNamespace

import jax
import pytest

from fp8jax.train import _cli as cli
from fp8jax.train import _memory as memory
from fp8jax.train._model import AUTO_ORDER as REMAT  # what --remat auto tries, in order

SMALL = ["--dim", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--ffn", "64",
         "--seq", "32", "--batch", "8", "--eval-batches", "1", "--max-bytes", "100000", "--quiet",
         "--precision", "bf16", "--no-plot", "--no-tensorboard", "--remat", "auto"]  # fmt: skip


@pytest.fixture(scope="module")
def steps():
    """The SMALL bf16 step compiled with each choice (as `TrainRun` compiles it, on the
    trainer's mesh: the CPU tests' devices), and its bytes per device."""
    args = cli.parse_args(SMALL)
    run = cli.run_config(args)
    assert run.remat == "auto"
    mesh = cli._mesh(args)
    trainer = cli.Trainer(cli.build_model(run, "bf16"), cli.make_optimizer(run), mesh)
    spec = trainer.batch_spec(run.batch, run.model.seq)
    compiled = {}
    for remat in REMAT:
        trainer.set_remat(remat)
        trainer.compile(spec)
        compiled[remat] = trainer.compiled
    nbytes = {r: memory.compiled_bytes(c, donated=True) for r, c in compiled.items()}
    assert all(b > 0 for b in nbytes.values()), nbytes
    return compiled, nbytes


def _choose(steps, monkeypatch, limit: int | None):
    compiled, _ = steps
    if limit is None:
        monkeypatch.delenv(memory.LIMIT_ENV, raising=False)
    else:
        monkeypatch.setenv(memory.LIMIT_ENV, repr(limit / 1e9))
    calls = []

    def compile_with(remat):
        calls.append(remat)
        return compiled[remat]

    chosen, tried, line = memory.choose_remat(compile_with, jax.devices()[:1], REMAT)
    assert list(tried) == calls == list(REMAT[: REMAT.index(chosen) + 1])  # in order, no more
    return chosen, tried, line


def test_auto_tries_in_order_until_one_fits_and_names_the_bytes(steps, monkeypatch):
    """For a limit at (and a byte below) each choice's bytes: the first choice in
    ``none, lean, fp8, fp8-min, full`` whose step fits (``fp8-store``, which rounds, is never tried), ``full`` where none does; the line names
    the choice, each try's bytes and the limit."""
    _, nbytes = steps
    assert nbytes["fp8"] < nbytes["none"], nbytes  # the case --remat auto is for
    limits = sorted({b + d for b in nbytes.values() for d in (0, -1)} | {10 * nbytes["none"]})
    seen = set()
    for limit in limits:
        want = next((r for r in REMAT if nbytes[r] <= limit), "full")
        chosen, tried, line = _choose(steps, monkeypatch, limit)
        assert chosen == want, (limit, nbytes, line)
        assert tried == {r: nbytes[r] for r in tried}
        assert line.startswith(f"--remat auto: {chosen} ("), line
        for r, b in tried.items():
            assert f"{r} {b:,} B" in line, line
        assert f"limit {limit:,} B" in line and memory.LIMIT_ENV in line, line
        warned = "likely run out of memory" in line
        assert warned == (nbytes["full"] > limit), line
        seen.add(chosen)
    assert {"none", "fp8", "full"} <= seen, seen
    assert "fp8-store" not in REMAT  # it rounds: an explicit choice only
    # above none's bytes: none, compiled once; between fp8's and none's: fp8
    assert _choose(steps, monkeypatch, nbytes["none"] + 1)[:2] == ("none", {"none": nbytes["none"]})
    between = (nbytes["none"] + nbytes["fp8"]) // 2
    assert _choose(steps, monkeypatch, between)[0] == "fp8"
    chosen, _, line = _choose(steps, monkeypatch, min(nbytes.values()) - 1)
    assert chosen == "full" and "even full does not fit" in line, line


def test_auto_keeps_none_where_no_limit_is_known(steps, monkeypatch):
    """The CPU's devices know no memory limit: ``none``, compiled once, and the line says
    why."""
    chosen, tried, line = _choose(steps, monkeypatch, None)
    assert (chosen, list(tried)) == ("none", ["none"])
    assert "no device memory limit known" in line, line
    no_stats = SimpleNamespace(memory_stats=lambda: None)
    assert memory.step_limit([no_stats], 0) == (None, "no device memory limit known")


def test_compiled_bytes_and_limit(steps, monkeypatch):
    """The step's bytes: arguments + outputs - aliased (the donated state the step updates in
    place) + temporaries; without the aliased field, counted twice (never too low). The
    limit: ``bytes_limit`` less the margin and what other arrays hold (bytes in use beyond
    the step's arguments), the smallest of the devices'."""
    compiled, nbytes = steps
    stats = compiled["none"].memory_analysis()
    total = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    assert stats.alias_size_in_bytes > 0  # the parameters and optimizer state, donated
    assert nbytes["none"] == total - stats.alias_size_in_bytes
    old = SimpleNamespace(argument_size_in_bytes=5, output_size_in_bytes=7, temp_size_in_bytes=11)
    assert memory.compiled_bytes(SimpleNamespace(memory_analysis=lambda: old), donated=True) == 23

    def broken():
        raise NotImplementedError

    assert memory.compiled_bytes(SimpleNamespace(memory_analysis=broken), donated=True) is None
    monkeypatch.delenv(memory.LIMIT_ENV, raising=False)
    gb = 10**9
    devices = [
        SimpleNamespace(memory_stats=lambda: dict(bytes_limit=100 * gb, bytes_in_use=30 * gb)),
        SimpleNamespace(memory_stats=lambda: dict(bytes_limit=120 * gb, bytes_in_use=0)),
    ]
    usable, how = memory.step_limit(devices, 20 * gb)
    assert usable == int(100 * gb * (1 - memory.MARGIN)) - 10 * gb
    assert "100.0 GB bytes_limit" in how and "10.0 GB held by other arrays" in how, how


def test_auto_end_to_end_records_the_choice_and_a_resume_chooses_again(
    steps, monkeypatch, tmp_path, capsys
):
    """Through ``fp8jax-train``: the chosen remat (and each try's bytes) is in the result, the
    train record (``params.remat``; ``remat_option`` auto), ``metrics.json`` and the summary;
    an interrupted run resumed chooses again, the same way (same device, same batch)."""
    _, nbytes = steps
    assert nbytes["lean"] > (nbytes["fp8"] + nbytes["none"]) / 2, nbytes  # lean is tried, too
    monkeypatch.setenv(memory.LIMIT_ENV, repr((nbytes["fp8"] + nbytes["none"]) / 2 / 1e9))
    out, record = tmp_path / "run", tmp_path / "train.jsonl"
    args = SMALL + ["--remat", "auto", "--steps", "3", "--eval-every", "3", "--out", str(out)]
    cut = cli.main(args, interrupt_at=1)["bf16"]
    assert cut["interrupted"] and cut["remat"] == "fp8", cut["remat"]
    assert capsys.readouterr().err.count("bf16: --remat auto: fp8 (step: none ") == 1
    result = cli.main(args + ["--resume", "--record", str(record)])["bf16"]
    err = capsys.readouterr().err
    assert "bf16: --remat auto: fp8 (step: none " in err and "--remat none" not in err, err
    assert not result["interrupted"] and result["steps"] == 3
    assert result["remat"] == "fp8" and result["remat_tried"] == {
        r: nbytes[r] for r in ("none", "lean", "fp8")
    }
    (rec,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert rec["params"]["remat"] == "fp8" and rec["remat_option"] == "auto"
    assert rec["remat_tried"] == result["remat_tried"]
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["results"]["bf16"]["remat"] == "fp8" and saved["meta"]["remat"] == "auto"
    assert "(--remat fp8)" in (out / "summary.md").read_text()


def test_explicit_remat_is_as_before(steps, monkeypatch, tmp_path, capsys):
    """``--remat X``: X, whatever the limit; nothing chosen or printed; the record as before
    (``params.remat`` where not none)."""
    monkeypatch.setenv(memory.LIMIT_ENV, "1e-9")  # nothing would fit
    for remat in ("none", "fp8-min"):
        record = tmp_path / f"{remat}.jsonl"
        args = SMALL + ["--steps", "1", "--remat", remat, "--out", str(tmp_path / remat)]
        result = cli.main(args + ["--record", str(record)])["bf16"]
        assert result["remat"] == remat and result["remat_tried"] is None
        assert "--remat auto" not in capsys.readouterr().err
        (rec,) = [json.loads(line) for line in record.read_text().splitlines()]
        assert rec["params"].get("remat") == (None if remat == "none" else remat)
        assert rec["remat_option"] == remat


def test_default_is_auto_and_silent_without_a_limit(tmp_path, capsys, monkeypatch):
    """No ``--remat``: auto; on the CPU (no memory limit) it keeps ``none`` and prints no line
    about it (the README's first command stays clean)."""
    monkeypatch.delenv(memory.LIMIT_ENV, raising=False)
    default = [a for a in SMALL if a not in ("--remat", "auto")]
    result = cli.main(default + ["--steps", "1", "--out", str(tmp_path / "d")])["bf16"]
    assert result["remat"] == "none"
    assert "--remat auto" not in capsys.readouterr().err
