"""Where the trainer's step time goes: GPU kernel time per category, bf16 vs FP8 variants.

Builds the model of a `fp8jax-train` preset, times ``--steps`` train steps (tokens/s),
then records ``--profile-steps`` more under ``jax.profiler`` and sums the device time of
every kernel by what it runs, from the compiled HLO instruction the kernel belongs to:
FP8 GEMMs, other GEMMs, attention (cuDNN), Pallas kernels, elementwise fusions,
reductions, copies/transposes, and the rest.

    python -m benchmarks.profile_train --preset 1b --variants bf16 fp8 fp8:selective=0
    python -m benchmarks.profile_train --quick        # CPU smoke run (no device kernels)

A variant is ``bf16`` or ``fp8`` with ``:key=value`` overrides of the trainer's
`RunConfig` or `ModelConfig` (``selective=0``, ``fp8_attention=1``, ``scan_unroll=16``, ...).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import tempfile
import time

import jax
import numpy as np

from benchmarks import comm_profile
from fp8jax import _jax_compat
from fp8jax.train import _cli as cli
from fp8jax.train._memory import saved_cell

TOP_OPS = 30
CATEGORIES = (
    "gemm-fp8",
    "gemm",
    "attention",
    "pallas",
    "elementwise",
    "reduction",
    "copy/transpose",
    "other",
)


def parse_variant(text: str) -> tuple[str, dict]:
    """``"fp8:selective=0:scan_unroll=16"`` -> ``("fp8", {"selective": False, "scan_unroll": 16})``:
    fields of the trainer's `RunConfig` or of its `ModelConfig`."""
    precision, *items = text.split(":")
    if precision not in ("bf16", "fp8"):
        raise argparse.ArgumentTypeError(f"variant must start with bf16 or fp8, got {text!r}")
    kinds = {
        f.name: str(f.type)
        for config in (cli.RunConfig, cli.ModelConfig)
        for f in dataclasses.fields(config)
    }
    convert = {"bool": lambda v: v.lower() in ("1", "true", "yes"), "int": int, "float": float}
    overrides = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in kinds or key == "model":
            raise argparse.ArgumentTypeError(
                f"unknown RunConfig field {key!r} in {text!r} (nor a ModelConfig one)"
            )
        overrides[key] = convert.get(kinds[key], str)(value)
    return precision, overrides


def apply_overrides(run: cli.RunConfig, overrides: dict) -> cli.RunConfig:
    """``run`` with `parse_variant`'s overrides, each on the config that has the field."""
    model_fields = {f.name for f in dataclasses.fields(cli.ModelConfig)}
    model = {k: v for k, v in overrides.items() if k in model_fields}
    rest = {k: v for k, v in overrides.items() if k not in model_fields}
    return dataclasses.replace(run, model=dataclasses.replace(run.model, **model), **rest)


def _instructions(hlo_text: str) -> dict[str, str]:
    """Instruction name -> its HLO line (every computation of the module)."""
    out = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
        if m:
            out[m.group(1)] = line
    return out


def _summary(line: str) -> str:
    """Shape and op of an HLO line, without operand lists (for the top-ops printout)."""
    m = re.search(r"=\s*(.*?)\s([\w\-]+)\(", line)
    extra = re.search(r'(kind=\w+|custom_call_target="[^"]+")', line)
    return f"{m.group(1)} {m.group(2)} {extra.group(1) if extra else ''}" if m else ""


def categorize(line: str | None, kernel: str) -> str:
    """The category of a kernel from its HLO instruction, else from its name (jax 0.11's
    command buffers tag every kernel with the buffer, not its instruction)."""
    text = line or ""
    if "custom-call" in text or "custom_call_target" in text:
        target = (re.search(r'custom_call_target="([^"]+)"', text) or re.search("()", "")).group(1)
        if "cublas" in target:
            return "gemm-fp8" if "f8" in target else "gemm"
        if "cudnn" in target and ("fmha" in target or "attention" in target.lower()):
            return "attention"
        if "triton" in target or "mosaic" in target:
            return "pallas"
        return "other"
    if text:
        if "kind=kCustom" in text and "gemm" in text:
            return "gemm"
        if re.search(r"\s(copy|transpose)\(", text) or "transpose" in kernel:
            return "copy/transpose"
        if "kind=kInput" in text or "reduce" in kernel:
            return "reduction"
        if "fusion" in text:
            return "elementwise"
    return _category_from_name(kernel)


