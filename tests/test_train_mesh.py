"""fp8jax-train on a device mesh (8 host CPU devices, issue 24): ``--mesh data=2,fsdp=4``
matches the single-device run, a checkpoint written on ``fsdp=8`` restores onto
``data=2,fsdp=4`` and onto one device (a fresh process) with the same state and training
continues with the same loss, bad ``--mesh`` strings raise clear errors."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import distributed
from fp8jax.train import _cli as cli, _loop as loop
from fp8jax.train import _trainer as trainer_module
from fp8jax.train._trainer import Trainer
from fp8jax.train._checkpoint import restore_checkpoint
from fp8jax.train._data import load_corpus
from fp8jax.train._memory import compiled_bytes
from fp8jax.train._mesh import (
    build_placed,
    default_mesh,
    make_mesh,
    parse_mesh,
    place_model,
    shard_embedding,
)
from fp8jax.train._model import ModelConfig

pytestmark = pytest.mark.skipif(
    len(jax.devices()) != 8, reason="needs 8 devices (conftest's XLA_FLAGS)"
)

ARGS = ["--dim", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--ffn", "64",
        "--seq", "32", "--batch", "8", "--eval-batches", "2", "--max-bytes", "300000",
        "--lr", "3e-3", "--steps", "3", "--eval-every", "3", "--checkpoint-every", "0",
        "--precision", "fp8", "--quiet", "--no-plot", "--no-tensorboard"]  # fmt: skip
# Against one device: the sharded step sums partial GEMMs and gradients in another order, in
# bf16 compute, and Adam's normalized update magnifies the gradients' last bits. Measured on
# CPU: step 1 (same weights) within 2e-7 relative, steps 2-3 within 1.7e-4 (bf16's epsilon
# is 7.8e-3; a batch split wrongly changes the loss by 1e-2 or more).
FIRST_RTOL = 1e-5
LOSS_RTOL = 1e-3


def _trainer(run, mesh_text):
    mesh = make_mesh(parse_mesh(mesh_text))
    return Trainer(cli.build_model(run, "fp8"), cli.make_optimizer(run), mesh)


def test_mesh_run_matches_one_device_and_checkpoint_moves_mesh(tmp_path):
    run = cli.run_config(cli.parse_args(ARGS))
    corpus = load_corpus(max_bytes=300_000)
    ref = loop.train(run, "fp8", corpus, tmp_path / "ref", quiet=True, tensorboard=False)
    out = tmp_path / "mesh"
    # Steps 1-2 on fsdp=8, "Ctrl-C" checkpoints them (sharded over 8 devices) ...
    cut = cli.main(ARGS + ["--mesh", "fsdp=8", "--out", str(out)], interrupt_at=2)["fp8"]
    assert cut["interrupted"] and (out / "ckpt-fp8" / "2").exists()
    one = tmp_path / "one-device"  # a copy for the 1-device resume (the mesh one saves step 3)
    shutil.copytree(out, one)
    # ... which restores onto data=2,fsdp=4 with the same values, placed on the new mesh.
    old, new = _trainer(run, "fsdp=8"), _trainer(run, "data=2,fsdp=4")
    fresh = jax.tree_util.tree_leaves(new.params)
    assert restore_checkpoint(out, "fp8", old)[0] == restore_checkpoint(out, "fp8", new)[0] == 2
    leaves = [jax.tree_util.tree_leaves(t.params) + jax.tree_util.tree_leaves(t.opt_state)
              for t in (old, new)]  # fmt: skip
    for a, b in zip(*leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert b.sharding.mesh.shape == {"data": 2, "fsdp": 4, "tensor": 1}
    assert any(not np.array_equal(a, b) for a, b in zip(fresh, leaves[1], strict=False))
    fc1 = new.params.blocks.mlp.fc1.weight  # [layers, out, in], FSDP along out
    assert fc1.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", None)
    assert fc1.addressable_shards[0].data.shape == (2, 128 // 4, 64)
    # Step 3 on data=2,fsdp=4: all three losses as on one device.
    resumed = cli.main(ARGS + ["--mesh", "data=2,fsdp=4", "--out", str(out), "--resume"])["fp8"]
    losses = [h["loss"] for h in resumed["history"]]
    want = [h["loss"] for h in ref["history"]]
    assert [h["step"] for h in resumed["history"]] == [1, 2, 3] and len(set(want)) == 3
    np.testing.assert_allclose(losses[0], want[0], rtol=FIRST_RTOL)
    np.testing.assert_allclose(losses, want, rtol=LOSS_RTOL)
    np.testing.assert_allclose(resumed["val_loss"], ref["val_loss"], rtol=LOSS_RTOL)
    # The fsdp=8 checkpoint also resumes in a process that sees one device (no mesh):
    # step 3 and the evaluation as on data=2,fsdp=4.
    single, meta = _resume_on_one_device(one)
    assert meta["mesh"] == "" and "x 8" not in meta["device"]  # one device, no mesh
    assert [h["step"] for h in single["history"]] == [1, 2, 3]
    one_losses = [h["loss"] for h in single["history"]]
    np.testing.assert_array_equal(one_losses[:2], losses[:2])  # the restored history
    np.testing.assert_allclose(one_losses[2], losses[2], rtol=LOSS_RTOL)
    np.testing.assert_allclose(single["val_loss"], resumed["val_loss"], rtol=LOSS_RTOL)


def _resume_on_one_device(out):
    """``python -m fp8jax.train --resume`` in a fresh process with one CPU device; its
    result and the run's metadata."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "fp8jax.train", *ARGS, "--out", str(out), "--resume"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((out / "metrics.json").read_text())["meta"]
    return json.loads((out / "result-fp8.json").read_text()), meta


