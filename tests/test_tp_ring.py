"""Collective matmul for the sequence-parallel FP8 linear (issue 48, `fp8jax._ops.tp_ring`)
on 8 host CPU devices: the ring step (``tp_overlap="ring"``) against the unchunked one
(constraint pairs), and the compiled collectives it leaves: ``collective-permute``s moving
FP8 tokens and output-dtype partial sums, no token all-gather or reduce-scatter."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
import fp8jax.tuning
import test_distributed as td
import test_train_mesh as ttm
from fp8jax import distributed
from fp8jax.train import _cli as cli
from fp8jax.train import _trainer
from fp8jax.train._mesh import make_mesh, parse_mesh

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs 8 devices (conftest's XLA_FLAGS)"
)

SP = {"tensor_axis": "tensor", "column_parallel": ["l1"], "row_parallel": ["l2"]}
TOKENS = P(("data", "fsdp", "tensor"), None)  # tokens split over every axis


def _placed(mesh, overlap: str):
    fsdp = {} if mesh.shape["fsdp"] > 1 else {"fsdp_axis": None}
    model = fp8jax.shard_model(
        td._model(), mesh, **SP, **fsdp, sequence_parallel=True, tp_overlap=overlap
    )
    assert model.l1.dot_general.weight_sharding.sequence.overlap == overlap
    return model


@pytest.mark.parametrize("overlap", ["ring", "chunks"])
@pytest.mark.parametrize("shape", [(2, 1, 4), (1, 2, 4), (1, 1, 8)])
def test_ring_step_matches_unchunked_step(shape, overlap):
    """Three float32 train steps, ring against unchunked: the same losses, gradients and
    FP8 state. The wgrads and every FP8 cast are the same computations on the same values
    (bit-identical here); only the reductions (l2's output, l1's dgrad) add the same
    partial sums in ring order, an ulp apart: measured on CPU, l2's bias gradient 1.8e-7
    of its max, everything else equal. Hence `helpers`' sharded-run tolerances
    (`td.check_matches`: losses 1e-6 relative, gradients 1e-5 of their max, FP8 state 1e-6
    relative and replicated) and bit-identical weight gradients, input and kernel state."""
    mesh = td._mesh(*shape)
    x, y = (jax.device_put(a, NamedSharding(mesh, TOKENS)) for a in td._data())
    ring = td._train(_placed(mesh, overlap), x, y)
    unchunked = td._train(_placed(mesh, "none"), x, y)
    td.check_matches(ring, unchunked)
    (model, _, grads), (ref_model, _, ref_grads) = ring, unchunked
    for g, rg in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        if g.ndim == 2:  # the weights' gradients: the same FP8 GEMMs on the same operands
            np.testing.assert_array_equal(g, rg)
    # the inputs' and kernels' scales and amax histories never see a reduction's order
    for layer in ("l1", "l2"):
        for name in ("input_scale", "kernel_scale", "input_amax_history", "kernel_amax_history"):
            a, b = (getattr(getattr(m, layer).dot_general, name) for m in (model, ref_model))
            np.testing.assert_array_equal(a, b)


def test_ring_collectives_move_fp8_tokens_and_output_dtype_sums():
    """data=2, tensor=4 (no FSDP: every all-gather would be a token's): each ring is
    three ``collective-permute``s of one device's 16 tokens. Forward: l1's FP8 input
    (e4m3), l2's float32 partial sums; backward: l2's FP8 output gradient (e5m2), l1's
    float32 dgrad partial sums with its FP8 input's transposed chunks (e4m3) riding along.
    No all-gather, no reduce-scatter, and the forward reduces nothing but amaxes."""
    mesh = td._mesh(2, 1, 4)
    cs = td._collectives(_placed(mesh, "ring"), mesh, TOKENS)
    permutes = sorted((c.dtype, c.shape) for c in cs if c.kind == "collective-permute")
    assert permutes == sorted(
        [("f8e4m3fn", "[1,16,64]")] * 3
        + [("f32", "[1,16,64]")] * 6
        + [("f8e5m2", "[1,16,64]")] * 3
        + [("f8e4m3fn", "[1,64,16]")] * 3
    ), permutes
    assert not [c for c in cs if c.kind in ("all-gather", "reduce-scatter", "all-to-all")], cs
    fwd = [c for c in cs if c.kind == "all-reduce" and "transpose(" not in c.op_name]
    assert fwd and all(c.shape == "[]" for c in fwd), fwd  # the amaxes
    # the unchunked step's l2 output reduction, for contrast: a forward all-reduce of tokens
    unchunked = td._collectives(_placed(mesh, "none"), mesh, TOKENS)
    assert [c for c in unchunked if c.kind == "all-gather"]
    assert not [c for c in unchunked if c.kind == "collective-permute"]


def test_chunks_collectives_move_fp8_tokens_in_chunks():
    """``tp_overlap="chunks"`` on data=2, tensor=4 (16 tokens per device, 2 chunks of 8):
    each token move is two collectives of one chunk each, in the dtypes of the unchunked
    path: l1's FP8 input (e4m3) and l2's FP8 output gradient (e5m2) all-gathered to 32
    tokens; l2's output and l1's dgrad partial sums (float32) reduce-scattered to 8 tokens;
    l1's transposed FP8 input gathered whole for its wgrad. No collective-permute. With
    ``tp_chunks=1`` each move is one collective again."""
    mesh = td._mesh(2, 1, 4)
    cs = td._collectives(_placed(mesh, "chunks"), mesh, TOKENS)
    moves = sorted((c.kind, c.dtype, c.shape) for c in cs if c.kind != "all-reduce")
    assert moves == sorted(
        [("all-gather", "f8e4m3fn", "[1,32,64]")] * 2
        + [("all-gather", "f8e5m2", "[1,32,64]")] * 2
        + [("reduce-scatter", "f32", "[1,8,64]")] * 4
        + [("all-gather", "f8e4m3fn", "[1,64,64]")]
    ), moves
    jax.clear_caches()  # the module's step was jitted (traced) outside the block
    with fp8jax.tuning.gemm(tp_chunks=1):
        whole = td._collectives(_placed(mesh, "chunks"), mesh, TOKENS)
    kinds = sorted((c.kind, c.shape) for c in whole if c.kind != "all-reduce")
    assert kinds == sorted(
        [("all-gather", "[1,64,64]")] * 3 + [("reduce-scatter", "[1,16,64]")] * 2
    ), kinds


def test_chunk_count_divides_the_tokens():
    """`tp_ring.chunk_count`: the tuned count, or the largest count below it dividing m."""
    from fp8jax._ops import tp_ring

    assert tp_ring.chunk_count(16) == 2
    with fp8jax.tuning.gemm(tp_chunks=4):
        assert [tp_ring.chunk_count(m) for m in (16, 6, 7)] == [4, 3, 1]
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="tp_chunks must be a positive int"):
            with fp8jax.tuning.gemm(tp_chunks=bad):
                pass


def test_trainer_ring_step_in_bfloat16():
    """``fp8jax-train --sequence-parallel --tp-overlap ring`` (data=2, tensor=4; qkv, o,
    fc1, fc2 as rings): the first step's loss as unchunked within 2e-3. The model computes
    in bfloat16, and the ring rounds l2's partial sums to bfloat16 at each of its 3 hops
    where the CPU's all-reduce rounded once (measured: 5.0e-4; with the ring summing in
    float32 the loss was bit-identical). Every token moves as a collective-permute: FP8
    inputs and output gradients, bfloat16 partial sums; no FP8 all-gather is left."""
    heads = ["--heads", "4", "--kv-heads", "2", "--fp8-everywhere", "--sequence-parallel"]
    run = cli.run_config(cli.parse_args(ARGS + heads + ["--tp-overlap", "ring"]))
    assert run.tp_overlap == "ring"
    tokens = np.random.default_rng(0).integers(0, 256, (8, 33), dtype=np.int32)
    losses, collectives = {}, {}
    for overlap in ("none", "ring"):
        mesh = make_mesh(parse_mesh("data=2,tensor=4"))
        model, opt = cli.build_model(run, "fp8"), cli.make_optimizer(run)
        trainer = _trainer.Trainer(model, opt, mesh, sequence_parallel=True, tp_overlap=overlap)
        batch = trainer.device_batch(tokens)
        lowered = trainer._train.lower(trainer.params, trainer.opt_state, batch)
        compiled, collectives[overlap] = distributed.compile_with_collectives(lowered)
        losses[overlap] = float(compiled(trainer.params, trainer.opt_state, batch)[2])
    np.testing.assert_allclose(losses["ring"], losses["none"], rtol=2e-3)
    ring = collectives["ring"]
    assert not [c for c in ring if c.kind == "all-gather" and c.dtype.startswith("f8")], ring
    moved = {c.dtype for c in ring if c.kind == "collective-permute"}
    assert {"f8e4m3fn", "f8e5m2", "bf16"} <= moved, moved
    sums = [c for c in ring if c.kind == "collective-permute" and c.dtype == "bf16"]
    assert ("bf16", "[1,32,64]") in {(c.dtype, c.shape) for c in sums}, sums


ARGS = [*ttm.ARGS, "--mesh", "data=2,tensor=4"]


def test_tp_overlap_bad_options(tmp_path):
    mesh = td._mesh(2, 1, 4)
    with pytest.raises(ValueError, match=r"shard_model: tp_overlap must be one of .*'rings'"):
        fp8jax.shard_model(td._model(), mesh, **SP, sequence_parallel=True, tp_overlap="rings")
    with pytest.raises(ValueError, match=r"sequence_parallel: tp_overlap must be one of"):
        distributed.sequence_parallel(td._model(), mesh, ["l1"], ["l2"], tp_overlap="x")
    with pytest.raises(ValueError, match="--tp-overlap ring needs --sequence-parallel"):
        cli.main(ARGS + ["--tp-overlap", "ring", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match=r"--tp-overlap ring: per-tensor .*--recipe rowwise"):
        cli.main(ARGS + ["--sequence-parallel", "--tp-overlap", "ring", "--recipe", "rowwise",
                         "--out", str(tmp_path)])  # fmt: skip


@pytest.mark.parametrize("overlap", ["ring", "chunks"])
def test_overlap_with_a_per_token_recipe_is_refused(overlap):
    """A ring or chunks takes per-tensor recipes only: a row-wise layer asked for one is
    refused by name (it would otherwise move its tokens whole without a word), from
    `shard_model`, `distributed.sequence_parallel` and the flax front door alike."""
    from fp8jax import flax as fp8flax

    mesh = td._mesh(2, 1, 4)
    rowwise = fp8jax.Fp8Config(recipe="rowwise", selective=False)
    model = fp8jax.fp8_linear_layers(td.MLP(jax.random.PRNGKey(0)), rowwise)
    match = rf"tp_overlap='{overlap}' takes per-tensor recipes only; layer 'l1' uses RowWise"
    with pytest.raises(ValueError, match="shard_model: " + match):
        fp8jax.shard_model(model, mesh, **SP, sequence_parallel=True, tp_overlap=overlap)
    placed = fp8jax.shard_model(model, mesh, **SP)
    with pytest.raises(ValueError, match="sequence_parallel: " + match):
        distributed.sequence_parallel(placed, mesh, ["l1"], ["l2"], tp_overlap=overlap)
    with pytest.raises(ValueError, match=r"fp8_dot_general_cls: .* its config uses RowWise"):
        fp8flax.fp8_dot_general_cls(rowwise, sequence_parallel="row", mesh=mesh, tp_overlap=overlap)
    # without sequence parallelism there is nothing to chunk: refused, not ignored
    with pytest.raises(ValueError, match=f"shard_model: tp_overlap='{overlap}' moves"):
        fp8jax.shard_model(td._model(), mesh, **SP, tp_overlap=overlap)
    with pytest.raises(ValueError, match=f"fp8_dot_general_cls: tp_overlap='{overlap}' moves"):
        fp8flax.fp8_dot_general_cls(rowwise, tp_overlap=overlap)
    # per-tensor (the default recipe) and tp_overlap="none" with row-wise are fine
    fp8jax.shard_model(model, mesh, **SP, sequence_parallel=True)
    fp8jax.shard_model(td._model(), mesh, **SP, sequence_parallel=True, tp_overlap=overlap)


def test_distributed_benchmark_tp_overlap_flag(capsys):
    """``python -m benchmarks.distributed --sequence-parallel --tp-overlap ring``: the run's
    records say so; the flag alone is a usage error."""
    from benchmarks import distributed as bench

    with pytest.raises(SystemExit):
        bench.main(["--quick", "--mesh", "data=2,tensor=4", "--tp-overlap", "ring"])
    assert "--tp-overlap ring needs --sequence-parallel" in capsys.readouterr().err
    run = cli.run_config(cli.parse_args(ARGS + ["--sequence-parallel", "--tp-overlap", "ring"]))
    sizes = {"data": 2, "fsdp": 1, "tensor": 4}
    params = bench.run_params(run, sizes, jax.devices())
    assert params["sequence_parallel"] and params["tp_overlap"] == "ring"
    assert "tp_chunks" not in params
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--mesh", "data=2,tensor=4", "--sequence-parallel",
                    "--tp-chunks", "4"])  # fmt: skip
    assert "--tp-chunks needs --tp-overlap chunks" in capsys.readouterr().err
    run = cli.run_config(cli.parse_args(ARGS + ["--sequence-parallel", "--tp-overlap", "chunks"]))
    with fp8jax.tuning.gemm(tp_chunks=4):
        assert bench.run_params(run, sizes, jax.devices())["tp_chunks"] == 4
