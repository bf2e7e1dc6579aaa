"""Device check of the raw grouped-GEMM kernels: correctness against float32 and a
block-size sweep on the ANCHORS table-3 probe shape. Prints JSON lines."""
import functools, itertools, json, sys, time, traceback
import numpy as np
import jax, jax.numpy as jnp
from fp8jax import _grouped_kernel as gk

A = gk.ROW_ALIGN
E4, E5, BF = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16


def layout(sizes, m_pad):
    sizes = np.asarray(sizes)
    padded = -(-sizes // A) * A
    starts = np.concatenate([[0], np.cumsum(padded)[:-1]])
    bg = np.full(m_pad // A, len(sizes), np.int32)
    valid = np.zeros(m_pad, bool)
    for e, (s, p, n) in enumerate(zip(starts, padded, sizes)):
        bg[s // A:(s + p) // A] = e
        valid[s:s + n] = True
    return starts.astype(np.int32), padded.astype(np.int32), bg, valid


def bench(f, *a, iters=20):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            o = f(*a)
        jax.block_until_ready(o)
        ts.append((time.perf_counter() - t0) / iters)
    return min(ts)


def sqnr(ref, out):
    ref = np.asarray(ref, np.float64); out = np.asarray(out, np.float64)
    return float(10 * np.log10(np.sum(ref ** 2) / max(np.sum((ref - out) ** 2), 1e-30)))


def check(dtype_a, dtype_b, sizes, K=256, N=512, G=None):
    G = len(sizes)
    m_pad = int(sum(-(-s // A) * A for s in sizes)) + 2 * A
    starts, padded, bg, valid = layout(sizes, m_pad)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k1, (m_pad, K), jnp.float32) * valid[:, None]
    w = jax.random.normal(k2, (G, N, K), jnp.float32)
    dy = jax.random.normal(k3, (m_pad, N), jnp.float32) * valid[:, None]
    scales = jnp.linspace(0.5, 2.0, G, dtype=jnp.float32)
    xq, wq, dyq = x.astype(dtype_a), w.astype(dtype_b), dy.astype(dtype_a)
    tk = 64 if dtype_a == BF else 128
    out = gk.grouped_rows(xq, wq, jnp.asarray(bg), scales, out_dtype=BF, config=gk.RowsConfig(tile_k=tk))
    gid = np.minimum(np.repeat(bg, A), G - 1)
    ref = jnp.einsum("mk,mnk->mn", xq.astype(jnp.float32), wq.astype(jnp.float32)[gid]) * scales[gid][:, None]
    r1 = sqnr(np.asarray(ref)[valid], np.asarray(out, np.float32)[valid])
    # wgrad: out[g] = x_g^T dy_g
    dw = gk.grouped_wgrad(xq.T, dyq.T, jnp.asarray(starts), jnp.asarray(padded), 0.5, out_dtype=jnp.float32,
                          config=gk.WgradConfig(block_k=tk))
    onehot = (np.arange(G)[:, None] == gid[None]) & valid[None]
    refw = 0.5 * jnp.einsum("gm,mk,mn->gkn", onehot.astype(np.float32), xq.astype(jnp.float32), dyq.astype(jnp.float32))
    r2 = sqnr(refw, dw)
    empty_ok = bool(np.all(np.asarray(dw)[np.asarray(sizes) == 0] == 0))
    return dict(check="kernel", a=str(jnp.dtype(dtype_a)), b=str(jnp.dtype(dtype_b)), sizes=list(map(int, sizes)),
                rows_sqnr_db=round(r1, 1), wgrad_sqnr_db=round(r2, 1), empty_groups_zero=empty_ok)


def sweep(G, dtype, M=16384, K=4096, N=7168, quick=False):
    sizes = [M // G] * G
    starts, padded, bg, valid = layout(sizes, M)
    x = jax.random.normal(jax.random.PRNGKey(1), (M, K), jnp.float32).astype(dtype)
    w = jax.random.normal(jax.random.PRNGKey(2), (G, N, K), jnp.float32).astype(dtype)
    scales = jnp.ones((G,), jnp.float32)
    flops = 2 * M * K * N
    tk = 64 if dtype == BF else 128
    best = {}
    for tm, tn, steps, width in itertools.product((128,), (128,), (3, 4, 5) if dtype != BF else (4, 6), (4, 8, 16)):
        cfg = gk.RowsConfig(tile_m=tm, tile_n=tn, tile_k=tk, max_concurrent_steps=steps, grid_tile_width=width)
        try:
            f = jax.jit(functools.partial(gk.grouped_rows, out_dtype=BF, config=cfg))
            t = bench(f, x, w, jnp.asarray(bg), scales)
            tf = flops / t / 1e12
            print(json.dumps(dict(sweep="rows", G=G, dtype=str(jnp.dtype(dtype)), cfg=dataclasses_str(cfg), tflops=round(tf, 1))), flush=True)
            if tf > best.get("tflops", 0):
                best = dict(tflops=round(tf, 1), cfg=dataclasses_str(cfg))
        except Exception as e:
            print(json.dumps(dict(sweep="rows", G=G, cfg=dataclasses_str(cfg), err=f"{type(e).__name__}: {str(e)[:300]}")), flush=True)
    # wgrad on the same shape: out [G, K, N] from x^T [K, M], dy^T [N, M]
    dyT = jax.random.normal(jax.random.PRNGKey(3), (N, M), jnp.float32).astype(dtype)
    xT = x.T
    for bm, bn, steps in itertools.product((128,), (128, 256), (3, 4, 6)):
        cfg = gk.WgradConfig(block_m=bm, block_n=bn, block_k=tk, max_concurrent_steps=steps)
        try:
            f = jax.jit(functools.partial(gk.grouped_wgrad, out_dtype=jnp.float32, config=cfg))
            t = bench(f, xT, dyT, jnp.asarray(starts), jnp.asarray(padded), 1.0)
            print(json.dumps(dict(sweep="wgrad", G=G, dtype=str(jnp.dtype(dtype)), cfg=dataclasses_str(cfg), tflops=round(flops / t / 1e12, 1))), flush=True)
        except Exception as e:
            print(json.dumps(dict(sweep="wgrad", G=G, cfg=dataclasses_str(cfg), err=f"{type(e).__name__}: {str(e)[:300]}")), flush=True)
    return best


def dataclasses_str(cfg):
    import dataclasses
    return dataclasses.asdict(cfg)


def accumulation_probe():
    """Kernel vs exact (float64) products of the *same* FP8 operands as K grows, next
    to XLA/cuBLAS FP8 on the same operands: how much Hopper's FP8 accumulation loses."""
    M, N, G = 1024, 512, 4
    for K in (256, 1024, 4096, 14336):
        for a_dt in (E4, E5):
            sizes = [M // G] * G
            starts, padded, bg, valid = layout(sizes, M)
            k1, k2 = jax.random.split(jax.random.PRNGKey(K), 2)
            xq = (jax.random.normal(k1, (M, K), jnp.float32) * 8).astype(a_dt)
            wq = (jax.random.normal(k2, (G, N, K), jnp.float32) * 8).astype(E4)
            out = gk.grouped_rows(xq, wq, jnp.asarray(bg), jnp.ones((G,), jnp.float32), out_dtype=jnp.float32,
                                  config=gk.RowsConfig())
            x64 = np.asarray(xq.astype(jnp.float32), np.float64)
            w64 = np.asarray(wq.astype(jnp.float32), np.float64)
            gid = np.repeat(np.arange(G), M // G)
            ref = np.einsum("mk,mnk->mn", x64, w64[gid])
            cublas = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                              preferred_element_type=jnp.float32))(xq[: M // G], wq[0])
            print(json.dumps(dict(probe="accumulation", K=K, a=str(jnp.dtype(a_dt)),
                                  kernel_sqnr_db=round(sqnr(ref, out), 1),
                                  cublas_sqnr_db=round(sqnr(ref[: M // G], cublas), 1))), flush=True)


if __name__ == "__main__":
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    if sys.argv[1:] == ["--accumulation"]:
        accumulation_probe()
        sys.exit(0)
    for a, b in ((E4, E4), (E5, E4), (BF, BF)):
        for sizes in ([300, 0, 1, 700], [0, 0, 1024, 0], [128, 256, 5, 127]):
            try:
                print(json.dumps(check(a, b, sizes)), flush=True)
            except Exception as e:
                traceback.print_exc()
                print(json.dumps(dict(check="kernel", a=str(jnp.dtype(a)), err=f"{type(e).__name__}: {str(e)[:600]}")), flush=True)
                break
    for G in (8, 64):
        for dt in (E4, BF):
            sweep(G, dt)
