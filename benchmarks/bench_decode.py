"""Decode attention, one layer: SnapMLA kernels vs vLLM 0.26.0's bundled FlashMLA, in one process.

    python benchmarks/bench_decode.py --out out/bench_decode [--quick]

Backends, on the same random data and shapes (those of /work/shared/anchors/h200-baselines.md):

* ``flashmla-bf16``: FlashMLA over a bf16 cache (vLLM's default MLA decode);
* ``flashmla-fp8``: FlashMLA's dense FP8 path (``--kv-cache-dtype fp8``): q and the 576-wide row
  in e4m3 with per-tensor scale 1.0; its q cast is not timed;
* every entry of ``SNAPMLA_KERNELS`` over the ``fp8_snapmla`` cache; the timed call includes the
  query quantization (``ops.quantize_q``) and the split combine.

Times are ``triton.testing.do_bench`` medians of a CUDA-graph replay of one call (as vLLM runs
decode; ``--eager`` times the Python call instead, launch overhead included).  do_bench overwrites
a 256 MB buffer before every timed call, so each call reads its cache from HBM.
TFLOP/s counts ``2*B*H*s_q*N*(576+512)``; GB/s counts each backend's own cache bytes per token
(1152 bf16, 576 fp8, 656 fp8_snapmla).  Writes ``decode.csv`` and ``decode.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_snapmla import format as fmt  # noqa: E402
from vllm_snapmla import ops, reference  # noqa: E402

# Kernels with snapmla_decode's signature: name -> "module:function".  A later CUDA kernel is one
# more line here.
SNAPMLA_KERNELS = {
    "snapmla-triton": "vllm_snapmla.triton.decode:snapmla_decode",
    "snapmla-sm90": "vllm_snapmla.sm90:snapmla_decode_sm90",
    "snapmla-sm90-free": "vllm_snapmla.sm90:snapmla_decode_sm90_free",
    "snapmla-sm90-split-roles": "vllm_snapmla.sm90:snapmla_decode_sm90_split_roles",
    "snapmla-sm90-narrow-16": "vllm_snapmla.sm90:snapmla_decode_sm90_narrow16",
}
# Backends that run only where a predicate ("module:function", no arguments) says so.
SNAPMLA_AVAILABLE = {name: "vllm_snapmla.sm90:available" for name in SNAPMLA_KERNELS
                     if name.startswith("snapmla-sm90")}

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

BYTES_PER_TOKEN = {"flashmla-bf16": 2 * fmt.HEAD_SIZE, "flashmla-fp8": fmt.HEAD_SIZE}


def _flashmla():
    """vLLM's FlashMLA entry points, or the reason they cannot be used."""
    try:
        from vllm.v1.attention.ops import flashmla as fm
    except Exception as e:  # noqa: BLE001  (any import failure means: run ours only)
        return None, f"vllm not importable ({type(e).__name__}: {e})"
    ok, reason = fm.is_flashmla_dense_supported()
    return (fm, None) if ok else (None, reason)


def _load(spec: str):
    module, fn = spec.split(":")
    return getattr(importlib.import_module(module), fn)


def _make_inputs(B, H, N, s_q, gen):
    """Random q and cache contents, a shuffled block table, and every backend's cache layout."""
    dev = "cuda"
    blocks_per_seq = N // fmt.PAGE_SIZE
    nb = B * blocks_per_seq
    perm = torch.randperm(nb, generator=gen).cuda()
    block_table = perm.view(B, blocks_per_seq).int()
    kv_c = torch.randn(nb * fmt.PAGE_SIZE, fmt.KV_LORA_RANK, device=dev, dtype=torch.bfloat16)
    k_pe = torch.randn(nb * fmt.PAGE_SIZE, fmt.ROPE_DIM, device=dev, dtype=torch.bfloat16)
    # Token t of request b lives in block perm[b * blocks_per_seq + t // 64].
    snap = torch.empty(nb, fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN, dtype=torch.uint8, device=dev)
    snap[perm] = reference.quantize_kv(kv_c, k_pe).view(nb, fmt.PAGE_SIZE, -1)
    bf16 = torch.empty(nb, fmt.PAGE_SIZE, 1, fmt.HEAD_SIZE, dtype=torch.bfloat16, device=dev)
    bf16[perm] = torch.cat([kv_c, k_pe], -1).view(nb, fmt.PAGE_SIZE, 1, -1)
    del kv_c, k_pe
    q_nope = torch.randn(B, s_q, H, fmt.KV_LORA_RANK, device=dev, dtype=torch.bfloat16)
    q_pe = torch.randn(B, s_q, H, fmt.ROPE_DIM, device=dev, dtype=torch.bfloat16)
    seq_lens = torch.full((B,), N, dtype=torch.int32, device=dev)
    return dict(q_nope=q_nope, q_pe=q_pe, snap=snap, bf16=bf16, block_table=block_table,
                seq_lens=seq_lens)


