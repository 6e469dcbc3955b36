"""The contract of ``vllm_snapmla.ops`` on CUDA tensors, for both decode kernels (Hopper and
Triton): the properties ``tests/unit/test_ops.py`` checks on the CPU reference, on the kernels
vLLM runs.  Without the data checks (vLLM's path) a bad length or block id gives NaN in the
rows that read it and never reads another block; NaN inputs give NaN exactly where the
reference has it; the rest matches the CPU reference of the same algorithm."""

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

# A plain import: a missing hypothesis ([test] extra) must not skip the whole file on a GPU.
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SETTINGS = settings(max_examples=15, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])

# Long enough that the planner cuts requests into several splits (few requests, many SMs).
lengths = st.lists(st.integers(0, 3000), min_size=1, max_size=3)
heads = st.sampled_from([1, 8, 16, 64, 128])   # narrow kernel up to 32 rows, 64-row kernel above
s_qs = st.sampled_from([1, 2])
seeds = st.integers(0, 2**16)


def _cpu_reference(case):
    q8, qs, qpe = ref.quantize_q(case.q_nope, case.q_pe)
    return ref.decode_quantized(q8, qs, qpe, case.kv_cache, case.block_table, case.seq_lens,
                                case.softmax_scale)


def _assert_matches_reference(out, lse, case, nan_out_allowed=None):
    """Rows the reference has NaN are NaN here too, and only those; the rest within the
    kernels' tolerance of the CPU reference (same algorithm, float64).  Rows in
    ``nan_out_allowed`` may have a NaN output where the reference has none (their LSE is still
    checked)."""
    r_out, r_lse = _cpu_reference(case)
    nan_out, nan_lse = nan_rows_of(out, lse)
    r_nan_out, r_nan_lse = nan_rows_of(r_out, r_lse)
    if nan_out_allowed is not None:
        r_nan_out = r_nan_out | (nan_out & nan_out_allowed)
    assert torch.equal(nan_out, r_nan_out) and torch.equal(nan_lse, r_nan_lse)
    out, lse = out.cpu().double(), lse.cpu().double()
    lse_rows, r_lse_rows = lse.permute(0, 2, 1), r_lse.permute(0, 2, 1)   # [B, s_q, H]
    # The LSE of every row the reference has one for, the NaN-output rows allowed above too.
    empty_lse = torch.isneginf(r_lse_rows) & ~r_nan_lse
    assert torch.isneginf(lse_rows[empty_lse]).all(), "rows that see nothing: lse -inf"
    finite = ~r_nan_lse & ~empty_lse
    if finite.any():
        d = (lse_rows[finite] - r_lse_rows[finite]).abs().max()
        assert d <= 1e-2, float(d)
    ok = ~r_nan_out
    empty = empty_lse & ok
    assert (out[empty] == 0).all()
    seen = ok & ~empty
    if seen.any():
        err = (out[seen] - r_out[seen]).norm() / r_out[seen].norm().clamp_min(1e-300)
        assert err <= 1e-2, float(err)


@SETTINGS
@given(lens=lengths, H=heads, s_q=s_qs, seed=seeds)
def test_random_batches_match_the_reference(kernel, lens, H, s_q, seed):
    case = decode_case(lens, H, s_q, seed, spare_columns=3)
    out, lse = ops.decode(*case.to("cuda").args())
    _assert_matches_reference(out, lse, case)


def _assert_nan_where_read(bad, rows, b):
    """Without the data checks: the rows that read the bad index are NaN (output and LSE); the
    request's other rows keep the reference's LSE, and their output is the reference's or NaN
    (the Hopper kernels: P' = P sigma_V is 0 x NaN for a NaN scale the row does not attend to);
    the other requests match the reference."""
    out, lse = ops.decode(*bad.to("cuda").args())
    nan_out, nan_lse = nan_rows_of(out, lse)
    assert nan_out[rows].all() and nan_lse[rows].all()
    same_request = torch.zeros_like(rows)
    same_request[b] = True
    _assert_matches_reference(out, lse, bad, nan_out_allowed=same_request & ~rows)


@SETTINGS
@given(lens=lengths, H=heads, s_q=s_qs, seed=seeds, name=st.sampled_from(sorted(BAD_INDICES)),
       pick=st.integers(0, 2))
