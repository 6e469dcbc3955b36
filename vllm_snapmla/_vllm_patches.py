"""Every patch of vLLM 0.26.0 internals that ``fp8_snapmla`` needs, in one place.

vLLM 0.26.0 has no registry for new KV-cache dtypes (the dtype set is a closed ``Literal``
matched on strings in several modules), so we patch the few private names involved.  Each
patch is labelled with its hook number (H1..H14 of our vLLM 0.26 integration notes; H15, the
V2 model runner's batch order, was found on the H200), is
idempotent (a wrapper carries the function it wraps in ``__snapmla_wrapped__``), and
``self_check`` verifies the result right after patching, so a vLLM that moved these names
fails loudly at start-up.  H6-H8, H10 and H11 need no patch: they are ``backend.py``
overrides.

``check_snapmla_config`` holds the start-up checks: the patched platform hook runs them while
vLLM builds its ``VllmConfig`` (before any worker starts) and ``SnapMLAImpl`` runs them again.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import typing

import torch

from vllm_snapmla import format as fmt

KV_CACHE_DTYPE = fmt.KV_CACHE_DTYPE
SNAPMLA_BACKEND_PATH = "vllm_snapmla.backend.SnapMLABackend"
MIN_CAPABILITY = (8, 9)   # native e4m3 (Ada, Hopper, Blackwell)
LOGGER_NAME = "vllm.snapmla"   # inside vLLM's logger tree, so vLLM's handlers print it
_WRAPPED = "__snapmla_wrapped__"


def apply_all() -> None:
    """Apply the patches every vLLM process needs (called by ``vllm_snapmla.register``)."""
    _accept_cache_dtype()
    _map_torch_dtype()
    _patch_mla_page_size()
    _register_custom_backend()
    _patch_cuda_platform()
    self_check()


def _is_ours(fn) -> bool:
    return getattr(fn, _WRAPPED, None) is not None


# --- H1, H2, H3: accept the string --------------------------------------------------------

def _accept_cache_dtype() -> None:
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
    if KV_CACHE_DTYPE not in _literal_options(field.type):
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


def _literal_options(tp) -> tuple:
    """The strings of a ``Literal[...]``, also inside ``Optional``/``X | None``."""
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    return tuple(o for arg in typing.get_args(tp) for o in _literal_options(arg))


# --- H4: storage dtype ---------------------------------------------------------------------

def _map_torch_dtype() -> None:
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    STR_DTYPE_TO_TORCH_DTYPE[KV_CACHE_DTYPE] = torch.uint8


# --- H5: 656 bytes per token ---------------------------------------------------------------

def _patch_mla_page_size() -> None:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    original = MLAAttentionSpec.__dict__["real_page_size_bytes"].fget
    if _is_ours(original):
        return

    def real_page_size_bytes(spec) -> int:
        if spec.cache_dtype_str == KV_CACHE_DTYPE:
            return spec.storage_block_size * fmt.BYTES_PER_TOKEN
        return original(spec)

    setattr(real_page_size_bytes, _WRAPPED, original)
    MLAAttentionSpec.real_page_size_bytes = property(real_page_size_bytes)


# --- H9: prefill / prefix-cache read-back --------------------------------------------------

def install_prefill_gather() -> None:
    """Route vLLM's context gather for ``fp8_snapmla`` caches to ``vllm_snapmla.ops.gather_kv``.

    ``MLACommonBaseImpl._compute_prefill_context`` calls
    ``vllm._custom_ops.gather_and_maybe_dequant_cache`` through the module at call time; the
    C++ op behind it rejects unknown dtypes.  Installed lazily by ``SnapMLAImpl`` because
    importing ``vllm._custom_ops`` resolves the platform and loads vLLM's kernels.
    """
    import vllm._custom_ops as custom_ops

    original = custom_ops.gather_and_maybe_dequant_cache
    if _is_ours(original):
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

    setattr(gather_and_maybe_dequant_cache, _WRAPPED, original)
    custom_ops.gather_and_maybe_dequant_cache = gather_and_maybe_dequant_cache


# --- H15: the chunked-context merge bound under the V2 model runner ----------------------

def fix_context_merge_bound(metadata, query_start_loc_cpu: torch.Tensor) -> None:
    """Make vLLM's prefix/suffix merge cover every prefill that has cached context.

    vLLM 0.26.0's MLA builder sets ``chunked_context.prefill_tokens_with_context`` to the
    query start of prefill number ``count(context > 0)``: it assumes the prefills that have
    context come first.  V1's batch reorder puts them first; the V2 model runner sorts
    requests by query length instead (``v1/worker/gpu/model_runner.py``
    ``sort_batch_req_ids``), and ``merge_attn_states`` then copies the new-token output
    for any prefill past that bound, dropping its cached context: the first token of a
    chunked prompt comes out wrong (DeepSeek-V2 models run on that runner by default).  The
    bound becomes the end of the last prefill with context.  Prefills without context
    before it are merged with an empty context, which ``mask_empty_context`` makes exact.
    ``query_start_loc_cpu`` is the whole batch's (decodes first).
    """
    prefill = getattr(metadata, "prefill", None)
    context = getattr(prefill, "chunked_context", None)
    if context is None:
        return
    with_context = torch.nonzero(context.seq_lens.sum(dim=0) > 0).flatten()
    if with_context.numel() == 0:
        return
    first_prefill = metadata.num_decodes
    last = first_prefill + int(with_context[-1])
    context.prefill_tokens_with_context = int(query_start_loc_cpu[last + 1]
                                              - query_start_loc_cpu[first_prefill])


# --- H12: backend registration and automatic selection ------------------------------------

def _register_custom_backend() -> None:
    from vllm.logger import init_logger
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden() and custom.get_path() != SNAPMLA_BACKEND_PATH:
        # Another plugin owns the single CUSTOM slot; fp8_snapmla still gets SnapMLA
        # through the selection wrapper, only `--attention-backend CUSTOM` is lost.
        init_logger(LOGGER_NAME).warning(
            "Attention backend CUSTOM is already registered to %s; vllm-snapmla leaves it. "
            "fp8_snapmla still selects SnapMLA automatically.", custom.get_path())
        return
    register_backend(custom, SNAPMLA_BACKEND_PATH)


def is_snapmla_backend_choice(backend) -> bool:
    """Whether an ``AttentionBackendEnum`` the user chose resolves to SnapMLA."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return (backend is AttentionBackendEnum.CUSTOM and backend.is_overridden()
            and backend.get_path() == SNAPMLA_BACKEND_PATH)


