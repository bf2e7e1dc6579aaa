"""Device probe: cuDNN FP8 forward without a mask, as a function of the S (softmax) scale."""
import jax, jax.numpy as jnp, numpy as np
from fp8jax import _cudnn_attention as cu
E, F = jnp.float8_e4m3fn, jnp.float32
def sq(a, b):
    a = np.asarray(a, np.float64); b = np.asarray(b, np.float64)
    return round(float(10 * np.log10((b ** 2).sum() / max(((a - b) ** 2).sum(), 1e-300))), 1)
ks = jax.random.split(jax.random.PRNGKey(0), 3)
for T in (256, 512, 2048):
    q8, k8, v8 = (jax.random.normal(kk, (2, T, 4, 128), F).astype(E) for kk in ks)
    for causal in (False, True):
        ref = jax.nn.dot_product_attention(*(x.astype(F) for x in (q8, k8, v8)), is_causal=causal)
        row = []
        for scale_s in (1.0, 16.0, 448.0, 4096.0):
            one = jnp.float32(1)
            o8, amax_s, amax_o, _ = cu.forward(q8, k8, v8, descale_q=one, descale_k=one, descale_v=one,
                                               descale_s=jnp.float32(1 / scale_s), scale_s=jnp.float32(scale_s),
                                               scale_o=one, softmax_scale=128 ** -0.5, causal=causal, training=True)
            row.append((scale_s, sq(o8.astype(F), ref), round(float(amax_s), 4)))
        print("T", T, "causal", causal, row, flush=True)
