"""Smoke test of the benchmark harness (CPU-sized ``--quick`` run)."""

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` lives at the repository root, not in src/
    sys.path.insert(0, str(ROOT))

from benchmarks import linear, mlp  # noqa: E402


def test_linear_quick_runs_all_variants(capsys, tmp_path):
    out = tmp_path / "linear.jsonl"
    rows = linear.main(["--quick", "--out", str(out)])
    printed = capsys.readouterr().out

    assert {r["variant"] for r in rows} == set(linear.VARIANTS)
    assert len(rows) == len(linear.QUICK_SHAPES) * len(linear.VARIANTS)
    for r in rows:
        assert r["error"] is None, f"{r['variant']} {r['params']}: {r['error']}"
        assert r["ms"] is not None and math.isfinite(r["ms"]) and r["ms"] > 0
        assert r["gemm_count"] == 3  # forward, dgrad and wgrad all in the compiled step
        assert r["speedup_vs_bf16"] is not None and r["speedup_vs_flax"] is not None
        assert isinstance(r["fp8_gemms"], bool)
        assert set(linear.RECORD_FIELDS) <= set(r)
    for variant in linear.VARIANTS:
        assert variant in printed
    assert not out.exists()  # --quick writes no records


def test_mlp_quick_runs_all_variants(tmp_path):
    out = tmp_path / "mlp.jsonl"
    rows = mlp.main(["--quick", "--out", str(out)])
    assert len(rows) == len(mlp.QUICK_CASES) * len(mlp.VARIANTS)
    for r in rows:
        assert r.get("error") is None, f"{r['variant']} {r['params']}: {r.get('error')}"
        assert r["ms"] > 0 and r["gemm_count"] == 6 and r["kernels"] > 0
    saved = {(r["params"]["activation"], r["variant"]): r["saved_act_mb"] for r in rows}
    assert saved[("swiglu", "fp8jax-fused")] <= 0.75 * saved[("swiglu", "bf16-unfused")]
    assert not out.exists()


def test_attention_quick_runs_all_variants(tmp_path):
    from benchmarks import attention

    out = tmp_path / "attention.jsonl"
    rows = attention.main(["--quick", "--out", str(out)])
    expected = sum(len(v) for v in attention.VARIANTS.values()) * len(attention.DIRECTIONS)
    assert len(rows) == expected
    for r in rows:
        assert r.get("error") is None, f"{r['variant']} {r['params']}: {r.get('error')}"
        assert r["ms"] > 0 and r["speedup_vs_bf16"] > 0
    saved = {(r["params"]["level"], r["variant"]): r["saved_act_mb"] for r in rows if r["params"]["direction"] == "fwd"}
    assert saved[("attention", "fp8jax-fp8_dpa")] < saved[("attention", "cudnn-bf16")]  # e4m3 residuals
    assert not out.exists()


def test_moe_quick_runs_all_variants():
    from benchmarks import moe

    rows = moe.main(["--quick", "--experts", "4", "--routing", "random"])
    assert {r["bench"] for r in rows} == {"grouped_gemm", "moe_mlp"}
    assert all(r.get("ms") is not None for r in rows), [r.get("error") for r in rows]
    assert {r["variant"] for r in rows if r["bench"] == "moe_mlp"} == set(moe.MLP_VARIANTS)
    sizes = moe.group_sizes(64, 4, "random")
    assert sizes.sum() == 64 and len(sizes) == 4
