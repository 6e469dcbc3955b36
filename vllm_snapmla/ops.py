"""Public operations on the ``fp8_snapmla`` cache (layout: ``vllm_snapmla.format``).

Every function takes CPU or CUDA tensors.  CPU tensors run the exact PyTorch reference
(``vllm_snapmla.reference``); CUDA tensors run our kernels: the native extension
(``vllm_snapmla._C``, ``csrc/``) for the data path, and for decode the sm_90a kernels on Hopper
(``vllm_snapmla.kernels.sm90``, one op call) or the portable Triton split-KV kernel elsewhere
(``vllm_snapmla.kernels.triton_decode``).  All give the same results within the tolerances the
tests state.

``SNAPMLA_DECODE_KERNEL`` picks the decode kernel: ``auto`` (default: sm90 where it is built and
the GPU is sm_90, Triton otherwise), ``sm90`` (always; refuse to run without it) or ``triton``.
"""

from __future__ import annotations

import functools
import os

import torch

from vllm_snapmla import format as fmt
from vllm_snapmla import reference
from vllm_snapmla._native import require_native
from vllm_snapmla.kernels import sm90, triton_decode


def _require_native(what: str):
    return require_native(f"vllm_snapmla.ops.{what}")


def _check_rows(name: str, t: torch.Tensor, width: int) -> None:
    if t.shape[-1] != width:
        raise ValueError(f"{name} must have last dimension {width}, got shape {tuple(t.shape)}")
    if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 3 or kv_cache.shape[1:] != (
            fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN):
        raise ValueError(
            f"kv_cache must be uint8[num_blocks, {fmt.PAGE_SIZE}, {fmt.BYTES_PER_TOKEN}], "
            f"got {kv_cache.dtype}{list(kv_cache.shape)}")


def quantize_kv(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """Quantize ``kv_c[T,512]`` and ``k_pe[T,64]`` into ``uint8[T,656]`` rows."""
    _check_rows("kv_c", kv_c, fmt.KV_LORA_RANK)
    k_pe = k_pe.reshape(k_pe.shape[0], -1) if k_pe.dim() == 3 else k_pe
    _check_rows("k_pe", k_pe, fmt.ROPE_DIM)
    if kv_c.shape[0] != k_pe.shape[0]:
        raise ValueError(f"kv_c has {kv_c.shape[0]} rows but k_pe has {k_pe.shape[0]}")
    if kv_c.is_cuda:
        out = torch.empty(kv_c.shape[0], fmt.BYTES_PER_TOKEN, dtype=torch.uint8, device=kv_c.device)
        _require_native("quantize_kv").quantize_kv(kv_c, k_pe, out)
        return out
    return reference.quantize_kv(kv_c, k_pe)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype = torch.float32):
    """Inverse of ``quantize_kv``: ``uint8[...,656] -> (kv_c[...,512], k_pe[...,64])`` in ``dtype``."""
    if rows.dtype != torch.uint8 or rows.shape[-1] != fmt.BYTES_PER_TOKEN:
        raise ValueError(f"rows must be uint8[..., {fmt.BYTES_PER_TOKEN}], got "
                         f"{rows.dtype}{list(rows.shape)}")
    return reference.dequantize_kv(rows, dtype)


