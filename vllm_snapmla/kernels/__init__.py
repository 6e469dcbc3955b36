"""The CUDA decode kernels behind ``vllm_snapmla.ops.decode``.

- ``sm90``: the Hopper kernels (``csrc/sm90/``), one op call per decode;
- ``triton_decode``: the portable Triton kernel (sm_89+: Ada, and anything without the sm_90a
  build);
- ``splits``: the split-KV planning and combine both use (``csrc/split_kv.h``).

Nothing here imports ``vllm_snapmla.ops`` or vLLM.
"""
