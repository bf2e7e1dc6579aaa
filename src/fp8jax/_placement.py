"""Checks and small helpers shared by `fp8jax.distributed` and `fp8jax._sequence`: mesh
axes, name lists, layer-path patterns."""

from __future__ import annotations

import fnmatch
from typing import Sequence

from jax.sharding import Mesh


def _axis_size(mesh: Mesh, axis: str | None, fn: str = "shard_model") -> int:
    if axis is None:
        return 1
    if axis not in mesh.shape:
        raise ValueError(f"{fn}: mesh has no axis {axis!r}; its axes are {tuple(mesh.shape)}.")
    return mesh.shape[axis]


def _names(fn: str, what: str, value, allow_none: bool = False) -> tuple[str, ...] | None:
    """``value`` as a tuple of names; a bare string is refused (it would iterate as letters)."""
    if value is None and allow_none:
        return None
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise TypeError(
            f"{fn}: {what} must be a list of names, e.g. [{value!r}], got {value!r}."
            if isinstance(value, str)
            else f"{fn}: {what} must be a list of names (strings), got {value!r}."
        )
    return tuple(value)


def _check_mesh(fn: str, mesh) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{fn}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    _check_auto(mesh, fn)


def _check_auto(mesh: Mesh, fn: str) -> None:
    """GSPMD (Auto) axes only: explicit-sharding meshes (`jax.make_mesh`'s default) need
    other constraints (`jax.sharding.reshard`), not written yet."""
    types = getattr(mesh, "axis_types", ())
    if any("Auto" not in str(t) for t in types):
        raise ValueError(
            f"{fn}: mesh axes must be Auto (GSPMD), got {tuple(map(str, types))}; build the "
            "mesh with jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) "
            "* len(names)) or jax.sharding.Mesh(devices, names)."
        )


def _matches(path: str, patterns: Sequence[str]) -> bool:
    return any(path == p or fnmatch.fnmatchcase(path, p) for p in patterns)


def _kinds(fn: str, paths, column_parallel, row_parallel, noun: str) -> dict[str, str]:
    """path -> "column" / "row" of the layers the Megatron patterns match; a ValueError
    naming a pattern that matches no layer (a ``noun``), or a layer both match."""
    kinds: dict[str, str] = {}
    for kind, patterns in (("column", column_parallel), ("row", row_parallel)):
        for p in patterns:
            hits = [path for path in paths if _matches(path, [p])]
            if not hits:
                raise ValueError(
                    f"{fn}: {kind}_parallel pattern {p!r} matches no {noun}; layers are: "
                    + ", ".join(paths)
                )
            for path in hits:
                if kinds.setdefault(path, kind) != kind:
                    raise ValueError(f"{fn}: layer {path!r} is both column- and row-parallel.")
    return kinds