def test_embedding_and_its_moments_are_split_over_fsdp():
    """Replicated, the embedding's float32 rows and AdamW moments cost every device 12 bytes
    an entry (6.3 GB at the 8b preset): they are split over fsdp along the vocabulary, along
    dim where fsdp does not divide it, and stay whole without an fsdp axis."""
    P = jax.sharding.PartitionSpec
    run = cli.run_config(cli.parse_args(ARGS))
    trainer = _trainer(run, "data=2,fsdp=4")
    vocab, dim = trainer.params.embed.shape
    assert trainer.params.embed.sharding.spec == P("fsdp", None)
    assert trainer.params.embed.addressable_shards[0].data.shape == (vocab // 4, dim)
    moments = [
        x
        for p, x in jax.tree_util.tree_flatten_with_path(trainer.opt_state)[0]
        if jax.tree_util.keystr(p).endswith(".embed")
    ]
    assert len(moments) == 2 and all(m.sharding.spec == P("fsdp", None) for m in moments)
    odd = jnp.ones((vocab + 2, dim))  # 258 rows: fsdp=4 splits dim instead
    assert shard_embedding(odd, make_mesh(parse_mesh("data=2,fsdp=4"))).sharding.spec == P(
        None, "fsdp"
    )
    assert shard_embedding(odd, make_mesh(parse_mesh("data=8"))).sharding.is_fully_replicated
    neither = shard_embedding(jnp.ones((258, 66)), make_mesh(parse_mesh("fsdp=8")))
    assert neither.sharding.is_fully_replicated


def test_unplaced_model_is_freed_before_the_optimizer_state(monkeypatch, tmp_path):
    """On a mesh no whole float32 model may sit on one device when the optimizer state is
    made (8b fsdp=4: built whole on device 0 and held there, it set device 0's peak at 55 GB
    where the step needs 46; benchmarks/RESULTS.md, twenty-fifth session). The trainer now
    makes each device's shards only (`build_placed`). Device 0's live bytes when
    `_init_sharded` runs, against the model's."""
    run = dataclasses.replace(cli.run_config(cli.parse_args(ARGS)), steps=1)
    dev0 = jax.devices()[0]

    def on_dev0() -> int:
        return sum(
            s.data.nbytes for a in jax.live_arrays() for s in a.addressable_shards
            if s.device == dev0
        )  # fmt: skip

    seen = []
    init = trainer_module._init_sharded

    def watched(optimizer, params, mesh):
        seen.append(on_dev0())
        return init(optimizer, params, mesh)

    monkeypatch.setattr(trainer_module, "_init_sharded", watched)
    model_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(cli.build_model(run, "fp8")))
    before = on_dev0()
    corpus = load_corpus(max_bytes=300_000)
    mesh = make_mesh(parse_mesh("fsdp=8"))
    loop.train(run, "fp8", corpus, tmp_path / "run", quiet=True, tensorboard=False, mesh=mesh)
    assert seen, "the trainer made no sharded optimizer state"
    # placed: an eighth of the weights and the replicated norms and FP8 state
    assert seen[0] - before < 0.5 * model_bytes, (seen[0] - before, model_bytes)


