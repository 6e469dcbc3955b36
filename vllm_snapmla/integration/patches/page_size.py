"""H5: an ``fp8_snapmla`` MLA page holds 656 bytes per token.

What it changes: wraps ``MLAAttentionSpec.real_page_size_bytes`` (``vllm/v1/kv_cache_interface.
py``) so that specs with ``cache_dtype_str == "fp8_snapmla"`` report ``storage_block_size *
656`` (the block size: MLA specs store every token); every other spec gets the original
property.
Why: vLLM sizes the cache from ``head_size x dtype size`` (576 x 1 byte for FP8), which is not
our row (512 FP8 + 4-byte scale + 128 bytes of BF16 RoPE + pad).  It must hold in the engine
core, which plans the cache: the plugin entry point runs there too.
Checked by: ``patches.self_check`` (a spec's ``page_size_bytes`` is 64 x 656);
tests/unit/integration/patches/test_page_size.py.
Remove when: vLLM lets a backend state its page size.
"""

from __future__ import annotations

from vllm_snapmla import format as fmt
from vllm_snapmla.integration.patches._common import KV_CACHE_DTYPE, is_ours, mark_wrapper


def apply() -> None:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    original = MLAAttentionSpec.__dict__["real_page_size_bytes"].fget
    if is_ours(original):
        return

    def real_page_size_bytes(spec) -> int:
        if spec.cache_dtype_str == KV_CACHE_DTYPE:
            return spec.storage_block_size * fmt.BYTES_PER_TOKEN
        return original(spec)

    mark_wrapper(real_page_size_bytes, original)
    MLAAttentionSpec.real_page_size_bytes = property(real_page_size_bytes)
