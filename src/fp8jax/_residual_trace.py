"""How `fp8jax._residuals` reads a vjp's jaxpr: where a residual comes from (`origin`: the
primitive, checkpoint name, source line and the calls around it) and which logical tensor it
holds (`Tensors`: through reshapes, transposes, casts and an FP8 cast's scaling)."""

from __future__ import annotations

import math

from jax.extend import core as jax_core

from . import _jax_compat


def origin(tensors: Tensors, jaxpr, v) -> tuple[str, str | None, str, list[str]]:
    """(primitive, checkpoint name, source line, the calls around it) of the computation
    of ``v``: as JAX's print_saved_residuals, through reduce_precision and a checkpoint
    name (kept as the name); further, into the calls (jit, scan, custom_vjp, ...) to the
    equation inside that computed it (the line: the innermost one JAX knows)."""
    name, calls, line = None, [], "unknown"
    producers = tensors.producers(jaxpr)
    eqn, j = producers[v]
    while True:
        line = _jax_compat.source_line(eqn) or line  # the innermost line known
        if eqn.primitive.name == "reduce_precision" or _checkpoint_name(eqn):
            name = name or _checkpoint_name(eqn)
            v = eqn.invars[0]
        else:
            inner = _inner_jaxpr(eqn)
            if inner is None:
                break
            calls.append(_primitive(eqn))
            producers, v = tensors.producers(inner), inner.outvars[j]
        if is_literal(v) or v not in producers:  # an operand passed through: stop here
            break
        eqn, j = producers[v]
    return _primitive(eqn), name, line, calls


def _primitive(eqn) -> str:
    """The primitive's name, with the called function's for a call (``jit f``)."""
    name = eqn.primitive.name
    called = eqn.params.get("name")
    return f"{name} {called}" if isinstance(called, str) else name


def _checkpoint_name(eqn) -> str | None:
    """The ``jax.ad_checkpoint.checkpoint_name`` an equation gives its operand, if it is
    one (the ``name`` primitive; a ``CheckpointName`` high-level primitive in newer JAX)."""
    if eqn.primitive.name == "name":
        return eqn.params.get("name")
    hi = eqn.params.get("_prim")
    return getattr(hi, "name", None) if type(hi).__name__ == "CheckpointName" else None


def is_literal(v) -> bool:
    literal = getattr(jax_core, "Literal", None)
    return isinstance(v, literal) if literal is not None else hasattr(v, "val")


def _count(v) -> int:
    return math.prod(v.aval.shape)


def is_fp8(dtype) -> bool:
    return str(dtype).startswith("float8")


# Primitives whose output holds the values of their first operand (``broadcast_in_dim``:
# where the element count stays, a unit dim added).
_SAME = set(
    "broadcast_in_dim convert_element_type copy copy_p device_put expand_dims mesh_cast "
    "name reduce_precision reshape reshard sharding_constraint squeeze transpose".split()
)
_POSITIONAL = {"optimization_barrier", "device_put"}
_NO_CALL = {"while", "cond"}  # their inner jaxprs do not line up with their operands


