"""Custom-VJP FP8 ops on canonical operands: `dot` (linear layers), `grouped` (MoE
experts), `attention` (cuDNN FP8 attention), `gated` (the FusedMLP core). Internal: the
modules in `fp8jax.nn` and `fp8jax.Fp8DotGeneral` call them."""
