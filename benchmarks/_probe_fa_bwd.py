"""Probe (issue 50): the FP8 flash-attention backward (`flash_fp8_bwd_mgpu`) on one Hopper GPU.

1. Accuracy, B=1 S=1024 8 heads (2 KV heads) x 128, causal and not: the gradients of
   `flash_fp8_attention` (float32 inputs quantized to e4m3 in front of it, straight through)
   against the float32 vjp (ok at >= 20 dB, the issue's bar), and the backward kernels against
   `flash_fp8_bwd_reference` on the same out/lse (ok at >= 35 dB; the FP8 variant at >= 22 dB),
   for the bf16 backward and ``Config(fp8=True)``.
2. Time, B=4 S=8192 16 heads x 128, causal: ``value_and_grad`` of ``sum(out * G)`` for cuDNN
   bf16 (``jax.nn.dot_product_attention(..., implementation="cudnn")``) and for the FP8
   custom_vjp per backward `Config` (from e4m3 q, k, v; and from bf16 with the per-tensor
   quantization in front), plus the backward kernels alone; 3 warmups + 10 timed calls, the
   mean in ms and the ratio cuDNN bf16 / variant (> 1: faster than cuDNN bf16).
A failing variant prints its error and the probe goes on.

Run from the repository root: ``PYTHONPATH=src:.:tests python benchmarks/_probe_fa_bwd.py``
(``--skip-check``, ``--only NAME,NAME``).
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax._kernels import flash_fp8_bwd_mgpu as fb
from fp8jax._kernels import flash_fp8_mgpu as fk
from fp8jax._kernels import flash_fp8_vjp as fv

E4M3, BF16, F32 = jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32
C = fb.Config
VARIANTS = {
    "default": C(),
    "fp8": C(fp8=True),
    "fp8 dq kv128": C(fp8=True, block_kv_dq=128),
    "steps3": C(max_concurrent_steps=3),
    "dq kv128": C(block_kv_dq=128),
    "dkv q128": C(block_q_dkv=128),
}
BUDGET_S = 150  # variants left when the probe has run this long are listed as skipped


def sqnr_db(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum((x - ref) ** 2), 1e-30)))


def quantize(x):
    scale = jax.lax.stop_gradient(jnp.max(jnp.abs(x)).astype(F32) / 448.0)
    return (x / scale).astype(E4M3), scale


def f32_attention(q, k, v, causal):
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / math.sqrt(q.shape[-1])
    if causal:
        n = s.shape[-1]
        s = jnp.where(jnp.arange(n)[:, None] >= jnp.arange(n)[None, :], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v, precision="highest")


def check(causal: bool, key, name: str, cfg: fb.Config, bar: float) -> None:
    """The custom_vjp's gradients from float32 inputs against the float32 vjp (ok at 20 dB),
    the backward kernels against the reference on the same out/lse (ok at ``bar``)."""
    kq, kk, kv, kd = jax.random.split(key, 4)
    x = [jax.random.normal(kk_, s, F32) for kk_, s in
         ((kq, (1, 1024, 8, 128)), (kk, (1, 1024, 2, 128)), (kv, (1, 1024, 2, 128)))]  # fmt: skip
    dout = jax.random.normal(kd, x[0].shape, F32).astype(BF16)

    def fp8(q, k, v):
        (q8, qs), (k8, ks), (v8, vs) = (quantize(t) for t in (q, k, v))
        return fv.flash_fp8_attention(q8, k8, v8, qs, ks, vs, causal=causal, bwd_config=cfg)

    _, vjp = jax.vjp(fp8, *x)
    got = vjp(dout)
    _, vjp32 = jax.vjp(lambda *a: f32_attention(*a, causal), *x)
    want = vjp32(dout.astype(F32))
    dbs = [sqnr_db(g, w) for g, w in zip(got, want)]
    nan = not all(bool(jnp.all(jnp.isfinite(g))) for g in got)
    ok = "ok" if min(dbs) >= 20.0 and not nan else "BAD"
    head = f"  [{name}] causal={causal}"
    print(f"{head} vs float32 vjp: dq/dk/dv {[round(d, 1) for d in dbs]} dB  {ok}")

    args = [quantize(t) for t in x]
    args = [a for a, _ in args] + [s for _, s in args]
    out, lse = fk.flash_fp8(*args, causal=causal)
    got = fb.flash_fp8_bwd(*args, out, lse, dout, causal=causal, config=cfg)
    ref = fb.flash_fp8_bwd_reference(*args, out, lse, dout, causal=causal)
    dbs = [sqnr_db(g.astype(F32), r.astype(F32)) for g, r in zip(got, ref)]
    ok = "ok" if min(dbs) >= bar else "BAD"
    print(f"{head} kernels vs reference: {[round(d, 1) for d in dbs]} dB  {ok}", flush=True)


def time_ms(fn, *args, warmup: int = 3, iters: int = 10) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    t0 = time.perf_counter()
    print(jax.devices()[0].device_kind, jax.__version__)
    if not a.skip_check:
        print("accuracy (B=1 S=1024 Hq=8 Hkv=2 D=128):")
        for name, cfg, bar in (("bf16", C(), 35.0), ("fp8", C(fp8=True), 22.0)):
            for causal in (False, True):
                try:
                    check(causal, jax.random.PRNGKey(int(causal)), name, cfg, bar)
                except Exception as e:
                    print(f"  [{name}] causal={causal} FAILED: {type(e).__name__}: {str(e)[:400]}")
    shape = (4, 8192, 16, 128)
    ks = jax.random.split(jax.random.PRNGKey(7), 4)
    q, k, v, g = (jax.random.normal(kk, shape, F32).astype(BF16) for kk in ks)
    print(f"fwd+bwd, B,S,H,D={shape} causal (ms, ratio = cuDNN bf16 / variant):")

    def cudnn_loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, implementation="cudnn", is_causal=True)
        return jnp.sum(out.astype(F32) * g.astype(F32))

    cudnn = jax.jit(jax.value_and_grad(cudnn_loss, argnums=(0, 1, 2)))
    base = None
    try:
        base = time_ms(cudnn, q, k, v)
        print(f"  cudnn bf16: {base:.3f} ms")
    except Exception as e:
        print(f"  cudnn bf16 FAILED: {type(e).__name__}: {str(e)[:400]}")
    (q8, qs), (k8, ks_), (v8, vs) = (quantize(t) for t in (q, k, v))
    only = set(filter(None, a.only.split(",")))
    for name, cfg in VARIANTS.items():
        if only and name not in only:
            continue
        if time.perf_counter() - t0 > BUDGET_S:
            print(f"  [{name}] skipped (past {BUDGET_S} s; --only {name} runs it)")
            continue

        def fp8_loss(q8, k8, v8, cfg=cfg):
            out = fv.flash_fp8_attention(q8, k8, v8, qs, ks_, vs, causal=True, bwd_config=cfg)
            return jnp.sum(out.astype(F32) * g.astype(F32))

        def quantized_loss(q, k, v, cfg=cfg):
            (q8, qs), (k8, ks), (v8, vs) = (quantize(t) for t in (q, k, v))
            out = fv.flash_fp8_attention(q8, k8, v8, qs, ks, vs, causal=True, bwd_config=cfg)
            return jnp.sum(out.astype(F32) * g.astype(F32))

        out, lse = fk.flash_fp8(q8, k8, v8, qs, ks_, vs, causal=True)
        bwd = jax.jit(lambda *r, cfg=cfg: fb.flash_fp8_bwd(*r, causal=True, config=cfg))
        cases = (
            ("fp8 fwd+bwd from e4m3", jax.value_and_grad(fp8_loss, (0, 1, 2)), (q8, k8, v8)),
            ("fp8 fwd+bwd from bf16", jax.value_and_grad(quantized_loss, (0, 1, 2)), (q, k, v)),
            ("bwd kernels alone", bwd, (q8, k8, v8, qs, ks_, vs, out, lse, g)),
        )
        for what, fn, args in cases:
            try:
                ms = time_ms(jax.jit(fn), *args)
                ratio = f"  x{base / ms:.3f}" if base and what.startswith("fp8") else ""
                print(f"  [{name}] {what}: {ms:.3f} ms{ratio}")
            except Exception as e:
                print(f"  [{name}] {what} FAILED: {type(e).__name__}: {str(e)[:400]}")
        print(f"  ({time.perf_counter() - t0:.0f} s so far)", flush=True)


if __name__ == "__main__":
    main()
