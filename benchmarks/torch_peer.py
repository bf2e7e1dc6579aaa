"""torchao float8 training (PyTorch) on the train steps of `benchmarks.linear` and
`benchmarks.mlp`, as extra variants of those harnesses: ``torchao-bf16`` (torch alone),
``torchao-tensorwise`` and ``torchao-rowwise`` (``torchao.float8`` recipes).

The steps are the JAX harnesses' (`benchmarks.common.train_step`): the loss
``sum(y.f32 * G)`` with a fixed random bf16 ``G`` and its gradients w.r.t. the
parameters and the input, i.e. forward + dgrad + wgrad per linear.

* linear: ``nn.Linear(K, N, bias=False)`` in bf16 on ``x: [M, K]``;
* mlp: RMSNorm (statistics in f32) -> fc1 (``hidden -> 2 ffn`` for a gated activation,
  first half activated and gating the second) -> fc2, no biases, as `fp8jax.nn.FusedMLP`.

Each variant is ``torch.compile``'d (``dynamic=False``, dynamo reset before each one), run
once (``compile_s``), then timed as `benchmarks.common.time_step` times JAX: warm-up calls,
then ``reps`` times the mean of ``iters`` calls rotating among three inputs, synchronised
at the end, the median kept. ``peak_mem_mb`` is ``torch.cuda.max_memory_allocated`` over
one step minus the two rotation inputs that step does not read (so it counts what the
JAX analysis counts: parameters, input, ``G``, gradients and temporaries); the GEMM counts
come from the profiler's ``aten::_scaled_mm`` / ``aten::mm`` calls of one step.

Two halves in one module:

* the **worker**, ``python -m benchmarks.torch_peer --bench linear --cases 8192,8192,8192``:
  imports torch (never jax) and prints one JSON line per (case, variant);
* the **launcher**, `run_peer`, called by the JAX harnesses: runs the worker in a child
  process and turns its lines into rows. Without torch (or torchao) the worker prints a
  skip line, and the launcher one sentence; the JAX variants run as usual.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("torchao-bf16", "torchao-tensorwise", "torchao-rowwise")
BASE = "torchao-bf16"  # the torch rows' speedup_vs_bf16 is against torch's own bf16
RECORD_EXTRA = ("torch", "torchao")  # versions, in the torch rows' records only
SITE_ENV = "FP8JAX_TORCH_SITE"
ROOT = Path(__file__).resolve().parents[1]
GATED = {"swiglu": "silu", "geglu": "gelu", "reglu": "relu", "qgeglu": "qgelu", "sreglu": "srelu"}
FP8_GEMM = "aten::_scaled_mm"
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", FP8_GEMM)


# ----------------------------------------------------------------------------- launcher
def add_cli(parser: argparse.ArgumentParser) -> None:
    """The ``--torch-site`` option of the harnesses that run these variants."""
    parser.add_argument(
        "--torch-site",
        default=os.environ.get(SITE_ENV),
        metavar="DIR",
        help=f"directory put first on the torch child process's PYTHONPATH (where torchao "
        f"was pip-installed with --target; default ${SITE_ENV})",
    )


def split_variants(variants) -> tuple[list[str], list[str]]:
    """``variants`` as (the JAX harness's own, the ones this module runs)."""
    return [v for v in variants if v not in VARIANTS], [v for v in variants if v in VARIANTS]


def _child_env(site: str | None) -> dict:
    paths = [p for p in (site, str(ROOT), os.environ.get("PYTHONPATH")) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def _warn_if_jax_holds_the_gpu() -> None:
    """The child should run before this process's JAX starts its GPU backend (see
    `run_peer`); say so if it has."""
    try:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized()
    except Exception:  # private API: no warning rather than a failure
        return
    if started:
        import jax

        if jax.devices()[0].platform == "gpu":
            print(
                "warning: JAX's GPU backend is already up (and holds its preallocated pool): "
                "torch runs in what is left",
                flush=True,
            )


def run_peer(
    bench: str,
    cases,
    variants,
    iters: int,
    reps: int,
    site: str | None = None,
    compile: bool = True,
    device: str = "auto",
) -> dict[tuple, list[dict]]:
    """Measure ``variants`` (of `VARIANTS`) on ``cases`` in a child process; ``{case:
    rows}`` with each row's ``params``, ``variant``, ``ms``, ``peak_mem_mb``, GEMM counts,
    ``fp8_gemms``, ``torch``/``torchao`` versions and ``error`` (None when measured).
    Variants the child cannot import are left out, after one printed line.

    Call it before JAX touches the GPU. JAX preallocates 75% of the GPU's memory on its
    first GPU use and keeps it until the process exits; torch in the same process, or in a
    child started later, would get the rest. Started first, the child has the whole GPU
    and frees all of it when it exits, before JAX allocates. (Turning preallocation off
    instead would change the allocator the JAX numbers are measured with.)
    """
    variants = list(variants)
    if not variants:
        return {}
    _warn_if_jax_holds_the_gpu()
    cmd = [sys.executable, "-m", "benchmarks.torch_peer", "--bench", bench, "--device", device]
    cmd += ["--variants", ",".join(variants), "--iters", str(iters), "--reps", str(reps)]
    cmd += ["--cases", *(",".join(map(str, c)) for c in cases)]
    if not compile:
        cmd.append("--no-compile")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env=_child_env(site), cwd=str(ROOT)
    )
    found: dict[tuple, dict[str, dict]] = {}
    skipped: set[str] = set()
    started = f"torch, in a child process: python {' '.join(cmd[1:])}"
    for line in proc.stdout:
        try:
            msg = json.loads(line)
        except ValueError:
            print(f"[torch] {line.rstrip()}", flush=True)
            continue
        if "skip" in msg:
            print(f"skipped {', '.join(msg['variants'])}: {msg['skip']}", flush=True)
            skipped.update(msg["variants"])
            continue
        if started:  # said once something runs (a skip alone is one line)
            print(started, flush=True)
            started = ""
        row = _row(bench, msg)
        found.setdefault(tuple(msg["case"]), {})[row["variant"]] = row
        print(f"  [torch] {tuple(msg['case'])} {_summary(row)}", flush=True)
    rc = proc.wait()
    lost = f"the torch child process exited with code {rc} before measuring this"
    out = {}
    for case in cases:
        rows = found.get(tuple(case), {})
        out[tuple(case)] = [
            rows.get(v) or _row(bench, dict(case=list(case), variant=v, error=lost))
            for v in variants
            if v not in skipped
        ]
    return out


def _row(bench: str, msg: dict) -> dict:
    """A harness row from one worker line."""
    case = msg["case"]
    if bench == "linear":
        params = dict(M=case[0], K=case[1], N=case[2])
    else:
        params = dict(hidden=case[0], ffn=case[1], tokens=case[2], activation=case[3])
    n_fp8 = msg.get("fp8_gemm_count")
    measured = msg.get("ms") is not None
    return dict(
        params=params,
        variant=msg["variant"],
        ms=msg.get("ms"),
        compile_s=msg.get("compile_s"),
        fp8_gemm_count=n_fp8,
        gemm_count=msg.get("gemm_count"),
        # FP8 when every GEMM of the step is (as the JAX rows' count of FP8 GEMMs)
        fp8_gemms=n_fp8 == msg.get("gemm_count") and n_fp8 > 0 if measured else None,
        peak_mem_mb=msg.get("peak_mem_mb"),
        torch=msg.get("torch"),
        torchao=msg.get("torchao"),
        torch_device=msg.get("torch_device"),
        note=msg.get("note", ""),
        error=msg.get("error"),
    )


def _summary(row: dict) -> str:
    if row["ms"] is None:
        return f"{row['variant']}: {row['error']}"
    peak = "-" if row["peak_mem_mb"] is None else f"{row['peak_mem_mb']:.0f}"
    return (
        f"{row['variant']}: ms={row['ms']:.3f}, compile_s={row['compile_s']:.1f}, "
        f"fp8 GEMMs {row['fp8_gemm_count']}/{row['gemm_count']}, peak MB {peak}"
    )


def measured_variants(peer: dict[tuple, list[dict]]) -> list[str]:
    """The variants `run_peer` returned rows of (those not skipped)."""
    return sorted({r["variant"] for rows in peer.values() for r in rows}, key=VARIANTS.index)


def with_meta(rows: list[dict], meta: dict) -> list[dict]:
    """``rows`` with the run's shared fields (`benchmarks.common.run_meta`) in front."""
    return [dict(meta, **r) for r in rows]


def rebase_speedup(rows: list[dict], key: str = "speedup_vs_bf16") -> None:
    """In place: the torch rows' ``key`` as torch bf16's time over theirs (a framework's
    FP8 speedup is over its own bf16), among ``rows`` of one case."""
    base = next((r.get("ms") for r in rows if r["variant"] == BASE), None)
    for r in rows:
        if r["variant"] in VARIANTS:
            r[key] = base / r["ms"] if base and r.get("ms") else None


# ----------------------------------------------------------------------------- worker
def _import_torch():
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True  # no f32 GEMMs here; as the peer script
    return torch


def _import_torchao():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return Float8LinearConfig, convert_to_float8_training


def _activation(torch, name: str):
    F = torch.nn.functional
    fns = {
        "silu": F.silu,
        "gelu": lambda h: F.gelu(h, approximate="tanh"),
        "relu": F.relu,
        "qgelu": lambda h: h * torch.sigmoid(1.702 * h),
        "srelu": lambda h: torch.square(F.relu(h)),
    }
    if name in GATED:
        return fns[GATED[name]], True
    if name in fns:
        return fns[name], False
    raise ValueError(
        f"activation {name!r} not in the torch peer; choose from {sorted([*fns, *GATED])}"
    )


def _modules(torch):
    """The torch modules (defined once torch is imported)."""
    nn = torch.nn

    class RMSNorm(nn.Module):
        """`fp8jax.nn._mlp.normalize`'s RMSNorm: statistics in f32, output in x's dtype."""

        def __init__(self, dim: int, eps: float = 1e-5):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            x32 = x.float()
            y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
            return (y * self.weight.float()).to(x.dtype)

    class MLP(nn.Module):
        """norm -> fc1 -> activation -> fc2, no biases (`fp8jax.nn.FusedMLP`'s block)."""

        def __init__(self, hidden: int, ffn: int, activation: str):
            super().__init__()
            self.act, self.gated = _activation(torch, activation)
            self.norm = RMSNorm(hidden)
            self.fc1 = nn.Linear(hidden, ffn * (2 if self.gated else 1), bias=False)
            self.fc2 = nn.Linear(ffn, hidden, bias=False)

        def forward(self, x):
            h = self.fc1(self.norm(x))
            if self.gated:
                gate, up = h.chunk(2, dim=-1)
                return self.fc2(self.act(gate) * up)
            return self.fc2(self.act(h))

    class Objective(nn.Module):
        """``(y, sum(y.f32 * G))``: the loss is computed (as the JAX step returns it)
        off the graph; its gradient w.r.t. ``y`` is ``G``, given to ``y.backward``."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, x, g):
            y = self.model(x)
            return y, (y.detach().float() * g.float()).sum()

    return RMSNorm, MLP, Objective


def _build(torch, bench: str, case, variant: str, device: str):
    """The bf16 model of ``case``, converted to torchao float8 for its recipe."""
    _, MLP, _ = _modules(torch)
    if bench == "linear":
        _, k, n = case
        model = torch.nn.Linear(k, n, bias=False)
    else:
        hidden, ffn, _, activation = case
        model = MLP(hidden, ffn, activation)
    model = model.to(device, torch.bfloat16)
    recipe = variant.removeprefix("torchao-")
    if recipe != "bf16":
        config_cls, convert = _import_torchao()
        if bench == "linear":  # convert_to_float8_training swaps children: wrap the layer
            model = convert(torch.nn.Sequential(model), config=config_cls.from_recipe_name(recipe))
        else:
            model = convert(model, config=config_cls.from_recipe_name(recipe))
    return model


def _inputs(torch, bench: str, case, device: str, n_inputs: int = 3):
    rows, width = (case[0], case[1]) if bench == "linear" else (case[2], case[0])
    out_width = case[2] if bench == "linear" else case[0]
    xs = [
        torch.randn(rows, width, device=device, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(n_inputs)
    ]
    g = torch.randn(rows, out_width, device=device, dtype=torch.bfloat16)
    return xs, g


def _step_fn(model, objective, g):
    params = list(model.parameters())

    def step(x):
        x.grad = None
        for p in params:
            p.grad = None
        y, loss = objective(x, g)
        y.backward(g)
        return loss

    return step


def _time(step, xs, sync, iters: int, reps: int, warmup: int) -> float:
    """`benchmarks.common.time_step`'s timing, in ms."""
    for i in range(warmup):
        step(xs[i % len(xs)])
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(iters):
            step(xs[i % len(xs)])
        sync()
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times) * 1e3


