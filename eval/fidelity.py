"""Layer-wise numerical fidelity of KV-cache quantization schemes (paper Appendix G, Figure 3/5).

For every layer, the attention output of each configuration is compared with exact attention
(float64 over the BF16 inputs).  Configurations (paper Table 3 plus vLLM's ``fp8`` and ours):

    A            per-token FP8 of the whole 576-wide row, RoPE included
    B            per-tensor FP8 content, RoPE kept in BF16
    C            per-channel FP8 content, RoPE in BF16
    D            per-block (64 tokens x 128 channels) FP8 content, RoPE in BF16
    vllm_fp8     vLLM ``--kv-cache-dtype fp8`` as its FlashMLA path runs by default: per-tensor
                 FP8 of Q and of the whole row incl. RoPE, scale 1.0
    vllm_fp8_amax  the same with calibrated per-tensor scales amax/448 (Q and KV separately)
    snapmla_kv   the ``fp8_snapmla`` cache alone: per-token FP8 content, RoPE in BF16 pre-divided
                 by the token's scale, read with the exact query (storage error only)
    snapmla      ``vllm_snapmla.reference.decode`` (FP8 Q, K, V and P) on a ``quantize_kv`` cache

A-D, snapmla_kv and the vLLM schemes run float64 attention over the dequantized operands, so they
isolate the storage error (the vLLM ones also quantize Q); snapmla is the whole decode algorithm,
FP8 Q and FP8 P included.

Input: a ``.pt`` file from ``eval.capture_vllm`` (or ``--synthetic``) holding, per layer, a list
of cases ``{q_nope [T,H,512], q_pe [T,H,64], kv_c [N,512], k_pe [N,64]}`` (BF16; every query
attends to all N tokens) and the model's ``softmax_scale``.
Output in ``--out``: ``fidelity.md``, ``fidelity.csv``, ``fidelity.png`` (metric vs layer, log y)
and ``value_range.png`` / ``value_range.csv`` (content vs RoPE magnitudes per layer).

    python -m eval.fidelity --synthetic --out runs/fidelity_synth
    python -m eval.fidelity --input runs/capture.pt --out runs/fidelity
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

import torch

from vllm_snapmla import format as fmt
from vllm_snapmla import reference

CONFIGS = ("A", "B", "C", "D", "vllm_fp8", "vllm_fp8_amax", "snapmla_kv", "snapmla")
METRICS = ("rmse", "cos_diff", "rel_l2")
BLOCK_TOKENS, BLOCK_CHANNELS = 64, 128
_E4M3 = torch.float8_e4m3fn


def _fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Quantize-dequantize ``x`` with ``scale`` (broadcast), saturating at +-448; float64 out."""
    scale = torch.as_tensor(scale, dtype=torch.float32)
    q = (x.float() / scale).clamp(-fmt.FP8_MAX, fmt.FP8_MAX).to(_E4M3)
    return q.double() * scale.double()


def _amax_scale(x: torch.Tensor, dim=None, keepdim=True) -> torch.Tensor:
    amax = x.float().abs() if dim is None else x.float().abs().amax(dim=dim, keepdim=keepdim)
    if dim is None:
        amax = amax.max()
    return torch.clamp_min(amax / fmt.FP8_MAX, fmt.SCALE_FLOOR)


