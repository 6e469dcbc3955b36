"""The contract of ``vllm_snapmla.ops`` on CPU tensors (the reference path): every violation
raises an error naming the argument, invalid indices never read another block, and NaN/Inf
propagate as in exact attention.  Property-based (``hypothesis``) over shapes, lengths, tables
and where things go wrong; the same properties run on the GPU kernels in
``tests/gpu/test_ops_cuda.py``."""

from __future__ import annotations

import re

import pytest
import torch

from vllm_snapmla import format as fmt
from vllm_snapmla import ops
from vllm_snapmla import reference as ref
from vllm_snapmla.testing import build_cache

from tests.decode_cases import (BAD_ARGUMENTS, BAD_INDICES, NON_FINITE, decode_case,
                                nan_rows_of, nan_scale_at, rows_reading_page,
                                zero_filled_page)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

lengths = st.lists(st.integers(0, 200), min_size=1, max_size=3)
heads = st.sampled_from([1, 2, 4])
s_qs = st.sampled_from([1, 2])
seeds = st.integers(0, 2**16)


@SETTINGS
@given(lens=lengths, H=heads, s_q=s_qs, seed=seeds, name=st.sampled_from(sorted(BAD_ARGUMENTS)))
def test_bad_arguments_raise_errors_that_name_them(lens, H, s_q, seed, name):
    change, error, argument = BAD_ARGUMENTS[name]
    case = decode_case(lens, H, s_q, seed)
    if name == "q_pe broadcasts over the batch":
        assume(len(lens) > 1)
    if name == "seq_lens too short":
        assume(len(lens) > 0)
    with pytest.raises(error, match=re.escape(argument)):
        ops.decode(*change(case).args())


def _assert_nan_in_those_rows_only(bad, case, rows, exact):
    """``bad``'s outputs are NaN (output and LSE) in ``rows`` and equal to ``case``'s bit for bit
    elsewhere: nothing of another block was read."""
    if exact:
        out, lse = ref.decode(*bad.args(), exact=True)
        base_out, base_lse = ref.decode(*case.args(), exact=True)
    else:   # what the CUDA kernels do without validate
        out, lse = ops.decode(*bad.args(), validate=False)
        base_out, base_lse = ops.decode(*case.args())
    nan_out, nan_lse = nan_rows_of(out, lse)
    assert torch.equal(nan_out, rows) and torch.equal(nan_lse, rows)
    assert torch.equal(out[~rows], base_out[~rows])
    assert torch.equal(lse.permute(0, 2, 1)[~rows], base_lse.permute(0, 2, 1)[~rows])


@SETTINGS
@given(lens=lengths, H=heads, s_q=s_qs, seed=seeds, name=st.sampled_from(sorted(BAD_INDICES)),
       pick=st.integers(0, 2))
def test_bad_indices_raise_or_give_nan_where_they_are_read(lens, H, s_q, seed, name, pick):
    change, message, nan_rows = BAD_INDICES[name]
    b = pick % len(lens)
    if "block id" in name:
        assume(lens[b] > 0)   # a page the request reads
    case = decode_case(lens, H, s_q, seed)
    bad = change(case, b)
    with pytest.raises(ValueError, match=message.format(b=b)):
        ops.decode(*bad.args())
    for exact in (False, True):
        _assert_nan_in_those_rows_only(bad, case, nan_rows(case, b), exact)


@pytest.mark.parametrize("s_q", [2, 4])
def test_nan_scale_on_a_token_only_the_last_query_sees(s_q):
    """The token's rows are NaN; the earlier queries, which do not attend to it, are exact in
    both references."""
    case = decode_case([129, 65, 70], 2, s_q, 0)
    rows = rows_reading_page(case, 1, 1)
    for exact in (False, True):
        _assert_nan_in_those_rows_only(nan_scale_at(case, 1, 64), case, rows, exact)


@pytest.mark.parametrize("s_q", [2, 4])
@pytest.mark.parametrize("name", ["block id -1", "block id past the cache"])
def test_bad_block_id_on_a_page_only_the_later_queries_read(name, s_q):
    """Causal s_q > 1: a request of 64 k + 1 tokens has its last page read by its last query
    only.  That row is NaN; the earlier ones are exact (nothing of the bad page enters them)."""
    case = decode_case([129, 65, 70], 2, s_q, 0)
    bad = BAD_INDICES[name][0](case, 1)
    rows = rows_reading_page(case, 1, 1)
    assert rows[1].any() and not rows[1].all()
    for exact in (False, True):
        _assert_nan_in_those_rows_only(bad, case, rows, exact)