def _patch_cuda_platform() -> None:
    try:
        from vllm.platforms.cuda import CudaPlatformBase
    except (ImportError, OSError):
        return  # no CUDA platform in this install: nothing to select or check on

    # H12: every fp8_snapmla attention layer gets SnapMLA (vLLM's priority lists never
    # contain CUSTOM, and every built-in backend rejects the dtype).
    select = CudaPlatformBase.__dict__["get_attn_backend_cls"].__func__
    if not _is_ours(select):
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            if attn_selector_config.kv_cache_dtype == KV_CACHE_DTYPE:
                return _select_snapmla(cls, selected_backend, attn_selector_config)
            return select(cls, selected_backend, attn_selector_config, num_heads)

        setattr(get_attn_backend_cls, _WRAPPED, select)
        CudaPlatformBase.get_attn_backend_cls = classmethod(get_attn_backend_cls)

    # Start-up checks: VllmConfig.__post_init__ calls this in the front-end process once the
    # whole config (compilation defaults included) is settled, before any worker starts.
    check_and_update = CudaPlatformBase.__dict__["check_and_update_config"].__func__
    if not _is_ours(check_and_update):
        def check_and_update_config(cls, vllm_config) -> None:
            check_and_update(cls, vllm_config)
            cache_config = vllm_config.cache_config
            if cache_config is not None and cache_config.cache_dtype == KV_CACHE_DTYPE:
                check_snapmla_config(vllm_config, _capability_or_none(cls))
            elif cache_config is not None and draft_kv_cache_dtype(vllm_config) == KV_CACHE_DTYPE:
                _raise_if(_speculative_problems(vllm_config))   # fp8_snapmla for the drafter only

        setattr(check_and_update_config, _WRAPPED, check_and_update)
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

    from vllm_snapmla.backend import SnapMLABackend

    if selected_backend is not None and not is_snapmla_backend_choice(selected_backend):
        raise ValueError(_wrong_backend_message(selected_backend.name, "--attention-backend"))
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
    return SNAPMLA_BACKEND_PATH


# --- start-up checks -----------------------------------------------------------------------

def _wrong_backend_message(name: str, how: str) -> str:
    return (f"--kv-cache-dtype {KV_CACHE_DTYPE} is served only by the SnapMLA attention "
            f"backend, but {how} requested {name}. Drop {how} (SnapMLA is selected "
            f"automatically for {KV_CACHE_DTYPE}) or pass --attention-backend CUSTOM.")


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
    elif rank != fmt.KV_LORA_RANK or rope != fmt.ROPE_DIM:
        reason = (f"fp8_snapmla stores a {fmt.KV_LORA_RANK}-wide latent and a {fmt.ROPE_DIM}-wide "
                  f"RoPE key per token, but {name} has kv_lora_rank={rank} and "
                  f"qk_rope_head_dim={rope}")
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


