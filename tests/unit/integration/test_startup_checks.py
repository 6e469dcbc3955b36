"""Every configuration fp8_snapmla cannot serve fails at start-up, saying what to do instead.

The checks run while vLLM builds its VllmConfig (``EngineArgs.create_engine_config``, the same
call ``LLM(...)`` and ``vllm serve`` make), before any worker starts.  The backend's selection
and constructor repeat them for configurations built some other way.
"""

import json
import tempfile

import pytest

from tests.unit._vllm_cpu import SPEC_NGRAM, RemoteError

KV = "fp8_snapmla"


def _tiny_llama(vocab_size: int = 1024) -> str:
    path = tempfile.mkdtemp(prefix="snapmla-llama-")
    with open(f"{path}/config.json", "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "vocab_size": vocab_size, "hidden_size": 256, "intermediate_size": 512,
                   "num_hidden_layers": 1, "num_attention_heads": 4,
                   "num_key_value_heads": 4, "max_position_embeddings": 1024,
                   "torch_dtype": "bfloat16"}, f)
    return path


def _in_vllm_startup_error(model_overrides=None, llama=False, capability=(9, 0),
                           llama_drafter=False, **engine_kwargs):
    """The start-up error for fp8_snapmla with these settings, or None if it starts.

    ``llama_drafter``: ``speculative_config["model"]`` becomes a tiny Llama (non-MLA) drafter
    with the tiny DeepSeek-V3's vocabulary.
    """
    from tests.unit._vllm_cpu import engine_config, tiny_model

    model = _tiny_llama(vocab_size=4096) if llama else tiny_model(**(model_overrides or {}))
    if llama_drafter:
        engine_kwargs["speculative_config"] = {**engine_kwargs["speculative_config"],
                                               "model": _tiny_llama(vocab_size=4096)}
    kv_cache_dtype = engine_kwargs.pop("kv_cache_dtype", KV)
    try:
        engine_config(model, capability=tuple(capability), kv_cache_dtype=kv_cache_dtype,
                      **engine_kwargs)
    except ValueError as e:   # pydantic's ValidationError is a ValueError
        return str(e)
    return None


def _startup_error(vllm_cpu, **settings) -> str:
    message = vllm_cpu.call(_in_vllm_startup_error, **settings)
    assert message is not None, f"fp8_snapmla started with {settings}"
    assert f"--kv-cache-dtype {KV} cannot be used here" in message
    return message


@pytest.mark.parametrize("settings", [
    {},
    {"block_size": 64},
    {"attention_backend": "CUSTOM"},
    {"capability": (8, 9)},
    {"capability": (10, 0)},
    {"model_overrides": {"q_lora_rank": None}},
], ids=str)
def test_supported_configurations_start(vllm_cpu, settings):
    assert vllm_cpu.call(_in_vllm_startup_error, **settings) is None


def test_non_mla_model(vllm_cpu):
    message = _startup_error(vllm_cpu, llama=True)
    assert "does not use multi-head latent attention" in message
    assert "Use --kv-cache-dtype fp8 or auto for this model" in message


