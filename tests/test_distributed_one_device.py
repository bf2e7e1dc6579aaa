"""The 8-device sharding tests' program on one device (issue 24's GPU check): every setup
of ``test_distributed`` on a mesh whose axes are all size 1 matches the unsharded run, and
on a GPU every GEMM of the sharded step is FP8. Runs on CPU too (one of the host devices)."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_distributed import (
    BLOCK_MESH,
    BLOCK_SHARDING,
    OPT,
    SETUPS,
    _block,
    _block_step,
    _data,
    _model,
    _train,
    _train_block,
    check_matches,
    step,
)

import fp8jax

ON_GPU = jax.devices()[0].platform == "gpu"
# On CPU the 8-device tests cover these setups; one of each kind keeps this file's code run.
CPU_CASES = ("fsdp+tp", "mlp")


def _gpu_or_cpu_case(setup):
    if not ON_GPU and setup not in CPU_CASES:
        pytest.skip("the GPU check; test_distributed covers this setup on 8 CPU devices")


def _one_device_mesh():
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), BLOCK_MESH)


def _all_fp8(compiled, minimum):
    report = fp8jax.fp8_gemm_report(compiled)
    fp8 = sum(g.is_fp8 for g in report.gemms)
    assert fp8 >= minimum and fp8 == len(report.gemms), report


@pytest.mark.parametrize("setup", list(SETUPS))
def test_linear_setups_on_one_device_mesh(setup):
    _gpu_or_cpu_case(setup)
    _, kwargs = SETUPS[setup]
    mesh = _one_device_mesh()
    x, y = _data()
    ref_model, ref_losses, ref_grads = _train(_model(), x, y)
    model = fp8jax.shard_model(_model(), mesh, **kwargs)
    batch = NamedSharding(mesh, P(("data", "fsdp"), None))
    xs, ys = jax.device_put(x, batch), jax.device_put(y, batch)
    if ON_GPU:  # two linears, three GEMMs each (the first layer's dgrad is dead code)
        _all_fp8(step.lower(model, OPT.init(fp8jax.trainable(model)), xs, ys).compile(), 5)
    check_matches(_train(model, xs, ys), (ref_model, ref_losses, ref_grads))


@pytest.mark.parametrize("setup", ["mlp", "mha", "moe"])
def test_blocks_on_one_device_mesh(setup):
    _gpu_or_cpu_case(setup)
    x = jax.random.normal(jax.random.PRNGKey(4), (8, 16, 64))
    y = jax.random.normal(jax.random.PRNGKey(5), (8, 16, 64))
    ref_model, ref_losses, ref_grads = _train_block(_block(setup), x, y)
    mesh = _one_device_mesh()
    model = fp8jax.shard_model(_block(setup), mesh, **BLOCK_SHARDING[setup])
    batch = NamedSharding(mesh, P(("data", "fsdp")))
    xs, ys = jax.device_put(x, batch), jax.device_put(y, batch)
    if ON_GPU and setup == "mlp":
        lowered = _block_step.lower(model, OPT.init(fp8jax.trainable(model)), xs, ys)
        _all_fp8(lowered.compile(), 5)
    check_matches(_train_block(model, xs, ys), (ref_model, ref_losses, ref_grads))
