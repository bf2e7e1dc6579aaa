"""Device probe: time the SwiGLU FP8 activation kernels (`fp8jax._gated`) per tile, against
the plain-JAX path, on a 1b-trainer-sized fc1 output ([16384, 2 x 8192] bf16).

    python benchmarks/_probe_gated.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.linear import time_call
from fp8jax import _gated

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def main(m=16384, f=8192):
    key = jax.random.PRNGKey(0)
    h = (jax.random.normal(key, (m, 2 * f), jnp.float32) * 300).astype(jnp.bfloat16)
    da = (jax.random.normal(key, (m, f), jnp.float32) * 50).astype(jnp.bfloat16)
    s = [jnp.array([v], jnp.float32) for v in (0.01, 0.02, 0.003, 0.0005)]
    fwd_bytes, bwd_bytes = h.size * 2 + 2 * m * f, h.size * 2 + da.size * 2 + 2 * h.size
    for mode, rows, warps in [("xla", 0, 0), ("kernel", 64, 4), ("kernel", 128, 4), ("kernel", 64, 8),
                              ("kernel", 128, 8), ("kernel", 32, 4)]:
        _gated.MODE["activation"] = mode
        _gated.TILE.update(rows=rows or 64, num_warps=warps or 4)
        fwd = jax.jit(lambda h, a, b: _gated.activation_fp8(h, a, b, E4M3))
        bwd = jax.jit(lambda h, a, d, b, c: _gated.activation_grad_fp8(h, a, d, b, c, E5M2, a, E4M3))
        try:
            t_f = time_call(fwd, (h, s[0], s[1]), 20, 5)
            t_b = time_call(bwd, (h, s[0], da, s[2], s[3]), 20, 5)
            print(f"{mode} rows={rows} warps={warps}: fwd {t_f:.3f} ms ({fwd_bytes / t_f / 1e9:.2f} TB/s), "
                  f"bwd {t_b:.3f} ms ({bwd_bytes / t_b / 1e9:.2f} TB/s)", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{mode} rows={rows} warps={warps}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    main()