def test_bad_indices_give_nan_where_they_are_read(kernel, lens, H, s_q, seed, name, pick):
    change, message, nan_rows = BAD_INDICES[name]
    b = pick % len(lens)
    if "block id" in name:
        assume(lens[b] > 0)
    case = decode_case(lens, H, s_q, seed)
    bad = change(case, b)
    _assert_nan_where_read(bad, nan_rows(case, b), b)
    with pytest.raises(ValueError, match=message.format(b=b)):
        ops.decode(*bad.to("cuda").args(), validate=True)


@pytest.mark.parametrize("H", [16, 128])   # the narrow kernel and the 64-row one
@pytest.mark.parametrize("s_q", [2, 4])
def test_nan_scale_on_a_token_only_the_last_query_sees(kernel, s_q, H):
    case = decode_case([129, 65, 3000], H, s_q, 0)
    _assert_nan_where_read(nan_scale_at(case, 1, 64), rows_reading_page(case, 1, 1), 1)


@pytest.mark.parametrize("H", [16, 128])   # the narrow kernel and the 64-row one
@pytest.mark.parametrize("s_q", [2, 4])
@pytest.mark.parametrize("name", ["block id -1", "block id past the cache"])
def test_bad_block_id_on_a_page_only_the_later_queries_read(kernel, name, s_q, H):
    """Causal s_q > 1: the last page of a 64 k + 1-token request is read by its last query only."""
    case = decode_case([129, 65, 3000], H, s_q, 0)
    bad = BAD_INDICES[name][0](case, 1)
    rows = rows_reading_page(case, 1, 1)
    assert rows[1].any() and not rows[1].all()
    _assert_nan_where_read(bad, rows, 1)


@SETTINGS
@given(lens=st.lists(st.integers(2, 3000), min_size=1, max_size=3), H=heads, s_q=s_qs,
       seed=seeds, name=st.sampled_from(sorted(NON_FINITE)), pick=st.integers(0, 2))
def test_nan_inputs_give_nan_where_the_reference_does(kernel, lens, H, s_q, seed, name, pick):
    b = pick % len(lens)
    poisoned, rows = NON_FINITE[name](decode_case(lens, H, s_q, seed), b,
                                      torch.Generator().manual_seed(seed))
    out, lse = ops.decode(*poisoned.to("cuda").args())
    nan_out, nan_lse = nan_rows_of(out, lse)
    assert torch.equal(nan_out, rows) and torch.equal(nan_lse, rows), name
    _assert_matches_reference(out, lse, poisoned)


@SETTINGS
@given(lens=st.lists(st.integers(1, 3000), min_size=1, max_size=3), H=heads, s_q=s_qs,
       seed=seeds, pick=st.integers(0, 2))
def test_zero_filled_rows_read_as_zero_tokens(kernel, lens, H, s_q, seed, pick):
    """A live page on an all-zero block (vLLM's null block, scale 0): finite, as the reference."""
    b = pick % len(lens)
    case, _ = zero_filled_page(decode_case(lens, H, s_q, seed), b,
                               torch.Generator().manual_seed(seed))
    out, lse = ops.decode(*case.to("cuda").args())
    assert torch.isfinite(out).all() and not lse.isnan().any()
    _assert_matches_reference(out, lse, case)


@pytest.mark.parametrize("name", sorted(BAD_ARGUMENTS))
def test_bad_arguments_raise_errors_that_name_them(kernel, name):
    change, error, argument = BAD_ARGUMENTS[name]
    case = decode_case([100, 7], 16, 1, 0).to("cuda")
    with pytest.raises(error, match=re.escape(argument)):
        ops.decode(*change(case).args())


def test_wrong_device_is_named():
    case = decode_case([100], 16, 1, 0).to("cuda")
    with pytest.raises(ValueError, match="seq_lens is on cpu"):
        ops.decode(*case.replace(seq_lens=case.seq_lens.cpu()).args())


