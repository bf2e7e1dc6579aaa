"""FSDP's FP8 weight all-gather for weights whose sharding is only known when compiling.

Under ``jit`` a weight the user placed with a `NamedSharding` on a GSPMD (Auto) mesh
carries no sharding at trace time (``jax.typeof(w).sharding`` is unspecified), so the
op cannot name it in a sharding constraint. `gather_fsdp` is a `custom_partitioning`
identity: the SPMD partitioner calls it back with the operand's real sharding, and it
all-gathers its (FP8) operand over the FSDP mesh axes (`current_axes`), keeping every
other axis (tensor parallel) sharded. So a converted model stepped by a plain
``eqx.filter_jit`` casts each weight shard to FP8 and moves 1 byte/element, with no
helper call. On one device (or inside a fully manual ``shard_map``) it is the identity.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator, Sequence

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Mesh axis names that mean FSDP (the weight is gathered over them before its GEMM), read
# when a step is traced: inside `axes` (``fp8jax.distributed.fsdp_axes``) the block's, else
# the process's (`set_axes`: one setting for every thread and notebook cell, which a context
# variable alone would not be: ipykernel runs cells in copies of a context).
_AXES: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "fp8jax_fsdp_axes", default=None
)
_PROCESS_AXES = {"axes": ("fsdp",)}


def current_axes() -> tuple[str, ...]:
    """The mesh axis names meaning FSDP here (default ``("fsdp",)``); part of the cache key
    of every trace that reads them (`fp8jax._ops.dot`)."""
    return _AXES.get() or _PROCESS_AXES["axes"]


def _checked(owner: str, names: Sequence[str]) -> tuple[str, ...]:
    if isinstance(names, str) or not all(isinstance(a, str) for a in names):
        raise TypeError(f"{owner}: expected a sequence of axis names, got {names!r}.")
    return tuple(names)


def set_axes(names: Sequence[str], owner: str = "set_fsdp_axes") -> None:
    """Make ``names`` the FSDP axes of the process from now on (a ``with axes(...)`` block
    still overrides them inside it)."""
    _PROCESS_AXES["axes"] = _checked(owner, names)


@contextlib.contextmanager
def axes(names: Sequence[str], owner: str = "fsdp_axes") -> Iterator[tuple[str, ...]]:
    """``names`` are the FSDP axes inside the ``with`` block."""
    token = _AXES.set(_checked(owner, names))
    try:
        yield _AXES.get()
    finally:
        _AXES.reset(token)


def _entries(spec, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(tuple(spec)))


def split_axes(entry, gather: tuple[str, ...]):
    """(axes kept, axes gathered) of one PartitionSpec entry: what stays sharded once the
    ``gather`` axes are all-gathered (an entry, or None), and those gathered axes."""
    axes = entry if isinstance(entry, tuple) else (entry,)
    axes = tuple(a for a in axes if a is not None)
    kept = tuple(a for a in axes if a not in gather)
    return (kept[0] if len(kept) == 1 else (kept or None)), tuple(a for a in axes if a in gather)


def _partition(gather, mesh, arg_shapes, result_shape):
    arg = arg_shapes[0]
    sharding = arg.sharding
    if not isinstance(sharding, NamedSharding):  # not decodable to mesh axes: leave it
        return mesh, lambda w: w, sharding, (sharding,)
    spec = _entries(sharding.spec, len(arg.shape))
    split = [split_axes(e, gather) for e in spec]
    out = NamedSharding(sharding.mesh, P(*(kept for kept, _ in split)))

    def lower(w):
        # minor axes first: a dim sharded over ("a", "b") is gathered "b" then "a"
        for dim, (_, axes) in enumerate(split):
            for axis in reversed(axes):
                w = jax.lax.all_gather(w, axis, axis=dim, tiled=True)
        return w

    return sharding.mesh, lower, out, (sharding,)


def _infer(gather, mesh, arg_shapes, result_shape):
    sharding = arg_shapes[0].sharding
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = _entries(sharding.spec, len(arg_shapes[0].shape))
    return NamedSharding(sharding.mesh, P(*(split_axes(e, gather)[0] for e in spec)))


@functools.lru_cache(maxsize=None)
def _op(ndim: int):
    """The identity on rank-``ndim`` arrays, partitioned by `_partition`."""

    @functools.partial(custom_partitioning, static_argnums=(1,))
    def gather(w, axes):
        del axes
        return w

    # Independent factors in and out: the operand's sharding is not propagated to the
    # result (which is gathered), nor the GEMM's wishes back onto the operand.
    letters = "abcdefgh"[:ndim], "ijklmnop"[:ndim]
    gather.def_partition(
        partition=_partition,
        infer_sharding_from_operands=_infer,
        sharding_rule=f"{' '.join(letters[0])} -> {' '.join(letters[1])}",
    )
    return gather


def gather_fsdp(w: jax.Array) -> jax.Array:
    """``w`` all-gathered over the FSDP axes (`current_axes`) it is sharded over (decided when
    the step is compiled; the identity where it is not sharded over them)."""
    if not 1 <= w.ndim <= 8:
        return w
    return _op(w.ndim)(w, current_axes())


def check_auto_axes(owner: str, **arrays) -> None:
    """Raise a clear error when an array is sharded over an Explicit mesh axis (``jax.make_mesh``'s
    default in newer JAX): fp8jax's sharded ops are written for GSPMD (Auto) axes, and JAX's
    explicit-sharding type checks reject the FP8 GEMMs' operand layouts deep inside."""
    for name, a in arrays.items():
        sharding = getattr(jax.typeof(a), "sharding", None)
        mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", ())
        types = dict(zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ())))
        used = [x for e in spec for x in (e if isinstance(e, tuple) else (e,)) if x is not None]
        explicit = [x for x in used if "Explicit" in str(types.get(x, ""))]
        if explicit:
            raise ValueError(
                f"{owner}: {name} {jax.typeof(a).str_short()} is sharded over Explicit mesh "
                f"axes {explicit}; fp8jax's sharded FP8 ops need Auto (GSPMD) axes: build the "
                "mesh with jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,)"
                " * len(names)) or jax.sharding.Mesh(devices, names)."
            )
