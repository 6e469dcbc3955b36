"""SnapMLA split-KV decode over the paged ``fp8_snapmla`` cache, in Triton.

Stage 1 (``_split_kernel``): one program per (request, block of query rows, KV split).  Query rows
are the request's ``(s_q, head)`` pairs, so one KV pass serves every head and every new token.
The program walks its split's 64-token pages in increasing order; per page it

* loads, through the block table, the e4m3 content ``[64, 512]`` (four 128-column chunks), the
  fp32 scales and the pre-scaled bf16 RoPE ``[64, 64]``; slots past ``seq_len`` are masked off
  in every load, so their bytes (arbitrary, NaN/Inf) never reach a register;
* forms logits with an FP8 MMA (``q8 . k8``) plus a BF16 MMA (``qpe' . kpe'``) into one FP32
  tile, restored by ``sq * sk * softmax_scale`` (RoPE lives in the content's scale domain, eq. 6);
* runs the SnapMLA P pipeline (paper §3.2, App. D eqs. 12-13, as ``reference.decode_quantized``):
  ``P' = exp(logit - m) * sk`` (scale fusion), ``sigma_P = max(amax(P'), peak * P_SCALE_RANGE,
  P_SCALE_FLOOR) / 448``, ``P8 = e4m3(P' / sigma_P)``, ``O = gamma O + P8 . V8`` with
  ``gamma = exp(m_old - m) * sigma_old / sigma_P`` and V8 the page's content.

Splits follow ``kernels/splits.py``: a fixed grid of ``max_splits`` per (request, row block),
each request's pages cut into runs of the planner's ``pages_per_split``.  A request with one run
writes its final result; otherwise each split writes its rows' output normalised over the split
and the split's LSE, and the combine (``csrc/split_kv.cu``) merges them by LSE.

Exponentials run in base 2 (``log2(e)`` is folded into the logit scale); LSEs leave in natural log.

Two choices forced by Triton, both exact:

* ``P8 . V8`` runs as an FP16 MMA over the e4m3 values (every e4m3 value is an fp16 value, and
  the MMA accumulates in FP32).  An FP8 MMA needs V with tokens contiguous in shared memory;
  Triton builds that transpose one byte per store, which cost more than the rest of the kernel
  on an H200.  The FP16 operand needs only a vectorised convert-and-store.
* The content is loaded twice per page (for QK and for PV; the second read hits L2).  One load
  with both users could not be pipelined, as the two MMAs want different shared layouts.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vllm_snapmla import format as fmt
from vllm_snapmla.kernels import splits

_LOG2E = math.log2(math.e)
_CHUNK = 128   # content columns per MMA chunk: 4 chunks cover the 512-wide latent
assert 4 * _CHUNK == fmt.KV_LORA_RANK


@triton.jit
def _qk_chunk(q_rows, k_rows, col0, cols, row_ok, k_live, acc):
    """Add ``q8[:, chunk] . k8[:, chunk]^T`` to the logit tile (FP8 MMA)."""
    q = tl.load(q_rows[:, None] + col0 + cols[None, :], mask=row_ok[:, None], other=0.0)
    k = tl.load(k_rows[:, None] + col0 + cols[None, :], mask=k_live[:, None], other=0.0)
    # Hopper's FP8 MMA accumulates in reduced precision (about 14 bits, truncating); chained over
    # 512 terms it moved LSEs by 3e-2.  Promoting to FP32 every 64 terms keeps them within 1e-3.
    return tl.dot(q, tl.trans(k), acc, max_num_imprecise_acc=64)


@triton.jit
def _pv_chunk(o, gamma, p16, v_rows, col0, cols, live):
    """``O[:, chunk] = gamma O[:, chunk] + P8 . V8[:, chunk]``."""
    v = tl.load(v_rows[:, None] + col0 + cols[None, :], mask=live[:, None], other=0.0)
    # A fresh accumulator per page: the page's sum is promoted into the FP32 O here, every 64
    # tokens (an FP16 MMA accumulates in full FP32; an FP8 one would not, see _qk_chunk).
    return o * gamma[:, None] + tl.dot(p16, v.to(tl.float16))


@triton.jit
def _store_chunk(base, rows, cols, o, norm, mask, ROW: tl.constexpr, DIRECT: tl.constexpr):
    val = o * norm[:, None]
    if DIRECT:
        val = val.to(tl.bfloat16)
    tl.store(base + rows[:, None] * ROW + cols[None, :], val, mask=mask[:, None])


@triton.jit
def _store_rows(base, rows, cols, o0, o1, o2, o3, norm, mask, CHUNK: tl.constexpr,
                DIRECT: tl.constexpr):
    """The four 128-column chunks of the rows' output, normalised, at ``base``."""
    _store_chunk(base, rows, cols, o0, norm, mask, 4 * CHUNK, DIRECT)
    _store_chunk(base + CHUNK, rows, cols, o1, norm, mask, 4 * CHUNK, DIRECT)
    _store_chunk(base + 2 * CHUNK, rows, cols, o2, norm, mask, 4 * CHUNK, DIRECT)
    _store_chunk(base + 3 * CHUNK, rows, cols, o3, norm, mask, 4 * CHUNK, DIRECT)