def _gemm_counts(torch, step, x) -> tuple[int, int]:
    """(FP8 GEMMs, all GEMMs) one step calls: ``_scaled_mm`` and the (``add``/``b``)``mm``
    calls that neither dispatch to another GEMM (eager torchao wraps its FP8 GEMMs in an
    ``mm`` on its tensor subclass) nor run inside a ``_scaled_mm``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(x)

    def calls_gemm(event) -> bool:
        return any(c.name in GEMM_OPS or calls_gemm(c) for c in event.cpu_children)

    def in_fp8_gemm(event) -> bool:  # e.g. the CPU's _scaled_mm runs an mm
        parent = event.cpu_parent
        return parent is not None and (parent.name == FP8_GEMM or in_fp8_gemm(parent))

    gemms = [
        e
        for e in prof.events()
        if e.name in GEMM_OPS and not in_fp8_gemm(e) and (e.name == FP8_GEMM or not calls_gemm(e))
    ]
    return sum(e.name == FP8_GEMM for e in gemms), len(gemms)


def measure(torch, bench, case, variant, device, iters, reps, compile=True) -> dict:
    """One (case, variant): compile + first step, timing, peak memory, GEMM counts."""
    torch._dynamo.reset()  # one model per compile: no cache shared between variants
    torch.manual_seed(0)
    model = _build(torch, bench, case, variant, device)
    _, _, Objective = _modules(torch)
    objective = Objective(model)
    if compile:
        objective = torch.compile(objective, dynamic=False)
    xs, g = _inputs(torch, bench, case, device)
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step = _step_fn(model, objective, g)
    t0 = time.perf_counter()
    step(xs[0])
    sync()
    compile_s = time.perf_counter() - t0
    ms = _time(step, xs, sync, iters, reps, warmup=1 if iters <= 2 else 2)
    peak = None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        step(xs[0])
        sync()
        unread = sum(x.numel() * x.element_size() for x in xs[1:])
        peak = (torch.cuda.max_memory_allocated() - unread) / 2**20
    n_fp8, n_gemms = _gemm_counts(torch, step, xs[0])
    return dict(
        ms=ms, compile_s=compile_s, peak_mem_mb=peak, fp8_gemm_count=n_fp8, gemm_count=n_gemms
    )


def _parse_case(bench: str, text: str) -> list:
    parts = text.split(",")
    try:
        values = [int(v) for v in parts[:3]]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad case {text!r}") from None
    if len(values) != 3 or (bench == "linear" and len(parts) != 3):
        raise argparse.ArgumentTypeError(
            f"case must be M,K,N (linear) or hidden,ffn,tokens[,activation] (mlp), got {text!r}"
        )
    return values if bench == "linear" else [*values, parts[3] if len(parts) > 3 else "swiglu"]


def _emit(**msg) -> None:
    print(json.dumps(msg), flush=True)


def worker(argv: list[str] | None = None) -> None:
    """The child process: measure and print one JSON line per (case, variant)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.torch_peer", description=__doc__)
    p.add_argument("--bench", choices=("linear", "mlp"), required=True)
    p.add_argument("--cases", nargs="+", required=True, metavar="CASE")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--no-compile", action="store_true", help="eager torch (smoke runs)")
    args = p.parse_args(argv)
    cases = [_parse_case(args.bench, c) for c in args.cases]
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    try:
        torch = _import_torch()
    except Exception as e:
        _emit(
            skip=f"torch is not importable ({type(e).__name__}: {e}); install it or pass "
            "--torch-site (benchmarks/README.md)",
            variants=variants,
        )
        return
    versions = dict(torch=torch.__version__, torchao=None)
    try:
        _import_torchao()
        import torchao

        versions["torchao"] = torchao.__version__
    except Exception as e:
        fp8 = [v for v in variants if v != BASE]
        if fp8:
            _emit(
                skip=f"torchao is not importable ({type(e).__name__}: {e}); pip-install its "
                "wheel with --target DIR and pass --torch-site DIR (benchmarks/README.md)",
                variants=fp8,
            )
        variants = [v for v in variants if v == BASE]
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    for case in cases:
        for variant in variants:
            base = dict(case=case, variant=variant, torch_device=name, **versions)
            try:
                found = measure(
                    torch,
                    args.bench,
                    case,
                    variant,
                    device,
                    args.iters,
                    args.reps,
                    compile=not args.no_compile,
                )
            except Exception as e:  # report it and go on with the others
                first = str(e).splitlines()[0] if str(e) else ""
                found = dict(error=f"{type(e).__name__}: {first}"[:300])
            _emit(**base, **found)
            if device.startswith("cuda"):
                torch.cuda.empty_cache()


if __name__ == "__main__":
    worker()
