"""Decode attention, one layer: SnapMLA kernels vs vLLM 0.26.0's bundled FlashMLA and
FlashAttention-3 MLA, in one process.

    python -m benchmarks.bench_decode --out out/bench_decode [--quick] [--shapes 64x16x1024 ...]
        [--table-width 2560] [--ragged] [--backends snapmla,flashmla-bf16,fa3-mla-bf16,...]
        [--kernels]
    python -m benchmarks.bench_decode --replot out/bench_decode/decode.csv --out DIR   # no GPU

Backends, on the same random data and shapes (default: ``SHAPES``, the shapes FlashMLA's own
H200/H800 decode figures are published for; ``--shapes BxHxN[xS_Q]`` instead):

* ``flashmla-bf16``: FlashMLA over a bf16 cache (``--attention-backend FLASHMLA``), the
  reference the kernel ratios are quoted against;
* ``fa3-mla-bf16``: FlashAttention-3's MLA decode over a bf16 cache in 16-token pages
  (``FLASH_ATTN_MLA``, what vLLM 0.26.0 picks on Hopper for a BF16 cache unless told
  otherwise), called as vLLM calls it: the scheduling metadata from the real lengths
  (``get_scheduler_metadata``), at most ``FA3_GRAPH_SPLITS`` splits as under FULL CUDA graphs,
  or with ``--eager`` FlashAttention's own split count as in eager steps.  Its block
  table holds 4 columns per 64-token page (``--table-width 2560`` is 10240 columns there, as
  in vLLM);
* ``flashmla-fp8``: FlashMLA's dense FP8 path (``--kv-cache-dtype fp8``): q and the 576-wide row
  in e4m3 with per-tensor scale 1.0; its q cast is not timed;
* ``snapmla``: ``vllm_snapmla.ops.decode`` from the BF16 query, exactly what vLLM's backend calls
  per layer (query quantization, kernel choice, splits and combine included), with the step's
  split plan (``ops.plan_decode``, which vLLM's metadata builder makes once per step for all
  layers) made before;
* every other entry of ``SNAPMLA_KERNELS``: one kernel from the quantized query over the
  ``fp8_snapmla`` cache; the timed call includes the query quantization (``ops.quantize_q``) and
  the split combine.

What users meet, as options: ``--table-width W`` gives the block table W columns (vLLM's is
max_model_len / 64 wide: 2560 for DeepSeek-V3.1), the entries past a request's pages 0 as vLLM
pads them; ``--ragged`` draws each request's length in [N/8, N] (seeded) instead of N.

Times per backend and shape, in µs:

* ``us``: ``triton.testing.do_bench`` median of a CUDA-graph replay of one call (as vLLM's FULL
  graphs run decode; ``--eager`` times the Python call instead).  do_bench overwrites a 256 MB
  buffer before every timed call, so each call reads its cache from HBM;
* ``host_us``: the CPU time of one eager call, the mean over many calls of ``time.perf_counter()``
  around the call, with the GPU idle before each (synchronized before, not inside): what a step
  that runs attention eagerly (``enforce_eager``, or a batch mixing prefill and decode) pays per
  layer on the CPU;
* ``eager_us``: CUDA events around many back-to-back eager calls, divided by their number: the
  per-layer time of eager decode, the larger of the launch-bound host time and the GPU time (no
  buffer is rewritten between calls, so small caches stay in L2);
* for ``snapmla``, FlashMLA and FlashAttention, ``metadata_host_us``, ``metadata_eager_us`` and
  ``metadata_us``: the same three for the scheduling metadata, which vLLM computes once per step
  for all layers (ours: ``ops.plan_decode``; BF16 FlashMLA: ``get_mla_metadata``, whose schedule
  the first ``flash_mla_with_kvcache`` call computes; FP8: ``get_mla_metadata_dense_fp8``;
  FlashAttention: ``get_scheduler_metadata``), each the time of (fresh metadata + call) minus
  that of the call with metadata computed before, which ``us``, ``host_us`` and ``eager_us``
  time.

TFLOP/s counts ``2*H*s_q*(sum of lengths)*(576+512)``; GB/s counts each backend's own cache bytes
per token (1152 bf16, 576 fp8, 656 fp8_snapmla), both on ``us``.  Writes ``decode.csv`` and
``decode.png`` to ``--out``.

``--kernels`` also profiles ``KERNEL_CALLS`` back-to-back eager calls of every backend with
torch's profiler and writes the GPU time of each kernel per call to ``kernels.csv`` (ours: the
query quantization, the decode kernel and the combine; our plan and FlashMLA's metadata are
computed before, as for ``us``): where one call's time goes, shape by shape.
"""

