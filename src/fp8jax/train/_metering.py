"""What the hardware can do and what it spent: peak bf16 FLOP/s (for MFU), the GPU's
energy counter (NVML, for joules per step) and how many GPUs there are (NVML)."""

from __future__ import annotations

import jax

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12}


def peak_flops() -> float | None:
    """Dense bf16 peak FLOP/s of one device of this kind, None where unknown (CPU)."""
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in kind), None)


def energy_counter():
    """A function returning GPU 0's energy counter in mJ (NVML, through ctypes), or None
    where NVML is missing (CPU, other vendors): on a power-capped GPU the joules a step
    takes, not its time on a cool chip, set its sustained speed."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        handle = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) != 0:
            return None
    except (OSError, AttributeError):
        return None

    def read() -> float | None:
        value = ctypes.c_ulonglong()
        ok = nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(value)) == 0
        return float(value.value) if ok else None

    return read if read() is not None else None


def gpu_count() -> int | None:
    """How many NVIDIA GPUs NVML sees (None where NVML is missing), without starting CUDA:
    ``--processes`` asks before any of its processes starts JAX."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return int(count.value)
