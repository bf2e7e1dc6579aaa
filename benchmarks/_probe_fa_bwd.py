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

``--sweep``: the ``Config(fp8=True)`` tiles, the dQ kernel and the dK/dV kernel timed apart
(``_dq``, ``_dkv`` on the operands `flash_fp8_bwd` builds), each variant's outputs first checked
against `flash_fp8_bwd_reference` on batch 0, heads 0-1 (ok at >= 20 dB); then the best
combined Config (one ``max_concurrent_steps`` for both) fwd+bwd against cuDNN bf16. TFLOP/s
count the causal half of each kernel's matmuls (dQ: S, dP, dQ; dK/dV: S^T, dP^T, dV, dK). ``--tiny``
runs it in Pallas' GPU interpret mode on a small shape (CPU); ``--lower`` only lowers each
variant for CUDA at the timed shape (no GPU needed).

Run from the repository root: ``PYTHONPATH=src:.:tests python benchmarks/_probe_fa_bwd.py``
(``--skip-check``, ``--only NAME,NAME``; ``--sweep [--tiny | --lower]``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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
SWEEP_BUDGET_S = 160  # --sweep: no new variant timed past this (then ~30 s of fwd+bwd)
TINY_BUDGET_S = 15  # --tiny: counted from the first variant (a few run, the rest show the skip)
SHAPE, TINY_SHAPE = (4, 8192, 16, 128), (1, 256, 1, 64)


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


# ----------------------------------------------------------------------------- --sweep
def sweep_configs(kernel: str) -> list[fb.Config]:
    """The fp8 variants of one kernel's tiles (the other kernel's at their defaults), steps 2
    first (the ones timed when the budget runs short)."""
    names = ("block_q_dq", "block_kv_dq") if kernel == "dq" else ("block_q_dkv", "block_kv_dkv")
    pairs = [(bq, bk) for bq in (64, 128) for bk in (64, 128)]
    return [
        C(**dict(zip(names, t)), max_concurrent_steps=n, fp8=True) for n in (2, 3) for t in pairs
    ]


def tiles(cfg: fb.Config, kernel: str) -> str:
    c = cfg
    bq, bk = (c.block_q_dq, c.block_kv_dq) if kernel == "dq" else (c.block_q_dkv, c.block_kv_dkv)
    return f"q{bq:<3} kv{bk:<3} steps{c.max_concurrent_steps}"


@functools.partial(jax.jit, static_argnames=("interpret",))
def fp8_operands(q8, k8, v8, qs, ks, vs, out, lse, dout, *, interpret: bool):
    """The fp8 kernels' inputs as `flash_fp8_bwd` builds them (``Config(fp8=True)``, default
    softmax scale, ``wrt_fp8=False``): ``(q, k, v, do8, lse2, delta, scales)``, K^T, (Q^T,
    dO^T). Checked against `flash_fp8_bwd` itself before the sweep (`drift_db`)."""
    sm = 1.0 / math.sqrt(q8.shape[-1])
    do8, do_s, ds_s = fb._quantize_dout(dout, v8, vs)
    perm = not interpret
    kt, qt_dot = fk._vt(k8, perm), (fk._vt(q8, perm), fk._vt(do8, perm))
    one = jnp.float32(1)
    scales = jnp.stack(
        [qs * ks * (sm * fb.LOG2E), vs * do_s, ds_s * sm * ks * one, ds_s * sm * qs * one,
         do_s / fk.P_SCALE * one, 1 / ds_s]
    )  # fmt: skip
    lse2 = lse.astype(F32) * fb.LOG2E
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(F32), do8.astype(F32) * do_s)
    return (q8, k8, v8, do8, lse2, delta, scales), kt, qt_dot


@functools.cache
def kernel_fn(kernel: str, cfg: fb.Config, interpret: bool):
    """One kernel alone (causal) on `fp8_operands`' results: dq, or (dk, dv) (Hq == Hkv)."""

    def run(ops, kt, qt_dot):
        if kernel == "dq":
            return (fb._dq(*ops, kt, True, cfg, interpret),)
        return fb._dkv(*ops, qt_dot, True, cfg, interpret)

    return jax.jit(run)


def drift_db(inputs, operands, interpret: bool) -> float:
    """The two kernels on `fp8_operands` against `flash_fp8_bwd` (default fp8 Config): the
    probe's copy of its operand code still matches (identical: inf dB)."""
    cfg = C(fp8=True)
    got = kernel_fn("dq", cfg, interpret)(*operands) + kernel_fn("dkv", cfg, interpret)(*operands)
    want = fb.flash_fp8_bwd(*inputs, causal=True, config=cfg, interpret=interpret)
    return min(sqnr_db(g.astype(F32), w.astype(F32)) for g, w in zip(got, want))


