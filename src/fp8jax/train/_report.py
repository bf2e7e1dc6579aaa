"""What a run leaves behind: the markdown summary table, ``metrics.csv`` / ``.json``,
the loss plot, benchmark records, and TensorBoard event files (`TensorBoardLog`)."""

from __future__ import annotations

import csv
import io
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np

from ._memory import saved_cell
from ._rundir import atomic_write_text


def summarize(results: dict[str, dict]) -> str:
    """The markdown summary table (bf16 first; speedup and val-loss gap vs bf16). Adds
    ``val_loss_rel_gap`` and ``speedup_vs_bf16`` to each result."""
    base = results.get("bf16")
    energy = all(r.get("joules_per_step") for r in results.values())
    head = (
        "| precision | steps | train loss | val loss | val gap vs bf16 | tokens/s | speedup | MFU "
    )
    lines = [
        head + "| peak MiB | saved MiB |" + (" J/step | mean W |" if energy else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if energy else ""),
    ]

    sources = {r.get("peak_mem_source") for r in results.values()}

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    for name in sorted(results, key=lambda n: n != "bf16"):
        r = results[name]
        gap = speed = None
        if base and r["val_loss"] is not None and base["val_loss"]:
            gap = (r["val_loss"] - base["val_loss"]) / base["val_loss"]
        if base and r["tokens_per_s"] and base["tokens_per_s"]:
            speed = r["tokens_per_s"] / base["tokens_per_s"]
        r["val_loss_rel_gap"], r["speedup_vs_bf16"] = gap, speed
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        gap_s = "-" if gap is None else f"{100 * gap:+.2f}%"
        speed_s = "-" if speed is None else f"{speed:.2f}x"
        cells = [name, str(r["steps"]), f(r["final_loss"], ".4f"), f(r["val_loss"], ".4f"), gap_s]
        peak = f(r["peak_mem_mb"], ",.0f")
        if r.get("peak_mem_source") == "compiled" and "allocator" in sources:
            peak += " (compiled)"  # the others' are the allocator's
        if r.get("remat") not in (None, "none", "auto"):  # what the step's backward kept
            peak += f" (--remat {r['remat']})"
        saved = saved_cell(r.get("saved_residual_mb"), r.get("saved_residuals"))
        cells += [f(r["tokens_per_s"], ",.0f"), speed_s, mfu, peak, saved]
        if energy:
            cells += [f"{r['joules_per_step']:.1f}", f(r.get("mean_power_w"), ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


CSV_FIELDS = ["precision", "step", "loss", "val_loss", "tokens_per_s", "mfu", "step_s"]


def write_metrics(results: dict[str, dict], out: Path, meta: dict) -> None:
    """Per-step metrics of every precision: ``metrics.csv`` and ``metrics.json`` (each
    written whole or not at all: `atomic_write_text`)."""
    f = io.StringIO(newline="")
    w = csv.writer(f)
    w.writerow(CSV_FIELDS)
    for name, r in results.items():
        for h in r["history"]:
            w.writerow(
                [name, h["step"], h["loss"], h.get("val_loss", "")]
                + [h.get(k) or "" for k in ("tokens_per_s", "mfu", "step_s")]
            )
    atomic_write_text(out / "metrics.csv", f.getvalue())
    atomic_write_text(out / "metrics.json", json.dumps(dict(meta=meta, results=results), indent=1))


def plot(results: dict[str, dict], out: Path, title: str) -> Path | None:
    """``loss.png``: EMA-smoothed train loss and val loss per precision (None without
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot; pip install 'fp8jax[train]')", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, r in sorted(results.items()):
        steps = np.array([h["step"] for h in r["history"]])
        loss = np.array([h["loss"] for h in r["history"]])
        ema, smooth = loss[0] if len(loss) else 0.0, []
        for v in loss:
            ema = 0.9 * ema + 0.1 * v
            smooth.append(ema)
        (line,) = ax.plot(steps, smooth, label=f"{name} train (EMA)", lw=1.2)
        val = [(h["step"], h["val_loss"]) for h in r["history"] if "val_loss" in h]
        if val:
            color = line.get_color()
            ax.plot(*zip(*val, strict=True), "o--", color=color, label=f"{name} val", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    path, tmp = out / "loss.png", out / f".loss.png.{os.getpid()}.tmp"
    fig.tight_layout()
    try:
        fig.savefig(tmp, dpi=120, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path


def to_records(
    results: dict[str, dict], run, preset: str, meta: dict, interleave: int = 0
) -> list[dict]:
    """`benchmarks/results/train.jsonl` records (names from BENCHMARKS.md); ``interleave``: the
    precisions alternated every that many steps in one process (0: one after the other)."""
    recs = []
    tokens = run.batch * run.model.seq
    for name, r in results.items():
        tps = r["tokens_per_s"]
        # --remat in the params when on (the records from before it ran without); under
        # --remat auto the choice (``remat_option``: auto)
        chosen = r.get("remat") or run.remat
        remat = {} if chosen in ("none", "auto") else dict(remat=chosen)
        recs.append(
            dict(
                bench="train",
                params=dict(
                    preset=preset, seq=run.model.seq, steps=r["steps"], batch=run.batch, **remat
                ),
                variant=name,
                device=meta["device"],
                date=meta["date"],
                jax=meta["jax"],
                command=meta["command"],
                xla_flags=meta.get("xla_flags", ""),
                ms=(tokens / tps * 1e3) if tps else None,
                tokens_per_s=tps,
                mfu=r["mfu"],
                val_loss=r["val_loss"],
                val_loss_rel_gap=r.get("val_loss_rel_gap"),
                speedup_vs_bf16=r.get("speedup_vs_bf16"),
                peak_mem_mb=r["peak_mem_mb"],
                peak_mem_source=r.get("peak_mem_source"),
                compiled_mem_mb=r.get("compiled_mem_mb"),
                saved_residual_mb=r.get("saved_residual_mb"),
                saved_residuals=r.get("saved_residuals"),
                remat_option=run.remat,
                remat_tried=r.get("remat_tried"),
                interleave=interleave,
                joules_per_step=r.get("joules_per_step"),
                mean_power_w=r.get("mean_power_w"),
                compile_s=r.get("compile_s"),
                fp8_gemms=bool(r.get("fp8_gemms")),
                fp8_gemm_count=r.get("fp8_gemms"),
                gemm_count=r.get("gemms"),
                gemm_census=r.get("gemm_census"),
                tokenizer=dict(
                    kind=run.tokenizer, vocab=run.tokenizer_vocab, sha256=run.tokenizer_sha256
                ),
            )
        )
    return recs


# ----------------------------------------------------------------------------- TensorBoard
_warned_no_tensorboard = False


class TensorBoardLog:
    """Scalars of one precision's run as TensorBoard event files in ``logdir`` (tensorboardX,
    imported here so the trainer runs without it: then nothing is written, said once)."""

    def __init__(self, logdir: Path | None):
        global _warned_no_tensorboard
        self.writer = None
        if logdir is None:
            return
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            if not _warned_no_tensorboard:
                print(
                    "(tensorboardX not installed: no TensorBoard logs; "
                    "pip install 'fp8jax[train]')",
                    file=sys.stderr,
                )
                _warned_no_tensorboard = True
            return
        self.writer = SummaryWriter(str(logdir), flush_secs=30)

    def scalars(self, step: int, values: dict[str, float | None]) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            if value is not None:
                self.writer.add_scalar(name, float(value), step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def read_tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars in ``logdir``'s event files (read with tensorboardX's protobufs):
    ``{tag: [(step, value), ...]}`` in file and write order."""
    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):  # records: u64 length, u32 crc, payload, u32 crc
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 16 + length
            for v in event.summary.value:
                scalars.setdefault(v.tag, []).append((event.step, v.simple_value))
    return scalars
