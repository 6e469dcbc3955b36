"""The CPU reference: format round trip, edge rows, paged write/gather, and decode vs exact."""

import math

import pytest
import torch

from vllm_snapmla import format as fmt
from vllm_snapmla import ops, reference as ref

from vllm_snapmla.testing import build_cache


def _rows(T, dtype=torch.bfloat16, content=1.0, rope=3.0, gen=None):
    kv_c = (torch.randn(T, fmt.KV_LORA_RANK, generator=gen) * content).to(dtype)
    k_pe = (torch.randn(T, fmt.ROPE_DIM, generator=gen) * rope).to(dtype)
    return kv_c, k_pe


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_and_byte_layout(dtype):
    kv_c, k_pe = _rows(257, dtype)
    rows = ops.quantize_kv(kv_c, k_pe)
    assert rows.shape == (257, fmt.BYTES_PER_TOKEN) and rows.dtype == torch.uint8
    assert (rows[:, fmt.PAD_OFFSET:fmt.ROPE_OFFSET] == 0).all()
    s = rows[:, fmt.SCALE_OFFSET:fmt.PAD_OFFSET].contiguous().view(torch.float32)[:, 0]
    torch.testing.assert_close(s, kv_c.float().abs().amax(-1) / fmt.FP8_MAX, rtol=0, atol=0)
    c, r = ops.dequantize_kv(rows)
    # e4m3 keeps 3 mantissa bits (relative step 2**-3, rounding error <= 2**-4); its subnormals
    # have an absolute step of 2**-9 in units of s.  bf16 RoPE keeps 8 bits.
    tol_c = torch.maximum(kv_c.float().abs() * 2 ** -4, s[:, None] * 2 ** -10) * 1.001
    assert ((c - kv_c.float()).abs() <= tol_c).all()
    assert ((r - k_pe.float()).abs() <= k_pe.float().abs() * 2 ** -8 * 1.01 + 1e-30).all()
    # The content uses the whole e4m3 range: every row has an element at +-448.
    c8 = rows[:, :fmt.KV_LORA_RANK].contiguous().view(torch.float8_e4m3fn).float()
    assert (c8.abs().amax(-1) == fmt.FP8_MAX).all()


@pytest.mark.parametrize("content, rope", [
    (0.0, 0.0),          # all-zero row: scale must not be 0
    (1e-30, 1e-30),      # tiny row
    (1e-30, 1e3),        # RoPE huge next to content: k_pe/s must not overflow bf16
    (0.0, 1e30),         # zero content, huge RoPE
    (1e30, 1e30),        # huge row (fp32 input)
    (1e-38, 0.0),        # denormal-adjacent content
])
def test_edge_rows_stay_finite(content, rope):
    kv_c, k_pe = _rows(8, torch.float32, content, rope)
    rows = ops.quantize_kv(kv_c, k_pe)
    c8, s, r16 = ref.split_rows(rows)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.isfinite(c8.float()).all() and torch.isfinite(r16.float()).all()
    assert (r16.float().abs() <= fmt.ROPE_PRESCALED_MAX).all()
    c, r = ops.dequantize_kv(rows)
    assert torch.isfinite(c).all() and torch.isfinite(r).all()
    # Whatever the floors did, the dequantized RoPE keeps bf16 relative precision.
    assert ((r - k_pe).abs() <= k_pe.abs() * 2 ** -8 * 1.01 + 1e-37).all()


def test_query_quantization_matches_key_rule():
    q = torch.randn(3, 2, 16, fmt.KV_LORA_RANK).bfloat16()
    qp = (torch.randn(3, 2, 16, fmt.ROPE_DIM) * 5).bfloat16()
    q8, qs, qpe = ops.quantize_q(q, qp)
    assert q8.dtype == torch.float8_e4m3fn and qs.shape == (3, 2, 16)
    assert qpe.dtype == torch.bfloat16
    rows = ops.quantize_kv(q.reshape(-1, fmt.KV_LORA_RANK), qp.reshape(-1, fmt.ROPE_DIM))
    c8, s, r16 = ref.split_rows(rows)
    assert torch.equal(q8.reshape(-1, fmt.KV_LORA_RANK).view(torch.uint8), c8.view(torch.uint8))
    assert torch.equal(qs.reshape(-1), s)
    assert torch.equal(qpe.reshape(-1, fmt.ROPE_DIM), r16)


