"""Probe (GPU): which top-level kernels of a `FusedMLP` train step write activation-sized
arrays, and in which dtype (are the norm, activation and activation-gradient passes
writing FP8 directly, or a bf16/f32 copy that another pass then casts?).

    python -m benchmarks._probe_mlp_hlo --activations gelu silu relu swiglu --out $OUT
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp

import fp8jax
from benchmarks.hlo import big_writes
from fp8jax.nn import FusedMLP


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--activations", nargs="+", default=["gelu", "silu", "relu", "swiglu"])
    ap.add_argument("--shape", default="1024,4096,8192", help="hidden,ffn,tokens")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    hidden, ffn, tokens = (int(v) for v in args.shape.split(","))
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (tokens, hidden), jnp.bfloat16)
    c = jax.random.normal(jax.random.fold_in(key, 1), (tokens, hidden), jnp.float32)

    def step(model, x, c):
        return jax.value_and_grad(lambda m, x: jnp.sum(m(x).astype(jnp.float32) * c), argnums=(0, 1))(model, x)

    for activation in args.activations:
        mlp = FusedMLP(hidden, ffn, activation=activation, dtype=jnp.bfloat16,
                       config=fp8jax.Fp8Config(selective=False), key=key)
        text = jax.jit(step).lower(mlp, x, c).compile().as_text()
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"mlp_{activation}.hlo.txt").write_text(text)
        report = fp8jax.fp8_gemm_report(step, mlp, x, c)
        print(f"\n== {activation}: {report.num_fp8} FP8 GEMMs", flush=True)
        for name, op, arrays in big_writes(text, tokens * ffn // 2):
            print(f"   {name}: {op} writes {' '.join(arrays)}", flush=True)


if __name__ == "__main__":
    main()
