"""Device probe for the linear path's memory passes (one call on the H100):

1. the Pallas Triton cast-transpose kernel (`fp8jax._cast_kernel`) against XLA's
   cast + amax + transpose: bitwise equality and time, per tile size / warps;
2. fast vs promoted FP8 accumulation (``Fp8Config.fast_accumulation``): error
   against float64 and time of the cuBLASLt FP8 GEMM.

    python benchmarks/_probe_linear_paths.py

Prints one line per measurement; the linear-step comparison runs through
``python -m benchmarks.linear_tuning --set ...`` (one process per setting).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.linear import time_call
from fp8jax import _cast_kernel as ck
from fp8jax import _gemm
from fp8jax import _quant as q


def bench(fn, *args, iters=30, reps=5):
    return time_call(fn, args, iters, reps)


def xla_cast(t, s, dtype):
    tq = q.quantize(t, s, dtype)
    return tq, jnp.swapaxes(tq, 1, 2), q.amax(t)


def cast_kernel_probe():
    key = jax.random.key(0)
    for shape in [(1, 16384, 4096), (2, 4096, 1024)]:
        t = jax.random.normal(key, shape, jnp.bfloat16) * 2
        s = jnp.array([4.0 / 448], jnp.float32)
        for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
            ref = jax.jit(xla_cast, static_argnums=2)(t, s, dtype)
            ms_xla = bench(jax.jit(xla_cast, static_argnums=2), t, s, dtype)
            nbytes = t.size * (2 + 1 + 1)  # read bf16 once, write two FP8 copies
            line = f"cast {shape} {jnp.dtype(dtype).name}: xla {ms_xla:.3f} ms ({nbytes / ms_xla / 1e9:.2f} TB/s of min traffic)"
            for block, warps in [(64, 4)]:
                fn = jax.jit(lambda t, s, b=block, w=warps, d=dtype: ck.cast_transpose(t, s, d, block=b, num_warps=w))
                try:
                    out = fn(t, s)
                    same = all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)) for a, b in zip(out[:2], ref[:2]))
                    same_amax = float(out[2]) == float(ref[2])
                    ms = bench(fn, t, s)
                    line += f" | b{block}w{warps} {ms:.3f} ms {nbytes / ms / 1e9:.2f} TB/s eq={same and same_amax}"
                except Exception as e:  # noqa: BLE001
                    line += f" | b{block}w{warps} FAILED {type(e).__name__}: {str(e)[:200]}"
            print(line, flush=True)


def accumulation_probe():
    """Fast vs promoted FP8 accumulation: relative error against float64 and time."""
    for m, k, n in [(16384, 4096, 4096), (16384, 14336, 4096), (4096, 16384, 14336)]:
        key_a, key_b = jax.random.split(jax.random.key(k))
        a = jax.random.normal(key_a, (1, m, k), jnp.float32).astype(jnp.float8_e5m2)
        b = jax.random.normal(key_b, (1, n, k), jnp.float32).astype(jnp.float8_e4m3fn)
        sa, sb = jnp.array([0.01], jnp.float32), jnp.array([0.02], jnp.float32)
        rows = slice(0, 512)  # float64 reference on a slice of rows keeps the host work small
        ref = (np.asarray(a[0, rows], np.float64) * 0.01) @ (np.asarray(b[0], np.float64) * 0.02).T
        line = f"accumulation {m}x{k}x{n}:"
        for fast in (True, False):
            fn = jax.jit(lambda a, sa, b, sb, fast=fast: _gemm.fp8_gemm(a, sa, b, sb, jnp.bfloat16, fast))
            text = fn.lower(a, sa, b, sb).compile().as_text()
            out = np.asarray(fn(a, sa, b, sb)[0, rows], np.float64)
            err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            ms = bench(fn, a, sa, b, sb)
            f8 = "__cublas$lt$matmul$f8" in text
            line += f" | fast={fast}: {ms:.3f} ms {2 * m * k * n / ms / 1e9:.0f} TFLOP/s rel err {err:.2e} f8={f8}"
        print(line, flush=True)


if __name__ == "__main__":
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    for part in (accumulation_probe, cast_kernel_probe):
        try:
            part()
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            print(f"{part.__name__} FAILED: {e}", flush=True)
