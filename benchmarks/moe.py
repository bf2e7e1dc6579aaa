"""Benchmark: grouped (MoE expert) GEMMs and the expert MLP's training step.

Three benches, each timed in one process per case:

* ``grouped_gemm`` -- one forward grouped GEMM ``y[r] = x[r] . W[e(r)]`` on the
  ANCHORS table-3 probe (M=16384 rows, K=4096, N=7168): ``loop-bf16`` (a Python loop
  of G dots on static slices), ``ragged-dot-bf16`` (``jax.lax.ragged_dot``),
  ``fp8jax-bf16`` and ``fp8jax-fp8`` (fp8jax's Pallas kernel on pre-cast operands,
  as the anchors time it).
* ``moe_mlp`` -- forward+backward of every expert's MLP (fc1 -> swiglu -> fc2) on
  the routed rows ``x_sorted [tokens * top_k, hidden]`` of a Mixtral-like layer
  (tokens 16384, hidden 4096, ffn 14336, top-2): ``sequential-bf16`` (a loop over
  experts on static slices), ``ragged-dot-bf16``, ``fp8jax-bf16``
  (``GroupedMLP(fp8=False)``) and ``fp8jax-fp8`` (``GroupedMLP``, delayed scaling,
  calibrated). Includes fp8jax's padding to the kernel layout and back.

``routing``: ``equal`` (every expert gets ``rows / G``) or ``random`` (uneven sizes
from a random top-k routing of normal logits).

``--bench moe`` (not in ``both``) times the whole `fp8jax.nn.MoE` layer's train step
(router, dispatch, experts, combine; forward+backward) with its experts sharded ``--ep``
ways over as many devices (expert parallelism, ``dispatch="all_to_all"``: the tokens split
over the devices, each row sent to its experts' device and back): ``bf16`` (bf16 experts,
bf16 dispatch), ``fp8-bf16-dispatch`` (FP8 experts, bf16 dispatch), ``fp8`` (FP8 experts,
FP8 dispatch: e4m3 rows cast with the experts' own per-tensor scale); ``fp8-replicated`` on
request (the rows replicated over the devices, outputs summed: no all-to-all). Tokens
``--tokens`` per device, capacity factor ``--capacity-factor`` (0: dropless). Its records
carry ``ep`` and ``dispatch`` in ``params``, ``speedup_vs_bf16``, the all-to-alls' dtypes,
whether the grouped Pallas kernels ran (``grouped_kernel``) and the assignments the capacity
dropped.

    python -m benchmarks.moe --bench moe --ep 4     # 4 GPUs

    python -m benchmarks.moe                    # both benches, default cases
    python -m benchmarks.moe --bench moe_mlp --experts 8 64
    python -m benchmarks.moe --quick            # CPU smoke run, writes nothing

Records (GPU, not ``--quick``) go to ``benchmarks/results/{grouped_gemm,moe_mlp,moe}.jsonl``.
"""

from __future__ import annotations

import argparse
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from benchmarks import common
from fp8jax import Fp8Config
from fp8jax._ops import grouped as gr
from fp8jax.distributed import hlo_collectives
from fp8jax.nn import GroupedMLP, MoE, make_layout

BF16 = jnp.bfloat16
COMMAND_PREFIX = "python -m benchmarks.moe"
GEMM_VARIANTS = ("loop-bf16", "ragged-dot-bf16", "fp8jax-bf16", "fp8jax-fp8")
MLP_VARIANTS = (
    "sequential-bf16",
    "ragged-dot-bf16",
    "fp8jax-bf16",
    "fp8jax-fp8",
    "fp8jax-blockwise",
)
GEMM_FIELDS = (*common.META_FIELDS, "ms", "tflops", "speedup_vs_bf16", "fp8_gemms")
MLP_FIELDS = (
    *common.META_FIELDS,
    "ms",
    "tflops",
    "speedup_vs_bf16",
    "speedup_vs_sequential_bf16",
    "fp8_gemms",
    "peak_mem_mb",
)


