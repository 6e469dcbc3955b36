"""Portable Triton kernels for the ``fp8_snapmla`` cache (any CUDA GPU with FP8 MMA, sm_89+)."""
