"""H4, H5 (``patches/storage_dtype.py``, ``patches/page_size.py``): the cache is stored as
``uint8`` and an ``fp8_snapmla`` MLA page holds 656 bytes a token; other dtypes keep vLLM's
sizes.

Functions named ``_in_vllm_*`` run inside a vLLM process on a fake CUDA platform
(``tests/unit/_vllm_cpu.py``); the tests call them through ``VllmCpuProcess.call``.
"""

KV = "fp8_snapmla"


def _in_vllm_page_sizes():
    import torch
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode

    def page(block_size, dtype, cache_dtype):
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576,
                                dtype=dtype, cache_dtype_str=cache_dtype,
                                kv_quant_mode=get_kv_quant_mode(cache_dtype))
        merged = MLAAttentionSpec.merge([spec, spec])
        assert merged.page_size_bytes == spec.page_size_bytes
        return spec.page_size_bytes

    return {"snapmla": page(64, torch.uint8, KV), "snapmla, 128": page(128, torch.uint8, KV),
            "bf16": page(64, torch.bfloat16, "auto"), "fp8": page(64, torch.uint8, "fp8"),
            "fp8_ds_mla": page(64, torch.uint8, "fp8_ds_mla"),
            "storage dtype": str(kv_cache_dtype_str_to_dtype(KV, None))}


def test_page_size_is_656_bytes_per_token(vllm_cpu):
    assert vllm_cpu.call(_in_vllm_page_sizes) == {
        "snapmla": 64 * 656, "snapmla, 128": 128 * 656,
        # other dtypes keep vLLM's own sizes
        "bf16": 64 * 576 * 2, "fp8": 64 * 576, "fp8_ds_mla": 64 * 656,
        "storage dtype": "torch.uint8"}
