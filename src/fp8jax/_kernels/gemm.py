"""The FP8 cast and GEMM seam of the per-tensor path: XLA's GEMM (cuBLASLt on Hopper) and
its cast, or the Pallas cast kernel where ``cast_kernel`` asks for it and it can run.

Operands are ``[B, P, C]`` with both GEMM operands contracting on their minor dim (the
"TN" layout Hopper's FP8 GEMMs want).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from .. import _quant as q
from . import cast as _cast_kernel
from . import dispatch

# The public part: the lowering choices and their context manager (`benchmarks/README.md`,
# ``linear_tuning.py``); the rest is the ops' implementation.
__all__ = ["Tuning", "current_tuning", "tuning"]

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Lowering choices, each measured on the GPU (benchmarks/RESULTS.md), read when an op
    is traced; `tuning` sets them for a block of code (the tuning harness compares them in
    one run).

    Arguments:
        f32_gemm_out: the GEMM writes f32 and a multiply dequantizes it (default False).
        cast_transposed: the transposed FP8 copy is cast from the transposed
            high-precision tensor rather than transposed from the FP8 copy (False).
        scaled_gemm: cuBLASLt takes the scales where both operands come from the cast
            kernel (True).
        per_device_cast: on a mesh that splits a layer's tokens (data parallel, FSDP), each
            device casts its own tokens of the activations and output gradients (delayed
            per-tensor scaling: `fp8jax._recipe.PerTensor.quantize_rows`), so that the cast
            kernel can run; False: XLA partitions its own cast (True).
        sequence_cast: under Megatron sequence parallelism, the casts that write a
            transposed copy (a column-parallel layer's input and output gradient, a
            row-parallel layer's input) run per device the same way, their tokens or
            features split over the tensor axis, and `fp8jax.nn.FusedMLP`'s gated core
            runs per device (its activation kernels on each device's features); False:
            XLA's partitioned casts, transposes and activation (True).
        tp_chunks: with ``tp_overlap="chunks"``, how many chunks each device's tokens move
            in (`fp8jax._ops.tp_ring.chunk_count`; 2).
    """

    # GEMM writes f32, then the dequant multiply. XLA does not fold that into the
    # cuBLASLt call, so the step is slower than writing bf16 directly (benchmarks/RESULTS.md,
    # "Linear layer train step": the "GEMM writes f32" row).
    f32_gemm_out: bool = False
    # Produce the transposed (column-wise) FP8 copies by casting the transposed
    # high-precision tensor (one fused read) rather than transposing the FP8 copy.
    cast_transposed: bool = False
    # Hand the scales to cuBLASLt (`scaled_fp8_gemm`) instead of a multiply after the GEMM,
    # where both operands come from the cast kernel (`takes_scales`). The linear step got
    # faster (one pass less per GEMM) with every GEMM still FP8; operands of XLA's casts lose
    # the pattern at some shapes (some GEMMs fell back to bf16), so those keep the multiply
    # (benchmarks/RESULTS.md, "Scales into cuBLASLt, by default", 2026-11-26 twelfth session).
    scaled_gemm: bool = True
    # Activation and output-gradient casts per device on its tokens under shard_map, where
    # the Pallas kernel can run (XLA cannot partition its custom call): `fp8jax._ops.rows`.
    per_device_cast: bool = True
    # The same under sequence parallelism, on the tensor axis too (`fp8jax._ops.dot`), and
    # the gated MLP core there (`fp8jax._ops.gated`): the tensor-parallel FP8 step on GPUs
    # sped up by a fifth (benchmarks/RESULTS.md, twenty-seventh session).
    sequence_cast: bool = True
    # Chunks per device of a sequence-parallel layer's token moves under
    # ``tp_overlap="chunks"`` (`fp8jax._ops.tp_ring`): one chunk's collective may run beside
    # another chunk's GEMM (measured slower than whole moves: benchmarks/RESULTS.md,
    # twenty-eighth session).
    tp_chunks: int = 2

    def __post_init__(self):
        chunks = self.tp_chunks
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"Tuning: tp_chunks must be a positive int, got {chunks!r}")


_TUNING: contextvars.ContextVar[Tuning] = contextvars.ContextVar("fp8jax_gemm", default=Tuning())


def current_tuning() -> Tuning:
    """The `Tuning` in effect here (the defaults outside any `tuning` block).

    Arguments:
        none.

    Returns:
        The `Tuning` an op traced now reads.
    """
    return _TUNING.get()


@contextlib.contextmanager
def tuning(**choices: bool | int) -> Iterator[Tuning]:
    """Trace FP8 ops with these `Tuning` fields changed, inside the ``with`` block
    (``with tuning(scaled_gemm=False): ...``). The ops' cached traces are keyed by it
    (`fp8jax._ops.dot`); a step jitted before the block is not traced again by entering it.
    A field `Tuning` does not have raises TypeError; a ``tp_chunks`` that is not a positive
    int raises ValueError.

    Arguments:
        choices: `Tuning` fields and their values.

    Returns:
        A context manager yielding the `Tuning` in force inside the block.
    """
    token = _TUNING.set(dataclasses.replace(_TUNING.get(), **choices))
    try:
        yield _TUNING.get()
    finally:
        _TUNING.reset(token)


def gemm(a, b, out_dtype, precision=None):
    """[B,P,C] x [B,Q,C] -> [B,P,Q], both operands contracting on their minor dim."""
    if a.shape[0] == 1:
        out = jax.lax.dot_general(a[0], b[0], (((1,), (1,)), ((), ())), precision, out_dtype)
        return out[None]
    return jax.lax.dot_general(a, b, (((2,), (2,)), ((0,), (0,))), precision, out_dtype)


