"""Start-up checks: every configuration ``fp8_snapmla`` cannot serve is refused, saying what to do.

Run twice: by the patched platform hook while vLLM builds its ``VllmConfig`` in the front-end
process (``patches/backend_selection.py``), and again by ``SnapMLAImpl`` in each worker.
"""

from __future__ import annotations

from vllm_snapmla import format as fmt

KV_CACHE_DTYPE = fmt.KV_CACHE_DTYPE
# Where vLLM's CUSTOM attention backend points when it is ours.
SNAPMLA_BACKEND_PATH = "vllm_snapmla.integration.backend.SnapMLABackend"
MIN_CAPABILITY = (8, 9)   # native e4m3 (Ada, Hopper, Blackwell)


def latent_shape_problem(kv_lora_rank, qk_rope_head_dim) -> str | None:
    """Why a model's MLA latent does not fit the 656-byte row, or None when it does."""
    if kv_lora_rank == fmt.KV_LORA_RANK and qk_rope_head_dim == fmt.ROPE_DIM:
        return None
    return (f"fp8_snapmla stores a {fmt.KV_LORA_RANK}-wide latent and a {fmt.ROPE_DIM}-wide RoPE "
            f"key per token, but the model has kv_lora_rank={kv_lora_rank} and "
            f"qk_rope_head_dim={qk_rope_head_dim}")


def is_snapmla_backend_choice(backend) -> bool:
    """Whether an ``AttentionBackendEnum`` the user chose resolves to SnapMLA."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return (backend is AttentionBackendEnum.CUSTOM and backend.is_overridden()
            and backend.get_path() == SNAPMLA_BACKEND_PATH)


def wrong_backend_message(name: str, how: str) -> str:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    custom = AttentionBackendEnum.CUSTOM
    advice = f"Drop {how} (SnapMLA is selected automatically for {KV_CACHE_DTYPE})"
    if custom.is_overridden() and custom.get_path() == SNAPMLA_BACKEND_PATH:
        advice += " or pass --attention-backend CUSTOM"
    elif name == custom.name:
        # Another plugin registered the one CUSTOM slot first (patches/backend_selection.py).
        name += f" (registered to {custom.get_path()} by another plugin)"
    return (f"--kv-cache-dtype {KV_CACHE_DTYPE} is served only by the SnapMLA attention "
            f"backend, but {how} requested {name}. {advice}.")


def _model_problems(model_config, fix: str | None = None) -> list[str]:
    """Why fp8_snapmla cannot serve this model's attention; ``fix`` replaces the advice."""
    import vllm.envs as envs

    name = model_config.model
    hf = model_config.hf_text_config
    rank = getattr(hf, "kv_lora_rank", None)
    rope = getattr(hf, "qk_rope_head_dim", None)
    if not model_config.use_mla:
        why = " (VLLM_MLA_DISABLE=1 is set)" if envs.VLLM_MLA_DISABLE else ""
        reason = (f"{name} does not use multi-head latent attention{why}; fp8_snapmla only "
                  "applies to MLA models (DeepSeek-V2/V3/R1, Kimi-K2, ...)")
        default = "Use --kv-cache-dtype fp8 or auto for this model."
    elif hasattr(hf, "index_topk"):
        reason = (f"{name} uses DeepSeek sparse attention (DeepSeek-V3.2 style, `index_topk` in "
                  "its config), which fp8_snapmla does not support yet")
        default = "Use --kv-cache-dtype fp8_ds_mla or auto for this model."
    elif hasattr(hf, "compress_ratios"):
        reason = (f"{name} uses DeepSeek-V4 compressed attention, which fp8_snapmla does not "
                  "support")
        default = "Use --kv-cache-dtype auto for this model."
    elif latent_shape_problem(rank, rope) is not None:
        reason = f"{name}: {latent_shape_problem(rank, rope)}"
        default = "Use --kv-cache-dtype fp8 or auto for this model."
    elif model_config.is_hybrid:
        # vLLM aligns a hybrid model's attention block size with its Mamba pages from a
        # 576-byte row (platforms/interface.py _align_hybrid_block_size), not our 656.
        reason = (f"{name} is a hybrid model (MLA with linear-attention or Mamba layers), whose "
                  f"KV pages vLLM sizes for 576-byte rows; fp8_snapmla has not been validated "
                  "there")
        default = "Use --kv-cache-dtype fp8 or auto for this model."
    else:
        return []
    return [f"{reason}. {fix or default}"]


# Speculative methods whose drafter has no attention layers of its own: token statistics
# (ngram, ngram_gpu, suffix) or heads on the target's hidden states (medusa, mlp_speculator,
# extract_hidden_states).  Every other method's drafter (eagle, eagle3, the *_mtp family,
# draft_model, ...) builds attention layers that get the drafter's KV-cache dtype.
_NO_DRAFT_ATTENTION = ("ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator",
                       "extract_hidden_states")