def append_kv(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """Quantize and write token ``t`` to slot ``slot_mapping[t]`` for ``t < len(slot_mapping)``.

    Negative slots (vLLM's padding) are skipped; ``kv_c`` may have more rows than
    ``slot_mapping`` (CUDA-graph padding), and those rows are ignored.
    """
    _check_cache(kv_cache)
    _check_rows("kv_c", kv_c, fmt.KV_LORA_RANK)
    k_pe = k_pe.reshape(k_pe.shape[0], -1) if k_pe.dim() == 3 else k_pe
    _check_rows("k_pe", k_pe, fmt.ROPE_DIM)
    n = slot_mapping.numel()
    if kv_c.shape[0] < n or k_pe.shape[0] < n:
        raise ValueError(f"slot_mapping has {n} entries but kv_c/k_pe have "
                         f"{kv_c.shape[0]}/{k_pe.shape[0]} rows")
    if kv_cache.is_cuda:
        _require_native("append_kv").append_kv(kv_c, k_pe, kv_cache, slot_mapping.flatten())
        return
    reference.append_kv(kv_c, k_pe, kv_cache, slot_mapping)


def gather_kv(kv_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
              cu_seq_lens: torch.Tensor, token_to_seq: torch.Tensor, num_tokens,
              seq_starts: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantizing gather with the semantics of vLLM's ``gather_and_maybe_dequant_cache``.

    For ``t < num_tokens``: ``b = token_to_seq[t]``, ``pos = seq_starts[b] + t - cu_seq_lens[b]``
    (``seq_starts`` defaults to 0), and ``dst[t] = [kv_c ; k_pe]`` of the token at ``pos`` of
    request ``b``, found through ``block_table[b, pos // 64]``.  ``dst`` is ``[>=num_tokens, 576]``.
    """
    _check_cache(kv_cache)
    if dst.shape[-1] != fmt.HEAD_SIZE or dst.dim() != 2:
        raise ValueError(f"dst must be [tokens, {fmt.HEAD_SIZE}], got {list(dst.shape)}")
    n = int(num_tokens)
    if dst.shape[0] < n or token_to_seq.numel() < n:
        raise ValueError(f"num_tokens={n} exceeds dst ({dst.shape[0]}) or token_to_seq "
                         f"({token_to_seq.numel()}) rows")
    if kv_cache.is_cuda:
        _require_native("gather_kv").gather_kv(kv_cache, dst, block_table, cu_seq_lens,
                                               token_to_seq, n, seq_starts)
        return dst
    return reference.gather_kv(kv_cache, dst, block_table, cu_seq_lens, token_to_seq, n,
                               seq_starts)


def quantize_q(q_nope: torch.Tensor, q_pe: torch.Tensor):
    """Per (token, head) query quantization: ``(q8 e4m3[...,512], q_scale f32[...], q_pe/q_scale bf16[...,64])``."""
    _check_rows("q_nope", q_nope, fmt.KV_LORA_RANK)
    _check_rows("q_pe", q_pe, fmt.ROPE_DIM)
    if q_nope.shape[:-1] != q_pe.shape[:-1]:
        raise ValueError(f"q_nope {list(q_nope.shape)} and q_pe {list(q_pe.shape)} disagree")
    if q_nope.is_cuda:
        lead = q_nope.shape[:-1]
        q8 = torch.empty(*lead, fmt.KV_LORA_RANK, dtype=torch.float8_e4m3fn, device=q_nope.device)
        scale = torch.empty(*lead, dtype=torch.float32, device=q_nope.device)
        qpe = torch.empty(*lead, fmt.ROPE_DIM, dtype=torch.bfloat16, device=q_nope.device)
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


def decode_kernel(device: torch.device):
    """The CUDA decode kernel that takes a quantized query (``quantize_q``'s outputs) on
    ``device``: ``sm90.snapmla_decode_sm90`` or ``triton_decode.snapmla_decode``."""
    return sm90.snapmla_decode_sm90 if _use_sm90(device) else triton_decode.snapmla_decode


def decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
           block_table: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
           causal: bool = True):
    """SnapMLA decode attention over the paged ``fp8_snapmla`` cache.

    ``q_nope[B,s_q,H,512]``, ``q_pe[B,s_q,H,64]``; ``block_table[B,max_blocks]`` int32;
    ``seq_lens[B]`` counts every cached token of a request, its ``s_q`` new ones included.
    With ``causal``, query ``i`` sees positions ``< seq_len - s_q + i + 1``.
    Returns ``out[B,s_q,H,512]`` (bfloat16) and ``lse[B,H,s_q]`` (float32, natural log).

    On CUDA the launch shape depends only on the shapes (never on the lengths' values), so a
    call can be captured in a CUDA graph and replayed for other lengths; the split count is
    chosen on the GPU from the real lengths (``vllm_snapmla.kernels.splits``).
    """
    if q_nope.is_cuda and _use_sm90(q_nope.device):
        # One op call: every check, the query quantization, the decode and the combine in C++.
        return sm90.decode_sm90(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale,
                                causal)
    _check_cache(kv_cache)
    if q_nope.dim() != 4 or q_pe.dim() != 4:
        raise ValueError(f"q_nope and q_pe must be [B, s_q, H, D], got {list(q_nope.shape)} "
                         f"and {list(q_pe.shape)}")
    _check_rows("q_nope", q_nope, fmt.KV_LORA_RANK)
    _check_rows("q_pe", q_pe, fmt.ROPE_DIM)
    B = q_nope.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] < B or seq_lens.numel() < B:
        raise ValueError(f"block_table {list(block_table.shape)} / seq_lens "
                         f"{list(seq_lens.shape)} do not cover batch {B}")
    if q_nope.is_cuda:
        q8, q_scale, qpe = quantize_q(q_nope, q_pe)
        return triton_decode.snapmla_decode(q8, q_scale, qpe, kv_cache, block_table, seq_lens,
                                            softmax_scale, causal)
    out, lse = reference.decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale,
                                causal)
    return out.to(torch.bfloat16), lse.float()
