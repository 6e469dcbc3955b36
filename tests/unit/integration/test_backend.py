"""``integration/backend.py`` in vLLM: the cache layout and block sizes ``SnapMLABackend``
states (H6, also as the V2 runner reshapes a drafter-only layer), and ``SnapMLAImpl``'s cache
write and decode (H7, H8) on CPU tensors, against the reference.

Functions named ``_in_vllm_*`` run inside a vLLM process on a fake CUDA platform
(``tests/unit/_vllm_cpu.py``); the tests call them through ``VllmCpuProcess.call``.
"""

import pytest

KV = "fp8_snapmla"


def _in_vllm_backend_layout():
    from vllm_snapmla.integration.backend import SnapMLABackend

    shape = SnapMLABackend.get_kv_cache_shape(1000, 64, 1, 576, cache_dtype_str=KV)
    return {"name": SnapMLABackend.get_name(), "shape": list(shape),
            "block dim": SnapMLABackend.get_kv_cache_block_dim(64, 1, 576, cache_dtype_str=KV),
            "preferred block size": SnapMLABackend.get_preferred_block_size(16),
            "block sizes": [b for b in (None, 16, 32, 64, 128)
                            if SnapMLABackend.supports_block_size(b)],
            "is_mla": SnapMLABackend.is_mla(), "is_sparse": SnapMLABackend.is_sparse(),
            "cudagraph": SnapMLABackend.get_builder_cls()._cudagraph_support.name,
            "query len": SnapMLABackend.get_builder_cls().query_len_support.name,
            "pcp": SnapMLABackend.supports_pcp()}


