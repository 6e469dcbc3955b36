"""The decode kernels (Triton split-KV; sm_90a CUDA where built) against the reference, on the GPU.

Two yardsticks: ``reference.decode_quantized`` (the same SnapMLA algorithm from the same quantized
query; the kernel must match it to FP32/bf16 rounding) and ``reference.decode(exact=True)``
(float64 attention; the kernel may not be noticeably worse than the reference algorithm itself).
"""

import math

import pytest
import torch

from vllm_snapmla import format as fmt
from vllm_snapmla import ops, reference as ref
from vllm_snapmla._native import native

from vllm_snapmla.testing import build_cache

pytestmark = pytest.mark.gpu

SCALE = 0.1147   # DeepSeek-V3's 1/sqrt(192) times its YaRN mscale, roughly


def _sm90_available():
    from vllm_snapmla.kernels import sm90
    return sm90.available()


_NEEDS_SM90 = [pytest.mark.hopper, pytest.mark.skipif(
    not _sm90_available(), reason="needs an sm_90 GPU and the decode_sm90 op")]


@pytest.fixture(params=[
    "triton",
    pytest.param("sm90", marks=_NEEDS_SM90),
    pytest.param("sm90-free", marks=_NEEDS_SM90),
    pytest.param("sm90-split-roles", marks=_NEEDS_SM90),   # also at <= 16 rows (not the default)
])
def decode(request):
    """Each decode kernel, with the signature of ``triton.decode.snapmla_decode``."""
    if request.param == "sm90":
        from vllm_snapmla.kernels.sm90 import snapmla_decode_sm90
        return snapmla_decode_sm90
    if request.param.startswith("sm90-"):
        from vllm_snapmla.kernels.sm90 import schedule_variant
        return schedule_variant(request.param[len("sm90-"):])
    from vllm_snapmla.kernels.triton_decode import snapmla_decode
    return snapmla_decode


def _poison_unused(cache, block_table, seq_lens, gen):
    """Overwrite every slot no request uses with NaN/Inf patterns of each field's type."""
    nb = cache.shape[0]
    used = torch.zeros(nb * fmt.PAGE_SIZE, dtype=torch.bool)
    for b, n in enumerate(seq_lens):
        pages = block_table[b, :(n + fmt.PAGE_SIZE - 1) // fmt.PAGE_SIZE].long().cpu()
        slots = (pages[:, None] * fmt.PAGE_SIZE + torch.arange(fmt.PAGE_SIZE)).flatten()[:n]
        used[slots] = True
    poison = torch.randint(0, 256, cache.shape, dtype=torch.uint8, generator=gen)
    rows = poison.view(-1, fmt.BYTES_PER_TOKEN)
    kind = torch.arange(rows.shape[0]) % 3
    rows[kind == 0, :fmt.KV_LORA_RANK] = 0x7F                                   # e4m3 NaN
    inf32 = torch.tensor([float("inf")]).view(torch.uint8)
    nan32 = torch.tensor([float("nan")]).view(torch.uint8)
    rows[kind == 1, fmt.SCALE_OFFSET:fmt.PAD_OFFSET] = inf32
    rows[kind != 1, fmt.SCALE_OFFSET:fmt.PAD_OFFSET] = nan32
    rope = rows[:, fmt.ROPE_OFFSET:].view(-1, fmt.ROPE_DIM, 2)
    rope[kind == 0] = torch.tensor([0x80, 0x7F], dtype=torch.uint8)            # bf16 +Inf
    rope[kind == 2] = torch.tensor([0xC0, 0x7F], dtype=torch.uint8)            # bf16 NaN
    keep = used.view(nb, fmt.PAGE_SIZE, 1).to(cache.device)
    return torch.where(keep, cache, poison.to(cache.device))


def _case(seq_lens, H, s_q, seed, q_std=1.0, content_std=1.0, rope_std=3.0):
    """Poisoned paged cache on the GPU plus a random bf16 query and its quantized form."""
    gen = torch.Generator().manual_seed(seed)
    cache, bt, _ = build_cache(seq_lens, gen=gen, content_std=content_std, rope_std=rope_std)
    cache = _poison_unused(cache, bt, seq_lens, gen).cuda()
    B = len(seq_lens)
    q = (torch.randn(B, s_q, H, fmt.KV_LORA_RANK, generator=gen) * q_std).bfloat16().cuda()
    qp = (torch.randn(B, s_q, H, fmt.ROPE_DIM, generator=gen) * q_std).bfloat16().cuda()
    sl = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    return q, qp, cache, bt.cuda(), sl


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-300)).item()


