"""ruff (configured in pyproject.toml) passes: lint rules and formatting, lines <= 100."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.skipif(shutil.which("ruff") is None and _ruff("--version").returncode != 0,
                    reason="ruff is not installed (pip install -e '.[test]')")
@pytest.mark.parametrize("args", [("check", "."), ("format", "--check", ".")])
def test_ruff(args):
    out = _ruff(*args)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]
