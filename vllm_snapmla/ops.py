"""Public operations on the ``fp8_snapmla`` cache (layout: ``vllm_snapmla.format``).

Every function takes CPU or CUDA tensors.  CPU tensors run the exact PyTorch reference
(``vllm_snapmla.reference``); CUDA tensors run our kernels: the native extension
(``vllm_snapmla._C``, ``csrc/``) for the data path, and for decode the sm_90a kernels on Hopper
(``vllm_snapmla.kernels.sm90``, one op call) or the portable Triton split-KV kernel elsewhere
(``vllm_snapmla.kernels.triton_decode``).  All give the same results within the tolerances the
tests state.

Each function states its contract in its docstring (``vllm_snapmla._checks`` enforces it):
shapes agree exactly, dtypes and devices are checked, and a violation raises ``TypeError`` or
``ValueError`` naming the argument.  Checks that read the data (lengths, block ids, slots) run
on CPU tensors, or on CUDA tensors with ``validate=True`` or ``SNAPMLA_VALIDATE=1`` (they sync
with the GPU, so vLLM's path skips them); without them the CUDA kernels never read outside the
cache and give NaN for a request whose indices are invalid.

``SNAPMLA_DECODE_KERNEL`` picks the decode kernel: ``auto`` (default: sm90 where it is built and
the GPU is sm_90, Triton otherwise), ``sm90`` (always; refuse to run without it) or ``triton``.
"""

from __future__ import annotations

import functools
import os

import torch

from vllm_snapmla import _checks, reference
from vllm_snapmla import format as fmt
from vllm_snapmla._native import require_native
from vllm_snapmla.kernels import sm90, triton_decode


def _require_native(what: str):
    return require_native(f"vllm_snapmla.ops.{what}")


def quantize_kv(kv_c: torch.Tensor, k_pe: torch.Tensor, *,
                validate: bool | None = None) -> torch.Tensor:
    """Quantize ``kv_c[T,512]`` and ``k_pe[T,64]`` (or ``[T,1,64]``) into ``uint8[T,656]`` rows.

    Both float (bf16, fp16, fp32), same dtype, device and ``T``.  A row holding NaN or Inf raises
    ``ValueError`` when the data checks run (module docstring); without them it is stored so that
    attention over that token gives NaN.
    """
    kv_c = _checks.token_rows("kv_c", kv_c, fmt.KV_LORA_RANK)
    k_pe = _checks.token_rows("k_pe", k_pe, fmt.ROPE_DIM)
    _kv_pair(kv_c, k_pe, kv_c.shape[0], exact=True)
    if _checks.data_checks_on(validate, kv_c):
        _checks.finite_rows("kv_c", kv_c)
        _checks.finite_rows("k_pe", k_pe)
    if kv_c.is_cuda:
        out = torch.empty(kv_c.shape[0], fmt.BYTES_PER_TOKEN, dtype=torch.uint8, device=kv_c.device)
        _require_native("quantize_kv").quantize_kv(kv_c, k_pe, out)
        return out
    return reference.quantize_kv(kv_c, k_pe)


def _kv_pair(kv_c: torch.Tensor, k_pe: torch.Tensor, rows: int, exact: bool) -> None:
    """Same dtype and device; ``rows`` rows each (``exact``), or at least ``rows``."""
    if k_pe.dtype != kv_c.dtype:
        raise TypeError(f"k_pe is {k_pe.dtype} but kv_c is {kv_c.dtype}; they must match")
    _checks.same_device(kv_c.device, k_pe=k_pe)
    if exact and k_pe.shape[0] != rows:
        raise ValueError(f"kv_c has {kv_c.shape[0]} rows and k_pe {k_pe.shape[0]}; they must "
                         "have the same count")
    if kv_c.shape[0] < rows or k_pe.shape[0] < rows:
        raise ValueError(f"kv_c has {kv_c.shape[0]} rows and k_pe {k_pe.shape[0]}; "
                         f"{rows} are needed (one per slot_mapping entry)")


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype = torch.float32):
    """Inverse of ``quantize_kv``: ``uint8[...,656] -> (kv_c[...,512], k_pe[...,64])`` in ``dtype``
    (bfloat16, float16, float32 or float64)."""
    _checks.tensor("rows", rows)
    if rows.dtype != torch.uint8 or rows.dim() == 0 or rows.shape[-1] != fmt.BYTES_PER_TOKEN:
        raise ValueError(f"rows must be uint8[..., {fmt.BYTES_PER_TOKEN}], got "
                         f"{rows.dtype}{list(rows.shape)}")
    return reference.dequantize_kv(rows, _checks.float_dtype("dtype", dtype))


