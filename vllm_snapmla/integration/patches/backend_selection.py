"""H12 and the start-up hook: every ``fp8_snapmla`` layer gets SnapMLA, checked before workers.

What it changes: registers ``SnapMLABackend`` in vLLM's ``CUSTOM`` backend slot (a public API);
wraps ``CudaPlatformBase.get_attn_backend_cls`` so that ``fp8_snapmla`` layers select SnapMLA
(or fail with a reason); wraps ``CudaPlatformBase.check_and_update_config`` to run
``startup_checks.check_snapmla_config`` in the front-end process once the config is settled.
Why: vLLM's priority lists never contain ``CUSTOM`` and every built-in backend rejects the
dtype, so without the wrapper no backend would be found; the start-up hook refuses unsupported
configurations before any worker starts (instead of failing mid-load).
Checked by: tests/unit/integration/patches/test_backend_selection.py (selection, the CUSTOM slot
owned by another plugin) and tests/unit/integration/test_startup_checks.py (refusals).
Remove when: vLLM lets a backend declare the KV-cache dtypes it serves.
"""

from __future__ import annotations

from vllm_snapmla.integration import startup_checks
from vllm_snapmla.integration.patches._common import (
    KV_CACHE_DTYPE,
    LOGGER_NAME,
    is_ours,
    mark_wrapper,
)


def apply() -> None:
    _register_custom_backend()
    _patch_cuda_platform()


def _register_custom_backend() -> None:
    from vllm.logger import init_logger
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden() and custom.get_path() != startup_checks.SNAPMLA_BACKEND_PATH:
        # Another plugin owns the single CUSTOM slot; fp8_snapmla still gets SnapMLA
        # through the selection wrapper, only `--attention-backend CUSTOM` is lost.
        init_logger(LOGGER_NAME).warning(
            "Attention backend CUSTOM is already registered to %s; vllm-snapmla leaves it. "
            "fp8_snapmla still selects SnapMLA automatically.", custom.get_path())
        return
    register_backend(custom, startup_checks.SNAPMLA_BACKEND_PATH)


def _patch_cuda_platform() -> None:
    try:
        from vllm.platforms.cuda import CudaPlatformBase
    except (ImportError, OSError):
        return  # no CUDA platform in this install: nothing to select or check on

    # H12: every fp8_snapmla attention layer gets SnapMLA (vLLM's priority lists never
    # contain CUSTOM, and every built-in backend rejects the dtype).
    select = CudaPlatformBase.__dict__["get_attn_backend_cls"].__func__
    if not is_ours(select):
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            if attn_selector_config.kv_cache_dtype == KV_CACHE_DTYPE:
                return _select_snapmla(cls, selected_backend, attn_selector_config)
            return select(cls, selected_backend, attn_selector_config, num_heads)

        mark_wrapper(get_attn_backend_cls, select)
        CudaPlatformBase.get_attn_backend_cls = classmethod(get_attn_backend_cls)

    # Start-up checks: VllmConfig.__post_init__ calls this in the front-end process once the
    # whole config (compilation defaults included) is settled, before any worker starts.
    check_and_update = CudaPlatformBase.__dict__["check_and_update_config"].__func__
    if not is_ours(check_and_update):
        def check_and_update_config(cls, vllm_config) -> None:
            check_and_update(cls, vllm_config)
            cache_config = vllm_config.cache_config
            if cache_config is None:
                return
            if cache_config.cache_dtype == KV_CACHE_DTYPE:
                startup_checks.check_snapmla_config(vllm_config, _capability_or_none(cls))
            elif startup_checks.draft_kv_cache_dtype(vllm_config) == KV_CACHE_DTYPE:
                # fp8_snapmla for the drafter only
                startup_checks.raise_if(startup_checks.speculative_problems(vllm_config)
                                        + startup_checks.layer_problems(vllm_config))
            else:
                return
            startup_checks.settle_block_size(cache_config)

        mark_wrapper(check_and_update_config, check_and_update)
        CudaPlatformBase.check_and_update_config = classmethod(check_and_update_config)


def _capability_or_none(platform_cls):
    # The front-end process may not see the GPU (e.g. no NVML); the workers check again.
    try:
        return platform_cls.get_device_capability()
    except Exception:
        return None


def _select_snapmla(platform_cls, selected_backend, attn_selector_config) -> str:
    """Pick SnapMLA for every ``fp8_snapmla`` layer (no built-in backend reads the format).

    Returns the class path directly rather than ``CUSTOM`` so that the selection does not
    depend on who owns the CUSTOM slot.
    """
    from vllm.logger import init_logger

    from vllm_snapmla.integration.backend import SnapMLABackend

    if (selected_backend is not None
            and not startup_checks.is_snapmla_backend_choice(selected_backend)):
        raise ValueError(startup_checks.wrong_backend_message(selected_backend.name,
                                                              "--attention-backend"))
    capability = platform_cls.get_device_capability()
    reasons = SnapMLABackend.validate_configuration(device_capability=capability,
                                                    **attn_selector_config._asdict())
    if reasons:
        raise ValueError(
            f"--kv-cache-dtype {KV_CACHE_DTYPE}: the SnapMLA backend cannot serve this "
            f"attention layer ({attn_selector_config!r}): {'; '.join(reasons)}. "
            f"Use --kv-cache-dtype fp8 or auto for this model.")
    # Once per process in practice: vLLM caches the selection per layer configuration.
    init_logger(LOGGER_NAME).info("Using SNAPMLA attention backend for the %s KV cache.",
                                  KV_CACHE_DTYPE)
    return startup_checks.SNAPMLA_BACKEND_PATH
