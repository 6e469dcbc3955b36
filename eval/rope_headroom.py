"""How far the RoPE-key range can grow before each KV-cache format loses accuracy, on the CPU.

    python -m eval.rope_headroom --out runs/headroom [--input capture.pt --layer 0]
        [--max-cases 8] [--exponents 0 2 4 ... 40] [--configs A,vllm_fp8,snapmla_kv,snapmla]

Takes the decode cases of one layer (a capture from ``eval.capture_vllm``, or the synthetic
layer of ``eval.fidelity``), multiplies every RoPE key by 2^e and every RoPE query by 2^-e, and
measures each configuration of ``eval.fidelity`` against float64 attention.  The scaling keeps
q_pe . k_pe, so exact attention is the same at every e; only the formats see larger keys (what
``eval.reparametrize_rope`` does to a model per channel group, here to every channel at once and
far beyond a real model's range).

Where ``fp8_snapmla`` loses: its per-token scale is ``max(amax|c_KV| / 448, amax|k_pe| / 2^24,
2^-126)``.  Until a token's RoPE abs-max reaches 2^24 / 448 (about 37,000) times its content
abs-max the first term wins: the content bytes stay the same and the RoPE part holds exactly 2^e
times the unscaled values; past it, the content is stored below the top of e4m3's range and
loses precision.  The report gives the share of cached token rows past that bound at each e
(over all the cases used: a capture's decode steps share their context, so its tokens count once
per case).

Writes ``headroom.csv`` (one row per exponent and configuration: the ranges, the share of tokens
past the bound, the error metrics), ``headroom.md`` (relative L2 per exponent and
configuration) and ``headroom.png`` (relative L2 against the RoPE-key abs-max).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

from eval import fidelity
from vllm_snapmla import format as fmt

DEFAULT_CONFIGS = ("A", "vllm_fp8", "snapmla_kv", "snapmla")
# RoPE / content abs-max ratio past which the format's scale comes from the RoPE key.
SCALE_BOUND = fmt.ROPE_PRESCALED_MAX / fmt.FP8_MAX


def scaled_cases(cases: list[dict], exponent: int) -> list[dict]:
    """The cases with RoPE keys times 2^exponent and RoPE queries times 2^-exponent (exact in
    BF16 within its range)."""
    factor = 2.0 ** exponent
    return [{**c, "k_pe": c["k_pe"] * factor, "q_pe": c["q_pe"] / factor} for c in cases]


def token_ranges(cases: list[dict]) -> dict[str, float]:
    """RoPE and content abs-max over the cases' token rows, and the share of rows whose
    RoPE/content ratio is past the scale bound."""
    kv_c = torch.cat([c["kv_c"].float() for c in cases])
    k_pe = torch.cat([c["k_pe"].float() for c in cases])
    content_max, rope_max = kv_c.abs().amax(-1), k_pe.abs().amax(-1)
    past = (rope_max > SCALE_BOUND * content_max).float().mean().item()
    return {"rope_absmax": rope_max.max().item(), "content_absmax": content_max.max().item(),
            "tokens_past_bound": past}


def study(cases: list[dict], softmax_scale: float, exponents, configs) -> list[dict]:
    rows = []
    for exponent in exponents:
        scaled = scaled_cases(cases, exponent)
        ranges = token_ranges(scaled)
        for config, metrics in fidelity.layer_fidelity(scaled, softmax_scale, configs).items():
            rows.append({"exponent": exponent, **ranges, "config": config, **metrics})
        print(f"[rope_headroom] 2^{exponent}: RoPE abs-max {ranges['rope_absmax']:.3g}, "
              f"{ranges['tokens_past_bound']:.0%} of tokens past the scale bound", flush=True)
    return rows


def write_markdown(path: Path, rows: list[dict], configs, source: str) -> None:
    lines = [f"# RoPE-key headroom of the KV-cache formats ({source})", "",
             "Relative L2 error of decode attention against float64 attention; RoPE keys times "
             "2^e, RoPE queries times 2^-e (exact attention unchanged).", "",
             "| e | RoPE abs-max | tokens past 2^24/448 | " + " | ".join(configs) + " |",
             "|---|---|---|" + "---|" * len(configs)]
    for exponent in dict.fromkeys(r["exponent"] for r in rows):
        by = {r["config"]: r for r in rows if r["exponent"] == exponent}
        first = by[configs[0]]
        lines.append(f"| {exponent} | {first['rope_absmax']:.3g} | "
                     f"{first['tokens_past_bound']:.0%} | "
                     + " | ".join(f"{by[c]['rel_l2']:.3e}" for c in configs) + " |")
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, rows: list[dict], configs) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for config in configs:
        pts = sorted((r["rope_absmax"], r["rel_l2"]) for r in rows if r["config"] == config)
        ax.plot(*zip(*pts), "o-", ms=3, label=config)
    content = rows[0]["content_absmax"]
    ax.set_xscale("log")
    ax.set_yscale("log")
    for x, text in ((fmt.FP8_MAX, " e4m3 max (448)"),
                    (SCALE_BOUND * content, " 2^24/448 × content abs-max")):
        ax.axvline(x, color="grey", ls="--", lw=0.8)
        ax.text(x, ax.get_ylim()[1], text, va="top", fontsize=8, color="grey")
    ax.set_xlabel("RoPE-key abs-max")
    ax.set_ylabel("relative L2 error vs float64 attention")
    ax.set_title("KV-cache formats against the RoPE-key range")
    ax.legend(loc="center left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.rope_headroom",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--input", default=None, help=".pt file from eval.capture_vllm "
                   "(default: eval.fidelity's synthetic layer)")
    p.add_argument("--layer", type=int, default=0, help="layer of the capture to use")
    p.add_argument("--max-cases", type=int, default=8,
                   help="cases of the layer to use, at least 1 (CPU time)")
    p.add_argument("--exponents", type=int, nargs="+", default=list(range(0, 41, 2)))
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    p.add_argument("--out", default="runs/headroom")
    opts = p.parse_args(argv)
    if opts.max_cases < 1:
        p.error(f"--max-cases must be at least 1, got {opts.max_cases}")
    configs = [c for c in opts.configs.split(",") if c]
    if unknown := set(configs) - set(fidelity.CONFIGS):
        p.error(f"unknown configs {sorted(unknown)}; available: {fidelity.CONFIGS}")
    if opts.input:
        capture = torch.load(opts.input, map_location="cpu", weights_only=False)
        source = f"{opts.input}, layer {opts.layer}"
    else:
        capture = fidelity.synthetic_capture(num_layers=1, num_queries=32)
        source = "eval.fidelity's synthetic layer, 32 queries"
    if not 0 <= opts.layer < len(capture["layers"]):
        p.error(f"--layer {opts.layer}: the capture has {len(capture['layers'])} layers")
    cases = capture["layers"][opts.layer]["cases"][:opts.max_cases]
    if not cases:
        p.error(f"layer {opts.layer} has no decode cases")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = study(cases, capture["softmax_scale"], opts.exponents, configs)
    with open(out / "headroom.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    write_markdown(out / "headroom.md", rows, configs, source)
    plot(out / "headroom.png", rows, configs)
    print((out / "headroom.md").read_text())
    print(f"[rope_headroom] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