from __future__ import annotations

import argparse
import importlib
import math
import time
from pathlib import Path

import torch

from benchmarks.provenance import describe, run_info
from benchmarks.vllm_engine import kernel_totals, merge_by_key, read_csv, run_number, write_csv
from vllm_snapmla import format as fmt
from vllm_snapmla import ops, reference
from vllm_snapmla._native import native


def _sm90_kernel(schedule=None):
    """Loader of the sm90 kernel (``schedule``: a fixed one; None: the kernel's own choice)."""
    def load():
        sm90 = importlib.import_module("vllm_snapmla.kernels.sm90")
        if not sm90.available():
            raise ImportError("not built for or not running on this GPU")
        return sm90.schedule_variant(schedule) if schedule else sm90.snapmla_decode_sm90
    return load


def _triton_kernel():
    return importlib.import_module("vllm_snapmla.kernels.triton_decode").snapmla_decode


# Kernels that take the quantized query (snapmla_decode_sm90's signature): name -> loader.
SNAPMLA_KERNELS = {
    "snapmla-triton": _triton_kernel,
    "snapmla-sm90": _sm90_kernel(),
    "snapmla-sm90-free": _sm90_kernel("free"),
    "snapmla-sm90-split-roles": _sm90_kernel("split-roles"),
    "snapmla-sm90-narrow": _sm90_kernel("narrow"),
}
OPS_DECODE = "snapmla"   # vllm_snapmla.ops.decode, BF16 query in
FLASHMLA = ("flashmla-bf16", "flashmla-fp8")
FA3_MLA = "fa3-mla-bf16"
BASELINES = {"bf16": "flashmla-bf16", "fp8": "flashmla-fp8", "fa3": FA3_MLA}
# vLLM's FLASH_ATTN_MLA runs 16-token pages (its default block size) and, in steps that replay
# FULL CUDA graphs (up to max_cudagraph_capture_size tokens, 512 by default), at most
# attention_config.flash_attn_max_num_splits_for_cuda_graph splits (32 by default); other steps
# let FlashAttention choose.
FA3_PAGE_SIZE = 16
FA3_GRAPH_SPLITS = 32

# (batch, heads, context, s_q)
SHAPES = [
    (32, 128, 4096, 1), (64, 128, 8192, 1), (32, 128, 16384, 1), (16, 128, 32768, 1),
    (8, 128, 65536, 1), (4, 128, 131072, 1),
    (128, 16, 8192, 1), (64, 16, 32768, 1), (32, 16, 65536, 1),
    (128, 64, 16384, 1), (32, 32, 16384, 1), (16, 32, 65536, 1), (32, 64, 16384, 1),
    (32, 128, 16384, 2), (64, 16, 32768, 2), (128, 16, 8192, 2),   # MTP: one draft token
    (128, 8, 8192, 1),     # Kimi-K2 on one TP8 rank (64 heads / 8)
]
QUICK_SHAPES = [(32, 128, 4096, 1), (8, 128, 65536, 1), (64, 16, 32768, 1), (32, 128, 16384, 2)]

BYTES_PER_TOKEN = {"flashmla-bf16": 2 * fmt.HEAD_SIZE, "flashmla-fp8": fmt.HEAD_SIZE,
                   FA3_MLA: 2 * fmt.HEAD_SIZE}
# Relative error against BF16 FlashMLA above which a backend's result counts as wrong (the FP8
# paths measure 2.7-3.6e-2 on the benchmark's N(0, 1) inputs).
MAX_RELERR = 0.1


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """``BxHxN`` or ``BxHxNxS_Q`` as (B, H, N, s_q)."""
    parts = text.lower().split("x")
    if len(parts) not in (3, 4) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a shape is BxHxN or BxHxNxS_Q, got {text!r}")
    B, H, N, s_q = (int(p) for p in parts + ["1"] * (4 - len(parts)))
    return B, H, N, s_q


