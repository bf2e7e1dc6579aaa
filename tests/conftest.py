import functools
import os
import shutil
import tempfile
import zlib

# 8 host devices for the data-parallel tests; must be set before jax is imported. On a host
# without a GPU (CI) the suite's time is mostly XLA compiling tiny CPU programs: LLVM's
# optimization level 0 took 29% off it (tests/test_benchmarks.py + test_grouped.py on 2 cores,
# 110 -> 79 s). A GPU host keeps XLA's default, so its kernels compile as users get them.
_XLA_FLAGS = "--xla_force_host_platform_device_count=8"
if shutil.which("nvidia-smi") is None:
    _XLA_FLAGS += " --xla_backend_optimization_level=0"
    # One thread per test worker for XLA's CPU ops: xdist's workers already fill the cores
    # (tests/test_grouped, test_mlp, test_attention on 2 cores: 99 -> 90 s).
    _XLA_FLAGS += " --xla_cpu_multi_thread_eigen=false"
    # The fused loops through XLA's older CPU emitters: its newer (MLIR) fusion emitters took
    # most of each tiny program's compile time (tests/test_benchmarks.py on 1 core: 207 -> 117
    # CPU s). A test about what XLA's default CPU code computes compiles with
    # `DEFAULT_CPU_CODEGEN` (they round differently: tests/test_train_remat.py).
    _XLA_FLAGS += " --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("XLA_FLAGS", _XLA_FLAGS)
# On a GPU, JAX preallocates 75% of its memory per process: the tests that start fresh
# processes (compile time, compile cache) found too little left and failed to start cuBLAS.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import fp8jax  # noqa: E402, F401  (first: its compile setting acts before JAX's backend starts)
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from fp8jax import _compilation  # noqa: E402

ON_GPU = jax.devices()[0].platform == "gpu"
# Compiler options for `Lowered.compile`: XLA's default CPU code generation where the flags
# above changed it (none on a GPU host).
DEFAULT_CPU_CODEGEN = {} if ON_GPU else {"xla_cpu_use_fusion_emitters": True}

# On a host without a GPU (CI): JAX's persistent compilation cache, shared by the xdist
# workers, so the many tests that build the same small programs compile each once (the
# optimizer-loop, misuse, outlier and report tests: 65 -> 44 s on 2 cores). A GPU host keeps
# JAX's default, so its tests compile as users' programs do.
_CACHE = {
    "jax_compilation_cache_dir": os.path.join(tempfile.gettempdir(), "fp8jax-tests-jax-cache"),
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
}


def _use_the_suites_cache():
    for name, value in _CACHE.items():
        if getattr(jax.config, name) != value:
            jax.config.update(name, value)


def suite_cache_env() -> dict[str, str]:
    """Environment variables giving a child process (a notebook's kernel) the suite's
    persistent compilation cache (none on a GPU host)."""
    return {} if ON_GPU else {name.upper(): str(value) for name, value in _CACHE.items()}


def _then_the_suites_cache(enable):
    """``fp8jax._compilation.enable_compilation_cache`` as the trainer calls it (its checks,
    its directory made), then the suite's settings again: a trainer run in a test would
    otherwise leave programs compiled in under 0.5 s uncached, the next run's too."""

    @functools.wraps(enable)
    def enable_then_suite(*args, **kwargs):
        directory = enable(*args, **kwargs)
        _use_the_suites_cache()
        return directory

    return enable_then_suite


if not ON_GPU:
    _use_the_suites_cache()
    # JAX opens the cache in the directory set at its first compile: this one, even where a
    # worker's first test is a trainer run.
    jax.jit(lambda x: x + 1)(np.float32(1)).block_until_ready()
    _compilation.enable_compilation_cache = _then_the_suites_cache(
        _compilation.enable_compilation_cache
    )


@pytest.fixture(autouse=True)
def _suite_compilation_cache():
    """After a test that turned on its own cache settings (`fp8jax.enable_compilation_cache`),
    the worker caches every program in the suite's cache again."""
    yield
    if not ON_GPU:
        _use_the_suites_cache()


def sqnr_db(actual, reference) -> float:
    """Signal-to-quantization-noise ratio in dB of ``actual`` against ``reference``."""
    ref = np.asarray(reference, np.float64)
    err = np.asarray(actual, np.float64) - ref
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum(err**2), 1e-300)))


@pytest.fixture
def key(request):
    # A fresh key per test, derived from its name with a stable hash (Python's str hash
    # changes per process, which made thresholds pass or fail from run to run).
    return jax.random.PRNGKey(zlib.crc32(request.node.name.encode()) % (2**31))


gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")


@pytest.fixture
def monkeypatch(monkeypatch):
    """pytest's ``monkeypatch`` with JAX's trace caches cleared before and after the test:
    an FP8 op's forward and backward are jitted functions traced once per config and shapes
    (`fp8jax._ops.traced.traced_once`), so a function patched after an earlier test traced the
    same shapes would not be called, and a trace made with the patch must not outlive it."""
    jax.clear_caches()
    yield monkeypatch
    jax.clear_caches()