def _in_vllm_v2_runner_shape_for_a_drafter_only(target_dtype):
    """The V2 model runner's reshape of a drafter layer on fp8_snapmla while the model's
    dtype is ``target_dtype`` (it passes the model's dtype to get_kv_cache_shape)."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode
    from vllm.v1.worker.gpu.attn_utils import _reshape_kv_cache
    from vllm.v1.worker.utils import AttentionGroup

    from vllm_snapmla.integration.backend import SnapMLABackend

    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.uint8,
                            cache_dtype_str=KV, kv_quant_mode=get_kv_quant_mode(KV))
    group = AttentionGroup(backend=SnapMLABackend, layer_names=["draft.attn"],
                           kv_cache_spec=spec, kv_cache_group_id=0)
    raw = {"draft.attn": torch.zeros(10 * spec.page_size_bytes, dtype=torch.int8)}
    out = _reshape_kv_cache([group], raw, cache_dtype=target_dtype, kernel_block_sizes=[64],
                            shared_kv_cache_layers={})
    return list(out["draft.attn"].shape)


@pytest.mark.parametrize("target_dtype", ["auto", "fp8", KV])
def test_v2_runner_gives_a_drafter_only_layer_656_byte_rows(vllm_cpu, target_dtype):
    assert vllm_cpu.call(_in_vllm_v2_runner_shape_for_a_drafter_only,
                         target_dtype=target_dtype) == \
        [10, 64, 656]


def test_backend_kv_cache_layout(vllm_cpu):
    layout = vllm_cpu.call(_in_vllm_backend_layout)
    assert layout == {"name": "SNAPMLA", "shape": [1000, 64, 656], "block dim": 0,
                      "preferred block size": 64, "block sizes": [None, 64],
                      "is_mla": True, "is_sparse": False, "cudagraph": "UNIFORM_BATCH",
                      "query len": "UNIFORM", "pcp": False}
    # The runner views page_size_bytes * num_blocks bytes as this shape: they must agree.
    assert layout["shape"][1] * layout["shape"][2] == 64 * 656


def _in_vllm_impl_write_then_decode():
    import types

    import torch
    import vllm._custom_ops as custom_ops
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import MLACommonDecodeMetadata

    from vllm_snapmla.testing import NAN_F32
    from tests.unit._vllm_cpu import device_capability, engine_config, tiny_model
    from vllm_snapmla import format as fmt
    from vllm_snapmla import reference as ref
    from vllm_snapmla.integration.backend import SnapMLABackend

    config = engine_config(tiny_model(), kv_cache_dtype=KV)
    with set_current_vllm_config(config), device_capability(9, 0):
        impl = SnapMLABackend.get_impl_cls()(
            num_heads=16, head_size=576, scale=0.0721, num_kv_heads=1, alibi_slopes=None,
            sliding_window=None, kv_cache_dtype=KV, logits_soft_cap=None, attn_type="decoder",
            kv_sharing_target_layer_name=None, q_lora_rank=256, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, qk_head_dim=192, v_head_dim=128,
            kv_b_proj=None)
    gen = torch.Generator().manual_seed(1)
    seq_lens = [70, 5, 130]
    num_blocks = 9
    cache = torch.randint(0, 256, (num_blocks, 64, 656), dtype=torch.uint8, generator=gen)
    cache[..., fmt.SCALE_OFFSET:fmt.PAD_OFFSET] = NAN_F32
    block_table = torch.randperm(num_blocks, generator=gen)[:3 * 3].view(3, 3).int()
    slots = torch.cat([(block_table[b].long()[:, None] * 64 + torch.arange(64)).flatten()[:n]
                       for b, n in enumerate(seq_lens)])
    slots[7] = -1                                     # a padding slot vLLM skips
    T = slots.numel()
    kv_c = torch.randn(T + 3, 512, generator=gen).to(torch.bfloat16)   # +3 rows of CG padding
    k_pe = (3 * torch.randn(T + 3, 1, 64, generator=gen)).to(torch.bfloat16)
    expected_cache = cache.clone()
    ref.append_kv(kv_c, k_pe.squeeze(1), expected_cache, slots)

    impl.do_kv_cache_update(kv_c, k_pe, cache, slots, KV, torch.ones(1))
    impl.do_kv_cache_update(kv_c, k_pe, torch.empty(0, dtype=torch.uint8), slots, KV,
                            torch.ones(1))                          # profile run: no cache
    writes_match = torch.equal(cache, expected_cache)

    # Decode, with the query as forward_impl builds it: ql_nope from a transposed bmm, and the
    # cache viewed as FP8.  Position 7's slot was skipped: decode only to lengths that avoid it.
    decode_lens = torch.tensor([5, 5, 130], dtype=torch.int32)
    B, N = 3, 16
    ql_nope = torch.randn(N, B, 512, generator=gen).to(torch.bfloat16).transpose(0, 1)
    q_pe = (3 * torch.randn(B, N, 64, generator=gen)).to(torch.bfloat16)
    metadata = types.SimpleNamespace(num_decodes=B, decode=MLACommonDecodeMetadata(
        block_table=block_table, seq_lens=decode_lens, dcp_tot_seq_lens=None))
    out, lse = impl.forward_mqa((ql_nope, q_pe), cache.view(torch.float8_e4m3fn), metadata,
                                layer=None)
    want, want_lse = ref.decode(ql_nope.unsqueeze(1), q_pe.unsqueeze(1), cache, block_table,
                                decode_lens, 0.0721)
    impl.need_to_return_lse_for_decode = True           # what DCP would ask for
    _, lse_dcp = impl.forward_mqa((ql_nope, q_pe), cache.view(torch.float8_e4m3fn), metadata,
                                  layer=None)
    return {"writes match": writes_match, "out shape": list(out.shape), "out dtype": str(out.dtype),
            "out equals reference": torch.equal(out, want.squeeze(1).to(torch.bfloat16)),
            "lse": lse, "lse shape": list(lse_dcp.shape),
            "lse equals reference": torch.equal(lse_dcp, want_lse.squeeze(-1).float()),
            "quantized query input": impl.supports_quant_query_input,
            "gather installed": hasattr(custom_ops.gather_and_maybe_dequant_cache,
                                        "__snapmla_wrapped__")}


def test_impl_writes_cache_and_decodes_through_ops(vllm_cpu):
    assert vllm_cpu.call(_in_vllm_impl_write_then_decode) == {
        "writes match": True, "out shape": [3, 16, 512], "out dtype": "torch.bfloat16",
        "out equals reference": True, "lse": None, "lse shape": [3, 16],
        "lse equals reference": True, "quantized query input": False, "gather installed": True}
