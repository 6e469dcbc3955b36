"""The native data-path kernels (csrc/cache_kernels.cu) against ``vllm_snapmla.reference``.

Quantized bytes must be bit-identical to the reference: both divide in IEEE FP32 and round to
nearest-even into e4m3 / bf16.  The dequantizing gather must match too: both multiply in FP32 and
round once into the destination dtype.  The reference runs on the CPU copies of the inputs.
"""

import pytest
import torch

from vllm_snapmla import format as fmt
from vllm_snapmla import ops, reference
from vllm_snapmla._native import missing_reason, native

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(native() is None, reason=missing_reason())]

FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CUDA = "cuda"


def _largest(dtype):
    return 6.0e4 if dtype == torch.float16 else 1.0e30


def _tiny(dtype):
    return 1.0e-6 if dtype == torch.float16 else 1.0e-30


def token_inputs(T, dtype, seed, width_content=fmt.KV_LORA_RANK, width_rope=fmt.ROPE_DIM):
    """Random rows over many magnitudes, led by the edge cases the scale rule must survive."""
    g = torch.Generator().manual_seed(seed)
    decades = 3 if dtype == torch.float16 else 4  # float16 overflows past 65504
    mag = torch.logspace(-decades, decades, T, dtype=torch.float64)[torch.randperm(T, generator=g)]
    c = torch.randn(T, width_content, generator=g, dtype=torch.float64) * mag[:, None]
    r = torch.randn(T, width_rope, generator=g, dtype=torch.float64) * mag[:, None]
    big, tiny = _largest(dtype), _tiny(dtype)
    edge = [
        (torch.zeros(width_content), torch.zeros(width_rope)),                  # all zeros
        (torch.randn(width_content, generator=g) * tiny,
         torch.randn(width_rope, generator=g) * tiny),
        (torch.randn(width_content, generator=g).clamp(-3, 3) * big / 4,        # huge
         torch.randn(width_rope, generator=g).clamp(-3, 3) * big / 4),
        (torch.randn(width_content, generator=g) * 1e-3,                        # rope >> content:
         torch.randn(width_rope, generator=g).clamp(-3, 3) * min(big / 4, 1e6)),  # rope floor binds
        (torch.zeros(width_content), torch.randn(width_rope, generator=g)),     # rope only
        (torch.randn(width_content, generator=g), torch.zeros(width_rope)),     # content only
    ]
    # s == 1 exactly, with e4m3 and bf16 round-to-nearest-even ties and e4m3 subnormals.
    ties_c = torch.tensor([448.0, -448.0, 1.0625, -1.0625, 1.1875, 17.0, -17.0, 2.0 ** -10,
                           -(2.0 ** -10), 3 * 2.0 ** -11, 0.5 + 2.0 ** -5, -0.0, 0.0])
    ties_r = torch.tensor([1.0 + 2.0 ** -8, -(1.0 + 2.0 ** -8), 1.0 + 3 * 2.0 ** -8, 3.0, -0.0])
    edge.append((torch.cat([ties_c, torch.rand(width_content - ties_c.numel(), generator=g)]),
                 torch.cat([ties_r, torch.rand(width_rope - ties_r.numel(), generator=g)])))
    for i, (ec, er) in enumerate(edge):
        c[i], r[i] = ec.double(), er.double()
    return c.to(dtype), r.to(dtype)