def test_gather_bad_indices_give_nan_rows():
    cache, bt, _ = build_cache([70, 10])
    cu = torch.tensor([0, 70, 80], dtype=torch.int32)
    t2s = torch.tensor([0] * 70 + [1] * 10, dtype=torch.int32)
    bad_bt = bt.clone()
    bad_bt[0, 1] = cache.shape[0] + 3
    bad_t2s = t2s.clone()
    bad_t2s[75] = 9
    expected = ops.gather_kv(cache, torch.empty(80, 576), bad_bt, cu, bad_t2s, 80,
                             validate=False)
    got = ops.gather_kv(cache.cuda(), torch.empty(80, 576, device="cuda"), bad_bt.cuda(),
                        cu.cuda(), bad_t2s.cuda(), 80)
    nan_rows = expected.isnan().all(-1)
    assert nan_rows.sum() == 7   # tokens 64-69 (block past the cache) and 75 (no request 9)
    assert torch.equal(got.isnan().all(-1).cpu(), nan_rows)
    torch.testing.assert_close(got.cpu()[~nan_rows], expected[~nan_rows])
    with pytest.raises(ValueError, match=r"token_to_seq\[75\] = 9"):
        ops.gather_kv(cache.cuda(), torch.empty(80, 576, device="cuda"), bt.cuda(), cu.cuda(),
                      bad_t2s.cuda(), 80, validate=True)


def test_gather_int64_indices_past_int32_give_nan_rows():
    """int64 indices 2^32 past valid ones would wrap onto them if narrowed: NaN rows instead,
    also where two of them would cancel in the position token - cu_seq_lens + seq_starts."""
    cache, bt, _ = build_cache([70, 10, 20])
    cu = torch.tensor([0, 70, 80, 100], dtype=torch.int32)
    t2s = torch.tensor([0] * 70 + [1] * 10 + [2] * 20, dtype=torch.int32)
    starts = torch.zeros(3, dtype=torch.int32)
    dst = lambda: torch.empty(100, 576, device="cuda")  # noqa: E731
    args = lambda *t: [x.cuda() for x in t]              # noqa: E731
    base = ops.gather_kv(cache.cuda(), dst(), *args(bt, cu, t2s), 100, seq_starts=starts.cuda())
    bad_bt, bad_cu, bad_t2s, bad_starts = bt.long(), cu.long(), t2s.long(), starts.long()
    bad_bt[0, 1] += 2**32            # tokens 64-69 of request 0
    bad_t2s[75] += 2**32             # token 75 names request 1 + 2^32
    bad_cu[2] += 2**32               # request 2 (tokens 80-99): cu and start both 2^32 past,
    bad_starts[2] += 2**32           # which cancel in the position if both saturate alike
    got = ops.gather_kv(cache.cuda(), dst(), *args(bad_bt, bad_cu, bad_t2s), 100,
                        seq_starts=bad_starts.cuda())
    nan_rows = torch.zeros(100, dtype=torch.bool)
    nan_rows[64:70] = nan_rows[75] = nan_rows[80:] = True
    assert torch.equal(got.isnan().all(-1).cpu(), nan_rows)
    assert not got[~nan_rows.cuda()].isnan().any()
    torch.testing.assert_close(got[~nan_rows.cuda()], base[~nan_rows.cuda()], rtol=0, atol=0)


def test_gather_index_past_int32_is_not_cancelled_by_the_other():
    """One index of the position seq_starts + (t - cu_seq_lens) past int32, the other an int32
    value that would cancel it once narrowed (INT_MAX against a start past the top, INT_MIN
    against a cumulative length past the bottom): NaN rows, as in the reference."""
    cache, bt, _ = build_cache([10, 10])
    t2s = torch.tensor([0] * 10 + [1] * 10, dtype=torch.int32)
    base_cu = torch.tensor([0, 10, 20], dtype=torch.int64)
    int_max, int_min = 2**31 - 1, -2**31
    for cu0, start0 in ((int_max, 2**40), (2**40, int_min)):
        cu, starts = base_cu.clone(), torch.zeros(2, dtype=torch.int64)
        cu[0], starts[0] = cu0, start0
        want = ops.gather_kv(cache, torch.empty(20, 576), bt, cu, t2s, 20, seq_starts=starts,
                             validate=False)
        got = ops.gather_kv(cache.cuda(), torch.empty(20, 576, device="cuda"), bt.cuda(),
                            cu.cuda(), t2s.cuda(), 20, seq_starts=starts.cuda())
        assert want[:10].isnan().all() and not want[10:].isnan().any()
        assert torch.equal(got.isnan().cpu(), want.isnan())
        torch.testing.assert_close(got[10:].cpu(), want[10:], rtol=0, atol=0)


