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

It writes its rows' output normalised over the split, and the split's LSE.  Stage 2
(``_combine_kernel``) merges the splits by LSE.  With one split, stage 1 writes the final result.

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

_LOG2E = math.log2(math.e)
_CHUNK = 128   # content columns per MMA chunk: 4 chunks cover the 512-wide latent
assert 4 * _CHUNK == fmt.KV_LORA_RANK
# A split's fixed cost (query load, partial write, combine) in units of one page's stream time.
_SPLIT_OVERHEAD_PAGES = 2


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
def _split_kernel(
        q8_ptr, q_scale_ptr, qpe_ptr,
        content_ptr, scale_ptr, rope_ptr,
        block_table_ptr, seq_lens_ptr,
        out_ptr, lse_ptr,
        stride_q8_b, stride_q8_s, stride_q8_h,
        stride_qs_b, stride_qs_s, stride_qs_h,
        stride_qpe_b, stride_qpe_s, stride_qpe_h,
        stride_content_blk, stride_scale_blk, stride_rope_blk,
        stride_bt_b, stride_out_b, stride_out_split, stride_lse_b, stride_lse_split,
        qk_scale_log2, num_heads, s_q, num_rows, causal, num_splits,
        PAGE: tl.constexpr, ROW_BYTES: tl.constexpr, SCALE_OFFSET: tl.constexpr,
        ROPE_OFFSET: tl.constexpr, ROPE_DIM: tl.constexpr, CHUNK: tl.constexpr,
        FP8_MAX: tl.constexpr, P_SCALE_RANGE: tl.constexpr, P_SCALE_FLOOR: tl.constexpr,
        BLOCK_H: tl.constexpr, DIRECT: tl.constexpr):
    b = tl.program_id(0)
    row_block = tl.program_id(1)
    split = tl.program_id(2)

    # This split's pages: the request's pages cut into num_splits equal page-aligned runs.
    seq_len = tl.load(seq_lens_ptr + b)
    num_pages = tl.cdiv(seq_len, PAGE)
    pages_per_split = tl.cdiv(num_pages, num_splits)
    first_page = split * pages_per_split
    end_page = tl.minimum(first_page + pages_per_split, num_pages)

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
    l = tl.zeros([BLOCK_H], tl.float32)                     # sum of exp, unscaled (= sigma_P * L)
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
        live = pos < seq_len            # slots past seq_len hold arbitrary bytes (NaN, Inf)
        k_scale = tl.load(scale_ptr + blk * stride_scale_blk + tok * (ROW_BYTES // 4)
                          + SCALE_OFFSET // 4, mask=live, other=0.0)
        k_rope = tl.load(rope_ptr + blk * stride_rope_blk + tok[:, None] * (ROW_BYTES // 2)
                         + ROPE_OFFSET // 2 + dr[None, :], mask=live[:, None], other=0.0)
        k_rows = content_ptr + blk * stride_content_blk + tok * ROW_BYTES
        # The same slots as `live`, written differently on purpose: identical K and V loads
        # would be merged into one load that Triton cannot pipeline (see the module docstring).
        k_live = tok < seq_len - page * PAGE

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

    seen_any = l > 0.0
    # out = sigma_P * O / (sigma_P * L); rows that saw nothing give 0 and LSE -inf.
    norm = tl.where(seen_any, amax_prev / (FP8_MAX * l), 0.0)
    lse = tl.where(seen_any, (m + tl.log2(l)) * 0.6931471805599453, float("-inf"))
    out_base = out_ptr + b64 * stride_out_b + split * stride_out_split
    if DIRECT:
        store_rows = row_ok
        tl.store(lse_ptr + b64 * stride_lse_b + qh * s_q + qi, lse, mask=row_ok)
    else:
        # The combine skips splits with LSE -inf, so their O need not be written.
        store_rows = row_ok & seen_any
        tl.store(lse_ptr + b64 * stride_lse_b + split * stride_lse_split + rows, lse, mask=row_ok)
    _store_chunk(out_base, rows, cols, o0, norm, store_rows, 4 * CHUNK, DIRECT)
    _store_chunk(out_base + CHUNK, rows, cols, o1, norm, store_rows, 4 * CHUNK, DIRECT)
    _store_chunk(out_base + 2 * CHUNK, rows, cols, o2, norm, store_rows, 4 * CHUNK, DIRECT)
    _store_chunk(out_base + 3 * CHUNK, rows, cols, o3, norm, store_rows, 4 * CHUNK, DIRECT)


@triton.jit
def _combine_kernel(part_ptr, part_lse_ptr, out_ptr, lse_ptr, num_heads, s_q, num_rows,
                    num_splits, BLOCK_S: tl.constexpr, D: tl.constexpr):
    """Merge one query row's split partials: weights exp(lse_s - max), skipping empty splits."""
    b = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1)
    lse_row = part_lse_ptr + b * num_splits * num_rows + r
    splits = tl.arange(0, BLOCK_S)
    lses = tl.load(lse_row + splits * num_rows, mask=splits < num_splits, other=float("-inf"))
    m = tl.max(lses, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lses - m_ref), 0)
    cols = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    part_row = part_ptr + (b * num_splits * num_rows + r) * D
    for sp in range(num_splits):
        w = tl.exp(tl.load(lse_row + sp * num_rows) - m_ref)
        # Empty splits (w == 0) never wrote their O: load none of it.
        o = tl.load(part_row + sp * num_rows * D + cols, mask=cols < tl.where(w > 0.0, D, 0),
                    other=0.0)
        acc += w * o
    seen_any = total > 0.0
    out = tl.where(seen_any, acc / total, 0.0)
    tl.store(out_ptr + (b * num_rows + r) * D + cols, out.to(tl.bfloat16))
    lse = tl.where(seen_any, m + tl.log(total), float("-inf"))
    tl.store(lse_ptr + b * num_heads * s_q + (r % num_heads) * s_q + r // num_heads, lse)


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


def num_splits_for(batch: int, num_heads: int, s_q: int, max_pages: int,
                   num_sms: int | None = None, shared_mem: int | None = None) -> int:
    """KV splits per request so that ``batch x row blocks x splits`` programs fill the GPU.

    Minimises (waves of programs) x (pages per split + a split's fixed cost), preferring fewer
    splits on ties.  Depends only on its arguments, so a fixed ``max_pages`` gives a fixed count.
    ``num_sms``/``shared_mem`` default to the current CUDA device's (an explicit ``num_sms``
    alone assumes a Hopper-sized shared memory).
    """
    if num_sms is None:
        num_sms, shared_mem = _device_limits(torch.cuda.current_device())
    cfg = _launch_config(s_q * num_heads, shared_mem or _HOPPER_SHARED_MEM)
    programs = max(batch, 1) * triton.cdiv(s_q * num_heads, cfg.block_h)
    slots = num_sms * cfg.programs_per_sm
    max_pages = max(max_pages, 1)
    best, best_cost = 1, None
    for splits in range(1, min(max_pages, 2 * slots) + 1):
        waves = triton.cdiv(programs * splits, slots)
        cost = waves * (triton.cdiv(max_pages, splits) + _SPLIT_OVERHEAD_PAGES)
        if best_cost is None or cost < best_cost:
            best, best_cost = splits, cost
    return best


def fixed_num_splits(batch: int, num_heads: int, max_model_len: int, s_q: int = 1,
                     num_sms: int | None = None, shared_mem: int | None = None) -> int:
    """A split count that stays valid for every sequence length up to ``max_model_len``.

    Splits are cut per request from its own length, so one count serves any mix of lengths;
    use this to keep the launch shape fixed under CUDA-graph capture.
    """
    return num_splits_for(batch, num_heads, s_q, triton.cdiv(max_model_len, fmt.PAGE_SIZE),
                          num_sms, shared_mem)


def snapmla_decode(q8: torch.Tensor, q_scale: torch.Tensor, q_pe_scaled: torch.Tensor,
                   kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   softmax_scale: float, causal: bool = True, num_splits: int | None = None):
    """SnapMLA decode from a quantized query (``vllm_snapmla.ops.quantize_q``).

    ``q8`` e4m3 ``[B,s_q,H,512]``, ``q_scale`` fp32 ``[B,s_q,H]``, ``q_pe_scaled`` bf16
    ``[B,s_q,H,64]``; ``kv_cache`` uint8 ``[num_blocks,64,656]``; ``block_table`` int32
    ``[B,max_blocks]``; ``seq_lens`` int32 ``[B]``.  Returns ``out`` bf16 ``[B,s_q,H,512]`` and
    ``lse`` fp32 ``[B,H,s_q]`` (natural log; -inf and zero output for rows that see no token).
    ``num_splits`` defaults to ``num_splits_for(..., max_pages=block_table.shape[1])``, which
    needs no device sync and is fixed for a fixed block-table width.
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
    num_sms, shared_mem = _device_limits(q8.device.index if q8.device.index is not None
                                         else torch.cuda.current_device()) \
        if q8.is_cuda else (1, _HOPPER_SHARED_MEM)
    cfg = _launch_config(num_rows, shared_mem)
    row_blocks = triton.cdiv(num_rows, cfg.block_h)
    if num_splits is None:
        num_splits = num_splits_for(B, H, s_q, block_table.shape[1], num_sms, shared_mem)
    num_splits = max(int(num_splits), 1)

    content = kv_cache.view(torch.float8_e4m3fn)
    scales = kv_cache.view(torch.float32)
    rope = kv_cache.view(torch.bfloat16)
    direct = num_splits == 1
    if direct:
        dst, dst_lse = out, lse
        stride_out = (num_rows * fmt.KV_LORA_RANK, 0)
        stride_lse = (H * s_q, 0)
    else:
        dst = torch.empty(B, num_splits, num_rows, fmt.KV_LORA_RANK, dtype=torch.float32,
                          device=q8.device)
        dst_lse = torch.empty(B, num_splits, num_rows, dtype=torch.float32, device=q8.device)
        stride_out = dst.stride()[:2]
        stride_lse = dst_lse.stride()[:2]

    _split_kernel[(B, row_blocks, num_splits)](
        q8, q_scale, q_pe_scaled, content, scales, rope, block_table, seq_lens, dst, dst_lse,
        *q8.stride()[:3], *q_scale.stride()[:3], *q_pe_scaled.stride()[:3],
        content.stride(0), scales.stride(0), rope.stride(0),
        block_table.stride(0), *stride_out, *stride_lse,
        float(softmax_scale) * _LOG2E, H, s_q, num_rows, int(bool(causal)), num_splits,
        PAGE=fmt.PAGE_SIZE, ROW_BYTES=fmt.BYTES_PER_TOKEN, SCALE_OFFSET=fmt.SCALE_OFFSET,
        ROPE_OFFSET=fmt.ROPE_OFFSET, ROPE_DIM=fmt.ROPE_DIM, CHUNK=_CHUNK, FP8_MAX=fmt.FP8_MAX,
        P_SCALE_RANGE=fmt.P_SCALE_RANGE, P_SCALE_FLOOR=fmt.P_SCALE_FLOOR,
        BLOCK_H=cfg.block_h, DIRECT=direct, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if not direct:
        _combine_kernel[(B, num_rows)](
            dst, dst_lse, out, lse, H, s_q, num_rows, num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), D=fmt.KV_LORA_RANK, num_warps=4)
    return out, lse
