"""SnapMLA split-KV decode on Hopper: the sm_90a kernels of ``csrc/sm90/``.

``decode_sm90`` is the path ``vllm_snapmla.ops.decode`` takes on sm_90 GPUs, and so vLLM's: one
op call per decode that quantizes the query (with the split planner in the same launch, unless
the step's plan from ``plan_decode_sm90`` is given), runs the decode kernel and, where a request
is cut into several runs, the combine (``kernels/splits.py``).  ``snapmla_decode_sm90`` takes an
already quantized query (``ops.quantize_q``), for tests and benchmarks of the kernels alone.

Two kernels, picked by query rows per request (``s_q x heads``): the narrow kernel up to
``NARROW_MAX_ROWS`` (a 16-row form up to 16 rows, a 32-row form above; S^T = K Q^T, so nothing is
padded to 64 rows), and the 64-row kernel above it, whose two consumer warpgroups divide the
work by ``schedule``:
- ``split-roles`` (the default): one warpgroup computes every page's P, the other builds every
  page's V^T, and each applies the page to its own output columns;
- ``free``: both compute every page's P and V^T and apply it to their own 256 columns (the
  plain form, the reference of the bit-identity tests).
"""

from __future__ import annotations

import torch

from vllm_snapmla._native import native, require_native
from vllm_snapmla.kernels import splits

SCHEDULES = {"free": 0, "split-roles": 1, "narrow": 2}   # csrc/sm90/config.h kSchedule*
NARROW_MAX_ROWS = 32   # csrc/sm90/config.h kNarrowMaxRows
BLOCK_ROWS = 64   # query rows per CTA of the 64-row kernel (csrc/sm90/config.h kBlockRows)


def launch_programs(batch: int, rows: int) -> int:
    """CTAs per split of a ``decode_sm90`` launch for ``batch`` requests of ``rows`` query rows
    (``s_q x heads``): one a request in the narrow kernel, one per BLOCK_ROWS rows above it
    (``csrc/api/decode_ops.cpp`` launch_shape)."""
    row_blocks = 1 if rows <= NARROW_MAX_ROWS else -(-rows // BLOCK_ROWS)
    return batch * row_blocks


def launch_max_splits(batch: int, rows: int, table_pages: int, slots: int) -> int:
    """The grid's splits per request of that launch on a GPU of ``slots`` SMs."""
    return splits.max_splits_for(batch, launch_programs(batch, rows), slots, table_pages)


def available(device: torch.device | int | None = None) -> bool:
    """True when ``device`` (default: current) is an sm_90 GPU and the extension was built with
    sm_90a code for it (``SNAPMLA_ARCHS`` containing ``90a``)."""
    ops = native()
    if ops is None or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device) != (9, 0):
        return False
    with torch.cuda.device(device):
        return bool(ops.has_sm90a_code())


def _schedule_id(schedule: str | None) -> int:
    if schedule is None:
        return -1   # by row count: narrow up to NARROW_MAX_ROWS, split-roles above
    try:
        return SCHEDULES[schedule]
    except KeyError:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)} or None, "
                         f"got {schedule!r}") from None


def decode_sm90(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                block_table: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
                causal: bool = True, num_splits: int | None = None,
                plan: torch.Tensor | None = None):
    """SnapMLA decode from the model's query on an sm_90 GPU, the kernel chosen by row count
    (``snapmla_decode_sm90`` takes a fixed ``schedule``).

    ``q_nope [B,s_q,H,512]``, ``q_pe [B,s_q,H,64]`` (bf16, fp16 or fp32; row-strided views are
    read in place); ``kv_cache`` uint8 ``[num_blocks,64,656]``; ``block_table`` int32 or int64
    ``[>=B, max_blocks]``; ``seq_lens`` int32 or int64 ``[>=B]`` (int64 is copied to int32).
    Returns ``out`` bf16 ``[B,s_q,H,512]`` and ``lse`` fp32 ``[B,H,s_q]`` (natural log; -inf and
    zero output for rows that see no token).  ``num_splits`` None lets the planner choose on the
    GPU from the real lengths; an int cuts every request into that many equal runs.  ``plan``
    (int32 ``[1]``, from ``plan_decode_sm90``; with ``num_splits`` None) replaces the call's own
    planner.
    """
    # The op's float argument would also take an int, a bool or a one-element tensor (read on
    # the host): ops.decode checks the scale before this call.
    return require_native("decode_sm90").decode_sm90(
        q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, bool(causal),
        num_splits or 0, _schedule_id(None), plan)


def plan_decode_sm90(seq_lens: torch.Tensor, block_table: torch.Tensor, batch: int, s_q: int,
                     heads: int, plan: torch.Tensor) -> torch.Tensor:
    """Write into ``plan`` (int32 ``[1]``) the split plan ``decode_sm90`` makes for ``batch``
    requests of ``s_q`` x ``heads`` query rows with this table and these lengths, on the GPU
    without a host sync; nothing is written where that launch has a single split (the plan is
    not read there).  Returns ``plan``."""
    require_native("plan_decode_sm90").plan_decode_sm90(seq_lens, block_table, batch, s_q,
                                                        heads, plan)
    return plan


def snapmla_decode_sm90(q8: torch.Tensor, q_scale: torch.Tensor, q_pe_scaled: torch.Tensor,
                        kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        softmax_scale: float, causal: bool = True, num_splits: int | None = None,
                        schedule: str | None = None, plan: torch.Tensor | None = None):
    """``decode_sm90`` from a quantized query (``ops.quantize_q``): ``q8`` e4m3 ``[B,s_q,H,512]``,
    ``q_scale`` fp32 ``[B,s_q,H]``, ``q_pe_scaled`` bf16 ``[B,s_q,H,64]``; the rest as there."""
    schedule_id = _schedule_id(schedule)
    return require_native("snapmla_decode_sm90").decode_sm90_quantized(
        q8, q_scale, q_pe_scaled, kv_cache, block_table, seq_lens, float(softmax_scale),
        bool(causal), num_splits or 0, schedule_id, plan)


def schedule_variant(schedule: str):
    """``snapmla_decode_sm90`` with a fixed ``schedule`` (for tests and benchmarks)."""
    _schedule_id(schedule)

    def decode(*args, **kwargs):
        return snapmla_decode_sm90(*args, schedule=schedule, **kwargs)
    decode.__name__ = f"snapmla_decode_sm90[{schedule}]"
    return decode
