"""FSDP keeps each FP8 weight's shard for the backward, not its gathered copy (issue 49): the
backward gathers the shard again. The saved copy (the weight's transposed FP8 layout) was
computed from the cast's unpinned output, and XLA transposed the gathered copy and sliced
the shard out of it where the backward read it, holding every layer's gathered weight from
the forward to the backward (8b fsdp=4: 1.3 GB a device; benchmarks/RESULTS.md,
twenty-fifth session). 8 host CPU devices."""

import re

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from helpers import eight_device_mesh as _mesh
from test_distributed import OPT, _data, _model, step

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs 8 devices (conftest's XLA_FLAGS)"
)


def _gather_readers(hlo: str) -> dict[str, int]:
    """Each all-gather's result (the ``-done`` of an async one) -> how many instructions
    read it."""
    names = re.findall(r"%([\w.-]+) = [^=]*? all-gather(?:-done)?\(", hlo)
    assert names, "no all-gather in the compiled step"
    return {n: len(re.findall(rf"%{re.escape(n)}(?![\w.-])", hlo)) - 1 for n in names}


def test_fsdp_weight_gathers_feed_only_their_gemm():
    mesh = _mesh(1, 8, 1)
    model = fp8jax.shard_model(_model(), mesh)
    batch = NamedSharding(mesh, P(("data", "fsdp"), None))
    x, y = (jax.device_put(a, batch) for a in _data())
    compiled = step.lower(model, OPT.init(fp8jax.trainable(model)), x, y).compile()
    hlo = getattr(compiled, "compiled", compiled).as_text()  # equinox wraps jax's
    readers = _gather_readers(hlo)
    # forward: l1 and l2 gathered once each; backward: l2 again for its dgrad
    assert len(readers) == 3, readers
    assert all(n == 1 for n in readers.values()), readers


def test_gather_readers_counts_each_use():
    hlo = (
        "%ag.1 = f16[4]{0} all-gather(%p), dimensions={0}\n"
        "%f = f16[4]{0} fusion(%ag.1, %ag.10)\n"
        "%g = f16[1]{0} fusion(%ag.1)\n"
        "%ag.10 = f16[4]{0} all-gather(%q), dimensions={0}\n"
    )
    assert _gather_readers(hlo) == {"ag.1": 2, "ag.10": 1}
