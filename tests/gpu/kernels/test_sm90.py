"""What only the sm_90a CUDA decode kernel (``vllm_snapmla.kernels.sm90``) needs tested.

The checks it shares with the Triton kernel (ragged batches, 131k tokens, causal and non-causal,
graph replay) run for both in ``test_decode.py``; here: the smallest cases first (with a
report of where a wrong result is wrong), block-table and cache-stride contracts, input checks,
a direct comparison with the Triton kernel, and the warpgroup schedules against each other.  Needs
an H100/H200 and a ``90a`` build.
"""

import pytest
import torch

from vllm_snapmla import format as fmt
from vllm_snapmla import reference as ref
from vllm_snapmla.kernels import sm90

from tests.gpu.kernels.test_decode import RAGGED, SCALE, _case, _check, _rel

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


@pytest.mark.parametrize("schedule", sorted(set(sm90.SCHEDULES) - {"narrow"}))
@pytest.mark.parametrize("seq_len", [64, 37, 129])
def test_few_pages_one_split(seq_len, schedule):
    """The smallest cases first: one request, 1-3 pages, one split (bf16 out written directly)."""
    q, qp, cache, bt, sl = _case([seq_len], 64, 1, seed=seq_len)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, True, num_splits=1, schedule=schedule)
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
    """Same algorithm, inputs and splits: the kernels differ only in FP32 rounding order and
    exp2, so a layout or masking bug (errors of order 1) stands out far above their differences."""
    from vllm_snapmla.kernels.triton_decode import snapmla_decode
    q, qp, cache, bt, sl = _case(RAGGED + [5000], H, s_q, seed=16 + H)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=num_splits)
    t_out, t_lse = snapmla_decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=num_splits)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(t_lse))
    seen = ~torch.isneginf(t_lse)
    assert (lse - t_lse)[seen].abs().max().item() <= 5e-3
    assert _rel(out, t_out.double()) <= 1e-2


@pytest.mark.parametrize("seq_lens, H, s_q, num_splits, q_std", [
    ([64], 64, 1, 1, 1.0),                      # one page: no V^T buffer reused
    ([128, 129, 191, 1], 128, 1, 1, 1.0),       # even and odd page counts (V^T buffer parity)
    (RAGGED, 16, 2, 3, 1.0),                    # empty splits and requests (no pages at all)
    ([3000, 200], 64, 1, 3, 8.0),               # sharp softmax: P scales jump between pages
    ([131072], 128, 1, 4, 1.0),
])
def test_schedules_are_bit_identical(seq_lens, H, s_q, num_splits, q_std):
    """split-roles moves whole sections between the warpgroups and hands each page's P8 and gamma
    (and the final row state) from WG1 to WG2, never changes an operation: output and LSE must
    equal the free schedule's bit for bit (a race or a stale hand-over or V^T buffer shows as a
    mismatch, a missed barrier arrival as a hang)."""
    schedule = "split-roles"
    q, qp, cache, bt, sl = _case(seq_lens, H, s_q, seed=19 + H, q_std=q_std)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=num_splits, schedule="free")
    for _ in range(3):   # timing-dependent bugs need more than one chance to show
        x_out, x_lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=num_splits,
                              schedule=schedule)
        if not (torch.equal(x_lse, lse) and torch.equal(x_out, out)):
            seen = ~torch.isneginf(lse)
            raise AssertionError(
                f"max |d lse| {(x_lse - lse)[seen].abs().max().item():.3e}, rel-L2 of out "
                f"{_rel(x_out, out.double()):.3e}; against the reference: "
                + _where_wrong(x_out, x_lse, q8, qs, qpe, cache, bt, sl))


def test_rejects_bad_inputs():
    q, qp, cache, bt, sl = _case([100], 16, 1, seed=17)
    q8, qs, qpe = ref.quantize_q(q, qp)
    with pytest.raises((RuntimeError, TypeError, ValueError), match="q_pe_scaled"):
        decode(q8, qs, qpe.float(), cache, bt, sl, SCALE)
    with pytest.raises((RuntimeError, TypeError, ValueError), match="kv_cache"):
        decode(q8, qs, qpe, cache[:, :32], bt, sl, SCALE)
    with pytest.raises(ValueError, match="schedule"):
        decode(q8, qs, qpe, cache, bt, sl, SCALE, schedule="fast")
    for bad in (0.0, -SCALE, float("nan")):
        with pytest.raises(ValueError, match="softmax_scale"):
            decode(q8, qs, qpe, cache, bt, sl, bad)


