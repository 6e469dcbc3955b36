"""Give a DeepSeek-V3-architecture checkpoint large RoPE keys without changing its function.

    python -m eval.reparametrize_rope --model CKPT --out DIR --rope-absmax 1000 [--tail 1.0]
        [--seed 0] [--calibration-tokens 4096]

In MLA the decoupled RoPE key ``k_pe`` (rows 512-575 of ``kv_a_proj_with_mqa``) and every head's
RoPE query ``q_pe`` (the last 64 rows of each head's slice of ``q_b_proj``) meet only in
``q_pe . k_pe`` after the same rotation, and the rotation mixes only the two rows of one
frequency pair.  Multiplying a pair's key rows by ``alpha`` and its query rows (every head) by
``1 / alpha`` leaves every logit unchanged in exact arithmetic.  With ``alpha`` a power of two the
scaled BF16 weights are exact and so is every product, so the model computes the same logits
bit for bit (checked here), while its KV cache sees RoPE keys ``alpha`` times larger: the value
ranges of the paper's Figure 3, where RoPE keys reach about 10^3 with outlier channels while the
content stays near 10.

Rows are scaled in groups of four, ``{2j, 2j+1, 2j+32, 2j+33}`` (j < 16): a group is closed
under both RoPE pairings in use (interleaved pairs ``(2i, 2i+1)`` and NeoX pairs ``(i, i+32)``),
so the result holds whichever the model runs.  Per layer the groups' ``alpha`` are chosen so that
the largest post-RoPE key magnitude of group g lands near ``rope_absmax * (g'+1) ** -tail`` (g' the
group's rank in a seeded order): one group reaches the target, a few carry the tail, the rest
stay near their natural size or grow little.  Magnitudes are measured on the checkpoint's held-out
tokens run through the model (transformers, CPU is fine for the tiny models).

Writes a checkpoint to ``--out`` (weights, config and tokenizer) and
``--out/reparametrization.json`` (per layer: the alphas, content and RoPE abs-max before and
after, the largest logit difference of the check).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import shutil

import torch

from eval.common import checkpoint_fingerprint

GROUPS = 16
ROPE_DIM = 64
KV_LORA_RANK = 512


def group_rows(g: int) -> list[int]:
    """RoPE rows of group g: closed under interleaved and NeoX pairing."""
    return [2 * g, 2 * g + 1, 2 * g + 32, 2 * g + 33]


def calibration_tokens(model_dir: pathlib.Path, count: int) -> torch.Tensor:
    """``count`` held-out tokens: the checkpoint's ``heldout_tokens.npy`` (written by
    ``eval.train_tiny_mla``), else standard-library sources in the model's vocabulary."""
    import sysconfig

    import numpy as np
    from tokenizers import Tokenizer

    heldout = model_dir / "heldout_tokens.npy"
    if heldout.exists():
        return torch.from_numpy(np.load(heldout)[:count].astype(np.int64))[None]

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for path in sorted(stdlib.glob("*.py"), reverse=True):
        ids += tokenizer.encode(path.read_text(errors="replace")).ids
        if len(ids) >= count:
            break
    return torch.tensor(ids[:count])[None]


