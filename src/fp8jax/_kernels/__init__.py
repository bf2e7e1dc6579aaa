"""Kernels behind the ops, one seam per family, each with its plain-JAX reference.
Implementation: the public part is `gemm`'s ``tuning`` (see ``docs/architecture.md``).

- `dispatch`: the one rule that picks a family's kernel or its reference (``backend``).
- `gemm`: the per-tensor FP8 GEMM and cast seam (XLA/cuBLASLt), and its `tuning` choices.
- `cast`: one-pass Pallas Triton cast into both FP8 layouts, with the amax.
- `tile_cast`: Pallas Triton casts of the row- and block-wise recipes (both layouts).
- `block_scales`: block scales per row, shared by the block-scaled GEMM and its kernel.
- `blockwise_gemm`: block-scaled FP8 GEMM: the reference and the dispatch to the kernel.
- `blockwise_gemm_mgpu`: the Hopper block-scaled GEMM kernel (Pallas Mosaic GPU, wgmma).
- `blockwise_grouped_mgpu`: its grouped-expert versions (forward/dgrad rows; wgrad).
- `grouped_gemm`: Hopper grouped GEMM kernels (Pallas Mosaic GPU) for MoE experts.
- `gated_activation`: Pallas Triton gated activation + FP8 cast of the FusedMLP core.
- `cudnn_attention`: cuDNN FP8 flash-attention custom calls.
- `flash_fp8_mgpu`: a Hopper FP8 flash-attention forward (Pallas Mosaic GPU, wgmma).
- `flash_fp8_bwd_mgpu`: its backward (dK/dV and dQ kernels, bf16 or e4m3 wgmma).
- `flash_fp8_bwd_parts`: the pieces its two kernels share (wgmma, TMA ring, call).
- `flash_fp8_layout`: register layouts and the causal grid order both directions share.
- `flash_fp8_vjp`: the two joined by a ``custom_vjp`` (`flash_fp8_attention`).
- `key_transpose`: their K-major operands (``[B, S, H, D] -> [B, H, D, S]``) in one pass.
"""
