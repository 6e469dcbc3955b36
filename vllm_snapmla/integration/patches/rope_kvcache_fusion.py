"""H13: the MLA RoPE+KV-cache fusion pass stays off for ``fp8_snapmla`` unless the user asks.

What it changes: wraps ``CudaPlatformBase.apply_config_platform_defaults`` (the platform hook
``VllmConfig.__post_init__`` calls before the optimization level's defaults) so that, when the
target or the drafter uses ``fp8_snapmla`` and the user left
``pass_config.fuse_rope_kvcache_cat_mla`` unset, it is set to False.
Why: at ``-O2``/``-O3`` vLLM turns the pass on by default with ``use_inductor_graph_partition``
or custom ``splitting_ops`` (``config/vllm.py`` ``enable_rope_kvcache_mla_fusion``), and the pass
swaps our cache write (H7) for vLLM's C++ ``concat_and_cache_mla_rope_fused``, which cannot
write the format.  After the defaults are applied a value the user set cannot be told from a
default, so the choice is made before them; a pass the user turns on explicitly is still
refused at start-up (``startup_checks``).
Checked by: tests/unit/integration/test_startup_checks.py (graph partition and custom splitting
ops start with the pass off; the explicit setting is refused).
Remove when: the fused writer supports ``fp8_snapmla``, or backends can opt out of the pass.
"""

from __future__ import annotations

from vllm_snapmla.integration import startup_checks
from vllm_snapmla.integration.patches._common import KV_CACHE_DTYPE, is_ours, mark_wrapper


def apply() -> None:
    try:
        from vllm.platforms.cuda import CudaPlatformBase
    except (ImportError, OSError):
        return  # no CUDA platform in this install
    original = CudaPlatformBase.apply_config_platform_defaults.__func__
    if is_ours(original):
        return

    def apply_config_platform_defaults(cls, vllm_config) -> None:
        original(cls, vllm_config)
        cache_config = vllm_config.cache_config
        uses_ours = cache_config is not None and (
            cache_config.cache_dtype == KV_CACHE_DTYPE
            or startup_checks.draft_kv_cache_dtype(vllm_config) == KV_CACHE_DTYPE)
        pass_config = vllm_config.compilation_config.pass_config
        if uses_ours and pass_config.fuse_rope_kvcache_cat_mla is None:
            pass_config.fuse_rope_kvcache_cat_mla = False

    mark_wrapper(apply_config_platform_defaults, original)
    CudaPlatformBase.apply_config_platform_defaults = classmethod(apply_config_platform_defaults)
