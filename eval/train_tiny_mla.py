"""Train a small DeepSeek-V3-architecture (MLA) model on the Python standard library's source.

The result is a real model with trained weights for KV-cache accuracy comparisons in vLLM
(``eval.parity_tiny``, ``eval.lm_eval_tiny``): MLA with the DeepSeek-V3 latent layout
(kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, q_lora_rank set,
so vLLM takes its fused q_a/kv_a path), a dense MLP in every layer, ~50M parameters,
2048-token context.

Data: Python source available offline.  The held-out set is a seeded 5% of the standard library's
``*.py`` files (``sysconfig.get_paths()["stdlib"]``); training uses the other stdlib files plus,
with ``--data python`` (the default), the ``*.py`` files of this interpreter's site-packages
(torch, transformers, numpy, ...: the stdlib alone is ~2.6M tokens, which a 50M model memorises
within a minute on an H200), minus any file whose text equals a held-out file's, up to
``--max-train-chars``.  Tokenizer: byte-level BPE trained on (a prefix of) the training text with
the ``tokenizers`` package.  The held-out loss is measured every 250 steps and the checkpoint
saved is the step with the lowest one (early stopping).

    python -m eval.train_tiny_mla --out build/tiny-mla --max-steps 1750 --minutes 8 --seed 0
    python -m eval.train_tiny_mla --out /tmp/tiny-mla-smoke --smoke      # CPU, seconds

``--out`` becomes a Hugging Face checkpoint directory that vLLM and transformers load directly
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json), plus ``heldout_tokens.npy`` (held-out files' token ids, each file
followed by EOS) and ``train_log.json``.  ``--minutes`` bounds the whole run: training stops
early enough to leave time for the held-out evaluation and saving.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import subprocess
import sys
import sysconfig
import time

import numpy as np
import torch
import torch.nn.functional as F

from vllm_snapmla.testing import TINY_DEEPSEEK_V3

BOS, EOS = "<|bos|>", "<|eos|>"   # ids 0 and 1: the first special tokens given to the trainer

# The vLLM-facing shape is vllm_snapmla.testing.TINY_DEEPSEEK_V3's (known to load in vLLM
# 0.26): no `head_dim` (transformers ties it to qk_rope_head_dim), no `index_topk` (that would
# be V3.2 sparse attention), default RoPE, silu.  Dense everywhere by first_k_dense_replace =
# num_hidden_layers, which both transformers and vLLM (deepseek_v2.py: MoE iff layer_idx >=
# first_k_dense_replace) honour; n_routed_experts stays set because vLLM's load_weights does
# arithmetic on it, but no expert is built or saved.
MODEL_CONFIG = {
    **TINY_DEEPSEEK_V3,
    "vocab_size": 12288, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 8, "first_k_dense_replace": 8,
    "initializer_range": 0.02,
}
# The smoke model keeps the MLA dimensions (what the KV cache sees) and shrinks the rest.
SMOKE_OVERRIDES = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
                   "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                   "q_lora_rank": 64, "first_k_dense_replace": 2,
                   "max_position_embeddings": 2048}


def log(msg: str) -> None:
    print(msg, flush=True)


def stdlib_files() -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))


def site_package_files() -> list[pathlib.Path]:
    """``*.py`` under this interpreter's site-packages (purelib/platlib), sorted, deduplicated."""
    roots = {pathlib.Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    found = set()
    for root in sorted(roots):
        if root.is_dir():
            found.update(p for p in root.rglob("*.py") if p.is_file())
    return sorted(found)


def read_text(path: pathlib.Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    assert tokenizer.token_to_id(BOS) == 0 and tokenizer.token_to_id(EOS) == 1
    return tokenizer


def encode_files(tokenizer, texts: list[str]) -> np.ndarray:
    """Token ids of ``texts``, each followed by EOS, concatenated."""
    eos = tokenizer.token_to_id(EOS)
    ids = [np.array(e.ids + [eos], dtype=np.int32) for e in tokenizer.encode_batch(texts)]
    return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32)


def git_commit() -> str:
    repo = pathlib.Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine to 10% of ``peak`` over ``progress`` in [0, 1]."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


@torch.no_grad()
def heldout_loss(model, tokens: torch.Tensor, seq_len: int, max_windows: int, batch: int,
                 device: torch.device, autocast) -> float:
    """Mean next-token loss over non-overlapping ``seq_len`` windows of ``tokens``."""
    n = min(max_windows, (len(tokens) - 1) // seq_len)
    if n == 0:
        raise ValueError(f"held-out split has {len(tokens)} tokens, fewer than one window")
    model.eval()
    total, count = 0.0, 0
    for start in range(0, n, batch):
        rows = [tokens[i * seq_len:(i + 1) * seq_len + 1]
                for i in range(start, min(n, start + batch))]
        chunk = torch.stack(rows).to(device, dtype=torch.long)
        with autocast():
            logits = model(input_ids=chunk[:, :-1]).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(),
                                 reduction="sum").item()
        count += chunk[:, 1:].numel()
    model.train()
    return total / count


def save_checkpoint(out: pathlib.Path, model, config: dict, tokenizer) -> None:
    from safetensors.torch import save_file

    # Checkpoint names are the model's own (transformers' DeepseekV3ForCausalLM), which are
    # DeepSeek-V3's: vLLM's loader fuses q_a_proj/kv_a_proj_with_mqa and gate/up itself.
    weights = {name: t.detach().to(torch.bfloat16).contiguous().cpu()
               for name, t in model.state_dict().items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]},
        indent=1))
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"]}, indent=1))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.train_tiny_mla",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=pathlib.Path, help="checkpoint directory")
    parser.add_argument("--minutes", type=float, default=8.0,
                        help="wall-clock budget for the whole run (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, few steps, short sequences, a few files (CPU is fine)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 2048 (smoke: 64)")
    parser.add_argument("--batch", type=int, default=None,
                        help="sequences per step (default 32; smoke: 4)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop after this many steps (default: budget only; smoke: 40)")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak LR (default 1e-3; smoke 3e-3)")
    parser.add_argument("--heldout-fraction", type=float, default=0.05)
    parser.add_argument("--data", choices=("python", "stdlib"), default="python",
                        help="training text: stdlib + site-packages sources (default) or the "
                             "stdlib alone (held-out files are stdlib files either way)")
    parser.add_argument("--max-train-chars", type=float, default=100e6,
                        help="cap on training characters (default 100e6)")
    parser.add_argument("--tokenizer-chars", type=float, default=30e6,
                        help="characters of training text the BPE tokenizer learns from")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--reserve-s", type=float, default=None,
                        help="seconds of the budget kept for held-out eval and saving "
                             "(default 45; smoke: 0)")
    args = parser.parse_args(argv)
    t_start = time.monotonic()
    budget_s = args.minutes * 60
    smoke = args.smoke
    seq_len = args.seq_len or (64 if smoke else 2048)
    batch = args.batch or (4 if smoke else 32)
    max_steps = args.max_steps or (40 if smoke else None)
    peak_lr = args.lr or (3e-3 if smoke else 1e-3)
    reserve_s = args.reserve_s if args.reserve_s is not None else (0.0 if smoke else 45.0)
    config = {**MODEL_CONFIG, **(SMOKE_OVERRIDES if smoke else {})}
    if seq_len > config["max_position_embeddings"]:
        parser.error("--seq-len exceeds max_position_embeddings")

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)

    # --- data: split by file, tokenizer on the training files only -------------------------
    files = stdlib_files()
    random.Random(args.seed).shuffle(files)
    if smoke:
        files = files[:80]
    n_heldout = max(1, round(args.heldout_fraction * len(files))) if not smoke else 8
    heldout_files, train_files = files[:n_heldout], files[n_heldout:]
    heldout_texts = [read_text(p) for p in heldout_files]
    if args.data == "python" and not smoke:
        # Site-packages after the stdlib, in a seeded order; exact copies of held-out files
        # (vendored stdlib modules) are dropped so the held-out text stays unseen.
        extra = site_package_files()
        random.Random(args.seed + 1).shuffle(extra)
        train_files = train_files + extra
    heldout_set = set(heldout_texts)
    train_texts, chars, skipped = [], 0, 0
    for path in train_files:
        text = read_text(path)
        if text in heldout_set or not text.strip():
            skipped += 1
            continue
        if chars + len(text) > args.max_train_chars:
            break
        train_texts.append(text)
        chars += len(text)
    log(f"data: {len(train_texts)} training files ({skipped} empty or copies of held-out files "
        f"skipped), {len(heldout_files)} held-out stdlib files "
        f"({chars / 1e6:.1f}M / {sum(map(len, heldout_texts)) / 1e6:.2f}M characters); "
        f"stdlib {sysconfig.get_paths()['stdlib']}")
    tok_texts, tok_chars = [], 0
    for text in train_texts:
        if tok_chars >= args.tokenizer_chars:
            break
        tok_texts.append(text)
        tok_chars += len(text)
    tokenizer = train_tokenizer(tok_texts, config["vocab_size"])
    config["vocab_size"] = tokenizer.get_vocab_size()
    train_tokens = torch.from_numpy(encode_files(tokenizer, train_texts))
    heldout_np = encode_files(tokenizer, heldout_texts)
    np.save(args.out / "heldout_tokens.npy", heldout_np)
    heldout_tokens = torch.from_numpy(heldout_np)
    log(f"tokenizer: vocab {config['vocab_size']}; {len(train_tokens):,} training tokens, "
        f"{len(heldout_tokens):,} held-out tokens ({time.monotonic() - t_start:.1f}s)")

    # --- model ------------------------------------------------------------------------------
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hf_config = DeepseekV3Config(**{k: v for k, v in config.items()
                                    if k not in ("architectures", "torch_dtype")})
    hf_config._attn_implementation = "sdpa"
    model = DeepseekV3ForCausalLM(hf_config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: DeepseekV3ForCausalLM, {n_params / 1e6:.1f}M parameters, "
        f"{config['num_hidden_layers']} dense layers, device {device}")
    use_cuda = device.type == "cuda"

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_cuda)

    forward = torch.compile(model) if args.compile else model
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=peak_lr, betas=(0.9, 0.95), eps=1e-8, fused=use_cuda)
    sampler = torch.Generator().manual_seed(args.seed)
    train_on_device = train_tokens.to(device, dtype=torch.long)
    offsets = torch.arange(seq_len + 1, device=device)
    eval_every = 20 if smoke else 250
    warmup = 10 if smoke else 100
    train_deadline = budget_s - reserve_s

    # --- training -----------------------------------------------------------------------------
    step, tokens_seen, history, heldout_history = 0, 0, [], []
    best = None   # (held-out loss, step, weights on the GPU) of the best evaluated step
    t_train = time.monotonic()
    t_window, tokens_window = t_train, 0
    while True:
        elapsed = time.monotonic() - t_start
        if (max_steps is not None and step >= max_steps) or elapsed >= train_deadline:
            break
        train_budget = max(train_deadline - (t_train - t_start), 1e-9)
        progress = max(step / max_steps if max_steps else 0.0,
                       (time.monotonic() - t_train) / train_budget)
        lr = lr_at(step, progress, peak_lr, warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train_tokens) - seq_len - 1, (batch, 1), generator=sampler)
        rows = train_on_device[starts.to(device) + offsets]
        with autocast():
            logits = forward(input_ids=rows[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        tokens_seen += rows[:, 1:].numel()
        tokens_window += rows[:, 1:].numel()
        if step == 1 or step % (5 if smoke else 25) == 0:
            loss_value = loss.item()   # synchronises, so the rate below is real
            now = time.monotonic()
            history.append([step, loss_value])
            log(f"step {step:5d}  loss {loss_value:.4f}  lr {lr:.2e}  "
                f"{tokens_window / (now - t_window):,.0f} tok/s  elapsed {now - t_start:.0f}s")
            t_window, tokens_window = now, 0
        if step % eval_every == 0:   # over-fitting watch, and the early-stopping candidates
            held = heldout_loss(model, heldout_tokens, seq_len, max_windows=8, batch=batch,
                                device=device, autocast=autocast)
            heldout_history.append([step, held])
            if best is None or held < best[0]:
                best = (held, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
            log(f"step {step:5d}  held-out loss {held:.4f} (8 windows)"
                + ("  best so far" if best[1] == step else ""))
            t_window, tokens_window = time.monotonic(), 0
    if step == 0:
        raise SystemExit(f"no training step fitted in --minutes {args.minutes} "
                         f"(reserve {reserve_s:.0f}s)")
    if history[-1][0] != step:
        history.append([step, loss.item()])
    train_s = time.monotonic() - t_train

    # --- evaluation and saving -------------------------------------------------------------
    final_train_loss = float(np.mean([l for _, l in history[-4:]]))
    last8 = heldout_loss(model, heldout_tokens, seq_len, max_windows=8, batch=batch,
                         device=device, autocast=autocast)
    selected_step = step
    if best is not None and best[0] < last8:
        model.load_state_dict(best[2])
        selected_step = best[1]
        log(f"early stopping: keeping step {best[1]} (held-out {best[0]:.4f} < {last8:.4f} "
            f"at the last step {step})")
    best = None
    held = heldout_loss(model, heldout_tokens, seq_len, max_windows=8 if smoke else 64,
                        batch=batch, device=device, autocast=autocast)
    log(f"held-out loss {held:.4f} (ppl {math.exp(held):.2f}); last train loss "
        f"{history[-1][1]:.4f}")
    save_checkpoint(args.out, model, config, tokenizer)
    train_log = {
        "steps": step, "selected_step": selected_step, "tokens_seen": tokens_seen,
        "train_seconds": round(train_s, 1),
        "wall_seconds": round(time.monotonic() - t_start, 1),
        "tokens_per_second": round(tokens_seen / max(train_s, 1e-9)),
        "final_train_loss": final_train_loss, "heldout_loss": held,
        "heldout_perplexity": math.exp(held), "loss_history": history,
        "heldout_loss_history": heldout_history,
        "parameters": n_params, "seq_len": seq_len, "batch": batch, "peak_lr": peak_lr,
        "seed": args.seed, "smoke": smoke, "compile": args.compile,
        "device": torch.cuda.get_device_name() if use_cuda else "cpu",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "python": sys.version.split()[0], "git_commit": git_commit(),
        "data": {"source": args.data, "stdlib": sysconfig.get_paths()["stdlib"],
                 "train_files": len(train_texts), "train_characters": chars,
                 "tokenizer_characters": tok_chars,
                 "heldout_files": sorted(str(p.relative_to(sysconfig.get_paths()["stdlib"]))
                                         for p in heldout_files),
                 "train_tokens": len(train_tokens), "heldout_tokens": len(heldout_tokens)},
        "config": config,
    }
    (args.out / "train_log.json").write_text(json.dumps(train_log, indent=1))
    log(f"saved {args.out} ({train_log['wall_seconds']}s total, {step} steps, "
        f"{tokens_seen:,} tokens)")


if __name__ == "__main__":
    main()
