"""Split-KV decode planning and combine, shared by the Hopper and Triton kernels.

A decode launch has a fixed grid of ``max_splits`` KV splits per (request, row block), so that a
CUDA graph captured once replays for any lengths.  Which splits work is decided on the GPU at
every call (``csrc/split_kv.h``): the planner reads the batch's lengths and writes how many pages
a split takes, from a cost model of waves of CTAs; each request's pages are cut into runs of
that many pages, and splits past a request's last run return at once.  A wide block table
(vLLM's is ``max_model_len / 64`` columns) with short requests therefore costs what a tight one
does.  ``split_range`` is the one rule every kernel and the combine apply.
"""

from __future__ import annotations

import torch

from vllm_snapmla import format as fmt
from vllm_snapmla._native import require_native


def max_splits_for(batch: int, programs: int, slots: int, table_pages: int) -> int:
    """The grid's splits: two waves of CTAs for several requests, one for a single request,
    never more than the table's pages (``split_kv.h max_splits_for``)."""
    programs = max(programs, 1)
    splits = slots // programs if batch == 1 else -(-2 * slots // programs)
    splits = min(splits, table_pages, 65535)
    if table_pages > 0:
        splits = min(splits, (2**31 - 1) // table_pages)   # split x run stays an int32
    return max(1, splits)


def valid_length(seq_len: int, table_pages: int) -> bool:
    """A length a block table ``table_pages`` wide can hold (``split_kv.h valid_length``); the
    kernels read nothing for any other and write NaN for its request."""
    return 0 <= seq_len <= table_pages * fmt.PAGE_SIZE


def request_pages(seq_len: int, table_pages: int) -> int:
    """Pages a request's kernels read: none for an invalid length."""
    return -(-seq_len // fmt.PAGE_SIZE) if valid_length(seq_len, table_pages) else 0


def split_range(seq_len: int, table_pages: int, pages_per_split: int, max_splits: int,
                split: int):
    """``(first_page, num_pages, num_splits)`` of one split (``split_kv.h split_range``)."""
    pages = request_pages(seq_len, table_pages)
    run = -(-pages // max_splits)
    if pages_per_split > run:
        run = min(pages_per_split, pages)   # any plan value: at most one run of the request
    num_splits = max(-(-pages // run), 1) if run > 0 else 1
    first = split * run
    return first, max(min(first + run, pages) - first, 0), num_splits


# A split's fixed cost (query load, partial write) in pages of streaming, for the planner's cost
# model (csrc/split_kv.h kSplitOverheadPages).
SPLIT_OVERHEAD_PAGES = 2
# The combine's cost for the longest request's runs, in the same units (split_kv.h
# combine_cost_pages, which says where the values come from): a fixed part, and 3 pages per 32
# splits of a row (one memory round trip of the wide combine: 8 warps, 4 splits in flight each)
# from COMBINE_WIDE_FROM splits on, else a page per 2 splits (one warp, split after split).
COMBINE_FIXED_PAGES = 2
COMBINE_WIDE_ROUND_PAGES = 3
COMBINE_WIDE_ROUND_SPLITS = 32
COMBINE_NARROW_SPLITS_PER_PAGE = 2
COMBINE_WIDE_FROM = 32


def combine_cost_pages(runs: int, max_splits: int) -> int:
    """The combine's share of the planner's cost (``split_kv.h combine_cost_pages``)."""
    if runs <= 1:
        return 0
    if max_splits >= COMBINE_WIDE_FROM:
        variable = -(-runs // COMBINE_WIDE_ROUND_SPLITS) * COMBINE_WIDE_ROUND_PAGES
    else:
        variable = -(-runs // COMBINE_NARROW_SPLITS_PER_PAGE)
    return COMBINE_FIXED_PAGES + variable


def pages_per_split_for(seq_lens: list[int], programs: int, slots: int, max_splits: int,
                        table_pages: int) -> int:
    """The planner's choice (``split_kv.h plan_splits_warp``), returned as pages per split: of
    the run lengths L = ceil(longest valid request's pages / s), s <= max_splits, the cheapest
    ceil(work / (slots x (L + SPLIT_OVERHEAD_PAGES))) waves x (L + SPLIT_OVERHEAD_PAGES), where
    work = row blocks (programs / batch) x (all requests' pages + their ceil(pages / L) runs x
    SPLIT_OVERHEAD_PAGES), plus ``combine_cost_pages`` of the longest request's runs; fewer
    splits on ties.  Invalid lengths count for nothing."""
    pages = [request_pages(n, table_pages) for n in seq_lens]
    max_pages, total_pages = max(pages, default=0), sum(pages)
    best, best_cost = 1, None
    for s in range(1, min(max_pages, max_splits) + 1):
        run = -(-max_pages // s)
        runs = sum(-(-p // run) for p in pages)
        work = programs * (total_pages + runs * SPLIT_OVERHEAD_PAGES)
        wave = len(pages) * slots * (run + SPLIT_OVERHEAD_PAGES)
        cost = (-(-work // wave) * (run + SPLIT_OVERHEAD_PAGES)
                + combine_cost_pages(-(-max_pages // run), max_splits))
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return -(-max_pages // best) if max_pages > 0 else 1


def plan(seq_lens: torch.Tensor, table_pages: int, batch: int, programs: int, slots: int,
         max_splits: int) -> torch.Tensor:
    """``pages_per_split`` as an int32[1] tensor on ``seq_lens``' device; on a GPU computed
    there (no host sync), on the CPU (Triton's interpreter) in Python."""
    if not seq_lens.is_cuda:
        return torch.tensor([pages_per_split_for(seq_lens[:batch].tolist(), programs, slots,
                                                 max_splits, table_pages)], dtype=torch.int32)
    pages_per_split = torch.empty(1, dtype=torch.int32, device=seq_lens.device)
    require_native("split planning").split_plan(seq_lens, pages_per_split, table_pages, batch,
                                                programs, slots, max_splits)
    return pages_per_split


def combine(part_out: torch.Tensor, part_lse: torch.Tensor, seq_lens: torch.Tensor,
            pages_per_split: torch.Tensor | None, table_pages: int, out: torch.Tensor,
            lse: torch.Tensor) -> None:
    """Merge the splits' partials ``[B, max_splits, rows, 512]`` into ``out [B, s_q, H, 512]``
    (bf16) and ``lse [B, H, s_q]`` by LSE, for every request cut into several runs (the decode
    kernel wrote a request of one run directly).  Splits with LSE -inf wrote no output; a NaN
    LSE makes the request's rows NaN."""
    if part_out.is_cuda:
        require_native("the split-KV combine").combine_splits(
            part_out, part_lse, seq_lens, pages_per_split, table_pages, out, lse)
        return
    B, max_splits, rows, _ = part_out.shape
    s_q, H = out.shape[1], out.shape[2]
    chunk = int(pages_per_split[0]) if pages_per_split is not None else 0
    for b in range(B):
        runs = split_range(int(seq_lens[b]), table_pages, chunk, max_splits, 0)[2]
        if runs == 1:
            continue
        lses = part_lse[b, :runs].double()                       # [runs, rows]
        m = torch.where(lses.isnan(), float("-inf"), lses).max(0).values   # as fmaxf: NaN skipped
        m_ref = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        w = torch.exp(lses - m_ref)
        total = w.sum(0)
        parts = torch.where(w[..., None] != 0, part_out[b, :runs].double(), 0.0)
        merged = (w[..., None] * parts).sum(0) / torch.where(total == 0, 1.0, total)[:, None]
        out[b] = merged.view(s_q, H, -1).to(out.dtype)
        lse[b] = torch.where(total == 0, float("-inf"), m + torch.log(total)).float() \
            .view(s_q, H).T