def _category_from_name(kernel: str) -> str:
    """A kernel's category from its name alone (names as H100 traces show them)."""
    name = kernel.lower()
    # cuBLASLt: "nvjet_sm90_qqtst_..." (q: an FP8 operand), "sm90_xmma_gemm_e4m3..."
    if re.match(r"nvjet_sm\d+_[a-z]*q[a-z]*_", name) or (
        "gemm" in name and any(t in name for t in ("e4m3", "e5m2", "f8"))
    ):
        return "gemm-fp8"
    if "nvjet" in name or "gemm" in name or "xmma" in name:
        return "gemm"
    if "sdpa" in name or "fmha" in name or "flash" in name or "cudnn" in name:
        return "attention"
    # Pallas: Mosaic GPU ("body_mosaic_gpu_kernel") and Triton ("_kernel", "_bwd_kernel__3")
    if "mosaic_gpu" in name or re.fullmatch(r"_\w*kernel(__\d+)?", name):
        return "pallas"
    if "transpose" in name or name.startswith(("memcpy", "copy")):
        return "copy/transpose"
    if name.startswith("input_") or "reduce" in name:
        return "reduction"
    if "fusion" in name:
        return "elementwise"
    return "other"


def device_kernel_ns(trace_dir: str) -> list[tuple[str, str, float]]:
    """``(kernel name, hlo op, ns)`` of every device kernel in the trace under ``trace_dir``."""
    out = []
    for _, event in comm_profile.gpu_stream_events(trace_dir):
        stats = dict(s if isinstance(s, tuple) else (s.name, s.value) for s in event.stats)
        out.append((event.name, str(stats.get("hlo_op", "")), float(event.duration_ns)))
    return out


def kernel_ms(
    kernels, lines: dict[str, str], steps: int
) -> tuple[collections.Counter, collections.Counter]:
    """Device ms per step by category and by ``(category, hlo op)``, from `device_kernel_ns`'s
    kernels of ``steps`` steps and the compiled program's `_instructions`."""
    by_cat, by_op = collections.Counter(), collections.Counter()
    for name, op, ns in kernels:
        cat = categorize(lines.get(op), name)
        by_cat[cat] += ns / steps / 1e6
        by_op[(cat, op or name[:60])] += ns / steps / 1e6
    return by_cat, by_op


def profile_variant(
    run: cli.RunConfig,
    precision: str,
    steps: int,
    profile_steps: int,
    dump_hlo: str | None = None,
    top: int = TOP_OPS,
) -> dict:
    """tokens/s and joules per step over ``steps`` steps, and device ms per step per category
    and per group of like ops (one per layer when the scan is unrolled); the compiled step's
    HLO text is written to ``dump_hlo`` and its kernels' times next to it when given."""
    model = cli.build_model(run, precision)
    trainer = cli.Trainer(model, cli.make_optimizer(run))
    rng = np.random.default_rng(0)
    batch = jax.numpy.asarray(rng.integers(0, 256, (run.batch, run.model.seq + 1), dtype=np.int32))
    trainer.compile(batch)
    t0 = time.perf_counter()
    jax.block_until_ready(trainer.step(batch))  # the first run loads the kernels
    compile_times = dict(trainer.compile_times, first_run_s=time.perf_counter() - t0)
    jax.block_until_ready(trainer.step(batch))
    energy = cli.energy_counter()
    e0 = energy() if energy else None
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = trainer.step(batch)
    jax.block_until_ready(loss)
    step_s = (time.perf_counter() - t0) / steps
    joules = (energy() - e0) / 1e3 / steps if energy else None
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(profile_steps):
                loss = trainer.step(batch)
            jax.block_until_ready(loss)
        kernels = device_kernel_ns(trace_dir)
    if kernels and not any(op for _, op, _ in kernels):
        print(
            f"  (no hlo_op stat on the kernels; categories from kernel names, e.g. {kernels[:3]})",
            flush=True,
        )
    hlo_text = trainer.compiled.as_text()
    lines = _instructions(hlo_text)
    by_cat, by_op = kernel_ms(kernels, lines, profile_steps)
    op_text = {op: _summary(lines.get(op, "")) for (_, op) in by_op}
    groups = collections.defaultdict(lambda: [0, 0.0])
    for (cat, op), ms in by_op.items():
        group = groups[(cat, op_text[op] or op)]
        group[0] += 1
        group[1] += ms
    if dump_hlo:
        with open(dump_hlo + ".hlo.txt", "w") as f:
            f.write(hlo_text)
        with open(dump_hlo + ".ops.tsv", "w") as f:
            for (cat, op), ms in by_op.most_common():
                f.write(f"{ms:.4f}\t{cat}\t{op}\t{op_text[op]}\n")
    return dict(
        step_ms=step_s * 1e3,
        tokens_per_s=run.batch * run.model.seq / step_s,
        joules_per_step=joules,
        **compile_times,
        by_cat=by_cat,
        top_groups=sorted(groups.items(), key=lambda kv: -kv[1][1])[:top],
        peak_mem_mb=trainer.peak_mem_mb(),
        **trainer.residuals,  # saved_residual_mb, saved_residuals: traced at compile
    )


