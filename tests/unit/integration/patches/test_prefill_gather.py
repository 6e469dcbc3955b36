"""H9 (``patches/prefill_gather.py``): vLLM's context gather, called for an ``fp8_snapmla``
cache, writes the dequantized rows of exactly the chunk's positions.

Functions named ``_in_vllm_*`` run inside a vLLM process on a fake CUDA platform
(``tests/unit/_vllm_cpu.py``); the tests call them through ``VllmCpuProcess.call``.
"""

KV = "fp8_snapmla"


def _in_vllm_prefill_gather():
    import torch
    import vllm._custom_ops as custom_ops

    from vllm_snapmla.testing import build_cache
    from vllm_snapmla.integration.patches import prefill_gather
    from vllm_snapmla import reference as ref

    prefill_gather.apply()
    gen = torch.Generator().manual_seed(2)
    seq_lens = [100, 40, 200]
    cache, block_table, _ = build_cache(seq_lens, gen=gen)
    # One chunk of the chunked-prefill context: request b contributes positions
    # [starts[b], starts[b] + chunk_lens[b]).
    starts = torch.tensor([64, 0, 128], dtype=torch.int32)
    chunk_lens = torch.tensor([36, 40, 72])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), chunk_lens.cumsum(0)]).int()
    token_to_seq = torch.repeat_interleave(torch.arange(3), chunk_lens).int()
    total = int(chunk_lens.sum())
    workspace = torch.full((total + 16, 576), float("nan"), dtype=torch.bfloat16)
    custom_ops.gather_and_maybe_dequant_cache(
        src_cache=cache.view(torch.float8_e4m3fn), dst=workspace, block_table=block_table,
        cu_seq_lens=cu, token_to_seq=token_to_seq, num_tokens=torch.tensor(total),
        kv_cache_dtype=KV, scale=torch.ones(1), seq_starts=starts)
    expected = []
    for b in range(3):
        for pos in range(int(starts[b]), int(starts[b] + chunk_lens[b])):
            c, r = ref.dequantize_kv(cache[block_table[b, pos // 64], pos % 64])
            expected.append(torch.cat([c, r]).to(torch.bfloat16))
    return {"rows match": torch.equal(workspace[:total], torch.stack(expected)),
            "tail untouched": bool(workspace[total:].isnan().all())}


def test_prefill_gather_wrapper_dequantizes_context(vllm_cpu):
    assert vllm_cpu.call(_in_vllm_prefill_gather) == {"rows match": True,
                                                      "tail untouched": True}
