"""``decode_uniform`` on the decode batches vLLM 0.26.0 builds for dummy runs, on the GPU.

An idle data-parallel rank runs a dummy batch for every step another rank runs
(``Worker.execute_dummy_batch``; ``tests/e2e/test_dummy_batch.py`` runs it in an engine), and so
do CUDA-graph warm-up and capture.  Under FULL graphs (and always on the V2 runner) the batch
reaches our decode with this metadata (paths relative to vLLM's package):

* V1 runner (``v1/worker/gpu_model_runner.py``, ``_dummy_run``): one request of ``s_q = 1 +
  num_speculative_tokens`` query tokens with ``seq_len = s_q`` (:5972); rows padded to the graph
  size with ``seq_len`` 0 (:5974) and query length 0 (every padded row a decode,
  ``v1/attention/backends/utils.py:616``, so ``T = num_reqs * s_q``); the block table as the
  persistent batch left it (:6001; padded rows are not reset to the null block because the
  padded count goes in as ``num_reqs``, :6007 and :2317): rows of requests that finished
  (not yet removed), or zeros, i.e. block 0, when the rows were cleared
  (``v1/worker/block_table.py:136``) or never used;
* V2 runner: every request, padded ones included, ``seq_len = query_len``
  (``v1/worker/gpu/input_batch.py:123``), over the last real step's gathered block-table rows,
  zeros where that step had fewer requests (``v1/worker/gpu/block_table.py:166``).

Block 0 is vLLM's null block: allocated with ``torch.zeros`` (``gpu_model_runner.py:7264``) and
never written.  A zero-filled row has per-token scale 0.0, which the format never writes
(scales are floored at 2^-126); the decode reads it as a zero token (logit 0, value 0), as a
BF16 cache holds there (``checked_scale`` in ``csrc/sm90/pipeline.cuh``).  vLLM discards
dummy outputs, but under expert parallelism they share the MoE all-gather with real tokens, so
they must stay finite.  What these tests require of both decode kernels:

* rows with ``seq_len`` 0 are exactly 0 with LSE -inf, whatever block ids their rows hold (real
  pages of finished requests here: they are not read);
* every other row is finite and equals the CPU reference, the rows that read the null block
  included (attention over zero tokens: exactly zero output, LSE ln(visible tokens) + 0);
* a FULL CUDA graph captured for a real batch and replayed with a dummy batch in between gives
  the real batch bit-identical outputs before and after (no state carried over).
"""

from __future__ import annotations

import pytest
import torch

from vllm_snapmla import format as fmt
from vllm_snapmla import ops
from vllm_snapmla import reference as ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCALE = 0.1147
WIDTH = 16                       # block-table columns (vLLM's is max_model_len / 64)
NUM_BLOCKS = 40
# Requests that ran before the dummy: their pages are written, their rows may still be in the
# persistent block table.
EARLIER = [130, 70, 200, 5, 64, 300]


def _decode_uniform():
    pytest.importorskip("vllm", reason="decode_uniform lives in the vLLM backend module")
    from vllm_snapmla.integration.backend import decode_uniform

    return decode_uniform


