"""Custom-VJP FP8 ops on canonical operands. Implementation: the modules in `fp8jax.nn`
and `fp8jax.Fp8DotGeneral` call them.

- `dot`: the linear layers' FP8 GEMM (forward, dgrad, wgrad) on 3-D operands.
- `traced`: how the ops are traced (once per context; vmapped axes folded into rows).
- `state_update`: the FP8 state a use proposes after its step (scales, amaxes, anomalies).
- `gated`: the FusedMLP core (fc1 -> gated activation -> fc2) as one custom VJP.
- `saved_fp8`: an activation kept for the backward as e4m3 + scale (fc1's output).
- `attention`: FP8 flash attention (cuDNN; plain-JAX reference).
- `attention_mgpu`: its opt-in ``"mgpu"`` backend (fp8jax's own Hopper FP8 flash attention).
- `grouped`: MoE experts' grouped GEMMs, the FP8 and bf16 custom VJPs.
- `grouped_tiled`: the grouped GEMMs under the row- and block-wise recipes.
- `grouped_gemms`: the grouped GEMMs themselves (kernel or reference, tile choices).
- `group_layout`: the padded row layout of the experts' rows.
- `expert_parallel`: grouped GEMMs per device on its own experts (``shard_map``).
- `token_dispatch`: MoE's all-to-all token dispatch (FP8 or bf16 rows) and bf16 combine.
- `fsdp`: FP8 all-gather of user-placed FSDP weights (``custom_partitioning``).
- `sequence_parallel`: Megatron sequence parallelism: FP8 token gathers, reduce-scatters.
- `tp_ring`: the same as collective matmul: ``ppermute`` rings around the FP8 GEMMs.
- `rows`: our kernels per device on its own token rows (``shard_map``).
"""