def _check(out, lse, q, qp, cache, bt, sl, causal=True, check_exact=True, same_alg_tol=1e-2):
    """Compare a kernel result with both references (see the module docstring)."""
    B, s_q, H, _ = q.shape
    assert out.shape == (B, s_q, H, fmt.KV_LORA_RANK) and out.dtype == torch.bfloat16
    assert lse.shape == (B, H, s_q) and lse.dtype == torch.float32
    q8, qs, qpe = ref.quantize_q(q, qp)
    r_out, r_lse = ref.decode_quantized(q8, qs, qpe, cache, bt, sl, SCALE, causal)
    empty = torch.isneginf(r_lse)                                            # [B, H, s_q]
    assert torch.equal(torch.isneginf(lse), empty), "rows that see no token must have lse -inf"
    assert torch.isfinite(out).all() and torch.isfinite(lse[~empty]).all()
    assert (out.permute(0, 2, 1, 3)[empty] == 0).all(), "rows that see no token must be 0"
    if empty.all():
        return
    assert (lse.double() - r_lse)[~empty].abs().max().item() <= 1e-2
    for b in range(B):                       # per request, so one wrong short request shows up
        if not empty[b].all():
            assert _rel(out[b], r_out[b]) <= same_alg_tol, f"request {b} (seq_len {int(sl[b])})"
    if not check_exact:
        return
    e_out, e_lse = ref.decode(q, qp, cache, bt, sl, SCALE, causal, exact=True)
    # The reference algorithm's own error, with its output rounded to bf16 as the kernels' is
    # (where attention is sharp the algorithm's error is as small as that rounding).
    ref_err = _rel(r_out.to(out.dtype).to(r_out.device), e_out)
    assert _rel(out, e_out) <= 1.1 * ref_err + 1e-4, (_rel(out, e_out), ref_err)
    ref_lse_err = (r_lse - e_lse)[~empty].abs().max().item()
    assert (lse.double() - e_lse)[~empty].abs().max().item() <= 1.1 * ref_lse_err + 1e-3


RAGGED = [1, 63, 64, 65, 0, 700, 2113]


@pytest.mark.parametrize("H", [16, 32, 64, 128])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_ragged_batch_matches_references(H, s_q, num_splits, decode):
    q, qp, cache, bt, sl = _case(RAGGED, H, s_q, seed=H * 10 + s_q)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, True, num_splits=num_splits)
    _check(out, lse, q, qp, cache, bt, sl)


@pytest.mark.parametrize("H, s_q", [(128, 1), (16, 2)])
def test_large_batch(H, s_q, decode):
    gen = torch.Generator().manual_seed(7)
    seq_lens = torch.randint(1, 3000, (64,), generator=gen).tolist()
    seq_lens[:4] = [1, 64, 65, 4096]
    q, qp, cache, bt, sl = _case(seq_lens, H, s_q, seed=8)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE)
    _check(out, lse, q, qp, cache, bt, sl, check_exact=False)


@pytest.mark.parametrize("num_splits", [None, 1])
def test_long_context_131072(num_splits, decode):
    q, qp, cache, bt, sl = _case([131072, 5000], 128, 1, seed=9)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=num_splits)
    _check(out, lse, q, qp, cache, bt, sl)


def _dominant_token_case(H, s_q, positions, length, needle=True, seed=21):
    """One request per position, each of ``length`` tokens with one token whose logit stands
    about 10 nats above the others (its content along the queries' common direction): its value
    then makes up nearly all of the output, so reading it wrongly or not at all is an O(1)
    error, not noise within the 1e-2 bounds."""
    gen = torch.Generator().manual_seed(seed)
    d = torch.randn(fmt.KV_LORA_RANK, generator=gen)
    d /= d.norm()
    B = len(positions)
    q = (4.0 * d + 0.05 * torch.randn(B, s_q, H, fmt.KV_LORA_RANK, generator=gen)).bfloat16()
    qp = (0.3 * torch.randn(B, s_q, H, fmt.ROPE_DIM, generator=gen)).bfloat16()
    kv = []
    for pos in positions:
        c = 0.3 * torch.randn(length, fmt.KV_LORA_RANK, generator=gen)
        if needle:
            c[pos] += d * (10.0 / (SCALE * 4.0))
        kv.append((c.bfloat16(),
                   (0.3 * torch.randn(length, fmt.ROPE_DIM, generator=gen)).bfloat16()))
    cache, bt, _ = build_cache([length] * B, kv=kv, gen=gen)
    sl = torch.tensor([length] * B, dtype=torch.int32)
    cache = _poison_unused(cache, bt, [length] * B, gen)
    return q.cuda(), qp.cuda(), cache.cuda(), bt.cuda(), sl.cuda()


