"""The pieces `flash_fp8_bwd_mgpu`'s two kernels share (Pallas Mosaic GPU): ``wgmma`` of
shared-memory or register operands (a dot in interpret mode), the memory warpgroup's TMA
ring with its barriers, the release of ring slots a warpgroup skips, the kernel call."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .. import _jax_compat
from . import grouped_gemm as _gg

pl, plgpu = _gg.pl, _gg.plgpu
F32 = jnp.float32
COMPUTE_WGS = 2  # compute warpgroups per CTA (the third one loads)


def mma(acc, a, b_smem, transpose_b: bool, interpret: bool):
    """``acc + a @ B`` in float32 on ``wgmma``, ``B`` the ``b_smem`` tile or its transpose;
    ``acc`` a shape for a zero accumulator, ``a`` a shared-memory tile or bf16 registers."""
    if interpret:  # a dot stands in for the wgmma
        dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
        r = lax.dot_general(a[...], b_smem[...], dims, preferred_element_type=F32)
        return r if isinstance(acc, tuple) else acc + r
    b_op = _gg._transposed(b_smem) if transpose_b else b_smem
    if isinstance(acc, tuple):

        def scope(acc_ref):
            plgpu.wgmma(acc_ref, a, b_op)
            return acc_ref[...]

        return pl.run_scoped(scope, plgpu.ACC(acc, F32))

    def compute(acc_ref):
        plgpu.wgmma(acc_ref, a, b_op)

    return pl.run_state(compute)(plgpu.ACC.init(acc))


def mmas(*specs, interpret: bool):
    """`mma` of each ``(acc, a, b_smem, transpose_b)``, the ``wgmma`` issued together and
    waited for once."""
    if interpret:
        return tuple(mma(*spec, interpret) for spec in specs)
    zeros = lambda shape: plgpu.layout_cast(jnp.full(shape, 0, F32), plgpu.Layout.WGMMA)  # noqa: E731
    accs = tuple(plgpu.ACC.init(zeros(acc) if isinstance(acc, tuple) else acc) for acc, *_ in specs)

    def compute(refs):
        for ref, (_, a, b_smem, transpose_b) in zip(refs, specs):
            plgpu.wgmma(ref, a, _gg._transposed(b_smem) if transpose_b else b_smem)

    return pl.run_state(compute)(accs)


def load_row(ref, dim: int, interpret: bool):
    """A ``[n]`` float32 vector from shared memory, laid out to broadcast along ``dim`` of
    a ``wgmma`` tile."""
    return ref[...] if interpret else plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(dim))


def ring(step, steps: int):
    return lax.rem(step, jnp.array(steps, jnp.int32))


def wait_all(barriers, slot):
    for bar in barriers:
        plgpu.barrier_wait(bar.at[slot])


def loader(n_steps, steps: int, loads, consumed, interpret: bool):
    """The memory warpgroup: stream ``n_steps`` blocks into a ring of ``steps`` slots,
    ``loads`` ``(src(step) -> gmem view, smem ring, barriers)``, a slot refilled once both
    compute warpgroups arrived on its ``consumed`` barrier."""
    plgpu.set_max_registers(40, action="decrease")

    def load(step, slot):
        for src, smem, bar in loads:
            plgpu.copy_gmem_to_smem(src(step), smem.at[slot], bar.at[slot])

    for i in range(steps):

        @pl.when(i < n_steps)
        def _():
            load(i, i)

    @pl.loop(0, n_steps - steps)
    def _refill(step):
        slot = ring(step, steps)
        plgpu.barrier_wait(consumed.at[slot])
        load(step + steps, slot)

    if interpret:  # the interpreter wants every phase of a barrier waited for

        @pl.loop(jnp.maximum(n_steps - steps, 0), n_steps)
        def _drain(step):
            plgpu.barrier_wait(consumed.at[ring(step, steps)])


def release(first, last, steps: int, barriers, consumed):
    """Stream steps ``[first, last)`` this warpgroup does not need (the other may): wait
    for their loads, hand the slots back."""

    @pl.loop(first, last)
    def _(step):
        slot = ring(step, steps)
        wait_all(barriers, slot)
        plgpu.barrier_arrive(consumed.at[slot])


def call(entry, smem, barriers, out_type, grid, grid_names, interpret, args):
    def run(*refs):
        pl.run_scoped(lambda s, b: entry(*refs, s, b), smem, barriers, collective_axes="wg")

    extra = dict(interpret=_jax_compat.interpret_gpu_params()()) if interpret else {}
    return plgpu.kernel(
        run,
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **extra,
    )(*args)