def request_lengths(B: int, N: int, ragged: bool, gen: torch.Generator) -> list[int]:
    """Every request N tokens, or with ``ragged`` lengths drawn uniformly in [N/8, N]."""
    if not ragged:
        return [N] * B
    return torch.randint(max(1, N // 8), N + 1, (B,), generator=gen).tolist()


def block_table_rows(pages: list[list[int]], width: int) -> list[list[int]]:
    """Each request's pages, then 0 up to ``width`` columns (vLLM pads its table with 0)."""
    if any(len(p) > width for p in pages):
        raise ValueError(f"a request has {max(len(p) for p in pages)} pages, more than the "
                         f"table's {width} columns")
    return [p + [0] * (width - len(p)) for p in pages]


def flashmla_ops():
    """vLLM's FlashMLA entry points, or the reason they cannot be used."""
    try:
        from vllm.v1.attention.ops import flashmla as fm
    except Exception as e:  # noqa: BLE001  (any import failure means: run ours only)
        return None, f"vllm not importable ({type(e).__name__}: {e})"
    ok, reason = fm.is_flashmla_dense_supported()
    return (fm, None) if ok else (None, reason)


def fa3_block_table(block_table: torch.Tensor, seq_lens: torch.Tensor,
                    page_ratio: int) -> torch.Tensor:
    """The block table of the same cache seen in pages ``page_ratio`` times smaller: 64-token
    page p holds small pages p * page_ratio ... p * page_ratio + page_ratio - 1, in token order;
    columns past a request's small pages are 0, as vLLM pads them."""
    width = block_table.shape[1]
    small = (block_table.unsqueeze(-1) * page_ratio
             + torch.arange(page_ratio, dtype=block_table.dtype, device=block_table.device))
    small = small.flatten(1)
    used = -(-seq_lens.to(torch.int64) // (fmt.PAGE_SIZE // page_ratio))
    columns = torch.arange(width * page_ratio, device=block_table.device)
    return torch.where(columns < used.unsqueeze(1), small, 0).to(block_table.dtype).contiguous()


def fa3_mla_ops():
    """vLLM's FlashAttention-3 entry points (varlen call, scheduling metadata), or why not."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata
        from vllm.vllm_flash_attn.flash_attn_interface import fa_version_unsupported_reason
    except Exception as e:  # noqa: BLE001  (any import failure means: not this backend)
        return None, f"vLLM's FlashAttention not importable ({type(e).__name__}: {e})"
    reason = fa_version_unsupported_reason(3)
    if reason is not None:
        return None, f"FlashAttention 3: {reason}"
    return (flash_attn_varlen_func, get_scheduler_metadata), None


def make_inputs(B, H, N, s_q, gen, table_width=None, ragged=False):
    """Random q and cache contents, request lengths, a shuffled block table padded to
    ``table_width`` columns, and every backend's cache layout."""
    dev = "cuda"
    lengths = request_lengths(B, N, ragged, gen)
    max_pages = math.ceil(N / fmt.PAGE_SIZE)
    nb = B * max_pages
    perm = torch.randperm(nb, generator=gen)
    # Request b owns pages perm[b * max_pages:][:its page count]; the rest of its row is 0.
    pages = [perm[b * max_pages:b * max_pages + math.ceil(n / fmt.PAGE_SIZE)].tolist()
             for b, n in enumerate(lengths)]
    width = max(table_width or 0, max_pages)
    block_table = torch.tensor(block_table_rows(pages, width), dtype=torch.int32, device=dev)
    perm = perm.cuda()
    kv_c = torch.randn(nb * fmt.PAGE_SIZE, fmt.KV_LORA_RANK, device=dev, dtype=torch.bfloat16)
    k_pe = torch.randn(nb * fmt.PAGE_SIZE, fmt.ROPE_DIM, device=dev, dtype=torch.bfloat16)
    snap = torch.empty(nb, fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN, dtype=torch.uint8, device=dev)
    snap[perm] = reference.quantize_kv(kv_c, k_pe).view(nb, fmt.PAGE_SIZE, -1)
    bf16 = torch.empty(nb, fmt.PAGE_SIZE, 1, fmt.HEAD_SIZE, dtype=torch.bfloat16, device=dev)
    bf16[perm] = torch.cat([kv_c, k_pe], -1).view(nb, fmt.PAGE_SIZE, 1, -1)
    del kv_c, k_pe
    q_nope = torch.randn(B, s_q, H, fmt.KV_LORA_RANK, device=dev, dtype=torch.bfloat16)
    q_pe = torch.randn(B, s_q, H, fmt.ROPE_DIM, device=dev, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
    return dict(q_nope=q_nope, q_pe=q_pe, snap=snap, bf16=bf16, block_table=block_table,
                seq_lens=seq_lens, tokens=sum(lengths))


def decode_calls(inp, fm, fa3, scale, quantize, wanted, eager=False):
    """name -> zero-argument callable returning (out [B, s_q, H, 512], lse in the backend's own
    layout), for the backends in ``wanted``, the BF16 ones first (the first that runs is the
    reference of the others' error); and for FlashMLA and FlashAttention, name -> the same call
    with fresh scheduling metadata.  ``eager``: FlashAttention as vLLM calls it outside CUDA
    graphs (its own split heuristic instead of the graphs' bound)."""
    runners, with_metadata = {}, {}
    bt, sl = inp["block_table"], inp["seq_lens"]
    B, s_q, H, _ = inp["q_nope"].shape
    q = torch.cat([inp["q_nope"], inp["q_pe"]], -1) if fm is not None else None
    if fm is not None and "flashmla-bf16" in wanted:
        meta, _ = fm.get_mla_metadata()   # scheduled by its first call, reused by the others

        def bf16(meta_of=lambda: meta):
            return fm.flash_mla_with_kvcache(q, inp["bf16"], bt, sl, fmt.KV_LORA_RANK, meta_of(),
                                             softmax_scale=scale, causal=True)
        runners["flashmla-bf16"] = bf16
        with_metadata["flashmla-bf16"] = lambda: bf16(lambda: fm.get_mla_metadata()[0])
    if fa3 is not None and FA3_MLA in wanted:
        varlen, schedule = fa3
        # The same bytes in 16-token pages: [pages, 16, 576], split as vLLM's forward_mqa does.
        cache = inp["bf16"].view(-1, FA3_PAGE_SIZE, fmt.HEAD_SIZE)
        kv_c = cache[..., :fmt.KV_LORA_RANK].unsqueeze(-2)
        k_pe = cache[..., fmt.KV_LORA_RANK:].unsqueeze(-2)
        table = fa3_block_table(bt, sl, fmt.PAGE_SIZE // FA3_PAGE_SIZE)
        cu_q = torch.arange(0, (B + 1) * s_q, s_q, dtype=torch.int32, device=sl.device)
        q_nope, q_pe = inp["q_nope"].flatten(0, 1), inp["q_pe"].flatten(0, 1)
        max_len = int(sl.max())
        splits = 0 if eager else FA3_GRAPH_SPLITS

        def fa3_metadata():
            return schedule(batch_size=B, max_seqlen_q=s_q, max_seqlen_k=max_len, num_heads_q=H,
                            num_heads_kv=1, headdim=fmt.ROPE_DIM, cache_seqlens=sl,
                            qkv_dtype=torch.bfloat16, headdim_v=fmt.KV_LORA_RANK,
                            page_size=FA3_PAGE_SIZE, cu_seqlens_q=cu_q, causal=True,
                            num_splits=splits)
        fa3_schedule = fa3_metadata()

        def fa3_call(metadata_of=lambda: fa3_schedule):
            out, lse = varlen(q=q_pe, k=k_pe, v=kv_c, q_v=q_nope, max_seqlen_q=s_q,
                              cu_seqlens_q=cu_q, max_seqlen_k=max_len, seqused_k=sl,
                              block_table=table, softmax_scale=scale, causal=True,
                              return_softmax_lse=True, fa_version=3,
                              scheduler_metadata=metadata_of(), num_splits=splits)
            return out.unflatten(0, (B, s_q)), lse
        runners[FA3_MLA] = fa3_call
        with_metadata[FA3_MLA] = lambda: fa3_call(fa3_metadata)
    if fm is not None and "flashmla-fp8" in wanted:
        q8 = q.to(torch.float8_e4m3fn)
        cache8 = inp["bf16"].to(torch.float8_e4m3fn)
        one = torch.ones(1, dtype=torch.float32, device="cuda")
        metadata = fm.get_mla_metadata_dense_fp8(sl, s_q * H, 1)

        def fp8(metadata_of=lambda: metadata):
            sched, splits = metadata_of()
            return fm.flash_mla_with_kvcache_fp8(
                q8, cache8, bt, sl, fmt.KV_LORA_RANK, sched, splits, softmax_scale=scale,
                causal=True, descale_q=one, descale_k=one)
        runners["flashmla-fp8"] = fp8
        with_metadata["flashmla-fp8"] = lambda: fp8(
            lambda: fm.get_mla_metadata_dense_fp8(sl, s_q * H, 1))
    if OPS_DECODE in wanted:
        plan = ops.plan_decode(sl, bt, H, s_q)   # the step's plan, as vLLM's builder makes it
        runners[OPS_DECODE] = lambda: ops.decode(inp["q_nope"], inp["q_pe"], inp["snap"], bt, sl,
                                                 scale, plan=plan)
        # Planned again into the same buffer, as the builder rewrites its own each step.
        with_metadata[OPS_DECODE] = lambda: ops.decode(
            inp["q_nope"], inp["q_pe"], inp["snap"], bt, sl, scale,
            plan=ops.plan_decode(sl, bt, H, s_q, out=plan))
    for name, load in SNAPMLA_KERNELS.items():
        if name not in wanted:
            continue
        try:
            kernel = load()
        except (ImportError, AttributeError) as e:
            print(f"  {name}: not available ({e})", flush=True)
            continue

        def run(kernel=kernel):
            q8, qs, qpe = quantize(inp["q_nope"], inp["q_pe"])
            return kernel(q8, qs, qpe, inp["snap"], bt, sl, scale, True)
        runners[name] = run
    return runners, with_metadata


def _time(fn, rep, warmup, eager):
    """Median microseconds of ``fn`` (captured in a CUDA graph unless ``eager``)."""
    from triton.testing import do_bench
    if not eager:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        fn = graph.replay
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def _host_us(fn, calls):
    """Mean CPU microseconds of one eager call, the GPU idle before each."""
    fn()
    total = 0.0
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
    torch.cuda.synchronize()
    return total / calls * 1e6


def _eager_us(fn, calls):
    """Microseconds per call of ``calls`` back-to-back eager calls, by CUDA events."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


KERNEL_CALLS = 50
KERNEL_COLUMNS = ["run", "backend", "B", "H", "N", "s_q", "table_width", "ragged", "kernel",
                  "us_per_call", "launches_per_call", "name"]


def short_kernel_name(name: str) -> str:
    """A profiler's kernel name without its return type, namespaces and arguments:
    ``void snapmla::sm90::decode_narrow_kernel<16>(CUtensorMap_st, ...)`` ->
    ``decode_narrow_kernel<16>`` (template arguments kept, at most 60 characters)."""
    name = name.replace("(anonymous namespace)", "anonymous")   # no "(" before the arguments
    depth, end, last_scope = 0, len(name), 0
    for i, c in enumerate(name):
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif depth == 0 and c == "(" and i > 0:
            end = i
            break
        elif depth == 0 and name.startswith("::", i):
            last_scope = i + 2
    short = name[last_scope:end].strip()
    if short.startswith("void "):
        short = short[len("void "):]
    return short if len(short) <= 60 else short[:57] + "..."


def kernels_per_call(events, calls: int) -> list[tuple[str, float, float]]:
    """``(name, µs per call, launches per call)`` of each kernel in ``events`` (``(name, µs)``
    of every launch over ``calls`` calls), the longest first."""
    rows = [(name, us / calls, launches / calls)
            for name, (us, launches) in kernel_totals(events).items()]
    return sorted(rows, key=lambda r: -r[1])


def _profile_kernels(fn, calls: int) -> list[tuple[str, float, float]]:
    """The kernels of ``calls`` back-to-back eager calls of ``fn`` (after one warm-up call)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [(e.name, e.device_time) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA]
    return kernels_per_call(events, calls)


FA3_PANEL = "every shape: speedup over FlashAttention-3 MLA (vLLM's BF16 default)"


def _bars(ax, rows, backends, colour, shapes, key):
    """Grouped bars of ``key`` (a speedup column) per shape, one colour per backend."""
    width = 0.8 / max(len(backends), 1)
    for i, backend in enumerate(backends):
        values = [next((r.get(key) or 0 for r in rows
                        if r["backend"] == backend
                        and (r["H"], r["s_q"], r["B"], r["N"]) == shape), 0)
                  for shape in shapes]
        ax.bar([x + i * width for x in range(len(shapes))], values, width,
               color=colour[backend], label=backend)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))])
    ax.set_xticklabels([f"H={h} s_q={q} B={b} N={f'{n // 1024}k' if n >= 1024 else n}"
                        for h, q, b, n in shapes],
                       fontsize=7, rotation=40, ha="right", rotation_mode="anchor")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))   # off the bars


