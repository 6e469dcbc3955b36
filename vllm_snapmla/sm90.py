"""SnapMLA split-KV decode with the sm_90a CUDA kernel (``csrc/sm90/decode/``).

Same inputs, outputs and split contract as ``vllm_snapmla.triton.decode.snapmla_decode``: stage 1
is the CUDA kernel (one CTA per request, 64-row block of ``(s_q, head)`` rows and KV split; TMA
page ring, FP8/BF16 WGMMA); with several splits, stage 2 is the Triton combine kernel.
``vllm_snapmla.ops.decode`` uses it on sm_90 GPUs (``SNAPMLA_DECODE_KERNEL`` overrides that):
the narrow kernel for requests of at most ``NARROW_ROWS`` query rows, the 64-row kernel above.
"""

from __future__ import annotations

import torch
import triton

from vllm_snapmla import format as fmt
from vllm_snapmla import ops
from vllm_snapmla.triton.decode import _combine_kernel, _device_limits, num_splits_for

_BLOCK_ROWS = 64   # query rows per CTA (csrc/sm90/decode/config.h kBlockRows)
# How the two consumer warpgroups divide the work (config.h kSchedule*).  "narrow" is another
# kernel (csrc/sm90/decode/snapmla_decode_sm90_narrow.cuh, a 16- and a 32-row form) for requests
# of at most NARROW_MAX_ROWS query rows; those of at most NARROW_ROWS take it by default.
# "narrow-16" (measurement) runs any row count as 16-row blocks of its 16-row form.
SCHEDULES = {"free": 0, "split-roles": 1, "narrow": 2, "narrow-16": 3}
NARROW_MAX_ROWS = 32
NARROW_ROWS = NARROW_MAX_ROWS   # both forms are faster than the 64-row kernel on their rows
DEFAULT_SCHEDULE = "split-roles"
# csrc/sm90/decode/config.h hard-codes these (kPScaleRange, kPScaleFloor).
assert fmt.P_SCALE_RANGE == 2.0 ** -32 and fmt.P_SCALE_FLOOR == 2.0 ** -126


def available(device: torch.device | int | None = None) -> bool:
    """True when the extension has the op and ``device`` (default: current) is an sm_90 GPU."""
    native = ops.native()
    if native is None or not hasattr(native, "decode_sm90") or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


