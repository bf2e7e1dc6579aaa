"""The public face (issue 46): every public module says what it exports (``__all__``), every
exported callable documents its arguments and what it returns, every package's docstring
names each of its modules, and no docstring or comment in ``src/`` quotes a measured timing
(those live in ``benchmarks/RESULTS.md``). The public modules are listed in
``docs/architecture.md`` ("Public API"); everything else is implementation."""

import ast
import importlib
import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "fp8jax"

# module -> the optional dependency it needs (None: always importable)
PUBLIC = {
    "fp8jax": None,
    "fp8jax.nn": None,
    "fp8jax.train": None,
    "fp8jax.flax": "flax",
    "fp8jax.nnx": "flax",
    "fp8jax.haliax": "haliax",
    "fp8jax.distributed": None,
    "fp8jax.inspect": None,
    "fp8jax.tuning": None,
}
# Callable objects in an ``__all__`` that are values, not functions: no signature to document.
CALLABLE_VALUES = {
    "fp8jax.nnx.WRT": "an nnx filter (nnx.Any(Param, Fp8State)), passed as a value",
}
# "Arguments:" or a group of them, "Arguments (the recipe):" (`Fp8Config` groups its fields).
ARGUMENTS = re.compile(r"^\s*Arguments(?: \(.*\))?:\s*$", re.M)
RETURNS = re.compile(r"^\s*Returns:\s*$", re.M)


def _module(name: str):
    if PUBLIC[name]:
        pytest.importorskip(PUBLIC[name])
    return importlib.import_module(name)


def _exports(name: str):
    module = _module(name)
    assert hasattr(module, "__all__"), f"{name} has no __all__"
    return module, list(module.__all__)


@pytest.mark.parametrize("name", PUBLIC)
def test_every_exported_name_exists(name):
    module, names = _exports(name)
    assert names, f"{name}.__all__ is empty"
    assert len(names) == len(set(names)), f"{name}.__all__ repeats a name"
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not have: {missing}"


def _doc_problems(qualified: str, obj) -> list[str]:
    """What the docstring of an exported object lacks ([] when nothing)."""
    if inspect.isclass(obj):
        init = obj.__dict__.get("__init__")
        doc = (obj.__doc__ or "") + "\n" + (getattr(init, "__doc__", None) or "")
        return [] if ARGUMENTS.search(doc) else [f"{qualified}: no Arguments: (class or __init__)"]
    doc = inspect.getdoc(obj) or ""
    return [
        f"{qualified}: no {section}"
        for section, pattern in (("Arguments:", ARGUMENTS), ("Returns:", RETURNS))
        if not pattern.search(doc)
    ]


@pytest.mark.parametrize("name", PUBLIC)
def test_every_exported_callable_documents_arguments_and_returns(name):
    module, names = _exports(name)
    problems = []
    for n in names:
        obj, qualified = getattr(module, n), f"{name}.{n}"
        if inspect.ismodule(obj) or not callable(obj) or qualified in CALLABLE_VALUES:
            continue
        problems += _doc_problems(qualified, obj)
    assert not problems, "\n".join(problems)


def test_the_docstring_check_sees_a_missing_section():
    """The check above can fail: a function without Returns:, a class without Arguments:."""

    def documented(x):
        """Twice ``x``.

        Arguments:
            x: a number.

        Returns:
            ``2 * x``.
        """

    def undocumented(x):
        """Twice ``x``.

        Arguments:
            x: a number.
        """

    class Bare:
        """A class whose arguments nobody wrote down."""

        def __init__(self, x):
            """Keep ``x``."""

    assert _doc_problems("documented", documented) == []
    assert _doc_problems("undocumented", undocumented) == ["undocumented: no Returns:"]
    assert _doc_problems("Bare", Bare) == ["Bare: no Arguments: (class or __init__)"]


PACKAGES = sorted(p.parent for p in SRC.glob("*/__init__.py"))


