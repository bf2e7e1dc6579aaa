"""Smoke test of the benchmark harness (CPU-sized ``--quick`` run)."""

import math
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` lives at the repository root, not in src/
    sys.path.insert(0, str(ROOT))

from benchmarks import common, linear, mlp  # noqa: E402
from fp8jax.train import _cli as cli


def test_linear_quick_runs_all_variants(capsys, tmp_path):
    out = tmp_path / "linear.jsonl"
    shape = linear.QUICK_SHAPES[0]  # one tiny shape: every variant runs on CPU
    rows = linear.main(["--quick", "--shapes", ",".join(map(str, shape)), "--out", str(out)])
    printed = capsys.readouterr().out
    rows = [r for r in rows if r["variant"] not in linear.PEER_VARIANTS]  # torch: tests below

    assert {r["variant"] for r in rows} == set(linear.VARIANTS)
    assert len(rows) == len(linear.VARIANTS)
    for r in rows:
        assert r["error"] is None, f"{r['variant']} {r['params']}: {r['error']}"
        assert r["ms"] is not None and math.isfinite(r["ms"]) and r["ms"] > 0
        assert r["gemm_count"] == 3  # forward, dgrad and wgrad all in the compiled step
        assert r["speedup_vs_bf16"] is not None and r["speedup_vs_flax"] is not None
        assert isinstance(r["fp8_gemms"], bool)
        assert set(linear.RECORD_FIELDS) <= set(r)
        assert r["params"] == dict(zip("MKN", shape))  # bf16 params: no param_dtype key
    for variant in linear.VARIANTS:
        assert variant in printed
    assert not out.exists()  # --quick writes no records


def test_linear_quick_with_f32_params_keeps_f32_weights_and_bf16_compute(capsys, monkeypatch):
    """``--param-dtype f32``: the variants that take f32 weights keep them f32 in the timed
    step (and their gradient), compute in bf16 or FP8 (no GEMM reads f32, the input's
    gradient stays bf16), all three GEMMs FP8 but in ``bf16``; the others are skipped in
    one line."""
    from fp8jax.inspect import fp8_gemm_report

    steps = {}

    def keeping(name, build):
        def build_and_keep(layer, x, g):
            steps[name] = build(layer, x, g)
            return steps[name]

        return build_and_keep

    for name in linear.F32_PARAM_VARIANTS:
        monkeypatch.setitem(linear.BUILDERS, name, keeping(name, linear.BUILDERS[name]))
    others = ["flax-direct", "fp8jax-current", "torchao-tensorwise"]
    variants = ",".join([*linear.F32_PARAM_VARIANTS, *others])
    rows = linear.main(["--quick", "--param-dtype", "f32", "--shapes", "64,32,48",
                        "--variants", variants])
    printed = capsys.readouterr().out
    skip_lines = [line for line in printed.splitlines() if "bf16 parameters only" in line]
    assert len(skip_lines) == 1 and all(v in skip_lines[0] for v in others), skip_lines
    assert [r["variant"] for r in rows] == list(linear.F32_PARAM_VARIANTS)
    _, xs, g = linear.make_inputs((64, 32, 48), seed=1)
    for r in rows:
        name = r["variant"]
        assert r["error"] is None, f"{name}: {r['error']}"
        assert r["params"] == dict(M=64, K=32, N=48, param_dtype="f32") and r["ms"] > 0
        step = steps[name]
        weights = [a for a in jax.tree_util.tree_leaves(step.params) if a.size == 32 * 48]
        assert [w.dtype for w in weights] == [jnp.float32], name
        # The step's GEMMs: compiled on a GPU, lowered on a CPU (its XLA runs FP8 dots in f32).
        report = fp8_gemm_report(step.fn, step.params, xs[0], g)
        n_fp8 = 0 if name == "bf16" else 3
        assert (report.num_fp8, len(report.gemms), r["gemm_count"]) == (n_fp8, 3, 3), report
        assert not any("f32" in gm.operand_types[:2] for gm in report.gemms), report
        bf16_out = [gm for gm in report.gemms if gm.result_type == "bf16"]
        assert len(bf16_out) >= 2, report  # forward and dgrad (wgrad: f32 out where FP8)
        if common.on_gpu():  # the row's census (the timed executable's) agrees
            assert (r["fp8_gemm_count"], r["fp8_gemms"]) == (n_fp8, n_fp8 == 3), name
        _, (param_grads, x_grad) = step.jitted(step.params, xs[0], g)
        grads = [a for a in jax.tree_util.tree_leaves(param_grads) if a.size == 32 * 48]
        assert [gr.dtype for gr in grads] == [jnp.float32] and x_grad.dtype == jnp.bfloat16


def test_mlp_quick_runs_all_variants(tmp_path):
    """Every variant, the flax front doors (fp8jax-linen, fp8jax-nnx) included where flax is
    installed: they run fp8jax-unfused's block, so they keep the same activations for the
    backward and have as many GEMMs."""
    from benchmarks.flax_steps import MissingDependency, require_flax

    try:
        require_flax()
        variants = mlp.VARIANTS
    except MissingDependency:
        variants = tuple(v for v in mlp.VARIANTS if v not in mlp.FLAX_VARIANTS)
    out = tmp_path / "mlp.jsonl"
    rows = mlp.main(["--quick", "--out", str(out)])
    rows = [r for r in rows if r["variant"] not in mlp.PEER_VARIANTS]  # torch: tests below
    assert [r["variant"] for r in rows] == list(variants) * len(mlp.QUICK_CASES)
    for r in rows:
        assert r.get("error") is None, f"{r['variant']} {r['params']}: {r.get('error')}"
        assert r["ms"] > 0 and r["gemm_count"] == 6 and r["kernels"] > 0
    by = {(r["params"]["activation"], r["variant"]): r for r in rows}
    saved = {case: r["saved_act_mb"] for case, r in by.items()}
    assert saved[("swiglu", "fp8jax-fused")] <= 0.75 * saved[("swiglu", "bf16-unfused")]
    for (activation, variant), r in by.items():
        if variant in mlp.FLAX_VARIANTS:
            unfused = by[(activation, "fp8jax-unfused")]
            assert r["saved_act_mb"] == pytest.approx(unfused["saved_act_mb"]), (variant, activation)
            assert r["fp8_gemm_count"] == unfused["fp8_gemm_count"], (variant, activation)
    assert not out.exists()


def test_mlp_without_flax_skips_its_flax_variants_in_one_line(capsys, monkeypatch):
    from benchmarks import flax_steps

    def missing():
        raise flax_steps.MissingDependency("skipped: flax not installed (in this test)")

    monkeypatch.setattr(flax_steps, "require_flax", missing)
    rows = mlp.main(["--quick", "--cases", "64,64,128,gelu",
                     "--variants", "bf16-unfused,fp8jax-linen,fp8jax-nnx"])
    printed = capsys.readouterr().out
    skip_lines = [line for line in printed.splitlines() if "flax not installed" in line]
    assert len(skip_lines) == 1 and all(v in skip_lines[0] for v in mlp.FLAX_VARIANTS)
    assert [r["variant"] for r in rows] == ["bf16-unfused"] and rows[0]["ms"] > 0


def test_attention_quick_runs_all_variants(tmp_path):
    from benchmarks import attention

    out = tmp_path / "attention.jsonl"
    rows = attention.main(["--quick", "--out", str(out)])
    expected = sum(
        1 if v in attention.FORWARD_ONLY else len(attention.DIRECTIONS)
        for variants in attention.VARIANTS.values()
        for v in variants
    )
    assert len(rows) == expected
    assert {r["params"]["direction"] for r in rows if r["variant"] == "fp8-mgpu"} == {"fwd"}
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


def test_moe_ep_quick_times_the_dispatch_variants():
    """``--bench moe``: the MoE layer's step with experts over 4 devices, per variant; the
    FP8 dispatch's all-to-alls move e4m3 (no f32 scales: the default recipe's experts take
    rows cast with their own per-tensor scale), the bf16 ones bf16 only."""
    from benchmarks import moe

    rows = moe.main(["--quick", "--bench", "moe", "--variants", "bf16,fp8,fp8-replicated"])
    assert all(r.get("ms") is not None for r in rows), [r.get("error") for r in rows]
    by = {r["variant"]: r for r in rows}
    assert {r["bench"] for r in rows} == {"moe"} and by["bf16"]["params"]["ep"] == 4
    assert by["bf16"]["speedup_vs_bf16"] == 1.0 and by["fp8"]["speedup_vs_bf16"] > 0
    assert by["fp8"]["params"]["dispatch"] == "all_to_all-fp8"
    assert "f8e4m3fn:1" in by["fp8"]["a2a_dtypes"] and "f8" not in by["bf16"]["a2a_dtypes"]
    assert "f32" not in by["fp8"]["a2a_dtypes"]
    assert by["fp8-replicated"]["a2a_dtypes"] == ""  # rows whole on each device, psum


def test_linear_bounds_quick_runs_floor_and_stack_memory():
    from benchmarks import linear_bounds

    floors, stacks = linear_bounds.main(["--quick"])
    (floor,) = floors
    assert set(floor["gemms"]) == {"fwd", "dgrad", "wgrad"} and all(t > 0 for t in floor["gemms"].values())
    assert floor["floor"] == pytest.approx(sum(floor["gemms"].values()) + sum(floor["casts"].values()))
    assert floor["max_vs_bf16"] > 0 and "| floor ms |" in linear_bounds.floor_table(floors)
    (rows,) = stacks
    bf16, fp8 = rows
    assert fp8["saved_act_mb"] < bf16["saved_act_mb"]  # FP8 residuals: one byte per element instead of two


def test_profile_train_categorizes_kernels_by_name():
    """jax 0.11 runs the step in command buffers, so kernels carry no HLO instruction and the
    table falls back to names (these are from an H100 trace of the 1b step)."""
    from benchmarks.profile_train import categorize

    want = {
        "nvjet_sm90_qrtst_128x160_128x5_1x2_h_bz_coopA_algo2_TNT": "gemm-fp8",
        "nvjet_sm90_qqtst_176x128_128x5_1x2_h_bz_TNN": "gemm-fp8",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "gemm",
        "body_mosaic_gpu_kernel": "pallas",
        "_bwd_kernel": "pallas",
        "_kernel__4": "pallas",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26": "attention",
        "loop_add_fusion_8": "elementwise",
        "input_reduce_fusion_15": "reduction",
        "loop_transpose_fusion": "copy/transpose",
    }
    assert {name: categorize(None, name) for name in want} == want
    # An instruction found in the HLO still decides.
    line = '%cc = f8e4m3fn[8]{0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton"'
    assert categorize(line, "loop_add_fusion_8") == "pallas"


def test_profile_train_quick_runs_and_parses_variants():
    from benchmarks import profile_train

    assert profile_train.parse_variant("fp8:selective=0:cast_kernel=1") == ("fp8", {"selective": False,
                                                                                    "cast_kernel": True})
    with pytest.raises(Exception, match="unknown RunConfig field"):
        profile_train.parse_variant("fp8:nope=1")
    precision, overrides = profile_train.parse_variant("bf16:scan_unroll=2:selective=0")  # a ModelConfig field too
    run = profile_train.apply_overrides(cli.RunConfig(**cli.PRESETS["tiny"]), overrides)
    assert precision == "bf16" and run.model.scan_unroll == 2 and run.selective is False
    results = profile_train.main(["--quick", "--variants", "bf16", "fp8"])
    assert set(results) == {"bf16", "fp8"} and all(r["tokens_per_s"] > 0 for r in results.values())
    _check_saved_residuals(results)
    assert "| saved MiB | " in profile_train.table(results)
    line = '  %c = (bf16[4]{0}, s8[8]{0}) custom-call(f8e4m3fn[4]{0} %a), custom_call_target="__cublas$lt$matmul$f8"'
    assert profile_train.categorize(line, "") == "gemm-fp8"


def test_profile_train_op_names_turns_command_buffers_off_before_the_backend(monkeypatch):
    """``--op-names`` adds XLA's command-buffer flag while JAX's backend has not started, and
    refuses (never silently ignored) once it has, as in this test process."""
    from benchmarks import profile_train as pt
    from fp8jax import _jax_compat

    jax.devices()
    with pytest.raises(SystemExit, match="backend already started"):
        pt.command_buffers_off()
    monkeypatch.setattr(_jax_compat, "backend_started", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
    pt.command_buffers_off()
    pt.command_buffers_off()  # once only
    assert os.environ["XLA_FLAGS"] == f"--xla_foo=1 {pt.COMMAND_BUFFERS_OFF}"


def test_big_writes_lists_activation_sized_passes_with_their_dtypes():
    from benchmarks.hlo import big_writes

    text = """HloModule m

ENTRY %main (p0: bf16[64,32]) -> f8e4m3fn[64,32] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %act = (f8e4m3fn[64,32]{1,0}, bf16[64,32]{1,0}, bf16[8]{0}) fusion(%p0), kind=kInput, calls=%f
  %gte = f8e4m3fn[64,32]{1,0} get-tuple-element(%act), index=0
  %small = f32[4]{0} fusion(%p0), kind=kLoop, calls=%g
  ROOT %gemm = (bf16[64,32]{1,0}, s8[16]{0}) custom-call(%gte), custom_call_target="__cublas$lt$matmul$f8"
}
"""
    rows = big_writes(text, 64 * 32)
    assert rows == [("act", "fusion", ["f8e4m3fn[2048]", "bf16[2048]"]),
                    ("gemm", "custom-call:__cublas$lt$matmul$f8", ["bf16[2048]"])]


def test_torch_peer_runs_a_tiny_linear_and_mlp_on_cpu():
    """The torch child process (eager, CPU) measures every torchao variant with the GEMM
    counts of the step; skipped where torch (or torchao) cannot be imported (CI)."""
    import os

    from benchmarks import torch_peer

    site = os.environ.get(torch_peer.SITE_ENV)
    peer = torch_peer.run_peer("linear", [(64, 32, 48)], torch_peer.VARIANTS, 2, 2, site,
                               compile=False, device="cpu")
    rows = peer[(64, 32, 48)]
    if len(rows) < len(torch_peer.VARIANTS):
        pytest.skip("torch or torchao not importable")
    for r in rows:
        assert r["error"] is None, f"{r['variant']}: {r['error']}"
        assert r["ms"] > 0 and r["gemm_count"] == 3 and r["params"] == dict(M=64, K=32, N=48)
        assert r["fp8_gemm_count"] == (0 if r["variant"] == "torchao-bf16" else 3)
        assert r["fp8_gemms"] == (r["variant"] != "torchao-bf16") and r["torch"]
    case = (64, 96, 128, "swiglu")
    (row,) = torch_peer.run_peer("mlp", [case], ["torchao-tensorwise"], 2, 2, site,
                                 compile=False, device="cpu")[case]
    assert row["error"] is None and row["ms"] > 0
    assert (row["fp8_gemm_count"], row["gemm_count"]) == (6, 6) and row["torchao"]


def test_linear_with_torchao_variants_but_no_torch_skips_them_in_one_line(capsys, tmp_path):
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)  # a torch that cannot be imported, put first
    (site / "torch" / "__init__.py").write_text("raise ImportError('no torch in this test')\n")
    variants = ["bf16", "fp8jax-delayed", *linear.PEER_VARIANTS]
    rows = linear.main(["--quick", "--shapes", "64,32,48", "--variants", ",".join(variants),
                        "--torch-site", str(site)])
    printed = capsys.readouterr().out
    skip_lines = [line for line in printed.splitlines() if "torch is not importable" in line]
    assert len(skip_lines) == 1 and all(v in skip_lines[0] for v in linear.PEER_VARIANTS)
    assert [r["variant"] for r in rows] == ["bf16", "fp8jax-delayed"]
    assert all(r["error"] is None and r["ms"] > 0 for r in rows)
    assert "Traceback" not in printed


def test_inference_quick_runs_both_variants(tmp_path):
    from benchmarks import inference

    out = tmp_path / "inference.jsonl"
    rows = inference.main(["--quick", "--out", str(out)])
    assert len(rows) == len(inference.QUICK_CASES) * len(inference.VARIANTS)
    for r in rows:
        assert r.get("error") is None, f"{r['variant']} {r['params']}: {r.get('error')}"
        assert r["prefill_tokens_per_s"] > 0 and r["decode_ms_per_token"] > 0
        assert math.isfinite(r["val_loss"]) and set(inference.RECORD_FIELDS) - {"val_loss_train",
               "val_loss_delta", "weight_scaling", "input_scale"} <= set(r)
    bf16, fp8 = sorted(rows, key=lambda r: r["variant"])
    assert fp8["weight_mb"] < bf16["weight_mb"]  # e4m3 block weights
    assert abs(fp8["val_loss_delta"]) < 0.05 * fp8["val_loss_train"]  # frozen scales: close


def test_distributed_quick_runs_both_variants_on_a_mesh(tmp_path):
    from benchmarks import distributed

    out = tmp_path / "distributed.jsonl"
    mesh = "data=2,fsdp=2,tensor=2"  # with sequence parallelism over "tensor"
    args = ["--quick", "--mesh", mesh, "--sequence-parallel", "--no-baseline", "--out", str(out)]
    rows = distributed.main(args)
    assert [r["variant"] for r in rows] == list(distributed.VARIANTS)
    for r in rows:
        assert r.get("error") is None, r.get("error")
        assert r["ms"] > 0 and r["tokens_per_s"] > 0 and r["params"]["gpus"] == 8
    gathers = {r["variant"]: r["allgather_dtypes"] for r in rows}
    assert gathers["fp8"].get("f8e4m3fn", 0) > 0 and "f8e4m3fn" not in gathers["bf16"]
    assert gathers["fp8"].get("f8e5m2", 0) > 0  # output gradients' tokens gathered in FP8
    assert all(r["params"]["sequence_parallel"] for r in rows)
    by = {r["variant"]: r["allgather_bytes"] for r in rows}
    assert by["fp8"] < by["bf16"]  # weights gathered at 1 byte/element instead of 2
    for r in rows:  # every kind's bytes; the all-gathers' are the ones above
        assert r["collective_bytes"]["all-gather"] == r["allgather_bytes"]
        assert r["collective_dtypes"]["all-gather"] == r["allgather_dtypes"]
        assert r["params"]["vocab"] == 256
    assert rows[1]["speedup_vs_bf16"] == pytest.approx(rows[0]["ms"] / rows[1]["ms"])
    _check_saved_residuals({r["variant"]: r for r in rows})
    assert "saved MiB" in distributed.table(rows)
    assert not out.exists()


def _check_saved_residuals(results):
    """Each variant's ``saved_residual_mb`` is the sum of its ``saved_residuals`` by dtype,
    with FP8 copies (``float8_e4m3fn``) in the fp8 variant only."""
    for name, r in results.items():
        by_dtype = r["saved_residuals"]
        assert r["saved_residual_mb"] == pytest.approx(sum(by_dtype.values())), name
        assert by_dtype.get("bfloat16", 0) > 0, (name, by_dtype)
        fp8 = {k: v for k, v in by_dtype.items() if k.startswith("float8")}
        assert (fp8.get("float8_e4m3fn", 0) > 0) if name == "fp8" else not fp8, (name, by_dtype)


def test_exposed_communication_is_the_collective_time_no_compute_covers():
    from benchmarks import comm_profile as cp

    comm = [(0, 10), (5, 15), (30, 40), (50, 60)]  # union: [0, 15], [30, 40], [50, 60]
    compute = [(2, 4), (12, 35), (50, 60), (70, 90)]
    # covered: 2..4 (2), 12..15 (3), 30..35 (5), 50..60 (10) of 35
    assert cp.exposed(comm, compute) == (35 - 20, 35)
    assert cp.exposed([], compute) == (0, 0)
    assert cp.exposed(comm, []) == (35, 35)
    assert cp.is_collective("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
    assert not cp.is_collective("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128")


def test_step_breakdown_sorts_kernels_and_counts_idle_time():
    """`breakdown_ms`: GEMM, attention and other kernels each as the union of their
    intervals, collectives only where no compute covers them, idle where nothing runs."""
    from benchmarks import comm_profile as cp

    assert cp.kernel_kind("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n") == "gemm"
    assert cp.kernel_kind("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert cp.kernel_kind("cudnn_generated_fort_native_sdpa_sm90_knob_7") == "attention"
    assert cp.kernel_kind("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL") == "collective"
    assert cp.kernel_kind("loop_convert_fusion_3") == "other"
    ms = 1_000_000
    kernels = {
        "/device:GPU:0": [
            ("nvjet_gemm_a", 0, 4 * ms),
            ("sm90_xmma_gemm_b", 3 * ms, 6 * ms),  # overlaps the first GEMM: union 6 ms
            ("cudnn_sdpa_fwd", 6 * ms, 8 * ms),
            ("ncclDevKernel_AllGather", 7 * ms, 11 * ms),  # 3 ms not under compute
            ("fusion_1", 12 * ms, 13 * ms),  # idle 11..12
        ]
    }
    got = cp.breakdown_ms(kernels, steps=1)
    want = dict(gemm=6.0, attention=2.0, other=1.0, exposed_comm=3.0, comm=4.0, idle=1.0,
                span=13.0)
    assert got == pytest.approx(want)
    assert cp.breakdown_ms(kernels, steps=2)["gemm"] == pytest.approx(3.0)
    two = dict(kernels, **{"/device:GPU:1": [("fusion_1", 0, 3 * ms), ("fusion_2", 0, ms)]})
    # "other" kernels by name, mean over the 2 GPUs and 2 steps: fusion_1 (1 + 3 ms) / 4
    assert cp.top_kernels(two, steps=2) == [("fusion_1", 1.0, 0.5), ("fusion_2", 0.25, 0.25)]
    assert cp.top_kernels(two, steps=1, n=1) == [("fusion_1", 2.0, 1.0)]


def test_collective_exposure_names_the_collectives_the_step_waits_for():
    """`collective_exposure`: per collective kernel (its name without the argument list),
    its time and the part no compute kernel of its GPU covers, mean over GPUs and steps."""
    from benchmarks import comm_profile as cp

    ms = 1_000_000
    kernels = {
        "/device:GPU:0": [
            ("nvjet_gemm", 0, 10 * ms),
            ("ncclDevKernel_AllGather_RING_LL(args)", 2 * ms, 5 * ms),  # under the GEMM
            ("ncclDevKernel_ReduceScatter_Sum_bf16(args)", 10 * ms, 13 * ms),  # waited for
            ("fusion_1", 12 * ms, 14 * ms),  # covers 1 ms of it
        ],
        "/device:GPU:1": [("ncclDevKernel_ReduceScatter_Sum_bf16(args)", 0, ms)],
    }
    got = cp.collective_exposure(kernels, steps=1)
    # ReduceScatter: (3 + 1) ms over 2 GPUs, exposed (2 + 1) / 2; AllGather 3 / 2, none shown
    assert got == [
        ("ncclDevKernel_ReduceScatter_Sum_bf16", 2.0, 1.5, 1.0),
        ("ncclDevKernel_AllGather_RING_LL", 1.5, 0.0, 0.5),
    ]
    assert cp.collective_exposure(kernels, steps=2, n=1)[0][1:] == (1.0, 0.75, 0.5)


def test_distributed_vocab_option(tmp_path):
    """``--vocab`` sizes the embedding and head (the tokens drawn from all of it); the FP8
    head and attention (split over fsdp x tensor) run and are recorded."""
    from benchmarks import distributed

    args = ["--quick", "--mesh", "fsdp=2,tensor=4", "--no-baseline", "--vocab", "1000",
            "--fp8-head", "--fp8-attention", "--out", str(tmp_path / "d.jsonl")]
    rows = distributed.main(args)
    assert [r["variant"] for r in rows] == ["bf16", "fp8"]
    for r in rows:
        assert r.get("error") is None, r.get("error")
        assert r["params"]["vocab"] == 1000 and r["params"]["fp8_head"]
        assert r["params"]["fp8_attention"]


def test_distributed_max_batch_finds_each_variants_largest_batch(tmp_path):
    """``--max-batch`` compiles (runs nothing) until it has, per variant, the largest
    global batch (a multiple of the data-parallel size) whose step fits the memory limit
    and, one data-parallel step larger, one that does not; a quick run writes nothing.
    (On a CPU XLA runs FP8 dots in float32, so FP8 fits no larger batch here.)"""
    from benchmarks import distributed

    out, limit_gb = tmp_path / "distributed.jsonl", 0.003
    args = ["--quick", "--max-batch", "--memory-limit-gb", str(limit_gb), "--mesh", "data=8",
            "--out", str(out)]
    rows = distributed.main(args)
    assert [r["variant"] for r in rows] == list(distributed.VARIANTS)
    for r in rows:
        assert r.get("error") is None, r.get("error")
        assert r["max_batch"] >= 8 and r["max_batch"] % 8 == 0  # 8 data-parallel ranks
        assert r["max_batch_mem_mb"] <= limit_gb * 1024 < r["next_mem_mb"]  # MiB
        assert 3 <= r["compiles"] <= 6 and r.get("ms") is None  # compiled, never run
        assert r["params"]["mesh"] == "data=8,fsdp=1,tensor=1" and "batch" not in r["params"]
    assert not out.exists()


def test_distributed_max_batch_under_sequence_parallelism_steps_in_whole_splits(tmp_path):
    """Under sequence parallelism more than one sequence per batch shard splits over the
    tensor axis as whole sequences, so the search steps in ``dp x tensor`` (it had compiled
    2 sequences per shard on tensor=4 and failed)."""
    from benchmarks import distributed

    args = ["--quick", "--max-batch", "--memory-limit-gb", "0.003", "--mesh", "data=2,tensor=4",
            "--sequence-parallel", "--variants", "fp8", "--out", str(tmp_path / "d.jsonl")]
    (row,) = distributed.main(args)
    assert row.get("error") is None, row.get("error")
    assert row["max_batch"] >= 8 and row["max_batch"] % 8 == 0, row
    assert row["params"]["sequence_cast"] is True


def test_max_batch_unit_is_one_sequence_per_shard_times_tensor_under_sequence_parallelism():
    """Both ``--max-batch`` probes (`benchmarks.distributed`, `benchmarks.memory`) step in
    `batch_search.batch_unit`."""
    from benchmarks.batch_search import batch_unit
    from helpers import eight_device_mesh

    mesh = eight_device_mesh(2, 1, 4)
    assert batch_unit(None, True) == 1
    assert batch_unit(mesh, False) == 2 and batch_unit(mesh, True) == 8


def test_distributed_max_batch_search_matches_a_linear_scan():
    """The search on made-up memory curves (linear, steeper at large batches, with a jump,
    flat): the largest multiple of ``dp`` under the limit, as a scan finds it, in few
    tries."""
    from benchmarks.batch_search import search_batch

    curves = {
        "linear": lambda b: 1000 + 50 * b,
        "steeper": lambda b: 1000 + 20 * b + b * b // 10,
        "jump": lambda b: 1000 + 40 * b + (5000 if b >= 600 else 0),
        "flat at first": lambda b: 30_000 if b <= 64 else 30_000 + 80 * (b - 64),
    }
    for name, nbytes in curves.items():
        for dp in (1, 8):
            for limit in (500, 2_000, 40_000, 61_000):
                fit, over, found = search_batch(nbytes, dp, limit)
                best = 0
                while nbytes(best + dp) <= limit:
                    best += dp
                assert (fit, over) == (best, best + dp), (name, dp, limit)
                assert found[over] > limit and (fit == 0 or found[fit] <= limit)
                assert len(found) <= 2 * math.log2(max(best, dp) / dp) + 4, (name, dp, found)
                for start in (best, best + 3 * dp, max(best // 2, 1)):  # --max-batch-from
                    assert search_batch(nbytes, dp, limit, start)[:2] == (best, best + dp)


def test_distributed_max_batch_cut_keeps_what_it_found():
    """A search interrupted (Ctrl-C, or SIGTERM from ``timeout`` under ``--max-batch``) still
    gives its row: the largest batch that fit so far (a lower bound), marked incomplete."""
    import os
    import signal

    from benchmarks.batch_search import interrupt_on_sigterm, search_row

    def nbytes(batch, calls=[]):  # noqa: B006 (counts the compiles)
        calls.append(batch)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return 1000 + 50 * batch

    row = search_row(nbytes, 8, 40_000)
    assert row["max_batch_complete"] is False and row["compiles"] == 2, row
    assert row["max_batch"] == 16 and row["next_mem_mb"] is None, row  # 8 and 16 fit
    full = search_row(lambda b: 1000 + 50 * b, 8, 40_000)
    assert full["max_batch_complete"] is True and full["max_batch"] == 776, full
    previous = signal.getsignal(signal.SIGTERM)
    try:
        interrupt_on_sigterm()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10**7):  # the handler runs between bytecodes
                pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_distributed_max_batch_needs_a_memory_limit_on_cpu(capsys):
    from benchmarks import distributed

    with pytest.raises(SystemExit):
        distributed.main(["--quick", "--max-batch"])
    assert "--max-batch on a CPU needs --memory-limit-gb" in capsys.readouterr().err


def test_distributed_probe_records_have_no_time(tmp_path):
    """A ``--max-batch`` row has no ``ms``: it is written by its ``max_batch``, with the
    optional fields it has; rows that failed (no ``max_batch``) are left out."""
    import json

    from benchmarks import common, distributed

    path = tmp_path / "r.jsonl"
    rows = [dict(bench="distributed", max_batch=24, next_mem_mb=3.2), dict(error="boom")]
    assert common.append_records(rows, path, distributed.RECORD_FIELDS) == 0  # no time
    written = common.append_records(rows, path, distributed.RECORD_FIELDS,
                                    optional=distributed.OPTIONAL_FIELDS, measured="max_batch")
    assert written == 1
    record = json.loads(path.read_text())
    assert record["max_batch"] == 24 and record["next_mem_mb"] == 3.2 and record["ms"] is None
    assert "compiles" not in record  # an optional field the row lacks


def test_front_doors_quick_times_the_nnx_object_doors(tmp_path):
    """The ``@nnx.jit`` step as the README writes it and under ``nnx.cached_partial``: both
    run and are timed; no records from a quick run."""
    pytest.importorskip("flax")
    from benchmarks import front_doors

    out = tmp_path / "front_doors.jsonl"
    rows = front_doors.main(["--quick", "--doors", "nnx-jit,nnx-cached", "--param-dtypes", "bf16",
                             "--out", str(out)])
    assert {r["params"]["door"] for r in rows} == {"nnx-jit", "nnx-cached"}
    for r in rows:
        assert r.get("error") is None, r.get("error")
        assert r["ms"] > 0
    assert not out.exists()


def test_memory_quick_remat_lowers_memory_and_a_case_runs_in_its_own_process(tmp_path):
    """``benchmarks.memory --quick``: the trainer's step per remat choice; ``--remat fp8``
    keeps less (compiled temporaries, residuals) and keeps FP8 copies. A case in its own
    process (``--isolate``, the GPU default: the allocator's peak is per process) gives the
    row the same case gives here; ``--max-batch`` probes the trainer's step. Nothing is
    written."""
    import jax

    from benchmarks import memory

    out = tmp_path / "memory.jsonl"
    args = ["--quick", "--variants", "fp8", "--batch", "32", "--out", str(out)]
    rows = memory.main(args + ["--remat", "none", "fp8"])
    assert [(r["variant"], r["params"]["remat"]) for r in rows] == [("fp8", "none"), ("fp8", "fp8")]
    for r in rows:
        assert r.get("error") is None, r.get("error")
        assert r["ms"] > 0 and r["tokens_per_s"] > 0 and math.isfinite(r["loss"])
        assert r["peak_mem_source"] == "compiled" and r["peak_mem_mb"] == r["compiled_mem_mb"]
        mesh = f"data={jax.device_count()},fsdp=1,tensor=1"  # the trainer's default mesh
        assert r["params"] == dict(preset="quick", mesh=mesh, batch=32, remat=r["params"]["remat"])
        assert r["saved_residual_mb"] == pytest.approx(sum(r["saved_residuals"].values()))
    none, fp8 = rows
    assert fp8["temp_mem_mb"] < 0.9 * none["temp_mem_mb"]  # 0.80x on 8 CPU devices
    assert fp8["saved_residual_mb"] < 0.75 * none["saved_residual_mb"]  # 0.62x
    assert fp8["saved_residuals"]["float8_e4m3fn"] > 0
    assert fp8["mem_vs_none"] == pytest.approx(fp8["peak_mem_mb"] / none["peak_mem_mb"])
    assert fp8["mem_vs_none"] < 1 and none["mem_vs_none"] == 1
    (child,) = memory.main(args + ["--remat", "fp8", "--isolate"])
    assert child.get("error") is None, child.get("error")
    for key in ("compiled_mem_mb", "temp_mem_mb", "saved_residual_mb", "saved_residuals"):
        assert child[key] == fp8[key], key
    # --max-batch's search is test_distributed_max_batch's; here its wiring, in one compile: a
    # limit below the smallest batch's bytes finds none and names that batch's bytes
    (probe,) = memory.main(args + ["--remat", "fp8", "--no-isolate", "--max-batch",
                                   "--memory-limit-gb", "0.0001"])  # fmt: skip
    assert probe["max_batch"] == 0 and probe["compiles"] == 1, probe
    assert probe["next_mem_mb"] > 0.0001 * 1024, probe
    # the FP8 head and attention (the 8b rows' settings) reach the run, its params and a case's
    # own process
    extra = ["--fp8-head", "--fp8-attention", "--max-batch-from", "64"]
    (head,) = memory.main(args + ["--remat", "none", "--no-isolate"] + extra)
    assert head.get("error") is None, head.get("error")
    assert head["params"]["fp8_head"] is True and head["params"]["fp8_attention"] is True
    child_argv = memory._case_argv(memory.build_parser().parse_args(args + extra), "fp8", "lean")
    assert {"--fp8-head", "--fp8-attention"} <= set(child_argv), child_argv
    assert child_argv[child_argv.index("--max-batch-from") + 1] == "64", child_argv
    assert not out.exists()


def test_distributed_records_the_remat_choice():
    """``benchmarks.distributed --remat`` reaches the run and its records' params (only
    when it is not ``none``, so older records keep their keys)."""
    import dataclasses

    import jax

    from benchmarks import distributed
    from fp8jax.train import _cli as cli

    run = dataclasses.replace(cli.RunConfig(**cli.PRESETS["tiny"]), remat="fc1-fp8")
    sizes = {"data": 1, "fsdp": 1, "tensor": 1}
    assert distributed.run_params(run, sizes, jax.devices()[:1])["remat"] == "fc1-fp8"
    plain = dataclasses.replace(run, remat="none")
    assert "remat" not in distributed.run_params(plain, sizes, jax.devices()[:1])
    assert cli.build_model(run, "fp8").remat == "fc1-fp8"


def test_distributed_keeps_the_mesh_row_when_the_one_device_baseline_fails(monkeypatch):
    """The one-device baseline of a model too large for one device (8b on one H200 ran out of
    memory) no longer erases the mesh's measured row: scaling efficiency is None and the
    baseline's error is kept beside it."""
    import jax

    from benchmarks import distributed

    calls = []

    def measure(run, precision, mesh, batch, steps, hlo=True, top_kernels=0):
        calls.append(mesh.size)
        if mesh.size == 1:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory")
        return dict(ms=10.0, tokens_per_s=100.0)

    monkeypatch.setattr(distributed, "measure", measure)
    run = distributed.cli.RunConfig(**distributed.cli.PRESETS["tiny"])
    sizes = dict(data=1, fsdp=4, tensor=1)
    row = distributed.run_variant(run, "fp8", sizes, jax.devices()[:4], 1, baseline=True)
    assert calls == [4, 1]
    assert row["ms"] == 10.0 and row["scaling_efficiency"] is None and "error" not in row
    assert "Out of memory" in row["baseline_error"]
