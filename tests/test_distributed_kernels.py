"""Our kernels on 8 host CPU devices (issue 24): custom calls XLA cannot partition step
aside outside shard_map; `FusedMLP`'s gated core and the row- and block-wise recipes run
per device on their token rows and match one device."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from conftest import DEFAULT_CPU_CODEGEN
from fp8jax import distributed, tuning
from helpers import LOSS_RTOL, assert_grads_match, take_state
from helpers import eight_device_mesh as _mesh

CFG = fp8jax.Fp8Config(selective=False)

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs 8 devices (conftest's XLA_FLAGS)"
)


def test_kernels_without_partitioning_rules_step_aside_over_several_devices():
    """Our Pallas / Mosaic kernels are custom calls that XLA cannot partition: with 8
    devices they run only inside a shard_map that makes every mesh axis manual."""
    from fp8jax._kernels import dispatch

    assert jax.device_count() == 8
    assert "8 devices and no shard_map" in dispatch.unpartitioned_reason()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))
    seen = {}

    def probe(name):
        def local(x):
            seen[name] = dispatch.unpartitioned_reason()
            return x

        return local

    x = jnp.ones((8, 4))
    jax.jit(jax.shard_map(probe("all"), mesh=mesh, in_specs=P("data"), out_specs=P("data")))(x)
    partial = jax.shard_map(
        probe("partial"), mesh=mesh, in_specs=P("data"), out_specs=P("data"), axis_names={"data"}
    )
    jax.jit(partial)(x)
    assert seen["all"] is None and "no partitioning rule" in seen["partial"]


@pytest.mark.parametrize("fc1_out_fp8", [False, True])
def test_fused_mlp_core_runs_per_device_on_its_rows(fc1_out_fp8):
    """`FusedMLP`'s gated core (Pallas kernels, here in interpret mode) on a data x FSDP mesh:
    its activation kernels run under shard_map on each device's 64 token rows with one
    scalar pmax per amax; no activation is gathered; loss and gradients match one device.
    With ``fc1_out_fp8`` fc1's output's FP8 copy is cast on each device with the one scale of
    the whole tensor (a scalar max across the devices), and the loss is the mesh's without
    the option bit for bit."""
    from fp8jax.nn import _mlp_paths as mlp_module
    from fp8jax._ops import gated

    with gated.tuning(activation="interpret"):
        kx, km, kc = jax.random.split(jax.random.PRNGKey(6), 3)
        mlp = fp8jax.nn.FusedMLP(
            64, 128, config=CFG, gate_block=64, fc1_out_fp8=fc1_out_fp8, key=km
        )
        x, c = (jax.random.normal(k, (512, 64)) for k in (kx, kc))
        step = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, x, c: jnp.sum(m(x) * c)))
        ref_loss, ref_grads = step(mlp, x, c)
        mesh = _mesh(2, 4, 1)
        model = fp8jax.shard_model(mlp, mesh)
        rows = NamedSharding(mesh, P(("data", "fsdp")))
        xs, cs = jax.device_put(x, rows), jax.device_put(c, rows)
        assert mlp_module._row_split(model).axes == ("data", "fsdp")
        assert mlp_module._gated_core_runs(model, xs)
        collectives = distributed.hlo_collectives(step.lower(model, xs, cs))
        if not fc1_out_fp8:  # one scalar pmax per amax: x's and g's casts, the activation
            # kernels' (fc1's output's adds its own)
            assert [c.shape for c in collectives if c.op_name == "pmax"] == ["[]"] * 4
        assert not [c for c in collectives if "512" in c.shape], collectives  # no token gather
        loss, grads = step(model, xs, cs)
        if fc1_out_fp8:
            assert float(loss) == float(step(model.with_fc1_out_fp8(False), xs, cs)[0])
            # --remat lean's region around the split core: the same bits (states entered
            # first, as the trainer does: the region enters them, which cycles the guards)
            entered = eqx.filter_jit(
                eqx.filter_value_and_grad(lambda m, x, c: jnp.sum(fp8jax.enter_state(m)(x) * c))
            )
            lean = entered(model.with_recompute_input(True), xs, cs)
            _assert_same_bits(entered(model, xs, cs), lean)
        with tuning.gemm(per_device_cast=False):  # x and g cast by XLA's partitioner
            whole = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, x, c: jnp.sum(m(x) * c)))
            _assert_same_bits((loss, grads), whole(model, xs, cs))
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    assert_grads_match(grads, ref_grads)


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
def test_tiled_recipes_run_per_device_on_their_rows(recipe):
    """The row- and block-wise recipes under FSDP (2 x 4): casts and GEMMs run under
    shard_map on each device's tokens (the wgrad summed over the devices), the weights are
    all-gathered in FP8 only, no activation moves, and the step matches one device. Each
    amax is one scalar pmax; the row-wise cast's column amaxes (the transposed copy's
    scales span every device's tokens) one pmax of a row per cast. On a GPU the same split
    lets the Pallas casts and the block-scaled kernel run."""
    cfg = fp8jax.Fp8Config(recipe=recipe, selective=False)
    k1, k2, kx, kc = jax.random.split(jax.random.PRNGKey(7), 4)
    model = [eqx.nn.Linear(256, 1024, key=k1), eqx.nn.Linear(1024, 256, key=k2)]
    model = fp8jax.fp8_linear_layers(model, cfg)
    x, c = jax.random.normal(kx, (2048, 256)), jax.random.normal(kc, (2048, 256))

    def loss(m, x, c):
        return jnp.sum(jax.vmap(m[1])(jax.nn.gelu(jax.vmap(m[0])(x))) * c)

    step = eqx.filter_jit(eqx.filter_value_and_grad(loss))

    def run(m, x, c):
        """The step compiled as XLA's default CPU code: the suite's older CPU emitters round
        the one-device and sharded programs differently (a few FP8 roundings flip)."""
        p, static = eqx.partition(m, eqx.is_array)
        fn = jax.jit(lambda p, x, c: eqx.filter_value_and_grad(loss)(eqx.combine(p, static), x, c))
        return fn.lower(p, x, c).compile(DEFAULT_CPU_CODEGEN)(p, x, c)

    ref_loss, ref_grads = run(model, x, c)
    mesh = _mesh(2, 4, 1)
    sharded = fp8jax.shard_model(model, mesh)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    xs, cs = jax.device_put(x, rows), jax.device_put(c, rows)
    collectives = distributed.hlo_collectives(step.lower(sharded, xs, cs))
    assert sorted(c.shape for c in collectives if c.op_name == "psum") == [
        "[1,1024,256]", "[1,256,1024]"]  # fmt: skip
    pmax = sorted(c.shape for c in collectives if c.op_name == "pmax")
    # x and g of each layer: [1, K] column amaxes (row-wise) or a scalar (block-wise)
    want = ["[1,1024]", "[1,1024]", "[1,256]", "[1,256]"] if recipe == "rowwise" else ["[]"] * 4
    assert pmax == want, collectives
    assert not [c for c in collectives if "2048" in c.shape], collectives  # no token moves
    # the weights' data (their scales, [1, 1024] or [1, 8, 2], are gathered too, in float32)
    weights = [
        c for c in collectives
        if c.kind == "all-gather" and "1024" in c.shape and c.shape.count(",") == 2
    ]  # fmt: skip
    assert len(weights) == 3 and {c.dtype for c in weights} == {"f8e4m3fn"}, collectives
    loss_value, grads = run(sharded, xs, cs)
    np.testing.assert_allclose(loss_value, ref_loss, rtol=LOSS_RTOL)
    assert_grads_match(grads, ref_grads)


def test_blockwise_weight_shards_of_partial_blocks_warn():
    cfg = fp8jax.Fp8Config(recipe="blockwise", selective=False)
    model = fp8jax.fp8_linear_layers([eqx.nn.Linear(256, 384, key=jax.random.PRNGKey(0))], cfg)
    with pytest.warns(UserWarning, match=r"'0': out_features=384 over mesh axis 'fsdp' of "):
        fp8jax.shard_model(model, _mesh(2, 4, 1))


def _assert_same_bits(got, want):
    """Every leaf of ``got`` (losses, gradients, FP8 state proposals) equals ``want``'s bits."""
    pairs = zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True)
    for a, b in pairs:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _manual_regions(lowered) -> int:
    """How many shard_map bodies (manual-sharding regions) a lowered step holds."""
    text = lowered.as_text()
    return text.count("sdy.manual_computation") + text.count("SPMDFullToShardShape")


