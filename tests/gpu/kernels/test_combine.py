"""The split combine on the GPU (``combine_splits``: one warp per row below 32 splits, eight
warps per row from 32 on) against its CPU model (``splits.combine`` on the CPU), on partials
with the cases the decode kernels produce: splits that saw nothing (LSE -inf, never written:
NaN garbage there), a NaN LSE, a NaN partial element, rows no split saw, and requests of one
run, which the decode kernel wrote and the combine must leave alone."""

import pytest
import torch

from vllm_snapmla import format as fmt
from vllm_snapmla._native import native
from vllm_snapmla.kernels import splits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or native() is None,
    reason="needs a CUDA GPU and the native combine_splits op")]

TABLE_PAGES = 4096
SENTINEL = 7.0   # what the decode kernel "wrote" for requests of one run


def _partials(batch, max_splits, s_q, heads, chunk, runs, seed):
    """Partials for requests cut into ``runs[b]`` runs of ``chunk`` pages (one run: left alone)."""
    gen = torch.Generator().manual_seed(seed)
    rows = s_q * heads
    part_out = torch.randn(batch, max_splits, rows, fmt.KV_LORA_RANK, generator=gen)
    part_lse = torch.rand(batch, max_splits, rows, generator=gen) * 16 - 8
    # Splits that saw nothing: LSE -inf and a partial never written (NaN garbage).
    unseen = torch.rand(batch, max_splits, rows, generator=gen) < 0.15
    part_lse[unseen] = float("-inf")
    part_out[unseen] = float("nan")
    seq_lens = torch.tensor([r * chunk * fmt.PAGE_SIZE - (b % fmt.PAGE_SIZE)
                             for b, r in enumerate(runs)], dtype=torch.int32)
    # Request 0: its first row saw nothing at all; its second row has a NaN LSE in its last run.
    part_lse[0, :, 0] = float("-inf")
    part_out[0, :, 0] = float("nan")
    part_lse[0, runs[0] - 1, 1] = float("nan")
    # Request 1: one NaN element in a partial of a split that saw tokens.
    part_lse[1, 0, 2] = 1.0
    part_out[1, 0, 2] = torch.randn(fmt.KV_LORA_RANK, generator=gen)
    part_out[1, 0, 2, 100] = float("nan")
    return part_out, part_lse, seq_lens


@pytest.mark.parametrize("max_splits, runs, s_q, heads", [
    (5, [5, 3, 1, 4], 1, 16),             # one warp per row
    (31, [31, 17, 1, 2], 2, 16),          # one warp per row, up to the threshold
    (32, [32, 5, 1, 31], 1, 16),          # eight warps per row from here on
    (66, [63, 40, 1, 2], 4, 8),
    (264, [128, 264, 1, 9], 1, 16),       # more splits than a launch makes: any max_splits merges
    (132, [128, 70, 1], 1, 128),
])
def test_combine_matches_its_cpu_model(max_splits, runs, s_q, heads):
    batch = len(runs)
    chunk = 2
    part_out, part_lse, seq_lens = _partials(batch, max_splits, s_q, heads, chunk, runs,
                                             seed=max_splits)
    pages_per_split = torch.tensor([chunk], dtype=torch.int32)
    out = torch.full((batch, s_q, heads, fmt.KV_LORA_RANK), SENTINEL, dtype=torch.bfloat16)
    lse = torch.full((batch, heads, s_q), SENTINEL)
    want_out, want_lse = out.clone(), lse.clone()
    splits.combine(part_out, part_lse, seq_lens, pages_per_split, TABLE_PAGES, want_out, want_lse)
    got_out, got_lse = out.cuda(), lse.cuda()
    splits.combine(part_out.cuda(), part_lse.cuda(), seq_lens.cuda(), pages_per_split.cuda(),
                   TABLE_PAGES, got_out, got_lse)
    got_out, got_lse = got_out.cpu().float(), got_lse.cpu()
    want_out = want_out.float()

    one_run = [b for b, r in enumerate(runs) if r == 1]
    assert one_run and all((got_out[b] == SENTINEL).all() and (got_lse[b] == SENTINEL).all()
                           for b in one_run), "a request of one run was overwritten"
    assert torch.equal(got_out.isnan(), want_out.isnan())
    assert torch.equal(got_lse.isnan(), want_lse.isnan())
    assert torch.equal(torch.isneginf(got_lse), torch.isneginf(want_lse))
    # The cases above happened: NaN rows, a NaN column, an empty row (0 out, -inf LSE).
    assert got_lse[0, 1 % heads, 1 // heads].isnan() and got_out[0, 0, 1].isnan().all()
    assert got_out[1, 0, 2, 100].isnan() and not got_out[1, 0, 2, 101].isnan()
    assert torch.isneginf(got_lse[0, 0, 0]) and (got_out[0, 0, 0] == 0).all()
    finite = ~want_out.isnan()
    # bf16 outputs: the two sum in different orders, so allow one bf16 rounding step.
    assert torch.allclose(got_out[finite], want_out[finite], rtol=1e-2, atol=1e-2)
    seen = torch.isfinite(want_lse)
    assert torch.allclose(got_lse[seen], want_lse[seen], rtol=0, atol=1e-4)


def test_combine_refuses_partials_without_splits():
    part_out = torch.zeros(1, 0, 16, fmt.KV_LORA_RANK, device="cuda")
    part_lse = torch.zeros(1, 0, 16, device="cuda")
    out = torch.zeros(1, 1, 16, fmt.KV_LORA_RANK, dtype=torch.bfloat16, device="cuda")
    lse = torch.zeros(1, 16, 1, device="cuda")
    seq_lens = torch.tensor([64], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="1 to 65535 splits"):
        splits.combine(part_out, part_lse, seq_lens, None, 1, out, lse)


def test_combine_refuses_more_requests_than_its_grid():
    batch = 65536   # the combine's grid holds the requests in y, at most 65535
    part_out = torch.zeros(batch, 1, 1, fmt.KV_LORA_RANK, device="cuda")
    part_lse = torch.zeros(batch, 1, 1, device="cuda")
    out = torch.zeros(batch, 1, 1, fmt.KV_LORA_RANK, dtype=torch.bfloat16, device="cuda")
    lse = torch.zeros(batch, 1, 1, device="cuda")
    seq_lens = torch.full((batch,), 64, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="at most 65535 requests"):
        splits.combine(part_out, part_lse, seq_lens, None, 1, out, lse)
