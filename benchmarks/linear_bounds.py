"""What bounds the FP8 linear step: the time floor of cuBLASLt FP8 GEMMs + one-pass casts,
and the memory of a stack of layers.

**Floor** (``--floor``, the default). An FP8 train step of one linear layer cannot take
less than its three FP8 GEMMs (forward, dgrad, wgrad, on pre-quantized operands, at
the accumulation `Fp8Config.fast_accumulation` picks) plus one read of x, w and g that
writes both FP8 layouts of each (timed with the one-pass cast kernel where it runs,
else XLA's cast + transpose). Everything else a step does (dequantize multiplies,
amax/scale bookkeeping, separate transposes) is overhead an ideal implementation could
fold away. In the same process it times the bf16 step, ``fp8jax-delayed`` and
``flax-direct`` (`benchmarks.linear`), and prints the best ratio any FP8 path built on
cuBLASLt could reach: ``bf16 / floor`` and ``flax / floor``.

**Stack memory** (``--stack L``). One linear step keeps its input alive as an argument,
so its FP8 copies can only add to the peak. The FP8 saving is in the residuals a
network keeps for its backward: ``L`` chained ``K -> K`` layers, bf16 vs
``fp8jax-delayed``, peak memory (XLA's memory analysis of the compiled step) and the
residual bytes with a token dim (`fp8jax.saved_activation_bytes`).

    python -m benchmarks.linear_bounds --shapes 16384,4096,4096 8192,8192,8192
    python -m benchmarks.linear_bounds --stack 8 --shapes 16384,4096,4096
    python -m benchmarks.linear_bounds --quick          # CPU smoke run (both parts)
"""

from __future__ import annotations

import argparse
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

import fp8jax
from benchmarks import common, linear
from fp8jax._kernels import cast as _cast_kernel
from fp8jax._kernels import gemm as _gemm

BF16, E4M3, E5M2 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2
STEP_VARIANTS = ("bf16", "fp8jax-delayed", "flax-direct")


# ----------------------------------------------------------------------------- floor
def _fp8(key, shape, dtype):
    return (jax.random.normal(key, shape, jnp.float32) * 2).astype(dtype)


def gemm_fns(shape, config: fp8jax.Fp8Config) -> dict[str, tuple[Callable, tuple]]:
    """The three FP8 GEMMs of the step as fp8jax lays them out (both operands
    contracting on their minor dim), without dequantization: name -> (fn, operands)."""
    m, k, n = shape
    keys = jax.random.split(jax.random.PRNGKey(1), 6)
    fast_fwd = config.fast_accumulation in ("forward", "all")
    fast_bwd = config.fast_accumulation == "all"

    def gemm(fast):
        precision = None if fast else jax.lax.Precision.HIGHEST
        return jax.jit(lambda a, b: _gemm.gemm(a, b, BF16, precision))

    return {
        "fwd": (gemm(fast_fwd), (_fp8(keys[0], (1, m, k), E4M3), _fp8(keys[1], (1, n, k), E4M3))),
        "dgrad": (gemm(fast_bwd), (_fp8(keys[2], (1, m, n), E5M2), _fp8(keys[3], (1, k, n), E4M3))),
        "wgrad": (gemm(fast_bwd), (_fp8(keys[4], (1, n, m), E5M2), _fp8(keys[5], (1, k, m), E4M3))),
    }


def cast_fn(t3_shape) -> tuple[Callable, str]:
    """The fastest cast of a ``[B, P, C]`` tensor into both FP8 layouts + amax there is
    here: the Pallas kernel where it runs, else XLA's fused cast + transpose."""
    if _cast_kernel.supported(t3_shape)[0]:
        return jax.jit(
            lambda t, s, d: _cast_kernel.cast_transpose(t, s, d), static_argnums=2
        ), "kernel"
    return jax.jit(lambda t, s, d: _gemm.quantize_both(t, s, d), static_argnums=2), "xla"


def floor_shape(shape, iters: int, reps: int, config: fp8jax.Fp8Config) -> dict:
    """Times of the steps, the bare GEMMs and the casts for one shape, and the bounds."""
    m, k, n = shape
    rows = linear.run_shape(shape, STEP_VARIANTS, iters, reps, meta={})
    steps = {r["variant"]: r["ms"] for r in rows}
    gemms = {
        name: common.time_call(fn, ops, iters, reps)
        for name, (fn, ops) in gemm_fns(shape, config).items()
    }
    casts, cast_path = {}, ""
    key = jax.random.PRNGKey(2)
    scale = jnp.array([4.0 / 448], jnp.float32)
    for name, t_shape, dtype in (
        ("x", (1, m, k), E4M3),
        ("w", (1, n, k), E4M3),
        ("g", (1, m, n), E5M2),
    ):
        fn, cast_path = cast_fn(t_shape)
        casts[name] = common.time_call(
            fn, (jax.random.normal(key, t_shape, BF16), scale, dtype), iters, reps
        )
    floor = sum(gemms.values()) + sum(casts.values())
    ratio = lambda a, b: a / b if a and b else None  # noqa: E731
    return dict(
        shape=shape,
        steps=steps,
        gemms=gemms,
        casts=casts,
        cast_path=cast_path,
        floor=floor,
        max_vs_bf16=ratio(steps.get("bf16"), floor),
        max_vs_flax=ratio(steps.get("flax-direct"), floor),
        fp8jax_vs_bf16=ratio(steps.get("bf16"), steps.get("fp8jax-delayed")),
        fp8jax_over_floor=ratio(steps.get("fp8jax-delayed"), floor),
    )


