"""KV-cache parity of the trained tiny MLA model through lm-eval (held-out perplexity, next token).

Takes the checkpoint written by ``eval.train_tiny_mla`` (with its ``heldout_tokens.npy``),
writes two local lm-eval tasks over its held-out split, and runs lm-eval 0.4.13's ``vllm``
model on them once per ``--kv`` setting (``auto`` = BF16 cache, ``fp8_snapmla``, ``fp8``), each
in its own process:

- ``tiny_mla_heldout_ppl``: one document per held-out file, ``loglikelihood_rolling``;
  word perplexity, byte perplexity and bits per byte.
- ``tiny_mla_next_token``: ``loglikelihood`` documents whose context is the decoded prefix of a
  held-out window and whose continuation is the text of the next token, at ``--per-window``
  seeded positions per window; accuracy (lm-eval's ``is_greedy``: the token is the argmax) and
  the perplexity of those tokens.  Every position has a context longer than ``--chunk`` tokens,
  so with chunked prefill (``max_num_batched_tokens = --chunk``) the prediction is made by a
  query that reads earlier context from the (quantized) KV cache.  A document is kept only if
  lm-eval's own split of the pair (trailing whitespace of the context moved to the
  continuation, the pair encoded whole, the context alone) gives back exactly the window's
  token ids with a one-token continuation; the others are dropped and counted.

    python -m eval.lm_eval_tiny --model build/tiny-mla --out build/lm-eval-tiny

Writes ``lm_eval_tiny.md`` / ``lm_eval_tiny.csv`` (per setting: the metrics, deltas against
``auto``, paired per-document comparisons against ``auto``), ``docs_stats.json``, the documents
(``data/*.jsonl``), the rendered task YAMLs (``tasks/``) and per setting ``<setting>/``
(``results.json``, ``samples_<task>.jsonl``, ``log.txt``, ``lm_eval_command.txt``).  Finished
settings whose documents are unchanged are reused (``--force`` reruns them).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import importlib.util
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

import numpy as np

from benchmarks.provenance import code_version, display_path
from eval.common import (checkpoint_fingerprint, markdown_cell, mean_se_cell, paired_delta,
                         paired_text, parse_kv_pairs, script_command, script_env,
                         tiny_engine_settings)

TASK_TEMPLATES = pathlib.Path(__file__).resolve().parent / "tasks" / "tiny_mla"
PPL_TASK, NEXT_TASK = "tiny_mla_heldout_ppl", "tiny_mla_next_token"
TASKS = (PPL_TASK, NEXT_TASK)
DATA_PLACEHOLDER = "@DATA_DIR@"
DEFAULT_KV = ("auto", "fp8_snapmla", "fp8")
BASELINE = "auto"
HF_RUN = "transformers"
INSTALL_HINT = "lm-eval is not installed: `pip install lm-eval==0.4.13`"

# (task, lm-eval "metric,filter" key, column)
METRICS = [
    (PPL_TASK, "word_perplexity,none", "word_ppl"),
    (PPL_TASK, "byte_perplexity,none", "byte_ppl"),
    (PPL_TASK, "bits_per_byte,none", "bits_per_byte"),
    (NEXT_TASK, "acc,none", "next_token_acc"),
    (NEXT_TASK, "perplexity,none", "next_token_ppl"),
]


def log(msg: str) -> None:
    print(f"[lm_eval_tiny] {msg}", flush=True)


# --- documents ----------------------------------------------------------------------------

def load_heldout(model: pathlib.Path) -> np.ndarray:
    path = model / "heldout_tokens.npy"
    if not path.is_file():
        raise SystemExit(f"{path} not found: --model must be a checkpoint directory written by "
                         "eval.train_tiny_mla (it saves the held-out token ids there)")
    return np.load(path).astype(np.int64)


def load_tokenizer(model: pathlib.Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    tokenizer.model_max_length = sys.maxsize   # whole files are encoded here, never run
    return tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def decode(tokenizer, ids) -> str:
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)


def lm_eval_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The (context, continuation) token ids lm-eval 0.4.13 scores for a causal model.

    Mirrors ``TemplateLM._encode_pair``: trailing whitespace of the context is moved to the
    continuation, the pair is encoded whole and the continuation is what follows the
    separately encoded context.
    """
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = encode(tokenizer, context + continuation)
    context_enc = encode(tokenizer, context)
    return context_enc, whole[len(context_enc):]