# The narrow kernel (at most 32 query rows: S^T = K Q^T, V^T in registers), in its 16-row form
# (up to 16 rows) and its 32-row form (17-32: 32 heads, 16 heads with MTP).

@pytest.mark.parametrize("H, s_q", [(16, 1), (8, 2), (1, 1), (5, 3), (32, 1), (16, 2), (17, 1),
                                    (6, 5)])
@pytest.mark.parametrize("seq_len", [37, 64, 129])
def test_narrow_few_pages_one_split(seq_len, H, s_q):
    q, qp, cache, bt, sl = _case([seq_len], H, s_q, seed=seq_len + H)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, True, num_splits=1, schedule="narrow")
    torch.cuda.synchronize()
    try:
        _check(out, lse, q, qp, cache, bt, sl)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{_where_wrong(out, lse, q8, qs, qpe, cache, bt, sl)}") from e


@pytest.mark.parametrize("H, s_q, num_splits, causal", [
    (16, 1, None, True), (16, 1, 1, True), (16, 1, 5, True), (8, 2, 3, True), (8, 2, 2, False),
    (4, 4, None, True), (32, 1, None, True), (32, 1, 1, False), (16, 2, 5, True),
    (8, 4, 3, True), (12, 2, None, False)])
def test_narrow_ragged_batch(H, s_q, num_splits, causal):
    """Ragged lengths (empty requests, one-token and page-edge lengths, empty splits) with NaN in
    every unused cache slot, against both references."""
    q, qp, cache, bt, sl = _case(RAGGED, H, s_q, seed=40 + H + s_q)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, causal, num_splits=num_splits,
                      schedule="narrow")
    _check(out, lse, q, qp, cache, bt, sl, causal=causal)


@pytest.mark.parametrize("H, s_q", [(16, 1), (32, 1), (16, 2)])
def test_narrow_is_the_default_up_to_its_rows_and_matches_split_roles(H, s_q):
    """Same per-row arithmetic as the 64-row kernel; only FP32 summation orders differ (and so,
    rarely, an e4m3 rounding of P), far below a layout or masking bug's error."""
    q, qp, cache, bt, sl = _case(RAGGED + [5000], H, s_q, seed=44 + H + s_q)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=3)
    n_out, n_lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=3, schedule="narrow")
    assert torch.equal(out, n_out) and torch.equal(lse, n_lse), "the default is not narrow"
    w_out, w_lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=3, schedule="split-roles")
    seen = ~torch.isneginf(w_lse)
    assert torch.equal(torch.isneginf(n_lse), ~seen)
    assert (n_lse - w_lse)[seen].abs().max().item() <= 2e-3
    assert _rel(n_out, w_out.double()) <= 5e-3


@pytest.mark.parametrize("H, s_q", [(16, 1), (32, 1), (16, 2)])
@pytest.mark.parametrize("seq_lens, num_splits, q_std", [
    ([131072, 5000], None, 1.0), ([131072], 1, 1.0), ([3000, 200], 3, 8.0)])
def test_narrow_long_and_peaked(seq_lens, num_splits, q_std, H, s_q):
    """128k tokens in one split (the per-page PV promotion over 2048 pages) and a sharp softmax
    (P scales jumping between pages)."""
    q, qp, cache, bt, sl = _case(seq_lens, H, s_q, seed=45 + H, q_std=q_std)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=num_splits, schedule="narrow")
    _check(out, lse, q, qp, cache, bt, sl)


def test_narrow_refuses_more_than_32_rows():
    q, qp, cache, bt, sl = _case([100], 16, 3, seed=46)
    q8, qs, qpe = ref.quantize_q(q, qp)
    with pytest.raises(ValueError, match="at most 32 query rows"):
        decode(q8, qs, qpe, cache, bt, sl, SCALE, schedule="narrow")


# --- splits planned on the GPU from the real lengths ----------------------------------------

def _widen(bt, columns):
    """vLLM's block table: ``max_model_len / 64`` columns, the unused ones 0 (a real block)."""
    wide = torch.zeros(bt.shape[0], columns, dtype=torch.int32, device=bt.device)
    wide[:, :bt.shape[1]] = bt
    return wide