@pytest.mark.parametrize("mesh_text", ["data=2,fsdp=4", "fsdp=2,tensor=4"])
def test_build_placed_makes_each_shard_where_place_model_puts_it(mesh_text):
    """The trainer's sharded init: the model placed abstractly, then made by one jitted
    build with those shardings: the same tree (weight shardings recorded), each array where
    `place_model` puts it, the values of the eager build up to the init's fusion (the last
    bit of the embedding's normal draws)."""
    import functools

    import equinox as eqx

    run = cli.run_config(cli.parse_args(ARGS + ["--fp8-head", "--fp8-attention"]))
    mesh = make_mesh(parse_mesh(mesh_text))
    tp = mesh.shape["tensor"] > 1
    build = functools.partial(cli.build_model, run, "fp8")
    made = build_placed(build, mesh, sequence_parallel=tp)
    ref = place_model(build(), mesh, sequence_parallel=tp)
    (a, sa), (b, sb) = eqx.partition(made, eqx.is_array), eqx.partition(ref, eqx.is_array)
    assert eqx.tree_equal(sa, sb)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (x.sharding, y.sharding)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-9)


def test_tensor_axis_places_megatron_split():
    run = cli.run_config(cli.parse_args(ARGS))
    params = _trainer(run, "tensor=2,fsdp=4").params.blocks
    P = jax.sharding.PartitionSpec
    assert params.attn.qkv.weight.sharding.spec == P(None, "tensor", "fsdp")  # column
    assert params.mlp.fc2.weight.sharding.spec == P(None, "fsdp", "tensor")  # row
    assert params.attn.norm.sharding.spec == P()


@pytest.mark.parametrize(
    "text, match",
    [
        ("data=2,fsdp=3", "multiply to 6, but 8 devices"),
        ("data=4", "multiply to 4, but 8 devices"),
        ("model=8", "unknown axis 'model'; axes are data, fsdp, tensor"),
        ("data=2,data=4", "'data' is given twice"),
        ("data", "'data' is not AXIS=SIZE"),
        ("data=two", "size 'two' of 'data' is not an int"),
        ("data=0,fsdp=8", "must be >= 1"),
    ],
)
def test_bad_mesh_raises(tmp_path, text, match):
    with pytest.raises(ValueError, match="--mesh " + repr(text) + ".*" + match):
        cli.main(ARGS + ["--mesh", text, "--out", str(tmp_path)])


def test_default_mesh_is_fsdp_on_gpus():
    """No ``--mesh``: FSDP over the GPUs (measured faster than data parallel there), data
    parallel over the CPU's virtual devices; either splits the batch over all devices."""
    assert default_mesh("gpu", 4) == "fsdp=4"
    assert default_mesh("cpu", 8) == "data=8"
    for backend in ("gpu", "cpu"):
        sizes = parse_mesh(default_mesh(backend, 8))
        assert sizes["data"] * sizes["fsdp"] == 8 and sizes["tensor"] == 1