def test_append_skips_negative_slots_and_padding_rows():
    cache = torch.randint(0, 256, (4, fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN), dtype=torch.uint8)
    before = cache.clone()
    kv_c, k_pe = _rows(10)
    slots = torch.tensor([5, -1, 64 * 3 + 63, 130, -1, 0], dtype=torch.int64)  # 4 rows unused
    ops.append_kv(kv_c, k_pe.unsqueeze(1), cache, slots)
    flat, flat_before = cache.view(-1, fmt.BYTES_PER_TOKEN), before.view(-1, fmt.BYTES_PER_TOKEN)
    expect = ops.quantize_kv(kv_c, k_pe)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat[slot], expect[t])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[[s for s in slots.tolist() if s >= 0]] = False
    assert torch.equal(flat[untouched], flat_before[untouched])


def test_gather_matches_gather_and_maybe_dequant_cache_semantics():
    gen = torch.Generator().manual_seed(3)
    seq_lens = [70, 1, 130]
    cache, block_table, kv = build_cache(seq_lens, gen=gen)
    seq_starts = torch.tensor([5, 0, 64])
    chunk = [40, 1, 66]                       # tokens gathered per request in this chunk
    cu = torch.tensor([0, 40, 41, 107])
    token_to_seq = torch.repeat_interleave(torch.arange(3), torch.tensor(chunk))
    dst = torch.full((120, fmt.HEAD_SIZE), float("nan"), dtype=torch.bfloat16)
    ops.gather_kv(cache, dst, block_table, cu, token_to_seq, torch.tensor(107), seq_starts)
    for b in range(3):
        for j in range(chunk[b]):
            pos = int(seq_starts[b]) + j
            c, r = ops.dequantize_kv(ops.quantize_kv(kv[b][0][pos:pos + 1], kv[b][1][pos:pos + 1]))
            row = torch.cat([c, r], -1).bfloat16()[0]
            assert torch.equal(dst[int(cu[b]) + j], row), (b, j)
    assert dst[107:].isnan().all()            # rows past num_tokens untouched


def _sdpa_exact(q, qp, kv, seq_lens, scale, causal):
    """Independent float64 attention over contiguous per-request K/V (no paging)."""
    B, s_q, H, _ = q.shape
    out = torch.zeros(B, s_q, H, fmt.KV_LORA_RANK, dtype=torch.float64)
    for b in range(B):
        n = seq_lens[b]
        c, r = (x.double() for x in ops.dequantize_kv(ops.quantize_kv(*kv[b])))
        k = torch.cat([c, r], -1)
        qq = torch.cat([q[b], qp[b]], -1).double().permute(1, 0, 2)       # [H, s_q, 576]
        mask = torch.ones(s_q, n, dtype=torch.bool)
        if causal:
            mask = torch.arange(n)[None, :] <= torch.arange(n - s_q, n)[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            qq, k[None].expand(H, -1, -1), c[None].expand(H, -1, -1), attn_mask=mask, scale=scale)
        out[b] = o.permute(1, 0, 2)
    return out


CASES = [
    (16, 1, [1, 63, 64, 65, 300]),
    (32, 2, [2, 129, 64]),
    (64, 1, [513, 7]),
    (128, 2, [200, 3]),
    (128, 1, [1500]),
]