def _vllm_cache(gen):
    """A cache as vLLM allocates it (zeros), with ``EARLIER``'s tokens appended on pages 1..;
    block 0 (the null block) stays zero.  Returns the cache and each earlier request's row."""
    cache = torch.zeros(NUM_BLOCKS, fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN, dtype=torch.uint8)
    ids = torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1
    rows = torch.zeros(len(EARLIER), WIDTH, dtype=torch.int32)
    start = 0
    for r, n in enumerate(EARLIER):
        pages = -(-n // fmt.PAGE_SIZE)
        rows[r, :pages] = ids[start:start + pages].int()
        start += pages
        slots = (rows[r, :pages].long()[:, None] * fmt.PAGE_SIZE
                 + torch.arange(fmt.PAGE_SIZE)).flatten()[:n]
        ref.append_kv(torch.randn(n, fmt.KV_LORA_RANK, generator=gen).bfloat16(),
                      (3 * torch.randn(n, fmt.ROPE_DIM, generator=gen)).bfloat16(), cache, slots)
    return cache, rows


def _queries(T, H, gen):
    """Token-major queries as forward_impl hands them over (q_nope a transposed bmm output)."""
    q_nope = torch.randn(H, T, fmt.KV_LORA_RANK, generator=gen).bfloat16().cuda().transpose(0, 1)
    q_pe = torch.randn(T, H, fmt.ROPE_DIM, generator=gen).bfloat16().cuda()
    return q_nope, q_pe


def _dummy_metadata(layout, s_q, earlier_rows):
    """(block_table, seq_lens) of a 4-row dummy batch, as the docstring describes."""
    B = 4
    table = torch.zeros(B, WIDTH, dtype=torch.int32)
    if layout == "v1-idle":                 # no request left: cleared rows, padded rows stale
        table[1:] = earlier_rows[1:B]
        seq_lens = [s_q] + [0] * (B - 1)
    elif layout == "v1-stale":              # finished requests still in the persistent batch
        table[:] = earlier_rows[:B]
        seq_lens = [s_q] + [0] * (B - 1)
    else:                                   # "mrv2": the last real step had 2 requests
        table[:2] = earlier_rows[2:4]
        seq_lens = [s_q] * B
    return table, torch.tensor(seq_lens, dtype=torch.int32)


def _reference(q_nope, q_pe, cache, table, seq_lens, s_q):
    """The CPU reference in decode_uniform's token-major layout: out [T,H,512], lse [T,H]."""
    T, H = q_pe.shape[:2]
    B = T // s_q
    out, lse = ref.decode(q_nope.cpu().reshape(B, s_q, H, -1), q_pe.cpu().reshape(B, s_q, H, -1),
                          cache, table, seq_lens, SCALE)
    return out.reshape(T, H, -1), lse.permute(0, 2, 1).reshape(T, H)


def _check_against_reference(out, lse, want_out, want_lse, seq_lens, s_q):
    out, lse = out.cpu().double(), lse.cpu().double()
    assert torch.isfinite(want_out).all() and not want_lse.isnan().any()
    assert torch.isfinite(out).all() and not lse.isnan().any()
    for b, n in enumerate(seq_lens.tolist()):
        rows = slice(b * s_q, (b + 1) * s_q)
        if n == 0:                           # padding: not read, zeros
            assert (out[rows] == 0).all() and torch.isneginf(lse[rows]).all(), b
        else:
            # The floor keeps a null-block request's all-zero reference from dividing by 0.
            err = (out[rows] - want_out[rows]).norm() / want_out[rows].norm().clamp_min(1e-30)
            assert err <= 1e-2, (b, float(err))
            assert (lse[rows] - want_lse[rows]).abs().max() <= 1e-2, b


@pytest.mark.parametrize("layout", ["v1-idle", "v1-stale", "mrv2"])
@pytest.mark.parametrize("H", [8, 16, 128])
@pytest.mark.parametrize("s_q", [1, 2, 4])
def test_dummy_batch_matches_the_reference(kernel, layout, H, s_q):
    gen = torch.Generator().manual_seed(H * 10 + s_q)
    cache, earlier_rows = _vllm_cache(gen)
    table, seq_lens = _dummy_metadata(layout, s_q, earlier_rows)
    q_nope, q_pe = _queries(len(seq_lens) * s_q, H, gen)
    out, lse = _decode_uniform()(q_nope, q_pe, cache.cuda().view(torch.float8_e4m3fn),
                                 table.cuda(), seq_lens.cuda(), len(seq_lens), SCALE,
                                 return_lse=True)
    assert out.shape == (len(seq_lens) * s_q, H, fmt.KV_LORA_RANK) and lse.shape == out.shape[:2]
    want_out, want_lse = _reference(q_nope, q_pe, cache, table, seq_lens, s_q)
    _check_against_reference(out, lse, want_out, want_lse, seq_lens, s_q)
    # A request over block 0 (zero bytes: scale 0) attends to zero tokens: output 0, LSE
    # ln(number of tokens its row sees), as with a BF16 cache.
    out3 = out.cpu().view(len(seq_lens), s_q, H, fmt.KV_LORA_RANK)
    lse3 = lse.cpu().double().view(len(seq_lens), s_q, H)
    null_reads = 0
    for b, n in enumerate(seq_lens.tolist()):
        if n > 0 and int(table[b, 0]) == 0:
            null_reads += 1
            assert (out3[b] == 0).all(), (b, layout)
            seen = torch.arange(n - s_q + 1, n + 1, dtype=torch.float64).log()   # causal
            assert torch.allclose(lse3[b], seen[:, None].expand(s_q, H), atol=1e-3), (b, layout)
    # v1-stale's rows all hold finished requests' pages; the other layouts read block 0.
    assert (null_reads > 0) == (layout != "v1-stale"), (null_reads, layout)


@pytest.mark.parametrize("step_plan", [False, True], ids=["own-plan", "step-plan"])
@pytest.mark.parametrize("s_q", [1, 2])
def test_full_graph_replays_a_dummy_between_real_batches(kernel, s_q, step_plan):
    """One captured decode (8 rows, 16 heads): a real batch, an idle rank's dummy, the real batch
    again; with ``step_plan`` the decode reads a plan buffer rewritten before each replay, as the
    metadata builder rewrites it each step."""
    if step_plan and kernel != "sm90":
        pytest.skip("only the Hopper kernels read a plan")
    H, B = 16, 8
    gen = torch.Generator().manual_seed(20 + s_q)
    cache, earlier_rows = _vllm_cache(gen)
    cache = cache.cuda().view(torch.float8_e4m3fn)
    real_table = torch.zeros(B, WIDTH, dtype=torch.int32)
    real_table[:len(EARLIER)] = earlier_rows
    real_lens = torch.tensor(EARLIER + [0, 0], dtype=torch.int32)        # 6 requests, 2 padded
    dummy_table = torch.zeros(B, WIDTH, dtype=torch.int32)
    dummy_lens = torch.zeros(B, dtype=torch.int32)
    dummy_table[1:len(EARLIER)] = earlier_rows[1:]                       # stale padded rows
    dummy_lens[0] = s_q                                                  # reads the null block
    real_q = _queries(B * s_q, H, gen)
    dummy_q = _queries(B * s_q, H, gen)

    # The graph's persistent inputs, as vLLM keeps them.
    q_nope_buf = torch.empty(H, B * s_q, fmt.KV_LORA_RANK, dtype=torch.bfloat16,
                             device="cuda").transpose(0, 1)
    q_pe_buf = torch.empty(B * s_q, H, fmt.ROPE_DIM, dtype=torch.bfloat16, device="cuda")
    table = torch.empty(B, WIDTH, dtype=torch.int32, device="cuda")
    lens = torch.empty(B, dtype=torch.int32, device="cuda")
    plan = torch.zeros(1, dtype=torch.int32, device="cuda") if step_plan else None

    def load(q, t, n):
        q_nope_buf.copy_(q[0])
        q_pe_buf.copy_(q[1])
        table.copy_(t)
        lens.copy_(n)
        if plan is not None:
            ops.plan_decode(lens, table, H, s_q, out=plan)

    decode_uniform = _decode_uniform()
    load(real_q, real_table, real_lens)
    eager_out, eager_lse = decode_uniform(q_nope_buf, q_pe_buf, cache, table, lens, B, SCALE,
                                          return_lse=True, plan=plan)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = decode_uniform(q_nope_buf, q_pe_buf, cache, table, lens, B, SCALE,
                                  return_lse=True, plan=plan)
    results = []
    for q, t, n in [(real_q, real_table, real_lens), (dummy_q, dummy_table, dummy_lens),
                    (real_q, real_table, real_lens)]:
        load(q, t, n)
        graph.replay()
        torch.cuda.synchronize()
        results.append((out.clone(), lse.clone()))
    (real_out, real_lse), (dummy_out, dummy_lse), (again_out, again_lse) = results
    assert torch.equal(real_out, again_out) and torch.equal(real_lse, again_lse)
    assert torch.equal(real_out, eager_out) and torch.equal(real_lse, eager_lse)
    want_out, want_lse = _reference(real_q[0], real_q[1], cache.view(torch.uint8).cpu(),
                                    real_table, real_lens, s_q)
    _check_against_reference(real_out, real_lse, want_out, want_lse, real_lens, s_q)
    want_out, want_lse = _reference(dummy_q[0], dummy_q[1], cache.view(torch.uint8).cpu(),
                                    dummy_table, dummy_lens, s_q)
    _check_against_reference(dummy_out, dummy_lse, want_out, want_lse, dummy_lens, s_q)
    assert (dummy_out == 0).all()   # zero tokens (null block) and padding rows
