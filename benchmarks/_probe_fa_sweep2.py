"""Probe (issue 50): the FP8 flash-attention forward's `Config` variants on one Hopper GPU.

For each variant: correctness against `flash_fp8_reference` on a small shape (SQNR and
NaN check on fresh random inputs, causal and not), then the kernel alone (e4m3 inputs, V
pre-transposed, `_forward` called directly) at B=4, S=8192, 32 heads x 128, causal:
3 warmups, 20 timed calls, the mean per call and TFLOP/s (causal flops
``4 * B * H * S * S * D / 2``). A variant that fails prints its error's first line.

Run from the repository root: ``PYTHONPATH=src:.:tests python benchmarks/_probe_fa_sweep2.py``
(``--only NAME,NAME`` picks variants).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax._kernels import flash_fp8_mgpu as fa

E4M3 = jnp.float8_e4m3fn
C = fa.Config
PP, OV = dict(schedule="pingpong"), dict(overlap_qk=True)
FOLD, REGS = dict(fold_scale=True), dict(p_in_registers=True)
VARIANTS = {  # the likeliest first (a sweep past BUDGET_S skips the rest)
    "base": C(),
    "pingpong": C(**PP),
    "fold": C(**FOLD),
    "pingpong+fold": C(**PP, **FOLD),
    "pingpong+fold+overlap": C(**PP, **FOLD, **OV),
    "pingpong+fold+regs": C(**PP, **FOLD, **REGS),
    "pingpong+fold+overlap+regs": C(**PP, **FOLD, **OV, **REGS),
    "overlap+fold+regs": C(**OV, **FOLD, **REGS),
    "none+fold+overlap+regs": C(schedule="none", **FOLD, **OV, **REGS),
    "regs": C(**REGS),
    "overlap": C(**OV),
    "overlap+fold": C(**OV, **FOLD),
    "pingpong+overlap": C(**PP, **OV),
    "none": C(schedule="none"),
    "none+fold": C(schedule="none", **FOLD),
    "none+fold+overlap": C(schedule="none", **FOLD, **OV),
    "pingpong+fold+overlap+regs steps3": C(**PP, **FOLD, **OV, **REGS, max_concurrent_steps=3),
    "pingpong+fold+overlap+regs steps5": C(**PP, **FOLD, **OV, **REGS, max_concurrent_steps=5),
    "pingpong+fold+overlap steps3": C(**PP, **FOLD, **OV, max_concurrent_steps=3),
    "pingpong+fold+overlap kv64 steps8": C(**PP, **FOLD, **OV, block_kv=64, max_concurrent_steps=8),
    "pingpong+fold kv256 steps2": C(**PP, **FOLD, block_kv=256, max_concurrent_steps=2),
    "pingpong+fold+overlap kv256 steps2": C(
        **PP, **FOLD, **OV, block_kv=256, max_concurrent_steps=2
    ),
}
BUDGET_S = 220  # variants left when the sweep has run this long are listed as skipped


def sqnr_db(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum((x - ref) ** 2), 1e-30)))


def _quantize(x):
    scale = jnp.max(jnp.abs(x)) / 448.0
    return (x / scale).astype(E4M3), scale


def check(cfg: fa.Config, causal: bool, key) -> str:
    """SQNR of the kernel against the reference on B=1, S=1024, 4 heads (2 KV heads) x 128."""
    kq, kk, kv = jax.random.split(key, 3)
    shape, kv_shape = (1, 1024, 4, 128), (1, 1024, 2, 128)
    q8, qs = _quantize(jax.random.normal(kq, shape, jnp.float32))
    k8, ks = _quantize(jax.random.normal(kk, kv_shape, jnp.float32))
    v8, vs = _quantize(jax.random.normal(kv, kv_shape, jnp.float32))
    out, lse = fa.flash_fp8(q8, k8, v8, qs, ks, vs, causal=causal, config=cfg)
    want, want_lse = fa.flash_fp8_reference(q8, k8, v8, qs, ks, vs, causal=causal, config=cfg)
    out32 = np.asarray(out.astype(jnp.float32))
    nan = not np.all(np.isfinite(out32)) or not np.all(np.isfinite(np.asarray(lse)))
    db = sqnr_db(out32, want.astype(jnp.float32))
    lse_err = float(np.max(np.abs(np.asarray(lse) - np.asarray(want_lse))))
    ok = (not nan) and db >= 25.0 and lse_err < 1e-2
    return f"{'ok' if ok else 'BAD'}(sqnr {db:.1f} dB, lse err {lse_err:.1e}, nan {nan})"


def big_inputs(b=4, s=8192, h=32, d=128):
    """e4m3 q, k [B, S, H, D] and vT [B, H, D, S] (Gaussian times 64) and the scales."""
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(1), 3)
    e4m3 = lambda key, shape: (jax.random.normal(key, shape, jnp.float32) * 64).astype(E4M3)  # noqa: E731
    q, k, vt = e4m3(kq, (b, s, h, d)), e4m3(kk, (b, s, h, d)), e4m3(kv, (b, h, d, s))
    scales = np.array([1 / np.sqrt(d) * np.log2(np.e) / 64**2, 1 / 448], np.float32)
    return q, k, vt, jnp.asarray(scales)


def time_kernel(cfg: fa.Config, inputs, warmup=3, iters=20):
    q, k, vt, scales = inputs
    b, s, h, d = q.shape
    f = jax.jit(lambda q, k, vt, sc: fa._forward(q, k, vt, sc, True, cfg, False))
    for _ in range(warmup):
        jax.block_until_ready(f(q, k, vt, scales))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = f(q, k, vt, scales)
    jax.block_until_ready(out)
    ms = (time.perf_counter() - t0) / iters * 1e3
    flops = 4 * b * h * s * s * d / 2
    return ms, flops / (ms * 1e-3) / 1e12


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated variant names")
    args = parser.parse_args()
    names = [n for n in VARIANTS if not args.only or n in args.only.split(",")]
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    key, inputs, t0 = jax.random.PRNGKey(0), big_inputs(), time.perf_counter()
    for name in names:
        cfg = VARIANTS[name]
        if time.perf_counter() - t0 > BUDGET_S:
            print(f"{name:36s} SKIPPED (the sweep's {BUDGET_S} s are spent)", flush=True)
            continue
        try:
            checks = " ".join(
                f"{'causal' if c else 'full'} {check(cfg, c, key)}" for c in (True, False)
            )
            ms, tflops = time_kernel(cfg, inputs)
            print(f"{name:36s} {ms:7.3f} ms {tflops:6.1f} TFLOP/s  {checks}", flush=True)
        except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            print(f"{name:36s} FAILED {type(e).__name__}: {first}", flush=True)


if __name__ == "__main__":
    main()