def gemm_precision(fast_accumulation: bool):
    """The ``dot_general`` precision of an FP8 GEMM: ``None`` lets cuBLASLt keep fast
    partial sums, ``Precision.HIGHEST`` asks for its promoted accumulator."""
    return None if fast_accumulation else jax.lax.Precision.HIGHEST


def fp8_gemm(a, a_scale, b, b_scale, out_dtype, fast_accumulation: bool):
    """FP8 GEMM of ``a`` and ``b``, dequantized by their (scalar) scales after it.

    ``fast_accumulation=False`` asks for ``Precision.HIGHEST``, which XLA turns into
    cuBLASLt's promoted ("split") FP8 accumulator; the fast one keeps partial sums
    in the tensor cores' reduced precision (with products of one sign an order of
    magnitude more error; the promoted one costs a few percent more GEMM time:
    benchmarks/RESULTS.md, "FP8 accumulation, the one-pass cast kernel, and the trainer").
    """
    acc_dtype = F32 if current_tuning().f32_gemm_out else out_dtype
    y = gemm(a, b, acc_dtype, gemm_precision(fast_accumulation))
    scale = (a_scale * b_scale).reshape(()).astype(F32)
    return (y.astype(F32) * scale).astype(out_dtype)


def gemm_scale(scale):
    """The scale an FP8 GEMM operand is cast and dequantized with: ``scale`` rounded up to the
    nearest bfloat16 value when `scaled_fp8_gemm` hands it to cuBLASLt (XLA's pattern takes
    the scale in the GEMM's bf16 compute type; rounding it the same way for the cast keeps
    cast and dequantization exactly consistent, and rounding up never overflows FP8).
    Scales are positive and finite: adding 0xFFFF to the float32 bits and clearing the low
    16 rounds the magnitude up to the bf16 grid."""
    if not current_tuning().scaled_gemm:
        return scale
    # lax ops on numpy constants: traced several times per op, a quarter of jnp's cost
    bits = jax.lax.bitcast_convert_type(scale.astype(F32), np.uint32)
    bits = jax.lax.bitwise_and(jax.lax.add(bits, np.uint32(0xFFFF)), np.uint32(0xFFFF0000))
    return jax.lax.bitcast_convert_type(bits, F32)


def takes_scales(a_shape, b_shape, cast_kernel: bool, out_dtype=jnp.bfloat16) -> bool:
    """Whether `scaled_fp8_gemm` hands the scales to cuBLASLt for operands of these
    ``[B, P, C]`` shapes: on the GPU, with `Tuning.scaled_gemm`, a bf16 output, and
    both operands from the Pallas cast kernel (its support is the same for a tensor and its
    transpose). XLA's GEMM rewriter took the pattern for those at every shape measured."""
    if not (current_tuning().scaled_gemm and cast_kernel) or jax.default_backend() != "gpu":
        return False
    if jnp.dtype(out_dtype) != jnp.dtype(jnp.bfloat16):
        return False
    return all(_cast_kernel.supported(tuple(s))[0] for s in (a_shape, b_shape))


def scaled_fp8_gemm(
    a, a_scale, b, b_scale, out_dtype, fast_accumulation: bool, cast_kernel: bool = True
):
    """FP8 GEMM whose scales cuBLASLt applies (its A/B scale pointers), with no dequantizing
    pass over the output; the scales must come from `gemm_scale`.

    Written as XLA's FP8 pattern, ``dot(convert(a) * sa, convert(b) * sb)``, which its GEMM
    rewriter turns into one ``__cublas$lt$matmul$f8`` call taking ``sa`` and ``sb``. The
    barrier keeps each operand's cast from fusing into the converts, so the pattern stays
    visible. Where `takes_scales` says no (off the GPU, operands of XLA's casts) it is
    `fp8_gemm`: the same math, and the lowered program keeps its FP8 dot for `fp8jax.inspect`.
    """
    if not takes_scales(a.shape, b.shape, cast_kernel, out_dtype):
        return fp8_gemm(a, a_scale, b, b_scale, out_dtype, fast_accumulation)
    a, b = jax.lax.optimization_barrier((a, b))
    a = a.astype(out_dtype) * a_scale.reshape(()).astype(out_dtype)
    b = b.astype(out_dtype) * b_scale.reshape(()).astype(out_dtype)
    return gemm(a, b, out_dtype, gemm_precision(fast_accumulation))


def quantize_both(t, scale, dtype, cast_kernel: bool = False):
    """FP8 copies of ``t: [B, P, C]`` in both layouts (``[B, P, C]`` and ``[B, C, P]``)
    and ``max |t|`` (non-finite when ``t`` holds NaN/Inf). ``cast_kernel``: one Pallas
    pass (`fp8jax._kernels.cast`) where it can run, else XLA's cast + transpose; the kernel's
    amax comes as its per-tile maxima, reduced where it is used (`fp8jax._quant.combined_max`)."""
    ok, why = _cast_kernel.supported(t.shape) if cast_kernel else (False, "")
    if (
        dispatch.choose("cast", "auto" if cast_kernel else "reference", None if ok else why)
        == "kernel"
    ):
        return _cast_kernel.cast_transpose(t, scale, dtype, tiles=True)
    tq = q.quantize(t, scale, dtype)
    if current_tuning().cast_transposed:
        return tq, q.quantize(jax.lax.transpose(t, (0, 2, 1)), scale, dtype), q.amax(t)
    return tq, jax.lax.transpose(tq, (0, 2, 1)), q.amax(t)
