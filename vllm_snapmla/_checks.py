"""The argument contract of ``vllm_snapmla.ops``: shape, dtype and device checks, and the checks
that read the data (lengths, block ids, slots).

Shape, dtype and device checks are free (no GPU work) and always run.  The data checks read
index tensors, which on a GPU means a host sync: they run on CPU tensors, and on CUDA tensors
only when asked (``validate=True``, or ``SNAPMLA_VALIDATE=1`` in the environment).  Without them
the CUDA kernels still never read outside the cache: a request whose length its table row cannot
hold comes out NaN, so do the rows that attend to a live page naming a block outside the cache
(``ops.decode``), and ``append_kv`` skips slots outside the cache.  Every violation raises
``TypeError`` (a wrong kind of argument) or ``ValueError`` (a wrong shape or value) naming the
argument, what was expected and what came.
"""

from __future__ import annotations

import math
import numbers
import os

import torch

from vllm_snapmla import format as fmt
from vllm_snapmla import reference

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
# gather_kv's positions are int32 on CUDA; a table at most this wide keeps them there, so that an
# index narrowed to its out-of-range value (csrc/api/checks.h) always lands past the table.
MAX_GATHER_PAGES = (2**31 - 1) // fmt.PAGE_SIZE


def data_checks_on(validate: bool | None, *tensors: torch.Tensor) -> bool:
    """Whether the data checks run: ``validate`` if given, else on CPU tensors or with
    ``SNAPMLA_VALIDATE=1``.  They read the data on the host, which a CUDA graph being captured
    cannot do: ``SNAPMLA_VALIDATE=1`` skips them during capture (graph replays are not checked;
    ``enforce_eager`` checks every step), ``validate=True`` refuses."""
    optional_flag("validate", validate)
    on_gpu = any(t.is_cuda for t in tensors)
    if validate is None:
        flag = os.environ.get("SNAPMLA_VALIDATE", "0")
        if flag in ("", "0"):
            return all(t.is_cpu for t in tensors)   # the data can be read on the host
        if flag != "1":   # "false" or "off" must not silently turn the checks on
            raise ValueError(f"SNAPMLA_VALIDATE={flag!r}; expected 1 (on) or 0 (off)")
        return not (on_gpu and torch.cuda.is_current_stream_capturing())
    if validate and on_gpu and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("validate=True reads the indices on the host, which cannot happen "
                           "inside CUDA-graph capture; validate before capturing")
    return bool(validate)


def _shape(t: torch.Tensor) -> str:
    return f"{t.dtype}{list(t.shape)}".replace("torch.", "")


def tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")


def float_rows(name: str, t, width: int, dims: int | None = None) -> torch.Tensor:
    """A float tensor ``[..., width]`` (``dims`` dimensions when given)."""
    tensor(name, t)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")
    if (dims is not None and t.dim() != dims) or t.dim() == 0 or t.shape[-1] != width:
        want = f"[{', '.join(['...'] if dims is None else ['?'] * (dims - 1))}, {width}]"
        raise ValueError(f"{name} must be {want}, got {_shape(t)}")
    return t


def token_rows(name: str, t, width: int) -> torch.Tensor:
    """``[T, width]``, or ``[T, 1, width]`` (vLLM's k_pe), viewed as ``[T, width]``."""
    float_rows(name, t, width)
    if t.dim() == 3 and t.shape[1] == 1:
        return t.reshape(t.shape[0], width)
    if t.dim() != 2:
        raise ValueError(f"{name} must be [tokens, {width}] (or [tokens, 1, {width}]), "
                         f"got {_shape(t)}")
    return t