# variant -> (FP8 experts, dispatch, dispatch_dtype) of the MoE layer bench
MOE_VARIANTS = {
    "bf16": (False, "all_to_all", "bf16"),
    "fp8-bf16-dispatch": (True, "all_to_all", "bf16"),
    "fp8": (True, "all_to_all", "fp8"),
    "fp8-replicated": (True, "replicated", "auto"),
}
MOE_DEFAULT_VARIANTS = ("bf16", "fp8-bf16-dispatch", "fp8")
MOE_FIELDS = (
    *common.META_FIELDS,
    "ms",
    "tflops",
    "speedup_vs_bf16",
    "a2a_dtypes",
    "grouped_kernel",
    "dropped_fraction",
    "peak_mem_mb",
)


def group_sizes(rows: int, experts: int, routing: str, top_k: int = 2, seed: int = 0) -> np.ndarray:
    """Per-expert row counts summing to ``rows``: equal, or from a random top-k routing."""
    if routing == "equal":
        sizes = np.full(experts, rows // experts)
        sizes[: rows - sizes.sum()] += 1
        return sizes
    tokens = rows // top_k
    logits = np.random.default_rng(seed).normal(size=(tokens, experts))
    top = np.argsort(-logits, axis=1)[:, :top_k].reshape(-1)
    sizes = np.bincount(top, minlength=experts)
    sizes[np.argmax(sizes)] += rows - sizes.sum()
    return sizes


def _starts(sizes):
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)


# ----------------------------------------------------------------------------- grouped_gemm
def _gemm_step(variant: str, x, w_kn, sizes) -> tuple[common.Step, tuple]:
    """A `benchmarks.common.Step` running one forward grouped GEMM, and its inputs."""
    g = w_kn.shape[0]
    gs = jnp.asarray(sizes, jnp.int32)
    if variant == "loop-bf16":

        def fn(w, x, _):
            return jnp.concatenate(
                [x[s : s + n] @ w[e] for e, (s, n) in enumerate(zip(_starts(sizes), sizes))]
            )

        return common.Step(fn, w_kn), (x,)
    if variant == "ragged-dot-bf16":
        return common.Step(lambda w, x, _: jax.lax.ragged_dot(x, w, gs), w_kn), (x,)
    layout = make_layout(gs, x.shape[0])
    x_pad = gr.pad_rows(x, layout)
    w_nk = jnp.swapaxes(w_kn, 1, 2)
    scales = jnp.ones((g,), jnp.float32)
    if variant == "fp8jax-fp8":
        x_pad, w_nk = x_pad.astype(jnp.float8_e4m3fn), w_nk.astype(jnp.float8_e4m3fn)
    elif variant != "fp8jax-bf16":
        raise ValueError(f"unknown variant {variant!r}; choose from {GEMM_VARIANTS}")
    backend = gr.resolve_backend("auto", layout, x.shape[1], w_kn.shape[2], x_pad.dtype)

    def fn(w, x, _):
        return gr.rows_gemm(backend, x, w, layout, scales, BF16)

    return common.Step(fn, w_nk), (x_pad,)