def _runners(inp, fm, scale, quantize, wanted):
    """name -> zero-argument callable returning (out, lse), for the backends in ``wanted``."""
    runners = {}
    bt, sl = inp["block_table"], inp["seq_lens"]
    B, s_q, H, _ = inp["q_nope"].shape
    q = torch.cat([inp["q_nope"], inp["q_pe"]], -1) if fm is not None else None
    if fm is not None and "flashmla-bf16" in wanted:
        meta, _ = fm.get_mla_metadata()
        runners["flashmla-bf16"] = lambda: fm.flash_mla_with_kvcache(
            q, inp["bf16"], bt, sl, fmt.KV_LORA_RANK, meta, softmax_scale=scale, causal=True)
    if fm is not None and "flashmla-fp8" in wanted:
        q8 = q.to(torch.float8_e4m3fn)
        cache8 = inp["bf16"].to(torch.float8_e4m3fn)
        one = torch.ones(1, dtype=torch.float32, device="cuda")
        sched, splits = fm.get_mla_metadata_dense_fp8(sl, s_q * H, 1)
        runners["flashmla-fp8"] = lambda: fm.flash_mla_with_kvcache_fp8(
            q8, cache8, bt, sl, fmt.KV_LORA_RANK, sched, splits, softmax_scale=scale, causal=True,
            descale_q=one, descale_k=one)
    for name, spec in SNAPMLA_KERNELS.items():
        if name not in wanted:
            continue
        try:
            kernel = _load(spec)
            if name in SNAPMLA_AVAILABLE and not _load(SNAPMLA_AVAILABLE[name])():
                raise ImportError("not built for or not running on this GPU")
        except (ImportError, AttributeError) as e:
            print(f"  {name}: not available ({e})", flush=True)
            continue

        def run(kernel=kernel):
            q8, qs, qpe = quantize(inp["q_nope"], inp["q_pe"])
            return kernel(q8, qs, qpe, inp["snap"], bt, sl, scale, True)
        runners[name] = run
    return runners


def _time(fn, rep, warmup, eager):
    """Median microseconds of ``fn`` (captured in a CUDA graph unless ``eager``)."""
    from triton.testing import do_bench
    if not eager:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        fn = graph.replay
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def _plot(rows, path):
    """One colour per backend: H=128 TFLOP/s and speedup over BF16 FlashMLA against context
    length (the paper's Figures 1 and 6), when the run has that sweep, and the speedup at the
    other shapes.  Returns the panels' titles (empty without matplotlib)."""
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
    others = sorted({(r["H"], r["s_q"], r["B"], r["N"]) for r in rows
                     if (r["H"], r["s_q"]) != (128, 1)})
    panels = (["H=128, s_q=1: TFLOP/s", "H=128, s_q=1: speedup over BF16 FlashMLA"] if sweep
              else []) + ([("other shapes: " if sweep else "") + "speedup over BF16 FlashMLA"]
                          if others else [])
    ratios = [1] * len(panels)
    if others:
        ratios[-1] = 1.6   # the bar panel, the last, gets the room of its many shape labels
    fig, axes = plt.subplots(1, len(panels), figsize=(19 if sweep else 10, 5.5), squeeze=False,
                             gridspec_kw={"width_ratios": ratios})
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
        ax_bar = axes[panels[-1]]
        width = 0.8 / max(len(backends), 1)
        for i, backend in enumerate(backends):
            values = [next((r.get("speedup_vs_bf16") or 0 for r in rows
                            if r["backend"] == backend
                            and (r["H"], r["s_q"], r["B"], r["N"]) == shape), 0)
                      for shape in others]
            ax_bar.bar([x + i * width for x in range(len(others))], values, width,
                       color=colour[backend], label=backend)
        ax_bar.set_xticks([x + 0.4 - width / 2 for x in range(len(others))])
        ax_bar.set_xticklabels([f"H={h} s_q={q} B={b} N={n // 1024}k" for h, q, b, n in others],
                               fontsize=7, rotation=40, ha="right", rotation_mode="anchor")
        ax_bar.axhline(1.0, color="gray", lw=0.8)
        ax_bar.grid(True, axis="y", alpha=0.3)
        ax_bar.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))   # off the bars
    for title, ax in axes.items():
        ax.set_title(title)
        if "speedup" in title and not has_flashmla:
            ax.text(0.5, 0.5, "FlashMLA not available in this run", ha="center",
                    transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}", flush=True)
    return panels