def append_kv(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, *, validate: bool | None = None) -> None:
    """Quantize and write token ``t`` to slot ``slot_mapping[t]`` for ``t < len(slot_mapping)``.

    ``slot_mapping`` is an integer tensor (flattened); slot ``s`` is row ``s % 64`` of block
    ``s // 64``.  Negative slots (vLLM's padding) are skipped; ``kv_c`` and ``k_pe`` may have
    more rows than ``slot_mapping`` (CUDA-graph padding), and those rows are ignored.  The slots
    written (the non-negative ones) are distinct.  A slot past the cache or written twice raises
    ``ValueError`` when the data checks run; without them a slot past the cache is skipped (a
    slot written twice holds either token's row, or on CUDA a mix of the two).
    """
    if (isinstance(kv_cache, torch.Tensor) and kv_cache.is_cuda
            and not _checks.data_checks_on(validate, kv_cache)):
        # vLLM's path, once per layer and step: one op call, whose C++ layer checks the same
        # contract (with the Python checks too, vLLM's cache-update op took 52 µs of host time
        # a layer on its own, against 28 for the BF16 cache).  On an error, the Python contract
        # names the argument.
        append = _require_native("append_kv").append_kv
        try:
            append(kv_c, k_pe, kv_cache, slot_mapping.reshape(-1))
        except (AttributeError, RuntimeError, TypeError, ValueError):
            _check_append(kv_c, k_pe, kv_cache, slot_mapping)
            raise
        return
    kv_c, k_pe = _check_append(kv_c, k_pe, kv_cache, slot_mapping)
    n = slot_mapping.numel()
    if _checks.data_checks_on(validate, kv_cache):
        written = _checks.slots(slot_mapping, kv_cache.shape[0])   # skipped rows: not stored
        _checks.finite_rows("kv_c", kv_c[:n], written)
        _checks.finite_rows("k_pe", k_pe[:n], written)
    if kv_cache.is_cuda:
        _require_native("append_kv").append_kv(kv_c, k_pe, kv_cache, slot_mapping.flatten())
        return
    reference.append_kv(kv_c, k_pe, kv_cache, slot_mapping)


def _check_append(kv_c, k_pe, kv_cache, slot_mapping) -> tuple[torch.Tensor, torch.Tensor]:
    """``append_kv``'s shape, dtype and device contract; ``kv_c`` and ``k_pe`` as ``[T, width]``."""
    _checks.cache(kv_cache)
    kv_c = _checks.token_rows("kv_c", kv_c, fmt.KV_LORA_RANK)
    k_pe = _checks.token_rows("k_pe", k_pe, fmt.ROPE_DIM)
    _checks.index_tensor("slot_mapping", slot_mapping)
    _checks.same_device(kv_cache.device, kv_c=kv_c, k_pe=k_pe, slot_mapping=slot_mapping)
    _kv_pair(kv_c, k_pe, slot_mapping.numel(), exact=False)
    return kv_c, k_pe


