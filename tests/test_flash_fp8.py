"""The FP8 flash-attention forward (`fp8jax._kernels.flash_fp8_mgpu`): its plain-JAX
reference against float32 attention, the kernel in Pallas' GPU interpret mode (CPU) and its
Mosaic GPU lowering against the reference, and the kernel itself on a Hopper GPU."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, gpu, sqnr_db

import fp8jax
from fp8jax._kernels import flash_fp8_mgpu as fk

E4M3 = jnp.float8_e4m3fn


def _inputs(key, b, sq, hq, hkv, d, outliers=False):
    """Float32 q, k, v: Gaussian, or with a few channels of k and v 20x larger (the
    per-tensor scales then follow the outliers)."""
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, sq, hq, d), jnp.float32)
    k = jax.random.normal(kk, (b, sq, hkv, d), jnp.float32)
    v = jax.random.normal(kv, (b, sq, hkv, d), jnp.float32)
    if outliers:
        big = jnp.ones((d,)).at[jnp.array([3, 17, d - 5])].set(20.0)
        k, v = k * big, v * big
    return q, k, v


def _quantize(x):
    """Per-tensor e4m3 (scale amax / 448) and its float32 scale."""
    scale = jnp.max(jnp.abs(x)) / 448.0
    return (x / scale).astype(E4M3), scale


def _fp8(q, k, v):
    (q8, qs), (k8, ks), (v8, vs) = _quantize(q), _quantize(k), _quantize(v)
    return (q8, k8, v8, qs, ks, vs)


def _f32_attention(q, k, v, causal):
    """Float32 softmax attention (GQA by repeating K/V heads) and its natural-log lse."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = s.shape[-2:]
        s = jnp.where(jnp.arange(sq)[:, None] >= jnp.arange(sk)[None, :], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v, precision="highest")
    return out, lse


def _dequantized(q8, k8, v8, qs, ks, vs):
    """Float32 values of the FP8 inputs, made on the host: the float32 references then
    have no e4m3 operand that XLA could fold into an FP8 GEMM on a GPU (as it does with the
    plain-JAX reference's dots; the device-made values gave the same results, H200)."""
    pairs = ((q8, qs), (k8, ks), (v8, vs))
    return [jnp.asarray(np.asarray(x).astype(np.float32) * np.float32(s)) for x, s in pairs]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
def test_reference_is_close_to_float32_attention(key, causal, outliers, hq, hkv):
    """Against float32 attention on the same (dequantized) FP8 inputs, the reference's
    only error is P's e4m3 rounding (33 dB Gaussian, 41 dB with outliers, 2026-11-27);
    its lse is exact up to float32 rounding on a CPU. On a GPU XLA runs the reference's
    dots of e4m3 values as cuBLASLt FP8 GEMMs, whose accumulation is not float32's: its lse
    was 1.3e-4 to 3.3e-4 from float32's (Gaussian) and 1.2e-2 to 1.5e-2 (outlier channels),
    the output's SQNR unchanged (H200, 2026-11-28)."""
    args = _fp8(*_inputs(key, 2, 256, hq, hkv, 64, outliers))
    out, lse = fk.flash_fp8_reference(*args, causal=causal)
    want, want_lse = _f32_attention(*_dequantized(*args), causal)
    assert out.dtype == jnp.bfloat16 and out.shape == want.shape
    assert lse.dtype == jnp.float32 and lse.shape == (2, hq, 256)
    assert sqnr_db(out, want) >= 30.0, sqnr_db(out, want)
    atol = (5e-2 if outliers else 2e-3) if ON_GPU else 1e-4
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=atol, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_end_to_end_from_float32_inputs(key, causal):
    """From float32 Gaussian inputs through per-tensor e4m3 q, k, v: the FP8 attention
    forward against float32 attention (25.6-26.9 dB measured, 2026-11-27: mostly the
    inputs' e4m3 rounding; with 20x outlier channels in k and v, 19-21 dB)."""
    q, k, v = _inputs(key, 2, 256, 4, 2, 64)
    out, lse = fk.flash_fp8_reference(*_fp8(q, k, v), causal=causal)
    want, want_lse = _f32_attention(q, k, v, causal)
    assert sqnr_db(out, want) >= 24.0, sqnr_db(out, want)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=0.2, rtol=0.02)


