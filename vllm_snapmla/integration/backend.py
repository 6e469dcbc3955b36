"""SnapMLA attention backend for vLLM 0.26.0 (dense MLA with the ``fp8_snapmla`` KV cache).

Built on vLLM's common MLA code: prefill of new tokens runs vLLM's MLA prefill backend on the
fresh BF16 latents; the cache write, the decode attention and the context read-back of
chunked prefill / prefix-cache hits go through ``vllm_snapmla.ops`` (the only code that
touches the cache bytes).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config, get_current_vllm_config_or_none
from vllm.config.cache import CacheDType
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionLayer,
    AttentionType,
    CommonAttentionMetadata,
)

from vllm_snapmla import format as fmt
from vllm_snapmla import ops as snapmla_ops
from vllm_snapmla.integration import startup_checks
from vllm_snapmla.integration.patches import prefill_gather
from vllm_snapmla.integration.patches._common import LOGGER_NAME
from vllm_snapmla.integration.patches.context_merge_bound import fix_context_merge_bound

KV_CACHE_DTYPE = fmt.KV_CACHE_DTYPE


class SnapMLABackend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = [KV_CACHE_DTYPE]

    @staticmethod
    def get_name() -> str:
        return "SNAPMLA"

    @staticmethod
    def get_impl_cls() -> type[SnapMLAImpl]:
        return SnapMLAImpl

    @staticmethod
    def get_builder_cls() -> type[SnapMLAMetadataBuilder]:
        return SnapMLAMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return [fmt.PAGE_SIZE]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        # One cache block is one probability-quantization block of the decode kernel.
        return block_size is None or block_size == fmt.PAGE_SIZE

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        return fmt.PAGE_SIZE

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        # H6: always the 656-byte row: only fp8_snapmla layers select this backend, but the V2
        # model runner passes the model's dtype, not the layer's ("auto" for a drafter that
        # alone uses fp8_snapmla, attn_utils._reshape_kv_cache).
        return (num_blocks, block_size, fmt.BYTES_PER_TOKEN)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [fmt.HEAD_SIZE]

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return tuple(capability) >= startup_checks.MIN_CAPABILITY

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                             has_sink, use_sparse, use_mm_prefix,
                             device_capability) -> str | None:
        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is None or vllm_config.model_config is None:
            return None
        hf = vllm_config.model_config.hf_text_config
        problem = startup_checks.latent_shape_problem(getattr(hf, "kv_lora_rank", None),
                                                      getattr(hf, "qk_rope_head_dim", None))
        if problem is not None:
            return problem
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            return "decode context parallelism not supported"
        return None


@dataclass
class SnapMLADecodeMetadata(MLACommonDecodeMetadata):
    # The step's split plan (ops.plan_decode), shared by every layer's decode: one planner
    # launch a step instead of one a layer.  None: each decode plans for itself.
    split_plan: torch.Tensor | None = None


class SnapMLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    # Decode runs inside FULL CUDA graphs for uniform batches (every request with the same
    # query length, 1 + num_speculative_tokens), like FlashMLA's builder: the launch depends
    # only on the padded batch size, the heads, s_q and the block-table width (fixed by vLLM's
    # persistent buffers); padded rows (seq_len 0, null block) give zeros.  Mixed batches run
    # attention eagerly between piecewise graphs.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    # Uniform multi-token decode (speculative decoding): the builder's
    # _init_reorder_batch_threshold raises reorder_batch_threshold to
    # 1 + num_speculative_tokens, and split_decodes_and_prefills(require_uniform=True) sends
    # requests of another query length down the prefill path.  The base threshold stays 1
    # (FlashMLA uses 128 to run short prefills as decodes): new prefill tokens keep attending
    # to their exact BF16 latents instead of the FP8 cache.
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM
    reorder_batch_threshold: int = 1

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # One buffer for the builder's life: a FULL CUDA graph reads the plan at this address,
        # and each step's build rewrites it (on the stream, before the step's kernels).
        self.split_plan = torch.zeros(1, dtype=torch.int32, device=self.device)

    def _build_decode(self, block_table_tensor: torch.Tensor, seq_lens_device: torch.Tensor,
                      max_seq_len: int, query_start_loc_cpu: torch.Tensor,
                      query_start_loc_device: torch.Tensor, num_decode_tokens: int,
                      dcp_tot_seq_lens_device: torch.Tensor | None) -> SnapMLADecodeMetadata:
        # H16: the step's split plan, made once here for every layer's decode.
        num_decodes = seq_lens_device.shape[0]
        plan = None
        if num_decodes > 0 and num_decode_tokens % num_decodes == 0:
            # Always so in vLLM 0.26 (decodes only, uniform query lengths); decode_uniform
            # refuses other batches with a clear error, which planning here must not preempt.
            plan = snapmla_ops.plan_decode(seq_lens_device, block_table_tensor, self.num_heads,
                                           num_decode_tokens // num_decodes,
                                           out=self.split_plan)
        return SnapMLADecodeMetadata(block_table=block_table_tensor, seq_lens=seq_lens_device,
                                     dcp_tot_seq_lens=dcp_tot_seq_lens_device, split_plan=plan)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> MLACommonMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        fix_context_merge_bound(metadata, common_attn_metadata.query_start_loc_cpu)
        return metadata

    @staticmethod
    def determine_prefill_query_data_type(vllm_config: VllmConfig,
                                          model_dtype: torch.dtype) -> torch.dtype:
        # H10: vLLM's FP8 prefill would copy raw 656-byte rows into the workspace
        # (cp_gather_cache); keep prefill in the model dtype so the context goes
        # through our dequantizing gather.
        return model_dtype


class SnapMLAImpl(MLACommonImpl[MLACommonMetadata]):
    can_return_lse_for_decode: bool = True   # natural log, as lse_base_on_e says
    supports_pcp: bool = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None, attn_type: str,
                 kv_sharing_target_layer_name: str | None, **mla_args) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, **mla_args)
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap:
            raise NotImplementedError(
                "SnapMLA does not support alibi slopes, sliding windows or logit soft-capping")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"SnapMLA supports decoder attention only, not {attn_type}")
        if kv_cache_dtype != KV_CACHE_DTYPE:
            raise ValueError(
                f"the SnapMLA backend reads only the {KV_CACHE_DTYPE} cache, but this layer's "
                f"KV-cache dtype is {kv_cache_dtype}. Pass --kv-cache-dtype {KV_CACHE_DTYPE} "
                "or drop --attention-backend CUSTOM.")
        problem = startup_checks.latent_shape_problem(self.kv_lora_rank, self.qk_rope_head_dim)
        if problem is not None:
            raise ValueError(f"{problem}. Use --kv-cache-dtype fp8 or auto for this model.")
        capability = (current_platform.get_device_capability()
                      if current_platform.is_cuda() else None)
        startup_checks.check_snapmla_config(get_current_vllm_config(), capability)

        # H11: decode takes BF16 queries and quantizes them per (token, head) itself.
        self.supports_quant_query_input = False
        prefill_gather.apply()   # H9
        if torch.cuda.is_available():
            log_decode_kernel(torch.cuda.current_device())

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor | None,
                           kv_cache_dtype: str, k_scale: torch.Tensor) -> None:
        # H7: vLLM's C++ concat_and_cache_mla rejects this dtype.  The cache is empty during
        # the memory-profiling run.
        if kv_cache.numel() == 0 or slot_mapping is None:
            return
        snapmla_ops.append_kv(kv_c_normed, k_pe, kv_cache.view(torch.uint8), slot_mapping)

    def forward_mqa(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: MLACommonMetadata,
                    layer: AttentionLayer) -> tuple[torch.Tensor, torch.Tensor | None]:
        # H8: decode attention over the fp8_snapmla cache.
        decode = attn_metadata.decode
        assert decode is not None
        if isinstance(q, tuple):
            q_nope, q_pe = q
        else:
            q_nope, q_pe = q.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        out, lse = decode_uniform(q_nope, q_pe, kv_c_and_k_pe_cache, decode.block_table,
                                  decode.seq_lens, attn_metadata.num_decodes, self.scale,
                                  return_lse=self.need_to_return_lse_for_decode,
                                  # Metadata not from this builder (vLLM's own class) has
                                  # no plan: the call plans.
                                  plan=getattr(decode, "split_plan", None))
        return out.to(q_nope.dtype), lse


@functools.cache
def log_decode_kernel(device: int) -> None:
    """Say once per process and GPU which decode kernel serves it (``ops.decode_kernel``), so that
    a build without the Hopper kernels does not pass unnoticed, and warn where that is the Triton
    kernel: it decodes slower than vLLM's BF16 attention, so a first benchmark would show it."""
    from vllm.logger import init_logger

    logger = init_logger(LOGGER_NAME)
    kernel = snapmla_ops.decode_kernel(device)
    note = ""
    if kernel == "triton" and torch.cuda.get_device_capability(device) == (9, 0):
        note = (" (slower than the Hopper kernels: this build has no sm_90a code, or "
                "SNAPMLA_DECODE_KERNEL=triton; build with SNAPMLA_ARCHS containing 90a)")
    logger.info(
        "fp8_snapmla decode kernel on cuda:%d: %s%s", device,
        "the Hopper kernels (sm_90a)" if kernel == "sm90" else "the portable Triton kernel", note)
    if kernel == "triton":
        logger.warning(
            "fp8_snapmla's Triton decode kernel is slower than BF16 attention (on an H200: "
            "0.8x BF16 FlashMLA at 16 heads, 0.3x at 128; not measured on other GPUs). What "
            "fp8_snapmla gives on cuda:%d is the 1.76x KV capacity: larger batches and longer "
            "contexts where the cache is what limits them.", device)


