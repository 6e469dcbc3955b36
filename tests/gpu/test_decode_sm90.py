"""The sm_90a CUDA decode kernel (``vllm_snapmla.sm90``) against the references and Triton.

Same checks as ``test_decode_triton.py`` (its ``_case``/``_check`` helpers: poisoned paged cache,
comparison with ``reference.decode_quantized`` and the float64 attention), plus a direct comparison
with the Triton kernel on the same inputs.  Run on an H100/H200 with the extension built for
``90a``; skipped elsewhere.
"""

import pytest
import torch

from vllm_snapmla import format as fmt
from vllm_snapmla import reference as ref
from vllm_snapmla import sm90

from tests.gpu.test_decode_triton import RAGGED, SCALE, _case, _check, _rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.hopper,
    pytest.mark.skipif(not sm90.available(), reason="needs an sm_90 GPU and the decode_sm90 op"),
]

decode = sm90.snapmla_decode_sm90


def _where_wrong(out, lse, q8, qs, qpe, cache, bt, sl, causal=True):
    """Which query rows (lse) and which output column blocks are off, for a layout bug's address:
    wrong rows in steps of 8/16 point at the accumulator fragment, column blocks of 128/256 at
    the PV halves / warpgroups, all-NaN at masking or the V^T zeroing."""
    r_out, r_lse = ref.decode_quantized(q8, qs, qpe, cache, bt, sl, SCALE, causal)
    seen = ~torch.isneginf(r_lse)
    lse_err = torch.where(seen, (lse.double() - r_lse).abs(), 0.0)          # [B, H, s_q]
    bad_rows = (lse_err > 1e-2).nonzero().tolist()
    err = (out.double() - r_out).abs().permute(0, 2, 1, 3)                   # [B, H, s_q, 512]
    scale = r_out.abs().permute(0, 2, 1, 3).mean().clamp_min(1e-30)
    col_err = (err.amax((0, 1, 2)) / scale).view(-1, 32).amax(1)            # per 32 columns
    return (f"nan out {int(torch.isnan(out).sum())}, nan lse {int(torch.isnan(lse).sum())}; "
            f"{len(bad_rows)} rows [b, h, i] with lse error > 1e-2 (first: {bad_rows[:8]}); "
            f"max |err| / mean |out| per 32 output columns: "
            f"{[round(x, 3) for x in col_err.tolist()]}")


@pytest.mark.parametrize("seq_len", [64, 37, 129])
def test_few_pages_one_split(seq_len):
    """The smallest cases first: one request, 1-3 pages, one split (bf16 out written directly)."""
    q, qp, cache, bt, sl = _case([seq_len], 64, 1, seed=seq_len)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, True, num_splits=1)
    torch.cuda.synchronize()
    try:
        _check(out, lse, q, qp, cache, bt, sl)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{_where_wrong(out, lse, q8, qs, qpe, cache, bt, sl)}") from e


def test_block_table_with_spare_rows():
    """As with the Triton kernel, block_table / seq_lens may have more rows than requests."""
    q, qp, cache, bt, sl = _case([300, 65], 16, 1, seed=18)
    q8, qs, qpe = ref.quantize_q(q, qp)
    bt_spare = torch.cat([bt, bt.flip(0)])
    sl_spare = torch.cat([sl, sl.flip(0) + 1000])
    out, lse = decode(q8, qs, qpe, cache, bt_spare, sl_spare, SCALE, num_splits=2)
    _check(out, lse, q, qp, cache, bt, sl, check_exact=False)


@pytest.mark.parametrize("H", [16, 32, 64, 128])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_ragged_batch_matches_references(H, s_q, num_splits):
    q, qp, cache, bt, sl = _case(RAGGED, H, s_q, seed=H * 10 + s_q)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, True, num_splits=num_splits)
    _check(out, lse, q, qp, cache, bt, sl)


@pytest.mark.parametrize("H, s_q", [(128, 1), (16, 2)])
def test_large_batch(H, s_q):
    gen = torch.Generator().manual_seed(7)
    seq_lens = torch.randint(1, 3000, (64,), generator=gen).tolist()
    seq_lens[:4] = [1, 64, 65, 4096]
    q, qp, cache, bt, sl = _case(seq_lens, H, s_q, seed=8)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE)
    _check(out, lse, q, qp, cache, bt, sl, check_exact=False)


