r"""Compare lowering choices of the fp8jax linear step (``fp8jax.tuning.gemm``) on a
GPU.

    python -m benchmarks.linear_tuning --set f32_gemm_out=1 cast_transposed=0 \
        --shapes 16384,4096,14336
    python -m benchmarks.linear_tuning --variant fp8jax-delayed-xlacast --dump hlo/

Run one process per setting (JAX caches traces); prints ms, speedup over bf16 from the
same process, and the kernels XLA launches.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from benchmarks import hlo, linear
from fp8jax import tuning


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--set", nargs="*", default=[], help="Tuning fields, key=0|1|text")
    parser.add_argument(
        "--shapes", nargs="+", type=linear.parse_shape, default=linear.ANCHOR_SHAPES[:3]
    )
    parser.add_argument("--variant", default="fp8jax-delayed")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--dump", default=None, help="write each shape's compiled fp8 step HLO into this folder"
    )
    args = parser.parse_args(argv)
    known = sorted(f.name for f in dataclasses.fields(tuning.GemmTuning))
    choices = {}
    for item in args.set:
        key, value = item.split("=")
        if key not in known:
            raise SystemExit(f"unknown tuning key {key}; known: {known}")
        choices[key] = bool(int(value)) if value in ("0", "1") else value
    with tuning.gemm(**choices) as chosen:
        print("TUNING", chosen)
        _run(args)


def _run(args) -> None:
    for shape in args.shapes:
        rows = linear.run_shape(shape, ["bf16", args.variant], args.iters, 5, meta={})
        bf16, fp8 = rows
        layer, xs, g = linear.make_inputs(shape)
        step = linear.BUILDERS[args.variant](layer, xs[0], g)
        text = step.hlo_text(xs[0], g)
        counts = hlo.kernel_summary(text)
        if args.dump:
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            tag = "_".join(args.set).replace("=", "-") or "default"
            (Path(args.dump) / f"{'x'.join(map(str, shape))}_{tag}.hlo").write_text(text)
        print(
            f"{shape}: bf16 {bf16['ms']:.3f} ms, {args.variant} {fp8['ms']:.3f} ms "
            f"({fp8['speedup_vs_bf16']:.3f}x), "
            f"fp8 gemms {fp8['fp8_gemm_count']}/{fp8['gemm_count']}, "
            f"peak {fp8['peak_mem_mb']:.0f} MB vs {bf16['peak_mem_mb']:.0f}, "
            f"launches {sum(counts.values())}: "
            + ", ".join(f"{k}={v}" for k, v in counts.most_common()),
            flush=True,
        )


if __name__ == "__main__":
    main()
