"""What ``jax.vjp`` keeps for the backward of a function (`residuals_report`): each
residual's shape, dtype, bytes and origin, and which FP8 copies have a high-precision twin
(`ResidualsReport.bf16_copies_of_fp8_inputs`). Its names are public in `fp8jax.inspect`.

The residuals are read as JAX's ``print_saved_residuals`` reads them: the last outputs of
``jax.make_jaxpr`` of ``jax.vjp`` are the leaves of the backward's closure. The jaxpr also
tells where each one comes from (an argument, the primitive and source line that computed
it, its ``checkpoint_name``) and which logical tensor it holds (`_Tensors`).
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import math
import os
from typing import Any, Callable

import equinox as eqx
import jax

from . import _jax_compat
from ._residual_trace import Tensors as _Tensors
from ._residual_trace import is_fp8 as _is_fp8
from ._residual_trace import is_literal as _is_literal
from ._residual_trace import origin as _origin

__all__ = ["Residual", "ResidualsReport", "residuals_report"]

HIGH_PRECISION = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class Residual:
    """One array the backward keeps (`residuals_report` makes them).

    Arguments:
        shape, dtype: the array's.
        nbytes: its size in bytes.
        kind: ``"argument"`` (a differentiated input itself, e.g. a weight or a layer's
            FP8 state), ``"activation"`` (computed in the forward), ``"constant"`` (an
            array the function closes over), ``"literal"``, or ``"unknown"`` (the fallback
            below).
        source: where it comes from, in words: the argument's path (``"model.a.weight"``),
            or the primitive, checkpoint name and source line that computed it.
        primitive: the primitive that computed it (``"jit fp8_gemm_forward"`` for a jitted
            call); None for an argument, constant or literal.
        name: its ``jax.ad_checkpoint.checkpoint_name``, if it has one.
        line: ``file:line:column (function)`` of the computation (``"unknown"`` where
            this JAX cannot say).
        tensor: which logical tensor it holds: residuals with the same number hold the
            same values up to layout, a dtype cast and a cast's scale (`_Tensors`); None
            where the jaxpr could not be read.
    """

    shape: tuple[int, ...]
    dtype: Any
    nbytes: int
    kind: str
    source: str
    primitive: str | None = None
    name: str | None = None
    line: str = "unknown"
    tensor: int | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def is_fp8(self) -> bool:
        return _is_fp8(self.dtype)


@dataclasses.dataclass
class ResidualsReport:
    """Every residual ``jax.vjp`` keeps for a function's backward, with totals; printing
    it gives a table (equal rows merged, with their count) and the totals by dtype.

    Arguments:
        residuals: the residuals, in the order JAX keeps them.
        exact: whether they were read from the jaxpr (sources and tensors known), not
            from the fallback (shapes and dtypes only).
    """

    residuals: list[Residual]
    exact: bool = True

    def total_bytes(self, dim: int | None = None, kind: str | None = None) -> int:
        """Bytes of the residuals (with an axis of size ``dim``, of ``kind``, if given).

        Arguments:
            dim: count only residuals with an axis of this size (as
                `saved_activation_bytes`); None: all.
            kind: count only residuals of this `Residual.kind`; None: all.

        Returns:
            Their size in bytes.
        """
        return sum(
            r.nbytes
            for r in self.residuals
            if (dim is None or dim in r.shape) and (kind is None or r.kind == kind)
        )

    @property
    def by_dtype(self) -> dict[str, int]:
        """Bytes per dtype name, largest first."""
        return _totals((str(r.dtype) for r in self.residuals), self.residuals)

    @property
    def by_kind(self) -> dict[str, int]:
        """Bytes per `Residual.kind` (arguments apart from activations), largest first."""
        return _totals((r.kind for r in self.residuals), self.residuals)

    def bf16_copies_of_fp8_inputs(
        self, candidates: bool = False
    ) -> list[tuple[Residual, Residual]]:
        """The FP8 residuals (an FP8 GEMM's saved input or weight) whose tensor is also
        kept in bf16, f16 or f32: memory the FP8 copy was meant to save.

        A pair is proven when both residuals hold the same logical tensor
        (`Residual.tensor`: the same values up to reshape/transpose, dtype casts and a
        cast's scale, followed through the jaxpr and the calls inside it). What the walk
        cannot follow (a Pallas cast kernel, a per-row scaling outside an FP8 cast) is
        missed; ``candidates=True`` adds the high-precision residuals that may be a
        layout of the same tensor: the same element count and a last dim the other has
        (an FP8 GEMM keeps ``[1, M, K]`` or ``[1, K, M]`` of a ``[..., K]`` input), to
        check by their sources.

        Arguments:
            candidates: also list the unproven same-size pairs.

        Returns:
            ``(fp8 residual, high-precision residual)`` pairs, in the FP8 residuals' order.
        """
        pairs = []
        high = [r for r in self.residuals if str(r.dtype) in HIGH_PRECISION]
        for f in (r for r in self.residuals if r.is_fp8):
            for h in high:
                if (f.tensor is not None and f.tensor == h.tensor) or (
                    candidates and _same_size(f, h)
                ):
                    pairs.append((f, h))
        return pairs

    def __str__(self) -> str:
        rows = collections.Counter((r.nbytes, _short(r), r.kind, _where(r)) for r in self.residuals)
        total = self.total_bytes()
        lines = [
            f"{len(self.residuals)} residuals, {_size(total)}"
            + ("" if self.exact else " (sources unknown: read from the vjp's closure)"),
            f"  {'count':>5}  {'bytes':>12}  {'array':<26} {'kind':<10} source",
        ]
        for (nbytes, array, kind, where), n in rows.items():
            lines.append(f"  {n:>5}  {nbytes * n:>12,}  {array:<26} {kind:<10} {where}")
        lines.append(
            "  by dtype: " + ", ".join(f"{d} {_size(b)}" for d, b in self.by_dtype.items())
        )
        lines.append("  by kind: " + ", ".join(f"{k} {_size(b)}" for k, b in self.by_kind.items()))
        copies = self.bf16_copies_of_fp8_inputs()
        if copies:
            lines.append("  FP8 residuals also kept in high precision:")
            lines += [f"    {_short(f)} and {_short(h)}: {_where(h)}" for f, h in copies]
        return "\n".join(lines)

    __repr__ = __str__


def _same_size(f: Residual, h: Residual) -> bool:
    """Whether ``h`` may hold ``f``'s tensor in another layout (not proven)."""
    return (
        h.kind != "literal"
        and h.size == f.size
        and bool(h.shape and f.shape)
        and (h.shape[-1] in f.shape or f.shape[-1] in h.shape)
    )


def _totals(keys, residuals: list[Residual]) -> dict[str, int]:
    totals = collections.Counter()
    for key, r in zip(keys, residuals):
        totals[key] += r.nbytes
    return dict(totals.most_common())


def _short(r: Residual) -> str:
    return f"{getattr(r.dtype, 'name', r.dtype)}{list(r.shape)}"


def _where(r: Residual) -> str:
    """`Residual.source` with the file's directory left out."""
    if r.line == "unknown" or r.primitive is None or ":" not in r.line:
        return r.source
    path, _, rest = r.line.partition(":")
    return r.source.replace(r.line, f"{os.path.basename(path)}:{rest}")


def _size(nbytes: int) -> str:
    return f"{nbytes:,} B" if nbytes < 2**20 else f"{nbytes / 2**20:,.2f} MiB"


def residuals_report(fn: Callable, *args: Any, **kwargs: Any) -> ResidualsReport:
    """What ``jax.vjp(fn, *args)`` keeps for the backward (nothing is run: shapes only).

    Every array leaf of ``args`` and ``kwargs`` is differentiated, and so are the arrays
    of ``fn`` itself where it is a pytree (an equinox module: its parameters, as
    `saved_activation_bytes` counts them); other leaves are static. Arrays ``fn`` closes
    over are constants. Where this JAX's vjp jaxpr is not as expected, the report lists
    the leaves of the backward's closure (what `saved_activation_bytes` counts) with
    ``kind`` and ``source`` ``"unknown"`` (``exact=False``); where it has no source
    summary (a JAX internal), the lines read ``"unknown"``.

    Arguments:
        fn: the function (a loss, a model call) whose backward is inspected.
        args, kwargs: what to call it with.

    Returns:
        A `ResidualsReport`: each residual (shape, dtype, bytes, kind, source), the totals
        by dtype and kind, and `ResidualsReport.bf16_copies_of_fp8_inputs`.
    """
    if not callable(fn):
        raise TypeError(f"residuals_report: fn must be a callable, got {type(fn).__name__}.")
    own = fn if jax.tree_util.tree_leaves(eqx.filter(fn, eqx.is_array)) else None
    dynamic, static = eqx.partition((own, args, kwargs), eqx.is_array)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(dynamic)
    names = _positional_names(fn, args, kwargs)
    labels = [_label(path, names) for path, _ in paths_leaves]
    leaves = [leaf for _, leaf in paths_leaves]

    def call(*leaves):
        own, args, kwargs = eqx.combine(jax.tree_util.tree_unflatten(treedef, leaves), static)
        return (fn if own is None else own)(*args, **kwargs)

    def vjp(*leaves):
        return jax.vjp(call, *leaves)

    closed, (_, res_shapes) = jax.make_jaxpr(vjp, return_shape=True)(*leaves)
    avals = jax.tree_util.tree_leaves(res_shapes)
    if not _lines_up(closed.jaxpr, avals, leaves):
        return ResidualsReport(_unknown(avals), exact=False)
    outvars = closed.jaxpr.outvars[len(closed.jaxpr.outvars) - len(avals) :]
    return ResidualsReport(_read(closed.jaxpr, outvars, labels))


def _lines_up(jaxpr, avals: list, leaves: list) -> bool:
    """Whether the vjp's jaxpr is as `residuals_report` reads it (JAX's own
    ``saved_residuals`` reads it so): one input per leaf, the residuals its last outputs."""
    tail = jaxpr.outvars[len(jaxpr.outvars) - len(avals) :]
    return (
        len(avals) <= len(jaxpr.outvars)
        and len(jaxpr.invars) == len(leaves)
        and all(tuple(v.aval.shape) == tuple(a.shape) for v, a in zip(tail, avals))
    )


def _positional_names(fn: Callable, args: tuple, kwargs: dict) -> list[str]:
    """The parameter name of each positional argument (``args[i]`` where unknown), so a
    residual that is an argument reads by its parameter's name."""
    try:
        signature = inspect.signature(fn)
        signature.bind(*args, **kwargs)
    except (TypeError, ValueError):  # no signature, or one the call does not fit
        return [f"args[{i}]" for i in range(len(args))]
    names, star = [], None
    for p in signature.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            star = p.name
    names = names[: len(args)]
    return names + [f"{star}[{i}]" for i in range(len(args) - len(names))]


def _label(path, names: list[str]) -> str:
    """A leaf's path as ``name.attr[0]``: its parameter's name (``fn`` for the function's
    own arrays), then the pytree path inside it."""
    which, rest = path[0].idx, path[1:]
    if which == 0:
        head = "fn"
    elif which == 1:
        head, rest = names[rest[0].idx], rest[1:]
    else:
        head, rest = str(rest[0].key), rest[1:]
    return head + jax.tree_util.keystr(tuple(rest))


def _unknown(avals) -> list[Residual]:
    return [Residual(tuple(a.shape), a.dtype, _nbytes(a), "unknown", "unknown") for a in avals]


def _nbytes(aval) -> int:
    """An array's bytes; an extended dtype's (the FP8 state's MAX_GRAD) by its storage."""
    itemsize = getattr(aval.dtype, "itemsize", None)
    if itemsize is None:
        aval = _jax_compat.physical_aval(jax.core.ShapedArray(aval.shape, aval.dtype))
        itemsize = aval.dtype.itemsize
    return math.prod(aval.shape) * itemsize


# ----------------------------------------------------------------------------- the jaxpr
def _read(jaxpr, res_vars, labels: list[str]) -> list[Residual]:
    """The `Residual` of each of ``res_vars`` (the vjp jaxpr's residual outputs)."""
    tensors = _Tensors()
    arguments = dict(zip(jaxpr.invars, labels))
    constants = set(jaxpr.constvars)
    ids: dict = {}
    out = []
    for v in res_vars:
        shape, dtype, nbytes = tuple(v.aval.shape), v.aval.dtype, _nbytes(v.aval)
        if _is_literal(v):
            out.append(Residual(shape, dtype, nbytes, "literal", "a literal"))
            continue
        tensor = ids.setdefault(tensors.root(jaxpr, v), len(ids))
        if v in arguments:
            source = f"argument {arguments[v]}"
            out.append(Residual(shape, dtype, nbytes, "argument", source, tensor=tensor))
            continue
        if v in constants:
            out.append(Residual(shape, dtype, nbytes, "constant", "a constant", tensor=tensor))
            continue
        primitive, name, line, calls = _origin(tensors, jaxpr, v)
        source = primitive + (f" named {name!r}" if name else "") + f" at {line}"
        source += f" in {' > '.join(calls)}" if calls else ""
        out.append(
            Residual(shape, dtype, nbytes, "activation", source, primitive, name, line, tensor)
        )
    return out
