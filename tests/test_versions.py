"""Declared version floors and the haliax/jax pairing check."""

import importlib.util
import os
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _declared() -> dict[str, str]:
    """The ``>=`` floors in pyproject.toml: core dependencies, the flax extra and the test
    extra's flax."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    extras = project["optional-dependencies"]
    floors = {}
    for req in project["dependencies"] + extras["flax"]:
        name, version = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][^,;\s]*)", req).groups()
        floors[name] = version
    test_flax = [r for r in extras["test"] if r.startswith("flax")]
    assert test_flax == [f"flax>={floors['flax']}"], "the test extra's flax floor differs"
    return floors


def test_floors_job_installs_the_declared_floors():
    out = subprocess.run(
        ["bash", os.path.join(ROOT, ".ci", "floors"), "--print"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout.split()
    installed = dict(pin.split("==") for pin in out)
    declared = _declared()
    assert set(declared) == {"jax", "equinox", "optax", "jaxtyping", "flax"}
    assert installed == {**declared, "jaxlib": declared["jax"]}


@pytest.mark.skipif(importlib.util.find_spec("haliax") is None, reason="haliax not installed")
def test_haliax_front_door_names_the_jax_it_needs():
    # jax.core as JAX 0.11 has it (is_constant_dim removed), then the haliax front door.
    code = (
        "import jax, jax.core as c\n"
        "c.__dict__.pop('is_constant_dim', None)\n"
        "getattr(c, '_deprecations', {}).pop('is_constant_dim', None)\n"
        "assert not hasattr(c, 'is_constant_dim')\n"
        "try:\n"
        "    import fp8jax.haliax\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    print('imported')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    with open(
        os.path.join(importlib.util.find_spec("haliax").submodule_search_locations[0],
                     "jax_utils.py"), encoding="utf-8"
    ) as f:
        if "jax.core.is_constant_dim" not in f.read():
            assert out.stdout.strip() == "imported"  # a haliax that no longer needs it
            return
    msg = out.stdout.strip()
    assert "\n" not in msg
    assert re.fullmatch(
        r"fp8jax\.haliax: haliax \S+ needs jax < 0\.11 \(it calls jax\.core\.is_constant_dim, "
        r"removed in JAX 0\.11\.0\); installed jax \S+; use jax<0\.11 for the haliax front door, "
        r"or the equinox/flax front doors .*",
        msg,
    ), msg