def lower_variant(kernel: str, cfg: fb.Config, operands) -> None:
    """Lower one kernel for CUDA (Mosaic GPU's checks of shapes, layouts, SMEM; no GPU)."""
    fn = kernel_fn(kernel, cfg, False)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), operands)
    fn.trace(*abstract).lower(lowering_platforms=("cuda",)).as_text()


def smem_kib(kernel: str, cfg: fb.Config, d: int) -> float:
    """The fp8 kernel's shared memory (`_dq`'s / `_dkv`'s buffers, barriers left out)."""
    c, wgs = cfg, fb.COMPUTE_WGS
    s = c.max_concurrent_steps
    if kernel == "dq":
        bq, bk = c.block_q_dq, c.block_kv_dq
        n = 2 * wgs * bq * d + 2 * wgs * bq * 4 + 3 * s * bk * d + 2 * wgs * bq * d
    else:
        bq, bk = c.block_q_dkv, c.block_kv_dkv
        n = 2 * wgs * bk * d + 2 * s * bq * d + 2 * s * bq * 4 + 2 * s * d * bq
        n += 2 * 2 * wgs * bk * d
    return n / 1024


def sweep(tiny: bool = False, lower_only: bool = False) -> None:
    """Time (or, ``lower_only``, lower) each fp8 variant of each kernel; the best combined
    Config's fwd+bwd against cuDNN bf16. ``tiny``: interpret mode on `TINY_SHAPE`."""
    t0 = time.perf_counter()
    interpret, shape = tiny, TINY_SHAPE if tiny else SHAPE
    budget = TINY_BUDGET_S if tiny else SWEEP_BUDGET_S
    print(jax.devices()[0].device_kind, jax.__version__, f"shape B,S,H,D={shape} causal fp8")
    b, s, h, d = shape
    flops = {"dq": 3 * 2 * b * h * s * s * d / 2, "dkv": 4 * 2 * b * h * s * s * d / 2}
    ks = jax.random.split(jax.random.PRNGKey(7), 4)
    q, k, v, g = (jax.random.normal(kk, shape, F32).astype(BF16) for kk in ks)
    (q8, qs), (k8, ks_), (v8, vs) = (quantize(t) for t in (q, k, v))
    if lower_only:  # abstract out/lse: nothing runs
        out = jax.ShapeDtypeStruct(shape, BF16)
        lse = jax.ShapeDtypeStruct((b, h, s), F32)
        operands = jax.eval_shape(
            functools.partial(fp8_operands, interpret=False), q8, k8, v8, qs, ks_, vs, out, lse, g
        )
    else:
        out, lse = fk.flash_fp8(q8, k8, v8, qs, ks_, vs, causal=True, interpret=interpret)
        inputs = (q8, k8, v8, qs, ks_, vs, out, lse, g)
        operands = fp8_operands(*inputs, interpret=interpret)
        print(f"  operands vs flash_fp8_bwd: {drift_db(inputs, operands, interpret):.1f} dB")
        sl = lambda x: x[:1, :, :2]  # noqa: E731  batch 0, heads 0-1
        ref = fb.flash_fp8_bwd_reference(
            *map(sl, (q8, k8, v8)), qs, ks_, vs, sl(out), lse[:1, :2], sl(g), causal=True
        )
        ref = {"dq": ref[:1], "dkv": ref[1:]}
        print(f"  reference ready ({time.perf_counter() - t0:.0f} s)", flush=True)
    results = {"dq": {}, "dkv": {}}
    t_loop = time.perf_counter()
    pairs = [(kn, c) for pair in zip(*(sweep_configs(kn) for kn in results)) for kn, c in
             zip(results, pair)]  # fmt: skip
    for kernel, cfg in pairs:
        name = f"[{kernel:>3}] {tiles(cfg, kernel)}"
        why = fb._shape_reason(shape, shape, E4M3, True, cfg)
        if why is not None:
            print(f"  {name} skipped: {why}")
            continue
        if not lower_only and time.perf_counter() - (t_loop if tiny else t0) > budget:
            print(f"  {name} skipped: past the {budget} s budget")
            continue
        kib = smem_kib(kernel, cfg, d)
        try:
            if lower_only:
                lower_variant(kernel, cfg, operands)
                print(f"  {name} lowers for CUDA (smem ~{kib:.0f} KiB)", flush=True)
                continue
            fn, t = kernel_fn(kernel, cfg, interpret), time.perf_counter()
            got = jax.block_until_ready(fn(*operands))
            db = min(sqnr_db(x[:1, :, :2].astype(F32), r.astype(F32)) for x, r in
                     zip(got, ref[kernel]))  # fmt: skip
            finite = all(bool(jnp.all(jnp.isfinite(x.astype(F32)))) for x in got)
            ok = db >= 20.0 and finite
            # tiny: the checked call's time (compile included), interpret mode is slow
            ms = (time.perf_counter() - t) * 1e3 if tiny else time_ms(fn, *operands)
            results[kernel][cfg] = (ms, ok)
            tf = flops[kernel] / ms / 1e9
            tag, el = "ok" if ok else "BAD", time.perf_counter() - t0
            print(f"  {name} {ms:8.3f} ms {tf:6.0f} TFLOP/s  {db:5.1f} dB {tag}", end="")
            print(f"  smem ~{kib:.0f} KiB  ({el:.0f} s)", flush=True)
        except Exception as e:
            print(f"  {name} skipped (smem ~{kib:.0f} KiB): {type(e).__name__}: {str(e)[:300]}")
    if lower_only:
        return
    for kernel, rows in results.items():
        print(f"{kernel} (ms, TFLOP/s; fastest first):")
        for cfg, (ms, ok) in sorted(rows.items(), key=lambda r: r[1][0]):
            tf = flops[kernel] / ms / 1e9
            print(f"  {tiles(cfg, kernel)}  {ms:8.3f}  {tf:6.0f}  {'' if ok else 'BAD'}")
    best = best_combined(results)
    if best is None:
        print("no steps value with a good variant of both kernels")
        return
    cfg, ms = best
    print(f"best combined: {cfg}: dq + dkv kernels {ms:.3f} ms ({time.perf_counter() - t0:.0f} s)")
    if not tiny:
        fwd_bwd_vs_cudnn(cfg, q, k, v, g, (q8, k8, v8, qs, ks_, vs))
    print(f"done ({time.perf_counter() - t0:.0f} s)")


