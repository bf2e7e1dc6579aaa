"""`benchmarks.distributed`'s printed tables: the timed runs' (`table`) and ``--max-batch``'s
(`max_batch_table`)."""

from __future__ import annotations

from benchmarks import common
from fp8jax.train._memory import saved_cell


def _max_batch_cell(row: dict) -> str:
    """``max_batch``, ``>= max_batch`` where the search was cut (a lower bound)."""
    cut = row.get("max_batch_complete") is False
    return (">= " if cut else "") + str(row["max_batch"])


def max_batch_table(rows) -> str:
    limit = rows[0]["memory_limit_gb"] if rows else None
    return "\n".join(
        common.markdown_rows(
            # markdown_rows shows a row without a time as its error: a probe has no time
            [dict(r, ms=0.0 if r.get("max_batch") is not None else None) for r in rows],
            f"mesh (limit {common.fmt(limit, '.3g')} GiB)",
            lambda r: r["params"]["mesh"],
            [
                ("max batch", _max_batch_cell),
                ("its MiB", lambda r: common.fmt(r.get("max_batch_mem_mb"), ".1f")),
                ("next MiB", lambda r: common.fmt(r.get("next_mem_mb"), ".1f")),
                ("compiles", lambda r: str(r.get("compiles"))),
            ],
        )
    )


def table(rows) -> str:
    return "\n".join(
        common.markdown_rows(
            rows,
            "mesh",
            lambda r: r["params"]["mesh"],
            [
                ("ms", lambda r: common.fmt(r["ms"], ".1f")),
                ("tokens/s", lambda r: common.fmt(r["tokens_per_s"], ",.0f")),
                ("vs bf16", lambda r: common.fmt(r.get("speedup_vs_bf16"), ".2f", "x")),
                ("scaling eff.", lambda r: common.fmt(r.get("scaling_efficiency"), ".2f")),
                ("exposed comm ms", lambda r: common.fmt(r.get("exposed_comm_ms"), ".1f")),
                ("comm ms", lambda r: common.fmt(r.get("comm_ms"), ".1f")),
                ("all-gather MB", lambda r: common.fmt(_mb(r.get("allgather_bytes")), ".2f")),
                ("all-gathers", lambda r: str(r.get("allgather_dtypes", "-"))),
                ("peak MiB", lambda r: common.fmt(r.get("peak_mem_mb"), ".0f")),
                (
                    "saved MiB",
                    lambda r: saved_cell(r.get("saved_residual_mb"), r.get("saved_residuals")),
                ),
            ],
        )
    )


def _mb(value):
    return None if value is None else value / 2**20