@pytest.mark.parametrize("H, s_q", [(16, 1), (16, 2), (64, 1), (128, 1)])
def test_wide_table_equals_tight_table(H, s_q):
    """The split count comes from the requests' lengths, not the table's width: a 2560-column
    table (DeepSeek-V3.1's max_model_len) gives the tight table's result bit for bit."""
    q, qp, cache, bt, sl = _case(RAGGED, H, s_q, seed=70 + H + s_q)
    q8, qs, qpe = ref.quantize_q(q, qp)
    tight = decode(q8, qs, qpe, cache, bt, sl, SCALE)
    wide = decode(q8, qs, qpe, cache, _widen(bt, 2560), sl, SCALE)
    assert torch.equal(tight[0], wide[0]) and torch.equal(tight[1], wide[1])
    _check(*wide, q, qp, cache, bt, sl)


@pytest.mark.parametrize("H, s_q", [(16, 1), (32, 1), (128, 1), (128, 2)])
def test_fused_decode_equals_quantized_path(H, s_q):
    """``decode_sm90`` (query quantization and split planner fused in one launch, a call without
    the step's plan)
    equals quantizing first and then decoding, bit for bit, with a wide table."""
    q, qp, cache, bt, sl = _case(RAGGED + [4000], H, s_q, seed=80 + H)
    wide = _widen(bt, 2560)
    out, lse = sm90.decode_sm90(q, qp, cache, wide, sl, SCALE)
    q8, qs, qpe = ref.quantize_q(q, qp)
    x_out, x_lse = decode(q8, qs, qpe, cache, wide, sl, SCALE)
    assert torch.equal(out, x_out) and torch.equal(lse, x_lse)
    _check(out, lse, q, qp, cache, bt, sl)


def test_planner_matches_its_python_model():
    """The GPU planner's pages_per_split equals ``splits.pages_per_split_for``."""
    from vllm_snapmla.kernels import splits
    gen = torch.Generator().manual_seed(3)
    for batch, programs, slots, max_splits in [(1, 1, 132, 132), (4, 8, 132, 33), (64, 64, 132, 5),
                                               (300, 300, 132, 1), (33, 66, 132, 4),
                                               (16, 32, 132, 9), (128, 256, 132, 3)]:
        lens = torch.randint(0, 140000, (batch,), generator=gen, dtype=torch.int32)
        if batch > 1:
            lens[0] = 0                                     # an empty request among others
        lens[-1] = -lens[-1] if batch > 2 else lens[-1]   # invalid lengths count for nothing
        table_pages = 2048                                  # also some lengths past the table
        got = splits.plan(lens.cuda(), table_pages, batch, programs, slots, max_splits)
        assert int(got) == splits.pages_per_split_for(lens.tolist(), programs, slots,
                                                      max_splits, table_pages), \
            (batch, programs, max_splits)


def test_graph_replay_adapts_to_new_lengths():
    """Captured once with short requests in a wide table, the graph replays long ones (and the
    reverse) with the result of an eager call: the planner runs inside the graph."""
    lengths_a, lengths_b = [300, 64, 1, 200], [20000, 1, 6400, 65]
    q, qp, cache, bt, sl = _case([20000] * 4, 16, 1, seed=90)
    wide = _widen(bt, 2560)
    sl.copy_(torch.tensor(lengths_a, dtype=torch.int32))
    sm90.decode_sm90(q, qp, cache, wide, sl, SCALE)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = sm90.decode_sm90(q, qp, cache, wide, sl, SCALE)
    for lengths in (lengths_b, lengths_a):
        sl.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        e_out, e_lse = sm90.decode_sm90(q, qp, cache, wide, sl, SCALE)
        torch.cuda.synchronize()
        assert torch.equal(out, e_out) and torch.equal(lse, e_lse), lengths
        _check(out, lse, q, qp, cache, bt, sl, check_exact=False)


def test_rejects_bad_inputs_of_the_fused_op():
    q, qp, cache, bt, sl = _case([100], 16, 1, seed=18)
    with pytest.raises(ValueError, match="q_pe must be"):
        sm90.decode_sm90(q, qp[:, :, :8], cache, bt, sl, SCALE)
    with pytest.raises(ValueError, match="softmax_scale"):
        sm90.decode_sm90(q, qp, cache, bt, sl, float("nan"))
    with pytest.raises(ValueError, match="block_table"):
        sm90.decode_sm90(q, qp, cache, bt[:, :0], sl, SCALE)