def gather_kv(kv_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
              cu_seq_lens: torch.Tensor, token_to_seq: torch.Tensor, num_tokens,
              seq_starts: torch.Tensor | None = None, *,
              validate: bool | None = None) -> torch.Tensor:
    """Dequantizing gather with the semantics of vLLM's ``gather_and_maybe_dequant_cache``.

    For ``t < num_tokens``: ``b = token_to_seq[t]``,
    ``pos = seq_starts[b] + (t - cu_seq_lens[b])`` (``seq_starts`` defaults to 0; neither term
    negative, as vLLM builds them), and ``dst[t] = [kv_c ; k_pe]`` of the token at ``pos`` of
    request ``b``, found through ``block_table[b, pos // 64]`` (1 to (2^31 - 1) / 64 columns).
    ``num_tokens`` is an int or a one-element integer tensor; ``dst`` is
    ``[>=num_tokens, 576]`` (float, rows not overlapping).  A token whose request, position or
    block falls outside the inputs raises ``ValueError`` when the data checks run, and gets a
    NaN row otherwise.
    """
    _checks.cache(kv_cache)
    _checks.float_rows("dst", dst, fmt.HEAD_SIZE, dims=2)
    _checks.separate_rows("dst", dst)
    _checks.index_tensor("block_table", block_table, dims=2)
    _checks.index_tensor("cu_seq_lens", cu_seq_lens, dims=1)
    _checks.index_tensor("token_to_seq", token_to_seq, dims=1)
    if seq_starts is not None:
        _checks.index_tensor("seq_starts", seq_starts, dims=1)
    _checks.same_device(kv_cache.device, dst=dst, block_table=block_table,
                        cu_seq_lens=cu_seq_lens, token_to_seq=token_to_seq, seq_starts=seq_starts)
    n = _checks.count("num_tokens", num_tokens)
    _checks.gather_table(block_table)
    if n < 0 or dst.shape[0] < n or token_to_seq.numel() < n:
        raise ValueError(f"num_tokens={n} must be >= 0 and within dst ({dst.shape[0]} rows) and "
                         f"token_to_seq ({token_to_seq.numel()} entries)")
    if _checks.data_checks_on(validate, kv_cache):
        _checks.gather_indices(block_table, cu_seq_lens, token_to_seq, n, seq_starts,
                               kv_cache.shape[0])
    if kv_cache.is_cuda:
        _require_native("gather_kv").gather_kv(kv_cache, dst, block_table, cu_seq_lens,
                                               token_to_seq, n, seq_starts)
        return dst
    return reference.gather_kv(kv_cache, dst, block_table, cu_seq_lens, token_to_seq, n,
                               seq_starts)


def quantize_q(q_nope: torch.Tensor, q_pe: torch.Tensor):
    """Per (token, head) query quantization: ``(q8 e4m3[...,512], q_scale f32[...],
    q_pe/q_scale bf16[...,64])``.

    ``q_nope [..., 512]`` and ``q_pe [..., 64]``: float, same leading shape (no broadcasting),
    same device.  NaN or Inf in a row gives a row that decode turns into NaN output.
    """
    _checks.float_rows("q_nope", q_nope, fmt.KV_LORA_RANK)
    _checks.float_rows("q_pe", q_pe, fmt.ROPE_DIM)
    _checks.same_leading("q_nope", q_nope, "q_pe", q_pe)
    _checks.same_dtype("q_nope", q_nope, "q_pe", q_pe)
    _checks.same_device(q_nope.device, q_pe=q_pe)
    if q_nope.is_cuda:
        lead = tuple(q_nope.shape[:-1])   # () for one row
        q8 = torch.empty((*lead, fmt.KV_LORA_RANK), dtype=torch.float8_e4m3fn,
                         device=q_nope.device)
        scale = torch.empty(lead, dtype=torch.float32, device=q_nope.device)
        qpe = torch.empty((*lead, fmt.ROPE_DIM), dtype=torch.bfloat16, device=q_nope.device)
        _require_native("quantize_q").quantize_q(q_nope, q_pe, q8, scale, qpe)
        return q8, scale, qpe
    return reference.quantize_q(q_nope, q_pe)


DECODE_KERNELS = ("auto", "sm90", "triton")


@functools.cache
def _sm90_available(device: torch.device) -> bool:
    return sm90.available(device)


def _use_sm90(device: torch.device) -> bool:
    """``SNAPMLA_DECODE_KERNEL`` (read on every call, see the module docstring) on ``device``."""
    choice = os.environ.get("SNAPMLA_DECODE_KERNEL", "auto")
    if choice == "auto":
        return _sm90_available(device)
    if choice == "triton":
        return False
    if choice == "sm90":
        if not _sm90_available(device):
            raise RuntimeError(
                "SNAPMLA_DECODE_KERNEL=sm90 needs an sm_90 GPU and an extension built with "
                "SNAPMLA_ARCHS containing 90a; unset it to fall back to the Triton kernel")
        return True
    raise ValueError(f"SNAPMLA_DECODE_KERNEL={choice!r}; expected one of {DECODE_KERNELS}")


