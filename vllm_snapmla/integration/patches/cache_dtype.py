"""H1, H2, H3, H14: vLLM accepts the string ``fp8_snapmla`` as a KV-cache dtype.

What it changes: widens the ``CacheDType`` Literal (``vllm/config/cache.py``) by one string, in
``CacheConfig`` (pydantic rebuild, H1), the argparse choices derived from it (H2), the attention
selector's own imported copy (H3) and ``SpeculativeConfig.kv_cache_dtype`` (H14).
Why: vLLM 0.26.0 has no registry for KV-cache dtypes; the set is a closed ``Literal`` that
pydantic validates and several modules import by name.
Checked by: ``patches.self_check`` at every start-up (a ``CacheConfig`` and the speculative
field accept the string); tests/unit/integration/patches/test_cache_dtype.py.
Remove when: vLLM offers a public way to register a KV-cache dtype.
"""

from __future__ import annotations

import sys
import typing

from vllm_snapmla.integration.patches._common import KV_CACHE_DTYPE, literal_options


def apply() -> None:
    import vllm.config.cache as cache_mod
    from pydantic.dataclasses import rebuild_dataclass

    options = typing.get_args(cache_mod.CacheDType)
    if KV_CACHE_DTYPE not in options:
        widened = typing.Literal[options + (KV_CACHE_DTYPE,)]
        cache_mod.CacheDType = widened
        # H1: pydantic 2.13 rebuilds the validator from the dataclass field's type.
        cache_mod.CacheConfig.__dataclass_fields__["cache_dtype"].type = widened
        cache_mod.CacheConfig.__annotations__["cache_dtype"] = widened
        rebuild_dataclass(cache_mod.CacheConfig, force=True)
    # H14: a draft model's own dtype (speculative_config.kv_cache_dtype) is validated against
    # the Literal speculative.py imported; "auto"/"fp8" for the drafter need no patch.
    import vllm.config.speculative as spec_mod

    field = spec_mod.SpeculativeConfig.__dataclass_fields__["kv_cache_dtype"]
    if KV_CACHE_DTYPE not in literal_options(field.type):
        spec_mod.CacheDType = cache_mod.CacheDType
        field.type = cache_mod.CacheDType | None
        spec_mod.SpeculativeConfig.__annotations__["kv_cache_dtype"] = field.type
        rebuild_dataclass(spec_mod.SpeculativeConfig, force=True)
    # H3: the selector asserts membership in its own imported name; modules imported after
    # this point pick up the widened Literal by themselves.
    selector = sys.modules.get("vllm.v1.attention.selector")
    if selector is not None:
        selector.CacheDType = cache_mod.CacheDType
    # H2: argparse choices come from CacheConfig's field type through an lru_cache.
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    if arg_utils is not None:
        arg_utils._compute_kwargs.cache_clear()
