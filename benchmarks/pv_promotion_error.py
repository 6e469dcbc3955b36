"""What promoting each page's PV sum into FP32 buys at long contexts (issue 3), on an H200.

Hopper's FP8 WGMMA adds into its accumulator with reduced precision (about 14 mantissa bits).
The sm90 kernel therefore runs each 64-token page's P8 . V8 into a fresh accumulator and adds it
into the FP32 output O with CUDA-core FMAs (`promote_pv=True`, the default).  This script runs
the kernel both ways (`promote_pv=False`: O is rescaled in registers and the WGMMAs accumulate
into it across all pages) on the same inputs, one KV split so that every page of a request lands
in one accumulator, and reports per context length:

- rel-L2 of the output against the reference algorithm (`reference.decode_quantized`: the same
  FP8 quantization of Q, K, V and P, float64 arithmetic): the kernel's own arithmetic error;
- rel-L2 against exact float64 attention over the dequantized cache (`decode(exact=True)`): the
  error a user sees, mostly the FP8 Q and P quantization, which promotion does not change;
- the reference algorithm's own rel-L2 against exact attention, for scale.

Inputs: N(0,1) query and cache, and a sharp case (query scaled by 4) whose softmax concentrates
on few tokens.  Writes a Markdown table and a CSV.

    python benchmarks/pv_promotion_error.py --out out/pv_promotion
"""

import argparse
import csv
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_snapmla import format as fmt, reference, sm90  # noqa: E402

from tests.cache_builder import build_cache  # noqa: E402

CONTEXTS = (4096, 32768, 131072)
QUERY_SCALES = (1.0, 4.0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-300)).item()


def measure(n: int, heads: int, q_std: float, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    cache, block_table, _ = build_cache([n], gen=gen)
    cache, block_table = cache.cuda(), block_table.cuda()
    q = (torch.randn(1, 1, heads, fmt.KV_LORA_RANK, generator=gen) * q_std).bfloat16().cuda()
    q_pe = (torch.randn(1, 1, heads, fmt.ROPE_DIM, generator=gen) * q_std).bfloat16().cuda()
    seq_lens = torch.tensor([n], dtype=torch.int32).cuda()
    scale = fmt.HEAD_SIZE ** -0.5
    q8, qs, qpe = reference.quantize_q(q, q_pe)
    ref_out, ref_lse = reference.decode_quantized(q8, qs, qpe, cache, block_table, seq_lens, scale)
    exact_out, _ = reference.decode(q, q_pe, cache, block_table, seq_lens, scale, exact=True)
    row = {"N": n, "H": heads, "q_std": q_std,
           "reference_vs_exact": _rel(ref_out.float(), exact_out)}
    for promote in (True, False):
        out, lse = sm90.snapmla_decode_sm90(q8, qs, qpe, cache, block_table, seq_lens, scale,
                                            num_splits=1, schedule="free", promote_pv=promote)
        key = "promoted" if promote else "unpromoted"
        row[f"{key}_vs_reference"] = _rel(out, ref_out)
        row[f"{key}_vs_exact"] = _rel(out, exact_out)
        row[f"{key}_lse_err"] = (lse.double() - ref_lse).abs().max().item()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="out/pv_promotion", help="folder for the table and CSV")
    parser.add_argument("--heads", type=int, default=128)
    args = parser.parse_args()
    if not sm90.available():
        sys.exit("needs an sm_90 GPU and a build with SNAPMLA_ARCHS containing 90a")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for q_std in QUERY_SCALES:
        for n in CONTEXTS:
            start = time.time()
            rows.append(measure(n, args.heads, q_std, seed=n + int(10 * q_std)))
            r = rows[-1]
            print(f"N={n:6d} q_std={q_std}: vs reference {r['promoted_vs_reference']:.2e} "
                  f"promoted, {r['unpromoted_vs_reference']:.2e} unpromoted "
                  f"({time.time() - start:.0f} s)", flush=True)
    with open(out / "pv_promotion.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"# PV promotion on {torch.cuda.get_device_name()} (H={args.heads}, one request, "
             "one split)", "",
             "| N | q std | promoted vs reference | unpromoted vs reference | promoted vs exact | "
             "unpromoted vs exact | reference vs exact | LSE error (both) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['N']} | {r['q_std']} | {r['promoted_vs_reference']:.2e} | "
                     f"{r['unpromoted_vs_reference']:.2e} | {r['promoted_vs_exact']:.2e} | "
                     f"{r['unpromoted_vs_exact']:.2e} | {r['reference_vs_exact']:.2e} | "
                     f"{max(r['promoted_lse_err'], r['unpromoted_lse_err']):.1e} |")
    (out / "pv_promotion.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