def run_gemm_case(case, variants, iters, reps, meta) -> list[dict]:
    experts, m, k, n, routing = case
    sizes = group_sizes(m, experts, routing)
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (m, k), BF16)
    w = jax.random.normal(kw, (experts, k, n), BF16) * 0.02
    rows = []
    for name in variants:
        row = dict(
            meta,
            bench="grouped_gemm",
            params=dict(experts=experts, M=m, K=k, N=n, routing=routing),
            variant=name,
        )
        try:
            step, (xin,) = _gemm_step(name, x, w, sizes)
            it = max(2, iters // 10) if name == "ragged-dot-bf16" else iters
            row["ms"] = common.time_step(step, [xin], None, it, reps, warmup=1)
            n_fp8, _ = common.gemm_check(step, xin, None)
            row["fp8_gemms"] = n_fp8 > 0
        except Exception as e:  # report and go on
            row.update(ms=None, error=common.error_text(e))
        rows.append(row)
    common.add_ratios(rows, 2.0 * m * k * n, {"speedup_vs_bf16": "loop-bf16"})
    return rows


# ----------------------------------------------------------------------------- moe_mlp
def _swiglu(h):
    gate, up = jnp.split(h, 2, axis=-1)
    return jax.nn.silu(gate) * up


def _mlp_step(variant: str, mlp: GroupedMLP, x, dy, sizes) -> common.Step:
    gs = jnp.asarray(sizes, jnp.int32)
    if variant == "sequential-bf16":

        def apply(p, x):
            outs = []
            for e, (s, n) in enumerate(zip(_starts(sizes), sizes)):
                outs.append(_swiglu(x[s : s + n] @ p[0][e]) @ p[1][e])
            return jnp.concatenate(outs)
    elif variant == "ragged-dot-bf16":

        def apply(p, x):
            return jax.lax.ragged_dot(_swiglu(jax.lax.ragged_dot(x, p[0], gs)), p[1], gs)
    else:
        step = common.train_step(mlp, lambda m, x: m(x, gs))
        return common.calibrate(step, mlp, x, dy) if variant == "fp8jax-fp8" else step
        # fp8jax-blockwise: current scaling per tile, nothing to calibrate
    weights = (mlp.fc1.weight, mlp.fc2.weight)
    return common.Step(
        jax.value_and_grad(
            lambda p, x, dy: common.projection_loss(apply(p, x), dy), argnums=(0, 1)
        ),
        weights,
    )


def run_mlp_case(case, variants, iters, reps, meta) -> list[dict]:
    experts, tokens, hidden, ffn, top_k, routing = case
    rows_n = tokens * top_k
    sizes = group_sizes(rows_n, experts, routing, top_k)
    kx, kd, km = jax.random.split(jax.random.PRNGKey(0), 3)
    xs = jax.block_until_ready(
        [jax.random.normal(k, (rows_n, hidden), BF16) for k in jax.random.split(kx, 2)]
    )
    dy = jax.random.normal(kd, (rows_n, hidden), BF16)
    flops = 6.0 * rows_n * (hidden * 2 * ffn + ffn * hidden)
    out = []
    for name in variants:
        row = dict(
            meta,
            bench="moe_mlp",
            variant=name,
            params=dict(
                experts=experts, tokens=tokens, hidden=hidden, ffn=ffn, top_k=top_k, routing=routing
            ),
        )
        try:
            mlp = GroupedMLP(
                experts,
                hidden,
                ffn,
                key=km,
                activation="swiglu",
                fp8=name in ("fp8jax-fp8", "fp8jax-blockwise"),
                config=Fp8Config(recipe="blockwise") if name == "fp8jax-blockwise" else None,
                dtype=BF16,
            )
            step = _mlp_step(name, mlp, xs[0], dy, sizes)
            slow = name == "ragged-dot-bf16"  # 6-60x slower (ANCHORS): one timed step is enough
            row["ms"] = common.time_step(
                step, xs, dy, 1 if slow else iters, 1 if slow else reps, warmup=1
            )
            n_fp8, _ = common.gemm_check(step, xs[0], dy)
            row.update(fp8_gemms=n_fp8 >= 6, peak_mem_mb=common.peak_mem_mb(step, xs[0], dy))
        except Exception as e:  # report and go on
            row.update(ms=None, error=common.error_text(e))
        finally:  # free this variant's weights (22.5 GB at 64 experts) before the next one
            step = mlp = None
        out.append(row)
    common.add_ratios(
        out,
        flops,
        {"speedup_vs_sequential_bf16": "sequential-bf16", "speedup_vs_bf16": "fp8jax-bf16"},
    )
    return out


# ----------------------------------------------------------------------------- moe
def _a2a_dtypes(step: common.Step, x, dy) -> str:
    """The dtypes the step's all-to-alls move, with counts (``bf16:3,f8e4m3fn:1,...``), from
    the partitioned program (`fp8jax.distributed.hlo_collectives`: before a backend's own
    rewrites, which on CPU carry bf16 as f32 and FP8 as f16). One more compile."""
    cs = hlo_collectives(jax.jit(step.fn).lower(step.params, x, dy))
    kinds = [d for c in cs if c.kind == "all-to-all" for d in sorted(set(c.dtype.split(",")))]
    return ",".join(f"{d}:{kinds.count(d)}" for d in sorted(set(kinds)))


@eqx.filter_jit
def _routing(model, x):
    return model(x)[1]


def run_moe_case(case, variants, iters, reps, meta) -> list[dict]:
    experts, tokens, hidden, ffn, top_k, ep, capacity = case
    mesh = Mesh(np.array(jax.devices()[:ep]), ("expert",))
    rows_spec = NamedSharding(mesh, P("expert"))
    total = tokens * ep
    kx, kd, km = jax.random.split(jax.random.PRNGKey(0), 3)
    xs = [jax.random.normal(k, (total, hidden), BF16) for k in jax.random.split(kx, 2)]
    xs = jax.block_until_ready([jax.device_put(x, rows_spec) for x in xs])
    dy = jax.device_put(jax.random.normal(kd, (total, hidden), BF16), rows_spec)
    flops = 6.0 * total * top_k * (hidden * 2 * ffn + ffn * hidden)
    out = []
    for name in variants:
        fp8, dispatch, dispatch_dtype = MOE_VARIANTS[name]
        params = dict(
            experts=experts, tokens=total, hidden=hidden, ffn=ffn, top_k=top_k, ep=ep,
            capacity_factor=capacity or None, dispatch=f"{dispatch}-{dispatch_dtype}",
        )  # fmt: skip
        row = dict(meta, bench="moe", variant=name, params=params)
        step = model = None
        try:
            model = MoE(
                hidden, ffn, experts, key=km, top_k=top_k, fp8=fp8, dtype=BF16,
                capacity_factor=capacity or None, dispatch=dispatch,
                dispatch_dtype=dispatch_dtype,
            )  # fmt: skip
            model = fp8jax.shard_model(model, mesh, fsdp_axis=None, expert_axis="expert")
            step = common.train_step(model, lambda m, x: m(x)[0])
            if fp8:  # delayed scaling: calibrated state, placed as the compiled step takes it
                placed = step.params
                step = common.calibrate(step, model, xs[0], dy)
                step.params = jax.tree.map(
                    lambda a, b: jax.device_put(a, b.sharding), step.params, placed
                )
            row["ms"] = common.time_step(step, xs, dy, iters, reps, warmup=1)
            row.update(
                a2a_dtypes=_a2a_dtypes(step, xs[0], dy),
                grouped_kernel=gr.GROUPED_SCOPE in step.hlo_text(xs[0], dy),  # Pallas ran
                dropped_fraction=float(_routing(model, xs[0]).dropped_fraction),
                peak_mem_mb=common.peak_mem_mb(step, xs[0], dy),
            )
        except Exception as e:  # report and go on
            row.update(ms=None, error=common.error_text(e))
        finally:
            step = model = None
        out.append(row)
    common.add_ratios(out, flops, {"speedup_vs_bf16": "bf16"})
    return out


def table(rows) -> str:
    columns = [
        ("ms", lambda r: f"{r['ms']:.3f}"),
        ("TFLOP/s", lambda r: common.fmt(r["tflops"], ".0f")),
        ("vs bf16", lambda r: common.fmt(r.get("speedup_vs_bf16"), ".2f", "x")),
        ("vs sequential", lambda r: common.fmt(r.get("speedup_vs_sequential_bf16"), ".2f", "x")),
        ("FP8", lambda r: f"{r.get('fp8_gemms')}"),
    ]
    return "\n".join(common.markdown_rows(rows, "bench | case", _case, columns, error_chars=100))


def moe_table(rows) -> str:
    columns = [
        ("ms", lambda r: f"{r['ms']:.3f}"),
        ("TFLOP/s", lambda r: common.fmt(r["tflops"], ".0f")),
        ("vs bf16", lambda r: common.fmt(r.get("speedup_vs_bf16"), ".2f", "x")),
        ("all-to-alls", lambda r: r.get("a2a_dtypes") or "-"),
        ("kernel", lambda r: f"{r.get('grouped_kernel')}"),
        ("dropped", lambda r: common.fmt(r.get("dropped_fraction"), ".3f")),
    ]
    return "\n".join(common.markdown_rows(rows, "bench | case", _case, columns, error_chars=100))


def _case(r) -> str:
    return f"{r['bench']} | " + ", ".join(f"{k}={v}" for k, v in r["params"].items())


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog=COMMAND_PREFIX, description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", choices=("grouped_gemm", "moe_mlp", "both", "moe"), default="both")
    p.add_argument("--ep", type=int, help="moe: expert-parallel devices (default 4)")
    p.add_argument("--tokens", type=int, help="moe: tokens per device")
    p.add_argument(
        "--capacity-factor", type=float, default=1.25, help="moe: capacity factor (0: dropless)"
    )
    p.add_argument("--experts", type=int, nargs="+")
    p.add_argument("--routing", nargs="+", default=["equal", "random"], choices=("equal", "random"))
    p.add_argument("--variants", type=lambda s: [v for v in s.split(",") if v])
    p.add_argument(
        "--quick", action="store_true", help="tiny CPU-sized cases, 2 iters; writes no records"
    )
    p.add_argument("--iters", type=int)
    p.add_argument("--reps", type=int)
    args = p.parse_args(argv)
    iters, reps = args.iters or (2 if args.quick else 10), args.reps or (1 if args.quick else 3)
    meta = common.run_meta(argv, bench="moe", prefix=COMMAND_PREFIX)
    rows = []
    if args.bench in ("grouped_gemm", "both"):
        experts = args.experts or ([2, 4] if args.quick else [8, 64])
        shape = (256, 64, 128) if args.quick else (16384, 4096, 7168)
        cases = [(e, *shape, r) for r in args.routing for e in experts]
        rows += common.run_cases(
            cases,
            lambda c: run_gemm_case(c, args.variants or GEMM_VARIANTS, iters, reps, meta),
            table,
            common.results_path("grouped_gemm"),
            GEMM_FIELDS,
            record=not args.quick,
        )
    if args.bench in ("moe_mlp", "both"):
        experts = args.experts or ([2, 4] if args.quick else [2, 4, 8, 16, 32, 64])
        dims = (64, 32, 64, 2) if args.quick else (16384, 4096, 14336, 2)
        cases = [(e, *dims, r) for r in args.routing for e in experts]
        rows += common.run_cases(
            cases,
            lambda c: run_mlp_case(c, args.variants or MLP_VARIANTS, iters, reps, meta),
            table,
            common.results_path("moe_mlp"),
            MLP_FIELDS,
            record=not args.quick,
        )
    if args.bench == "moe":
        experts = args.experts or [8]
        ep = args.ep or 4
        dims = (
            (args.tokens or 64, 64, 32, 2) if args.quick else (args.tokens or 8192, 4096, 14336, 2)
        )
        cases = [(e, *dims, ep, args.capacity_factor) for e in experts]
        rows += common.run_cases(
            cases,
            lambda c: run_moe_case(c, args.variants or MOE_DEFAULT_VARIANTS, iters, reps, meta),
            moe_table,
            common.results_path("moe"),
            MOE_FIELDS,
            record=not args.quick,
        )
    return rows


if __name__ == "__main__":
    main()