def test_sparse_mla_model(vllm_cpu):
    message = _startup_error(vllm_cpu, model_overrides={
        "index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128})
    assert "DeepSeek sparse attention" in message
    assert "Use --kv-cache-dtype fp8_ds_mla or auto" in message


@pytest.mark.parametrize("dims", [{"kv_lora_rank": 256}, {"qk_rope_head_dim": 32}], ids=str)
def test_other_latent_dimensions(vllm_cpu, dims):
    message = _startup_error(vllm_cpu, model_overrides=dims)
    rank, rope = dims.get("kv_lora_rank", 512), dims.get("qk_rope_head_dim", 64)
    assert f"has kv_lora_rank={rank} and qk_rope_head_dim={rope}" in message
    assert "Use --kv-cache-dtype fp8 or auto for this model" in message


@pytest.mark.parametrize("capability", [(8, 0), (8, 6)], ids=str)
def test_gpu_without_fp8(vllm_cpu, capability):
    message = _startup_error(vllm_cpu, capability=capability)
    assert "compute capability 8.9 or newer" in message
    assert f"this GPU has compute capability {capability[0]}.{capability[1]}" in message
    assert "Use --kv-cache-dtype auto on this GPU" in message


@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_block_size_other_than_64(vllm_cpu, block_size):
    message = _startup_error(vllm_cpu, block_size=block_size)
    assert f"--block-size {block_size} was given" in message
    assert "Drop --block-size or pass --block-size 64" in message


@pytest.mark.parametrize("settings, how, name", [
    ({"attention_backend": "FLASHMLA"}, "--attention-backend", "FLASHMLA"),
    ({"attention_backend": "TRITON_MLA"}, "--attention-backend", "TRITON_MLA"),
    ({"attention_config": {"backend_per_kind": {"mla_attention": "FLASH_ATTN_MLA"}}},
     "--attention-config backend_per_kind", "FLASH_ATTN_MLA"),
], ids=["flashmla", "triton_mla", "per_kind"])
def test_another_attention_backend(vllm_cpu, settings, how, name):
    message = _startup_error(vllm_cpu, **settings)
    assert f"{how} requested {name}" in message
    assert "or pass --attention-backend CUSTOM" in message


# Speculative decoding: the target's decode takes uniform multi-token queries; refused only
# where the drafter's own attention would get fp8_snapmla and cannot use it.
MTP = {"method": "mtp", "num_speculative_tokens": 2}
WITH_MTP_LAYER = {"num_nextn_predict_layers": 1}


@pytest.mark.parametrize("settings", [
    {"speculative_config": SPEC_NGRAM},
    {"speculative_config": {**SPEC_NGRAM, "num_speculative_tokens": 4}},
    {"speculative_config": MTP, "model_overrides": WITH_MTP_LAYER},
    # H14: the drafter's own dtype, explicitly ours or another one
    {"speculative_config": {**MTP, "kv_cache_dtype": KV}, "model_overrides": WITH_MTP_LAYER},
    {"speculative_config": {**MTP, "kv_cache_dtype": "auto"}, "model_overrides": WITH_MTP_LAYER},
    {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 2,
                            "kv_cache_dtype": "auto"}, "llama_drafter": True},
    {"speculative_config": SPEC_NGRAM, "enforce_eager": False},
], ids=["ngram", "ngram_k4", "mtp", "mtp_draft_kv_ours", "mtp_draft_kv_auto",
        "llama_drafter_auto", "ngram_compiled"])
def test_speculative_decoding_starts(vllm_cpu, settings):
    assert vllm_cpu.call(_in_vllm_startup_error, **settings) is None


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_speculative_drafter_without_mla(vllm_cpu, method):
    message = _startup_error(vllm_cpu, llama_drafter=True, speculative_config={
        "method": method, "num_speculative_tokens": 2})
    assert f"the {method} drafter's attention layers would use {KV}" in message
    assert "(inherited from --kv-cache-dtype)" in message
    assert "does not use multi-head latent attention" in message
    assert f'"method": "{method}", ..., "kv_cache_dtype": "auto"' in message


def test_fp8_snapmla_for_a_non_mla_drafter_only(vllm_cpu):
    # The target keeps BF16; the drafter asks for fp8_snapmla explicitly (H14) but is a Llama.
    message = _startup_error(vllm_cpu, llama=True, llama_drafter=True, kv_cache_dtype="auto",
                             speculative_config={"method": "draft_model",
                                                 "num_speculative_tokens": 2,
                                                 "kv_cache_dtype": KV})
    assert f"would use {KV} (speculative_config.kv_cache_dtype)" in message


def _in_vllm_draft_config(target, draft, **engine_kwargs):
    """The block size of the front end's config, and what the worker's rebuild of the config
    for a drafter with its own KV-cache dtype gives (``_create_draft_vllm_config``)."""
    from types import SimpleNamespace

    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    from tests.unit._vllm_cpu import engine_config, tiny_model

    config = engine_config(tiny_model(**WITH_MTP_LAYER), kv_cache_dtype=target,
                           speculative_config={**MTP, "kv_cache_dtype": draft}, **engine_kwargs)
    try:
        draft_config = SpecDecodeBaseProposer._create_draft_vllm_config(
            SimpleNamespace(speculative_config=config.speculative_config, vllm_config=config))
    except ValueError as e:
        return config.cache_config.block_size, str(e)
    return (config.cache_config.block_size,
            (draft_config.cache_config.cache_dtype, draft_config.cache_config.block_size))


@pytest.mark.parametrize("target", ["auto", "fp8", KV])
def test_a_drafter_with_its_own_fp8_snapmla_loads_in_the_worker(vllm_cpu, target):
    """vLLM rebuilds the drafter's config in the worker with the front end's block size, as one
    the user gave: 64 from the start, not vLLM's provisional 16."""
    assert vllm_cpu.call(_in_vllm_draft_config, target=target, draft=KV) == [64, [KV, 64]]


def _in_vllm_block_size_after_model_load(target_backend: str):
    """Only the drafter on fp8_snapmla: the block size after vLLM's post-load update (which
    takes the first attention layer's backend, the target's), and whether the target's backend
    and ours share a kernel block size there."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker.utils import select_common_block_size

    from tests.unit._vllm_cpu import engine_config, tiny_model
    from vllm_snapmla.integration.backend import SnapMLABackend

    config = engine_config(tiny_model(**WITH_MTP_LAYER), kv_cache_dtype="auto",
                           speculative_config={**MTP, "kv_cache_dtype": KV})
    target = AttentionBackendEnum[target_backend].get_class()
    platform = type(current_platform)
    assert "_find_non_ssm_backend" not in platform.__dict__      # inherited: removed below
    platform._find_non_ssm_backend = classmethod(lambda cls, vllm_config: target)
    try:
        current_platform.update_block_size_for_backend(config)
    finally:
        del platform._find_non_ssm_backend
    block_size = config.cache_config.block_size
    return [block_size, select_common_block_size(block_size, [target, SnapMLABackend])]


@pytest.mark.parametrize("target_backend", ["FLASH_ATTN_MLA", "TRITON_MLA", "FLASHINFER_MLA",
                                            "FLASHMLA"])
def test_a_drafter_only_fp8_snapmla_keeps_block_size_64_after_model_load(vllm_cpu,
                                                                         target_backend):
    """The target's backend would pick 16 or 32, which SnapMLA's 64-token pages cannot share."""
    assert vllm_cpu.call(_in_vllm_block_size_after_model_load,
                         target_backend=target_backend) == [64, 64]


def test_a_drafter_with_fp8_snapmla_refuses_other_block_sizes_up_front(vllm_cpu):
    message = _startup_error(vllm_cpu, kv_cache_dtype="auto", block_size=16,
                             model_overrides=WITH_MTP_LAYER,
                             speculative_config={**MTP, "kv_cache_dtype": KV})
    assert "--block-size 16 was given" in message


def test_a_drafter_on_another_attention_backend(vllm_cpu):
    message = _startup_error(vllm_cpu, model_overrides=WITH_MTP_LAYER,
                             speculative_config={**MTP, "attention_backend": "FLASH_ATTN"})
    assert "speculative_config.attention_backend requested FLASH_ATTN" in message


def _in_vllm_startup_error_with_env(env: dict, **settings):
    import os

    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        return _in_vllm_startup_error(**settings)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_batch_invariant_mode(vllm_cpu):
    message = vllm_cpu.call(_in_vllm_startup_error_with_env, env={"VLLM_BATCH_INVARIANT": "1"})
    assert message is not None and "VLLM_BATCH_INVARIANT=1" in message


def test_kv_connectors(vllm_cpu):
    message = _startup_error(vllm_cpu, kv_transfer_config={"kv_connector": "NixlConnector",
                                                           "kv_role": "kv_both"})
    assert "KV connectors (--kv-transfer-config" in message
    # vLLM turns --kv-offloading-size into a connector only after the start-up check.
    message = _startup_error(vllm_cpu, kv_offloading_size=4.0)
    assert "Remove --kv-offloading-size" in message


def test_float32_activations(vllm_cpu):
    message = _startup_error(vllm_cpu, dtype="float32")
    assert "runs in torch.float32 (--dtype). Pass --dtype bfloat16." in message


def test_hybrid_mla_models():
    """MLA with linear-attention layers (Kimi-Linear): vLLM sizes its pages for 576 bytes."""
    from types import SimpleNamespace

    from vllm_snapmla.integration.startup_checks import _model_problems

    hf = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64)
    model = SimpleNamespace(model="moonshotai/Kimi-Linear-48B-A3B-Instruct", hf_text_config=hf,
                            use_mla=True, is_hybrid=True)
    [problem] = _model_problems(model)
    assert "is a hybrid model" in problem and "Use --kv-cache-dtype fp8 or auto" in problem
    assert _model_problems(SimpleNamespace(**{**vars(model), "is_hybrid": False})) == []


def test_decode_context_parallel(vllm_cpu):
    # "mp" named explicitly: vLLM otherwise refuses a world size above this machine's 0 GPUs.
    message = _startup_error(vllm_cpu, tensor_parallel_size=2, decode_context_parallel_size=2,
                             distributed_executor_backend="mp")
    assert "does not support decode context parallelism" in message
    assert "Remove --decode-context-parallel-size/-dcp" in message


def test_prefill_context_parallel(vllm_cpu):
    message = _startup_error(vllm_cpu, prefill_context_parallel_size=2,
                             distributed_executor_backend="mp")
    assert "does not support prefill context parallelism" in message
    assert "Remove --prefill-context-parallel-size/-pcp" in message


def test_kv_cache_dtype_skip_layers(vllm_cpu):
    message = _startup_error(vllm_cpu, kv_cache_dtype_skip_layers=["0"])
    assert "does not support --kv-cache-dtype-skip-layers" in message
    assert "Remove --kv-cache-dtype-skip-layers" in message


def _in_vllm_rope_fusion_pass(**engine_kwargs):
    from tests.unit._vllm_cpu import engine_config, tiny_model

    config = engine_config(tiny_model(), **engine_kwargs)
    return config.compilation_config.pass_config.fuse_rope_kvcache_cat_mla


@pytest.mark.parametrize("compilation", [{"use_inductor_graph_partition": True},
                                         {"splitting_ops": []}], ids=str)
def test_rope_kv_cache_fusion_pass_is_off_unless_asked_for(vllm_cpu, compilation):
    """vLLM's -O2 defaults turn the pass on with these settings; for fp8_snapmla (target or
    drafter) it stays off, and auto keeps vLLM's default."""
    settings = {"enforce_eager": False, "compilation_config": compilation}
    assert vllm_cpu.call(_in_vllm_rope_fusion_pass, kv_cache_dtype=KV, **settings) is False
    assert vllm_cpu.call(_in_vllm_rope_fusion_pass, kv_cache_dtype="auto", **settings) is True


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_rope_kv_cache_fusion_pass(vllm_cpu, enforce_eager):
    message = _startup_error(vllm_cpu, enforce_eager=enforce_eager, compilation_config={
        "pass_config": {"fuse_rope_kvcache_cat_mla": True}})
    assert "fusion pass (pass_config.fuse_rope_kvcache_cat_mla)" in message
    assert '"fuse_rope_kvcache_cat_mla": false' in message
    # Also when only the drafter uses fp8_snapmla: the pass rewrites its cache writes too.
    message = _startup_error(vllm_cpu, kv_cache_dtype="auto", model_overrides=WITH_MTP_LAYER,
                             speculative_config={**MTP, "kv_cache_dtype": KV},
                             compilation_config={
                                 "pass_config": {"fuse_rope_kvcache_cat_mla": True}})
    assert "fusion pass (pass_config.fuse_rope_kvcache_cat_mla)" in message