def load_model(model_dir: pathlib.Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    return model.eval()


def attention_modules(model):
    return [layer.self_attn for layer in model.model.layers]


@torch.no_grad()
def measure(model, tokens: torch.Tensor) -> list[dict]:
    """Per layer: content abs-max (after its norm), RoPE-key abs-max before the rotation, and
    per group the largest RoPE-key pair norm (which bounds the pair's rotated values and is
    reached by some rotation)."""
    captured: list[torch.Tensor] = []
    hooks = [attn.kv_a_proj_with_mqa.register_forward_hook(
        lambda _m, _i, out: captured.append(out.float()))
        for attn in attention_modules(model)]
    try:
        model(tokens)
    finally:
        for h in hooks:
            h.remove()
    stats = []
    for attn, kv in zip(attention_modules(model), captured):
        content = attn.kv_a_layernorm(kv[..., :KV_LORA_RANK].to(torch.bfloat16)).float()
        rope = kv[..., KV_LORA_RANK:KV_LORA_RANK + ROPE_DIM].reshape(-1, ROPE_DIM)
        groups = []
        for g in range(GROUPS):
            r = group_rows(g)
            # Both pairings' pair norms; the larger is what a rotation can reach.
            inter = torch.hypot(rope[:, r[0]], rope[:, r[1]]).amax()
            inter2 = torch.hypot(rope[:, r[2]], rope[:, r[3]]).amax()
            neox = torch.hypot(rope[:, r[0]], rope[:, r[2]]).amax()
            neox2 = torch.hypot(rope[:, r[1]], rope[:, r[3]]).amax()
            groups.append(float(max(inter, inter2, neox, neox2)))
        stats.append({"content_absmax": float(content.abs().amax()),
                      "rope_absmax": float(rope.abs().amax()), "group_absmax": groups})
    return stats


def choose_alphas(group_absmax: list[float], rope_absmax: float, tail: float,
                  gen: torch.Generator) -> list[float]:
    """Powers of two: group of rank k aims at ``rope_absmax * (k+1) ** -tail``, never shrinks."""
    order = torch.randperm(GROUPS, generator=gen).tolist()
    alphas = [1.0] * GROUPS
    for rank, g in enumerate(order):
        target = rope_absmax * (rank + 1) ** -tail
        natural = max(group_absmax[g], 1e-30)
        alphas[g] = 2.0 ** max(0, round(math.log2(target / natural)))
    return alphas


@torch.no_grad()
def apply_alphas(model, layer_alphas: list[list[float]]) -> None:
    config = model.config
    q_head = config.qk_nope_head_dim + config.qk_rope_head_dim
    for attn, alphas in zip(attention_modules(model), layer_alphas):
        kv_w = attn.kv_a_proj_with_mqa.weight          # [512 + 64, hidden]
        q_proj = attn.q_b_proj if getattr(attn, "q_b_proj", None) is not None else attn.q_proj
        q_w = q_proj.weight                              # [heads * 192, q_lora or hidden]
        if any(alpha != 1.0 for alpha in alphas):
            # A bias would need the same scaling; DeepSeek's projections have none.
            for bias, rows in ((getattr(attn.kv_a_proj_with_mqa, "bias", None), "kv"),
                               (getattr(q_proj, "bias", None), "q")):
                if bias is not None:
                    raise ValueError(f"{rows} projection has a bias: not handled")
        for g, alpha in enumerate(alphas):
            if alpha == 1.0:
                continue
            for r in group_rows(g):
                kv_w[KV_LORA_RANK + r] *= alpha
                for h in range(config.num_attention_heads):
                    q_w[h * q_head + config.qk_nope_head_dim + r] /= alpha


def save(model, source: pathlib.Path, out: pathlib.Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    weights = {name: t.detach().to(torch.bfloat16).contiguous()
               for name, t in model.state_dict().items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "train_log.json":
            shutil.copy(path, out / path.name)


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = report["layers"]
    x = list(range(len(layers)))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    ax.plot(x, [l["before"]["content_absmax"] for l in layers], "o-", label="content (both)")
    ax.plot(x, [l["before"]["rope_absmax"] for l in layers], "s--", label="RoPE key, original")
    ax.plot(x, [l["after"]["rope_absmax"] for l in layers], "s-", label="RoPE key, reparametrized")
    ax.axhline(448, color="grey", lw=0.8, ls=":")
    ax.text(0, 448 * 1.15, "e4m3 max (448)", color="grey", fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xlabel("layer")
    ax.set_ylabel("abs-max over held-out tokens")
    ax.set_title(f"KV-cache value ranges (target RoPE abs-max {report['rope_absmax']:g})")
    ax.legend(fontsize=8)
    # The channel groups of the layer with the largest keys: a few carry the tail.
    top = max(range(len(layers)), key=lambda i: layers[i]["after"]["rope_absmax"])
    g = list(range(GROUPS))
    bx.bar([i - 0.2 for i in g], layers[top]["before"]["group_absmax"], 0.4, label="original")
    bx.bar([i + 0.2 for i in g], layers[top]["after"]["group_absmax"], 0.4,
           label="reparametrized")
    bx.set_yscale("log")
    bx.set_xlabel("RoPE channel group (4 channels)")
    bx.set_title(f"layer {top}: largest pair norm per group", fontsize=10)
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.reparametrize_rope",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=pathlib.Path, help="checkpoint directory")
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--rope-absmax", required=True, type=float,
                        help="target largest RoPE-key magnitude per layer (e.g. 10, 100, 1000)")
    parser.add_argument("--tail", type=float, default=1.0,
                        help="group k of 16 aims at rope_absmax * (k+1)**-tail (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calibration-tokens", type=int, default=4096)
    args = parser.parse_args(argv)
    if args.rope_absmax <= 0:
        parser.error("--rope-absmax must be positive")

    tokens = calibration_tokens(args.model, args.calibration_tokens)
    model = load_model(args.model)
    before = measure(model, tokens)
    with torch.no_grad():
        logits_before = model(tokens).logits.float()
    gen = torch.Generator().manual_seed(args.seed)
    alphas = [choose_alphas(s["group_absmax"], args.rope_absmax, args.tail, gen) for s in before]
    apply_alphas(model, alphas)
    after = measure(model, tokens)
    with torch.no_grad():
        logits_after = model(tokens).logits.float()
    diff = float((logits_after - logits_before).abs().max())
    nll = [float(torch.nn.functional.cross_entropy(lg[0, :-1], tokens[0, 1:]))
           for lg in (logits_before, logits_after)]
    save(model, args.model, args.out)
    report = {
        "source": str(args.model), "source_fingerprint": checkpoint_fingerprint(args.model),
        "rope_absmax": args.rope_absmax, "tail": args.tail,
        "seed": args.seed, "calibration_tokens": int(tokens.shape[1]),
        "max_abs_logit_difference": diff, "nll_before": nll[0], "nll_after": nll[1],
        "layers": [{"alphas": a, "before": b, "after": c}
                   for a, b, c in zip(alphas, before, after)],
    }
    (args.out / "reparametrization.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "value_range.png")
    print(f"wrote {args.out}: RoPE abs-max per layer "
          f"{[round(l['before']['rope_absmax'], 1) for l in report['layers']]} -> "
          f"{[round(l['after']['rope_absmax'], 1) for l in report['layers']]}; content "
          f"{[round(l['after']['content_absmax'], 1) for l in report['layers']]}; "
          f"largest logit change {diff:.3g}, NLL {nll[0]:.5f} -> {nll[1]:.5f}")


if __name__ == "__main__":
    main()