# decode.csv's columns: the backend, the shape's integers, then measured floats.
CSV_COLUMNS = ["backend", "B", "H", "N", "s_q", "us", "tflops", "gbps", "relerr",
               "speedup_vs_bf16", "speedup_vs_fp8"]
_CSV_INTS = CSV_COLUMNS[1:5]


def _read_csv(path):
    """decode.csv's rows with numbers as numbers (empty cells None), as _plot takes them."""
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row = dict(r)
            for c in CSV_COLUMNS[1:]:
                row[c] = int(r[c]) if c in _CSV_INTS else float(r[c]) if r.get(c) else None
            rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="out/bench_decode", help="folder for decode.csv/png")
    parser.add_argument("--quick", action="store_true", help="4 shapes, shorter timing")
    parser.add_argument("--eager", action="store_true", help="time Python calls, not graphs")
    parser.add_argument("--backends", help="comma-separated subset of: flashmla-bf16, "
                        "flashmla-fp8, " + ", ".join(SNAPMLA_KERNELS) + " (default: all)")
    parser.add_argument("--heads", type=int, nargs="+", help="only the shapes of these head counts")
    parser.add_argument("--replot", metavar="CSV", help="no timing: redraw a decode.csv's plot "
                        "into --out")
    args = parser.parse_args()
    if args.replot:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        _plot(_read_csv(args.replot), Path(args.out) / "decode.png")
        return
    known = {"flashmla-bf16", "flashmla-fp8", *SNAPMLA_KERNELS}
    wanted = set(args.backends.split(",")) if args.backends else known
    if wanted - known:
        parser.error(f"unknown backends {sorted(wanted - known)}; known: {sorted(known)}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    fm, why = _flashmla()
    if fm is None:
        print(f"FlashMLA unavailable, timing ours only: {why}", flush=True)
    if ops.native() is not None:
        quantize, quant_note = ops.quantize_q, "native quantize_q"
    else:
        quantize, quant_note = reference.quantize_q, "torch reference quantize_q (no native build)"
    print(f"{torch.cuda.get_device_name()}; ours include {quant_note} and the combine; "
          f"{'eager calls' if args.eager else 'CUDA-graph replays'}", flush=True)

    scale = fmt.HEAD_SIZE ** -0.5
    rep, warmup = (50, 10) if args.quick else (200, 25)
    gen = torch.Generator().manual_seed(0)
    rows = []
    shapes = [shape for shape in (QUICK_SHAPES if args.quick else SHAPES)
              if not args.heads or shape[1] in args.heads]
    for B, H, N, s_q in shapes:
        print(f"shape B={B} H={H} N={N} s_q={s_q} ...", flush=True)
        inp = _make_inputs(B, H, N, s_q, gen)
        runners = _runners(inp, fm, scale, quantize, wanted)
        flops = 2 * B * H * s_q * N * (fmt.HEAD_SIZE + fmt.KV_LORA_RANK)
        times, base_out = {}, None
        for name, fn in list(runners.items()):
            try:
                out = fn()[0].float()
            except RuntimeError as e:   # e.g. a head count a baseline does not support
                print(f"  {name:16s} failed on this shape: {str(e).splitlines()[0][:120]}",
                      flush=True)
                del runners[name]
                continue
            if name == "flashmla-bf16":
                base_out = out
            relerr = ((out - base_out).norm() / base_out.norm()).item() if base_out is not None \
                else float("nan")
            us = _time(fn, rep, warmup, args.eager)
            times[name] = us
            nbytes = B * N * BYTES_PER_TOKEN.get(name, fmt.BYTES_PER_TOKEN)
            rows.append(dict(backend=name, B=B, H=H, N=N, s_q=s_q, us=us,
                             tflops=flops / us * 1e-6, gbps=nbytes / us * 1e-3, relerr=relerr))
            print(f"  {name:16s} {us:9.1f} us  {flops / us * 1e-6:6.0f} TFLOP/s  "
                  f"{nbytes / us * 1e-3:6.0f} GB/s  relerr {relerr:.1e}", flush=True)
        for r in rows[-len(runners):]:
            for base in ("bf16", "fp8"):
                t = times.get(f"flashmla-{base}")
                r[f"speedup_vs_{base}"] = t / r["us"] if t else None
        del inp, runners
        torch.cuda.empty_cache()

    cols = CSV_COLUMNS
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    with open(out_dir / "decode.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols)
        writer.writeheader()
        writer.writerows({c: r.get(c) for c in cols} for r in rows)
    print(f"wrote {out_dir / 'decode.csv'}", flush=True)
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
