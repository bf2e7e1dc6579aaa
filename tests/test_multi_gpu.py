"""Sharded FP8 training on real GPUs (two or more, one host): data parallel and FSDP steps
match the same step on one GPU, every GEMM is a cuBLASLt FP8 GEMM, FSDP all-gathers its
weights in FP8, and `FusedMLP`'s Pallas core runs per device on its token rows. The same
checks on 8 CPU devices are `tests/test_distributed.py`; these run the GPU paths (cast
kernels under ``shard_map``, NCCL collectives) that the CPU cannot. Skipped below 2 GPUs."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax import distributed

ON_GPU = jax.devices()[0].platform == "gpu"
pytestmark = pytest.mark.skipif(
    not (ON_GPU and jax.device_count() >= 2), reason="needs 2 or more GPUs"
)

CFG = fp8jax.Fp8Config(selective=False)
BF16 = jnp.bfloat16
# bf16 weights and activations: the sharded step sums the weight gradient's partial GEMMs
# over the devices, the single one in one GEMM, so bf16 roundings of the two differ. The
# FP8 casts are identical (global amaxes), so the gaps stay at bf16's resolution.
LOSS_RTOL = 1e-2
GRAD_OF_MAX = 2e-2  # max |sharded - single| / max |single|, per gradient array


class MLP(eqx.Module):
    l1: eqx.nn.Linear
    l2: eqx.nn.Linear

    def __init__(self, key, dim=512, hidden=2048):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(dim, hidden, use_bias=False, dtype=BF16, key=k1)
        self.l2 = eqx.nn.Linear(hidden, dim, use_bias=False, dtype=BF16, key=k2)

    def __call__(self, x):
        return jax.vmap(self.l2)(jax.nn.gelu(jax.vmap(self.l1)(x)))


OPT = optax.adam(1e-3)


def _loss(model, x, y):
    return jnp.mean((model(x) - y).astype(jnp.float32) ** 2)


@eqx.filter_jit
def step(model, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
    model, opt_state = fp8jax.optax_step(OPT, model, grads, opt_state)
    return model, opt_state, loss, fp8jax.trainable(grads)


def _train(model, x, y, steps=2):
    opt_state = OPT.init(fp8jax.trainable(model))
    losses, grads = [], []
    for _ in range(steps):
        model, opt_state, loss, g = step(model, opt_state, x, y)
        losses.append(float(loss))
        grads.append(g)
    return model, losses, grads


def _data(tokens=4096, dim=512):
    kx, ky = jax.random.split(jax.random.PRNGKey(1))
    return (jax.random.normal(kx, (tokens, dim), BF16) * 3,
            jax.random.normal(ky, (tokens, dim), BF16))  # fmt: skip


def _mesh(data: int, fsdp: int) -> Mesh:
    devices = np.array(jax.devices()[: data * fsdp]).reshape(data, fsdp, 1)
    return Mesh(devices, ("data", "fsdp", "tensor"))


@pytest.mark.parametrize("shape", [(2, 1), (1, 2)], ids=["dp", "fsdp"])
def test_sharded_step_matches_one_gpu_in_fp8(shape):
    model = fp8jax.fp8_linear_layers(MLP(jax.random.PRNGKey(0)), CFG)
    x, y = _data()
    ref_model, ref_losses, ref_grads = _train(model, x, y)
    mesh = _mesh(*shape)
    sharded = fp8jax.shard_model(model, mesh)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    xs, ys = jax.device_put(x, rows), jax.device_put(y, rows)
    opt_state = OPT.init(fp8jax.trainable(sharded))
    compiled = step.lower(sharded, opt_state, xs, ys).compile()
    report = fp8jax.fp8_gemm_report(compiled)
    if ON_GPU:  # (the module runs on GPUs only; the CPU's reference GEMMs are float32)
        assert report.gemms and all(g.is_fp8 for g in report.gemms), report
    if shape[1] > 1:  # FSDP: the weights move as e4m3
        gathers = [c for c in distributed.hlo_collectives(step.lower(sharded, opt_state, xs, ys))
                   if c.kind == "all-gather"]  # fmt: skip
        assert gathers and all(c.dtype == "f8e4m3fn" for c in gathers), gathers
    trained, losses, grads = _train(sharded, xs, ys)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    for g, rg in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads),
                     strict=True):  # fmt: skip
        g, rg = np.asarray(g, np.float32), np.asarray(rg, np.float32)
        assert np.max(np.abs(g - rg)) <= GRAD_OF_MAX * np.max(np.abs(rg))
    assert distributed.fp8_state_replicated(trained)
    new, ref = trained.l1.dot_general, ref_model.l1.dot_general
    # the input's and weight's amaxes are global maxima: the same on every mesh
    np.testing.assert_allclose(new.input_amax_history, ref.input_amax_history, rtol=1e-6)
    np.testing.assert_allclose(new.kernel_amax_history, ref.kernel_amax_history, rtol=1e-6)


def test_fused_mlp_core_runs_per_gpu_on_its_rows():
    """The gated core's Pallas kernels on a data-parallel mesh of the GPUs: each device runs
    them on its own token rows (no activation gathered), and the step matches one GPU."""
    from fp8jax.nn import _mlp as mlp_module

    kx, km, kc = jax.random.split(jax.random.PRNGKey(6), 3)
    mlp = fp8jax.nn.FusedMLP(512, 1024, config=CFG, gate_block=64, dtype=BF16, key=km)
    x, c = (jax.random.normal(k, (4096, 512), BF16) for k in (kx, kc))
    grad = eqx.filter_jit(
        eqx.filter_value_and_grad(lambda m, x, c: jnp.mean((m(x) - c).astype(jnp.float32) ** 2))
    )
    ref_loss, ref_grads = grad(mlp, x, c)
    mesh = _mesh(2, 1)
    model = fp8jax.shard_model(mlp, mesh)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    xs, cs = jax.device_put(x, rows), jax.device_put(c, rows)
    assert mlp_module._gated_core_runs(model, xs)
    collectives = distributed.hlo_collectives(grad.lower(model, xs, cs))
    assert not [k for k in collectives if "4096" in k.shape], collectives  # no token gather
    loss, grads = grad(model, xs, cs)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=LOSS_RTOL)
    for g, rg in zip(jax.tree_util.tree_leaves(fp8jax.trainable(grads)),
                     jax.tree_util.tree_leaves(fp8jax.trainable(ref_grads)), strict=True):  # fmt: skip
        g, rg = np.asarray(g, np.float32), np.asarray(rg, np.float32)
        assert np.max(np.abs(g - rg)) <= GRAD_OF_MAX * np.max(np.abs(rg))


def test_moe_all_to_all_dispatch_runs_the_grouped_kernels_per_gpu():
    """`MoE(dispatch="all_to_all")` with its experts over the GPUs (up to 4): each GPU runs
    the grouped Pallas kernels on its block of dispatched rows; the step matches one GPU's
    with either dispatch (FP8: the rows move as e4m3 cast with fc1's own per-tensor scale,
    which fc1 takes as they arrive: no f32 scales on the wire)."""
    from fp8jax._ops.grouped_gemms import GROUPED_SCOPE

    n = min(4, jax.device_count())
    mesh = Mesh(np.array(jax.devices()[:n]), ("expert",))
    kx, kc = jax.random.split(jax.random.PRNGKey(7))
    x, c = (jax.random.normal(k, (4096, 512), BF16) for k in (kx, kc))
    grad = eqx.filter_jit(
        eqx.filter_value_and_grad(lambda m, x, c: jnp.mean((m(x)[0] - c).astype(jnp.float32) ** 2))
    )

    def moe(dispatch_dtype, dispatch="all_to_all"):
        return fp8jax.nn.MoE(512, 256, 8, top_k=2, config=CFG, dtype=BF16, dispatch=dispatch,
                             dispatch_dtype=dispatch_dtype, key=jax.random.PRNGKey(0))  # fmt: skip

    ref_loss, ref_grads = grad(moe("bf16", "replicated"), x, c)
    rows = NamedSharding(mesh, P("expert"))
    xs, cs = jax.device_put(x, rows), jax.device_put(c, rows)
    for dispatch_dtype in ("bf16", "fp8"):
        model = fp8jax.shard_model(moe(dispatch_dtype), mesh, fsdp_axis=None,
                                   expert_axis="expert")  # fmt: skip
        assert GROUPED_SCOPE in grad.lower(model, xs, cs).lowered.compile().as_text()
        a2a = {k.dtype for k in distributed.hlo_collectives(grad.lower(model, xs, cs))
               if k.kind == "all-to-all" and k.shape.endswith(",512]")}  # fmt: skip
        assert a2a == ({"bf16", "f8e4m3fn"} if dispatch_dtype == "fp8" else {"bf16"}), a2a
        scales = [k for k in distributed.hlo_collectives(grad.lower(model, xs, cs))
                  if k.kind == "all-to-all" and k.dtype == "f32"]  # fmt: skip
        assert not scales, scales
        loss, grads = grad(model, xs, cs)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=LOSS_RTOL)
        for g, rg in zip(jax.tree_util.tree_leaves(fp8jax.trainable(grads)),
                         jax.tree_util.tree_leaves(fp8jax.trainable(ref_grads)),
                         strict=True):  # fmt: skip
            g, rg = np.asarray(g, np.float32), np.asarray(rg, np.float32)
            assert np.max(np.abs(g - rg)) <= GRAD_OF_MAX * np.max(np.abs(rg))


def test_sequence_casts_run_the_cast_kernel_per_gpu():
    """`tuning.gemm(sequence_cast=True)` on a tensor=2 sequence-parallel pair: the casts that
    write a transposed copy (l1's input and output gradient, l2's input) run as the Pallas
    cast kernel on each GPU, every GEMM stays a cuBLASLt FP8 GEMM, and two steps match XLA's
    partitioned casts. Not to the bit, as on the CPU (`tests/test_sequence_parallel.py`):
    each program is compiled and its GEMMs autotuned on its own, so the GPUs may sum the
    same FP8 products in another order."""
    from fp8jax import tuning

    triton = 'custom_call_target="__gpu$xla.gpu.triton"'
    devices = np.array(jax.devices()[:2]).reshape(1, 1, 2)
    mesh = Mesh(devices, ("data", "fsdp", "tensor"))
    x, y = _data()
    tokens = NamedSharding(mesh, P(("data", "fsdp", "tensor")))
    xs, ys = jax.device_put(x, tokens), jax.device_put(y, tokens)
    runs, kernels = [], []
    for on in (False, True):
        with tuning.gemm(sequence_cast=on):
            model = fp8jax.shard_model(
                fp8jax.fp8_linear_layers(MLP(jax.random.PRNGKey(0)), CFG), mesh,
                tensor_axis="tensor", column_parallel=["l1"], row_parallel=["l2"],
                sequence_parallel=True, fsdp_axis=None,
            )  # fmt: skip
            fresh = _fresh_step()  # the tuning is read at trace time
            opt_state = OPT.init(fp8jax.trainable(model))
            # compiled once: the report and the kernel count read the same program
            compiled = fresh.lower(model, opt_state, xs, ys).lowered.compile()
            report = fp8jax.fp8_gemm_report(compiled)
            assert report.gemms and all(g.is_fp8 for g in report.gemms), report
            kernels.append(compiled.as_text().count(triton))
            out = []
            for _ in range(2):
                model, opt_state, loss, grads = fresh(model, opt_state, xs, ys)
                out.append((loss, grads))
            runs.append(out)
    assert kernels[1] >= kernels[0] + 3, kernels
    for (loss, grads), (ref_loss, ref_grads) in zip(runs[1], runs[0]):
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-3)
        for g, rg in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads),
                         strict=True):  # fmt: skip
            g, rg = np.asarray(g, np.float32), np.asarray(rg, np.float32)
            assert np.max(np.abs(g - rg)) <= 1e-2 * np.max(np.abs(rg))


def _fresh_step():
    """`step`, traced anew (a new function: no cache shared with an earlier tuning)."""

    @eqx.filter_jit
    def fresh(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
        model, opt_state = fp8jax.optax_step(OPT, model, grads, opt_state)
        return model, opt_state, loss, fp8jax.trainable(grads)

    return fresh


def test_fused_mlp_core_runs_per_gpu_under_sequence_parallelism():
    """With `tuning.gemm(sequence_cast=True)` the gated core runs on a tensor=2 sequence-
    parallel pair (fc1's rows interleaved in blocks of 128, the trainer's): its Pallas
    kernels per GPU, every GEMM FP8, and the step matches one GPU."""
    from fp8jax import tuning
    from fp8jax.nn import _mlp_paths as paths

    kx, km, kc = jax.random.split(jax.random.PRNGKey(6), 3)
    mlp = fp8jax.nn.FusedMLP(512, 1024, config=CFG, gate_block=128, dtype=BF16, key=km)
    x, c = (jax.random.normal(k, (4, 1024, 512), BF16) for k in (kx, kc))

    def fresh():
        return eqx.filter_jit(eqx.filter_value_and_grad(
            lambda m, x, c: jnp.mean((m(x) - c).astype(jnp.float32) ** 2)))  # fmt: skip

    ref_loss, ref_grads = fresh()(mlp, x, c)
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 1, 2), ("data", "fsdp", "tensor"))
    model = fp8jax.shard_model(
        mlp, mesh, tensor_axis="tensor", column_parallel=["fc1"], row_parallel=["fc2"],
        sequence_parallel=True, fsdp_axis=None,
    )  # fmt: skip
    tokens = distributed.sequence_sharding(mesh, x.shape)
    xs, cs = jax.device_put(x, tokens), jax.device_put(c, tokens)
    with tuning.gemm(sequence_cast=True):
        assert paths._gated_core_runs(model, xs)
        step = fresh()
        compiled = step.lower(model, xs, cs).lowered.compile()  # once, as above
        report = fp8jax.fp8_gemm_report(compiled)
        assert report.gemms and all(g.is_fp8 for g in report.gemms), report
        text = compiled.as_text()
        assert text.count('custom_call_target="__gpu$xla.gpu.triton"') >= 4  # casts, kernels
        loss, grads = step(model, xs, cs)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=LOSS_RTOL)
    trained, reference = fp8jax.trainable(grads), fp8jax.trainable(ref_grads)
    for g, rg in zip(jax.tree_util.tree_leaves(trained), jax.tree_util.tree_leaves(reference),
                     strict=True):  # fmt: skip
        g, rg = np.asarray(g, np.float32), np.asarray(rg, np.float32)
        assert np.max(np.abs(g - rg)) <= GRAD_OF_MAX * np.max(np.abs(rg))
