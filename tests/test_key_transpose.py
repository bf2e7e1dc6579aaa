"""The flash kernels' K-major operands (`fp8jax._kernels.key_transpose`): bit for bit the
transpose and 16-key reorder that `flash_fp8_mgpu._vt` had XLA write, in Pallas' interpreter
on the CPU and compiled on a GPU, where `_vt` must take the kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gpu

from fp8jax._kernels import flash_fp8_mgpu as _fk
from fp8jax._kernels import key_transpose as kt

E4M3 = jnp.float8_e4m3fn


def _bits(a):
    return np.asarray(a).view(np.uint8)


def _fp8(key, shape):
    return (4 * jax.random.normal(key, shape, jnp.float32)).astype(E4M3)


def test_key_order_is_a_permutation_within_each_16():
    order = kt.key_order(np.arange(64))
    assert sorted(order) == list(range(64))
    assert all(set(order[i : i + 16]) == set(range(i, i + 16)) for i in range(0, 64, 16))
    # position 4t + 2a + b holds key 8a + 2t + b: t=1, a=1, b=0 -> position 6, key 10
    assert order[6] == 10 and order[1] == 1 and order[4] == 2


@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("shape", [(2, 128, 3, 32), (1, 64, 2, 16)])
def test_interpret_kernel_matches_xla_bit_for_bit(key, permute, shape):
    x = _fp8(key, shape)
    out = kt.transpose_keys(x, permute, interpret=True)
    ref = kt.reference(x, permute)
    assert out.shape == (shape[0], shape[2], shape[3], shape[1]) and out.dtype == E4M3
    np.testing.assert_array_equal(_bits(out), _bits(ref))
    if permute:  # the reorder moves something: the plain transpose differs
        assert not np.array_equal(_bits(out), _bits(kt.reference(x, False)))


def test_reference_is_the_xla_layout_the_kernels_read(key):
    x = _fp8(key, (1, 32, 2, 16))
    xt = np.asarray(jnp.transpose(x, (0, 2, 3, 1))).view(np.uint8)
    perm = xt.reshape(1, 2, 16, 2, 2, 4, 2).swapaxes(-3, -2).reshape(xt.shape)
    np.testing.assert_array_equal(_bits(kt.reference(x, True)), perm)


def test_reason_names_shapes_and_types_the_kernel_does_not_take(monkeypatch):
    from fp8jax._kernels import cast

    monkeypatch.setattr(cast, "device_reason", lambda device=None, local=False: None)
    assert kt.reason((2, 128, 4, 64), E4M3) is None
    for shape, dtype, why in (
        ((2, 100, 4, 64), E4M3, "S % 64"),
        ((2, 128, 4), E4M3, "not [B, S, H, D]"),
        ((2, 128, 4, 64), jnp.bfloat16, "not a 1-byte type"),
    ):
        assert why in kt.reason(shape, dtype)


@gpu
@pytest.mark.parametrize("shape", [(2, 256, 4, 128), (1, 128, 8, 64)])
def test_gpu_kernel_matches_xla_and_vt_takes_it(key, shape):
    x = _fp8(key, shape)
    assert kt.reason(shape) is None
    for permute in (False, True):
        out = jax.jit(lambda x, p=permute: kt.transpose_keys(x, p))(x)
        np.testing.assert_array_equal(_bits(out), _bits(kt.reference(x, permute)))
    vt = jax.jit(lambda x: _fk._vt(x, True))
    np.testing.assert_array_equal(_bits(vt(x)), _bits(kt.reference(x, True)))
    hlo = vt.lower(x).compile().as_text()
    assert "__gpu$xla.gpu.triton" in hlo or "triton" in hlo.lower(), "_vt did not take the kernel"