def _per_block(content: torch.Tensor) -> torch.Tensor:
    """FP8 with one scale per 64-token x 128-channel tile (the last token tile may be partial)."""
    n, d = content.shape
    pad = (-n) % BLOCK_TOKENS
    x = torch.cat([content.float(), content.new_zeros(pad, d).float()]) if pad else content.float()
    tiles = x.view(-1, BLOCK_TOKENS, d // BLOCK_CHANNELS, BLOCK_CHANNELS)
    scale = _amax_scale(tiles, dim=(1, 3))
    return _fp8(tiles, scale).view(-1, d)[:n]


def quantized_kv(config: str, kv_c: torch.Tensor, k_pe: torch.Tensor):
    """Dequantized ``(content, rope)`` float64 as stored by ``config`` (not for snapmla)."""
    rope_bf16 = k_pe.double()
    if config == "A":
        row = torch.cat([kv_c, k_pe], -1)
        deq = _fp8(row, _amax_scale(row, dim=-1))
        return deq[:, :fmt.KV_LORA_RANK], deq[:, fmt.KV_LORA_RANK:]
    if config == "B":
        return _fp8(kv_c, _amax_scale(kv_c)), rope_bf16
    if config == "C":
        return _fp8(kv_c, _amax_scale(kv_c, dim=0)), rope_bf16
    if config == "D":
        return _per_block(kv_c), rope_bf16
    if config in ("vllm_fp8", "vllm_fp8_amax"):
        row = torch.cat([kv_c, k_pe], -1)
        deq = _fp8(row, 1.0 if config == "vllm_fp8" else _amax_scale(row))
        return deq[:, :fmt.KV_LORA_RANK], deq[:, fmt.KV_LORA_RANK:]
    if config == "snapmla_kv":
        content, rope = reference.dequantize_kv(reference.quantize_kv(kv_c, k_pe))
        return content.double(), rope.double()
    raise ValueError(f"unknown config {config!r}")


def quantized_q(config: str, q_nope: torch.Tensor, q_pe: torch.Tensor):
    """The query each config computes with: BF16 for A-D, per-tensor FP8 for vLLM's fp8."""
    if config in ("vllm_fp8", "vllm_fp8_amax"):
        q = torch.cat([q_nope, q_pe], -1)
        deq = _fp8(q, 1.0 if config == "vllm_fp8" else _amax_scale(q))
        return deq[..., :fmt.KV_LORA_RANK], deq[..., fmt.KV_LORA_RANK:]
    return q_nope.double(), q_pe.double()


def attention(q_nope, q_pe, content, rope, softmax_scale: float) -> torch.Tensor:
    """Float64 MLA decode attention, every query over all tokens: ``[T,H,512]``."""
    logits = (torch.einsum("thd,nd->thn", q_nope.double(), content.double())
              + torch.einsum("thd,nd->thn", q_pe.double(), rope.double())) * softmax_scale
    return torch.einsum("thn,nd->thd", torch.softmax(logits, -1), content.double())


def snapmla_attention(q_nope, q_pe, kv_c, k_pe, softmax_scale: float) -> torch.Tensor:
    """The SnapMLA reference decode over a ``quantize_kv`` cache of the N tokens."""
    n = kv_c.shape[0]
    pages = (n + fmt.PAGE_SIZE - 1) // fmt.PAGE_SIZE
    cache = torch.zeros(pages * fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN, dtype=torch.uint8)
    cache[:n] = reference.quantize_kv(kv_c, k_pe)
    block_table = torch.arange(pages, dtype=torch.int32)[None]
    out, _ = reference.decode(q_nope[None], q_pe[None], cache.view(pages, fmt.PAGE_SIZE, -1),
                              block_table, torch.tensor([n], dtype=torch.int32), softmax_scale,
                              causal=False)
    return out[0]


def config_output(config, q_nope, q_pe, kv_c, k_pe, softmax_scale) -> torch.Tensor:
    if config == "snapmla":
        return snapmla_attention(q_nope, q_pe, kv_c, k_pe, softmax_scale)
    qn, qr = quantized_q(config, q_nope, q_pe)
    content, rope = quantized_kv(config, kv_c, k_pe)
    return attention(qn, qr, content, rope, softmax_scale)


def error_metrics(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    diff = (out - ref).flatten()
    ref, out = ref.flatten(), out.flatten()
    cos = torch.dot(out, ref) / (out.norm() * ref.norm()).clamp_min(1e-300)
    return {"rmse": diff.square().mean().sqrt().item(),
            "cos_diff": (1.0 - cos).item(),
            "rel_l2": (diff.norm() / ref.norm().clamp_min(1e-300)).item()}


def layer_fidelity(cases: list[dict], softmax_scale: float,
                   configs=CONFIGS) -> dict[str, dict[str, float]]:
    """Metrics of every config on one layer, over all of its cases' outputs together."""
    refs, outs = [], {c: [] for c in configs}
    for case in cases:
        args = (case["q_nope"], case["q_pe"], case["kv_c"], case["k_pe"])
        refs.append(attention(*args, softmax_scale).flatten())
        for c in configs:
            outs[c].append(config_output(c, *args, softmax_scale).flatten())
    ref = torch.cat(refs)
    return {c: error_metrics(torch.cat(outs[c]), ref) for c in configs}


def value_ranges(cases: list[dict]) -> dict[str, float]:
    """Figure 3 statistics of one layer: abs-max and percentiles of content and RoPE keys."""
    kv_c = torch.cat([c["kv_c"].float().flatten() for c in cases]).abs()
    k_pe = torch.cat([c["k_pe"].float().flatten() for c in cases]).abs()
    stats = {}
    for name, x in (("content", kv_c), ("rope", k_pe)):
        sample = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))[:1 << 20]]
        stats[f"{name}_absmax"] = x.max().item()
        for p in (50, 99, 99.9):
            stats[f"{name}_p{p}"] = torch.quantile(sample, p / 100).item()
    return stats


