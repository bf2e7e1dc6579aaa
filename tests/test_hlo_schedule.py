"""benchmarks.hlo_schedule: what XLA scheduled beside each collective, read from a scheduled
HLO module's text (a GPU step's ``compiled.as_text()``; written out here, since CPU programs
keep their collectives synchronous)."""

from benchmarks.hlo_schedule import collective_schedule

MODULE = """HloModule jit_step, is_scheduled=true, entry_computation_layout={(bf16[8,4]{1,0})->bf16[4,4]{1,0}}

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %sum = bf16[] add(%a, %b)
}

%a2a_body (p: bf16[8,4]) -> bf16[8,4] {
  %p = bf16[8,4]{1,0} parameter(0)
  ROOT %all-to-all.1 = bf16[8,4]{1,0} all-to-all(%p), dimensions={0}
}

ENTRY %main.1_spmd (x: bf16[8,4]) -> bf16[4,4] {
  %x = bf16[8,4]{1,0} parameter(0)
  %reduce-scatter.1 = bf16[4,4]{1,0} reduce-scatter(%x), dimensions={0}, to_apply=%add
  %reduce-scatter-start.2 = ((bf16[8,4]{1,0}), bf16[4,4]{1,0}) reduce-scatter-start(%x), dimensions={0}, to_apply=%add
  %cublas-gemm.1 = (bf16[8,8]{1,0}, s8[64]{0}) custom-call(%x, %x), custom_call_target="__cublas$lt$matmul$f8"
  %reduce-scatter-done.2 = bf16[4,4]{1,0} reduce-scatter-done(%reduce-scatter-start.2)
  %all-gather-start = ((bf16[4,4]{1,0}), bf16[8,4]{1,0}) all-gather-start(%reduce-scatter.1), dimensions={0}
  %bitcast.1 = bf16[4,4]{1,0} bitcast(%reduce-scatter.1)
  %get-tuple-element.1 = bf16[8,8]{1,0} get-tuple-element(%cublas-gemm.1), index=0
  %all-gather-done = bf16[8,4]{1,0} all-gather-done(%all-gather-start)
  %all-gather-start.1 = ((bf16[4,4]{1,0}), bf16[8,4]{1,0}) all-gather-start(%bitcast.1), dimensions={0}
  %loop_add_fusion = bf16[4,4]{1,0} fusion(%bitcast.1, %bitcast.1), kind=kLoop, calls=%add
  %all-gather-done.1 = bf16[8,4]{1,0} all-gather-done(%all-gather-start.1)
  %async-start = ((bf16[8,4]{1,0}), bf16[8,4]{1,0}, s32[]) async-start(%x), calls=%a2a_body
  %pallas_call.1 = f8e4m3fn[8,4]{1,0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton"
  %async-done = bf16[8,4]{1,0} async-done(%async-start)
  ROOT %out = bf16[4,4]{1,0} add(%reduce-scatter-done.2, %loop_add_fusion)
}
"""


def test_each_collective_is_classed_by_what_runs_beside_it():
    """A synchronous reduce-scatter and one beside a cuBLAS GEMM; an all-gather with only
    bookkeeping between its start and done, one beside an XLA fusion; an all-to-all (its
    async wrapper names it in its callee) beside a Pallas kernel. The all-to-all inside the
    wrapper's body is not counted again as synchronous: a body computation holds it."""
    got = collective_schedule(MODULE)
    assert got["reduce-scatter"] == {"sync": 1, "alone": 0, "other": 0, "kernel": 1}
    assert got["all-gather"] == {"sync": 0, "alone": 1, "other": 1, "kernel": 0}
    assert got["all-to-all"]["kernel"] == 1
    assert set(got) == {"reduce-scatter", "all-gather", "all-to-all"}


def test_a_program_without_collectives_has_none():
    assert collective_schedule("HloModule m\n\nENTRY %e (x: f32[]) -> f32[] {\n"
                               "  ROOT %x = f32[] parameter(0)\n}\n") == {}  # fmt: skip