def _plot(rows, path):
    """One colour per backend: H=128 TFLOP/s and speedup over BF16 FlashMLA against context
    length (the paper's Figures 1 and 6), when the run has that sweep (one shape per length), the
    speedup at the other shapes, and when FlashAttention-3 MLA ran, the speedup over it at every
    shape.
    Returns the panels' titles (empty without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot", flush=True)
        return []
    backends = sorted({r["backend"] for r in rows})
    colour = {b: f"C{i}" for i, b in enumerate(backends)}
    sweep = [r for r in rows if r["H"] == 128 and r["s_q"] == 1]
    # A line against context length needs one row per length: shapes that repeat a length at
    # another batch (64 x 512 beside 1 x 512) would fold the line back, so they go to the bars.
    if len({(r["backend"], r["N"]) for r in sweep}) < len(sweep):
        sweep = []
    in_sweep = {(r["H"], r["s_q"], r["B"], r["N"]) for r in sweep}
    others = sorted({(r["H"], r["s_q"], r["B"], r["N"]) for r in rows} - in_sweep)
    with_fa3 = sorted({(r["H"], r["s_q"], r["B"], r["N"]) for r in rows
                       if r.get("speedup_vs_fa3")})
    # (title, relative width): the bar panels get the room of their many shape labels.
    layout = ([("H=128, s_q=1: TFLOP/s", 1), ("H=128, s_q=1: speedup over BF16 FlashMLA", 1)]
              if sweep else [])
    others_title = ("other shapes: " if sweep else "") + "speedup over BF16 FlashMLA"
    layout += [(others_title, 1.6)] if others else []
    layout += [(FA3_PANEL, 1.6)] if with_fa3 else []
    panels = [title for title, _ in layout]
    fig, axes = plt.subplots(1, len(panels), squeeze=False,
                             figsize=((19 if sweep else 10) + (8 if with_fa3 else 0), 5.5),
                             gridspec_kw={"width_ratios": [width for _, width in layout]})
    axes = dict(zip(panels, axes[0]))
    has_flashmla = any(r.get("speedup_vs_bf16") for r in rows)
    if sweep:
        ax_tf, ax_sp = axes[panels[0]], axes[panels[1]]
        for backend in backends:
            pts = sorted((r["N"], r["tflops"], r.get("speedup_vs_bf16")) for r in sweep
                         if r["backend"] == backend)
            if not pts:
                continue
            ax_tf.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                       color=colour[backend], label=backend)
            if all(p[2] for p in pts):
                ax_sp.plot([p[0] for p in pts], [p[2] for p in pts], marker="o",
                           color=colour[backend], label=backend)
        for ax in (ax_tf, ax_sp):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length N (tokens)")
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        ax_sp.axhline(1.0, color="gray", lw=0.8)
    if others:
        _bars(axes[others_title], rows, backends, colour, others, "speedup_vs_bf16")
    if with_fa3:
        _bars(axes[FA3_PANEL], rows, backends, colour, with_fa3, "speedup_vs_fa3")
    for title, ax in axes.items():
        ax.set_title(title, fontsize=10)
        if "FlashMLA" in title and not has_flashmla:
            ax.text(0.5, 0.5, "FlashMLA not available in this run", ha="center",
                    transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}", flush=True)
    return panels


# decode.csv's columns: the backend, the shape's integers, the measured floats, then (added later,
# so that older files still read) the table options, what ``us`` timed and the other times.
CSV_COLUMNS = ["run", "backend", "B", "H", "N", "s_q", "us", "tflops", "gbps", "relerr",
               "speedup_vs_bf16", "speedup_vs_fp8", "table_width", "ragged", "timing", "host_us",
               "eager_us", "metadata_host_us", "metadata_eager_us", "metadata_us",
               "speedup_vs_fa3"]
_CSV_INTS = {"run", "B", "H", "N", "s_q", "table_width", "ragged"}
_CSV_TEXT = {"backend", "timing"}


def _read_csv(path):
    """decode.csv's rows with numbers as numbers (empty or absent cells None), as _plot takes
    them."""
    _, rows = read_csv(Path(path))
    for row in rows:
        for c in CSV_COLUMNS:
            if c not in _CSV_TEXT:
                row[c] = (None if not row.get(c) else int(row[c]) if c in _CSV_INTS
                          else float(row[c]))
    return rows


def _row_key(r) -> tuple:
    """What one measurement is of: a later run of the same replaces it in decode.csv."""
    return tuple(str(r.get(c)) for c in ("backend", "B", "H", "N", "s_q", "table_width",
                                         "ragged", "timing"))


def _kernel_measurement(r) -> tuple:
    return tuple(str(r.get(c)) for c in ("backend", "B", "H", "N", "s_q", "table_width",
                                         "ragged"))


def merge_kernel_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """kernels.csv after a run: a (backend, shape, table, lengths) measured again replaces all
    its earlier kernel rows, so that a kernel a new build no longer launches leaves none."""
    measured = {_kernel_measurement(r) for r in new}
    return [r for r in old if _kernel_measurement(r) not in measured] + new


def _shape_generator(B, H, N, s_q) -> torch.Generator:
    """Each shape's own seed: its (ragged) lengths and inputs do not depend on the shape list."""
    return torch.Generator().manual_seed(((B * 1009 + H) * 100003 + N) * 7 + s_q)