def same_leading(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    """Exactly the same leading shape: no broadcasting."""
    if a.shape[:-1] != b.shape[:-1]:
        raise ValueError(f"{b_name} must have the leading shape of {a_name} "
                         f"{list(a.shape[:-1])} (no broadcasting), got {_shape(b)}")


def same_dtype(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    """The native ops read both halves of a query in one dtype."""
    if a.dtype != b.dtype:
        raise TypeError(f"{b_name} must have the dtype of {a_name} ({a.dtype}), got {b.dtype}")


def index_tensor(name: str, t, dims: int | None = None) -> torch.Tensor:
    tensor(name, t)
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimension(s), got {_shape(t)}")
    return t


def gather_table(table: torch.Tensor) -> None:
    """A gather's table: at least one column, and positions that fit int32 (MAX_GATHER_PAGES)."""
    if not 1 <= table.shape[1] <= MAX_GATHER_PAGES:
        raise ValueError(f"block_table must have 1 to {MAX_GATHER_PAGES} columns (positions are "
                         f"int32 on CUDA), got {_shape(table)}")


def split_plan(name: str, t) -> torch.Tensor:
    """A decode split plan (``ops.plan_decode``): int32 ``[1]``."""
    tensor(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (ops.plan_decode's), got {t.dtype}")
    if tuple(t.shape) != (1,):
        raise ValueError(f"{name} must have shape [1] (ops.plan_decode's), got {_shape(t)}")
    return t


def not_aliased(name: str, out: torch.Tensor, **inputs: torch.Tensor) -> None:
    """An output that shares no storage with an input (a plan written into ``seq_lens`` would
    change the lengths that later calls read)."""
    out_bytes = _byte_range(out)
    for other, t in inputs.items():
        in_bytes = _byte_range(t)
        if out_bytes and in_bytes and out_bytes[0] < in_bytes[1] and in_bytes[0] < out_bytes[1]:
            raise ValueError(f"{name} shares its memory with {other}; pass a tensor of its own")


def _byte_range(t: torch.Tensor) -> tuple[int, int] | None:
    """``[first, last + 1)`` byte addresses a tensor's elements span; None without memory."""
    if t.numel() == 0 or t.device.type == "meta":
        return None
    start = t.data_ptr()
    span = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return start, start + (span + 1) * t.element_size()


def unit_column_stride(name: str, t: torch.Tensor) -> None:
    """The kernels read a row's elements (a table row's ids, a dst row) as consecutive."""
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have unit column stride (each row's elements "
                         f"consecutive), got strides {tuple(t.stride())}")


def cache(kv_cache) -> torch.Tensor:
    tensor("kv_cache", kv_cache)
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 3 or tuple(kv_cache.shape[1:]) != (
            fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN):
        raise ValueError(f"kv_cache must be uint8[num_blocks, {fmt.PAGE_SIZE}, "
                         f"{fmt.BYTES_PER_TOKEN}], got {_shape(kv_cache)}")
    # Rows packed in a block, as the kernels address them (csrc/api/checks.h check_cache): an
    # expanded or strided view would make tokens share bytes.
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != fmt.BYTES_PER_TOKEN:
        raise ValueError(f"kv_cache must have its {fmt.PAGE_SIZE} rows of "
                         f"{fmt.BYTES_PER_TOKEN} bytes packed in each block (strides "
                         f"(*, {fmt.BYTES_PER_TOKEN}, 1)), got strides {tuple(kv_cache.stride())}")
    block_bytes = fmt.PAGE_SIZE * fmt.BYTES_PER_TOKEN
    if kv_cache.shape[0] > 1 and kv_cache.stride(0) < block_bytes:
        raise ValueError(f"kv_cache blocks overlap: block stride {kv_cache.stride(0)} bytes, "
                         f"a block is {block_bytes}")
    return kv_cache


def separate_rows(name: str, t: torch.Tensor) -> None:
    """Rows of unit column stride that do not overlap (an expanded tensor would have every
    token write one row), as the CUDA kernels write them."""
    unit_column_stride(name, t)
    if t.shape[0] > 1 and abs(t.stride(0)) < t.shape[1]:
        raise ValueError(f"{name} rows overlap (strides {tuple(t.stride())}); pass a tensor "
                         "whose rows are separate")


def softmax_scale(value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:   # an int past float's range
        raise ValueError("softmax_scale must be positive and finite, got an int past float's "
                         "range") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"softmax_scale must be positive and finite, got {value}")
    # The kernels scale logits by softmax_scale * log2(e) in float32: it must not overflow to
    # Inf (NaN outputs) or flush to 0 (uniform attention).
    f32 = torch.finfo(torch.float32)
    if not f32.tiny <= value * math.log2(math.e) <= f32.max:
        raise ValueError(f"softmax_scale = {value}: softmax_scale * log2(e) must be a normal "
                         f"float32 ([{f32.tiny:.3g}, {f32.max:.3g}]), the kernels' logit scale")
    return value


def flag(name: str, value) -> bool:
    """A bool: a string such as "False" would be truthy."""
    if not isinstance(value, bool):
        kind = type(value)
        where = "" if kind.__module__ == "builtins" else f"{kind.__module__}."
        raise TypeError(f"{name} must be a bool, got {where}{kind.__name__}")
    return value


def optional_flag(name: str, value) -> bool | None:
    """``validate``: a bool, or None for the default."""
    return None if value is None else flag(name, value)


def float_dtype(name: str, dtype) -> torch.dtype:
    """An output dtype that holds dequantized values as they are (FP8 would not saturate)."""
    if dtype not in (*FLOAT_DTYPES, torch.float64):
        raise TypeError(f"{name} must be torch.bfloat16, float16, float32 or float64, got {dtype}")
    return dtype


def count(name: str, value) -> int:
    """An integer count: an int, or a one-element integer tensor (vLLM passes the chunked
    context's token count as one).  A bool or a float would silently truncate."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.dtype in INDEX_DTYPES + (torch.int16, torch.int8,
                                                                 torch.uint8):
            return int(value)
        raise TypeError(f"{name} must be an int or a one-element integer tensor, got "
                        f"{_shape(value)}")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


# --- data checks (read the values) ---------------------------------------------------------


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def decode_indices(block_table: torch.Tensor, seq_lens: torch.Tensor, batch: int,
                   num_blocks: int) -> None:
    """Lengths in ``[0, table_pages * 64]``; the block ids of every page a request reads in
    ``[0, num_blocks)``."""
    lens = seq_lens[:batch].long().cpu()
    table = block_table[:batch].long().cpu()
    width = table.shape[1]
    limit = width * fmt.PAGE_SIZE
    bad = ~reference.valid_lengths(lens, width)
    if bad.any():
        b = _first(bad)
        raise ValueError(f"seq_lens[{b}] = {int(lens[b])} is outside [0, {limit}]: block_table "
                         f"has {width} columns of {fmt.PAGE_SIZE} tokens")
    pages = (lens + fmt.PAGE_SIZE - 1) // fmt.PAGE_SIZE
    used = torch.arange(width)[None, :] < pages[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bad.any():
        b, k = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"block_table[{b}, {k}] = {int(table[b, k])} is not a block of the cache "
                         f"([0, {num_blocks})), but request {b} reads page {k} "
                         f"(seq_lens[{b}] = {int(lens[b])})")


def slots(slot_mapping: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Slots below ``num_blocks * 64`` (negative slots are skipped by design), each written once.
    Returns which entries are written (the non-negative ones), on the CPU."""
    flat = slot_mapping.flatten().long().cpu()
    limit = num_blocks * fmt.PAGE_SIZE
    bad = flat >= limit
    if bad.any():
        t = _first(bad)
        raise ValueError(f"slot_mapping[{t}] = {int(flat[t])} is outside the cache's {limit} slots "
                         f"({num_blocks} blocks x {fmt.PAGE_SIZE}); use a negative slot to skip "
                         "a token")
    written = flat >= 0
    values, counts = torch.unique(flat[written], return_counts=True)
    if (counts > 1).any():
        slot = int(values[_first(counts > 1)])
        first, second = (int(i) for i in (flat == slot).nonzero()[:2, 0])
        raise ValueError(f"slot_mapping[{first}] and slot_mapping[{second}] are both slot {slot}: "
                         "two tokens written to one cache row")
    return written


def finite_rows(name: str, t: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """No NaN or Inf in the rows of ``t`` (those where ``rows`` is true, when given)."""
    bad = ~torch.isfinite(t).all(-1).cpu()        # t is [rows, width]
    if rows is not None:
        bad &= rows
    if bad.any():
        r = _first(bad)
        raise ValueError(f"{name} row {r} holds a NaN or Inf; its cache row would read back as "
                         "NaN (pass validate=False to store it so)")


def gather_indices(block_table: torch.Tensor, cu_seq_lens: torch.Tensor,
                   token_to_seq: torch.Tensor, num_tokens: int,
                   seq_starts: torch.Tensor | None, num_blocks: int) -> None:
    """Every token names a request with a table row, a position inside it and a cache block."""
    for name, values in (("cu_seq_lens", cu_seq_lens), ("seq_starts", seq_starts)):
        if values is None:
            continue
        flat = values.long().cpu()
        bad = ~reference.fits_int32(flat)
        if bad.any():
            i = _first(bad)
            raise ValueError(f"{name}[{i}] = {int(flat[i])} does not fit int32 (the CUDA kernels "
                             "read int32 indices)")
    src = reference.gather_sources(block_table, cu_seq_lens, token_to_seq, num_tokens,
                                   seq_starts, num_blocks)
    if not src.seq_ok.all():
        t = _first(~src.seq_ok)
        raise ValueError(f"token_to_seq[{t}] = {int(src.seq[t])} names no request: block_table, "
                         f"cu_seq_lens and seq_starts describe {src.num_seqs}")
    for bad, what in ((src.offset < 0, "comes before its request's first token"),
                      (src.start < 0, "has a negative seq_starts")):
        if bad.any():
            t = _first(bad)
            b = int(src.seq[t])
            start = f", seq_starts[{b}] = {int(seq_starts[b])}" if seq_starts is not None else ""
            raise ValueError(f"token {t} of request {b} {what} (cu_seq_lens[{b}] = "
                             f"{int(cu_seq_lens[b])}{start})")
    if not src.pos_ok.all():
        t = _first(~src.pos_ok)
        limit = block_table.shape[1] * fmt.PAGE_SIZE
        raise ValueError(f"token {t} of request {int(src.seq[t])} is at position "
                         f"{int(src.pos[t])}, outside its block_table row ([0, {limit}))")
    if not src.block_ok.all():
        t = _first(~src.block_ok)
        b, page = int(src.seq[t]), int(src.pos[t]) // fmt.PAGE_SIZE
        raise ValueError(f"token {t} reads block_table[{b}, {page}] = "
                         f"{int(block_table[b, page])}, not a block of the cache "
                         f"([0, {num_blocks}))")