def poisoned_cache(num_blocks, seed):
    """A cache full of garbage, including float32 / e4m3 / bf16 NaN and Inf bit patterns."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randint(0, 256, (num_blocks, fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN), generator=g,
                          dtype=torch.uint8)
    cache[::3, :, :] = 0xFF                                               # NaN everywhere
    cache[1::3, :, fmt.SCALE_OFFSET:fmt.PAD_OFFSET] = torch.tensor([0, 0, 0x80, 0x7F],
                                                                   dtype=torch.uint8)  # +Inf scale
    return cache


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("rope_3d", [False, True])
def test_quantize_kv_bit_exact(dtype, rope_3d):
    kv_c, k_pe = token_inputs(1203, dtype, seed=1)
    k_pe_in = k_pe[:, None, :] if rope_3d else k_pe
    got = ops.quantize_kv(kv_c.to(CUDA), k_pe_in.to(CUDA))
    want = reference.quantize_kv(kv_c, k_pe)
    assert got.shape == (1203, fmt.BYTES_PER_TOKEN) and got.dtype == torch.uint8
    assert torch.equal(got.cpu(), want)
    assert not got[:, fmt.PAD_OFFSET:fmt.ROPE_OFFSET].any()


def test_quantize_rounding_at_ties():
    """Quotients x / s within an FP32 ulp of e4m3 and bf16 rounding boundaries.

    There, a division that is off by one FP32 ulp (x * (1/s), say) flips the quantized value, so
    these rows check that the kernel's division is exactly rounded for many different scales.
    """
    g = torch.Generator().manual_seed(17)
    rows = 4096
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    e4m3 = e4m3[e4m3.isfinite() & (e4m3 >= 0)].unique()
    e4m3_ties = (e4m3[1:] + e4m3[:-1]) / 2                                 # 0 < tie < 448
    bf16 = (torch.rand(rows, fmt.ROPE_DIM, generator=g) * 400 + 1e-3).to(torch.bfloat16)
    bf16_ties = (bf16.float().view(torch.int32) | 0x8000).view(torch.float32).double()
    s = torch.logspace(-20, 20, rows, dtype=torch.float64)[torch.randperm(rows, generator=g)]
    s = (s * (1 + torch.rand(rows, generator=g, dtype=torch.float64))).float().double()
    pick = torch.randint(0, e4m3_ties.numel(), (rows, fmt.KV_LORA_RANK), generator=g)
    sign = torch.randint(0, 2, (rows, fmt.KV_LORA_RANK), generator=g) * 2 - 1.0
    kv_c = (e4m3_ties[pick] * sign * s[:, None]).float()
    kv_c[:, 0] = (448 * s).float()                      # sets amax, so the scale is ~s
    k_pe = (bf16_ties * s[:, None]).float()
    k_pe[:, ::2] *= -1
    got = ops.quantize_kv(kv_c.to(CUDA), k_pe.to(CUDA))
    assert torch.equal(got.cpu(), reference.quantize_kv(kv_c, k_pe))
    q8, q_scale, q_pe_scaled = ops.quantize_q(kv_c.to(CUDA), k_pe.to(CUDA))
    w8, w_scale, w_pe = reference.quantize_q(kv_c, k_pe)
    assert torch.equal(as_bytes(q8.cpu()), as_bytes(w8))
    assert torch.equal(q_scale.cpu(), w_scale) and torch.equal(q_pe_scaled.cpu(), w_pe)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_kv_strided_and_misaligned_inputs(dtype):
    T = 517
    c, r = token_inputs(T, dtype, seed=2)
    # vLLM's layout: kv_c and k_pe split out of one [T, 576] projection (row stride 576).
    fused = torch.cat([c, r], dim=1).to(CUDA)
    kv_c, k_pe = fused.split([fmt.KV_LORA_RANK, fmt.ROPE_DIM], dim=1)
    assert not kv_c.is_contiguous()
    assert torch.equal(ops.quantize_kv(kv_c, k_pe).cpu(), reference.quantize_kv(c, r))
    # Rows starting off a 16-byte boundary and a non-unit last stride take the copying path.
    wide = torch.zeros(T, fmt.KV_LORA_RANK + 1, dtype=dtype, device=CUDA)
    wide[:, 1:] = c.to(CUDA)
    r_t = r.t().contiguous().to(CUDA).t()
    assert torch.equal(ops.quantize_kv(wide[:, 1:], r_t).cpu(), reference.quantize_kv(c, r))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("strided_cache", [False, True])
def test_append_kv_scatter(dtype, slot_dtype, strided_cache):
    num_blocks, n, extra = 37, 1500, 29
    g = torch.Generator().manual_seed(3)
    kv_c, k_pe = token_inputs(n + extra, dtype, seed=4)   # rows past len(slot_mapping): padding
    slots = torch.randperm(num_blocks * fmt.PAGE_SIZE, generator=g)[:n]
    slots[torch.randperm(n, generator=g)[:97]] = -1
    poison = poisoned_cache(num_blocks, seed=5)
    want = poison.clone()
    reference.append_kv(kv_c, k_pe, want, slots)

    if strided_cache:  # a cache that is a view into a larger allocation (block stride 2 * 64 * 656)
        backing = torch.stack([poison, poison], dim=1).to(CUDA)
        cache = backing[:, 1]
        assert not cache.is_contiguous()
    else:
        cache = poison.to(CUDA)
    ops.append_kv(kv_c.to(CUDA), k_pe[:, None, :].to(CUDA), cache, slots.to(slot_dtype).to(CUDA))
    assert torch.equal(cache.cpu(), want)  # written slots exact, every other byte untouched
    if strided_cache:
        assert torch.equal(backing[:, 0].cpu(), poison)


def test_append_kv_all_slots_skipped():
    kv_c, k_pe = token_inputs(64, torch.bfloat16, seed=6)
    poison = poisoned_cache(3, seed=7)
    cache = poison.to(CUDA)
    ops.append_kv(kv_c.to(CUDA), k_pe.to(CUDA), cache, torch.full((64,), -1, device=CUDA))
    ops.append_kv(kv_c.to(CUDA), k_pe.to(CUDA), cache,
                  torch.empty(0, dtype=torch.long, device=CUDA))
    assert torch.equal(cache.cpu(), poison)


def filled_cache(seq_lens, num_blocks, seed):
    """A poisoned cache holding valid quantized rows for every position of every request.

    Returns (cache, block_table): each request's pages are shuffled over the whole cache.
    """
    g = torch.Generator().manual_seed(seed)
    cache = poisoned_cache(num_blocks, seed + 1)
    max_pages = max(-(-int(s) // fmt.PAGE_SIZE) for s in seq_lens)
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.full((len(seq_lens), max_pages + 2), -7, dtype=torch.int32)
    used = 0
    for b, s in enumerate(seq_lens):
        pages = -(-int(s) // fmt.PAGE_SIZE)
        block_table[b, :pages] = perm[used:used + pages].int()
        used += pages
        kv_c, k_pe = token_inputs(max(int(s), 8), torch.bfloat16, seed=seed + 10 + b)
        pos = torch.arange(int(s))
        slots = block_table[b].long()[pos // fmt.PAGE_SIZE] * fmt.PAGE_SIZE + pos % fmt.PAGE_SIZE
        reference.append_kv(kv_c, k_pe, cache, slots)
    assert used <= num_blocks
    return cache, block_table


def gather_case(seq_lens, starts):
    """cu_seq_lens / token_to_seq for gathering positions [starts[b], seq_lens[b]) of request b."""
    counts = [int(s) - int(st) for s, st in zip(seq_lens, starts)]
    cu = torch.tensor([0] + counts).cumsum(0).int()
    token_to_seq = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).int()
    return cu, token_to_seq, int(cu[-1])


@pytest.mark.parametrize("dst_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("with_starts", [False, True])
def test_gather_kv_ragged(dst_dtype, with_starts):
    g = torch.Generator().manual_seed(8)
    seq_lens = [1, 64, 65, 0, 300, 1000, 127, 129]
    starts = ([int(torch.randint(0, max(s, 1), (1,), generator=g)) if s else 0 for s in seq_lens]
              if with_starts else [0] * len(seq_lens))
    cache, block_table = filled_cache(seq_lens, num_blocks=80, seed=9)
    cu, token_to_seq, n = gather_case(seq_lens, starts)
    seq_starts = torch.tensor(starts, dtype=torch.int32) if with_starts else None

    extra = 5  # rows past num_tokens must stay untouched
    dst = torch.full((n + extra, fmt.HEAD_SIZE), float("nan"), dtype=dst_dtype)
    want = reference.gather_kv(cache, dst.clone(), block_table, cu, token_to_seq, n, seq_starts)
    got = dst.to(CUDA)
    ops.gather_kv(cache.to(CUDA), got, block_table.to(CUDA), cu.to(CUDA), token_to_seq.to(CUDA),
                  n, None if seq_starts is None else seq_starts.to(CUDA))
    got = got.cpu()
    assert torch.equal(got[:n], want[:n])
    assert got[n:].isnan().all()


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gather_kv_128k_tokens(index_dtype):
    seq_lens = [131072, 4000, 77]
    cache, block_table = filled_cache(seq_lens, num_blocks=2200, seed=11)
    starts = [0, 0, 0]
    cu, token_to_seq, n = gather_case(seq_lens, starts)
    want = reference.gather_kv(cache, torch.empty(n, fmt.HEAD_SIZE, dtype=torch.bfloat16),
                               block_table, cu, token_to_seq, n)
    got = torch.empty(n, fmt.HEAD_SIZE, dtype=torch.bfloat16, device=CUDA)
    ops.gather_kv(cache.to(CUDA), got, block_table.to(index_dtype).to(CUDA),
                  cu.to(index_dtype).to(CUDA), token_to_seq.to(index_dtype).to(CUDA), n)
    assert torch.equal(got.cpu(), want)


def test_gather_kv_roundtrips_append():
    """Our own append then our own gather: values equal reference.dequantize_kv of the rows."""
    kv_c, k_pe = token_inputs(640, torch.float32, seed=13)
    cache = poisoned_cache(12, seed=14).to(CUDA)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(15))[:10]
    block_table = perm[None, :].int()
    pos = torch.arange(640)
    slots = block_table[0].long()[pos // fmt.PAGE_SIZE] * fmt.PAGE_SIZE + pos % fmt.PAGE_SIZE
    ops.append_kv(kv_c.to(CUDA), k_pe.to(CUDA), cache, slots.to(CUDA))
    dst = torch.empty(640, fmt.HEAD_SIZE, dtype=torch.float32, device=CUDA)
    ops.gather_kv(cache, dst, block_table.to(CUDA), torch.tensor([0, 640], device=CUDA),
                  torch.zeros(640, dtype=torch.int32, device=CUDA), 640)
    c, r = reference.dequantize_kv(reference.quantize_kv(kv_c, k_pe))
    assert torch.equal(dst.cpu(), torch.cat([c, r], dim=1))


def q_views(T, H, dtype, layout, seed):
    """(q_nope, q_pe) on the GPU in the layouts vLLM produces, plus their dense CPU copies."""
    c, r = token_inputs(T * H, dtype, seed=seed)
    c, r = c.view(T, H, -1), r.view(T, H, -1)
    if layout == "bmm_transposed":  # ql_nope = bmm(...) of shape [H, T, 512], transposed back
        q_nope = c.transpose(0, 1).contiguous().to(CUDA).transpose(0, 1)
        q_pe = torch.cat([torch.zeros_like(c[..., :64]), r], -1).to(CUDA)[..., 64:]  # slice of q
    elif layout == "decode_4d":     # [B, s_q, H, D]
        c, r = c.view(T // 2, 2, H, -1), r.view(T // 2, 2, H, -1)
        q_nope, q_pe = c.to(CUDA), r.to(CUDA)
    elif layout == "rows_2d":       # [T*H, D]
        c, r = c.reshape(T * H, -1), r.reshape(T * H, -1)
        q_nope, q_pe = c.to(CUDA), r.to(CUDA)
    else:                           # misaligned rows: copied before the kernel reads them
        wide = torch.zeros(T, H, fmt.KV_LORA_RANK + 3, dtype=dtype)
        wide[..., 3:] = c
        q_nope, q_pe = wide.to(CUDA)[..., 3:], r.to(CUDA)
    return q_nope, q_pe, c, r


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("layout", ["bmm_transposed", "decode_4d", "rows_2d", "misaligned"])
def test_quantize_q_bit_exact(dtype, layout):
    q_nope, q_pe, c, r = q_views(T=86, H=16, dtype=dtype, layout=layout, seed=16)
    q8, q_scale, q_pe_scaled = ops.quantize_q(q_nope, q_pe)
    w8, w_scale, w_pe = reference.quantize_q(c, r)
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == c.shape
    assert q_scale.dtype == torch.float32 and q_scale.shape == c.shape[:-1]
    assert q_pe_scaled.dtype == torch.bfloat16 and q_pe_scaled.shape == r.shape
    assert torch.equal(as_bytes(q8.cpu()), as_bytes(w8))
    assert torch.equal(as_bytes(q_scale.cpu()), as_bytes(w_scale))
    assert torch.equal(as_bytes(q_pe_scaled.cpu()), as_bytes(w_pe))


def test_empty_inputs():
    e = torch.empty(0, fmt.KV_LORA_RANK, dtype=torch.bfloat16, device=CUDA)
    ep = torch.empty(0, fmt.ROPE_DIM, dtype=torch.bfloat16, device=CUDA)
    assert ops.quantize_kv(e, ep).shape == (0, fmt.BYTES_PER_TOKEN)
    q8, s, qpe = ops.quantize_q(e.new_empty(0, 4, fmt.KV_LORA_RANK),
                                ep.new_empty(0, 4, fmt.ROPE_DIM))
    assert q8.shape == (0, 4, 512) and s.shape == (0, 4) and qpe.shape == (0, 4, 64)


def test_quantize_q_of_one_row_without_a_batch():
    """``[512]`` and ``[64]``: the leading shape is empty, as on the CPU path."""
    q, qp = torch.randn(fmt.KV_LORA_RANK), torch.randn(fmt.ROPE_DIM)
    q8, s, qpe = ops.quantize_q(q.to(CUDA), qp.to(CUDA))
    w8, ws, wpe = reference.quantize_q(q, qp)
    assert q8.shape == (512,) and s.shape == () and qpe.shape == (64,)
    assert torch.equal(as_bytes(q8.cpu()), as_bytes(w8)) and torch.equal(s.cpu(), ws)
    assert torch.equal(as_bytes(qpe.cpu()), as_bytes(wpe))


# --- input checks of the native ops themselves (ops.py checks some of these first) -----------

def _kv(T=4, dtype=torch.bfloat16, device=CUDA):
    return (torch.randn(T, fmt.KV_LORA_RANK, device=device).to(dtype),
            torch.randn(T, fmt.ROPE_DIM, device=device).to(dtype))


def test_errors_quantize_and_append():
    C = torch.ops._snapmla_C
    kv_c, k_pe = _kv()
    out = torch.empty(4, fmt.BYTES_PER_TOKEN, dtype=torch.uint8, device=CUDA)
    with pytest.raises(TypeError, match="kv_c must be bfloat16, float16 or float32"):
        C.quantize_kv(kv_c.int(), k_pe, out)
    with pytest.raises(TypeError, match="k_pe is Float but kv_c is BFloat16"):
        C.quantize_kv(kv_c, k_pe.float(), out)
    with pytest.raises(ValueError, match=r"kv_c must be \[tokens, 512\]"):
        C.quantize_kv(kv_c[:, :511], k_pe, out)
    with pytest.raises(ValueError, match=r"k_pe must be \[tokens, 64\] or \[tokens, 1, 64\]"):
        C.quantize_kv(kv_c, k_pe.view(4, 2, 32), out)
    with pytest.raises(ValueError, match="kv_c has 4 rows but k_pe has 3"):
        C.quantize_kv(kv_c, k_pe[:3], out)
    with pytest.raises(ValueError, match=r"out must be a contiguous uint8\[4, 656\]"):
        C.quantize_kv(kv_c, k_pe, out[:, :600])
    with pytest.raises(RuntimeError, match="k_pe must be a CUDA tensor"):
        C.quantize_kv(kv_c, k_pe.cpu(), out)

    cache = torch.zeros(2, fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN, dtype=torch.uint8, device=CUDA)
    slots = torch.arange(4, device=CUDA)
    with pytest.raises(ValueError, match=r"kv_cache must be uint8\[num_blocks, 64, 656\]"):
        C.append_kv(kv_c, k_pe, cache[:, :, :600], slots)
    with pytest.raises(ValueError, match="kv_cache blocks must be contiguous"):
        C.append_kv(kv_c, k_pe, cache.transpose(0, 1).contiguous().transpose(0, 1), slots)
    with pytest.raises(ValueError, match="non-overlapping"):   # every block one memory
        C.append_kv(kv_c, k_pe, cache[:1].expand(2, fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN), slots)
    with pytest.raises(TypeError, match="slot_mapping must be int32 or int64"):
        C.append_kv(kv_c, k_pe, cache, slots.float())
    with pytest.raises(ValueError, match="slot_mapping has 5 entries but kv_c / k_pe have 4 / 4"):
        C.append_kv(kv_c, k_pe, cache, torch.arange(5, device=CUDA))
    with pytest.raises(RuntimeError, match="slot_mapping must be a CUDA tensor"):
        C.append_kv(kv_c, k_pe, cache, slots.cpu())
    with pytest.raises(ValueError, match="kv_cache must be uint8"):  # the public API checks too
        ops.append_kv(kv_c, k_pe, cache.view(torch.int8), slots)


def test_public_append_on_cuda_names_the_argument():
    """vLLM's path (CUDA, data checks off) is one op call; a bad argument still raises the
    public contract's error naming it, not only the op's, and any slot_mapping shape is read
    flattened, as on the CPU path."""
    kv_c, k_pe = _kv()
    cache = torch.zeros(2, fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN, dtype=torch.uint8, device=CUDA)
    slots = torch.tensor([3, 70, -1, 5], device=CUDA)
    with pytest.raises(TypeError, match="slot_mapping must be a torch.Tensor"):
        ops.append_kv(kv_c, k_pe, cache, [3, 70, -1, 5])
    with pytest.raises(ValueError, match="k_pe is on cpu but the other inputs are on cuda"):
        ops.append_kv(kv_c, k_pe.cpu(), cache, slots)
    with pytest.raises(TypeError, match="k_pe is torch.float32 but kv_c is torch.bfloat16"):
        ops.append_kv(kv_c, k_pe.float(), cache, slots)
    with pytest.raises(ValueError, match=r"kv_c has 3 rows and k_pe 4; 4 are needed"):
        ops.append_kv(kv_c[:3], k_pe, cache, slots)
    flat = torch.zeros_like(cache)
    ops.append_kv(kv_c, k_pe, flat, slots)
    strided = torch.stack([slots, torch.zeros_like(slots)], dim=1)[:, 0]   # stride 2
    for other_shape in (slots.view(2, 2), strided.view(1, 4)[:, :], strided):
        other = torch.zeros_like(cache)
        ops.append_kv(kv_c, k_pe, other, other_shape)
        assert torch.equal(other, flat)
    assert (flat != 0).any(-1).sum() == 3


def test_a_cache_with_spaced_blocks_is_accepted():
    """Blocks inside a larger allocation (one layer of a cross-layer layout): the C++ checks
    accept them, and append and gather match a contiguous cache."""
    kv_c = torch.randn(3, fmt.KV_LORA_RANK, dtype=torch.bfloat16, device=CUDA)
    k_pe = torch.randn(3, fmt.ROPE_DIM, dtype=torch.bfloat16, device=CUDA)
    slots = torch.tensor([5, 70, 130], device=CUDA)
    contiguous = torch.zeros(3, fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN, dtype=torch.uint8, device=CUDA)
    spaced = torch.zeros(3, 2, fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN, dtype=torch.uint8,
                         device=CUDA)[:, 1]
    for cache in (contiguous, spaced):
        torch.ops._snapmla_C.append_kv(kv_c, k_pe, cache, slots)
    assert torch.equal(spaced, contiguous)
    bt = torch.tensor([[0, 1, 2]], dtype=torch.int32, device=CUDA)
    cu = torch.tensor([0, 131], dtype=torch.int32, device=CUDA)
    t2s = torch.zeros(131, dtype=torch.int32, device=CUDA)
    got = [ops.gather_kv(cache, torch.empty(131, fmt.HEAD_SIZE, device=CUDA), bt, cu, t2s, 131)
           for cache in (contiguous, spaced)]
    assert torch.equal(got[0], got[1])


def test_errors_gather_and_quantize_q():
    C = torch.ops._snapmla_C
    cache = torch.zeros(2, fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN, dtype=torch.uint8, device=CUDA)
    bt = torch.zeros(1, 2, dtype=torch.int32, device=CUDA)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=CUDA)
    t2s = torch.zeros(8, dtype=torch.int32, device=CUDA)
    dst = torch.empty(8, fmt.HEAD_SIZE, dtype=torch.bfloat16, device=CUDA)
    with pytest.raises(TypeError, match="dst must be bfloat16, float16 or float32"):
        C.gather_kv(cache, dst.to(torch.float8_e4m3fn), bt, cu, t2s, 8, None)
    with pytest.raises(ValueError, match=r"dst must be \[tokens, 576\]"):
        C.gather_kv(cache, dst[:, :512], bt, cu, t2s, 8, None)
    misaligned = torch.empty(8, fmt.HEAD_SIZE + 1, dtype=torch.bfloat16, device=CUDA)[:, 1:]
    with pytest.raises(ValueError,
                       match="dst rows must have unit stride and start 16-byte aligned"):
        C.gather_kv(cache, misaligned, bt, cu, t2s, 8, None)
    with pytest.raises(ValueError, match="num_tokens=9 must be within dst"):
        C.gather_kv(cache, dst, bt, cu, t2s, 9, None)
    with pytest.raises(ValueError, match="dst rows must not overlap"):
        C.gather_kv(cache, dst[:1].expand(8, fmt.HEAD_SIZE), bt, cu, t2s, 8, None)
    with pytest.raises(ValueError, match="block_table must have 1 to"):
        C.gather_kv(cache, dst, bt[:, :0], cu, t2s, 8, None)
    with pytest.raises(TypeError, match="block_table must be int32 or int64"):
        C.gather_kv(cache, dst, bt.float(), cu, t2s, 8, None)
    with pytest.raises(ValueError, match="block_table must have 2 dimension"):
        C.gather_kv(cache, dst, bt[0], cu, t2s, 8, None)
    with pytest.raises(RuntimeError, match="seq_starts must be a CUDA tensor"):
        C.gather_kv(cache, dst, bt, cu, t2s, 8, torch.zeros(1, dtype=torch.int32))

    q = torch.randn(3, 2, fmt.KV_LORA_RANK, dtype=torch.bfloat16, device=CUDA)
    qpe = torch.randn(3, 2, fmt.ROPE_DIM, dtype=torch.bfloat16, device=CUDA)
    q8 = torch.empty(3, 2, fmt.KV_LORA_RANK, dtype=torch.float8_e4m3fn, device=CUDA)
    s = torch.empty(3, 2, dtype=torch.float32, device=CUDA)
    pe = torch.empty(3, 2, fmt.ROPE_DIM, dtype=torch.bfloat16, device=CUDA)
    with pytest.raises(TypeError, match="q_pe is Half but q_nope is BFloat16"):
        C.quantize_q(q, qpe.half(), q8, s, pe)
    with pytest.raises(ValueError, match="q_pe must be .* with the leading shape of q_nope"):
        C.quantize_q(q, qpe[:2], q8, s, pe)
    with pytest.raises(ValueError, match="q8 must be a contiguous Float8_e4m3fn"):
        C.quantize_q(q, qpe, q8.view(torch.uint8), s, pe)
    with pytest.raises(ValueError, match="q_scale must be a contiguous Float"):
        C.quantize_q(q, qpe, q8, s[:, :1], pe)
    with pytest.raises(ValueError, match="q_pe_scaled must be a contiguous BFloat16"):
        C.quantize_q(q, qpe, q8, s, pe.float())