def measure_call(fn, fresh, rep, warmup, eager, calls):
    """The times of one backend (see the module docstring); ``fresh``: for FlashMLA and
    FlashAttention, the call with fresh metadata, whose excess over ``fn`` is the metadata's
    (two separate timings: a difference below zero is their noise and reads 0)."""
    times = dict(us=_time(fn, rep, warmup, eager), host_us=_host_us(fn, calls),
                 eager_us=_eager_us(fn, calls))
    if fresh is not None:
        times["metadata_us"] = max(0.0, _time(fresh, rep, warmup, eager) - times["us"])
        times["metadata_host_us"] = max(0.0, _host_us(fresh, calls) - times["host_us"])
        times["metadata_eager_us"] = max(0.0, _eager_us(fresh, calls) - times["eager_us"])
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="out/bench_decode", help="folder for decode.csv/png")
    parser.add_argument("--quick", action="store_true", help="4 shapes, shorter timing")
    parser.add_argument("--eager", action="store_true",
                        help="us times eager Python calls, not graph replays")
    parser.add_argument("--backends", help="comma-separated subset of: "
                        + ", ".join([*FLASHMLA, FA3_MLA, OPS_DECODE, *SNAPMLA_KERNELS])
                        + " (default: all)")
    parser.add_argument("--heads", type=int, nargs="+", help="only the shapes of these head counts")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", metavar="BxHxN[xS_Q]",
                        help="these shapes instead of the default list")
    parser.add_argument("--table-width", type=int, metavar="PAGES",
                        help="block-table columns (vLLM: max_model_len / 64, e.g. 2560); default "
                             "each shape's own pages")
    parser.add_argument("--ragged", action="store_true",
                        help="request lengths drawn in [N/8, N] (seeded) instead of N")
    parser.add_argument("--kernels", action="store_true",
                        help="also the GPU time of each kernel of one eager call (kernels.csv)")
    parser.add_argument("--replot", metavar="CSV", help="no timing: redraw a decode.csv's plot "
                        "into --out")
    args = parser.parse_args()
    if args.replot:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        _plot(_read_csv(args.replot), Path(args.out) / "decode.png")
        return
    known = {*FLASHMLA, FA3_MLA, OPS_DECODE, *SNAPMLA_KERNELS}
    wanted = set(args.backends.split(",")) if args.backends else known
    if wanted - known:
        parser.error(f"unknown backends {sorted(wanted - known)}; known: {sorted(known)}")
    shapes = [shape for shape in args.shapes or (QUICK_SHAPES if args.quick else SHAPES)
              if not args.heads or shape[1] in args.heads]
    if not shapes:
        parser.error(f"no shape has --heads {args.heads}")
    too_narrow = [s for s in shapes if args.table_width
                  and math.ceil(s[2] / fmt.PAGE_SIZE) > args.table_width]
    if too_narrow:
        parser.error(f"--table-width {args.table_width} is narrower than the pages of {too_narrow}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode needs a CUDA GPU (only --replot runs without one)")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    header = describe(run_info("benchmarks.bench_decode"))
    print(header, flush=True)
    # decode.csv keeps earlier runs' rows (a --heads or --shapes subset replaces only its own);
    # each row names its run, described in the file's "# " header lines.
    runs, old_rows = read_csv(out_dir / "decode.csv")
    run = run_number(runs, header)
    kernel_runs, old_kernel_rows = read_csv(out_dir / "kernels.csv")
    kernel_run = run_number(kernel_runs, header)
    kernel_rows = []
    fm, why = flashmla_ops()
    if fm is None:
        print(f"FlashMLA unavailable, not timed: {why}", flush=True)
    fa3, why = fa3_mla_ops() if FA3_MLA in wanted else (None, None)
    if FA3_MLA in wanted and fa3 is None:
        print(f"FlashAttention-3 MLA unavailable, not timed: {why}", flush=True)
    if native() is not None:
        quantize, quant_note = ops.quantize_q, "native quantize_q"
    else:
        quantize, quant_note = reference.quantize_q, "torch reference quantize_q (no native build)"
    timing = "eager" if args.eager else "graph"
    print(f"{torch.cuda.get_device_name()}; ours include {quant_note} and the combine; us = "
          f"{'eager calls' if args.eager else 'CUDA-graph replays'}; table width "
          f"{args.table_width or 'as the context'}; lengths {'ragged' if args.ragged else 'N'}",
          flush=True)

    scale = fmt.HEAD_SIZE ** -0.5
    rep, warmup, calls = (50, 10, 30) if args.quick else (200, 25, 100)
    rows = []
    for B, H, N, s_q in shapes:
        print(f"shape B={B} H={H} N={N} s_q={s_q} ...", flush=True)
        inp = make_inputs(B, H, N, s_q, _shape_generator(B, H, N, s_q), args.table_width,
                          args.ragged)
        runners, with_metadata = decode_calls(inp, fm, fa3, scale, quantize, wanted, args.eager)
        flops = 2 * H * s_q * inp["tokens"] * (fmt.HEAD_SIZE + fmt.KV_LORA_RANK)
        times, base_name, base_out, shape_rows = {}, None, None, []
        for name, fn in list(runners.items()):
            try:
                out = fn()[0].float()
            except (RuntimeError, ValueError, AssertionError) as e:   # e.g. unsupported heads
                print(f"  {name:24s} failed on this shape: {str(e).splitlines()[0][:120]}",
                      flush=True)
                continue
            if name in ("flashmla-bf16", FA3_MLA) and base_out is None:
                base_name, base_out = name, out
            relerr = ((out - base_out).norm() / base_out.norm()).item() if base_out is not None \
                else float("nan")
            if base_out is not None and not relerr <= MAX_RELERR:
                # FP8 paths sit at 2.7-3.6e-2 of BF16 FlashMLA on these inputs: a time for a
                # wrong result would only mislead.
                print(f"  {name:24s} wrong result on this shape (relerr {relerr:.1e} against "
                      f"{base_name}): not timed", flush=True)
                continue
            try:
                measured = measure_call(fn, with_metadata.get(name), rep, warmup, args.eager,
                                        calls)
            except (RuntimeError, ValueError, AssertionError) as e:   # e.g. graph capture
                print(f"  {name:24s} failed while timed: {str(e).splitlines()[0][:120]}",
                      flush=True)
                continue
            us = measured["us"]
            times[name] = us
            nbytes = inp["tokens"] * BYTES_PER_TOKEN.get(name, fmt.BYTES_PER_TOKEN)
            shape_rows.append({**measured, "run": run, "backend": name, "B": B, "H": H, "N": N,
                               "s_q": s_q, "us": us, "tflops": flops / us * 1e-6,
                               "gbps": nbytes / us * 1e-3, "relerr": relerr,
                               "table_width": inp["block_table"].shape[1],
                               "ragged": int(args.ragged), "timing": timing})
            metadata = (f"  metadata {measured['metadata_us']:6.1f} us "
                        f"(host {measured['metadata_host_us']:5.1f})"
                        if "metadata_us" in measured else "")
            print(f"  {name:24s} {us:9.1f} us  {flops / us * 1e-6:6.0f} TFLOP/s  "
                  f"{nbytes / us * 1e-3:6.0f} GB/s  relerr {relerr:.1e}  host "
                  f"{measured['host_us']:6.1f} us  eager {measured['eager_us']:7.1f} us"
                  f"{metadata}", flush=True)
            if args.kernels:
                kernels = _profile_kernels(fn, KERNEL_CALLS)
                print("  " + " " * 24 + " kernels: " + ", ".join(
                    f"{short_kernel_name(k)} {us:.1f}" for k, us, _ in kernels), flush=True)
                kernel_rows += [{"run": kernel_run, "backend": name, "B": B, "H": H, "N": N,
                                 "s_q": s_q, "table_width": inp["block_table"].shape[1],
                                 "ragged": int(args.ragged), "kernel": short_kernel_name(k),
                                 "us_per_call": round(us, 3),
                                 "launches_per_call": round(launches, 3), "name": k}
                                for k, us, launches in kernels]
        for r in shape_rows:
            for base, backend in BASELINES.items():
                t = times.get(backend)
                r[f"speedup_vs_{base}"] = t / r["us"] if t else None
        rows += shape_rows
        # After every shape: a cut-short run keeps what it measured.
        write_csv(merge_by_key(old_rows, rows, _row_key), out_dir / "decode.csv", CSV_COLUMNS,
                  runs)
        if args.kernels:
            write_csv(merge_kernel_rows(old_kernel_rows, kernel_rows), out_dir / "kernels.csv",
                      KERNEL_COLUMNS, kernel_runs)
        del inp, runners, with_metadata
        torch.cuda.empty_cache()

    cols = CSV_COLUMNS
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    print(f"wrote {out_dir / 'decode.csv'} (this run: {run})", flush=True)
    _plot(rows, out_dir / "decode.png")



def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.1e}" if abs(v) < 0.1 else f"{v:.2f}" if abs(v) < 10 else f"{v:.0f}"
    return str(v)


if __name__ == "__main__":
    main()