@pytest.mark.parametrize("H, s_q, num_splits", [(16, 1, None), (16, 2, 5), (128, 1, 5)])
def test_one_dominant_token_at_page_and_split_edges(H, s_q, num_splits, decode):
    """The dominant token at a page's first and last slot, the first slot of the second page,
    the last slot before and the first slot of a split (5 splits of 41 pages: runs of 9 pages,
    the second starting at position 576) and the request's last position (which, with s_q = 2,
    only the last query sees)."""
    length = 64 * 40 + 17
    positions = [0, 63, 64, 575, 576, length - 1]
    q, qp, cache, bt, sl = _dominant_token_case(H, s_q, positions, length)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=num_splits)
    # Against the reference algorithm only: with one token carrying the output, the algorithm's
    # own error against exact attention (2e-3) is as small as the bf16 output's rounding.
    _check(out, lse, q, qp, cache, bt, sl, check_exact=False)
    # The inputs discriminate: without the dominant token every request's output moves by O(1).
    r_out, _ = ref.decode_quantized(q8, qs, qpe, cache, bt, sl, SCALE)
    q0, qp0, cache0, bt0, sl0 = _dominant_token_case(H, s_q, positions, length, needle=False)
    r0, _ = ref.decode_quantized(*ref.quantize_q(q0, qp0), cache0, bt0, sl0, SCALE)
    assert all(_rel(r0[b], r_out[b]) > 0.5 for b in range(len(positions)))


def test_non_causal_two_token_query(decode):
    q, qp, cache, bt, sl = _case([1, 65, 300], 32, 2, seed=10)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, False, num_splits=3)
    _check(out, lse, q, qp, cache, bt, sl, causal=False)


def test_peaked_attention(decode):
    """Large logits (sharp softmax): P blocks span many orders of magnitude across pages."""
    q, qp, cache, bt, sl = _case([3000, 200], 64, 1, seed=11, q_std=8.0)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=3)
    _check(out, lse, q, qp, cache, bt, sl)


@pytest.mark.parametrize("H, s_q", [(64, 2), (16, 1), (16, 2)])   # 16 heads: the narrow kernel
@pytest.mark.parametrize("growth, pages", [(0.5, 40), (6.0, 6)])
def test_rising_maxima(growth, pages, H, s_q, decode):
    """Keys along the queries' mean direction d, scaled by a ramp over the positions so that the
    row maxima rise by about `growth` (log2 units, times |q.d| / mean |q.d|) from page to page
    where q.d > 0, and fall where q.d < 0: by 0.5 per page the running maximum moves a little on
    most pages, by 6 it jumps on every page (the rescale of O and l, and P's scale, change by
    2^6 and more between pages).  (The logits stay below about 60: far larger ones, e.g. a rise
    of 12 over 40 pages, move the LSE by more than the 1e-2 bound through the FP8 QK's
    reduced-precision accumulation alone: 7.2e-2 at an LSE of 834 in split-roles, free and the
    ping-pong experiment alike, on the H200 on 2026-12-02.)"""
    seq_lens = [64 * pages + 17, 300]
    gen = torch.Generator().manual_seed(60 + pages)
    q = torch.randn(len(seq_lens), s_q, H, fmt.KV_LORA_RANK, generator=gen).bfloat16()
    qp = torch.randn(len(seq_lens), s_q, H, fmt.ROPE_DIM, generator=gen).bfloat16()
    kv = []
    for b, n in enumerate(seq_lens):
        d = q[b].float().mean((0, 1))
        d /= d.norm()
        q_dot_d = (q[b].float() @ d).abs().mean().item()
        per_token = growth * math.log(2) / (SCALE * q_dot_d * fmt.PAGE_SIZE)
        ramp = per_token * torch.arange(n, dtype=torch.float32)
        kv_c = torch.randn(n, fmt.KV_LORA_RANK, generator=gen) * 0.3 + ramp[:, None] * d
        kv.append((kv_c.bfloat16(), torch.randn(n, fmt.ROPE_DIM, generator=gen).bfloat16()))
    cache, bt, _ = build_cache(seq_lens, kv=kv, gen=gen)
    cache = _poison_unused(cache, bt, seq_lens, gen).cuda()
    q, qp, bt = q.cuda(), qp.cuda(), bt.cuda()
    sl = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=2)
    _check(out, lse, q, qp, cache, bt, sl)