def test_bad_batch_or_multihost_options_raise(tmp_path):
    with pytest.raises(ValueError, match=r"--batch 6 does not divide .* data x fsdp = 8"):
        cli.main(ARGS + ["--batch", "6", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--coordinator, --num-processes and --process-id go"):
        cli.main(ARGS + ["--coordinator", "localhost:1234", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--process-id 2 must be in"):
        cli.main(ARGS + ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"])


def test_sequence_parallel_step_matches_tensor_parallel():
    """``--sequence-parallel`` on data=4,tensor=2: the train step's loss as without it (same
    math, tokens split between the blocks), and its FP8 layers gather tokens in FP8 (e4m3
    inputs, e5m2 output gradients). With or without it, attention needs no reshuffle (the
    qkv outputs are grouped per KV head), nor does `FusedMLP`'s activation (fc1's gate and
    up rows interleaved: `FusedMLP.gate_block`)."""
    heads = ["--heads", "4", "--kv-heads", "2", "--fp8-everywhere", "--sequence-parallel"]
    run = cli.run_config(cli.parse_args(ARGS + heads))
    assert run.sequence_parallel
    tokens = np.random.default_rng(0).integers(0, 256, (8, 33), dtype=np.int32)
    losses, collectives = [], []
    for sp in (False, True):
        mesh = make_mesh(parse_mesh("data=4,tensor=2"))
        model, opt = cli.build_model(run, "fp8"), cli.make_optimizer(run)
        trainer = Trainer(model, opt, mesh, sequence_parallel=sp)
        batch = trainer.device_batch(tokens)
        lowered = trainer._train.lower(trainer.params, trainer.opt_state, batch)
        compiled, cs = distributed.compile_with_collectives(lowered)
        losses.append(float(compiled(trainer.params, trainer.opt_state, batch)[2]))
        collectives.append(cs)
        assert not [c for c in cs if c.kind in ("all-to-all", "collective-permute")], cs
    np.testing.assert_allclose(losses[1], losses[0], rtol=FIRST_RTOL)
    gathers = [
        c for c in collectives[1] if c.kind == "all-gather" and "sharding_constraint" in c.op_name
    ]
    # per block (scanned: counted once): qkv and fc1 gather their input (forward) and its
    # transposed copy (backward); o and fc2 their output gradient once (per-tensor scale: the
    # wgrad's copy is the gathered one transposed on each device)
    assert sorted(c.dtype for c in gathers) == ["f8e4m3fn"] * 4 + ["f8e5m2"] * 2, gathers
    assert not [c for c in collectives[0] if "sharding_constraint" in c.op_name]


def test_sequence_parallel_bad_options(tmp_path):
    with pytest.raises(ValueError, match="--sequence-parallel needs a --mesh with tensor > 1"):
        cli.main(ARGS + ["--mesh", "data=8", "--sequence-parallel", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--sequence-parallel: dense blocks only"):
        cli.main(ARGS + ["--mesh", "data=2,tensor=4", "--sequence-parallel", "--experts", "4",
                         "--out", str(tmp_path)])  # fmt: skip
    with pytest.raises(ValueError, match=r"2 sequences of --seq 32 per batch shard"):
        cli.main(ARGS + ["--mesh", "fsdp=2,tensor=4", "--batch", "4", "--sequence-parallel",
                         "--out", str(tmp_path)])  # fmt: skip


# Issue 49: a CPU-sized dense model, its layers unrolled (as benchmarks.distributed measures
# them: each layer's gathers are their own instructions, which XLA may schedule anywhere).
MEMORY_MODEL = ModelConfig(
    dim=256, layers=2, heads=4, kv_heads=4, ffn=768, seq=256, vocab=512, scan_unroll=2
)


def _step_bytes(precision: str, mesh_text: str) -> int:
    """The compiled train step's bytes per device (`compiled_bytes`, donated state counted
    once) on four of the devices, ``--sequence-parallel`` where there is a tensor axis."""
    run = cli.RunConfig(**cli.PRESETS["tiny"])
    run = dataclasses.replace(run, model=MEMORY_MODEL, batch=8, remat="none")
    mesh = make_mesh(parse_mesh(mesh_text, 4), jax.devices()[:4])
    sp = mesh.shape["tensor"] > 1
    trainer = Trainer(cli.build_model(run, precision), cli.make_optimizer(run), mesh, sp)
    tokens = np.random.default_rng(0).integers(0, 256, (8, MEMORY_MODEL.seq + 1), np.int32)
    batch = trainer.device_batch(tokens)
    compiled = trainer._train.lower(trainer.params, trainer.opt_state, batch).compile()
    return compiled_bytes(compiled, donated=True)


@pytest.mark.parametrize("mesh_text", ["tensor=4", "fsdp=2,tensor=2", "fsdp=4"])
def test_fp8_step_needs_less_memory_than_bf16(mesh_text):
    """Issue 49: the FP8 step's compiled peak is below the bf16 step's, with sequence
    parallelism too. The backward gathers again what the forward keeps split (the FP8
    input's tokens, the FP8 weight under FSDP) only once the output gradient exists
    (`fp8jax._ops.dot._after`); before, XLA ran those gathers in the forward and held every
    layer's gathered copy until the backward (measured: FP8 3.6 MB above bf16 at tensor=4,
    0.8 MB at fsdp=2,tensor=2, 1.6 MB at fsdp=4; 1.7, 3.6 and 1.0 MB below after)."""
    bf16, fp8 = _step_bytes("bf16", mesh_text), _step_bytes("fp8", mesh_text)
    assert fp8 < bf16 - 500_000, (fp8, bf16)