def test_a_cache_with_spaced_blocks_decodes_like_a_contiguous_one(kernel):
    """One layer's blocks inside a larger allocation (block stride 3 x 64 x 656 bytes)."""
    case = decode_case([70, 1300, 5], 16, 2, 0).to("cuda")
    spaced = torch.zeros(case.kv_cache.shape[0], 3, *case.kv_cache.shape[1:], dtype=torch.uint8,
                         device="cuda")[:, 1]
    spaced.copy_(case.kv_cache)
    want = ops.decode(*case.args())
    got = ops.decode(*case.replace(kv_cache=spaced).args())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_one_column_table_may_have_any_stride(kernel):
    """A one-column table's column stride is never used: any stride reads like a contiguous
    table (wider tables with a column stride are refused, see BAD_ARGUMENTS)."""
    case = decode_case([40, 7], 16, 1, 0, spare_columns=0)
    on_gpu = case.to("cuda")
    assert on_gpu.block_table.shape[1] == 1
    strided = on_gpu.block_table.repeat(1, 2)[:, ::2]
    assert strided.shape == on_gpu.block_table.shape and strided.stride(1) == 2
    out, lse = ops.decode(*on_gpu.args())
    s_out, s_lse = ops.decode(*on_gpu.replace(block_table=strided).args())
    assert torch.equal(out, s_out) and torch.equal(lse, s_lse)
    _assert_matches_reference(out, lse, case)


def _poison_cached_memory(fill: int) -> None:
    """Leave the caching allocator's free blocks filled with the byte ``fill``: every size class
    a decode call allocates from (its outputs and the splits' partial results) is carved out
    of blocks whose bytes are ``fill``."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = [torch.full((size,), fill, dtype=torch.uint8, device="cuda")
            for size in [512 << k for k in range(12)] * 8 + [256 << 20]]
    torch.cuda.synchronize()
    del held


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("H, s_q", [(16, 1), (16, 2), (128, 1), (128, 2)])
def test_decode_is_bitwise_repeatable_whatever_memory_it_gets(kernel, H, s_q):
    """Two engines running the same batches must give the same tokens: no output bit may
    depend on what the memory the op allocates held before (NaN bytes, other bytes) or on the
    calls before it.  Ragged lengths in a table as wide as vLLM's (several splits, so the
    partial results and the combine are used)."""
    case = decode_case([1, 64, 700, 3001, 9000, 0], H, s_q, 7, spare_columns=2500).to("cuda")
    runs = []
    for fill in (0xFF, 0x00, 0x7F):   # NaN, zero, large finite bytes
        _poison_cached_memory(fill)
        runs.append(ops.decode(*case.args()))
        # Another batch in between (other shapes, other plan) must leave nothing behind.
        ops.decode(*decode_case([5000, 3], H, s_q, 8).to("cuda").args())
    for out, lse in runs[1:]:
        assert torch.equal(_bits(out), _bits(runs[0][0]))
        assert torch.equal(_bits(lse), _bits(runs[0][1]))
    _assert_matches_reference(*runs[0], case.to("cpu"))


def test_append_skips_slots_past_the_cache():
    cache = torch.zeros(2, fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN, dtype=torch.uint8, device="cuda")
    kv_c = torch.randn(4, 512, device="cuda")
    k_pe = torch.randn(4, 64, device="cuda")
    ops.append_kv(kv_c, k_pe, cache, torch.tensor([0, 128, -1, 127], device="cuda"))
    written = (cache != 0).any(-1)
    assert written.sum() == 2 and written[0, 0] and written[1, 63]
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 128"):
        ops.append_kv(kv_c, k_pe, cache, torch.tensor([0, 128], device="cuda"), validate=True)


def test_env_validation_skips_graph_capture_and_explicit_validation_refuses_it(monkeypatch):
    case = decode_case([300, 20], 16, 1, 1).to("cuda")
    monkeypatch.setenv("SNAPMLA_VALIDATE", "1")
    eager_out, _ = ops.decode(*case.args())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ops.decode(*case.args())                    # warm-up on the capture stream
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = ops.decode(*case.args())           # checks skipped: no host read in capture
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_out)
    # validate=True during a capture: refused before any GPU work (the capture state faked).
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="inside CUDA-graph capture"):
        ops.decode(*case.args(), validate=True)