# Drafters whose attention is non-causal (block drafting); SnapMLA decode is causal only.
_NON_CAUSAL_DRAFTERS = ("dflash", "dspark")


def draft_kv_cache_dtype(vllm_config) -> str | None:
    """The KV-cache dtype the drafter's own attention layers get, or None without a drafter.

    vLLM gives the draft model ``speculative_config.kv_cache_dtype`` when set, otherwise the
    target's ``--kv-cache-dtype`` (``llm_base_proposer._create_draft_vllm_config``,
    ``worker/gpu/spec_decode/eagle/utils.load_eagle_model``).
    """
    spec = vllm_config.speculative_config
    if spec is None or spec.method in _NO_DRAFT_ATTENTION:
        return None
    return spec.kv_cache_dtype or vllm_config.cache_config.cache_dtype


def speculative_problems(vllm_config) -> list[str]:
    """Speculative decoding works when the drafter can use (or does not use) fp8_snapmla.

    The target's decode takes uniform multi-token queries (QueryLenSupport.UNIFORM): vLLM sends
    requests whose query length differs from the batch's first decode down the prefill path
    (``split_decodes_and_prefills(require_uniform=True)``), so every method's verification
    batches are served; FULL CUDA graphs cover the uniform ones (1 + num_speculative_tokens).
    What remains is the drafter's own attention when it inherits fp8_snapmla.
    """
    spec = vllm_config.speculative_config
    if spec is None or draft_kv_cache_dtype(vllm_config) != KV_CACHE_DTYPE:
        return []
    where = ("speculative_config.kv_cache_dtype" if spec.kv_cache_dtype
             else "inherited from --kv-cache-dtype")
    fix = ("Give the drafter its own KV-cache dtype, e.g. --speculative-config "
           f"'{{\"method\": \"{spec.method}\", ..., \"kv_cache_dtype\": \"auto\"}}'.")
    if spec.method in _NON_CAUSAL_DRAFTERS:
        return [(f"the {spec.method} drafter attends non-causally, which the SnapMLA decode "
                 f"kernels do not do, and its attention would use {KV_CACHE_DTYPE} ({where}). "
                 f"{fix}")]
    problems = []
    chosen = spec.attention_backend
    if chosen is not None and not is_snapmla_backend_choice(chosen):
        # Otherwise the worker refuses it while loading the drafter.
        problems.append(f"the {spec.method} drafter's attention would use {KV_CACHE_DTYPE} "
                        f"({where}), but " + wrong_backend_message(
                            chosen.name, "speculative_config.attention_backend"))
    draft = spec.draft_model_config
    if draft is None or vllm_config.model_config is None:
        return problems
    return problems + [f"the {spec.method} drafter's attention layers would use "
                       f"{KV_CACHE_DTYPE} ({where}): {why}" for why in _model_problems(draft, fix)]


def layer_problems(vllm_config) -> list[str]:
    """What no attention layer on fp8_snapmla, the target's or the drafter's, can run with."""
    import torch
    import vllm.envs as envs

    problems = []
    model_config = vllm_config.model_config
    if model_config is not None and model_config.dtype not in (torch.bfloat16, torch.float16):
        problems.append(
            f"fp8_snapmla's kernels take bfloat16 or float16 activations, but the model runs "
            f"in {model_config.dtype} (--dtype). Pass --dtype bfloat16.")
    cache_config = vllm_config.cache_config
    if cache_config.user_specified_block_size and cache_config.block_size != fmt.PAGE_SIZE:
        problems.append(
            f"fp8_snapmla uses {fmt.PAGE_SIZE}-token KV blocks (its decode kernel quantizes "
            f"attention probabilities per {fmt.PAGE_SIZE}-token block), but --block-size "
            f"{cache_config.block_size} was given. Drop --block-size or pass --block-size "
            f"{fmt.PAGE_SIZE}.")
    if envs.VLLM_BATCH_INVARIANT:
        problems.append(
            "VLLM_BATCH_INVARIANT=1 asks for attention whose result does not depend on the "
            "batch, which the SnapMLA decode does not give (how it splits a request's pages "
            "depends on the other requests). Unset VLLM_BATCH_INVARIANT, or use "
            "--kv-cache-dtype auto.")
    # --kv-offloading-size becomes a KV connector only after this check runs
    # (VllmConfig._post_init_kv_transfer_config).
    offloading = getattr(cache_config, "kv_offloading_size", None) is not None
    if vllm_config.kv_transfer_config is not None or offloading:
        flag = "--kv-offloading-size" if offloading else "--kv-transfer-config"
        problems.append(
            "KV connectors (--kv-transfer-config, --kv-offloading-size: disaggregated prefill, "
            f"KV offloading, LMCache, ...) have not been validated with {KV_CACHE_DTYPE}'s "
            f"{fmt.BYTES_PER_TOKEN}-byte rows, and some assume {fmt.HEAD_SIZE}-byte ones. "
            f"Remove {flag}, or use --kv-cache-dtype fp8 or auto.")
    # H13: the pass swaps our cache write for vLLM's fused C++ writer, which rejects this
    # dtype (patches/rope_kvcache_fusion.py keeps it off unless the user turns it on).
    if vllm_config.compilation_config.pass_config.fuse_rope_kvcache_cat_mla:
        problems.append(
            "fp8_snapmla writes the KV cache with its own kernel, but the MLA RoPE+KV-cache "
            "fusion pass (pass_config.fuse_rope_kvcache_cat_mla) would replace it with vLLM's "
            "C++ writer, which cannot write fp8_snapmla. Turn the pass off: "
            "--compilation-config '{\"pass_config\": {\"fuse_rope_kvcache_cat_mla\": false}}'.")
    return problems