def _undocumented_modules(package: Path) -> list[str]:
    """The modules (files) of ``package`` its docstring does not name as `module`."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    modules = sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__")
    return [m for m in modules if f"`{m}`" not in doc]


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_package_docstring_names_every_module(package):
    missing = _undocumented_modules(package)
    assert not missing, f"fp8jax.{package.name}'s docstring does not name {missing}"


def test_the_package_check_sees_a_new_module(tmp_path):
    (tmp_path / "__init__.py").write_text('"""`old`: the one module."""\n')
    (tmp_path / "old.py").write_text("")
    assert _undocumented_modules(tmp_path) == []
    (tmp_path / "new.py").write_text("")
    assert _undocumented_modules(tmp_path) == ["new"]


# Measured timings belong in benchmarks/RESULTS.md, the code keeps the reason in words.
MEASUREMENTS = [
    re.compile(r"\d+(\.\d+)?\s*(ms|µs|us)\b"),  # a time
    re.compile(r"\d+(\.\d+)?\s*s\b"),  # a compile time
    re.compile(r"\d+(\.\d+)?x\b"),  # a ratio (speed, error)
    re.compile(r"\d+(\.\d+)?\s*TFLOP/s"),  # a GEMM's rate
    re.compile(r"\d+(\.\d+)?\s*[GMT]i?B/s"),  # a bandwidth
    re.compile(r"\d[\d,]*\s*tokens/s"),  # a trainer's rate
    re.compile(r"\d+(-\d+)?%\s+(faster|slower)"),  # a speedup
]
# (file relative to src/fp8jax, the matched text) -> why it is not a measurement
NOT_MEASUREMENTS: dict[tuple[str, str], str] = {
    ("_recipe.py", "100x"): "an example jump of the activations the outlier rule must track",
    ("train/_config.py", "4x"): "a device count (4x H200), the preset's target machine",
}


def _texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment in ``path``."""
    source = path.read_text()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def _measurements(path: Path, rel: str | None = None) -> list[str]:
    """``file:line: 'text'`` of each measurement in ``path``'s docstrings and comments."""
    rel = rel or path.relative_to(SRC).as_posix()
    found = []
    for line, text in _texts(path):
        for pattern in MEASUREMENTS:
            for m in pattern.finditer(text):
                if (rel, m.group(0)) not in NOT_MEASUREMENTS:
                    found.append(f"{rel}:{line}: {m.group(0)!r}")
    return found


def test_no_measured_timings_in_docstrings_or_comments():
    found = [hit for path in sorted(SRC.rglob("*.py")) for hit in _measurements(path)]
    assert not found, (
        "move these numbers to benchmarks/RESULTS.md and point there:\n" + "\n".join(found)
    )


def test_the_measurement_check_sees_one(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('"""Fast."""\n\n\ndef f():\n    """About 2.5 ms on an H100."""\n')
    assert _measurements(path, "m.py") == ["m.py:5: '2.5 ms'"]
    path.write_text("x = 1  # 1.45x bf16, compiles in 12.5 s\n")
    assert _measurements(path, "m.py") == ["m.py:1: '12.5 s'", "m.py:1: '1.45x'"]
    assert _measurements(path, "_recipe.py") == ["_recipe.py:1: '12.5 s'", "_recipe.py:1: '1.45x'"]
    path.write_text("x = 1  # a 100x jump\n")
    assert _measurements(path, "_recipe.py") == []  # allow-listed, with its reason


def test_implementation_modules_are_underscored():
    """equinox's layout: a module is public (listed in `PUBLIC`, the table of
    docs/architecture.md) or has a ``_``-prefixed part in its path, so no import path
    promises what the library does not."""
    unmarked = []
    for path in sorted(SRC.rglob("*.py")):
        parts = ("fp8jax",) + path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        if name in PUBLIC or name == "fp8jax.train.__main__":
            continue
        if not any(p.startswith("_") for p in parts):
            unmarked.append(name)
    assert not unmarked, f"public by path but not in the public face: {unmarked}"
