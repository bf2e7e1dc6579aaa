"""Every notebook runs top to bottom on CPU (tiny sizes) and is committed without outputs."""

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import suite_cache_env

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Run on a GPU host only (CI's time budget): they drive the trainer and the benchmark
# harnesses, whose CPU runs tests/test_train.py and tests/test_benchmarks.py cover.
GPU_ONLY = {
    "02_train_lm": "runs fp8jax.train's pieces (tests/test_train.py on CPU); GPU hosts run it",
    "03_benchmarks": "runs the benchmark harnesses (tests/test_benchmarks.py on CPU); GPU hosts",
}


def test_there_are_notebooks():
    names = {p.stem for p in NOTEBOOKS}
    assert {"01_quickstart", "02_train_lm", "03_benchmarks", "04_fused_mlp", "05_attention", "06_moe", "07_sharded"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, f"{path.name}: strip outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_valid_without_warnings(path):
    """nbformat reads each notebook without a warning (a cell without an id gave
    MissingIDFieldWarning, which nbformat will turn into an error)."""
    import warnings

    nbformat = pytest.importorskip("nbformat")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nbformat.validate(nbformat.read(path, as_version=4))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, monkeypatch):
    if path.stem in GPU_ONLY and shutil.which("nvidia-smi") is None:
        pytest.skip(GPU_ONLY[path.stem])
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    book = nbformat.read(path, as_version=4)
    env_src = str(ROOT / "src")
    os.environ["PYTHONPATH"] = os.pathsep.join([env_src, os.environ.get("PYTHONPATH", "")])
    os.environ.setdefault("STEPS", "6")
    # The kernel compiles into the suite's persistent cache, as the tests' own process does.
    for name, value in suite_cache_env().items():
        monkeypatch.setenv(name, value)
    # Run in a scratch copy of the repository root's layout: cwd is tmp_path, but the
    # benchmarks notebook finds the repository through its parents, so run it from ROOT.
    cwd = ROOT if "benchmarks" in path.stem else tmp_path
    client = nbclient.NotebookClient(book, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(cwd)}})
    client.execute()