def table(results: dict[str, dict]) -> str:
    names = list(results)
    base = results[names[0]]["tokens_per_s"]
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines.append(
        "| step ms (wall) | " + " | ".join(f"{r['step_ms']:.1f}" for r in results.values()) + " |"
    )
    lines.append(
        "| tokens/s | "
        + " | ".join(
            f"{r['tokens_per_s']:,.0f} ({r['tokens_per_s'] / base:.2f}x)" for r in results.values()
        )
        + " |"
    )
    for cat in CATEGORIES:
        lines.append(
            f"| {cat} ms | "
            + " | ".join(f"{r['by_cat'].get(cat, 0.0):.1f}" for r in results.values())
            + " |"
        )
    lines.append(
        "| saved MiB | "
        + " | ".join(
            saved_cell(r["saved_residual_mb"], r["saved_residuals"]) for r in results.values()
        )
        + " |"
    )
    lines.append(
        "| device total ms | "
        + " | ".join(f"{sum(r['by_cat'].values()):.1f}" for r in results.values())
        + " |"
    )
    if all(r["joules_per_step"] for r in results.values()):
        lines.append(
            "| J/step | "
            + " | ".join(f"{r['joules_per_step']:.1f}" for r in results.values())
            + " |"
        )
    return "\n".join(lines)


COMMAND_BUFFERS_OFF = "--xla_gpu_enable_command_buffer="


def command_buffers_off() -> None:
    """Add `COMMAND_BUFFERS_OFF` to ``XLA_FLAGS``; refused once JAX's backend has started
    (the flag would silently not apply)."""
    if _jax_compat.backend_started():
        raise SystemExit("--op-names: JAX's backend already started; its flags are fixed")
    flags = os.environ.get("XLA_FLAGS", "")
    if COMMAND_BUFFERS_OFF not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {COMMAND_BUFFERS_OFF}".strip()


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.profile_train", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--preset", default="1b", choices=sorted(cli.PRESETS))
    p.add_argument("--variants", nargs="+", type=parse_variant, default=[("bf16", {}), ("fp8", {})])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument(
        "--top", type=int, default=TOP_OPS, help="how many of the costliest op groups to list"
    )
    p.add_argument(
        "--dump-hlo",
        default=None,
        help="directory for each variant's compiled HLO text and kernel times",
    )
    p.add_argument(
        "--op-names",
        action="store_true",
        help="GPU: XLA's command buffers off, so each kernel is named by its HLO op (with them "
        "a whole step is one 'command_buffer'); the steps then run without them as well",
    )
    p.add_argument("--quick", action="store_true", help="tiny preset, 2 steps (CPU smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.steps, args.profile_steps = "tiny", 2, 1
    if args.op_names:
        command_buffers_off()
    print(
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}, preset {args.preset}", flush=True
    )
    results = {}
    for precision, overrides in args.variants:
        preset = dict(cli.PRESETS[args.preset])
        run = cli.RunConfig(**preset)
        run = apply_overrides(run, dict(overrides, **({"batch": args.batch} if args.batch else {})))
        name = precision + "".join(f":{k}={v}" for k, v in overrides.items())
        dump = None
        if args.dump_hlo:
            os.makedirs(args.dump_hlo, exist_ok=True)
            dump = os.path.join(args.dump_hlo, re.sub(r"[^\w.-]+", "_", name))
        results[name] = profile_variant(
            run, precision, args.steps, args.profile_steps, dump, args.top
        )
        r = results[name]
        energy = f", {r['joules_per_step']:.1f} J/step" if r["joules_per_step"] else ""
        print(
            f"{name}: {r['step_ms']:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s{energy}, "
            f"peak {r['peak_mem_mb'] or 0:.0f} MiB, saved residuals "
            f"{saved_cell(r['saved_residual_mb'], r['saved_residuals'])} MiB; "
            f"lower {r['lower_s']:.1f} s, "
            f"compile {r['compile_s']:.1f} s, "
            f"first run {r['first_run_s']:.1f} s",
            flush=True,
        )
        for (cat, text), (count, ms) in r["top_groups"]:
            print(f"    {ms:8.2f} ms  x{count:<3} {cat:<14} {text[:150]}", flush=True)
    print(table(results), flush=True)
    return results


if __name__ == "__main__":
    main()