def decode_uniform(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   block_table: torch.Tensor, seq_lens: torch.Tensor, num_decodes: int,
                   softmax_scale: float, return_lse: bool = False,
                   plan: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode attention for vLLM's token-major decode batch (``forward_mqa``'s contract).

    ``q_nope [T,H,512]`` and ``q_pe [T,H,64]`` hold ``num_decodes`` requests of ``s_q = T /
    num_decodes`` consecutive query tokens each (QueryLenSupport.UNIFORM; under a FULL CUDA
    graph ``num_decodes`` is the padded batch).  Returns ``out [T,H,512]`` (bfloat16) and,
    with ``return_lse``, ``lse [T,H]`` (float32, natural log), token-major like ``out``.
    ``plan``: the step's split plan (``ops.plan_decode``), or None to plan in the call.

    Shapes only, no host sync and no data-dependent branch: safe under CUDA-graph capture.
    """
    T = q_nope.shape[0]
    if num_decodes <= 0 or T % num_decodes:
        raise ValueError(f"{T} decode tokens do not split into {num_decodes} requests of one "
                         "query length (SnapMLA decode needs uniform query lengths)")
    s_q = T // num_decodes
    # Views, no copies: q_nope is vLLM's transposed bmm output; the fused Q quantization
    # reads such strided rows in place.
    q_nope = q_nope.unflatten(0, (num_decodes, s_q))
    q_pe = q_pe.unflatten(0, (num_decodes, s_q))
    out, lse = snapmla_ops.decode(q_nope, q_pe, kv_cache.view(torch.uint8), block_table,
                                  seq_lens, softmax_scale, plan=plan)
    out = out.flatten(0, 1)                                   # [T, H, 512]
    if not return_lse:
        return out, None
    return out, lse.transpose(1, 2).flatten(0, 1)             # [B,H,s_q] -> [T, H]