# ----------------------------------------------------------------------------- synthetic inputs

def synthetic_capture(num_layers: int = 8, num_tokens: int = 512, num_heads: int = 8,
                      num_queries: int = 2, seed: int = 0) -> dict:
    """Inputs with the structure the paper shows (Figure 3) so the study runs without a model.

    Content: small-range Gaussian rows (|c| of order 0.1-1) with a log-normal per-token magnitude,
    so tokens differ in range (what per-token scales exploit).  RoPE: unit Gaussian plus a few
    low-frequency channels that rotate slowly with position, so they are large in both q_pe and
    k_pe and nearly constant over the context (2% per-token jitter); their magnitude grows with
    depth from ~10 to ~1e3.
    Their q.k product is a large logit offset that cancels in softmax when stored exactly but
    whose quantization error does not, which is why quantizing RoPE in FP8 hurts deep layers.
    The varying parts of the logits (content, ordinary RoPE channels) have std ~1.5 each.
    """
    g = torch.Generator().manual_seed(seed)
    softmax_scale = 1.0 / math.sqrt(192.0)
    pos = torch.arange(num_tokens, dtype=torch.float32)[:, None]
    num_outliers = 4
    layers = []
    for layer in range(num_layers):
        depth = layer / max(num_layers - 1, 1)
        token_mag = torch.exp(0.7 * torch.randn(num_tokens, 1, generator=g))
        kv_c = 0.1 * token_mag * torch.randn(num_tokens, fmt.KV_LORA_RANK, generator=g)
        k_pe = torch.randn(num_tokens, fmt.ROPE_DIM, generator=g)
        q_nope = torch.randn(num_queries, num_heads, fmt.KV_LORA_RANK, generator=g)
        q_pe = torch.randn(num_queries, num_heads, fmt.ROPE_DIM, generator=g)
        for q, k in ((q_nope, kv_c), (q_pe, k_pe)):
            q *= 1.5 / (torch.einsum("thd,nd->thn", q, k) * softmax_scale).std()
        channels = torch.randperm(fmt.ROPE_DIM, generator=g)[:num_outliers]
        amplitude = 10.0 ** (1.0 + 2.0 * depth) * (0.5 + torch.rand(num_outliers, generator=g))
        phase = 2 * math.pi * torch.rand(num_outliers, generator=g)
        jitter = 1.0 + 0.02 * torch.randn(num_tokens, num_outliers, generator=g)
        k_pe[:, channels] = amplitude * jitter * torch.cos(1e-4 * pos + phase)
        # Query outliers aligned with the keys' signs: together a logit offset of
        # 10**(1 + depth) nats shared by all tokens.
        offset = 10.0 ** (1.0 + depth)
        q_out = torch.sign(k_pe[0, channels]) * offset / (
            softmax_scale * num_outliers * k_pe[:, channels].abs().mean(0))
        q_pe[:, :, channels] = q_out
        layers.append({"name": f"layer.{layer}", "cases": [{
            "q_nope": q_nope.bfloat16(), "q_pe": q_pe.bfloat16(),
            "kv_c": kv_c.bfloat16(), "k_pe": k_pe.bfloat16()}]})
    return {"softmax_scale": softmax_scale, "layers": layers,
            "meta": {"source": "synthetic", "seed": seed}}


# ----------------------------------------------------------------------------- outputs