@SETTINGS
@given(lens=st.lists(st.integers(2, 200), min_size=1, max_size=3), H=heads, s_q=s_qs,
       seed=seeds, name=st.sampled_from(sorted(NON_FINITE)), pick=st.integers(0, 2))
def test_nan_inputs_give_nan_where_attention_uses_them(lens, H, s_q, seed, name, pick):
    b = pick % len(lens)
    case = decode_case(lens, H, s_q, seed)
    poisoned, rows = NON_FINITE[name](case, b, torch.Generator().manual_seed(seed))
    out, lse = ops.decode(*poisoned.args())
    nan_out, nan_lse = nan_rows_of(out, lse)
    assert torch.equal(nan_out, rows) and torch.equal(nan_lse, rows), name
    base_out, _ = ops.decode(*case.args())
    assert torch.equal(out[~rows], base_out[~rows])
    # Exact float64 attention agrees on which rows are NaN.
    ex_out, ex_lse = ref.decode(*poisoned.args(), exact=True)
    assert torch.equal(nan_rows_of(ex_out, ex_lse)[0], rows)


@SETTINGS
@given(lens=st.lists(st.integers(1, 200), min_size=1, max_size=3), H=heads, s_q=s_qs,
       seed=seeds, pick=st.integers(0, 2))
def test_zero_filled_rows_read_as_zero_tokens(lens, H, s_q, seed, pick):
    """A live page on an all-zero block (vLLM's never-written null block: scale 0.0, which the
    format never writes) reads as tokens with zero key and value, as a BF16 cache holds there:
    the same attention as zero vectors written through the format (scale at its floor)."""
    b = pick % len(lens)
    case, _ = zero_filled_page(decode_case(lens, H, s_q, seed), b,
                               torch.Generator().manual_seed(seed))
    written = case.kv_cache.clone()
    block = written.shape[0] - 1
    ref.append_kv(torch.zeros(fmt.PAGE_SIZE, fmt.KV_LORA_RANK, dtype=torch.bfloat16),
                  torch.zeros(fmt.PAGE_SIZE, fmt.ROPE_DIM, dtype=torch.bfloat16), written,
                  block * fmt.PAGE_SIZE + torch.arange(fmt.PAGE_SIZE))
    assert (written[block] != 0).any()            # the floor scale: bytes differ, tokens do not
    for exact in (False, True):
        out, lse = ref.decode(*case.args(), exact=exact)
        want_out, want_lse = ref.decode(*case.replace(kv_cache=written).args(), exact=exact)
        assert torch.isfinite(out).all() and not lse.isnan().any()
        torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    out16, _ = ops.decode(*case.args())
    assert torch.isfinite(out16).all()


