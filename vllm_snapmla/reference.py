"""Exact PyTorch reference of every SnapMLA operation (device-agnostic: CPU or CUDA tensors).

This is the specification the kernels are tested against.  Quantization steps are done exactly
as a kernel must do them (FP32 division, round-to-nearest-even casts to e4m3 and bf16); every
other step runs in float64, so the reference isolates the error of the quantization itself.
``decode(..., exact=True)`` is plain float64 attention over the dequantized cache with the
unquantized query: the yardstick for "how much does FP8 cost".
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_snapmla import format as fmt

_E4M3 = torch.float8_e4m3fn


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    # Clamp first: values a hair above 448 after FP32 division must saturate, not become NaN.
    return x.float().clamp(-fmt.FP8_MAX, fmt.FP8_MAX).to(_E4M3)


def _quantize_rows(content: torch.Tensor, rope: torch.Tensor):
    """Shared row quantizer for K (per token) and Q (per token and head)."""
    c = content.float()
    r = rope.float()
    s = fmt.scale_from_amax(c.abs().amax(-1), r.abs().amax(-1))
    return _to_e4m3(c / s[..., None]), s, (r / s[..., None]).to(torch.bfloat16)


def quantize_kv(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """``kv_c[T,512]``, ``k_pe[T,64]`` (or ``[T,1,64]``) -> ``uint8[T,656]`` rows."""
    T = kv_c.shape[0]
    c8, s, r16 = _quantize_rows(kv_c, k_pe.reshape(T, fmt.ROPE_DIM))
    rows = torch.zeros(T, fmt.BYTES_PER_TOKEN, dtype=torch.uint8, device=kv_c.device)
    rows[:, fmt.CONTENT_OFFSET:fmt.SCALE_OFFSET] = c8.view(torch.uint8)
    rows[:, fmt.SCALE_OFFSET:fmt.PAD_OFFSET] = s.contiguous().view(torch.uint8).view(T, 4)
    rows[:, fmt.ROPE_OFFSET:] = r16.contiguous().view(torch.uint8).view(T, 2 * fmt.ROPE_DIM)
    return rows


def split_rows(rows: torch.Tensor):
    """View ``uint8[...,656]`` rows as ``(e4m3[...,512], scale f32[...], rope bf16[...,64])``."""
    c8 = rows[..., fmt.CONTENT_OFFSET:fmt.SCALE_OFFSET].contiguous().view(_E4M3)
    s = rows[..., fmt.SCALE_OFFSET:fmt.PAD_OFFSET].contiguous().view(torch.float32)[..., 0]
    r16 = rows[..., fmt.ROPE_OFFSET:].contiguous().view(torch.bfloat16)
    return c8, s, r16


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype = torch.float32):
    """``uint8[...,656] -> (kv_c = e4m3 * s, k_pe = bf16 * s)``, products in FP32, cast to
    ``dtype``."""
    c8, s, r16 = split_rows(rows)
    s = s[..., None]
    return (c8.float() * s).to(dtype), (r16.float() * s).to(dtype)


def append_kv(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """Write token ``t`` to slot ``slot_mapping[t]`` (``t < slot_mapping.numel()``), skipping slots
    < 0 and slots past the cache (as the CUDA kernel does)."""
    slots = slot_mapping.flatten().long()
    n = slots.numel()
    keep = (slots >= 0) & (slots < kv_cache.shape[0] * fmt.PAGE_SIZE)
    slots = slots[keep]
    rows = quantize_kv(kv_c[:n][keep], k_pe[:n].reshape(n, fmt.ROPE_DIM)[keep])
    kv_cache[slots // fmt.PAGE_SIZE, slots % fmt.PAGE_SIZE] = rows


class GatherSources(NamedTuple):
    """Where each gathered token comes from, and whether each step of finding it is valid
    (``*_ok`` are cumulative: a token's position is only valid if its request is, and so on).
    ``offset``, ``start`` and ``pos`` are as computed for every token (from request 0's where
    its own request is invalid); ``block`` is 0 where ``block_ok`` is false."""
    num_seqs: int            # requests the inputs describe
    seq: torch.Tensor        # token_to_seq as given
    seq_ok: torch.Tensor
    offset: torch.Tensor     # the token's place in its request, t - cu_seq_lens[b]
    start: torch.Tensor      # its request's seq_starts (0 without)
    pos: torch.Tensor        # start + offset
    pos_ok: torch.Tensor
    block: torch.Tensor
    block_ok: torch.Tensor


def fits_int32(x: torch.Tensor) -> torch.Tensor:
    """Which values an int32 index (what the CUDA kernels read) can hold."""
    return (x >= -2**31) & (x < 2**31)


def gather_sources(block_table: torch.Tensor, cu_seq_lens: torch.Tensor,
                   token_to_seq: torch.Tensor, num_tokens: int,
                   seq_starts: torch.Tensor | None, num_blocks: int,
                   device: torch.device | str = "cpu") -> GatherSources:
    """Request, position and block of tokens ``t < num_tokens`` of a gather: request
    ``token_to_seq[t]`` (one with a table row, a ``cu_seq_lens`` pair and a start), position
    ``seq_starts[b] + t - cu_seq_lens[b]`` inside its table row, block from the table inside the
    cache of ``num_blocks`` blocks (``csrc/cache_kernels.cu`` applies the same rule).  The
    token's place in its request, ``t - cu_seq_lens[b]``, and the start are never negative.
    Indices are int32 on CUDA: a request whose ``cu_seq_lens`` or start lies outside int32 has
    no valid position."""
    n = int(num_tokens)
    table = block_table.to(device).long()
    cu = cu_seq_lens.to(device).long()
    num_seqs = max(min(table.shape[0], cu.numel() - 1), 0)
    if seq_starts is not None:
        num_seqs = min(num_seqs, seq_starts.numel())
    seq = token_to_seq[:n].to(device).long()
    seq_ok = (seq >= 0) & (seq < num_seqs)
    b = torch.where(seq_ok, seq, 0)
    offset = torch.arange(n, device=device) - cu[b] if num_seqs > 0 else torch.zeros_like(b)
    fits = fits_int32(cu[b]) if num_seqs > 0 else torch.ones_like(seq_ok)
    start = torch.zeros_like(b)
    if seq_starts is not None and num_seqs > 0:
        start = seq_starts.to(device).long()[b]
        fits = fits & fits_int32(start)
    pos = start + offset
    pos_ok = (seq_ok & fits & (offset >= 0) & (start >= 0)
              & (pos < table.shape[1] * fmt.PAGE_SIZE))
    page = torch.where(pos_ok, pos, 0) // fmt.PAGE_SIZE
    block = table[b, page] if num_seqs > 0 else torch.zeros_like(b)
    block_ok = pos_ok & (block >= 0) & (block < num_blocks)
    return GatherSources(num_seqs, seq, seq_ok, offset, start, pos, pos_ok,
                         torch.where(block_ok, block, 0), block_ok)


def gather_kv(kv_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
              cu_seq_lens: torch.Tensor, token_to_seq: torch.Tensor, num_tokens: int,
              seq_starts: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantizing gather; semantics of vLLM's ``gather_and_maybe_dequant_cache``.  A token whose
    request, position or block lies outside the inputs gets a NaN row, as on CUDA."""
    n = int(num_tokens)
    if kv_cache.shape[0] == 0:   # no block to read: every token is outside the cache
        dst[:n] = float("nan")
        return dst
    src = gather_sources(block_table, cu_seq_lens, token_to_seq, n, seq_starts,
                         kv_cache.shape[0], kv_cache.device)
    slot = torch.where(src.block_ok, src.pos, 0) % fmt.PAGE_SIZE
    c, r = dequantize_kv(kv_cache[src.block, slot])
    row = torch.cat([c, r], -1)
    dst[:n] = torch.where(src.block_ok[:, None], row, float("nan")).to(dst.dtype)
    return dst


def quantize_q(q_nope: torch.Tensor, q_pe: torch.Tensor):
    """Per (token, head): ``(q8 e4m3[...,512], q_scale f32[...], q_pe / q_scale bf16[...,64])``."""
    return _quantize_rows(q_nope, q_pe)


def visible_lengths(seq_lens: torch.Tensor, batch: int, s_q: int, causal: bool) -> torch.Tensor:
    """``[B, s_q]`` number of cache positions each query row may attend to."""
    seq = seq_lens[:batch].long()[:, None]
    if not causal:
        return seq.expand(batch, s_q)
    i = torch.arange(s_q, device=seq.device)[None, :]
    return (seq - s_q + 1 + i).clamp_min(0)


def _page(kv_cache, block_table, seq, k):
    """Rows of page ``k`` of every request, with positions past ``seq_len`` zeroed.

    Unused cache bytes are arbitrary (NaN, Inf); zeroing them before any arithmetic keeps them from
    leaking through ``0 * NaN``.  Masking the logits is done separately, per query row.  A live
    page whose block id is outside the cache is not read (zero content and RoPE): its live tokens
    get a NaN scale, so the rows that attend to them come out NaN, as in the CUDA kernels.  A
    zero scale is a zero-filled row (vLLM's never-written null block, which dummy and padded
    requests point at): a zero token, logit 0 and value 0, as a BF16 cache holds there.  A
    negative or NaN scale is not a cache row: NaN.
    """
    B = seq.shape[0]
    pos = k * fmt.PAGE_SIZE + torch.arange(fmt.PAGE_SIZE, device=seq.device)
    live = pos[None, :] < seq[:, None]                                   # [B, 64]
    page_live = (k * fmt.PAGE_SIZE) < seq                               # [B]
    blk = torch.where(page_live, block_table[:B, min(k, block_table.shape[1] - 1)].long(), 0)
    blk_ok = (blk >= 0) & (blk < kv_cache.shape[0])
    c8, s, r16 = split_rows(kv_cache[torch.where(blk_ok, blk, 0)])     # [B,64,...]
    read = live & blk_ok[:, None]
    s = torch.where(blk_ok[:, None] & (s >= 0), s.double(), torch.nan)
    c = torch.where(read[..., None], c8.double(), 0.0)
    s = torch.where(live, s, 0.0)
    r = torch.where(read[..., None], r16.double(), 0.0)
    return pos, c, s, r


def valid_lengths(seq: torch.Tensor, table_pages: int) -> torch.Tensor:
    """Lengths a table ``table_pages`` wide can hold; an invalid request reads nothing and comes
    out NaN (``kernels/splits.py valid_length``)."""
    return (seq >= 0) & (seq <= table_pages * fmt.PAGE_SIZE)


def decode_quantized(q8: torch.Tensor, q_scale: torch.Tensor, q_pe_scaled: torch.Tensor,
                     kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     softmax_scale: float, causal: bool = True):
    """The SnapMLA decode algorithm from an already-quantized query.

    Per query row, per 64-token page ``k`` in increasing order (paper Appendix D, eqs. 12-13):
    ``logit = (q8.k8 + qpe'.kpe') * sq * sk * softmax_scale``; ``m' = max(m, rowmax)``;
    ``e = exp(logit - m')``; ``P' = e * sk`` (scale fusion);
    ``sigma = max(amax(P'), peak * P_SCALE_RANGE, P_SCALE_FLOOR) / 448``;
    ``P8 = e4m3(P' / sigma)``; ``g = exp(m - m') * sigma_prev / sigma``;
    ``O = g O + P8 V8``; ``L = g L + sum(e) / sigma``.  Output ``O / L``, ``lse = m + ln(sigma L)``.
    Returns float64 ``out[B,s_q,H,512]`` and ``lse[B,H,s_q]``.
    """
    B, s_q, H, _ = q8.shape
    dev = q8.device
    qc = q8.double()
    qr = q_pe_scaled.double()
    qs = q_scale.double() * softmax_scale
    seq = seq_lens[:B].to(dev).long()
    valid = valid_lengths(seq, block_table.shape[1])
    seq = torch.where(valid, seq, 0)
    vis = visible_lengths(seq, B, s_q, causal)                           # [B, s_q]
    shape = (B, s_q, H)
    m = torch.full(shape, -torch.inf, dtype=torch.float64, device=dev)
    peak = torch.zeros(shape, dtype=torch.float64, device=dev)
    sigma = torch.ones(shape, dtype=torch.float64, device=dev)
    L = torch.where(valid[:, None, None], torch.zeros(shape, dtype=torch.float64, device=dev),
                    torch.nan)
    O = torch.zeros(*shape, fmt.KV_LORA_RANK, dtype=torch.float64, device=dev)
    num_pages = (int(seq.max()) + fmt.PAGE_SIZE - 1) // fmt.PAGE_SIZE if B else 0
    for k in range(num_pages):
        pos, c, ks, r = _page(kv_cache, block_table.to(dev), seq, k)
        dots = torch.einsum("bshd,btd->bsht", qc, c) + torch.einsum("bshd,btd->bsht", qr, r)
        logit = dots * qs[..., None] * ks[:, None, None, :]
        seen = pos[None, None, :] < vis[:, :, None]                      # [B, s_q, 64]
        logit = torch.where(seen[:, :, None, :], logit, -torch.inf)
        m_new = torch.maximum(m, logit.amax(-1))
        m_ref = torch.where(torch.isinf(m_new), 0.0, m_new)             # rows with nothing seen yet
        e = torch.exp(logit - m_ref[..., None])
        # P' = P sigma_V where the row attends; a NaN scale it does not attend to (a block id
        # outside the cache) stays out of its row, as in exact attention.
        p = torch.where(seen[:, :, None, :], e * ks[:, None, None, :], 0.0)
        amax = p.amax(-1)
        peak = torch.maximum(peak * torch.exp(m - m_ref), amax)
        sigma_new = torch.clamp_min(torch.maximum(amax, peak * fmt.P_SCALE_RANGE),
                                    fmt.P_SCALE_FLOOR) / fmt.FP8_MAX
        p8 = _to_e4m3((p / sigma_new[..., None]).float()).double()
        g = torch.exp(m - m_ref) * sigma / sigma_new
        O = g[..., None] * O + torch.einsum("bsht,btd->bshd", p8, c)
        L = g * L + e.sum(-1) / sigma_new
        m, sigma = m_new, sigma_new
    # A NaN sum (non-finite inputs, an invalid request) gives NaN, never a quiet zero.
    seen = L != 0
    out = torch.where(seen[..., None], O / torch.where(seen, L, 1.0)[..., None], 0.0)
    lse = torch.where(seen, m + torch.log(sigma * L), -torch.inf)
    return out, lse.permute(0, 2, 1).contiguous()


def decode_exact(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
                 causal: bool = True):
    """Float64 attention of the unquantized query over the dequantized cache.  A request whose
    length the table cannot hold gives NaN.  A live token without a cache scale (its block id
    outside the cache, or a NaN or negative scale) is not read: the rows that attend to it give
    NaN, the others are exact, as in ``decode_quantized``."""
    B, s_q, H, _ = q_nope.shape
    dev = q_nope.device
    seq = seq_lens[:B].to(dev).long()
    valid = valid_lengths(seq, block_table.shape[1])
    vis = visible_lengths(torch.where(valid, seq, 0), B, s_q, causal)
    qn = q_nope.double()
    qr = q_pe.double()
    out = torch.zeros(B, s_q, H, fmt.KV_LORA_RANK, dtype=torch.float64, device=dev)
    lse = torch.full((B, H, s_q), -torch.inf, dtype=torch.float64, device=dev)
    for b in range(B):
        n = int(seq[b])
        if not valid[b]:
            out[b] = torch.nan
            lse[b] = torch.nan
            continue
        if n == 0:
            continue
        pages = block_table[b, :(n + fmt.PAGE_SIZE - 1) // fmt.PAGE_SIZE].to(dev).long()
        page_ok = (pages >= 0) & (pages < kv_cache.shape[0])
        rows = kv_cache[torch.where(page_ok, pages, 0)].reshape(-1, fmt.BYTES_PER_TOKEN)[:n]
        _, scale, _ = split_rows(rows)
        readable = page_ok.repeat_interleave(fmt.PAGE_SIZE)[:n] & (scale >= 0)   # [n]
        c, r = dequantize_kv(rows)
        c = torch.where(readable[:, None], c.double(), 0.0)
        r = torch.where(readable[:, None], r.double(), 0.0)
        logit = (qn[b] @ c.T + qr[b] @ r.T) * softmax_scale               # [s_q, H, n]
        seen = torch.arange(n, device=dev)[None, :] < vis[b][:, None]     # [s_q, n]
        logit = torch.where(seen[:, None, :], logit, -torch.inf)
        row_lse = torch.logsumexp(logit, -1)                            # [s_q, H]
        p = torch.exp(logit - torch.where(torch.isinf(row_lse), 0.0, row_lse)[..., None])
        out[b] = p @ c
        lse[b] = row_lse.T
        reads_unreadable = (seen & ~readable[None, :]).any(-1)          # [s_q]
        out[b, reads_unreadable] = torch.nan
        lse[b][:, reads_unreadable] = torch.nan
    return out, lse


def decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
           block_table: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
           causal: bool = True, exact: bool = False):
    """Reference decode: the SnapMLA algorithm (default) or exact float64 attention (``exact``).

    Shapes as in ``vllm_snapmla.ops.decode``; returns float64 ``(out, lse)``.
    """
    if exact:
        return decode_exact(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, causal)
    q8, q_scale, q_pe_scaled = quantize_q(q_nope, q_pe)
    return decode_quantized(q8, q_scale, q_pe_scaled, kv_cache, block_table, seq_lens,
                            softmax_scale, causal)