def run_study(capture: dict, configs=CONFIGS) -> tuple[list[dict], list[dict]]:
    """``(metric rows, value-range rows)``, one row per layer and config / per layer."""
    rows, ranges = [], []
    for index, layer in enumerate(capture["layers"]):
        cases = layer["cases"]
        if not cases:
            continue
        for config, metrics in layer_fidelity(cases, capture["softmax_scale"], configs).items():
            rows.append({"layer": index, "name": layer["name"], "config": config, **metrics})
        ranges.append({"layer": index, "name": layer["name"], **value_ranges(cases)})
    return rows, ranges


def _write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_markdown(path: Path, rows: list[dict], configs) -> None:
    layers = sorted({r["layer"] for r in rows})
    by = {(r["layer"], r["config"]): r for r in rows}
    lines = []
    for metric in METRICS:
        lines += [f"### {metric}", "", "| layer | " + " | ".join(configs) + " |",
                  "|---|" + "---|" * len(configs)]
        for layer in layers:
            lines.append(f"| {layer} | " + " | ".join(
                f"{by[(layer, c)][metric]:.3e}" for c in configs) + " |")
        means = [sum(by[(layer, c)][metric] for layer in layers) / len(layers) for c in configs]
        lines += ["| mean | " + " | ".join(f"{m:.3e}" for m in means) + " |", ""]
    path.write_text("\n".join(lines))


def plot(out: Path, rows: list[dict], ranges: list[dict], configs) -> list[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[fidelity] matplotlib not installed: no PNG plots (tables are written)")
        return []
    fig, axes = plt.subplots(1, len(METRICS), figsize=(6 * len(METRICS), 4.5))
    for ax, metric in zip(axes, METRICS):
        for config in configs:
            pts = sorted((r["layer"], r[metric]) for r in rows if r["config"] == config)
            ax.plot([p[0] for p in pts], [max(p[1], 1e-30) for p in pts], marker=".",
                    label=config)
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_title(metric)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    paths = [out / "fidelity.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    layer_ids = [r["layer"] for r in ranges]
    for part, colour in (("content", "tab:blue"), ("rope", "tab:red")):
        ax.plot(layer_ids, [r[f"{part}_absmax"] for r in ranges], color=colour,
                label=f"{part} abs-max")
        ax.plot(layer_ids, [r[f"{part}_p99"] for r in ranges], color=colour, linestyle="--",
                label=f"{part} p99")
        ax.plot(layer_ids, [r[f"{part}_p50"] for r in ranges], color=colour, linestyle=":",
                label=f"{part} median")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("|value|")
    ax.set_title("KV cache value range: content vs RoPE")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "value_range.png")
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.fidelity",
                                description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help=".pt file written by eval.capture_vllm")
    src.add_argument("--synthetic", action="store_true", help="generated inputs, no model")
    p.add_argument("--out", default="runs/fidelity")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--layers", type=int, default=8, help="synthetic: number of layers")
    p.add_argument("--tokens", type=int, default=512, help="synthetic: context length")
    p.add_argument("--heads", type=int, default=8, help="synthetic: query heads")
    p.add_argument("--seed", type=int, default=0, help="synthetic: random seed")
    p.add_argument("--max-cases", type=int, default=None,
                   help="use at most this many captured cases per layer (CPU time)")
    opts = p.parse_args(argv)
    configs = [c for c in opts.configs.split(",") if c]
    if unknown := set(configs) - set(CONFIGS):
        p.error(f"unknown configs {sorted(unknown)}; available: {CONFIGS}")
    if opts.synthetic:
        capture = synthetic_capture(opts.layers, opts.tokens, opts.heads, seed=opts.seed)
    else:
        capture = torch.load(opts.input, map_location="cpu", weights_only=False)
    if opts.max_cases is not None:
        for layer in capture["layers"]:
            layer["cases"] = layer["cases"][:opts.max_cases]
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, ranges = run_study(capture, configs)
    if not rows:
        print("[fidelity] the capture has no decode cases", file=sys.stderr)
        return 1
    _write_csv(out / "fidelity.csv", rows)
    _write_csv(out / "value_range.csv", ranges)
    write_markdown(out / "fidelity.md", rows, configs)
    plot(out, rows, ranges, configs)
    print((out / "fidelity.md").read_text())
    print(f"[fidelity] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