@pytest.mark.parametrize("H, s_q", [(64, 2), (16, 1), (16, 2)])   # 16 heads: the narrow kernel
def test_tiny_token_scales(H, s_q, decode):
    """Tokens of magnitude 1e-36: every token scale sits at its floor (2^-126), so every
    P' = P sigma_V is below 2^-119, where 448 / amax(P') overflows FP32 (the sm90 kernel carries
    P' scaled by 2^16 to keep its one-multiply quantization finite).  The query is 1e36 so that
    the logits still spread."""
    q, qp, cache, bt, sl = _case([700, 65, 1], H, s_q, seed=13, q_std=1e36,
                                 content_std=1e-36, rope_std=1e-36)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=2)
    # With sigma_P at its absolute floor, P8 = e4m3(448 exp(logit - m)) depends on the running
    # maximum m, so on where the pages are cut (splits restart m; the narrow kernel's two
    # consumers keep one each over alternate pages), while the reference runs uncut.  The two
    # are different FP8 roundings of the same size: measured 0.58-1.2% apart from the
    # reference (0.16-0.22% above the floor), and no farther from exact attention than the
    # reference algorithm, which the exact bound checks.
    _check(out, lse, q, qp, cache, bt, sl, same_alg_tol=2e-2)


@pytest.mark.parametrize("H, s_q", [(64, 2), (16, 1), (16, 2)])   # 16 heads: the narrow kernel
def test_huge_token_scales(H, s_q, decode):
    """Tokens of magnitude 1e37 (token scales near 2^115, the top of what a bf16 input can
    need: 3.4e38 / 448 = 2^119.2), with the query scaled down so that the logits spread."""
    q, qp, cache, bt, sl = _case([700, 65, 1], H, s_q, seed=13, q_std=1e-37, content_std=1e37,
                                 rope_std=1e37)
    q8, qs, qpe = ref.quantize_q(q, qp)
    out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=2)
    _check(out, lse, q, qp, cache, bt, sl)


def test_all_requests_empty(decode):
    q, qp, cache, bt, sl = _case([0, 0], 16, 2, seed=12)
    q8, qs, qpe = ref.quantize_q(q, qp)
    for splits in (None, 1, 4):
        out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE, num_splits=splits)
        assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("kernel", ["auto", "triton", "sm90"])
@pytest.mark.parametrize("H", [16, 128])
def test_ops_decode_from_bf16_query(kernel, H, monkeypatch):
    if native() is None:
        pytest.skip("native extension (quantize_q) not built")
    if kernel == "sm90" and not _sm90_available():
        pytest.skip("needs an sm_90 GPU and the decode_sm90 op")
    monkeypatch.setenv("SNAPMLA_DECODE_KERNEL", kernel)
    from vllm_snapmla.kernels import sm90, triton_decode
    ran = []
    for module, name in ((sm90, "decode_sm90"), (triton_decode, "snapmla_decode")):
        def spy(*args, _kernel=getattr(module, name), _name=name, **kwargs):
            ran.append(_name)
            return _kernel(*args, **kwargs)
        monkeypatch.setattr(module, name, spy)
    q, qp, cache, bt, sl = _case(RAGGED, H, 2, seed=13)
    out, lse = ops.decode(q, qp, cache, bt, sl, SCALE)
    _check(out, lse, q, qp, cache, bt, sl)
    expect = "decode_sm90" if kernel == "sm90" or (kernel == "auto" and _sm90_available()) \
        else "snapmla_decode"
    assert ran == [expect]


def test_cuda_graph_replay_with_new_lengths(decode):
    """The launch shape depends only on the shapes (the split count is planned on the GPU):
    capture once, replay with other lengths."""
    lengths_a, lengths_b = [900, 64, 1, 2000], [2047, 1, 640, 65]
    q, qp, cache, bt, sl = _case([2048] * 4, 64, 2, seed=14)
    q8, qs, qpe = ref.quantize_q(q, qp)
    sl.copy_(torch.tensor(lengths_a, dtype=torch.int32))
    decode(q8, qs, qpe, cache, bt, sl, SCALE)          # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = decode(q8, qs, qpe, cache, bt, sl, SCALE)
    for lengths in (lengths_a, lengths_b):
        sl.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, lse, q, qp, cache, bt, sl, check_exact=False)