def test_fixed_splits_refuse_more_requests_than_the_combine_grid():
    # The combine's grid holds the requests in y (at most 65535); planned splits give so many
    # requests one split each, with no combine, and run.
    batch = 65536
    q = torch.randn(batch, 1, 1, fmt.KV_LORA_RANK, dtype=torch.bfloat16, device="cuda")
    qp = torch.randn(batch, 1, 1, fmt.ROPE_DIM, dtype=torch.bfloat16, device="cuda")
    cache = torch.zeros(1, fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN, dtype=torch.uint8, device="cuda")
    bt = torch.zeros(batch, 1, dtype=torch.int32, device="cuda")
    sl = torch.zeros(batch, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="more than 65535 requests"):
        sm90.decode_sm90(q, qp, cache, bt, sl, SCALE, num_splits=2)
    out, lse = sm90.decode_sm90(q, qp, cache, bt, sl, SCALE)
    assert (out == 0).all() and torch.isneginf(lse).all()


# --- the chain of launches in one decode call, queued as vLLM queues it ---------------------

def _chained_decodes(q0, qp, cache, table, lengths, steps):
    """``steps`` fused decodes queued without a host sync, each one's query built on the GPU
    from the previous one's output and each with its own lengths: a launch that read its input
    before the launch writing it had finished would see the previous step's data."""
    outs, q = [], q0
    for sl in lengths[:steps]:
        out, lse = sm90.decode_sm90(q, qp, cache, table, sl, SCALE)
        outs.append((out, lse))
        q = _next_query(q0, out)
    return outs


def _next_query(q0, out):
    """The next step's query: ``q0`` moved by a tenth of the output.  The output is a mix of the
    cached rows, which are also the keys, so a larger share sharpens the logits step by step: with
    4x the output the log-sum-exp reached ~250 (19 at the first step) and the reference tolerance,
    set for logits of that first scale, no longer held; with 0.1x it stays under 30."""
    return q0 + 0.1 * out


@pytest.mark.parametrize("H, s_q", [(16, 1), (128, 1), (16, 2)])
def test_queued_chain_equals_calls_one_at_a_time(H, s_q):
    """Eight decodes whose queries depend on the previous output, queued back to back (eager)
    and replayed from one CUDA graph, give bit for bit what the same calls give with a host sync
    after each, and each of those matches the reference for its own query: the calls one after
    the other see their producer's finished output, and within a call a launch that read its
    input early (the query quantization's, the planner's, the decode's) would give a result
    off the reference."""
    steps = 8
    q0, qp, cache, bt, sl = _case([20000] * 4, H, s_q, seed=100 + H + s_q)
    wide = _widen(bt, 2560)
    gen = torch.Generator().manual_seed(H + s_q)
    lengths = [torch.randint(1, 20001, (4,), generator=gen, dtype=torch.int32).cuda()
               for _ in range(steps)]
    lengths[1][:] = torch.tensor([20000, 1, 64, 3000])          # one long and three short runs
    torch.cuda.synchronize()

    expected, queries, q = [], [], q0
    for sl_k in lengths:
        out, lse = sm90.decode_sm90(q, qp, cache, wide, sl_k, SCALE)
        torch.cuda.synchronize()
        expected.append((out.clone(), lse.clone()))
        queries.append(q)
        q = _next_query(q0, out)
        torch.cuda.synchronize()

    queued = _chained_decodes(q0, qp, cache, wide, lengths, steps)
    torch.cuda.synchronize()
    for k, ((out, lse), (e_out, e_lse)) in enumerate(zip(queued, expected)):
        assert torch.equal(out, e_out) and torch.equal(lse, e_lse), f"eager, step {k}"

    _chained_decodes(q0, qp, cache, wide, lengths, steps)       # warm-up before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _chained_decodes(q0, qp, cache, wide, lengths, steps)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for k, ((out, lse), (e_out, e_lse)) in enumerate(zip(captured, expected)):
            assert torch.equal(out, e_out) and torch.equal(lse, e_lse), f"graph, step {k}"
    # Last, so that a tolerance miss cannot hide the result of the exactness checks above.
    for (out, lse), q_k, sl_k in zip(expected, queries, lengths):
        _check(out, lse, q_k, qp, cache, bt, sl_k, check_exact=False)


