"""Random decode inputs and the ways a caller can get them wrong, for the contract tests of
``vllm_snapmla.ops`` on the CPU (``tests/unit/test_ops.py``) and on the GPU
(``tests/gpu/test_ops_cuda.py``).

A case is a poisoned paged cache (every unused byte random, every unused scale NaN), a block
table with spare columns, ragged lengths and a random query.  ``BAD_ARGUMENTS`` break the shape,
type or scale contract (always an error); ``BAD_INDICES`` break a request's length or block ids
(an error when the data checks run; otherwise NaN in the rows that depend on them, and nothing
read from another block); ``NON_FINITE`` put a NaN where attention must carry it into the
output.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_snapmla import format as fmt
from vllm_snapmla.testing import build_cache

SCALE = 0.1147


@dataclasses.dataclass
class DecodeCase:
    q_nope: torch.Tensor       # [B, s_q, H, 512] bf16
    q_pe: torch.Tensor         # [B, s_q, H, 64] bf16
    kv_cache: torch.Tensor     # uint8 [num_blocks, 64, 656]
    block_table: torch.Tensor  # int32 [B, width]
    seq_lens: torch.Tensor     # int32 [B]
    softmax_scale: float = SCALE

    def args(self):
        return (self.q_nope, self.q_pe, self.kv_cache, self.block_table, self.seq_lens,
                self.softmax_scale)

    def to(self, device) -> DecodeCase:
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        return DecodeCase(**moved)

    def replace(self, **changes) -> DecodeCase:
        return dataclasses.replace(self, **changes)


def decode_case(seq_lens, heads: int, s_q: int, seed: int, spare_columns: int = 1) -> DecodeCase:
    gen = torch.Generator().manual_seed(seed)
    cache, table, _ = build_cache(seq_lens, gen=gen)
    spare = torch.randint(0, cache.shape[0], (table.shape[0], spare_columns), generator=gen,
                          dtype=torch.int32)
    table = torch.cat([table, spare], 1)
    B = len(seq_lens)
    q = torch.randn(B, s_q, heads, fmt.KV_LORA_RANK, generator=gen).bfloat16()
    qp = (torch.randn(B, s_q, heads, fmt.ROPE_DIM, generator=gen) * 3).bfloat16()
    return DecodeCase(q, qp, cache, table, torch.tensor(seq_lens, dtype=torch.int32))


# --- arguments that break the contract: (change, exception, what the message must name) ------

def _q_pe_batch_one(c):
    return c.replace(q_pe=c.q_pe[:1])                       # would broadcast


def _q_pe_half_heads(c):
    return c.replace(q_pe=c.q_pe[:, :, : max(c.q_pe.shape[2] // 2, 1)].contiguous()
                     if c.q_pe.shape[2] > 1 else torch.cat([c.q_pe, c.q_pe], 2))


BAD_ARGUMENTS = {
    "q_pe broadcasts over the batch": (_q_pe_batch_one, ValueError, "q_pe"),
    "q_pe has other heads": (_q_pe_half_heads, ValueError, "q_pe"),
    "q_nope 3-D": (lambda c: c.replace(q_nope=c.q_nope[:, 0]), ValueError, "q_nope"),
    "q_nope integer": (lambda c: c.replace(q_nope=c.q_nope.to(torch.int32)), TypeError, "q_nope"),
    "q_pe 63 wide": (lambda c: c.replace(q_pe=c.q_pe[..., :63]), ValueError, "q_pe"),
    "seq_lens a list": (lambda c: c.replace(seq_lens=c.seq_lens.tolist()), TypeError, "seq_lens"),
    "seq_lens float": (lambda c: c.replace(seq_lens=c.seq_lens.float()), TypeError, "seq_lens"),
    "seq_lens too short": (lambda c: c.replace(seq_lens=c.seq_lens[:-1]), ValueError, "seq_lens"),
    "block_table float": (lambda c: c.replace(block_table=c.block_table.float()), TypeError,
                          "block_table"),
    "block_table 1-D": (lambda c: c.replace(block_table=c.block_table[0]), ValueError,
                        "block_table"),
    # Every other column of a table twice as wide: the same ids, read with a column stride of 2.
    "block_table column-strided": (lambda c: c.replace(
        block_table=c.block_table.repeat_interleave(2, dim=1)[:, ::2]), ValueError, "block_table"),
    "kv_cache rows 600 wide": (lambda c: c.replace(kv_cache=c.kv_cache[..., :600]), ValueError,
                               "kv_cache"),
    "kv_cache bf16": (lambda c: c.replace(kv_cache=c.kv_cache.view(torch.bfloat16)), ValueError,
                      "kv_cache"),
    "softmax_scale NaN": (lambda c: c.replace(softmax_scale=float("nan")), ValueError,
                          "softmax_scale"),
    "softmax_scale 0": (lambda c: c.replace(softmax_scale=0.0), ValueError, "softmax_scale"),
    "softmax_scale negative": (lambda c: c.replace(softmax_scale=-0.1), ValueError,
                               "softmax_scale"),
    "softmax_scale inf": (lambda c: c.replace(softmax_scale=float("inf")), ValueError,
                          "softmax_scale"),
    "softmax_scale a string": (lambda c: c.replace(softmax_scale="0.1"), TypeError,
                               "softmax_scale"),
    # The kernels' logit scale is softmax_scale * log2(e) as a float32: Inf (NaN outputs) or 0
    # (uniform attention) there.
    "softmax_scale past float32": (lambda c: c.replace(softmax_scale=1e39), ValueError,
                                   "softmax_scale"),
    "softmax_scale below float32": (lambda c: c.replace(softmax_scale=1e-50), ValueError,
                                    "softmax_scale"),
    "kv_cache without blocks": (lambda c: c.replace(kv_cache=c.kv_cache[:0]), ValueError,
                                "kv_cache"),
    "kv_cache blocks overlap": (lambda c: c.replace(kv_cache=c.kv_cache[:1].expand(
        c.kv_cache.shape[0], *c.kv_cache.shape[1:])), ValueError, "kv_cache"),
    # A bool or a tensor would pass as a number through the native op's float argument.
    "softmax_scale a bool": (lambda c: c.replace(softmax_scale=True), TypeError,
                             "softmax_scale"),
    "softmax_scale a tensor": (lambda c: c.replace(
        softmax_scale=torch.tensor(0.1, device=c.q_nope.device)), TypeError, "softmax_scale"),
    "q_pe in another dtype": (lambda c: c.replace(q_pe=c.q_pe.to(
        torch.float16 if c.q_nope.dtype != torch.float16 else torch.bfloat16)), TypeError,
                              "q_pe"),
}


# --- indices that break one request b: (change(case, b), what the message must name) --------

def _set_len(value_of):
    def change(c, b):
        lens = c.seq_lens.clone()
        lens[b] = value_of(c)
        return c.replace(seq_lens=lens)
    return change


def _set_block(value_of, page_of):
    def change(c, b):
        table = c.block_table.clone()
        table[b, page_of(c, b)] = value_of(c)
        return c.replace(block_table=table)
    return change


def _past_int32(c, b, value):
    """``value`` + 2^32: an int64 index that wraps onto ``value`` when narrowed to int32."""
    return value + 2**32


def _set_len_int64(c, b):
    lens = c.seq_lens.clone().long()
    lens[b] = _past_int32(c, b, int(lens[b]))
    return c.replace(seq_lens=lens)


def _set_block_int64(c, b):
    table = c.block_table.clone().long()
    page = _last_live_page(c, b)
    table[b, page] = _past_int32(c, b, int(table[b, page]))
    return c.replace(block_table=table)


def _last_live_page(c, b):
    return (int(c.seq_lens[b]) - 1) // fmt.PAGE_SIZE


def _whole_request(c, b):
    rows = torch.zeros(c.q_nope.shape[:3], dtype=torch.bool)
    rows[b] = True
    return rows


def rows_reading_page(c: DecodeCase, b: int, page: int) -> torch.Tensor:
    """``[B, s_q, H]``: the rows of request b that attend to a position of ``page`` (causal)."""
    s_q = c.q_nope.shape[1]
    visible = int(c.seq_lens[b]) - s_q + 1 + torch.arange(s_q)
    rows = torch.zeros(c.q_nope.shape[:3], dtype=torch.bool)
    rows[b] = (visible > page * fmt.PAGE_SIZE)[:, None]
    return rows


def _reading_last_live_page(c, b):
    return rows_reading_page(c, b, _last_live_page(c, b))


# name: (change(case, b), what the message must name, rows(case, b) that come out NaN).  A length
# the table cannot hold makes the whole request NaN; a block id outside the cache the rows that
# attend to its page (with s_q > 1 the last page can lie past what the first queries see).
BAD_INDICES = {
    # seq_len 192 over a 2-block table re-read the last block; 10,000 moved the LSE.
    "seq_len past the table": (_set_len(lambda c: c.block_table.shape[1] * fmt.PAGE_SIZE + 1),
                               r"seq_lens\[{b}\]", _whole_request),
    "seq_len far past the table": (_set_len(lambda c: 10_000_000), r"seq_lens\[{b}\]",
                                   _whole_request),
    "negative seq_len": (_set_len(lambda c: -3), r"seq_lens\[{b}\]", _whole_request),
    "block id -1": (_set_block(lambda c: -1, _last_live_page), r"block_table\[{b}, ",
                    _reading_last_live_page),
    "block id past the cache": (_set_block(lambda c: c.kv_cache.shape[0] + 5, _last_live_page),
                                r"block_table\[{b}, ", _reading_last_live_page),
    # int64 values that a narrowing to int32 would wrap onto the request's own valid ones.
    "seq_len 2^32 past its own (int64)": (_set_len_int64, r"seq_lens\[{b}\]", _whole_request),
    "block id 2^32 past its own (int64)": (_set_block_int64, r"block_table\[{b}, ",
                                           _reading_last_live_page),
}


# --- NaN where attention must carry it: (change(case, b, generator), rows it makes NaN) -------

def nan_in_query(c, b, gen):
    """One element of one query row (b, i, h): that row only."""
    i = int(torch.randint(c.q_nope.shape[1], (1,), generator=gen))
    h = int(torch.randint(c.q_nope.shape[2], (1,), generator=gen))
    which = "q_nope" if int(torch.randint(2, (1,), generator=gen)) else "q_pe"
    t = getattr(c, which).clone()
    t[b, i, h, int(torch.randint(t.shape[-1], (1,), generator=gen))] = float("nan")
    rows = torch.zeros(c.q_nope.shape[:3], dtype=torch.bool)
    rows[b, i, h] = True
    return c.replace(**{which: t}), rows


def _token_every_query_sees(c, b, gen):
    s_q = c.q_nope.shape[1]
    return int(torch.randint(int(c.seq_lens[b]) - s_q + 1, (1,), generator=gen))


def _cache_byte(c, b, pos, offset, value):
    cache = c.kv_cache.clone()
    cache[int(c.block_table[b, pos // fmt.PAGE_SIZE]), pos % fmt.PAGE_SIZE, offset] = value
    return cache


def nan_in_cache_content(c, b, gen):
    """An e4m3 NaN byte in a token every query of request b sees: all of b's rows."""
    pos = _token_every_query_sees(c, b, gen)
    col = int(torch.randint(fmt.KV_LORA_RANK, (1,), generator=gen))
    return (c.replace(kv_cache=_cache_byte(c, b, pos, fmt.CONTENT_OFFSET + col, 0x7F)),
            _whole_request(c, b))