def test_all_problems_reported_together(vllm_cpu):
    message = _startup_error(vllm_cpu, model_overrides={"kv_lora_rank": 256}, block_size=16,
                             kv_cache_dtype_skip_layers=["0"], capability=(8, 0))
    for part in ("kv_lora_rank=256", "--block-size 16", "--kv-cache-dtype-skip-layers",
                 "compute capability 8.0"):
        assert part in message


# --- the same refusals where a layer picks its backend and where the impl is built -----------

def _in_vllm_select_after_config(use_sparse=False, force_backend=None, kv_cache_dtype=KV,
                                 capability=(9, 0)):
    """Backend selection for a config that skipped the start-up check (e.g. edited later)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from tests.unit._vllm_cpu import device_capability, engine_config, tiny_model

    config = engine_config(tiny_model(), kv_cache_dtype=KV)
    if force_backend is not None:
        config.attention_config.backend = AttentionBackendEnum[force_backend]
    selector._cached_get_attn_backend.cache_clear()
    with set_current_vllm_config(config), device_capability(*capability):
        backend = selector.get_attn_backend(576, torch.bfloat16, kv_cache_dtype, use_mla=True,
                                            use_sparse=use_sparse, num_heads=16)
    return backend.get_name()


@pytest.mark.parametrize("settings, expected", [
    ({"force_backend": "FLASHMLA"}, "--attention-backend requested FLASHMLA"),
    ({"use_sparse": True}, "sparse not supported"),
    ({"capability": (8, 0)}, "compute capability not supported"),
], ids=["other_backend", "sparse", "no_fp8"])
def test_selection_refuses(vllm_cpu, settings, expected):
    with pytest.raises(RemoteError) as err:
        vllm_cpu.call(_in_vllm_select_after_config, **settings)
    assert err.value.exc_type == "ValueError"
    assert expected in err.value.message
    assert "--kv-cache-dtype fp8_snapmla" in err.value.message


def _in_vllm_build_impl(kv_cache_dtype=KV, kv_lora_rank=512, capability=(9, 0)):
    from vllm.config import set_current_vllm_config

    from tests.unit._vllm_cpu import device_capability, engine_config, tiny_model
    from vllm_snapmla.integration.backend import SnapMLAImpl

    config = engine_config(tiny_model(), kv_cache_dtype=KV)
    with set_current_vllm_config(config), device_capability(*capability):
        SnapMLAImpl(num_heads=16, head_size=kv_lora_rank + 64, scale=0.07, num_kv_heads=1,
                    alibi_slopes=None, sliding_window=None, kv_cache_dtype=kv_cache_dtype,
                    logits_soft_cap=None, attn_type="decoder",
                    kv_sharing_target_layer_name=None, q_lora_rank=256,
                    kv_lora_rank=kv_lora_rank, qk_nope_head_dim=128, qk_rope_head_dim=64,
                    qk_head_dim=192, v_head_dim=128, kv_b_proj=None)


@pytest.mark.parametrize("settings, expected", [
    ({"kv_cache_dtype": "auto"}, "Pass --kv-cache-dtype fp8_snapmla or drop --attention-backend"),
    ({"kv_lora_rank": 256}, "kv_lora_rank=256 and qk_rope_head_dim=64"),
    ({"capability": (8, 0)}, "this GPU has compute capability 8.0"),
], ids=["other_dtype", "latent_rank", "no_fp8"])
def test_impl_refuses(vllm_cpu, settings, expected):
    with pytest.raises(RemoteError) as err:
        vllm_cpu.call(_in_vllm_build_impl, **settings)
    assert err.value.exc_type == "ValueError"
    assert expected in err.value.message


def test_a_gpu_without_the_native_extension_is_refused_with_how_to_build(monkeypatch):
    """A GPU process whose package was installed without the extension (no toolkit, or
    SNAPMLA_SKIP_BUILD=1) is refused at start-up, saying how to reinstall, not at the first
    cache write after the model has loaded; without a GPU there is nothing to refuse."""
    import torch

    from vllm_snapmla import _native
    from vllm_snapmla.integration import startup_checks

    monkeypatch.setattr(_native, "native", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    problem = startup_checks.native_problem()
    assert problem is not None
    assert "was not built" in problem and "CUDA 13 toolkit" in problem
    assert "pip install --no-build-isolation --force-reinstall --no-deps -e ." in problem
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert startup_checks.native_problem() is None