@triton.jit
def _split_kernel(
        q8_ptr, q_scale_ptr, qpe_ptr,
        content_ptr, scale_ptr, rope_ptr,
        block_table_ptr, seq_lens_ptr, pages_per_split_ptr,
        out_ptr, lse_ptr, part_ptr, part_lse_ptr,
        stride_q8_b, stride_q8_s, stride_q8_h,
        stride_qs_b, stride_qs_s, stride_qs_h,
        stride_qpe_b, stride_qpe_s, stride_qpe_h,
        stride_content_blk, stride_scale_blk, stride_rope_blk,
        stride_bt_b, table_pages, num_blocks, qk_scale_log2, num_heads, s_q, num_rows, causal,
        max_splits,
        PAGE: tl.constexpr, ROW_BYTES: tl.constexpr, SCALE_OFFSET: tl.constexpr,
        ROPE_OFFSET: tl.constexpr, ROPE_DIM: tl.constexpr, CHUNK: tl.constexpr,
        FP8_MAX: tl.constexpr, P_SCALE_RANGE: tl.constexpr, P_SCALE_FLOOR: tl.constexpr,
        BLOCK_H: tl.constexpr, PLANNED: tl.constexpr):
    b = tl.program_id(0)
    row_block = tl.program_id(1)
    split = tl.program_id(2)

    # This split's pages (kernels/splits.py split_range): the request's pages cut into runs of
    # the planner's pages_per_split (an equal cut into max_splits without a planner).  A length
    # the table cannot hold reads nothing and makes the request NaN (its row sum starts NaN).
    seq_len = tl.load(seq_lens_ptr + b)
    valid = (seq_len >= 0) & (seq_len <= table_pages * PAGE)
    num_pages = tl.where(valid, tl.cdiv(tl.maximum(seq_len, 0), PAGE), 0)
    run = tl.cdiv(num_pages, max_splits)
    if PLANNED:
        run = tl.maximum(run, tl.load(pages_per_split_ptr))
    num_runs = tl.maximum(tl.cdiv(num_pages, tl.maximum(run, 1)), 1)
    first_page = split * run
    end_page = tl.minimum(first_page + run, num_pages)
    # Splits past the request's last run do nothing; split 0 always writes (zeros, LSE -inf for
    # a request with no tokens).  A request with one run writes its final result directly.
    active = (split == 0) | (first_page < num_pages)
    direct = num_runs == 1

    rows = row_block * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < num_rows
    qi = rows // num_heads
    qh = rows % num_heads
    # Query i of s_q sees positions < seq_len - s_q + i + 1 when causal.
    visible = seq_len - causal * (s_q - 1 - qi)

    cols = tl.arange(0, CHUNK)
    dr = tl.arange(0, ROPE_DIM)
    tok = tl.arange(0, PAGE)
    b64 = b.to(tl.int64)
    q8_rows = q8_ptr + b64 * stride_q8_b + qi * stride_q8_s + qh * stride_q8_h
    qpe = tl.load(qpe_ptr + b64 * stride_qpe_b + qi[:, None] * stride_qpe_s
                  + qh[:, None] * stride_qpe_h + dr[None, :], mask=row_ok[:, None], other=0.0)
    q_scale = tl.load(q_scale_ptr + b64 * stride_qs_b + qi * stride_qs_s + qh * stride_qs_h,
                      mask=row_ok, other=0.0)
    row_scale = q_scale * qk_scale_log2

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)      # running max logit (log2 units)
    peak = tl.zeros([BLOCK_H], tl.float32)                  # largest P' so far, at the current m
    amax_prev = tl.full([BLOCK_H], P_SCALE_FLOOR, tl.float32)   # 448 * sigma_P of the last page
    # sum of exp, unscaled (= sigma_P * L)
    l = tl.where(valid, tl.zeros([BLOCK_H], tl.float32), float("nan"))
    o0 = tl.zeros([BLOCK_H, CHUNK], tl.float32)            # O in the current sigma_P domain
    o1 = tl.zeros([BLOCK_H, CHUNK], tl.float32)
    o2 = tl.zeros([BLOCK_H, CHUNK], tl.float32)
    o3 = tl.zeros([BLOCK_H, CHUNK], tl.float32)

    # The block id is fetched one page ahead and carried: with the id loaded in the same iteration,
    # Triton's pipeliner single-buffers the page copies (no overlap of copy and MMA).
    bt_row = block_table_ptr + b64 * stride_bt_b
    blk_next = tl.load(bt_row + first_page, mask=first_page < end_page, other=0).to(tl.int64)
    for page in range(first_page, end_page):
        blk = blk_next
        blk_next = tl.load(bt_row + page + 1, mask=page + 1 < end_page, other=0).to(tl.int64)
        pos = page * PAGE + tok
        # A block id outside the cache is never read: its page loads as zeros and its live
        # tokens get a NaN scale, so the request's output shows it.  A zero scale is a
        # zero-filled row (vLLM's null block): a zero token, as in a BF16 cache.
        blk_ok = (blk >= 0) & (blk < num_blocks)
        in_use = pos < seq_len            # slots past seq_len hold arbitrary bytes (NaN, Inf)
        live = in_use & blk_ok
        k_scale = tl.load(scale_ptr + blk * stride_scale_blk + tok * (ROW_BYTES // 4)
                          + SCALE_OFFSET // 4, mask=live, other=0.0)
        # Every scale the format writes is positive; a negative or NaN one is NaN.
        k_scale = tl.where(in_use & (~blk_ok | ~(k_scale >= 0.0)), float("nan"), k_scale)
        k_rope = tl.load(rope_ptr + blk * stride_rope_blk + tok[:, None] * (ROW_BYTES // 2)
                         + ROPE_OFFSET // 2 + dr[None, :], mask=live[:, None], other=0.0)
        k_rows = content_ptr + blk * stride_content_blk + tok * ROW_BYTES
        # The same slots as `live`, written differently on purpose: identical K and V loads
        # would be merged into one load that Triton cannot pipeline (see the module docstring).
        k_live = (tok < seq_len - page * PAGE) & blk_ok

        s = tl.dot(qpe, tl.trans(k_rope))
        s = _qk_chunk(q8_rows, k_rows, 0, cols, row_ok, k_live, s)
        s = _qk_chunk(q8_rows, k_rows, CHUNK, cols, row_ok, k_live, s)
        s = _qk_chunk(q8_rows, k_rows, 2 * CHUNK, cols, row_ok, k_live, s)
        s = _qk_chunk(q8_rows, k_rows, 3 * CHUNK, cols, row_ok, k_live, s)

        logit = s * (row_scale[:, None] * k_scale[None, :])
        seen = (pos[None, :] < visible[:, None]) & row_ok[:, None]
        logit = tl.where(seen, logit, float("-inf"))
        m_new = tl.maximum(m, tl.max(logit, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows that have seen nothing yet
        alpha = tl.exp2(m - m_ref)
        e = tl.exp2(logit - m_ref[:, None])
        p = e * k_scale[None, :]                                # scale fusion: P' = P * sigma_V
        amax = tl.max(p, 1)
        peak = tl.maximum(peak * alpha, amax)
        amax_new = tl.maximum(tl.maximum(amax, peak * P_SCALE_RANGE), P_SCALE_FLOOR)
        inv_amax = 1.0 / amax_new                               # <= 2**126: finite
        p8 = tl.minimum((p * inv_amax[:, None]) * FP8_MAX, FP8_MAX).to(tl.float8e4nv)
        gamma = alpha * (amax_prev * inv_amax)                  # exp(m_old - m) sigma_old / sigma
        p16 = p8.to(tl.float16)                                 # exact: e4m3 is a subset of fp16
        o0 = _pv_chunk(o0, gamma, p16, k_rows, 0, cols, live)
        o1 = _pv_chunk(o1, gamma, p16, k_rows, CHUNK, cols, live)
        o2 = _pv_chunk(o2, gamma, p16, k_rows, 2 * CHUNK, cols, live)
        o3 = _pv_chunk(o3, gamma, p16, k_rows, 3 * CHUNK, cols, live)
        l = l * alpha + tl.sum(e, 1)
        m = m_new
        amax_prev = amax_new

    # out = sigma_P * O / (sigma_P * L); rows that saw nothing give 0 and LSE -inf, rows whose
    # sum is NaN (non-finite inputs, an invalid request) NaN.
    seen_any = l != 0.0
    norm = tl.where(seen_any, amax_prev / (FP8_MAX * l), 0.0)
    lse = tl.where(seen_any, (m + tl.log2(l)) * 0.6931471805599453, float("-inf"))
    if direct:
        final_rows = row_ok & active
        tl.store(lse_ptr + b64 * num_rows + qh * s_q + qi, lse, mask=final_rows)
        _store_rows(out_ptr + b64 * num_rows * (4 * CHUNK), rows, cols, o0, o1, o2, o3, norm,
                    final_rows, CHUNK, True)
    else:
        # The combine skips splits with LSE -inf, so their O need not be written.
        part_row = (b64 * max_splits + split) * num_rows
        tl.store(part_lse_ptr + part_row + rows, lse, mask=row_ok & active)
        _store_rows(part_ptr + part_row * (4 * CHUNK), rows, cols, o0, o1, o2, o3, norm,
                    row_ok & active & seen_any, CHUNK, False)


class LaunchConfig(NamedTuple):
    block_h: int            # query rows per program
    num_warps: int
    num_stages: int         # page loads in flight
    programs_per_sm: int    # resident at once (shared memory and registers allow)


# Shared memory a program may use on Hopper (sm_90: 227 KB); smaller parts get smaller tiles.
_HOPPER_SHARED_MEM = 227 * 1024


def _launch_config(num_rows: int, shared_mem: int = _HOPPER_SHARED_MEM) -> LaunchConfig:
    """Tiles for a request with ``num_rows = s_q * H`` query rows (tuned on an H200).

    64 rows is one Hopper warpgroup MMA tile; two warpgroups share the 512 output columns, so the
    FP32 O takes 128 registers a thread and one program fills an SM.  Requests with fewer rows
    take smaller tiles instead of padding the MMA, with 4 warps so that two programs share an SM
    (measured 1.3-1.4x faster than one 8-warp program with deeper prefetch).  GPUs with less
    shared memory (sm_89: 99 KB) get at most 32 rows, one program an SM.
    """
    if shared_mem < _HOPPER_SHARED_MEM:
        return LaunchConfig(16, 8, 2, 1) if num_rows <= 16 else LaunchConfig(32, 8, 2, 1)
    if num_rows <= 16:
        return LaunchConfig(16, 4, 2, 2)
    if num_rows <= 32:
        return LaunchConfig(32, 4, 2, 2)
    return LaunchConfig(64, 8, 2, 1)


@functools.cache
def _device_limits(device_index: int) -> tuple[int, int]:
    """``(multiprocessors, shared memory a program may opt into)`` of a CUDA device."""
    props = torch.cuda.get_device_properties(device_index)
    return props.multi_processor_count, props.shared_memory_per_block_optin


def _int32_lengths(seq_lens: torch.Tensor) -> torch.Tensor:
    """``seq_lens`` as the contiguous int32 the kernel, the planner and the combine read.  An
    int64 length outside int32's range saturates, so it stays invalid (NaN for its request)
    instead of wrapping onto a valid length; block ids need no narrowing (loaded as they are)."""
    if seq_lens.dtype != torch.int32:
        seq_lens = seq_lens.clamp(-2**31, 2**31 - 1).to(torch.int32)
    return seq_lens.contiguous()


def snapmla_decode(q8: torch.Tensor, q_scale: torch.Tensor, q_pe_scaled: torch.Tensor,
                   kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   softmax_scale: float, causal: bool = True, num_splits: int | None = None):
    """SnapMLA decode from a quantized query (``vllm_snapmla.ops.quantize_q``).

    ``q8`` e4m3 ``[B,s_q,H,512]``, ``q_scale`` fp32 ``[B,s_q,H]``, ``q_pe_scaled`` bf16
    ``[B,s_q,H,64]``; ``kv_cache`` uint8 ``[num_blocks,64,656]``; ``block_table`` int32 or
    int64 ``[>=B,max_blocks]`` with unit column stride; ``seq_lens`` int32 or int64 ``[>=B]``.
    Returns ``out`` bf16 ``[B,s_q,H,512]`` and ``lse`` fp32 ``[B,H,s_q]`` (natural log; -inf and
    zero output for rows that see no token).
    ``num_splits`` None lets the planner choose on the GPU from the real lengths
    (``kernels/splits.py``); an int cuts every request into that many equal runs.
    The kernel layer checks only the layout it reads; the argument contract (dtypes, devices,
    row counts, the scale's range) is ``vllm_snapmla.ops.decode``'s, which calls this.
    """
    B, s_q, H, _ = q8.shape
    num_rows = s_q * H
    out = torch.empty(B, s_q, H, fmt.KV_LORA_RANK, dtype=torch.bfloat16, device=q8.device)
    lse = torch.empty(B, H, s_q, dtype=torch.float32, device=q8.device)
    if B == 0 or num_rows == 0:
        return out, lse
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != fmt.BYTES_PER_TOKEN or \
            kv_cache.stride(0) % 16:
        raise ValueError("kv_cache must hold contiguous 656-byte rows in 16-byte aligned blocks")
    if q8.stride(-1) != 1 or q_pe_scaled.stride(-1) != 1:
        raise ValueError("q8 and q_pe_scaled must be contiguous in their last dimension")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [>=B, max_blocks], got shape "
                         f"{tuple(block_table.shape)}")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(f"block_table must have unit column stride (each row's ids "
                         f"consecutive), got strides {tuple(block_table.stride())}")
    seq_lens = _int32_lengths(seq_lens[:B])
    num_sms, shared_mem = _device_limits(q8.device.index if q8.device.index is not None
                                         else torch.cuda.current_device()) \
        if q8.is_cuda else (1, _HOPPER_SHARED_MEM)
    cfg = _launch_config(num_rows, shared_mem)
    row_blocks = triton.cdiv(num_rows, cfg.block_h)
    programs = B * row_blocks
    if num_splits is None:
        max_splits = splits.max_splits_for(B, programs, num_sms * cfg.programs_per_sm,
                                           block_table.shape[1])
        pages_per_split = (splits.plan(seq_lens, block_table.shape[1], B, programs,
                                       num_sms * cfg.programs_per_sm, max_splits)
                           if max_splits > 1 else None)
    else:
        max_splits, pages_per_split = max(int(num_splits), 1), None

    if max_splits > 1:
        part = torch.empty(B, max_splits, num_rows, fmt.KV_LORA_RANK, dtype=torch.float32,
                           device=q8.device)
        part_lse = torch.empty(B, max_splits, num_rows, dtype=torch.float32, device=q8.device)
    else:
        part, part_lse = out, lse   # never written: every request is one run
    content = kv_cache.view(torch.float8_e4m3fn)
    _split_kernel[(B, row_blocks, max_splits)](
        q8, q_scale, q_pe_scaled, content, kv_cache.view(torch.float32),
        kv_cache.view(torch.bfloat16), block_table, seq_lens,
        pages_per_split if pages_per_split is not None else seq_lens,
        out, lse, part, part_lse,
        *q8.stride()[:3], *q_scale.stride()[:3], *q_pe_scaled.stride()[:3],
        content.stride(0), kv_cache.view(torch.float32).stride(0),
        kv_cache.view(torch.bfloat16).stride(0), block_table.stride(0), block_table.shape[1],
        kv_cache.shape[0], float(softmax_scale) * _LOG2E, H, s_q, num_rows, int(bool(causal)),
        max_splits,
        PAGE=fmt.PAGE_SIZE, ROW_BYTES=fmt.BYTES_PER_TOKEN, SCALE_OFFSET=fmt.SCALE_OFFSET,
        ROPE_OFFSET=fmt.ROPE_OFFSET, ROPE_DIM=fmt.ROPE_DIM, CHUNK=_CHUNK, FP8_MAX=fmt.FP8_MAX,
        P_SCALE_RANGE=fmt.P_SCALE_RANGE, P_SCALE_FLOOR=fmt.P_SCALE_FLOOR,
        BLOCK_H=cfg.block_h, PLANNED=pages_per_split is not None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    if max_splits > 1:
        splits.combine(part, part_lse, seq_lens, pages_per_split, block_table.shape[1], out,
                       lse)
    return out, lse
