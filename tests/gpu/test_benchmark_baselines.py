"""The baselines the benchmarks time compute the attention they are named for (on the GPU).

``benchmarks/bench_decode.py`` calls vLLM's FlashAttention-3 MLA decode (``fa3-mla-bf16``,
vLLM's BF16 default on Hopper) over the same cache as FlashMLA, seen in 16-token pages through
a block table of its own; a wrong table would time another computation.  Here both
FlashAttention calls (CUDA-graph split bound, eager heuristic) must give FlashMLA's BF16 output
on ragged lengths in vLLM's 2560-column table, with one and two query tokens; and
``benchmarks/explain_matrix.py`` must time both sides of a cell in both modes.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _baselines():
    pytest.importorskip("vllm", reason="the baselines are vLLM's kernels")
    from benchmarks import bench_decode

    fm, why = bench_decode.flashmla_ops()
    if fm is None:
        pytest.skip(f"FlashMLA: {why}")
    fa3, why = bench_decode.fa3_mla_ops()
    if fa3 is None:
        pytest.skip(why)
    return bench_decode, fm, fa3


@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("eager", [False, True])
def test_flashattention_mla_reads_the_same_tokens_as_flashmla(s_q, eager):
    bench_decode, fm, fa3 = _baselines()
    from vllm_snapmla import format as fmt

    gen = torch.Generator().manual_seed(11 + s_q)
    inputs = bench_decode.make_inputs(24, 16, 3000, s_q, gen, table_width=2560, ragged=True)
    lengths = inputs["seq_lens"].tolist()
    assert len(set(lengths)) > 10 and min(lengths) < 1000   # ragged, pages of every fill
    wanted = {"flashmla-bf16", bench_decode.FA3_MLA}
    calls, fresh = bench_decode.decode_calls(inputs, fm, fa3, fmt.HEAD_SIZE ** -0.5, None, wanted,
                                             eager)
    flashmla = calls["flashmla-bf16"]()[0].float()
    for call in (calls[bench_decode.FA3_MLA], fresh[bench_decode.FA3_MLA]):
        out = call()[0].float()
        assert out.shape == flashmla.shape == (24, s_q, 16, fmt.KV_LORA_RANK)
        # Two BF16 kernels over one cache: they differ by rounding only (a page read from the
        # wrong place moves the output by O(1)).  Per request, so that one short request read
        # wrongly is not averaged away by 23 long ones.
        for b, length in enumerate(lengths):
            relerr = ((out[b] - flashmla[b]).norm() / flashmla[b].norm()).item()
            assert relerr < 1e-2, (b, length, relerr)


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_explain_times_both_sides_of_a_cell(mode):
    bench_decode, _, _ = _baselines()
    from benchmarks import explain_matrix

    shape = (8, 16, 700, 12)   # B, H, N, 64-token table columns
    ours = explain_matrix.time_attention(shape, "snapmla", mode)
    bf16 = explain_matrix.time_attention(shape, bench_decode.FA3_MLA, mode)
    assert 0 < ours["us"] < 1e4 and 0 < bf16["us"] < 1e4
    # Both sides have per-step metadata: the BF16 kernel's scheduler metadata, our split plan
    # (ops.plan_decode).
    assert bf16["metadata_us"] >= 0 and ours["metadata_us"] >= 0