def nan_scale_at(c: DecodeCase, b: int, pos: int) -> DecodeCase:
    """A NaN scale at position ``pos`` of request b (a live token without a valid scale)."""
    nan = torch.tensor([float("nan")], dtype=torch.float32).view(torch.uint8)
    return c.replace(kv_cache=_cache_byte(c, b, pos, slice(fmt.SCALE_OFFSET, fmt.PAD_OFFSET), nan))


def nan_in_cache_scale(c, b, gen):
    """A NaN scale in a token every query of request b sees: all of b's rows."""
    return nan_scale_at(c, b, _token_every_query_sees(c, b, gen)), _whole_request(c, b)


NON_FINITE = {
    "NaN in a query element": nan_in_query,
    "NaN e4m3 byte in a live cache row": nan_in_cache_content,
    "NaN scale in a live cache row": nan_in_cache_scale,
}


# --- zero-filled rows: vLLM's null block ------------------------------------------------------

def zero_filled_page(c: DecodeCase, b: int, gen) -> tuple[DecodeCase, int]:
    """Point one live page of request b at a new all-zero block, as vLLM's never-written null
    block (``torch.zeros``, scale 0.0) is for dummy and padded requests.  Returns the case and
    the page index.  Such rows read as zero tokens: logit 0, value 0."""
    pages = (int(c.seq_lens[b]) + fmt.PAGE_SIZE - 1) // fmt.PAGE_SIZE
    page = int(torch.randint(pages, (1,), generator=gen))
    zero = torch.zeros(1, *c.kv_cache.shape[1:], dtype=c.kv_cache.dtype)
    table = c.block_table.clone()
    table[b, page] = c.kv_cache.shape[0]
    return c.replace(kv_cache=torch.cat([c.kv_cache, zero]), block_table=table), page


def nan_rows_of(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, s_q, H]`` masks of rows whose output has a NaN, and whose LSE is NaN."""
    return out.isnan().any(-1).cpu(), lse.permute(0, 2, 1).isnan().cpu()
