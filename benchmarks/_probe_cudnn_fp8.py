"""Device probe: what each scale operand of cuDNN's FP8 attention backward does (via XLA),
and how the raw FP8 kernels scale with batch/seq."""
import json, time
import jax, jax.numpy as jnp, numpy as np
from fp8jax import _cudnn_attention as cu

E = jnp.float8_e4m3fn
F = jnp.float32
B, T, N, H = 1, 256, 2, 128
ks = jax.random.split(jax.random.PRNGKey(0), 4)
q8, k8, v8, do8 = (jax.random.normal(kk, (B, T, N, H), F).astype(E) for kk in ks)
SS = 1 / 16.0
FWD = ["descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"]
BWD = ["descale_q", "descale_k", "descale_v", "descale_o", "descale_do", "descale_s", "descale_dp", "scale_s",
       "scale_dq", "scale_dk", "scale_dv", "scale_dp"]

def run(fwd_over=None, bwd_over=None):
    fp = {n: 1.0 for n in FWD}; fp.update(fwd_over or {})
    bp = {n: 1.0 for n in BWD}; bp.update(bwd_over or {})
    o8, amax_s, amax_o, st = cu.forward(q8, k8, v8, **{n: jnp.float32(x) for n, x in fp.items()},
                                        softmax_scale=SS, causal=False, training=True)
    out = cu.backward(q8, k8, v8, o8, do8, st, **{n: jnp.float32(x) for n, x in bp.items()}, softmax_scale=SS, causal=False)
    return o8, amax_s, amax_o, out

def mag(x):
    return float(jnp.mean(jnp.abs(x.astype(F))))

# float reference from the same fp8 operands (scales 1)
qf, kf, vf, dof = (x.astype(F) for x in (q8, k8, v8, do8))
def ref_fwd(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, scale=SS)
with jax.default_matmul_precision("float32"):
    o_ref, vjp = jax.vjp(ref_fwd, qf, kf, vf)
    dq_ref, dk_ref, dv_ref = vjp(dof)
o8, amax_s, amax_o, (dq8, dk8, dv8, adq, adk, adv, adp) = run()
def sq(a, b):
    a = np.asarray(a, np.float64); b = np.asarray(b, np.float64)
    return round(float(10 * np.log10((b ** 2).sum() / max(((a - b) ** 2).sum(), 1e-300))), 1)
print("baseline sqnr o", sq(o8.astype(F), o_ref), "dq", sq(dq8.astype(F), dq_ref), "dk", sq(dk8.astype(F), dk_ref), "dv", sq(dv8.astype(F), dv_ref))
print("baseline amax s,o", float(amax_s), float(amax_o), "ref o", float(jnp.max(jnp.abs(o_ref))))
print("baseline amax dq,dk,dv,dp", [float(a) for a in (adq, adk, adv, adp)], "ref", [float(jnp.max(jnp.abs(x))) for x in (dq_ref, dk_ref, dv_ref)])
base = dict(o=mag(o8), dq=mag(dq8), dk=mag(dk8), dv=mag(dv8), aq=float(adq), ak=float(adk), av=float(adv), ap=float(adp), as_=float(amax_s), ao=float(amax_o))
for which, names in (("fwd", FWD), ("bwd", BWD)):
    for name in names:
        o8, amax_s, amax_o, (dq8, dk8, dv8, adq, adk, adv, adp) = run(**({"fwd_over": {name: 2.0}} if which == "fwd" else {"bwd_over": {name: 2.0}}))
        cur = dict(o=mag(o8), dq=mag(dq8), dk=mag(dk8), dv=mag(dv8), aq=float(adq), ak=float(adk), av=float(adv), ap=float(adp), as_=float(amax_s), ao=float(amax_o))
        print(which, f"{name:>11}=2:", " ".join(f"{k}x{cur[k] / base[k]:.2f}" if base[k] else f"{k}:{cur[k]:.3g}" for k in cur), flush=True)

def bench(f, *a, n=10):
    out = f(*a); jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(n):
        out = f(*a)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n * 1e3
one = jnp.float32(1.0)
for (b, s, n) in [(2, 8192, 16), (4, 8192, 16), (2, 8192, 32), (1, 16384, 16), (2, 16384, 16), (8, 4096, 16), (16, 2048, 16)]:
    xs = [jax.random.normal(kk, (b, s, n, 128), jnp.bfloat16) for kk in ks]
    x8 = [x.astype(E) for x in xs]
    def raw(q8, k8, v8, do8):
        o8, _, _, st = cu.forward(q8, k8, v8, **{k: one for k in FWD}, softmax_scale=128 ** -0.5, causal=True, training=True)
        return cu.backward(q8, k8, v8, o8, do8, st, **{k: one for k in BWD}, softmax_scale=128 ** -0.5, causal=True)
    def rawf(q8, k8, v8):
        return cu.forward(q8, k8, v8, **{k: one for k in FWD}, softmax_scale=128 ** -0.5, causal=True, training=False)[0]
    bf = jax.jit(jax.grad(lambda q, k, v, d: jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn").astype(F) * d.astype(F)), argnums=(0, 1, 2)))
    bff = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    r = dict(b=b, s=s, n=n, fp8_fwdbwd=bench(jax.jit(raw), *x8), bf16_fwdbwd=bench(bf, *xs), fp8_fwd=bench(jax.jit(rawf), *x8[:3]), bf16_fwd=bench(bff, *xs[:3]))
    r["ratio_fwdbwd"] = r["bf16_fwdbwd"] / r["fp8_fwdbwd"]; r["ratio_fwd"] = r["bf16_fwd"] / r["fp8_fwd"]
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