def snapmla_decode_sm90(q8: torch.Tensor, q_scale: torch.Tensor, q_pe_scaled: torch.Tensor,
                        kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        softmax_scale: float, causal: bool = True, num_splits: int | None = None,
                        schedule: str | None = None, promote_pv: bool = True):
    """SnapMLA decode from a quantized query on an sm_90 GPU.

    ``q8`` e4m3 ``[B,s_q,H,512]``, ``q_scale`` fp32 ``[B,s_q,H]``, ``q_pe_scaled`` bf16
    ``[B,s_q,H,64]``; ``kv_cache`` uint8 ``[num_blocks,64,656]``; ``block_table`` int32
    ``[>=B,max_blocks]``; ``seq_lens`` int32 ``[>=B]``.  Returns ``out`` bf16 ``[B,s_q,H,512]`` and
    ``lse`` fp32 ``[B,H,s_q]`` (natural log; -inf and zero output for rows that see no token).
    ``num_splits`` defaults to the Triton kernel's ``num_splits_for`` heuristic over
    ``block_table.shape[1]`` pages, evaluated for this kernel's grid.

    ``schedule`` (a key of ``SCHEDULES``) picks the kernel and how its two consumer warpgroups
    divide the work:
    - ``split-roles`` (the default above ``NARROW_ROWS`` rows): one warpgroup computes every
      page's P, the other builds every page's V^T, and each applies the page to its columns;
    - ``free``: both compute every page's P and V^T and apply it to their own 256 columns.

    Those two have the same arithmetic, so their results are equal bit for bit. ``narrow`` is
    the kernel for at most ``NARROW_MAX_ROWS`` query rows (``s_q x H``; a 16-row form up to 16,
    a 32-row form above). It computes ``S^T = K Q^T`` and ``O^T = V^T P^T``, so that nothing
    is padded to 64 rows. ``narrow-16`` (measurement) runs any row count as blocks of 16 rows
    of the 16-row form, one CTA each, a request's blocks adjacent in the grid so that they read
    each page at about the same time (all but the first from L2). Their results
    equal the others' up to FP32 rounding: each of its two consumer warpgroups keeps its own
    running state over alternate pages, and the two are merged at the end like two KV splits.
    ``None`` (the default) picks ``narrow`` where it applies, else ``DEFAULT_SCHEDULE``.

    ``promote_pv=False`` (measurement only; with ``schedule="free"``) accumulates every page's PV
    straight into O in the tensor core instead of promoting each page's sum into FP32 O.
    """
    B, s_q, H, _ = q8.shape
    num_rows = s_q * H
    if schedule is None:
        schedule = "narrow" if num_rows <= NARROW_ROWS and promote_pv else DEFAULT_SCHEDULE
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    if schedule == "narrow" and num_rows > NARROW_MAX_ROWS:
        raise ValueError(f"schedule 'narrow' takes at most {NARROW_MAX_ROWS} query rows "
                         f"(s_q x heads), got {s_q} x {H}")
    if not promote_pv and schedule != "free":
        raise ValueError(f"promote_pv=False exists only with schedule='free', got {schedule!r}")
    native = ops.native()
    if native is None or not hasattr(native, "decode_sm90"):
        raise RuntimeError("vllm_snapmla._C was built without decode_sm90 (csrc/sm90/); rebuild "
                           "with SNAPMLA_ARCHS containing 90a")
    device = q8.device
    out = torch.empty(B, s_q, H, fmt.KV_LORA_RANK, dtype=torch.bfloat16, device=device)
    lse = torch.empty(B, H, s_q, dtype=torch.float32, device=device)
    if B == 0 or num_rows == 0:
        return out, lse
    if num_splits is None:
        num_sms, shared_mem = _device_limits(device.index if device.index is not None
                                             else torch.cuda.current_device())
        # The Triton heuristic, for this kernel's grid: one CTA per SM and 64-row block (the
        # narrow kernel's single block of <= 32 rows counts as one, narrow-16's blocks of 16
        # as one each).  With one page per split
        # the narrow kernel's second consumer has nothing to do; the heuristic does not know.
        blocks = (triton.cdiv(num_rows, 16) if schedule == "narrow-16"
                  else triton.cdiv(num_rows, _BLOCK_ROWS))
        rows_padded = blocks * _BLOCK_ROWS
        num_splits = num_splits_for(B, rows_padded, 1, block_table.shape[1], num_sms, shared_mem)
    num_splits = max(int(num_splits), 1)
    # Like the Triton kernel (and vLLM's persistent buffers), accept tables with more rows than
    # requests; the op wants exactly B rows.
    block_table = block_table[:B].to(torch.int32)
    seq_lens = seq_lens[:B].to(torch.int32).contiguous()
    q_scale = q_scale.float()

    if num_splits == 1:
        native.decode_sm90(q8, q_scale, q_pe_scaled, kv_cache, block_table, seq_lens, out, lse,
                           float(softmax_scale), bool(causal), 1, SCHEDULES[schedule],
                           bool(promote_pv))
        return out, lse
    part = torch.empty(B, num_splits, num_rows, fmt.KV_LORA_RANK, dtype=torch.float32,
                       device=device)
    part_lse = torch.empty(B, num_splits, num_rows, dtype=torch.float32, device=device)
    native.decode_sm90(q8, q_scale, q_pe_scaled, kv_cache, block_table, seq_lens, part, part_lse,
                       float(softmax_scale), bool(causal), num_splits, SCHEDULES[schedule],
                       bool(promote_pv))
    _combine_kernel[(B, num_rows)](
        part, part_lse, out, lse, H, s_q, num_rows, num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits), D=fmt.KV_LORA_RANK, num_warps=4)
    return out, lse



def schedule_variant(schedule: str):
    """``snapmla_decode_sm90`` with a fixed ``schedule`` (for tests and benchmarks)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")

    def decode(*args, **kwargs):
        return snapmla_decode_sm90(*args, schedule=schedule, **kwargs)
    decode.__name__ = f"snapmla_decode_sm90[{schedule}]"
    return decode


snapmla_decode_sm90_free = schedule_variant("free")
snapmla_decode_sm90_split_roles = schedule_variant("split-roles")
snapmla_decode_sm90_narrow16 = schedule_variant("narrow-16")
