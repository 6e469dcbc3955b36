"""H12 (``patches/backend_selection.py``): dense MLA layers on ``fp8_snapmla`` select SnapMLA
(also with ``--attention-backend CUSTOM``), other dtypes keep vLLM's choice, and a CUSTOM slot
another plugin owns is left to it.

Functions named ``_in_vllm_*`` run inside a vLLM process on a fake CUDA platform
(``tests/unit/_vllm_cpu.py``); the tests call them through ``VllmCpuProcess.call``.
"""

KV = "fp8_snapmla"


def _in_vllm_select(kv_cache_dtype, attention_backend=None):
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention import selector

    from tests.unit._vllm_cpu import device_capability, engine_config, tiny_model

    config = engine_config(tiny_model(), kv_cache_dtype=kv_cache_dtype,
                           attention_backend=attention_backend)
    selector._cached_get_attn_backend.cache_clear()
    with set_current_vllm_config(config), device_capability(9, 0):
        backend = selector.get_attn_backend(576, torch.bfloat16, config.cache_config.cache_dtype,
                                            use_mla=True, num_heads=16)
    return f"{backend.__module__}.{backend.__qualname__}"


def _in_vllm_selection_log():
    """What vLLM's own log handler prints while a layer selects SnapMLA."""
    import io
    import logging

    printed = io.StringIO()
    handler = logging.getLogger("vllm").handlers[0]     # the handler vLLM configured
    saved_stream = handler.setStream(printed)
    try:
        _in_vllm_select(KV)
    finally:
        handler.setStream(saved_stream)
    return printed.getvalue()


def _in_vllm_custom_slot_owned_by_another_plugin():
    """Another plugin registered vLLM's one CUSTOM backend slot before ours."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from tests.unit.integration.test_startup_checks import _in_vllm_startup_error
    from vllm_snapmla.integration.patches import backend_selection
    from vllm_snapmla.integration.startup_checks import SNAPMLA_BACKEND_PATH

    custom = AttentionBackendEnum.CUSTOM
    register_backend(custom, "other_plugin.OtherBackend")
    try:
        backend_selection._register_custom_backend()
        return {"CUSTOM": custom.get_path(), "selected": _in_vllm_select(KV),
                "with CUSTOM": _in_vllm_startup_error(attention_backend="CUSTOM")}
    finally:
        register_backend(custom, SNAPMLA_BACKEND_PATH)


def test_custom_slot_owned_by_another_plugin(vllm_cpu):
    """Ours stays out of the slot, fp8_snapmla still selects SnapMLA, and asking for CUSTOM
    says whose it is instead of advising CUSTOM."""
    seen = vllm_cpu.call(_in_vllm_custom_slot_owned_by_another_plugin)
    assert seen["CUSTOM"] == "other_plugin.OtherBackend"
    assert seen["selected"] == "vllm_snapmla.integration.backend.SnapMLABackend"
    message = seen["with CUSTOM"]
    assert "requested CUSTOM (registered to other_plugin.OtherBackend by another plugin)" \
        in message
    assert "pass --attention-backend CUSTOM" not in message


def test_dense_mla_with_fp8_snapmla_selects_snapmla(vllm_cpu):
    snapmla = "vllm_snapmla.integration.backend.SnapMLABackend"
    assert vllm_cpu.call(_in_vllm_select, kv_cache_dtype=KV) == snapmla
    assert vllm_cpu.call(_in_vllm_select, kv_cache_dtype=KV, attention_backend="CUSTOM") == snapmla
    # The e2e tests look for this line in vLLM's output.
    assert "Using SNAPMLA attention backend" in vllm_cpu.call(_in_vllm_selection_log)
    # Other dtypes keep vLLM's own choice for an H200 (the fake GPU reports sm_90).
    mla = "vllm.v1.attention.backends.mla"
    assert vllm_cpu.call(_in_vllm_select, kv_cache_dtype="auto") == \
        f"{mla}.flashattn_mla.FlashAttnMLABackend"
    assert vllm_cpu.call(_in_vllm_select, kv_cache_dtype="fp8") == f"{mla}.flashmla.FlashMLABackend"
