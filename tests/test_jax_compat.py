"""JAX internals behind one module (`fp8jax._jax_compat`): each one fp8jax uses still exists
in this JAX, a missing one is named with the JAX version (at ``import fp8jax`` where it is
required), and no other module of fp8jax imports ``jax._src``."""

import ast
import os
import subprocess
import sys
import textwrap

import jax
import pytest

from fp8jax import _jax_compat

SRC = os.path.join(os.path.dirname(__file__), "..", "src")


def test_every_jax_internal_fp8jax_uses_still_exists():
    """Every entry of `INTERNALS` resolves in this JAX: an upgrade that moves one fails here,
    by name and JAX version."""
    missing = _jax_compat.missing()
    assert not missing, f"JAX internals gone in jax {jax.__version__}: {missing}"
    for internal in _jax_compat.INTERNALS:
        assert internal.why and internal.module.startswith("jax._src."), internal


def test_a_missing_internal_is_found_and_named():
    """The check above can fail: a name this JAX lacks is reported, and its message names
    the internal, what it is for and the JAX version."""
    fake = _jax_compat.Internal("jax._src.core", "no_such_name_in_jax", "a made-up internal")
    gone_module = fake._replace(module="jax._src.no_such_module")
    assert _jax_compat.missing(_jax_compat.INTERNALS + (fake, gone_module)) == [
        "jax._src.core.no_such_name_in_jax",
        "jax._src.no_such_module.no_such_name_in_jax",
    ]
    later = fake._replace(since="99.0")  # a JAX before its first release need not have it
    assert _jax_compat.missing((later,)) == []
    message = _jax_compat.missing_message(fake)
    assert "jax._src.core.no_such_name_in_jax" in message and "a made-up internal" in message
    assert f"jax {jax.__version__}" in message


def test_a_public_name_is_taken_before_the_internal():
    """An entry with a public home resolves there where JAX has it."""
    public = _jax_compat.Internal("jax._src.no_such_module", "Tracer", "x", public="jax.core")
    assert _jax_compat.resolve(public) is jax.core.Tracer


REQUIRED = [(i.module, i.attribute) for i in _jax_compat.INTERNALS if i.required]


@pytest.mark.parametrize("module, attribute", REQUIRED[:2])  # a subprocess each: two suffice
def test_import_fp8jax_names_a_missing_required_internal(module, attribute):
    """``import fp8jax`` on a JAX without a required internal: an ImportError naming it and
    the JAX version, not an AttributeError from inside fp8jax."""
    code = textwrap.dedent(f"""
        import importlib, jax
        delattr(importlib.import_module({module!r}), {attribute!r})
        try:
            import fp8jax
        except ImportError as e:
            print(e)
    """)
    env = {**os.environ, "PYTHONPATH": SRC, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{module}.{attribute}" in out.stdout, out.stdout
    assert f"jax {jax.__version__}" in out.stdout, out.stdout


def _jax_src_uses(path: str) -> list[str]:
    """``line: what`` for each import of ``jax._src`` and each ``jax._src`` attribute in a
    Python file (docstrings and comments aside)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and node.attr == "_src":
            names = [ast.unparse(node)]
        found += [f"{node.lineno}: {n}" for n in names if n == "jax._src" or
                  n.startswith("jax._src.")]
    return found


def test_no_jax_internals_outside_jax_compat():
    """Only `fp8jax._jax_compat` imports ``jax._src``: an internal anywhere else would escape
    the check above."""
    root = os.path.join(SRC, "fp8jax")
    uses = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and name != "_jax_compat.py":
                if found := _jax_src_uses(path):
                    uses[os.path.relpath(path, root)] = found
    assert not uses, f"jax._src used outside fp8jax/_jax_compat.py: {uses}"


def test_the_source_check_finds_an_internal(tmp_path):
    """The check above can fail: each way of reaching ``jax._src`` is found."""
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent('''
        """Docstrings may mention jax._src."""
        import jax._src.core
        from jax._src import dtypes
        from jax import _src
        x = jax._src.core.Tracer  # comments too: jax._src
    '''))
    assert [u.split(": ")[0] for u in _jax_src_uses(str(path))] == ["3", "4", "4", "5", "6"]