class Tensors:
    """Which logical tensor a jaxpr variable holds: the variable it was made from by
    layout changes (reshape, transpose, squeeze, ...), dtype casts, a scalar scale, and an
    FP8 cast's saturation and scaling (by a scale of any shape), followed back
    through the calls in the jaxpr (jit, custom_vjp/vmap, checkpoint, a scan's per-step
    outputs). Two residuals with the same root hold the same values in two layouts or
    precisions; an activation function, a norm or a sum ends the walk."""

    def __init__(self):
        self._producers: dict[int, tuple] = {}  # id(jaxpr) -> (jaxpr, {var: (eqn, j)})
        self._calls: dict[tuple, tuple] = {}  # (id(jaxpr), j, fp8) -> where outvar j ends

    def producers(self, jaxpr) -> dict:
        if id(jaxpr) not in self._producers:
            found = {v: (e, j) for e in jaxpr.eqns for j, v in enumerate(e.outvars)}
            self._producers[id(jaxpr)] = (jaxpr, found)
        return self._producers[id(jaxpr)][1]

    def root(self, jaxpr, v) -> tuple:
        """A hashable key of ``v``'s tensor."""
        end = self._walk(jaxpr, v, False)
        if end[0] == "call":
            return end[:2]
        # a walk may end at a literal (a cast of a constant): unhashable, its own tensor
        return ("literal", id(end[1])) if is_literal(end[1]) else ("var", end[1])

    def _walk(self, jaxpr, v, fp8: bool) -> tuple:
        """``("var", var, fp8)``: the variable of ``jaxpr`` the walk from ``v`` ends at;
        ``("call", key)``: it ends inside a call of ``jaxpr`` (``key`` names where)."""
        producers = self.producers(jaxpr)
        while not is_literal(v) and v in producers:
            eqn, j = producers[v]
            step = self._step(producers, eqn, j, fp8)
            if step is None:
                inner = _inner_jaxpr(eqn)
                if inner is None:
                    break
                end = self._call(inner, j, fp8)
                if end[0] == "call":
                    return ("call", (id(eqn), end[1]))
                i, fp8_in = end[1], end[2]
                if not _scan_step(eqn, i, j) or _count(eqn.invars[i]) != _count(v):
                    break
                v, fp8 = eqn.invars[i], fp8_in
                continue
            i, fp8 = step
            v = eqn.invars[i]
        return ("var", v, fp8)

    def _call(self, jaxpr, j: int, fp8: bool) -> tuple:
        """Where the walk from a call's ``j``-th output ends: ``("in", i, fp8)`` at its
        ``i``-th operand, or ``("call", key)`` inside it."""
        key = (id(jaxpr), j, fp8)
        if key not in self._calls:
            self.producers(jaxpr)  # keeps ``jaxpr`` alive while its id is a key
            end = self._walk(jaxpr, jaxpr.outvars[j], fp8)
            invars = {v: i for i, v in enumerate(jaxpr.invars)}
            if end[0] == "var" and not is_literal(end[1]) and end[1] in invars:
                self._calls[key] = ("in", invars[end[1]], end[2])
            else:
                self._calls[key] = ("call", end[1] if end[0] == "call" else ("var", end[1]))
        return self._calls[key]

    @staticmethod
    def _step(producers, eqn, j: int, fp8: bool) -> tuple[int, bool] | None:
        """``(i, fp8)``: ``eqn``'s ``j``-th output holds its ``i``-th operand's values;
        None where it does not (or the primitive is a call: `_inner_jaxpr`)."""
        p, ins, out = eqn.primitive.name, eqn.invars, eqn.outvars[j]
        if p in _POSITIONAL:
            i = j
        elif p in _SAME or _checkpoint_name(eqn):
            i = 0
        elif p == "clamp" and fp8:  # clamp(lo, x, hi): an FP8 cast's saturation
            i = 1 if len(ins) == 3 and all(_scalar(ins[k]) for k in (0, 2)) else None
        elif p in ("max", "min") and fp8:  # jnp.clip's halves
            i = next((k for k in (0, 1) if _scalar(ins[1 - k])), None)
        elif p in ("mul", "div"):  # x * s, s * x, x / s
            sides = (0, 1) if p == "mul" else (0,)
            i = next((k for k in sides if _is_scale(producers, ins[1 - k], out, fp8)), None)
            fp8 = False  # one scale per cast
        else:
            return None
        if i is None or i >= len(ins) or is_literal(ins[i]) or _count(ins[i]) != _count(out):
            return None
        if p == "convert_element_type" and is_fp8(out.aval.dtype):
            fp8 = True  # walking back into an FP8 cast: its scale may have any shape
        return i, fp8


def _scalar(v) -> bool:
    return is_literal(v) or _count(v) == 1


def _is_scale(producers, s, out, fp8: bool) -> bool:
    """Whether ``s`` scales ``out``'s tensor without changing which one it is: a scalar,
    or (inside an FP8 cast) a smaller array of scales, possibly broadcast first."""
    if _scalar(s) or (fp8 and _count(s) < _count(out)):
        return True
    if is_literal(s) or s not in producers:
        return False
    eqn = producers[s][0]
    if eqn.primitive.name != "broadcast_in_dim":
        return False
    src = eqn.invars[0]
    return _scalar(src) or (fp8 and _count(src) < _count(out))


def _inner_jaxpr(eqn):
    """The jaxpr a call equation runs, if its operands and results line up with the
    jaxpr's inputs and outputs (jit, custom_vjp/jvp/vmap, checkpoint, scan, ...)."""
    if eqn.primitive.name in _NO_CALL:
        return None
    for value in eqn.params.values():
        inner = value.jaxpr if isinstance(value, jax_core.ClosedJaxpr) else value
        if (
            isinstance(inner, jax_core.Jaxpr)
            and len(inner.invars) == len(eqn.invars)
            and len(inner.outvars) == len(eqn.outvars)
        ):
            return inner
    return None


def _scan_step(eqn, i: int, j: int) -> bool:
    """For a scan: only a per-step output made from a per-step input is the same tensor
    (a carry is not its initial value)."""
    if eqn.primitive.name != "scan":
        return True
    carry = eqn.params.get("num_carry", 0)
    return j >= carry and i >= eqn.params.get("num_consts", 0) + carry
