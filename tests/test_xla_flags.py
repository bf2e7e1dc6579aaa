"""skip_triton_gemm_autotuning: adds its flag only where it can act and the user has not chosen."""

import os
import subprocess
import sys

import pytest

import fp8jax
from fp8jax import _xla_flags


def test_adds_the_flag_before_the_backend_starts_unless_the_user_chose(monkeypatch):
    monkeypatch.setattr(_xla_flags, "_backend_started", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert fp8jax.skip_triton_gemm_autotuning()
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8 " + _xla_flags.TRITON_GEMM_OFF
    assert not fp8jax.skip_triton_gemm_autotuning()  # once is enough
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    assert not fp8jax.skip_triton_gemm_autotuning()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=true"
    monkeypatch.delenv("XLA_FLAGS")
    assert fp8jax.skip_triton_gemm_autotuning() and os.environ["XLA_FLAGS"] == _xla_flags.TRITON_GEMM_OFF


def test_changes_nothing_once_the_backend_has_started(monkeypatch):
    import jax

    jax.numpy.zeros(1).block_until_ready()  # the backend is up
    assert _xla_flags._backend_started()
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    with pytest.warns(UserWarning, match="already started"):
        assert not fp8jax.skip_triton_gemm_autotuning()
    assert not fp8jax.skip_triton_gemm_autotuning(warn=False)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


def test_a_fresh_process_starts_jax_with_the_flag():
    """In a new process (the trainer's case) the flag is in XLA_FLAGS when the backend starts,
    and XLA accepts it on CPU too."""
    code = ("import fp8jax, os, jax; assert fp8jax.skip_triton_gemm_autotuning(); "
            "print(jax.numpy.ones(2).sum(), os.environ['XLA_FLAGS'])")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2.0", _xla_flags.TRITON_GEMM_OFF]
