"""Kernels behind the ops: `gemm` (the XLA/cuBLASLt FP8 GEMM and cast seam), `cast` (Pallas
cast + transpose + amax), `grouped_gemm` (Mosaic GPU grouped GEMM), `cudnn_attention`."""