def _speculative_problems(vllm_config) -> list[str]:
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
    draft = spec.draft_model_config
    if draft is None or vllm_config.model_config is None:
        return []
    return [f"the {spec.method} drafter's attention layers would use {KV_CACHE_DTYPE} "
            f"({where}): {why}" for why in _model_problems(draft, fix)]


def check_snapmla_config(vllm_config, device_capability=None) -> None:
    """Refuse, with what to do instead, every configuration fp8_snapmla cannot serve yet.

    ``device_capability`` is the GPU's ``DeviceCapability`` (None skips that check).
    """
    from vllm.v1.kv_cache_interface import KVCacheSpecKind

    problems: list[str] = []
    if vllm_config.model_config is not None:
        problems += _model_problems(vllm_config.model_config)

    if device_capability is not None and tuple(device_capability) < MIN_CAPABILITY:
        problems.append(
            "fp8_snapmla needs a GPU with FP8 support (compute capability 8.9 or newer: Ada, "
            f"Hopper, Blackwell), but this GPU has compute capability "
            f"{device_capability.major}.{device_capability.minor}. Use --kv-cache-dtype auto "
            "on this GPU.")

    cache_config = vllm_config.cache_config
    if cache_config.user_specified_block_size and cache_config.block_size != fmt.PAGE_SIZE:
        problems.append(
            f"fp8_snapmla uses {fmt.PAGE_SIZE}-token KV blocks (its decode kernel quantizes "
            f"attention probabilities per {fmt.PAGE_SIZE}-token block), but --block-size "
            f"{cache_config.block_size} was given. Drop --block-size or pass --block-size "
            f"{fmt.PAGE_SIZE}.")
    if cache_config.kv_cache_dtype_skip_layers:
        problems.append(
            "fp8_snapmla does not support --kv-cache-dtype-skip-layers yet (every MLA layer "
            "must use the same cache format). Remove --kv-cache-dtype-skip-layers "
            f"({cache_config.kv_cache_dtype_skip_layers}).")

    attention_config = vllm_config.attention_config
    chosen = attention_config.backend
    if chosen is not None and not is_snapmla_backend_choice(chosen):
        problems.append(_wrong_backend_message(chosen.name, "--attention-backend"))
    per_kind = (attention_config.backend_per_kind or {}).get(KVCacheSpecKind.MLA_ATTENTION.value)
    if per_kind is not None and not is_snapmla_backend_choice(per_kind):
        problems.append(_wrong_backend_message(
            per_kind.name, "--attention-config backend_per_kind"))

    problems += _speculative_problems(vllm_config)
    parallel_config = vllm_config.parallel_config
    if parallel_config.decode_context_parallel_size > 1:
        problems.append(
            "fp8_snapmla does not support decode context parallelism yet. Remove "
            "--decode-context-parallel-size/-dcp, or use --kv-cache-dtype fp8.")
    if parallel_config.prefill_context_parallel_size > 1:
        problems.append(
            "fp8_snapmla does not support prefill context parallelism yet. Remove "
            "--prefill-context-parallel-size/-pcp, or use --kv-cache-dtype fp8.")

    pass_config = vllm_config.compilation_config.pass_config
    if pass_config.fuse_rope_kvcache_cat_mla:
        # H13: the pass swaps our cache write for vLLM's fused C++ writer, which
        # rejects this dtype.
        problems.append(
            "fp8_snapmla writes the KV cache with its own kernel, but the MLA RoPE+KV-cache "
            "fusion pass (pass_config.fuse_rope_kvcache_cat_mla) would replace it with vLLM's "
            "C++ writer, which cannot write fp8_snapmla. Turn the pass off: "
            "--compilation-config '{\"pass_config\": {\"fuse_rope_kvcache_cat_mla\": false}}'.")

    _raise_if(problems)


def _raise_if(problems: list[str]) -> None:
    if problems:
        raise ValueError(f"--kv-cache-dtype {KV_CACHE_DTYPE} cannot be used here:\n- "
                         + "\n- ".join(problems))


# --- self-check ----------------------------------------------------------------------------

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

        assert KV_CACHE_DTYPE in _literal_options(
            SpeculativeConfig.__dataclass_fields__["kv_cache_dtype"].type)
        spec = MLAAttentionSpec(block_size=fmt.PAGE_SIZE, num_kv_heads=1,
                                head_size=fmt.HEAD_SIZE, dtype=torch.uint8,
                                cache_dtype_str=KV_CACHE_DTYPE)
        expected = fmt.PAGE_SIZE * fmt.BYTES_PER_TOKEN
        assert spec.page_size_bytes == expected, (
            f"MLAAttentionSpec page size {spec.page_size_bytes} != {expected}")
    except Exception as e:
        raise RuntimeError(
            "vllm-snapmla could not patch this vLLM build for fp8_snapmla (its internals differ "
            f"from vLLM 0.26.0): {type(e).__name__}: {e}. Install vllm==0.26.0.") from e