def split_files(tokens: np.ndarray, eos_id: int) -> list[np.ndarray]:
    """The held-out files' token ids (``heldout_tokens.npy`` ends every file with EOS)."""
    ends = np.flatnonzero(tokens == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1]) if len(ends) else np.zeros(0, dtype=np.int64)
    files = [tokens[s:e] for s, e in zip(starts, ends)]
    if len(ends) == 0 or ends[-1] != len(tokens) - 1:   # a tail without EOS
        files.append(tokens[(ends[-1] + 1) if len(ends) else 0:])
    return [f for f in files if len(f)]


def build_ppl_docs(tokenizer, tokens: np.ndarray, eos_id: int,
                   max_docs: int = 0) -> tuple[list[dict], dict]:
    """One document per held-out file whose decoded text re-encodes to the same ids."""
    docs, dropped, dropped_tokens = [], 0, 0
    for i, ids in enumerate(split_files(tokens, eos_id)):
        if max_docs and len(docs) >= max_docs:
            break
        text = decode(tokenizer, ids)
        if encode(tokenizer, text) != ids.tolist():
            dropped += 1
            dropped_tokens += len(ids)
            continue
        docs.append({"text": text, "file": i, "n_tokens": int(len(ids)),
                     "n_bytes": len(text.encode("utf-8"))})
    stats = {"docs": len(docs), "tokens": sum(d["n_tokens"] for d in docs),
             "bytes": sum(d["n_bytes"] for d in docs),
             "dropped_reencode": dropped, "dropped_tokens": dropped_tokens}
    return docs, stats


def check_position(tokenizer, window: list[int], pos: int) -> tuple[dict | None, str]:
    """The document predicting ``window[pos]`` from ``window[:pos]``, or why there is none."""
    context = decode(tokenizer, window[:pos])
    full = decode(tokenizer, window[:pos + 1])
    if not full.startswith(context) or len(full) == len(context):
        return None, "reencode"        # the token boundary splits a character
    continuation = full[len(context):]
    if context != context.rstrip():
        return None, "trailing_whitespace"   # lm-eval would move it into the continuation
    context_enc, continuation_enc = lm_eval_pair(tokenizer, context, continuation)
    if context_enc != window[:pos] or continuation_enc != [window[pos]]:
        return None, "reencode"
    return {"context": context, "continuation": continuation, "token_id": int(window[pos]),
            "context_tokens": pos}, ""