@SETTINGS
@given(lens=lengths, H=heads, s_q=s_qs, seed=seeds)
def test_garbage_in_unused_slots_is_ignored(lens, H, s_q, seed):
    """Unused bytes (past each length, spare table columns, free blocks) never matter."""
    case = decode_case(lens, H, s_q, seed)
    out, lse = ops.decode(*case.args())
    assert torch.isfinite(out).all() and not lse.isnan().any()
    cache = case.kv_cache.clone()
    used = torch.zeros(cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate(lens):
        for pos in range(n):
            used[int(case.block_table[b, pos // 64]), pos % 64] = True
    cache[~used] = 0xFF   # e4m3 NaN bytes, NaN scales and RoPE
    out2, lse2 = ops.decode(*case.replace(kv_cache=cache).args())
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_decode_contract_cases_from_the_report():
    """The cases first seen giving plausible wrong answers, now errors."""
    cache, bt, _ = build_cache([150, 100])
    bt = bt[:, :2].contiguous()
    q = torch.randn(2, 1, 16, 512).bfloat16()
    qp = torch.randn(2, 1, 16, 64).bfloat16()
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 192 is outside \[0, 128\]"):
        ops.decode(q, qp, cache, bt, torch.tensor([192, 100]), 0.1)
    bad = bt.clone()
    bad[0, 1] = -1
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = -1"):
        ops.decode(q, qp, cache, bad, torch.tensor([100, 100]), 0.1)
    with pytest.raises(ValueError, match="no broadcasting"):
        ops.decode(q, qp[:1], cache, bt, torch.tensor([100, 100]), 0.1)
    with pytest.raises(ValueError, match=r"q_pe must have the leading shape .*\[2, 1, 8, 64\]"):
        ops.decode(q, qp[:, :, :8], cache, bt, torch.tensor([100, 100]), 0.1)
    with pytest.raises(TypeError, match="seq_lens must be a torch.Tensor, got list"):
        ops.decode(q, qp, cache, bt, [100, 100], 0.1)
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = -1"):
        ops.decode(q, qp, cache, bt, torch.tensor([100, -1]), 0.1)


def test_contract_cases_from_the_second_review():
    """Inputs a review found accepted with a wrong result or refused with a raw error."""
    cache, bt, _ = build_cache([150, 100])
    sl = torch.tensor([150, 100], dtype=torch.int32)
    q = torch.randn(2, 1, 16, 512).bfloat16()
    qp = torch.randn(2, 1, 16, 64).bfloat16()
    kv_c, k_pe = torch.randn(2, 512), torch.randn(2, 64)
    # Caches whose rows share bytes: all tokens would land in one row, or a later block's slot
    # would overwrite an earlier block's.
    shared_rows = torch.zeros(2, 64, 656, dtype=torch.uint8)[:, :1].expand(2, 64, 656)
    spread = torch.zeros(3 * 64 * 656 * 2, dtype=torch.uint8).as_strided(
        (2, 64, 656), (64 * 656, 2 * 656, 2))
    for bad in (shared_rows, spread):
        with pytest.raises(ValueError, match="kv_cache must have its 64 rows of 656 bytes packed"):
            ops.append_kv(kv_c, k_pe, bad, torch.tensor([0, 1]))
    # Flags: a string such as "False" is truthy.
    with pytest.raises(TypeError, match="causal must be a bool, got str"):
        ops.decode(q, qp, cache, bt, sl, 0.1, causal="False")
    with pytest.raises(TypeError, match="validate must be a bool, got str"):
        ops.decode(q, qp, cache, bt, sl, 0.1, validate="no")
    with pytest.raises(TypeError, match="validate must be a bool, got int"):
        ops.quantize_kv(kv_c, k_pe, validate=1)
    # A plan written into the lengths or the table would corrupt what later calls read.
    for alias, name in ((sl[:1], "seq_lens"), (bt[0, :1], "block_table")):
        with pytest.raises(ValueError, match=f"out shares its memory with {name}"):
            ops.plan_decode(sl, bt, 16, out=alias)
    buffer = torch.zeros(4, dtype=torch.int32)   # disjoint parts of one buffer are fine
    buffer[:2] = sl
    plan_view = buffer[3:]
    assert ops.plan_decode(buffer[:2], bt, 16, out=plan_view) is plan_view
    assert buffer[:2].tolist() == sl.tolist()
    with pytest.raises(ValueError, match="softmax_scale must be positive and finite, got an int"):
        ops.decode(q, qp, cache, bt, sl, 10**400)
    with pytest.raises(ValueError, match="decode_kernel names the kernel of a CUDA device"):
        ops.decode_kernel("cpu")
    # gather_kv: a column-major or expanded dst is refused by what is wrong with it, and a cache
    # without blocks gives NaN rows, as the contract says, instead of an IndexError.
    one = torch.zeros(1, dtype=torch.int32)
    for dst in (torch.empty(576, 80).t(), torch.empty(1, 1).expand(1, 576)):
        with pytest.raises(ValueError, match="dst must have unit column stride"):
            ops.gather_kv(cache, dst, bt, torch.tensor([0, 1]), one, 1)
    dst = torch.zeros(80, 576)
    ops.gather_kv(cache[:0], dst, bt, torch.tensor([0, 80]), torch.zeros(80, dtype=torch.int32),
                  80, validate=False)
    assert dst.isnan().all()
    with pytest.raises(ValueError, match="seq_starts describe 0$"):
        ops.gather_kv(cache, dst, bt, torch.zeros(0, dtype=torch.int32),
                      torch.zeros(80, dtype=torch.int32), 80)


def test_float16_outputs_overflow_only_past_their_range():
    """BF16 rounding of ``k_pe / s`` can carry a value at float16's largest past it: a float16
    output then holds Inf (docs/format.md), a float32 one the value within BF16's precision."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        k_pe = torch.randn(2, 64, generator=g).half()
        k_pe[0, 0] = 65504
        rows = ops.quantize_kv(torch.randn(2, 512, generator=g).half(), k_pe)
        wide = float(ops.dequantize_kv(rows, torch.float32)[1][0, 0])
        narrow = ops.dequantize_kv(rows, torch.float16)[1][0, 0]
        assert abs(wide - 65504) <= 65504 * 2**-8
        assert bool(torch.isinf(narrow)) == (wide >= 65520)   # float16 rounds 65520 up to Inf


def test_plan_decode_on_the_cpu_writes_nothing_and_decode_ignores_any_plan():
    """The CPU reference and the Triton kernel read no plan: ``plan_decode`` returns ``out``
    unwritten, and a decode given any plan returns what it returns without one."""
    cache, bt, _ = build_cache([150, 100])
    sl = torch.tensor([150, 100])
    q = torch.randn(2, 1, 16, 512).bfloat16()
    qp = torch.randn(2, 1, 16, 64).bfloat16()
    plan = ops.plan_decode(sl, bt, 16)
    assert plan.dtype == torch.int32 and plan.shape == (1,) and int(plan) == 0
    out = torch.full((1,), 7, dtype=torch.int32)
    assert ops.plan_decode(sl, bt, 16, 2, out=out) is out and int(out) == 7
    plain = ops.decode(q, qp, cache, bt, sl, 0.1)
    for value in (-3, 0, 1, 1 << 30):
        planned = ops.decode(q, qp, cache, bt, sl, 0.1, plan=torch.tensor([value],
                                                                          dtype=torch.int32))
        assert torch.equal(planned[0], plain[0]) and torch.equal(planned[1], plain[1])


def test_plan_contract():
    cache, bt, _ = build_cache([150, 100])
    sl = torch.tensor([150, 100])
    q = torch.randn(2, 1, 16, 512).bfloat16()
    qp = torch.randn(2, 1, 16, 64).bfloat16()
    with pytest.raises(TypeError, match=r"plan must be int32 \(ops.plan_decode's\), got "
                                        "torch.int64"):
        ops.decode(q, qp, cache, bt, sl, 0.1, plan=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"plan must have shape \[1\]"):
        ops.decode(q, qp, cache, bt, sl, 0.1, plan=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match="plan must be a torch.Tensor"):
        ops.decode(q, qp, cache, bt, sl, 0.1, plan=3)
    with pytest.raises(TypeError, match="out must be int32"):
        ops.plan_decode(sl, bt, 16, out=torch.zeros(1))
    with pytest.raises(ValueError, match="num_heads and s_q must be at least 1"):
        ops.plan_decode(sl, bt, 0)
    with pytest.raises(TypeError, match="s_q must be an int"):
        ops.plan_decode(sl, bt, 16, 1.5)
    with pytest.raises(ValueError, match="at least batch = 2 rows"):
        ops.plan_decode(sl, bt[:1], 16)
    with pytest.raises(TypeError, match="seq_lens must be int32 or int64"):
        ops.plan_decode(sl.float(), bt, 16)


def test_quantize_and_append_contract():
    kv_c, k_pe = torch.randn(4, 512), torch.randn(4, 64)
    with pytest.raises(ValueError, match=r"kv_c must be \[\.\.\., 512\], got float32\[4, 500\]"):
        ops.quantize_kv(kv_c[:, :500], k_pe)
    with pytest.raises(ValueError, match="kv_c has 4 rows and k_pe 3"):
        ops.quantize_kv(kv_c, k_pe[:3])
    with pytest.raises(TypeError, match="kv_c must be bfloat16, float16 or float32"):
        ops.quantize_kv(kv_c.to(torch.int32), k_pe)
    with pytest.raises(ValueError, match=r"k_pe must be \[tokens, 64\].*got float32\[4, 2, 64\]"):
        ops.quantize_kv(kv_c, torch.randn(4, 2, 64))
    assert torch.equal(ops.quantize_kv(kv_c, k_pe[:, None]), ops.quantize_kv(kv_c, k_pe))
    with pytest.raises(TypeError, match="k_pe is torch.bfloat16 but kv_c is torch.float32"):
        ops.quantize_kv(kv_c, k_pe.bfloat16())
    # A non-finite row is refused when checked; unchecked it is stored so that it reads as NaN.
    bad = kv_c.clone()
    bad[2, 5] = float("inf")
    with pytest.raises(ValueError, match="kv_c row 2 holds a NaN or Inf"):
        ops.quantize_kv(bad, k_pe)
    rows = ops.quantize_kv(bad, k_pe, validate=False)
    c, r = ops.dequantize_kv(rows[2])
    assert c.isnan().any() or r.isnan().any() or not torch.isfinite(c).all()
    with pytest.raises(TypeError, match="dtype must be torch.bfloat16, float16, float32"):
        ops.dequantize_kv(rows, dtype=torch.int32)
    # FP8 would not saturate the dequantized values (NaN above 448): refused.
    with pytest.raises(TypeError, match="dtype must be torch.bfloat16"):
        ops.dequantize_kv(rows, dtype=torch.float8_e4m3fn)
    assert ops.dequantize_kv(rows[:2], dtype=torch.float64)[0].dtype == torch.float64

    cache = torch.zeros(2, 64, 656, dtype=torch.uint8)
    with pytest.raises(ValueError, match="kv_cache must be uint8"):
        ops.append_kv(kv_c, k_pe, torch.zeros(2, 16, 656, dtype=torch.uint8), torch.tensor([0]))
    with pytest.raises(TypeError, match="slot_mapping must be int32 or int64, got torch.float32"):
        ops.append_kv(kv_c, k_pe, cache, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError,
                       match=r"slot_mapping\[1\] = 128 is outside the cache's 128 slots"):
        ops.append_kv(kv_c, k_pe, cache, torch.tensor([0, 128]))
    with pytest.raises(ValueError, match="4 are needed"):
        ops.append_kv(kv_c[:1], k_pe[:1], cache, torch.tensor([0, 1, 2, 3]))
    # Unchecked, a slot past the cache is skipped (as on CUDA) and negative slots always are.
    ops.append_kv(kv_c, k_pe, cache, torch.tensor([0, 128, -1, 127]), validate=False)
    written = (cache != 0).any(-1)
    assert written.sum() == 2 and written[0, 0] and written[1, 63]


def test_empty_batches_pass_the_data_checks():
    """No tokens (and vLLM's padded case: rows, but no slots) is a valid call, checked or not."""
    cache = torch.zeros(2, 64, 656, dtype=torch.uint8)
    assert ops.quantize_kv(torch.randn(0, 512), torch.randn(0, 64)).shape == (0, 656)
    for validate in (True, False):
        ops.append_kv(torch.randn(8, 512), torch.randn(8, 64), cache,
                      torch.zeros(0, dtype=torch.int32), validate=validate)
    assert not cache.any()


def test_append_checks_only_what_it_writes():
    cache = torch.zeros(2, 64, 656, dtype=torch.uint8)
    kv_c, k_pe = torch.randn(3, 512), torch.randn(4, 64)
    kv_c[1, 7] = float("nan")                         # the row of a skipped slot: never stored
    ops.append_kv(kv_c, k_pe, cache, torch.tensor([0, -1, 5]))
    assert (cache != 0).any(-1).sum() == 2
    # Either input may carry padding rows past slot_mapping (k_pe here).
    ops.append_kv(kv_c[[0, 2]], k_pe, cache, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="3 are needed"):
        ops.append_kv(kv_c[:2], k_pe, cache, torch.tensor([0, 1, 2]))
    # Two tokens to one slot: refused when checked (on CUDA their bytes could interleave).
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] and slot_mapping\[2\] are both "
                                         "slot 5"):
        ops.append_kv(kv_c[[0, 2, 0]], k_pe, cache, torch.tensor([5, -1, 5]))
    # Blocks that overlap in memory are refused.
    with pytest.raises(ValueError, match="kv_cache blocks overlap"):
        ops.append_kv(kv_c[[0]], k_pe, cache[:1].expand(2, 64, 656), torch.tensor([0]))


def test_gather_contract():
    cache, bt, kv = build_cache([70, 10])
    dst = torch.empty(80, 576)
    cu = torch.tensor([0, 70, 80], dtype=torch.int32)
    t2s = torch.tensor([0] * 70 + [1] * 10, dtype=torch.int32)
    ops.gather_kv(cache, dst, bt, cu, t2s, 80)
    assert torch.isfinite(dst).all()
    for bad_t2s, match in ((t2s.clone().index_fill_(0, torch.tensor([75]), 2),
                            r"token_to_seq\[75\] = 2 names no request"),
                           (t2s.clone().index_fill_(0, torch.tensor([3]), -1),
                            r"token_to_seq\[3\] = -1")):
        with pytest.raises(ValueError, match=match):
            ops.gather_kv(cache, dst, bt, cu, bad_t2s, 80)
        out = ops.gather_kv(cache, torch.empty(80, 576), bt, cu, bad_t2s, 80, validate=False)
        bad_rows = out.isnan().all(-1)
        assert bad_rows.sum() == 1 and torch.equal(out[~bad_rows], dst[~bad_rows])
    bad_bt = bt.clone()
    bad_bt[0, 1] = cache.shape[0]
    with pytest.raises(ValueError, match=r"token 64 reads block_table\[0, 1\]"):
        ops.gather_kv(cache, dst, bad_bt, cu, t2s, 80)
    out = ops.gather_kv(cache, torch.empty(80, 576), bad_bt, cu, t2s, 80, validate=False)
    assert out[64:70].isnan().all() and torch.equal(out[:64], dst[:64])
    with pytest.raises(ValueError, match="num_tokens=81"):
        ops.gather_kv(cache, dst, bt, cu, t2s, 81)
    with pytest.raises(TypeError, match="cu_seq_lens must be int32 or int64"):
        ops.gather_kv(cache, dst, bt, cu.float(), t2s, 80)
    # int64 offsets past int32 (what CUDA reads), even where cu_seq_lens and seq_starts would
    # cancel in the position: an error when checked, NaN rows for that request otherwise.
    starts = torch.zeros(2, dtype=torch.int64)
    wide_cu, wide_starts = cu.long(), starts.clone()
    wide_cu[1] += 2**32
    wide_starts[1] += 2**32
    with pytest.raises(ValueError, match=r"cu_seq_lens\[1\] = 4294967366 does not fit int32"):
        ops.gather_kv(cache, dst, bt, wide_cu, t2s, 80, seq_starts=wide_starts)
    with pytest.raises(ValueError, match=r"seq_starts\[1\] = 4294967296 does not fit int32"):
        ops.gather_kv(cache, dst, bt, cu, t2s, 80, seq_starts=wide_starts)
    out = ops.gather_kv(cache, torch.empty(80, 576), bt, wide_cu, t2s, 80, seq_starts=wide_starts,
                        validate=False)
    assert out[70:].isnan().all() and torch.equal(out[:70], dst[:70])
    # A token's place in its request and the request's start are never negative: otherwise one
    # index narrowed on CUDA could be cancelled by the other.  An error when checked, NaN rows
    # (that request's) otherwise.
    late_cu = cu.clone()
    late_cu[1] = 75                                  # tokens 70-74 come before request 1 starts
    negative = torch.tensor([0, -5], dtype=torch.int32)
    for args, message, nan_rows in (
            ((late_cu, t2s, 80, None), r"token 70 of request 1 comes before its request's first "
                                       r"token \(cu_seq_lens\[1\] = 75\)", slice(70, 75)),
            ((cu, t2s, 80, negative), r"token 70 of request 1 has a negative seq_starts "
                                      r"\(cu_seq_lens\[1\] = 70, seq_starts\[1\] = -5\)",
             slice(70, 80))):
        with pytest.raises(ValueError, match=message):
            ops.gather_kv(cache, dst, bt, *args[:3], seq_starts=args[3])
        out = ops.gather_kv(cache, torch.empty(80, 576), bt, *args[:3], seq_starts=args[3],
                            validate=False)
        want = torch.zeros(80, dtype=torch.bool)
        want[nan_rows] = True
        assert torch.equal(out.isnan().all(-1), want)
    # num_tokens: an int or a one-element integer tensor (what vLLM passes), never truncated.
    assert torch.equal(ops.gather_kv(cache, torch.empty(80, 576), bt, cu, t2s,
                                     torch.tensor(80, dtype=torch.int32)), dst)
    for count in (79.9, True, torch.tensor(80.0)):
        with pytest.raises(TypeError, match="num_tokens must be an int"):
            ops.gather_kv(cache, dst, bt, cu, t2s, count)
    with pytest.raises(ValueError, match="block_table must have 1 to"):
        ops.gather_kv(cache, dst, bt[:, :0], cu, t2s, 80)
    with pytest.raises(ValueError, match="dst rows overlap"):
        ops.gather_kv(cache, torch.empty(1, 576).expand(80, 576), bt, cu, t2s, 80)


def test_quantize_q_contract():
    with pytest.raises(ValueError, match="no broadcasting"):
        ops.quantize_q(torch.randn(2, 16, 512), torch.randn(1, 16, 64))
    with pytest.raises(ValueError, match=r"q_pe must be \[\.\.\., 64\]"):
        ops.quantize_q(torch.randn(2, 16, 512), torch.randn(2, 16, 32))
    with pytest.raises(TypeError, match="q_pe must have the dtype of q_nope"):
        ops.quantize_q(torch.randn(2, 16, 512), torch.randn(2, 16, 64).bfloat16())
    q8, s, qpe = ops.quantize_q(torch.full((1, 512), float("nan")), torch.randn(1, 64))
    assert s.isnan().all()
    q8, s, qpe = ops.quantize_q(torch.randn(512), torch.randn(64))    # one row, no batch
    assert q8.shape == (512,) and s.shape == () and qpe.shape == (64,)


def test_validation_can_be_forced_and_skipped(monkeypatch):
    case = decode_case([100], 2, 1, 0)
    bad = BAD_INDICES["block id -1"][0](case, 0)
    with pytest.raises(ValueError):
        ops.decode(*bad.args())
    assert ops.decode(*bad.args(), validate=False)[0].isnan().all()
    monkeypatch.setenv("SNAPMLA_VALIDATE", "1")
    with pytest.raises(ValueError):
        ops.decode(*bad.args(), validate=None)
    # A value other than 0 or 1 ("false", "off") is an error, not a silent "on".
    monkeypatch.setenv("SNAPMLA_VALIDATE", "false")
    with pytest.raises(ValueError, match="SNAPMLA_VALIDATE='false'"):
        ops.decode(*case.args(), validate=None)


def test_inf_propagates_like_nan():
    """Inf in a query row, or in a token written to the cache unchecked, gives NaN where
    attention uses it (softmax of an infinite logit has no finite answer)."""
    case = decode_case([130, 90], 4, 1, 7)
    q = case.q_nope.clone()
    q[1, 0, 2, 11] = float("inf")
    out, lse = ops.decode(*case.replace(q_nope=q).args())
    rows = torch.zeros(2, 1, 4, dtype=torch.bool)
    rows[1, 0, 2] = True
    assert torch.equal(nan_rows_of(out, lse)[0], rows)
    kv_c, k_pe = torch.randn(1, 512), torch.randn(1, 64)
    kv_c[0, 3] = float("-inf")
    cache = case.kv_cache.clone()
    slot = int(case.block_table[0, 0]) * 64 + 5          # token 5 of request 0
    ops.append_kv(kv_c, k_pe, cache, torch.tensor([slot]), validate=False)
    out, lse = ops.decode(*case.replace(kv_cache=cache).args())
    assert out[0].isnan().all() and not out[1].isnan().any()


@SETTINGS
@given(tokens=st.integers(1, 150), blocks=st.integers(1, 6), seed=seeds,
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
def test_append_then_gather_returns_the_quantized_rows(tokens, blocks, seed, dtype):
    """The data path as vLLM uses it: tokens appended at random slots (some skipped: negative,
    or past the cache when unchecked) and gathered back as one request's context equal the
    reference's round trip, and nothing else in the cache changes."""
    gen = torch.Generator().manual_seed(seed)
    kv_c = (torch.randn(tokens, 512, generator=gen) * 3).to(dtype)
    k_pe = (torch.randn(tokens, 64, generator=gen) * 30).to(dtype)
    cache = torch.randint(0, 256, (blocks, 64, 656), dtype=torch.uint8, generator=gen)
    before = cache.clone()
    capacity = blocks * 64
    slots = torch.randperm(capacity + tokens, generator=gen)[:tokens] - tokens // 4
    ops.append_kv(kv_c, k_pe, cache, slots, validate=False)   # negative and past-end: skipped
    kept = (slots >= 0) & (slots < capacity)
    written = torch.zeros(capacity, dtype=torch.bool)
    written[slots[kept]] = True
    assert torch.equal(cache.view(capacity, 656)[~written], before.view(capacity, 656)[~written])
    if not kept.any():
        return
    if (slots >= capacity).any():
        with pytest.raises(ValueError, match="slot_mapping"):
            ops.append_kv(kv_c, k_pe, cache.clone(), slots)
    # Gather the kept tokens back, as the context of one request whose pages are all blocks.
    order = slots[kept]
    n = int(kept.sum())
    table = torch.arange(blocks, dtype=torch.int32)[None]
    dst = torch.empty(n, 576)
    # token t of the request sits at position order[t]: one request per token keeps it simple.
    cu = torch.arange(n + 1, dtype=torch.int32)
    starts = order.to(torch.int32)
    ops.gather_kv(cache, dst, table.expand(n, blocks).contiguous(), cu,
                  torch.arange(n, dtype=torch.int32), n, starts)
    c, r = ops.dequantize_kv(ops.quantize_kv(kv_c[kept], k_pe[kept]))
    assert torch.equal(dst, torch.cat([c, r], -1))


def test_a_cache_with_spaced_blocks_works_like_a_contiguous_one():
    """One layer's blocks inside a larger allocation (block stride past 64 x 656 bytes), as a
    cross-layer KV layout gives them: accepted, with the same results."""
    case = decode_case([70, 130], 4, 2, 0)
    nb = case.kv_cache.shape[0]
    spaced = torch.zeros(nb, 3, 64, 656, dtype=torch.uint8)[:, 1]
    spaced.copy_(case.kv_cache)
    assert spaced.stride(0) == 3 * 64 * 656
    for a, b in zip(ops.decode(*case.args()), ops.decode(*case.replace(kv_cache=spaced).args())):
        assert torch.equal(a, b)
    kv_c, k_pe = torch.randn(3, 512), torch.randn(3, 64)
    slots = torch.tensor([5, 70, 200])
    contiguous = case.kv_cache.clone()
    ops.append_kv(kv_c, k_pe, contiguous, slots)
    ops.append_kv(kv_c, k_pe, spaced, slots)
    assert torch.equal(spaced, contiguous)
    cu = torch.tensor([0, 70, 200], dtype=torch.int32)
    t2s = torch.tensor([0] * 70 + [1] * 130, dtype=torch.int32)
    got = [ops.gather_kv(cache, torch.empty(200, 576), case.block_table, cu, t2s, 200)
           for cache in (contiguous, spaced)]
    assert torch.equal(got[0], got[1]) and torch.isfinite(got[0]).all()


def test_decode_kernel_names_what_decode_runs(monkeypatch):
    """``decode_kernel``: the Triton kernel where the Hopper kernels cannot run (no sm_90 GPU here
    or no sm_90a code), an error for SNAPMLA_DECODE_KERNEL=sm90 there, and any other value
    refused by name."""
    from vllm_snapmla.kernels import sm90

    device = torch.device("cuda", 0)
    ops._sm90_available.cache_clear()
    monkeypatch.setattr(sm90, "available", lambda device=None: False)
    try:
        monkeypatch.delenv("SNAPMLA_DECODE_KERNEL", raising=False)
        assert ops.decode_kernel(device) == "triton"
        monkeypatch.setenv("SNAPMLA_DECODE_KERNEL", "sm90")
        with pytest.raises(RuntimeError, match="SNAPMLA_DECODE_KERNEL=sm90 needs"):
            ops.decode_kernel(device)
        monkeypatch.setattr(sm90, "available", lambda device=None: True)
        ops._sm90_available.cache_clear()
        assert ops.decode_kernel(device) == "sm90"
        monkeypatch.setenv("SNAPMLA_DECODE_KERNEL", "triton")
        assert ops.decode_kernel(device) == "triton"
        monkeypatch.setenv("SNAPMLA_DECODE_KERNEL", "hopper")
        with pytest.raises(ValueError, match="'hopper'"):
            ops.decode_kernel(device)
    finally:
        ops._sm90_available.cache_clear()