def settle_block_size(cache_config) -> None:
    """Fix the block size at 64 in the front end when the user gave none, as if given.

    vLLM's provisional block size (16) is copied into the config it rebuilds in the workers for a
    drafter with its own KV-cache dtype, as a block size given by the user, which fp8_snapmla
    refuses.  And once the model is loaded, ``update_block_size_for_backend`` resets a block size
    the user did not give to the preferred one of the first attention layer's backend: the
    target's, 16 or 32 when only the drafter uses fp8_snapmla, and the two would share no block
    size.  Every MLA backend vLLM pairs with ours takes 64."""
    if not cache_config.user_specified_block_size:
        cache_config.block_size = fmt.PAGE_SIZE
        cache_config.user_specified_block_size = True


def native_problem() -> str | None:
    """Why fp8_snapmla cannot run on this process's GPU, if it has one and the native extension
    (the cache ops every kernel choice needs) did not load; None otherwise."""
    import torch

    from vllm_snapmla._native import REBUILD, missing_reason, native

    if not torch.cuda.is_available() or native() is not None:
        return None
    return (f"fp8_snapmla's cache and decode ops need the native extension on the GPU, but "
            f"{missing_reason()}. {REBUILD}")


def check_snapmla_config(vllm_config, device_capability=None) -> None:
    """Refuse, with what to do instead, every configuration fp8_snapmla cannot serve yet.

    ``device_capability`` is the GPU's ``DeviceCapability`` (None skips that check).
    """
    from vllm.v1.kv_cache_interface import KVCacheSpecKind

    problems: list[str] = []
    if vllm_config.model_config is not None:
        problems += _model_problems(vllm_config.model_config)

    problem = native_problem()
    if problem is not None:
        problems.append(problem)
    if device_capability is not None and tuple(device_capability) < MIN_CAPABILITY:
        problems.append(
            "fp8_snapmla needs a GPU with FP8 support (compute capability 8.9 or newer: Ada, "
            f"Hopper, Blackwell), but this GPU has compute capability "
            f"{device_capability.major}.{device_capability.minor}. Use --kv-cache-dtype auto "
            "on this GPU.")

    problems += layer_problems(vllm_config)
    cache_config = vllm_config.cache_config
    if cache_config.kv_cache_dtype_skip_layers:
        problems.append(
            "fp8_snapmla does not support --kv-cache-dtype-skip-layers yet (every MLA layer "
            "must use the same cache format). Remove --kv-cache-dtype-skip-layers "
            f"({cache_config.kv_cache_dtype_skip_layers}).")

    attention_config = vllm_config.attention_config
    chosen = attention_config.backend
    if chosen is not None and not is_snapmla_backend_choice(chosen):
        problems.append(wrong_backend_message(chosen.name, "--attention-backend"))
    per_kind = (attention_config.backend_per_kind or {}).get(KVCacheSpecKind.MLA_ATTENTION.value)
    if per_kind is not None and not is_snapmla_backend_choice(per_kind):
        problems.append(wrong_backend_message(
            per_kind.name, "--attention-config backend_per_kind"))

    problems += speculative_problems(vllm_config)
    parallel_config = vllm_config.parallel_config
    if parallel_config.decode_context_parallel_size > 1:
        problems.append(
            "fp8_snapmla does not support decode context parallelism yet. Remove "
            "--decode-context-parallel-size/-dcp, or use --kv-cache-dtype fp8.")
    if parallel_config.prefill_context_parallel_size > 1:
        problems.append(
            "fp8_snapmla does not support prefill context parallelism yet. Remove "
            "--prefill-context-parallel-size/-pcp, or use --kv-cache-dtype fp8.")

    raise_if(problems)


def raise_if(problems: list[str]) -> None:
    if problems:
        raise ValueError(f"--kv-cache-dtype {KV_CACHE_DTYPE} cannot be used here:\n- "
                         + "\n- ".join(problems))