def _per_tensor_mlp():
    """Two linears, per-tensor delayed scaling (the default recipe), and their loss."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(8))
    model = [eqx.nn.Linear(64, 256, key=k1), eqx.nn.Linear(256, 64, key=k2)]

    def loss(m, x, c):  # positive terms: summed in another order, it moves by rounding only
        return jnp.mean((jax.vmap(m[1])(jax.nn.gelu(jax.vmap(m[0])(x))) - c) ** 2)

    return fp8jax.fp8_linear_layers(model, CFG), loss


def _two_steps(model, loss, x, c):
    """Two steps' losses and gradients (the FP8 state's proposals written back between them:
    the second casts with scales from the first's amaxes), and the step lowered. A new
    function each call: traced under the `tuning` in force, not served an earlier trace."""
    step = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, x, c: loss(m, x, c)))
    first = step(model, x, c)
    return [first, step(take_state(model, first[1]), x, c)], step.lower(model, x, c)


@pytest.mark.parametrize("shape", [(1, 4, 1), (2, 4, 1)], ids=["fsdp=4", "data=2,fsdp=4"])
def test_per_tensor_casts_run_per_device_on_their_rows(shape):
    """Delayed per-tensor scaling on a data x FSDP mesh: the activations' and output
    gradients' casts run under shard_map on each device's tokens (where the Pallas cast
    kernel can run: XLA cannot partition it), their amaxes one scalar pmax each; the GEMMs
    stay XLA's. The cast is elementwise with a scale known before it, so the losses,
    gradients and FP8 state proposals are the bits of XLA's partitioned cast
    (`Tuning.per_device_cast` off), and match one device."""
    model, loss = _per_tensor_mlp()
    kx, kc = jax.random.split(jax.random.PRNGKey(9))
    x, c = jax.random.normal(kx, (256, 64)) * 3.0, jax.random.normal(kc, (256, 64))
    ref, _ = _two_steps(model, loss, x, c)
    devices = np.array(jax.devices()[: np.prod(shape)]).reshape(shape)
    mesh = Mesh(devices, ("data", "fsdp", "tensor"))
    sharded = fp8jax.shard_model(model, mesh)
    assert sharded[0].dot_general.weight_sharding.gather == ("fsdp",)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    xs, cs = jax.device_put(x, rows), jax.device_put(c, rows)
    got, lowered = _two_steps(sharded, loss, xs, cs)
    with tuning.gemm(per_device_cast=False):
        whole, whole_lowered = _two_steps(sharded, loss, xs, cs)
    # shard_map's manual-sharding boundary (Shardy's or GSPMD's): around the casts only
    assert _manual_regions(lowered) and not _manual_regions(whole_lowered)
    pmax = [c.shape for c in distributed.hlo_collectives(lowered) if c.op_name == "pmax"]
    assert pmax == ["[]"] * 4  # x and g of each layer
    _assert_same_bits(got, whole)
    for (loss_value, grads), (ref_loss, ref_grads) in zip(got, ref, strict=True):
        np.testing.assert_allclose(loss_value, ref_loss, rtol=LOSS_RTOL)
        assert_grads_match(grads, ref_grads)


def test_per_tensor_cast_kernel_runs_inside_the_split(monkeypatch):
    """The Pallas cast kernel (interpret mode, let run on CPU) on a data x FSDP mesh: it runs
    inside the shard_map, where no mesh axis is left to partition, on each device's 32 token
    rows; without the split (`Tuning.per_device_cast` off) XLA's partitioned cast runs
    instead. The kernel's bits are XLA's cast's: the two steps agree bit for bit."""
    from fp8jax._kernels import cast as cast_kernel
    from fp8jax._kernels import dispatch

    kernel, calls = cast_kernel.cast_transpose, []

    def interpreted(t, scale, dtype, **kw):
        calls.append((t.shape, dispatch.unpartitioned_reason()))
        return kernel(t, scale, dtype, interpret=True, **kw)

    def no_gpu_needed(device=None, local=False):
        return None if local else dispatch.unpartitioned_reason()

    monkeypatch.setattr(cast_kernel, "device_reason", no_gpu_needed)
    monkeypatch.setattr(cast_kernel, "cast_transpose", interpreted)
    model, loss = _per_tensor_mlp()
    kx, kc = jax.random.split(jax.random.PRNGKey(10))
    x, c = jax.random.normal(kx, (256, 64)), jax.random.normal(kc, (256, 64))
    mesh = _mesh(2, 4, 1)
    sharded = fp8jax.shard_model(model, mesh)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    xs, cs = jax.device_put(x, rows), jax.device_put(c, rows)
    got, _ = _two_steps(sharded, loss, xs, cs)
    # x and g of each layer, each device's 256 / 8 tokens
    assert sorted(calls) == sorted(((1, 32, k), None) for k in (64, 64, 256, 256)), calls
    calls.clear()
    with tuning.gemm(per_device_cast=False):
        whole, _ = _two_steps(sharded, loss, xs, cs)
    assert not calls
    _assert_same_bits(got, whole)


