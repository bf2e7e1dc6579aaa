"""Block-scaled grouped expert GEMMs (`fp8jax._kernels.blockwise_grouped_mgpu`) against the
float32 grouped reference, and `GroupedLinear(recipe="blockwise")` on the kernels against
its reference backend. The kernels need a Hopper GPU; on CPU the layer's reference path is
covered by `tests/test_blockwise.py::test_grouped_linear_recipe`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gpu, sqnr_db

import fp8jax
from fp8jax import nn
from fp8jax._ops import grouped as gr
from fp8jax._ops import grouped_gemms as gemms
from fp8jax._recipe import BlockWise

E4M3 = jnp.float8_e4m3fn
SIZES = [300, 0, 130, 77]  # an empty expert, and groups that end mid-block


def test_kernel_reason_names_what_does_not_fit():
    from fp8jax._ops import grouped_tiled as gt

    spec = gr.Spec(fp8jax.Fp8Config(recipe="rowwise"), "auto", jnp.bfloat16, jnp.bfloat16)
    layout = nn.make_layout(jnp.array(SIZES), 507)
    x = jnp.zeros((layout.num_rows, 128))
    assert "rowwise" in gt.kernel_reason(spec, layout, 128, 256, x)
    spec = spec._replace(config=fp8jax.Fp8Config(recipe="blockwise"))
    if jax.devices()[0].platform != "gpu":
        assert gt.kernel_reason(spec, layout, 128, 256, x) is not None
        assert gt.kernel_reason(spec._replace(experts=object()), layout, 128, 256, x)


def _casts(key, layout, k, n, groups):
    """Block-wise casts of x [M, K] (1x128 tiles, both layouts), dy [M, N] and w [G, K, N]."""
    kx, kw, kd = jax.random.split(key, 3)
    recipe = BlockWise()
    valid = layout.row_valid[:, None]
    x = jnp.where(valid, jax.random.normal(kx, (layout.num_rows, k), jnp.bfloat16), 0)
    dy = jnp.where(valid, jax.random.normal(kd, (layout.num_rows, n), jnp.bfloat16), 0)
    w = jax.random.normal(kw, (groups, k, n), jnp.bfloat16) * 0.05
    xc = recipe.quantize_both(x[None], None, None, E4M3)
    gc = recipe.quantize_both(dy[None], None, None, E4M3)
    wc = recipe.quantize_both(w, None, None, E4M3, weight=True)
    return recipe, xc, gc, wc


def test_blockwise_layers_lay_large_groups_out_on_256_rows(key):
    """Block-wise grouped layers whose experts average >= 512 rows align groups to 256 rows
    (the kernels then take 256-row blocks); smaller batches and per-tensor layers keep 128.
    The alignment only moves padding: outputs and gradients stay the same."""
    from fp8jax.nn import _grouped as nng

    experts, k, n = 2, 128, 128
    rows = experts * nng.ALIGN_256_MIN_ROWS
    kx, kd, kw = jax.random.split(key, 3)
    layer = nn.GroupedLinear(
        experts, k, n, key=kw, config=fp8jax.Fp8Config(recipe="blockwise"), dtype=jnp.bfloat16
    )
    assert nn.row_align(layer, rows) == 256
    assert nn.row_align(layer, experts * nng.ALIGN_256_MIN_ROWS - 1) == 128
    assert nn.row_align(nn.GroupedLinear(experts, k, n, key=kw), 8 * rows) == 128
    sizes = jnp.array([rows // 2 + 77, rows // 2 - 77])  # neither a multiple of 128
    x = jax.random.normal(kx, (rows, k), jnp.bfloat16)
    dy = jax.random.normal(kd, (rows, n), jnp.bfloat16)

    @functools.partial(jax.jit, static_argnums=3)
    def grads_of(layer, x, dy, align):
        fn = padded(align) if align else lambda l, x: l(x, sizes)
        y, vjp = jax.vjp(fn, layer, x)
        dlayer, dx = vjp(dy)
        return y, dx, dlayer.weight

    def grads(align):
        return grads_of(layer, x, dy, align)

    def padded(align):
        layout = nn.make_layout(sizes, rows, align)
        assert layout.align == align and layout.num_rows % align == 0
        return lambda l, x: gr.unpad_rows(l.apply_padded(gr.pad_rows(x, layout), layout), layout, rows)  # noqa: E501

    want = grads(128)
    for got in (grads(256), grads(0)):  # 0: the layer's own choice
        for g, w in zip(got, want, strict=True):
            assert sqnr_db(g, w) > 60


@gpu
@pytest.mark.parametrize("align", [128, 256])
def test_grouped_kernels_match_reference(key, align):
    """``align`` 256: dx (bf16 out) runs the 256-row blocks; y (float32 out) 128-row ones."""
    from fp8jax._kernels import blockwise_grouped_mgpu as bgk

    k, n = 256, 384
    layout = nn.make_layout(jnp.array(SIZES), sum(SIZES), align)
    recipe, xc, gc, wc = _casts(key, layout, k, n, len(SIZES))
    deq = lambda d, s: recipe.dequantize(d, s, jnp.float32)  # noqa: E731
    ones = jnp.ones((len(SIZES),), jnp.float32)
    valid = np.asarray(layout.row_valid)

    y = jax.jit(lambda *a: bgk.grouped_rows(*a, out_dtype=jnp.float32, group_align=align))(
        xc.data[0], xc.scale[0], wc.data_t, wc.scale_t, layout.block_group
    )
    ref = gemms._rows_reference(
        deq(xc.data, xc.scale)[0], deq(wc.data_t, wc.scale_t), layout, ones, jnp.float32
    )
    assert sqnr_db(np.asarray(y)[valid], np.asarray(ref)[valid]) > 50

    dx = jax.jit(lambda *a: bgk.grouped_rows(*a, out_dtype=jnp.bfloat16, group_align=align))(
        gc.data[0], gc.scale[0], wc.data, wc.scale, layout.block_group
    )
    ref = gemms._rows_reference(
        deq(gc.data, gc.scale)[0], deq(wc.data, wc.scale), layout, ones, jnp.float32
    )
    assert sqnr_db(np.asarray(dx, np.float32)[valid], np.asarray(ref)[valid]) > 40

    ref = gemms._wgrad_reference(
        deq(xc.data_t, xc.scale_t)[0],
        deq(gc.data_t, gc.scale_t)[0],
        layout,
        jnp.ones((), jnp.float32),
        jnp.float32,
    )
    dw = jax.jit(lambda *a: bgk.grouped_wgrad(*a, out_dtype=jnp.float32))(
        xc.data_t[0], xc.scale_t[0], gc.data_t[0], gc.scale_t[0], layout.starts,
        layout.padded_sizes,
    )  # fmt: skip
    assert sqnr_db(dw, ref) > 50
    assert np.all(np.asarray(dw[1]) == 0)  # the empty expert


@gpu
@pytest.mark.parametrize("experts", [4, 8])
def test_grouped_linear_blockwise_kernel_matches_reference_backend(key, experts):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    sizes = jax.random.randint(k4, (experts,), 0, 300).at[1].set(0)
    rows = int(sizes.sum())
    x = jax.random.normal(k2, (rows, 256), jnp.bfloat16)
    dy = jax.random.normal(k3, (rows, 512), jnp.bfloat16)
    out = {}
    for backend in ("auto", "reference"):
        layer = nn.GroupedLinear(
            experts, 256, 512, key=k1, backend=backend,
            config=fp8jax.Fp8Config(recipe="blockwise"), dtype=jnp.bfloat16,
        )  # fmt: skip
        f = jax.jit(lambda l, x: jax.vjp(lambda l, x: l(x, sizes), l, x))
        y, vjp = f(layer, x)
        dlayer, dx = jax.jit(lambda v, d: v(d))(vjp, dy)
        out[backend] = (y, dx, dlayer.weight)
        if backend == "auto":  # forward, dgrad and wgrad: the block-scaled kernels
            def step(layer, x):
                y, vjp = jax.vjp(lambda l, x: l(x, sizes), layer, x)
                return y, vjp(dy)

            assert fp8jax.fp8_gemm_report(step, layer, x).num_fp8 == 3
    for got, want in zip(out["auto"], out["reference"]):
        assert sqnr_db(got, want) > 40