@pytest.mark.parametrize("H, s_q, seq_lens", CASES)
def test_decode_algorithm_tracks_exact_attention(H, s_q, seq_lens):
    gen = torch.Generator().manual_seed(H * 7 + s_q)
    cache, block_table, kv = build_cache(seq_lens, gen=gen)
    B = len(seq_lens)
    q = torch.randn(B, s_q, H, fmt.KV_LORA_RANK, generator=gen).bfloat16()
    qp = torch.randn(B, s_q, H, fmt.ROPE_DIM, generator=gen).bfloat16()
    scale = 1 / math.sqrt(192)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    out, lse = ref.decode(q, qp, cache, block_table, sl, scale)
    ex, ex_lse = ref.decode(q, qp, cache, block_table, sl, scale, exact=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # The exact mode itself agrees with an independent, unpaged float64 SDPA.
    torch.testing.assert_close(ex, _sdpa_exact(q, qp, kv, seq_lens, scale, True),
                               rtol=1e-9, atol=1e-9)
    rel = ((out - ex).norm() / ex.norm()).item()
    # FP8 Q and P cost about 2.5e-2 on N(0,1) data; far more means a broken pipeline,
    # far less means the quantization steps are not being applied.
    assert 2e-3 < rel < 4e-2, rel
    # LSE error is the FP8 error of single logits (a few percent of logits of size ~5).
    lse_err = (lse - ex_lse).abs()
    assert lse_err.max() < 0.25 and lse_err.mean() < 0.03, (lse_err.max(), lse_err.mean())
    # ops.decode on CPU is this reference, in the kernel's output dtypes.
    o16, l32 = ops.decode(q, qp, cache, block_table, sl, scale)
    assert o16.dtype == torch.bfloat16 and l32.dtype == torch.float32
    assert o16.shape == (B, s_q, H, fmt.KV_LORA_RANK) and l32.shape == (B, H, s_q)
    torch.testing.assert_close(o16.double(), out, rtol=1e-2, atol=1e-2)


def test_decode_causal_rows_match_shorter_requests():
    """Row i of an s_q=2 causal decode equals an s_q=1 decode over seq_len - 1 + i tokens."""
    gen = torch.Generator().manual_seed(11)
    seq_lens = [100, 65]
    cache, bt, _ = build_cache(seq_lens, gen=gen)
    q = torch.randn(2, 2, 16, fmt.KV_LORA_RANK, generator=gen).bfloat16()
    qp = torch.randn(2, 2, 16, fmt.ROPE_DIM, generator=gen).bfloat16()
    sl = torch.tensor(seq_lens)
    out, lse = ref.decode(q, qp, cache, bt, sl, 0.1)
    first, first_lse = ref.decode(q[:, :1], qp[:, :1], cache, bt, sl - 1, 0.1)
    torch.testing.assert_close(out[:, :1], first, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[:, :, :1], first_lse, rtol=1e-12, atol=1e-12)
    full, _ = ref.decode(q, qp, cache, bt, sl, 0.1, causal=False)
    assert not torch.allclose(full[:, 0], out[:, 0])


@pytest.mark.parametrize("gap", [90.0, 2500.0])
def test_decode_survives_attention_sink_gap(gap):
    """Token 0 sits ``gap`` nats above the rest: later blocks' probabilities underflow next to it.

    The P-scale floor (format.P_SCALE_RANGE) must keep the result finite and accurate.
    """
    gen = torch.Generator().manual_seed(5)
    n, scale = 64 * 6, 0.1
    kv_c = torch.randn(n, fmt.KV_LORA_RANK, generator=gen)
    k_pe = torch.randn(n, fmt.ROPE_DIM, generator=gen)
    q_pe = torch.randn(fmt.ROPE_DIM, generator=gen)
    k_pe[0] = q_pe * gap / (scale * q_pe.square().sum())
    cache, bt, _ = build_cache([n], kv=[(kv_c.bfloat16(), k_pe.bfloat16())], gen=gen)
    q = torch.randn(1, 1, 8, fmt.KV_LORA_RANK, generator=gen).bfloat16()
    qp = q_pe.expand(1, 1, 8, fmt.ROPE_DIM).bfloat16()
    out, lse = ref.decode(q, qp, cache, bt, torch.tensor([n]), scale)
    ex, ex_lse = ref.decode(q, qp, cache, bt, torch.tensor([n]), scale, exact=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert ((out - ex).norm() / ex.norm()) < 4e-2
    assert (lse - ex_lse).abs().max() < 0.05 * gap


def test_empty_request_gives_zero_output_and_minus_inf_lse():
    cache, bt, _ = build_cache([5, 0])
    q = torch.randn(2, 1, 16, fmt.KV_LORA_RANK).bfloat16()
    qp = torch.randn(2, 1, 16, fmt.ROPE_DIM).bfloat16()
    out, lse = ref.decode(q, qp, cache, bt, torch.tensor([5, 0]), 0.1)
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all() and torch.isfinite(lse[0]).all()


def test_decode_kernel_choice_is_checked(monkeypatch):
    """SNAPMLA_DECODE_KERNEL: a typo or an unavailable sm90 kernel is an error, not a fallback."""
    cpu = torch.device("cpu")
    # As on a machine without an sm_90 GPU, also where a GPU is present.
    monkeypatch.setattr(ops, "_sm90_available", lambda device: False)
    for value, error in (("flashmla", ValueError), ("sm90", RuntimeError)):
        monkeypatch.setenv("SNAPMLA_DECODE_KERNEL", value)
        with pytest.raises(error, match="SNAPMLA_DECODE_KERNEL"):
            ops._use_sm90(cpu)
    for value in ("triton", "auto"):   # auto: no sm_90 GPU here, so the Triton kernel
        monkeypatch.setenv("SNAPMLA_DECODE_KERNEL", value)
        assert ops._use_sm90(cpu) is False
