"""H9: chunked prefill and prefix-cache hits read the cache through our dequantizing gather.

What it changes: wraps ``vllm._custom_ops.gather_and_maybe_dequant_cache``; for
``kv_cache_dtype == "fp8_snapmla"`` it calls ``vllm_snapmla.ops.gather_kv``, otherwise the
original.
Why: vLLM's MLA prefill (``MLACommonBaseImpl._compute_prefill_context``) gathers a request's
cached context with that C++ op, which rejects unknown dtypes.  The module attribute is looked
up at call time, so one wrapper covers every caller.
Checked by: the e2e tests with prefix caching and chunked prefill (outputs equal BF16's up to
near-ties); tests/unit/integration/patches/test_prefill_gather.py (the rows it writes) and
test_registration.py (the wrapper is installed once).
Remove when: vLLM lets a backend supply its context gather.
"""

from __future__ import annotations

import torch

from vllm_snapmla.integration.patches._common import KV_CACHE_DTYPE, is_ours, mark_wrapper


def apply() -> None:
    """Route vLLM's context gather for ``fp8_snapmla`` caches to ``vllm_snapmla.ops.gather_kv``.

    ``MLACommonBaseImpl._compute_prefill_context`` calls
    ``vllm._custom_ops.gather_and_maybe_dequant_cache`` through the module at call time; the
    C++ op behind it rejects unknown dtypes.  Installed lazily by ``SnapMLAImpl`` because
    importing ``vllm._custom_ops`` resolves the platform and loads vLLM's kernels.
    """
    import vllm._custom_ops as custom_ops

    original = custom_ops.gather_and_maybe_dequant_cache
    if is_ours(original):
        return

    def gather_and_maybe_dequant_cache(src_cache, dst, block_table, cu_seq_lens, token_to_seq,
                                       num_tokens, kv_cache_dtype, scale, seq_starts=None):
        if kv_cache_dtype != KV_CACHE_DTYPE:
            return original(src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens,
                            kv_cache_dtype, scale, seq_starts)
        from vllm_snapmla import ops

        # forward_impl hands the cache over viewed as FP8; our rows are bytes.
        ops.gather_kv(src_cache.view(torch.uint8), dst, block_table, cu_seq_lens, token_to_seq,
                      num_tokens, seq_starts)

    mark_wrapper(gather_and_maybe_dequant_cache, original)
    custom_ops.gather_and_maybe_dequant_cache = gather_and_maybe_dequant_cache