def build_next_token_docs(tokenizer, tokens: np.ndarray, windows: int, window_len: int,
                          per_window: int, chunk: int, seed: int) -> tuple[list[dict], dict]:
    """``per_window`` documents in each of ``windows`` held-out windows, at seeded positions.

    Windows are ``tokens[i * window_len:(i + 1) * window_len]`` (those of
    ``eval.parity_tiny``).  The target index ``pos`` has ``pos > chunk``: the prediction is
    made at position ``pos - 1 >= chunk``, which a prefill chunk of at most ``chunk`` tokens
    cannot hold together with position 0, so part of its context comes from the KV cache.
    Candidates are tried in a seeded random order; those whose pair does not survive lm-eval's
    tokenization are skipped and counted by reason.
    """
    if window_len <= chunk + 1:
        raise ValueError(f"--window-len {window_len} leaves no position past --chunk {chunk}")
    n_windows = min(windows, len(tokens) // window_len)
    rng = np.random.default_rng(seed)
    docs, rejected, short = [], {"trailing_whitespace": 0, "reencode": 0}, 0
    for w in range(n_windows):
        window = tokens[w * window_len:(w + 1) * window_len].tolist()
        kept = []
        for pos in rng.permutation(np.arange(chunk + 1, window_len)).tolist():
            if len(kept) == per_window:
                break
            doc, reason = check_position(tokenizer, window, pos)
            if doc is None:
                rejected[reason] += 1
                continue
            kept.append({**doc, "window": w, "position": pos})
        short += per_window - len(kept)
        docs += sorted(kept, key=lambda d: d["position"])
    stats = {"docs": len(docs), "windows": n_windows, "window_len": window_len,
             "per_window": per_window, "min_context_tokens": chunk + 1, "seed": seed,
             "rejected_trailing_whitespace": rejected["trailing_whitespace"],
             "rejected_reencode": rejected["reencode"], "missing": short}
    return docs, stats


def write_jsonl(path: pathlib.Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def render_tasks(data_dir: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """The task YAMLs with the documents' absolute directory filled in (an --include_path)."""
    dest.mkdir(parents=True, exist_ok=True)
    for template in sorted(TASK_TEMPLATES.glob("*.yaml")):
        (dest / template.name).write_text(
            template.read_text().replace(DATA_PLACEHOLDER, str(data_dir.resolve())))
    return dest


def write_docs(opts) -> dict:
    """Documents, rendered tasks and ``docs_stats.json`` in ``opts.out``; returns the stats."""
    tokens = load_heldout(opts.model)
    tokenizer = load_tokenizer(opts.model)
    eos_id = tokenizer.eos_token_id
    probe = "def f(x):\n    return x\n"
    adds_special = encode(tokenizer, probe) != tokenizer(probe)["input_ids"]
    ppl_docs, ppl_stats = build_ppl_docs(tokenizer, tokens, eos_id, opts.ppl_docs)
    next_docs, next_stats = build_next_token_docs(
        tokenizer, tokens, opts.windows, opts.window_len, opts.per_window, opts.chunk, opts.seed)
    data = opts.out / "data"
    data.mkdir(parents=True, exist_ok=True)
    write_jsonl(data / f"{PPL_TASK}.jsonl", ppl_docs)
    write_jsonl(data / f"{NEXT_TASK}.jsonl", next_docs)
    render_tasks(data, opts.out / "tasks")
    digest = hashlib.sha256()
    for task in TASKS:
        digest.update((data / f"{task}.jsonl").read_bytes())
    stats = {"heldout_tokens": int(len(tokens)), "eos_id": eos_id,
             "tokenizer_adds_special_tokens": adds_special, PPL_TASK: ppl_stats,
             NEXT_TASK: next_stats, "docs_sha256": digest.hexdigest()[:16]}
    (opts.out / "docs_stats.json").write_text(json.dumps(stats, indent=1))
    return stats


# --- one setting (child process) ----------------------------------------------------------

def model_args(opts, setting: str, eos_id: int) -> tuple[str, dict]:
    """lm-eval model name and arguments of one run."""
    if setting == HF_RUN:
        import torch

        device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
        args = {"pretrained": str(opts.model), "device": device, "max_length": opts.max_model_len,
                "dtype": "bfloat16" if device.startswith("cuda") else "float32",
                "prefix_token_id": eos_id, "batch_size": opts.hf_batch_size}
        return "hf", args
    # The engine of eval.parity_tiny, so that both harnesses measure the same thing.
    args = {"pretrained": str(opts.model),
            **tiny_engine_settings(setting, opts.chunk, opts.max_model_len),
            "batch_size": "auto",
            # heldout_tokens.npy puts EOS before every file: the rolling windows' first
            # token is predicted after EOS, as in training (lm-eval's default would be BOS).
            "prefix_token_id": eos_id}
    args.update(parse_kv_pairs(opts.model_args))
    return "vllm", args


def lm_eval_command(name: str, args: dict, include_path: pathlib.Path, out_dir: pathlib.Path,
                    limit) -> list[str]:
    """The equivalent plain ``lm_eval`` command line (written next to each run; the CLI has
    no bootstrap option, so its next-token perplexity stderr uses lm-eval's default)."""
    args = dict(args)
    batch_size = args.pop("batch_size")
    cmd = ["python", "-m", "lm_eval", "--model", name, "--model_args", json.dumps(args),
           "--tasks", ",".join(TASKS), "--include_path", str(include_path),
           "--batch_size", str(batch_size), "--log_samples", "--output_path", str(out_dir)]
    if "device" in args:       # the CLI passes its own --device to the model as well
        cmd[cmd.index("--model_args") + 1] = json.dumps(
            {k: v for k, v in args.items() if k != "device"})
        cmd += ["--device", str(args["device"])]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    return cmd


def run_one(setting: str, opts) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    stats = json.loads((opts.out / "docs_stats.json").read_text())
    out = opts.out / setting
    out.mkdir(parents=True, exist_ok=True)
    name, args = model_args(opts, setting, stats["eos_id"])
    include_path = opts.out / "tasks"
    (out / "lm_eval_command.txt").write_text(" ".join(
        _quote(a) for a in lm_eval_command(name, args, include_path, out, opts.limit)) + "\n")
    batch_size = args.pop("batch_size")
    started = time.monotonic()
    results = simple_evaluate(
        model=name, model_args=args, tasks=list(TASKS), batch_size=batch_size,
        task_manager=TaskManager(include_path=str(include_path)), limit=opts.limit,
        log_samples=True, bootstrap_iters=opts.bootstrap_iters)
    seconds = time.monotonic() - started
    samples = results.pop("samples", {})
    for task, entries in samples.items():
        write_jsonl(out / f"samples_{task}.jsonl",
                    [json.loads(json.dumps(e, default=str)) for e in entries])
    results["snapmla"] = {"setting": setting, "docs_sha256": stats["docs_sha256"],
                          "code": code_version(),
                          "checkpoint": checkpoint_fingerprint(opts.model),
                          "limit": opts.limit, "model_args": json.dumps(args, sort_keys=True),
                          "seconds": round(seconds, 1)}
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))


def _quote(arg: str) -> str:
    return arg if re.fullmatch(r"[\w./=:,@+-]+", arg) else "'" + arg.replace("'", "'\\''") + "'"


# --- parent: runs and report ---------------------------------------------------------------

_TQDM = re.compile(r"(\d+)%\|")


def run_setting(setting: str, opts, env: dict) -> bool:
    """One setting in a child process; streams its progress, keeps its full log."""
    out = opts.out / setting
    out.mkdir(parents=True, exist_ok=True)
    cmd = script_command("eval.lm_eval_tiny", "--run-one", setting, *opts.child_argv)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    killer = threading.Timer(opts.timeout, proc.kill)
    killer.start()
    last_bar = 0.0
    with open(out / "log.txt", "w") as logfile:
        for line in proc.stdout:          # text mode: tqdm's \r updates arrive as lines
            logfile.write(line)
            bar = _TQDM.search(line)
            now = time.monotonic()
            if bar and bar.group(1) != "100" and now - last_bar < 15:
                continue
            last_bar = now if bar else last_bar
            print(f"    | {line.rstrip()[:220]}", flush=True)
    proc.wait()
    killer.cancel()
    if proc.returncode != 0:
        log(f"[{setting}] FAILED (exit {proc.returncode}); full log: {out / 'log.txt'}")
        return False
    return True


def read_samples(setting_dir: pathlib.Path, task: str) -> dict[int, tuple]:
    """``doc_id -> (log-likelihood, is_greedy or the document's token count)`` of a run."""
    path = setting_dir / f"samples_{task}.jsonl"
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        resp = entry["resps"][0][0]
        if isinstance(resp, (list, tuple)):     # loglikelihood: (ll, is_greedy)
            out[entry["doc_id"]] = (float(resp[0]), int(bool(resp[1])))
        else:                                   # loglikelihood_rolling: ll of the whole doc
            out[entry["doc_id"]] = (float(resp), int(entry["doc"]["n_tokens"]))
    return out


def summarize(settings: list[str], opts) -> list[dict]:
    rows = []
    for setting in settings:
        path = opts.out / setting / "results.json"
        if not path.exists():
            continue
        results = json.loads(path.read_text())["results"]
        row = {"setting": setting}
        for task, key, column in METRICS:
            value = results.get(task, {}).get(key)
            row[column] = None if value in (None, "N/A") else float(value)
        # Token-level perplexity (what eval.parity_tiny reports): lm-eval's per-document
        # log-likelihoods over the documents' token counts; every token is scored once.
        docs = read_samples(opts.out / setting, PPL_TASK)
        if docs:
            row["token_ppl"] = math.exp(-sum(ll for ll, _ in docs.values())
                                        / sum(n for _, n in docs.values()))
            row["ppl_docs"] = docs       # for paired comparisons (not written to the CSV)
        rows.append(row)
    base = next((r for r in rows if r["setting"] == BASELINE), None)
    if base is None:
        return rows
    base_next = read_samples(opts.out / BASELINE, NEXT_TASK)
    base_ppl = read_samples(opts.out / BASELINE, PPL_TASK)
    for row in rows:
        if row is base:
            continue
        for column in ("token_ppl", "word_ppl", "byte_ppl", "next_token_ppl"):
            if row.get(column) is not None and base.get(column) is not None:
                row[f"d_{column}_pct"] = 100 * (row[column] / base[column] - 1)
        if row["next_token_acc"] is not None and base["next_token_acc"] is not None:
            row["d_next_token_acc"] = row["next_token_acc"] - base["next_token_acc"]
        ours = read_samples(opts.out / row["setting"], NEXT_TASK)
        common = sorted(set(ours) & set(base_next))
        if common:
            row["next_token_flips"] = sum(ours[d][1] != base_next[d][1] for d in common)
            row["next_token_mean_abs_dlogprob"] = float(np.mean(
                [abs(ours[d][0] - base_next[d][0]) for d in common]))
        ours = read_samples(opts.out / row["setting"], PPL_TASK)
        common = sorted(set(ours) & set(base_ppl))
        if common:
            row["ppl_docs_sum_dloglik"] = float(sum(ours[d][0] - base_ppl[d][0] for d in common))
            row["d_token_nll"], row["d_token_nll_se"], _ = paired_token_nll(ours, base_ppl)
    return rows


def paired_token_nll(ours: dict, theirs: dict) -> tuple[float, float, int]:
    """Per-token NLL of ``ours`` minus ``theirs`` over their common perplexity documents
    (``read_samples`` dicts), its paired standard error with the documents as the units
    (``eval.common.paired_delta``), and the number of documents."""
    common = sorted(set(ours) & set(theirs))
    mean, se = paired_delta([theirs[d][0] - ours[d][0] for d in common],
                            [theirs[d][1] for d in common])
    return mean, se, len(common)


COLUMNS = [("setting", "setting", "{}"),
           ("token_ppl", "token ppl", "{:.4f}"), ("d_token_ppl_pct", "Δ token ppl", "{:+.3f}%"),
           ("d_token_nll", "ΔNLL/token ± SE", mean_se_cell("d_token_nll")),
           ("d_token_nll_se", "SE of ΔNLL/token", "{:.2e}"),
           ("word_ppl", "word ppl", "{:.6g}"), ("d_word_ppl_pct", "Δ word ppl", "{:+.3f}%"),
           ("byte_ppl", "byte ppl", "{:.5f}"), ("d_byte_ppl_pct", "Δ byte ppl", "{:+.3f}%"),
           ("bits_per_byte", "bits/byte", "{:.5f}"),
           ("next_token_acc", "next-token acc", "{:.4f}"),
           ("d_next_token_acc", "Δ acc", "{:+.4f}"),
           ("next_token_flips", "acc flips vs auto", "{}"),
           ("next_token_ppl", "next-token ppl", "{:.4f}"),
           ("d_next_token_ppl_pct", "Δ next-token ppl", "{:+.3f}%"),
           ("next_token_mean_abs_dlogprob", "mean abs Δlogprob vs auto", "{:.2e}"),
           ("ppl_docs_sum_dloglik", "Σ Δloglik (ppl docs) vs auto", "{:+.3f}")]
# keeps the Markdown table narrower (the ΔNLL cell shows its SE)
MD_ONLY_IN_CSV = {"d_byte_ppl_pct", "ppl_docs_sum_dloglik", "d_token_nll_se"}


def write_report(rows: list[dict], stats: dict, opts, failed: list[str]) -> str:
    with open(opts.out / "lm_eval_tiny.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[c for c, _, _ in COLUMNS])
        writer.writeheader()
        writer.writerows([{c: "" if r.get(c) is None else r.get(c) for c, _, _ in COLUMNS}
                          for r in rows])

    shown = [c for c in COLUMNS if c[0] not in MD_ONLY_IN_CSV]
    table = ["| " + " | ".join(h for _, h, _ in shown) + " |", "|" + "---|" * len(shown)]
    table += ["| " + " | ".join(markdown_cell(r, k, f) for k, _, f in shown) + " |" for r in rows]
    by = {r["setting"]: r for r in rows}
    verdicts = []
    d = by.get("fp8_snapmla", {}).get("d_token_ppl_pct")
    if d is not None:
        verdicts.append(f"- fp8_snapmla held-out token perplexity within 0.5% of BF16: "
                        f"{'PASS' if abs(d) <= 0.5 else 'FAIL'} ({d:+.3f}%)")
    if {"fp8", "fp8_snapmla"} <= by.keys() and None not in (by["fp8"].get("token_ppl"),
                                                            by["fp8_snapmla"].get("token_ppl")):
        s, f8 = by["fp8_snapmla"]["token_ppl"], by["fp8"]["token_ppl"]
        mean, se, docs = paired_token_nll(by["fp8_snapmla"]["ppl_docs"], by["fp8"]["ppl_docs"])
        verdicts.append(f"- fp8_snapmla held-out token perplexity no worse than fp8: "
                        f"{'PASS' if s <= f8 else 'FAIL'} ({s:.4f} vs {f8:.4f}; NLL per token "
                        f"fp8_snapmla − fp8 {paired_text(mean, se, docs, 'files')})")
    ppl, nxt = stats[PPL_TASK], stats[NEXT_TASK]
    train_log_path = opts.model / "train_log.json"
    model_line = f"model `{display_path(opts.model)}`"
    if train_log_path.exists():
        tl = json.loads(train_log_path.read_text())
        model_line += (f": {tl['parameters'] / 1e6:.1f}M parameters, {tl['steps']} steps, "
                       f"held-out loss {tl['heldout_loss']:.4f} (trained at commit "
                       f"{tl['git_commit']})")
    limit = f", lm-eval --limit {opts.limit}" if opts.limit is not None else ""
    text = "\n".join([
        "# Tiny MLA model: KV-cache parity through lm-eval", "",
        model_line + ".",
        f"Measured with {code_version()} (every row: a saved run is reused only for the same "
        "code, checkpoint, documents and options).",
        f"lm-eval `vllm` model, kv_cache_dtype per row, BF16 weights, eager, chunked prefill "
        f"with max_num_batched_tokens={opts.chunk}, no prefix caching, max_model_len "
        f"{opts.max_model_len}{limit}.", "",
        f"- `{PPL_TASK}`: {ppl['docs']} held-out files ({ppl['tokens']:,} tokens, "
        f"{ppl['bytes']:,} bytes), rolling windows of {opts.max_model_len - 2} tokens; "
        f"{ppl['dropped_reencode']} files dropped (decoded text does not re-encode to the "
        f"same ids).",
        f"- `{NEXT_TASK}`: {nxt['docs']} positions ({nxt['per_window']} per window in "
        f"{nxt['windows']} windows of {nxt['window_len']} tokens, seed {nxt['seed']}, context "
        f"≥ {nxt['min_context_tokens']} tokens so the prediction reads context through the "
        f"KV cache); candidates skipped: {nxt['rejected_trailing_whitespace']} with a context "
        f"ending in whitespace (lm-eval moves it into the continuation), "
        f"{nxt['rejected_reencode']} not re-encoding to the same ids; "
        f"{nxt['missing']} positions short.", "",
        *table, "",
        "token ppl: exp(−Σ log-likelihood / Σ tokens) over the perplexity documents (from "
        "lm-eval's per-document log-likelihoods); word/byte ppl and bits/byte are lm-eval's. "
        "Δ are against `auto` (BF16 cache); ΔNLL/token: the token perplexity's mean negative "
        "log-likelihood per token minus `auto`'s (nats; Δ token ppl = exp(ΔNLL) − 1), ± its "
        "paired standard error with the files as the units (ratio estimator); flips: "
        "next-token documents whose is_greedy differs from `auto`'s; Δlogprob: per document, "
        "paired.", "", *verdicts,
        *(["", f"Failed settings (see <setting>/log.txt): {', '.join(failed)}"]
          if failed else [])]) + "\n"
    (opts.out / "lm_eval_tiny.md").write_text(text)
    return text


# --- CLI ----------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m eval.lm_eval_tiny",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=pathlib.Path,
                   help="checkpoint directory written by eval.train_tiny_mla")
    p.add_argument("--out", required=True, type=pathlib.Path)
    p.add_argument("--kv", default=",".join(DEFAULT_KV),
                   help=f"comma-separated kv_cache_dtype settings or fp8-calibrated (vLLM's fp8 "
                        f"with calculate_kv_scales; default {','.join(DEFAULT_KV)}"
                        "; 'none' for no vLLM run)")
    p.add_argument("--hf", action="store_true",
                   help=f"also run lm-eval's `hf` model (transformers, row '{HF_RUN}')")
    p.add_argument("--limit", type=float, default=None,
                   help="documents per task (int) or fraction (<1), for smoke runs")
    p.add_argument("--windows", type=int, default=64, help="next-token windows (default 64)")
    p.add_argument("--window-len", type=int, default=2048)
    p.add_argument("--per-window", type=int, default=4, help="positions per window (default 4)")
    p.add_argument("--chunk", type=int, default=256,
                   help="max_num_batched_tokens (the prefill chunk); next-token contexts are "
                        "longer than this (default 256)")
    p.add_argument("--seed", type=int, default=0, help="position sampling seed")
    p.add_argument("--ppl-docs", type=int, default=0,
                   help="at most this many held-out files for perplexity (default 0: all)")
    p.add_argument("--max-model-len", type=int, default=2050,
                   help="vLLM max_model_len = lm-eval's max length; rolling perplexity windows "
                        "are 2 tokens shorter (default 2050: 2048-token windows, the training "
                        "length)")
    p.add_argument("--model-args", default="",
                   help="extra vLLM engine / lm-eval model args, key=value,... (override)")
    p.add_argument("--bootstrap-iters", type=int, default=1000,
                   help="lm-eval bootstrap iterations for the next-token perplexity stderr")
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--device", default=None, help="device of the hf run (default cuda if any)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per setting")
    p.add_argument("--force", action="store_true", help="rerun settings already in --out")
    p.add_argument("--docs-only", action="store_true",
                   help="only write the documents and the rendered tasks (OUT/tasks)")
    p.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    opts.kv = [] if opts.kv == "none" else [s for s in opts.kv.split(",") if s]
    if opts.limit is not None and opts.limit >= 1:
        opts.limit = int(opts.limit)
    if opts.max_model_len < opts.window_len + 1:
        p.error(f"--max-model-len must be at least --window-len + 1 ({opts.window_len + 1}): "
                "lm-eval would truncate the next-token contexts")
    opts.model = opts.model.resolve()
    opts.out = opts.out.resolve()
    # a setting's child process re-parses the same options (plus --run-one SETTING)
    opts.child_argv = list(argv if argv is not None else sys.argv[1:])
    return opts


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = parse_args(argv)
    if opts.run_one:
        run_one(opts.run_one, opts)
        return 0
    opts.out.mkdir(parents=True, exist_ok=True)
    settings = opts.kv + ([HF_RUN] if opts.hf else [])
    if not opts.docs_only:
        # Checked without importing: the runs happen in child processes, and importing
        # vLLM here would only slow the parent down.
        if importlib.util.find_spec("lm_eval") is None:
            raise SystemExit(INSTALL_HINT)
        if opts.kv and importlib.util.find_spec("vllm") is None:
            raise SystemExit("vLLM is not installed (`pip install vllm==0.26.0`); "
                             "use --kv none --hf to run transformers only")
        if not settings:
            raise SystemExit("nothing to run: --kv none without --hf")
    started = time.monotonic()
    stats = write_docs(opts)
    log(f"documents: {stats[PPL_TASK]['docs']} perplexity docs "
        f"({stats[PPL_TASK]['tokens']:,} tokens), {stats[NEXT_TASK]['docs']} next-token docs "
        f"(skipped {stats[NEXT_TASK]['rejected_trailing_whitespace']} trailing-whitespace, "
        f"{stats[NEXT_TASK]['rejected_reencode']} re-encoding candidates) in "
        f"{time.monotonic() - started:.1f}s -> {opts.out / 'data'}, tasks {opts.out / 'tasks'}")
    if opts.docs_only:
        return 0
    env = os.environ.copy()
    if opts.kv:
        # loads the plugin from this tree, installed or not, in all of vLLM's processes
        from vllm_snapmla.testing import subprocess_env

        env = subprocess_env()
    env = script_env(env)
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_CACHE", str(opts.out / "hf_datasets_cache"))
    env.setdefault("DISABLE_MULTIPROC", "1")   # lm-eval's bootstrap: no worker pool
    env["PYTHONUNBUFFERED"] = "1"
    failed = []
    checkpoint = checkpoint_fingerprint(opts.model)
    code = code_version()
    for setting in settings:
        done = opts.out / setting / "results.json"
        if done.exists() and not opts.force:
            meta = json.loads(done.read_text()).get("snapmla", {})
            args = model_args(opts, setting, stats["eos_id"])[1]
            args.pop("batch_size")
            if (meta.get("docs_sha256"), meta.get("code"), meta.get("checkpoint"),
                    meta.get("limit"), meta.get("model_args")) == (
                    stats["docs_sha256"], code, checkpoint, opts.limit,
                    json.dumps(args, sort_keys=True)):
                log(f"[{setting}] reusing {done}")
                continue
        done.unlink(missing_ok=True)     # a failed rerun must not leave stale results behind
        log(f"[{setting}] running lm-eval ({'hf' if setting == HF_RUN else 'vllm'}) ...")
        t0 = time.monotonic()
        if run_setting(setting, opts, env):
            log(f"[{setting}] done in {time.monotonic() - t0:.0f}s")
        else:
            failed.append(setting)
    rows = summarize(settings, opts)
    print("\n" + write_report(rows, stats, opts, failed), flush=True)
    log(f"wrote {opts.out / 'lm_eval_tiny.md'} and {opts.out / 'lm_eval_tiny.csv'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