def decode_kernel(device: torch.device | str | int) -> str:
    """Which kernel ``decode`` runs for CUDA tensors on ``device``: ``"sm90"`` (the Hopper
    kernels) or ``"triton"`` (the portable kernel), as ``SNAPMLA_DECODE_KERNEL`` and the build
    decide (module docstring).  Tensors on the CPU run the reference (``vllm_snapmla.reference``)
    and have no kernel: a CPU device is refused."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"decode_kernel names the kernel of a CUDA device, got {device} (decode "
                         "runs the PyTorch reference there)")
    return "sm90" if _use_sm90(device) else "triton"


def _check_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale,
                  validate: bool | None, plan=None) -> float:
    """The whole contract of ``decode``; returns the scale as a float."""
    if plan is not None:
        _checks.split_plan("plan", plan)
    _checks.float_rows("q_nope", q_nope, fmt.KV_LORA_RANK, dims=4)
    _checks.float_rows("q_pe", q_pe, fmt.ROPE_DIM, dims=4)
    _checks.same_leading("q_nope", q_nope, "q_pe", q_pe)
    _checks.same_dtype("q_nope", q_nope, "q_pe", q_pe)
    _checks.cache(kv_cache)
    _checks.index_tensor("block_table", block_table, dims=2)
    _checks.unit_column_stride("block_table", block_table)
    _checks.index_tensor("seq_lens", seq_lens, dims=1)
    _checks.same_device(q_nope.device, q_pe=q_pe, kv_cache=kv_cache, block_table=block_table,
                        seq_lens=seq_lens, plan=plan)
    B = q_nope.shape[0]
    if block_table.shape[0] < B or block_table.shape[1] < 1 or seq_lens.numel() < B:
        raise ValueError(f"block_table [{', '.join(map(str, block_table.shape))}] and seq_lens "
                         f"[{seq_lens.numel()}] must have at least batch = {B} rows (and the "
                         "table at least one column)")
    if kv_cache.shape[0] == 0:   # the Hopper kernels' tensor maps need a block
        raise ValueError("kv_cache must have at least one block, got uint8[0, "
                         f"{fmt.PAGE_SIZE}, {fmt.BYTES_PER_TOKEN}]")
    scale = _checks.softmax_scale(softmax_scale)
    if _checks.data_checks_on(validate, seq_lens):
        _checks.decode_indices(block_table, seq_lens, B, kv_cache.shape[0])
    return scale


def plan_decode(seq_lens: torch.Tensor, block_table: torch.Tensor, num_heads: int, s_q: int = 1,
                *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The split plan of a ``decode`` of ``B = seq_lens.shape[0]`` requests of ``s_q`` query
    tokens x ``num_heads`` heads over ``block_table[>=B, max_blocks]``, for the layers of one
    step to share (``decode(..., plan=)``): each call then skips its own planner.  vLLM's
    metadata builder makes one per step.

    ``seq_lens`` holds exactly the batch's requests (a persistent buffer of more rows would plan
    for more requests: correct, but the cut of another launch).  Returns ``out`` (int32 ``[1]``;
    a new one, zeroed, on ``seq_lens``' device when None).  With the Hopper kernels the plan is
    written on the GPU from the lengths, on the current stream, without a host sync, so a CUDA
    graph may read ``out`` as a persistent buffer that each step rewrites.  Elsewhere (CPU, the
    Triton kernel), and where the launch has a single split, nothing is written: those decodes
    read no plan.  Any plan gives exact results (one made for other lengths or shapes only
    costs speed) as long as it is not rewritten while a decode that reads it runs: write it on
    the decodes' stream.
    """
    _checks.index_tensor("seq_lens", seq_lens, dims=1)
    _checks.index_tensor("block_table", block_table, dims=2)
    _checks.unit_column_stride("block_table", block_table)
    heads = _checks.count("num_heads", num_heads)
    s_q = _checks.count("s_q", s_q)
    if heads < 1 or s_q < 1:
        raise ValueError(f"num_heads and s_q must be at least 1, got {heads} and {s_q}")
    B = seq_lens.shape[0]
    if block_table.shape[0] < B or block_table.shape[1] < 1:
        raise ValueError(f"block_table [{', '.join(map(str, block_table.shape))}] must have at "
                         f"least batch = {B} rows and one column")
    if out is None:
        out = torch.zeros(1, dtype=torch.int32, device=seq_lens.device)
    _checks.split_plan("out", out)
    _checks.same_device(seq_lens.device, block_table=block_table, out=out)
    _checks.not_aliased("out", out, seq_lens=seq_lens, block_table=block_table)
    if seq_lens.is_cuda and _use_sm90(seq_lens.device):
        sm90.plan_decode_sm90(seq_lens, block_table, B, s_q, heads, out)
    return out


def decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
           block_table: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
           causal: bool = True, *, plan: torch.Tensor | None = None,
           validate: bool | None = None):
    """SnapMLA decode attention over the paged ``fp8_snapmla`` cache.

    ``q_nope[B,s_q,H,512]``, ``q_pe[B,s_q,H,64]`` (float, the same ``[B,s_q,H]``);
    ``kv_cache`` uint8 ``[num_blocks,64,656]``; ``block_table[>=B,max_blocks]`` and
    ``seq_lens[>=B]`` integer tensors (their first ``B`` rows are read); ``num_blocks >= 1``;
    ``softmax_scale`` positive, with ``softmax_scale * log2(e)`` a normal float32 (the kernels'
    logit scale).  ``seq_lens`` counts every cached token of a request, its ``s_q`` new
    ones included, and lies in ``[0, max_blocks*64]``; the block ids of the pages a request
    reads lie in ``[0, num_blocks)``.  With ``causal``, query ``i`` sees positions
    ``< seq_len - s_q + i + 1``.  Returns ``out[B,s_q,H,512]`` (bfloat16) and ``lse[B,H,s_q]``
    (float32, natural log); rows that see no token give zeros and LSE -inf.

    Non-finite values propagate as in exact attention: NaN or Inf in a query row, or in a cache
    row the request attends to, gives NaN in the outputs that depend on it.  Bytes of unused
    slots (past a request's length) are never read.  Lengths and block ids are checked when the
    data checks run (CPU tensors, ``validate=True``, ``SNAPMLA_VALIDATE=1``); otherwise nothing
    outside the cache is read: a request whose length its table row cannot hold comes out NaN,
    and a live block id outside the cache makes NaN (output and LSE) every row that attends to
    its page.  The request's other rows (causal ``s_q > 1``: its last page may lie past what its
    first queries see) keep their LSE; their output is exact or NaN.

    On CUDA the launch shape depends only on the shapes (never on the lengths' values), so a
    call can be captured in a CUDA graph and replayed for other lengths; the split count is
    chosen on the GPU from the real lengths (``vllm_snapmla.kernels.splits``), by the call
    itself or, given ``plan`` (``plan_decode``'s, int32 ``[1]`` on the same device), once for
    all the calls that share it.
    """
    _checks.flag("causal", causal)
    if (isinstance(q_nope, torch.Tensor) and q_nope.is_cuda and not validate
            and _use_sm90(q_nope.device) and not _checks.data_checks_on(validate, q_nope)):
        # vLLM's path: one op call, whose C++ layer checks shapes, dtypes and devices.  On an
        # error, the Python contract names the argument where it can.  The scale is checked
        # here: the op's float argument would take a bool or a tensor (read on the host).
        scale = _checks.softmax_scale(softmax_scale)
        try:
            return sm90.decode_sm90(q_nope, q_pe, kv_cache, block_table, seq_lens, scale,
                                    causal, plan=plan)
        except (RuntimeError, TypeError, ValueError):
            _check_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, False,
                          plan)
            raise
    scale = _check_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, validate,
                          plan)
    if q_nope.is_cuda:
        if _use_sm90(q_nope.device):
            return sm90.decode_sm90(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, causal,
                                    plan=plan)
        # Triton launches on the current device; the native ops guard their own.
        with torch.cuda.device(q_nope.device):
            q8, q_scale, qpe = quantize_q(q_nope, q_pe)
            return triton_decode.snapmla_decode(q8, q_scale, qpe, kv_cache, block_table,
                                                seq_lens, scale, causal)
    out, lse = reference.decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, causal)
    return out.to(torch.bfloat16), lse.float()