def best_combined(results):
    """The fastest good dQ and dK/dV variants of one ``max_concurrent_steps`` (shared)."""
    best = None
    for steps in (2, 3):
        pick = []
        for kernel, rows in results.items():
            good = [
                (ms, c) for c, (ms, ok) in rows.items() if ok and c.max_concurrent_steps == steps
            ]
            pick.append(min(good, key=lambda r: r[0]) if good else None)
        if None in pick:
            continue
        (ms_q, cq), (ms_kv, ckv) = pick
        cfg = dataclasses.replace(cq, block_q_dkv=ckv.block_q_dkv, block_kv_dkv=ckv.block_kv_dkv)
        if best is None or ms_q + ms_kv < best[1]:
            best = (cfg, ms_q + ms_kv)
    return best


def fwd_bwd_vs_cudnn(cfg: fb.Config, q, k, v, g, fp8_inputs) -> None:
    """``value_and_grad`` of ``sum(out * G)``: cuDNN bf16 and the fp8 custom_vjp from e4m3
    with ``cfg`` and with the default fp8 Config (as `main`)."""
    q8, k8, v8, qs, ks, vs = fp8_inputs

    def cudnn_loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, implementation="cudnn", is_causal=True)
        return jnp.sum(out.astype(F32) * g.astype(F32))

    def fp8_loss(q8, k8, v8, cfg):
        out = fv.flash_fp8_attention(q8, k8, v8, qs, ks, vs, causal=True, bwd_config=cfg)
        return jnp.sum(out.astype(F32) * g.astype(F32))

    base = None
    cases = [("cudnn bf16", jax.value_and_grad(cudnn_loss, (0, 1, 2)), (q, k, v))]
    for what, c in (("fp8 best", cfg), ("fp8 default", C(fp8=True))):
        loss = functools.partial(fp8_loss, cfg=c)
        cases.append((f"{what} from e4m3", jax.value_and_grad(loss, (0, 1, 2)), (q8, k8, v8)))
    for what, fn, args in cases:
        try:
            ms = time_ms(jax.jit(fn), *args)
            base = base or ms
            print(f"  fwd+bwd {what}: {ms:.3f} ms  x{base / ms:.3f}", flush=True)
        except Exception as e:
            print(f"  fwd+bwd {what} FAILED: {type(e).__name__}: {str(e)[:300]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--sweep", action="store_true", help="fp8 tile sweep, kernels apart")
    ap.add_argument("--tiny", action="store_true", help="--sweep in interpret mode (CPU)")
    ap.add_argument("--lower", action="store_true", help="--sweep: only lower for CUDA")
    a = ap.parse_args()
    if a.sweep or a.tiny or a.lower:
        return sweep(tiny=a.tiny, lower_only=a.lower)
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
    shape = SHAPE
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