# --- a plan made once and read by several calls (ops.plan_decode, vLLM's metadata builder) ----

def _model_plan(lens, table_pages, batch, rows):
    """The planner's pages_per_split for ``decode_sm90``'s launch shape, from the Python model,
    and the launch's max_splits."""
    from vllm_snapmla.kernels import splits
    slots = torch.cuda.get_device_properties(0).multi_processor_count
    max_splits = sm90.launch_max_splits(batch, rows, table_pages, slots)
    programs = sm90.launch_programs(batch, rows)
    return splits.pages_per_split_for(lens, programs, slots, max_splits, table_pages), max_splits


@pytest.mark.parametrize("lens, H, s_q", [([8192], 16, 1), ([131072], 128, 1),
                                          (RAGGED + [4000], 16, 2), ([2048] * 8, 128, 1),
                                          ([512] * 64, 16, 1)])
def test_a_shared_plan_is_the_calls_own(lens, H, s_q):
    """``plan_decode_sm90`` writes the plan the call would make itself (the Python model's), and a
    call given it returns bit for bit what the call planning alone returns."""
    q, qp, cache, bt, sl = _case(lens, H, s_q, seed=100 + H + len(lens))
    wide = _widen(bt, 2560)
    B = len(lens)
    plan = torch.full((1,), -99, dtype=torch.int32, device="cuda")
    sm90.plan_decode_sm90(sl, wide, B, s_q, H, plan)
    expected, max_splits = _model_plan(lens, 2560, B, s_q * H)
    assert max_splits > 1
    assert int(plan) == expected
    out, lse = sm90.decode_sm90(q, qp, cache, wide, sl, SCALE, plan=plan)
    own_out, own_lse = sm90.decode_sm90(q, qp, cache, wide, sl, SCALE)
    assert torch.equal(out, own_out) and torch.equal(lse, own_lse)
    q8, qs, qpe = ref.quantize_q(q, qp)
    x_out, x_lse = decode(q8, qs, qpe, cache, wide, sl, SCALE, plan=plan)
    assert torch.equal(x_out, own_out) and torch.equal(x_lse, own_lse)


@pytest.mark.parametrize("H, s_q", [(16, 1), (128, 1), (64, 2)])
def test_a_given_plan_decides_the_cut(H, s_q):
    """Both entries read the plan they are given: the largest int32 leaves every request one run
    (what ``num_splits=1`` gives), 0 or a negative value the equal cut into max_splits runs
    (what ``num_splits=max_splits`` gives), bit for bit."""
    lens = RAGGED + [9000]
    q, qp, cache, bt, sl = _case(lens, H, s_q, seed=113 + H)
    wide = _widen(bt, 2560)
    _, max_splits = _model_plan(lens, 2560, len(lens), s_q * H)
    q8, qs, qpe = ref.quantize_q(q, qp)
    for value, forced in ((2**31 - 1, 1), (0, max_splits), (-5, max_splits)):
        plan = torch.tensor([value], dtype=torch.int32, device="cuda")
        want_out, want_lse = sm90.decode_sm90(q, qp, cache, wide, sl, SCALE, num_splits=forced)
        out, lse = sm90.decode_sm90(q, qp, cache, wide, sl, SCALE, plan=plan)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse), value
        out, lse = decode(q8, qs, qpe, cache, wide, sl, SCALE, plan=plan)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse), value


@pytest.mark.parametrize("H, s_q", [(16, 1), (128, 1), (64, 2)])
@pytest.mark.parametrize("value", [-(2**31), -5, 0, 1, 3, 40, 1 << 30, 2**31 - 1])
def test_any_plan_gives_exact_results(value, H, s_q):
    """A plan made for other lengths (here: any int32) changes the cut, never the result, from
    the model's query and from a quantized one (the 64-row kernel and both combines included)."""
    q, qp, cache, bt, sl = _case(RAGGED + [9000], H, s_q, seed=110 + H)
    wide = _widen(bt, 2560)
    plan = torch.tensor([value], dtype=torch.int32, device="cuda")
    out, lse = sm90.decode_sm90(q, qp, cache, wide, sl, SCALE, plan=plan)
    _check(out, lse, q, qp, cache, bt, sl)
    q8, qs, qpe = ref.quantize_q(q, qp)
    x_out, x_lse = decode(q8, qs, qpe, cache, wide, sl, SCALE, plan=plan)
    assert torch.equal(x_out, out) and torch.equal(x_lse, lse)


