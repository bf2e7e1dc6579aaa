"""Compile tax: ``import fp8jax`` turns XLA's Triton GEMMs off for every compile, whatever
JAX ran before (FP8 steps compile in seconds and their GEMMs stay FP8), and the persistent
compilation cache makes a second start load its executables. Each case runs in a fresh
process: XLA reads its flags once per process."""

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
from conftest import gpu

from fp8jax import _compilation as compilation

SRC = os.path.join(os.path.dirname(__file__), "..", "src")


def _run(code: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", compilation.KEEP_ENV)}
    base["PYTHONPATH"] = os.pathsep.join([SRC, os.path.dirname(__file__)])
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**base, **(env or {})},
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_import_turns_triton_gemm_autotuning_off_and_jax_runs():
    out = _run("import fp8jax, os, jax; print(jax.numpy.ones(2).sum(), os.environ['XLA_FLAGS'])")
    assert out.stdout.split() == ["2.0", compilation.TRITON_GEMM_OFF]


@pytest.mark.parametrize("env, expected", [
    ({compilation.KEEP_ENV: "1"}, "<unset>"),  # the opt-out
    ({"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}, "--xla_gpu_enable_triton_gemm=true"),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
     "--xla_force_host_platform_device_count=2 " + compilation.TRITON_GEMM_OFF),
])
def test_the_users_choice_wins(env, expected):
    out = _run("import os, fp8jax; print(os.environ.get('XLA_FLAGS', '<unset>'))", env)
    assert out.stdout.strip() == expected


def test_jax_first_still_compiles_with_triton_gemm_off():
    """Issue 44: JAX run before ``import fp8jax`` (a notebook's first cells) no longer costs
    FP8: every later compile takes the option per compile, with no warning; the user's
    per-jit choice and the opt-out still win."""
    out = _run("""
        import os, warnings, jax
        jax.numpy.ones(1).block_until_ready()  # the backend starts before fp8jax is imported
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import fp8jax
            import fp8jax.nn
        from jax._src import compiler
        print(len(caught), os.environ.get("XLA_FLAGS", "<unset>"))
        print(dict(compiler.get_compile_options(1, 1).env_option_overrides))
        print(dict(compiler.get_compile_options(
            1, 1, env_options_overrides={"xla_gpu_enable_triton_gemm": True}
        ).env_option_overrides))
        f = jax.jit(lambda x: x @ x)
        print(float(f(jax.numpy.ones((4, 4))).sum()))  # CPU compiles with the option
        os.environ["FP8JAX_KEEP_TRITON_GEMM"] = "1"
        print(dict(compiler.get_compile_options(1, 1).env_option_overrides))
    """)
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "0 <unset>", out.stdout
    assert lines[1] == "{'xla_gpu_enable_triton_gemm': False}", out.stdout
    assert lines[2] == "{'xla_gpu_enable_triton_gemm': True}", out.stdout
    assert lines[3] == "64.0" and lines[4] == "{}", out.stdout


@gpu
def test_jax_first_then_fp8jax_runs_every_gemm_in_fp8():
    """Issue 44's first-hour failure on the GPU: a two-block step compiled after
    ``jax.devices()`` ran first (before ``import fp8jax``) ran 0 of its 11 GEMMs in FP8.
    Now every GEMM of the step is a cuBLASLt FP8 GEMM."""
    out = _run("""
        import jax, jax.numpy as jnp
        print(jax.devices())  # JAX's backend starts first, as in a notebook
        import equinox as eqx, fp8jax
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
        model = [eqx.nn.Linear(1024, 2048, key=k1), eqx.nn.Linear(2048, 1024, key=k2)]
        model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(selective=False))
        def loss(m, x):
            for layer in m:
                x = jax.nn.gelu(jax.vmap(layer)(x))
            return jnp.mean(x.astype(jnp.float32) ** 2)
        x = jax.random.normal(k3, (4096, 1024), jnp.bfloat16)
        step = eqx.filter_jit(eqx.filter_value_and_grad(loss))
        report = fp8jax.fp8_gemm_report(step, model, x)
        print(report.num_fp8, len(report.gemms))
        fp8jax.assert_fp8(step, model, x)
    """)
    fp8, total = map(int, out.stdout.split()[-2:])
    assert fp8 == total >= 5, out.stdout  # fwd + wgrad each, dgrad where one is needed


def test_second_start_hits_the_persistent_cache(tmp_path):
    code = f"""
        import jax, jax.numpy as jnp, equinox as eqx, fp8jax
        hits = []
        jax.monitoring.register_event_listener(
            lambda name, **kw: hits.append(name) if "cache_hits" in name else None)
        fp8jax.enable_compilation_cache({str(tmp_path)!r}, min_compile_s=0)
        model = fp8jax.fp8_linear_layers(eqx.nn.Linear(64, 64, key=jax.random.PRNGKey(0)),
                                         fp8jax.Fp8Config(selective=False))
        step = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(x))))
        step(model, jnp.ones((32, 64)))
        print(len(hits))
    """
    assert int(_run(code).stdout.split()[-1]) == 0  # first start: compiles, fills the cache
    assert any(tmp_path.iterdir())
    assert int(_run(code).stdout.split()[-1]) >= 1  # second start: loads from it


def test_cache_dir_errors_name_the_path(tmp_path):
    import fp8jax

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot create"):
        fp8jax.enable_compilation_cache(blocker / "sub")
    with pytest.raises(TypeError, match=r"enable_compilation_cache: path=5 is not allowed"):
        fp8jax.enable_compilation_cache(5)
    for bad in (-1, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match=r"min_compile_s=.* is not allowed"):
            fp8jax.enable_compilation_cache(tmp_path, min_compile_s=bad)


@gpu
def test_fp8_step_compiles_within_2x_bf16_with_default_flags():
    """Issue 21's two-block step as a user writes it (plain ``eqx.filter_jit``, no fp8jax
    flag call) compiles in at most twice the bf16 step's time (medians of three fresh
    processes each), every GEMM in FP8: a guard against the compile tax the issue found
    (255 s against 6 s, 42x, with XLA's Triton GEMM autotuning). The issue's goal, 1.5x, is
    met on an H200 (1.05 s against 0.82 s, 2026-11-26); on an H100 the ratio was 1.40x and
    1.59x in two calls of one day (benchmarks/RESULTS.md, fifteenth session)."""
    import statistics

    from benchmarks.compile import user_step

    seconds, rows = {}, {}
    for variant in ("bf16", "fp8"):
        runs = []
        for _ in range(3):
            with tempfile.TemporaryDirectory() as cache:  # empty: a first start each time
                rows[variant] = user_step("two-block", variant, cache, "default", quick=False)
            runs.append(rows[variant]["compile_s"])
        seconds[variant] = statistics.median(runs)
    assert rows["fp8"]["fp8_gemms"] == rows["fp8"]["gemms"] > 0, rows
    ratio = seconds["fp8"] / seconds["bf16"]
    assert ratio <= 2.0, f"FP8 / bf16 compile {ratio:.2f}x: {seconds}"


def test_identical_layers_lower_their_fp8_gemm_once():
    """Layers that share a config and shapes trace and lower an FP8 GEMM's forward and
    backward once (`fp8jax._ops.traced.traced_once`): the step calls one function per
    distinct layer instead of inlining a copy per layer (issue 21: lowering time)."""
    import re

    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import fp8jax

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    layers = [eqx.nn.Linear(64, 64, key=k) for k in keys[:3]] + [eqx.nn.Linear(64, 128, key=keys[3])]
    model = fp8jax.fp8_linear_layers(layers, fp8jax.Fp8Config(selective=False))

    def loss(m, x):
        for layer in m:
            x = jax.vmap(layer)(x)
        return jnp.sum(x)

    x = jax.random.normal(keys[0], (32, 64))
    text = eqx.filter_jit(eqx.filter_grad(loss)).lower(model, x).as_text()
    for name in ("fp8_gemm_forward", "fp8_gemm_backward"):
        defined = re.findall(rf"func\.func (?:private |public )?@({name}\S*)\(", text)
        assert len(defined) == 2, (name, defined)  # the 64x64 layers' and the 64x128 one's
        assert len(re.findall(rf"call @{name}\S*\(", text)) == 4, name


def _step_equations(model: str, precision: str) -> int:
    """Equations of ``model``'s quick step (`benchmarks.compile_cases`) as traced, nested
    jaxprs included, each distinct one once (a function traced once is lowered once)."""
    import jax

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks.compile_cases import HEADER, MODELS

    names = {"ARGV": ["-", model, precision, "1", "-"], "__name__": "__compile_step__"}
    exec(HEADER + MODELS[model], names)
    seen = set()

    def count(jaxpr) -> int:
        n = 0
        for eqn in jaxpr.eqns:
            n += 1
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns") and id(sub) not in seen:
                        seen.add(id(sub))
                        n += count(sub)
        return n

    return count(jax.make_jaxpr(names["step"])(*names["args"]).jaxpr)


def test_fp8_state_bookkeeping_stays_cheap_to_trace():
    """Issue 21's two-block step (quick shapes): the FP8 step's equations beyond the bf16
    step's (four layers' casts, GEMMs, state proposals and write-back, the guards) stay at
    most 1245 (jax 0.10.2: 1191, from 1280 before the state's checks, screen and record ran
    on the stacked histories and packed scalars in lax ops). Each equation is traced and
    lowered, per layer where it sits outside the GEMM's jitted functions: a count, not a
    time, so the test is stable."""
    import jax

    extra = _step_equations("two-block", "fp8") - _step_equations("two-block", "bf16")
    bound = 1245 if jax.__version_info__[:2] == (0, 10) else 1400  # other versions differ
    assert extra <= bound, f"the FP8 step has {extra} equations more than the bf16 step's"


def test_compile_benchmark_runs_on_cpu():
    """The harness itself (tiny shapes, writes nothing): every variant compiles."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks import compile as bench

    # fp8-cached (a second process start) is left to the GPU run: the persistent cache's
    # second start is tested by test_second_start_hits_the_persistent_cache.
    rows = bench.main(["--quick", "--models", "two-block", "--repeats", "1",
                       "--variants", "bf16", "fp8"])
    assert [r["variant"] for r in rows] == ["bf16", "fp8"]
    assert all(r["compile_s"] > 0 and r["step_ms"] > 0 for r in rows)


def test_every_notebook_step_of_the_compile_benchmark_runs_on_cpu():
    """Each notebook's step in the harness (`benchmarks.compile.MODELS`) builds, compiles and
    steps at its tiny CPU sizes in FP8 (the reference path), here in one process."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks import compile as bench

    for model in bench.MODELS:
        row = bench.run_here(model)
        assert row["compile_s"] > 0 and row["gemms"] > 0, (model, row)
        assert row["fusions"] > 0 and row["hlo_instructions"] > row["fusions"], (model, row)
        # 1b-step compiles from abstract shapes and does not run
        assert (row["step_ms"] is None) == (model == "1b-step"), (model, row)
        assert model == "1b-step" or row["step_ms"] > 0, (model, row)