@pytest.mark.parametrize("num_splits", [None, 1])
def test_long_context_131072(num_splits):
    q, qp, cache, bt, sl = _case([131072, 5000], 128, 1, seed=9)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=num_splits)
    _check(out, lse, q, qp, cache, bt, sl)


def test_non_causal_two_token_query():
    q, qp, cache, bt, sl = _case([1, 65, 300], 32, 2, seed=10)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, False, num_splits=3)
    _check(out, lse, q, qp, cache, bt, sl, causal=False)


def test_peaked_attention():
    """Large logits (sharp softmax): P blocks span many orders of magnitude across pages."""
    q, qp, cache, bt, sl = _case([3000, 200], 64, 1, seed=11, q_std=8.0)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=3)
    _check(out, lse, q, qp, cache, bt, sl)


def test_all_requests_empty():
    q, qp, cache, bt, sl = _case([0, 0], 16, 2, seed=12)
    q8, qs, qpe = ref.quantize_q(q, qp)
    for splits in (None, 1, 4):
        out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=splits)
        assert (out == 0).all() and torch.isneginf(lse).all()


def test_strided_cache_blocks():
    """Cache blocks further apart than 64 rows (a view into a larger allocation) and a block
    table that is a column slice: both reach the kernel without copies."""
    q, qp, cache, bt, sl = _case([700, 65, 1], 64, 1, seed=15)
    wide = torch.full((cache.shape[0], 2 * fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN), 0x7F,
                      dtype=torch.uint8, device=cache.device)
    wide[:, :fmt.PAGE_SIZE] = cache
    strided = wide[:, :fmt.PAGE_SIZE]
    bt_wide = torch.cat([bt, torch.zeros_like(bt)], 1)[:, :bt.shape[1]]
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, strided, bt_wide, sl, SCALE, num_splits=2)
    _check(out, lse, q, qp, cache, bt, sl, check_exact=False)


@pytest.mark.parametrize("H, s_q, num_splits", [(128, 1, 2), (16, 2, 1), (64, 2, 5)])
def test_matches_triton_kernel(H, s_q, num_splits):
    """Same algorithm, inputs and splits: the kernels differ only in FP32 rounding order, the QK
    promotion interval (128 vs 64 terms) and exp2, so a layout or masking bug (errors of order 1)
    stands out far above their differences."""
    from vllm_snapmla.triton.decode import snapmla_decode
    q, qp, cache, bt, sl = _case(RAGGED + [5000], H, s_q, seed=16 + H)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=num_splits)
    t_out, t_lse = snapmla_decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=num_splits)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(t_lse))
    seen = ~torch.isneginf(t_lse)
    assert (lse - t_lse)[seen].abs().max().item() <= 5e-3
    assert _rel(out, t_out.double()) <= 1e-2


def test_cuda_graph_replay_with_new_lengths():
    """A fixed split count makes the launch shape independent of the lengths: capture, replay."""
    from vllm_snapmla.triton.decode import fixed_num_splits
    lengths_a, lengths_b = [900, 64, 1, 2000], [2047, 1, 640, 65]
    q, qp, cache, bt, sl = _case([2048] * 4, 64, 2, seed=14)
    q8, qs, qpe = ref.quantize_q(q, qp)
    splits = fixed_num_splits(4, 64, max_model_len=2048, s_q=2)
    sl.copy_(torch.tensor(lengths_a, dtype=torch.int32))
    decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=splits)   # compile the combine first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=splits)
    for lengths in (lengths_a, lengths_b):
        sl.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, lse, q, qp, cache, bt, sl, check_exact=False)


def test_rejects_bad_inputs():
    q, qp, cache, bt, sl = _case([100], 16, 1, seed=17)
    q8, qs, qpe = ref.quantize_q(q, qp)
    with pytest.raises((RuntimeError, TypeError, ValueError), match="q_pe_scaled"):
        decode(q8, qs, qpe.float(), cache, bt, sl, SCALE)
    with pytest.raises((RuntimeError, TypeError, ValueError), match="kv_cache"):
        decode(q8, qs, qpe, cache[:, :32], bt, sl, SCALE)