def floor_table(results: list[dict]) -> str:
    """Markdown table of `floor_shape` results."""

    def f(v, spec=".3f", suffix=""):
        return common.fmt(v, spec, suffix)

    lines = [
        "| M x K x N | bf16 ms | fp8jax ms | flax ms | FP8 GEMMs ms (fwd + dgrad + wgrad) "
        "| casts ms (x + w + g) | floor ms | fp8jax vs bf16 | best possible vs bf16 "
        "| best possible vs flax | fp8jax / floor |",
        "|" + "---|" * 11,
    ]
    for r in results:
        s, g, c = r["steps"], r["gemms"], r["casts"]
        lines.append(
            f"| {' x '.join(map(str, r['shape']))} | {f(s.get('bf16'))} | "
            f"{f(s.get('fp8jax-delayed'))} | {f(s.get('flax-direct'))} | "
            f"{g['fwd']:.3f} + {g['dgrad']:.3f} + {g['wgrad']:.3f} | "
            f"{c['x']:.3f} + {c['w']:.3f} + {c['g']:.3f} ({r['cast_path']}) | {r['floor']:.3f} | "
            f"{f(r['fp8jax_vs_bf16'], '.2f', 'x')} | {f(r['max_vs_bf16'], '.2f', 'x')} | "
            f"{f(r['max_vs_flax'], '.2f', 'x')} | {f(r['fp8jax_over_floor'], '.2f', 'x')} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- stack memory
class Stack(eqx.Module):
    """``layers`` chained ``K -> K`` linears (no bias, no nonlinearity: every residual
    is a layer input, the thing FP8 stores in 1 byte instead of 2)."""

    layers: list

    def __init__(self, dim: int, depth: int, *, key):
        self.layers = [
            eqx.nn.Linear(dim, dim, use_bias=False, dtype=BF16, key=k)
            for k in jax.random.split(key, depth)
        ]

    def __call__(self, x):
        for layer in self.layers:
            x = linear._apply(layer, x)
        return x


def stack_memory(m: int, k: int, depth: int) -> list[dict]:
    """bf16 vs fp8jax-delayed peak memory and saved residuals of a ``depth``-layer step."""
    stack = Stack(k, depth, key=jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (m, k), BF16)
    g = jax.random.normal(jax.random.PRNGKey(2), (m, k), BF16)
    out = []
    for name, model in (
        ("bf16", stack),
        ("fp8jax-delayed", fp8jax.fp8_linear_layers(stack, fp8jax.Fp8Config(selective=False))),
    ):
        step = common.train_step(model, linear._apply)
        out.append(
            dict(
                variant=name,
                peak_mem_mb=common.peak_mem_mb(step, x, g),
                saved_act_mb=fp8jax.saved_activation_bytes(model, x, dim=m) / 2**20,
            )
        )
    return out


def stack_table(m: int, k: int, depth: int, rows: list[dict]) -> str:
    lines = [
        "| layers x (M x K -> K) | variant | peak MiB | saved activations MiB |",
        "|---|---|---|---|",
    ]
    for r in rows:
        peak = "-" if r["peak_mem_mb"] is None else f"{r['peak_mem_mb']:.0f}"
        lines.append(
            f"| {depth} x ({m} x {k} -> {k}) | {r['variant']} | {peak} | {r['saved_act_mb']:.1f} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI
def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.linear_bounds", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--shapes",
        nargs="+",
        type=linear.parse_shape,
        default=linear.ANCHOR_SHAPES[:3],
        metavar="M,K,N",
    )
    p.add_argument(
        "--stack",
        type=int,
        default=0,
        help="depth of the stack for the memory part (0: floor only)",
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--quick", action="store_true", help="tiny shapes, 2 iters, both parts (CPU smoke run)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.shapes, args.iters, args.reps, args.stack = linear.QUICK_SHAPES[:1], 2, 2, 3
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    results = []
    if not args.stack or args.quick:
        for shape in args.shapes:
            results.append(floor_shape(shape, args.iters, args.reps, fp8jax.Fp8Config()))
            print(floor_table(results[-1:]), flush=True)
        print("\nfloor (all shapes):\n" + floor_table(results), flush=True)
    stacks = []
    if args.stack:
        for m, k, _ in args.shapes:
            rows = stack_memory(m, k, args.stack)
            stacks.append(rows)
            print(stack_table(m, k, args.stack, rows), flush=True)
    return results, stacks


if __name__ == "__main__":
    main()
