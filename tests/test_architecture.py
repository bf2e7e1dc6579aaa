"""The import graph of src/fp8jax is the strict layering of docs/architecture.md.

* import-linter's contracts in pyproject.toml (``[tool.importlinter]``) hold: the layers,
  no circle inside a package, kernels below the FP8 machinery, extras only where optional.
* An AST scan of every import, the ones inside functions and under ``TYPE_CHECKING``
  included, finds no circle, so one is caught even where a contract is edited to allow it.
* Only `fp8jax._jax_compat` imports JAX's internals (``jax._src``).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PACKAGE = "fp8jax"


# ----------------------------------------------------------------------------- import-linter
def _lint_imports() -> str | None:
    """The ``lint-imports`` entry point of this interpreter's environment, else on PATH."""
    script = Path(sys.executable).with_name("lint-imports")
    return str(script) if script.exists() else shutil.which("lint-imports")


@pytest.mark.skipif(
    _lint_imports() is None, reason="import-linter is not installed (pip install -e '.[test]')"
)
def test_import_contracts():
    paths = [str(SRC), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    out = subprocess.run(
        [_lint_imports(), "--no-cache", "--no-logo"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]


# ----------------------------------------------------------------------------- AST scan
def _modules(src: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package`` under ``src``."""
    mods = {}
    for path in sorted((src / package).rglob("*.py")):
        name = ".".join(path.relative_to(src).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> dict[str, int]:
    """Modules of ``mods`` that module ``name`` imports anywhere (functions included) ->
    the line of the first such import."""
    is_package = path.name == "__init__.py"
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            # ``from pkg import mod`` imports the module; ``from mod import name`` the module
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
            ]
        for target in targets:
            while target and target not in mods:  # ``import a.b.c`` of a name: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.setdefault(target, node.lineno)
    return out


def import_graph(src: Path = SRC, package: str = PACKAGE) -> dict[str, dict[str, int]]:
    """Module -> {imported module of the package: line}."""
    mods = _modules(src, package)
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_circle():
    graph = import_graph()
    assert len(graph) > 50 and "fp8jax._ops.dot" in graph["fp8jax._dot_general"]
    found = circles(graph)
    lines = [
        f"  {a} -> {b} ({graph[a][b]})"
        for component in found
        for a in component
        for b in sorted(graph[a])
        if b in component
    ]
    assert not found, "import circles (move what two modules share down):\n" + "\n".join(lines)


def test_scan_sees_imports_inside_functions(tmp_path):
    """The scan counts an import inside a function: a circle through one is found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from .sub import high\n    return high\n")
    (pkg / "sub" / "high.py").write_text("from .. import low\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.low"] == {"pkg.sub.high": 2}
    assert circles(graph) == [["pkg.low", "pkg.sub.high"]]
    (pkg / "low.py").write_text("x = 1\n")
    assert circles(import_graph(tmp_path, "pkg")) == []


# ----------------------------------------------------------------------------- jax._src
def jax_internal_imports(source: str) -> list[int]:
    """Lines of ``source`` that import ``jax._src`` (or a module under it)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        if any(n == "jax._src" or n.startswith("jax._src.") for n in names):
            lines.append(node.lineno)
    return sorted(lines)


def test_jax_internals_only_in_jax_compat():
    assert jax_internal_imports("def f():\n    from jax import _src\n") == [2]
    assert jax_internal_imports("import jax._src.core as c\nfrom jax._src.lax import lax\n") == [
        1,
        2,
    ]
    assert jax_internal_imports("import jax\nfrom jax import lax\n") == []
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for name, path in _modules(SRC, PACKAGE).items()
        if name != "fp8jax._jax_compat"
        for line in jax_internal_imports(path.read_text(encoding="utf-8"))
    ]
    assert not found, "jax._src outside fp8jax/_jax_compat.py:\n  " + "\n  ".join(found)