def test_a_launch_of_one_split_reads_and_writes_no_plan():
    """300 requests at 128 heads fill the GPU with one split each: ``plan_decode_sm90`` leaves
    the buffer as it was and a decode given it returns what it returns alone; an empty batch
    with a plan returns empty outputs."""
    lens = [64 * (1 + i % 7) for i in range(300)]
    q, qp, cache, bt, sl = _case(lens, 128, 1, seed=114)
    plan = torch.tensor([12345], dtype=torch.int32, device="cuda")
    sm90.plan_decode_sm90(sl, bt, 300, 1, 128, plan)
    assert int(plan) == 12345
    out, lse = sm90.decode_sm90(q, qp, cache, bt, sl, SCALE, plan=plan)
    own_out, own_lse = sm90.decode_sm90(q, qp, cache, bt, sl, SCALE)
    assert torch.equal(out, own_out) and torch.equal(lse, own_lse)
    sm90.plan_decode_sm90(sl[:0], bt[:0], 0, 1, 128, plan)
    assert int(plan) == 12345
    out, lse = sm90.decode_sm90(q[:0], qp[:0], cache, bt, sl, SCALE, plan=plan)
    assert out.shape == (0, 1, 128, 512) and lse.shape == (0, 128, 1)


def test_a_graph_reads_the_plan_each_replay():
    """Captured with a plan buffer, the graph replays with the plan written before each replay
    (as vLLM's builder rewrites it each step) and gives the eager call's result.  Batch a's
    requests are one page at most (plan 1); batch b's 313-page request needs more than one page
    per split on any GPU below 626 CTA slots, so the two plans differ."""
    lengths_a, lengths_b = [64, 1, 30, 64], [20000, 1, 6400, 65]
    q, qp, cache, bt, sl = _case([20000] * 4, 16, 1, seed=111)
    wide = _widen(bt, 2560)
    plan = torch.zeros(1, dtype=torch.int32, device="cuda")
    sl.copy_(torch.tensor(lengths_a, dtype=torch.int32))
    sm90.plan_decode_sm90(sl, wide, 4, 1, 16, plan)
    sm90.decode_sm90(q, qp, cache, wide, sl, SCALE, plan=plan)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = sm90.decode_sm90(q, qp, cache, wide, sl, SCALE, plan=plan)
    seen = set()
    for lengths in (lengths_b, lengths_a):
        sl.copy_(torch.tensor(lengths, dtype=torch.int32))
        sm90.plan_decode_sm90(sl, wide, 4, 1, 16, plan)
        seen.add(int(plan))
        graph.replay()
        e_out, e_lse = sm90.decode_sm90(q, qp, cache, wide, sl, SCALE)
        torch.cuda.synchronize()
        assert torch.equal(out, e_out) and torch.equal(lse, e_lse), lengths
        _check(out, lse, q, qp, cache, bt, sl, check_exact=False)
    assert len(seen) == 2   # the two batches have different plans


def test_rejects_bad_plans():
    q, qp, cache, bt, sl = _case([100, 5000], 16, 1, seed=112)
    for bad in (torch.zeros(1, dtype=torch.int64, device="cuda"),
                torch.zeros(2, dtype=torch.int32, device="cuda"),
                torch.zeros(1, dtype=torch.int32)):
        with pytest.raises((ValueError, TypeError, RuntimeError), match=": plan "):
            sm90.decode_sm90(q, qp, cache, bt, sl, SCALE, plan=bad)
        with pytest.raises((ValueError, TypeError, RuntimeError), match=": plan "):
            sm90.plan_decode_sm90(sl, bt, 2, 1, 16, bad)
    plan = torch.zeros(1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="num_splits 0"):
        sm90.decode_sm90(q, qp, cache, bt, sl, SCALE, num_splits=2, plan=plan)
    with pytest.raises(ValueError, match="block_table"):
        sm90.plan_decode_sm90(sl, bt, 3, 1, 16, plan)      # more requests than table rows
    with pytest.raises(ValueError, match="s_q"):
        sm90.plan_decode_sm90(sl, bt, 2, 0, 16, plan)
