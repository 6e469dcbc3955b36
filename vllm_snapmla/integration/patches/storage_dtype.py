"""H4: the cache's torch storage dtype is ``uint8``.

What it changes: adds ``"fp8_snapmla": torch.uint8`` to ``vllm.utils.torch_utils.
STR_DTYPE_TO_TORCH_DTYPE`` (one shared dict, so every importer sees it).
Why: vLLM allocates each layer's cache with the torch dtype this dict maps the string to; our
rows are raw 656-byte records (FP8 content, FP32 scale, BF16 RoPE).
Checked by: ``patches.self_check`` (reads the dtype back and computes the page size with it),
``tests/unit/integration/patches/test_page_size.py`` and the e2e tests.
Remove when: vLLM offers a public way to register a KV-cache dtype.
"""

from __future__ import annotations

import torch

from vllm_snapmla.integration.patches._common import KV_CACHE_DTYPE


def apply() -> None:
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    STR_DTYPE_TO_TORCH_DTYPE[KV_CACHE_DTYPE] = torch.uint8