def test_reference_block_size_only_changes_rounding(key):
    """The online softmax over 64- or 128-key blocks: the same attention up to P's e4m3
    rounding (relative to a different running max)."""
    args = _fp8(*_inputs(key, 1, 256, 2, 2, 64))
    a, lse_a = fk.flash_fp8_reference(*args, causal=True, config=fk.Config(block_kv=64))
    b, lse_b = fk.flash_fp8_reference(*args, causal=True, config=fk.Config(block_kv=128))
    assert sqnr_db(a, b) >= 30.0
    np.testing.assert_allclose(np.asarray(lse_a), np.asarray(lse_b), atol=1e-5, rtol=1e-5)


def test_default_config_takes_256_key_tiles_where_they_fit():
    """256-key tiles through 2 slots where ``Sk`` allows, 128 through 4 otherwise; the
    kernel and the reference take the same tiles when none are given (the same rounding)."""
    assert (fk.default_config(8192).block_kv, fk.default_config(8192).max_concurrent_steps) == (
        256, 2
    )
    assert (fk.default_config(384).block_kv, fk.default_config(384).max_concurrent_steps) == (
        128, 4
    )
    assert fk._shape_reason((1, 384, 4, 64), (1, 384, 2, 64), E4M3, True, None) is None
    assert "Sk=384" in fk._shape_reason((1, 384, 4, 64), (1, 384, 2, 64), E4M3, True, fk.Config())
    args = _fp8(*_inputs(jax.random.PRNGKey(4), 1, 512, 2, 2, 64))
    same = fk.flash_fp8_reference(*args, causal=True)
    want = fk.flash_fp8_reference(*args, causal=True, config=fk.Config(block_kv=256))
    for a, b in zip(same, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_reason_names_what_does_not_fit():
    ok = ((1, 256, 4, 64), (1, 256, 2, 64))
    assert fk._shape_reason(*ok, E4M3, True, fk.Config()) is None
    assert "head_dim 96" in fk._shape_reason(
        (1, 256, 4, 96), (1, 256, 2, 96), E4M3, False, fk.Config()
    )
    assert "bfloat16" in fk._shape_reason(*ok, jnp.bfloat16, False, fk.Config())
    assert "multiple of 3" in fk._shape_reason(
        (1, 256, 4, 64), (1, 256, 3, 64), E4M3, False, fk.Config()
    )
    assert "Sq=256" in fk._shape_reason((1, 256, 4, 64), (1, 512, 2, 64), E4M3, True, fk.Config())
    assert "Sq=192" in fk._shape_reason((1, 192, 4, 64), (1, 192, 2, 64), E4M3, False, fk.Config())
    if not ON_GPU:
        assert fk.reason(*ok, E4M3) is not None  # no Hopper here
        with pytest.raises(ValueError, match="FP8 flash-attention kernel"):
            fk.flash_fp8(*_fp8(*_inputs(jax.random.PRNGKey(0), 1, 256, 4, 2, 64)))


def _needs_mosaic_gpu():
    if fk.plgpu is None:
        pytest.skip("Pallas Mosaic GPU does not import")


@pytest.mark.parametrize(
    "causal,d,block_kv,hq,hkv,steps",
    [
        (False, 64, 64, 2, 1, 2),  # GQA; 4 KV blocks through 2 slots: the ring wraps
        (True, 64, 64, 2, 1, 4),
        (True, 64, 64, 2, 1, 2),  # the ring wraps, and the causal flush releases slots
        (True, 128, 128, 1, 1, 4),
        (True, 128, 256, 1, 1, 2),  # the default tiles: 256 keys through 2 slots
        (False, 64, 256, 1, 1, 2),
    ],
)
def test_kernel_in_interpret_mode_matches_reference(key, causal, d, block_kv, hq, hkv, steps):
    """The kernel's warp-specialized pipeline (three threads, TMA ring, barriers, the
    ping-pong hand-off, causal skip and mask, lse) in Pallas' GPU interpret mode on CPU,
    dots standing in for the ``wgmma`` (the interpreter has no transposed-B ``wgmma``): the
    reference's result up to summation order."""
    if ON_GPU:
        pytest.skip("interpret mode is the CPU check; the GPU runs the kernel itself")
    _needs_mosaic_gpu()
    try:
        fp8jax._jax_compat.interpret_gpu_params()
    except ImportError:
        pytest.skip("no Pallas GPU interpret mode in this jax")
    s = 512 if d == 128 or block_kv == 256 else 256
    args = _fp8(*_inputs(key, 1, s, hq, hkv, d))
    config = fk.Config(block_q=64, block_kv=block_kv, max_concurrent_steps=steps)
    out, lse = fk.flash_fp8(*args, causal=causal, config=config, interpret=True)
    want, want_lse = fk.flash_fp8_reference(*args, causal=causal, config=config)
    assert out.dtype == jnp.bfloat16 and out.shape == want.shape
    assert sqnr_db(out, want) >= 60.0
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal,d", [(False, 128), (True, 128), (True, 64)])
def test_kernel_lowers_to_fp8_wgmma(causal, d):
    """The kernel lowers through Mosaic GPU for CUDA (on any host: shapes, layouts, SMEM
    transforms and P's registers regrouped as the 8-bit A operand are checked there) to
    e4m3 ``wgmma`` and e4m3 conversions."""
    _needs_mosaic_gpu()
    q = jax.ShapeDtypeStruct((1, 512, 4, d), E4M3)
    kv = jax.ShapeDtypeStruct((1, 512, 2, d), E4M3)
    sc = jax.ShapeDtypeStruct((), jnp.float32)

    def forward(q, k, v, qs, ks, vs):
        vt, scales = jnp.transpose(v, (0, 2, 3, 1)), jnp.stack([qs * ks, vs])
        return fk._forward(q, k, vt, scales, causal, fk.Config(), False)

    lowered = jax.jit(forward).trace(q, kv, kv, sc, sc, sc).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", text)
    # P V takes its A operand (P) from four registers, not a shared-memory descriptor
    assert re.search(r"e4m3\.e4m3 \{[$\d,]+\}, \{\$\d+,\$\d+,\$\d+,\$\d+\}", text)
    assert "cvt.rn.satfinite.e4m3x2.f32" in text


def test_vt_reorders_keys_as_p_registers():
    """On the GPU vT's keys are reordered within each 16 as P's registers are read as the
    8-bit wgmma operand: the wgmma's key position ``4t + 2a + b`` holds key ``8a + 2t + b``
    (interpret mode keeps the natural order)."""
    v = jax.random.normal(jax.random.PRNGKey(3), (1, 32, 2, 8), jnp.float32)
    plain, perm = np.asarray(fk._vt(v, False)), np.asarray(fk._vt(v, True))
    np.testing.assert_array_equal(plain, np.transpose(np.asarray(v), (0, 2, 3, 1)))
    for c, t, a, b in np.ndindex(2, 4, 2, 2):
        np.testing.assert_array_equal(
            perm[..., 16 * c + 4 * t + 2 * a + b], plain[..., 16 * c + 8 * a + 2 * t + b]
        )


def _hopper_or_skip(q_shape, k_shape, causal):
    why = fk.reason(q_shape, k_shape, E4M3, causal)
    if why is not None:
        pytest.skip(f"the kernel cannot run here: {why}")


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv,d", [(8, 128), (2, 128), (8, 64)])
def test_kernel_matches_reference_on_hopper(key, causal, hkv, d):
    q, k, v = _inputs(key, 1, 2048, 8, hkv, d)
    _hopper_or_skip(q.shape, k.shape, causal)
    args = _fp8(q, k, v)
    out, lse = fk.flash_fp8(*args, causal=causal)
    want, want_lse = fk.flash_fp8_reference(*args, causal=causal)
    f32, _ = _f32_attention(*_dequantized(*args), causal)  # the reference: 32-34 dB
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    assert sqnr_db(out, want) >= 25.0, sqnr_db(out, want)
    assert sqnr_db(out, f32) >= 30.0, sqnr_db(out, f32)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=2e-3, rtol=1e-4)


@gpu
def test_kernel_handles_outlier_channels_on_hopper(key):
    q, k, v = _inputs(key, 2, 1024, 4, 2, 128, outliers=True)
    _hopper_or_skip(q.shape, k.shape, True)
    args = _fp8(q, k, v)
    out, lse = fk.flash_fp8(*args, causal=True)
    want, want_lse = fk.flash_fp8_reference(*args, causal=True)
    assert sqnr_db(out, want) >= 25.0, sqnr_db(out, want)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=2e-3, rtol=1e-4)
