"""The one rule by which every kernel family picks kernel or plain-JAX reference.

Backends are named the same way everywhere: ``"auto"`` runs the kernel where it can run
this call and the reference elsewhere, ``"kernel"`` runs the kernel or raises a clear
error, ``"reference"`` runs the plain-JAX reference (any platform, the tests' oracle).
Each family keeps its older name for ``"kernel"`` as an alias (``"pallas"`` for the grouped
GEMM, ``"cudnn"`` for attention), so existing code keeps working.
"""

from __future__ import annotations

import jax

BACKENDS = ("auto", "kernel", "reference")
ALIASES = {"pallas": "kernel", "cudnn": "kernel"}


def check(owner: str, backend, accepted: tuple[str, ...] = BACKENDS) -> str:
    """``backend`` as one of `BACKENDS` (aliases mapped), else a ValueError naming ``owner``
    and the names it accepts."""
    name = ALIASES.get(backend, backend) if isinstance(backend, str) else None
    if backend not in accepted and name not in BACKENDS:
        raise ValueError(f"{owner}: backend must be one of {accepted}, got {backend!r}.")
    return name


def choose(owner: str, backend, why_not: str | None, accepted: tuple[str, ...] = BACKENDS) -> str:
    """``"kernel"`` or ``"reference"`` for one call. ``why_not``: why the kernel cannot run
    it (version, platform, shape, dtype), or None when it can."""
    backend = check(owner, backend, accepted)
    if backend == "reference":
        return "reference"
    if why_not is None:
        return "kernel"
    if backend == "kernel":
        raise ValueError(
            f"{owner}: the kernel cannot run this call ({why_not}); "
            "use backend='auto' or backend='reference'."
        )
    return "reference"


def unpartitioned_reason() -> str | None:
    """Why one of our Pallas / Mosaic GPU kernels should not run in the program being traced,
    or None. Their custom calls have no partitioning rule: in a program over several devices
    XLA would hand each device the whole operands (all-gathered) and run the kernel on them.
    They run when one device is visible, or inside a `jax.shard_map` that makes every mesh
    axis manual (the kernel then sees its own shard); elsewhere the XLA path runs, which
    partitions. (cuDNN's bf16 attention partitions by JAX's rule; its FP8 attention runs per
    device where the model was placed: `fp8jax._ops.attention.AttnSplit`.)"""
    if jax.device_count() == 1:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and set(mesh.manual_axes) == set(mesh.axis_names):
        return None
    return (
        f"{jax.device_count()} devices and no shard_map around the call: the kernel's custom "
        "call has no partitioning rule, so XLA would run it on whole arrays on every device"
    )
