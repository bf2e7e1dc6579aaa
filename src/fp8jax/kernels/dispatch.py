"""The one rule by which every kernel family picks kernel or plain-JAX reference.

Backends are named the same way everywhere: ``"auto"`` runs the kernel where it can run
this call and the reference elsewhere, ``"kernel"`` runs the kernel or raises a clear
error, ``"reference"`` runs the plain-JAX reference (any platform, the tests' oracle).
Each family keeps its older name for ``"kernel"`` as an alias (``"pallas"`` for the grouped
GEMM, ``"cudnn"`` for attention), so existing code keeps working.
"""

from __future__ import annotations

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