@pytest.mark.parametrize("gate_block, fsdp_axis", [(64, None), (128, "fsdp")])
def test_fused_mlp_core_runs_per_device_under_sequence_parallelism(gate_block, fsdp_axis):
    """`FusedMLP`'s gated core (Pallas kernels in interpret mode) under Megatron sequence
    parallelism with `Tuning.sequence_cast` (data=2 x tensor=4): x's and g's casts run per
    device on their tokens, the activation kernels on each device's features of fc1's
    output; only FP8 tokens are gathered, fc1's rows move in place (``gate_block`` 128 to
    the kernels' 64 within each group), and loss and gradients match one device. With the
    option off the block takes XLA's path. FSDP over an axis of size 1 (the trainer's
    placement on a tensor-only mesh) gathers nothing and keeps the core."""
    from fp8jax._ops import gated
    from fp8jax.nn import _mlp_paths as paths

    kx, km, kc = jax.random.split(jax.random.PRNGKey(8), 3)
    mlp = fp8jax.nn.FusedMLP(64, 1024, config=CFG, gate_block=gate_block, key=km)
    x, c = (jax.random.normal(k, (8, 64, 64)) for k in (kx, kc))

    def fresh():
        return eqx.filter_jit(eqx.filter_value_and_grad(lambda m, x, c: jnp.sum(m(x) * c)))

    with gated.tuning(activation="interpret"):
        ref_loss, ref_grads = fresh()(mlp, x, c)
        mesh = _mesh(2, 1, 4)
        model = fp8jax.shard_model(
            mlp, mesh, tensor_axis="tensor", column_parallel=["fc1"], row_parallel=["fc2"],
            sequence_parallel=True, fsdp_axis=fsdp_axis,
        )  # fmt: skip
        tokens = fp8jax.distributed.sequence_sharding(mesh, x.shape)
        xs, cs = jax.device_put(x, tokens), jax.device_put(c, tokens)
        with tuning.gemm(sequence_cast=False):  # the switch off: XLA's path
            assert not paths._gated_core_runs(model, xs)
        assert paths._gated_core_runs(model, xs)  # on by default
        with tuning.gemm(sequence_cast=True):
            step = fresh()
            collectives = distributed.hlo_collectives(step.lower(model, xs, cs))
            loss, grads = step(model, xs, cs)
    gathers = {c.dtype for c in collectives if c.kind == "all-gather"}
    assert gathers == {"f8e4m3fn", "f8e5m2"}, collectives  # x's and g's FP8 tokens only
    assert not [c for c in collectives if c.kind in ("all-to-all", "collective-permute")]
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    assert_grads_match(grads, ref_grads)
