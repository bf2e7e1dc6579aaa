"""Block-scaled FP8 GEMM alone (issue 25): ``[M, K] x [N, K]^T`` with 1x128 scales on the
left operand and 128x128 block scales on the right (the forward of a block-wise linear),
against XLA's bf16 GEMM and its per-tensor FP8 GEMM (cuBLASLt) on the same shapes.

Variants: ``fp8jax-blockwise`` (`fp8jax._kernels.blockwise_gemm`, backend ``auto``: the
Hopper kernel where it runs, the plain-JAX reference elsewhere; the ``backend`` field
says which), ``fp8jax-blockwise-grouped`` (the same rows split into 8 equal experts, each
with its own ``[N, K]`` weight: `fp8jax._kernels.blockwise_grouped_mgpu.grouped_rows`, the
grouped reference elsewhere; same FLOPs), ``xla-fp8-tensor`` (one scale per operand),
``xla-bf16``.

    python -m benchmarks.blockwise_gemm                      # H100: records to results/
    python -m benchmarks.blockwise_gemm --quick              # CPU smoke, writes nothing
    python -m benchmarks.blockwise_gemm --shapes 8192,8192,8192
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from benchmarks import common
from fp8jax._kernels import blockwise_gemm as bg

COMMAND_PREFIX = "python -m benchmarks.blockwise_gemm"
BENCH = "blockwise_gemm"
VARIANTS = ("fp8jax-blockwise", "fp8jax-blockwise-grouped", "xla-fp8-tensor", "xla-bf16")
EXPERTS = 8
FIELDS = (*common.META_FIELDS, "ms", "tflops", "speedup_vs_bf16", "backend")
SHAPES = [(8192, 8192, 8192), (16384, 4096, 14336), (4096, 4096, 4096)]  # M, K, N
QUICK_SHAPES = [(128, 256, 128)]
E4M3 = jnp.float8_e4m3fn


def _operands(m, k, n):
    ka, kb, ksa, ksb = jax.random.split(jax.random.PRNGKey(0), 4)
    a = jax.random.normal(ka, (1, m, k), jnp.bfloat16)
    b = jax.random.normal(kb, (1, n, k), jnp.bfloat16)
    nk = -(-k // 128)
    sa = jnp.exp(jax.random.normal(ksa, (1, m, nk)) * 0.1)
    sb = jnp.exp(jax.random.normal(ksb, (1, -(-n // 128), nk)) * 0.1)
    return a, b, sa, sb


def _fn(variant):
    if variant == "fp8jax-blockwise":
        return jax.jit(lambda a, sa, b, sb: bg.blockwise_gemm(a, sa, b, sb, jnp.bfloat16))
    dims = (((2,), (2,)), ((0,), (0,)))
    if variant == "xla-fp8-tensor":

        def fp8(a, sa, b, sb):
            y = jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.bfloat16)
            return (y.astype(jnp.float32) * (sa[0, 0, 0] * sb[0, 0, 0])).astype(jnp.bfloat16)

        return jax.jit(fp8)
    if variant == "xla-bf16":
        return jax.jit(
            lambda a, sa, b, sb: jax.lax.dot_general(
                a, b, dims, preferred_element_type=jnp.bfloat16
            )
        )
    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")


def _grouped(a8, sa, b8, sb):
    """(function, args, backend) of the grouped variant: the rows split into equal experts
    (fewer than `EXPERTS` where M is small), each expert's weight a copy of ``b``."""
    from fp8jax._ops import grouped as gr
    from fp8jax._ops import grouped_gemms as gemms
    from fp8jax._recipe import BlockWise

    m, k = a8.shape[1:]
    groups = max(1, min(EXPERTS, m // 128))
    layout = gr.layout_from_sizes(jnp.full((groups,), m // groups), m, 128)
    b8g, sbg = (jnp.broadcast_to(t[0], (groups, *t.shape[1:])) + 0 for t in (b8, sb))
    try:
        from fp8jax._kernels import blockwise_grouped_mgpu as bgk

        why = bgk.reason(m, k, b8.shape[1], a8.dtype, jnp.bfloat16) or None
    except ImportError as e:  # pragma: no cover - depends on the installed JAX
        why = str(e)
    if why is None:
        fn = jax.jit(
            lambda a, sa, b, sb: bgk.grouped_rows(
                a[0], sa[0], b, sb, layout.block_group, out_dtype=jnp.bfloat16
            )
        )
        return fn, (a8, sa, b8g, sbg), "kernel"
    recipe, ones = BlockWise(), jnp.ones((groups,), jnp.float32)

    def reference(a, sa, b, sb):
        deq_a = recipe.dequantize(a, sa, jnp.float32)[0]
        return gemms._rows_reference(
            deq_a, recipe.dequantize(b, sb, jnp.float32), layout, ones, jnp.bfloat16
        )

    return jax.jit(reference), (a8, sa, b8g, sbg), f"reference ({why})"


def run_case(shape, variants, iters, reps, meta) -> list[dict]:
    m, k, n = shape
    a, b, sa, sb = _operands(m, k, n)
    a8, b8 = a.astype(E4M3), b.astype(E4M3)
    rows = []
    for name in variants:
        row = dict(meta, bench=BENCH, params=dict(M=m, K=k, N=n), variant=name, backend=None)
        try:
            lhs, rhs = (a, b) if name == "xla-bf16" else (a8, b8)
            args = (lhs, sa, rhs, sb)
            fn = None if name == "fp8jax-blockwise-grouped" else _fn(name)
            if name == "fp8jax-blockwise":
                why = bg.kernel_reason(a8, sa, b8, sb, jnp.bfloat16, 128)
                row["backend"] = "kernel" if why is None else f"reference ({why})"
            elif name == "fp8jax-blockwise-grouped":
                fn, args, row["backend"] = _grouped(a8, sa, b8, sb)
            row["ms"] = common.time_call(fn, args, iters, reps)
        except Exception as e:  # report and go on
            row.update(ms=None, error=common.error_text(e))
        rows.append(row)
    common.add_ratios(rows, 2.0 * m * k * n, {"speedup_vs_bf16": "xla-bf16"})
    return rows


def table(rows) -> str:
    columns = [
        ("ms", lambda r: f"{r['ms']:.3f}"),
        ("TFLOP/s", lambda r: common.fmt(r["tflops"], ".0f")),
        ("vs bf16", lambda r: common.fmt(r.get("speedup_vs_bf16"), ".2f", "x")),
        ("backend", lambda r: str(r.get("backend") or "-")[:60]),
    ]
    case = lambda r: "x".join(str(r["params"][d]) for d in "MKN")  # noqa: E731
    return "\n".join(common.markdown_rows(rows, "M x K x N", case, columns, error_chars=100))


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog=COMMAND_PREFIX, description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", help="M,K,N (several allowed)")
    p.add_argument("--variants", type=lambda s: [v for v in s.split(",") if v])
    p.add_argument("--quick", action="store_true", help="tiny CPU-sized case; writes no records")
    p.add_argument("--iters", type=int)
    p.add_argument("--reps", type=int)
    p.add_argument("--out", help="records file (default benchmarks/results/blockwise_gemm.jsonl)")
    args = p.parse_args(argv)
    iters, reps = args.iters or (2 if args.quick else 20), args.reps or (1 if args.quick else 5)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else None
    shapes = shapes or (QUICK_SHAPES if args.quick else SHAPES)
    meta = common.run_meta(argv, bench=BENCH, prefix=COMMAND_PREFIX)
    path = common.results_path(BENCH) if args.out is None else common.Path(args.out)
    return common.run_cases(
        shapes,
        lambda s: run_case(s, args.variants or VARIANTS, iters, reps, meta),
        table,
        path,
        FIELDS,
        record=not args.quick,
    )


if __name__ == "__main__":
    main()
