"""Every patch of vLLM 0.26.0 internals that ``fp8_snapmla`` needs: one module per patch.

vLLM 0.26.0 has no registry for new KV-cache dtypes (the dtype set is a closed ``Literal``
matched on strings in several modules), so we patch the few private names involved.  Each module
starts with its record: what it changes, why, how it is checked, and when it can go.  The hook
numbers (H1..H16) name the places in vLLM 0.26.0 that the plugin touches; H6-H8, H10, H11 and H16
need no patch (``integration/backend.py`` overrides), and H15
(``context_merge_bound``) corrects the metadata the backend's builder returns rather than
patching vLLM, though it reads vLLM's private prefill metadata.

Every patch is idempotent (a wrapper carries the function it wraps; the others add to or set
vLLM's tables), and ``self_check`` verifies the result right after patching, so a vLLM that
moved these names fails loudly at start-up.
Importing this package does not import vLLM; ``apply_all`` does.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from vllm_snapmla import format as fmt
from vllm_snapmla.integration.patches import (
    backend_selection,
    cache_dtype,
    page_size,
    rope_kvcache_fusion,
    storage_dtype,
)
from vllm_snapmla.integration.patches._common import KV_CACHE_DTYPE, literal_options


def apply_all() -> None:
    """Apply the patches every vLLM process needs (called by ``vllm_snapmla.register``)."""
    cache_dtype.apply()
    storage_dtype.apply()
    page_size.apply()
    backend_selection.apply()
    rope_kvcache_fusion.apply()
    self_check()


@contextlib.contextmanager
def _quiet(logger_name: str):
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def self_check() -> None:
    """Fail at start-up, not mid-serving, if the patches did not take on this vLLM build."""
    from vllm.config.cache import CacheConfig
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    try:
        with _quiet("vllm.config.cache"):   # its validator logs an fp8 accuracy warning
            config = CacheConfig(cache_dtype=KV_CACHE_DTYPE)
        assert config.cache_dtype == KV_CACHE_DTYPE
        from vllm.config.speculative import SpeculativeConfig

        assert KV_CACHE_DTYPE in literal_options(
            SpeculativeConfig.__dataclass_fields__["kv_cache_dtype"].type)
        from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

        storage = STR_DTYPE_TO_TORCH_DTYPE.get(KV_CACHE_DTYPE)
        assert storage is torch.uint8, f"{KV_CACHE_DTYPE} storage dtype {storage} != uint8"
        spec = MLAAttentionSpec(block_size=fmt.PAGE_SIZE, num_kv_heads=1,
                                head_size=fmt.HEAD_SIZE, dtype=storage,
                                cache_dtype_str=KV_CACHE_DTYPE)
        expected = fmt.PAGE_SIZE * fmt.BYTES_PER_TOKEN
        assert spec.page_size_bytes == expected, (
            f"MLAAttentionSpec page size {spec.page_size_bytes} != {expected}")
    except Exception as e:
        raise RuntimeError(
            "vllm-snapmla could not patch this vLLM build for fp8_snapmla (its internals differ "
            f"from vLLM 0.26.0): {type(e).__name__}: {e}. Install vllm==0.26.0.") from e
