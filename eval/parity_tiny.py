"""KV-cache accuracy of the trained tiny MLA model in vLLM: BF16 vs fp8_snapmla vs fp8.

Needs a CUDA GPU with FP8 (sm_89+) and vLLM 0.26.0.  Takes the checkpoint written by
``eval.train_tiny_mla`` (with its ``heldout_tokens.npy``) and, for each KV-cache dtype, in its
own process (so each gets the whole GPU):

(a) scores ``--windows`` held-out windows of ``--window-len`` tokens with ``prompt_logprobs``:
    perplexity and next-token accuracy.  vLLM's MLA prefill attends over the *fresh* BF16
    latents of the tokens it is computing; only context from earlier steps is read back from
    the KV cache.  Chunked prefill with a small ``--chunk`` (``max_num_batched_tokens``) makes
    every token past the first chunk attend to earlier chunks through the (quantized) cache,
    and the headline numbers are over those tokens (position >= ``--chunk``).  This reads the
    cache through the context path (dequantize, then BF16 attention); the FP8 decode kernel
    (FP8 queries and probabilities) is exercised by (b).
(b) greedily continues ``--prompts`` held-out prompts for ``--gen-len`` tokens and compares
    with BF16: fraction of identical continuations and mean common-prefix length.

As a check that vLLM runs the trained model faithfully, transformers' own BF16 forward pass
(no KV cache) scores the same windows.

    python -m eval.parity_tiny --model build/tiny-mla --out build/parity-tiny

Writes ``parity_tiny.md`` (table), ``parity_tiny.csv`` and, per run, ``raw_<name>.json``
to ``--out``.  Finished runs are reused (``--force`` reruns them), so an interrupted
invocation resumes where it stopped.
"""

from __future__ import annotations

import argparse
import csv
import inspect
import json
import math
import pathlib
import subprocess
import sys
import threading
import time

import numpy as np

from benchmarks.provenance import code_version, display_path
from eval.common import (EXTRA_SETTINGS, checkpoint_fingerprint, markdown_cell, mean_se_cell,
                         paired_delta, paired_text, script_command, script_env,
                         tiny_engine_settings)

RESULT_TAG = "PARITY_TINY_RESULT "
DTYPES = ("auto", "fp8_snapmla", "fp8")
HF_RUN = "transformers"
TEXT_PROMPT = "def main():\n"


def log(msg: str) -> None:
    print(msg, flush=True)


# --- child processes ----------------------------------------------------------------------

def _score_entries(prompt_logprobs, tokens: list[int]) -> tuple[list[float], list[int]]:
    """Per position 1.. of a prompt: the actual token's logprob and whether it ranked first."""
    logprobs, correct = [], []
    for pos in range(1, len(tokens)):
        entry = prompt_logprobs[pos][tokens[pos]]
        logprobs.append(float(entry.logprob))
        correct.append(int(entry.rank == 1))
    return logprobs, correct


def engine_kwargs(model: str, run: str, chunk: int, max_model_len: int,
                  gpu_memory_utilization: float = 0.5) -> dict:
    """``LLM`` arguments of a run (a KV-cache dtype or an ``EXTRA_SETTINGS`` name): prefill in
    chunks of ``chunk`` tokens, no prefix caching."""
    return dict(model=model, **tiny_engine_settings(run, chunk, max_model_len,
                                                    gpu_memory_utilization))


def run_vllm(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(**engine_kwargs(spec["model"], spec["kv_cache_dtype"], spec["chunk"],
                              spec["max_model_len"], spec["gpu_memory_utilization"]))
    load_s = time.monotonic() - started
    windows = spec["windows"]
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1,
                             detokenize=False)
    started = time.monotonic()
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], scoring, use_tqdm=False)
    scored = [_score_entries(o.prompt_logprobs, w) for o, w in zip(outputs, windows)]
    score_s = time.monotonic() - started
    greedy = SamplingParams(max_tokens=spec["gen_len"], temperature=0.0, ignore_eos=True,
                            detokenize=False)
    started = time.monotonic()
    continuations = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in spec["prompts"]], greedy, use_tqdm=False)]
    generate_s = time.monotonic() - started
    # A text prompt goes through vLLM's own use of the checkpoint's tokenizer; a failure
    # there is reported in the sample rather than discarding the measurements.
    try:
        text = TEXT_PROMPT + llm.generate([TEXT_PROMPT], SamplingParams(
            max_tokens=48, temperature=0.0), use_tqdm=False)[0].outputs[0].text
    except Exception as error:   # noqa: BLE001
        text = f"text generation failed: {error!r}"
    cache = llm.llm_engine.vllm_config.cache_config
    return {"logprobs": [s[0] for s in scored], "correct": [s[1] for s in scored],
            "continuations": continuations, "text_sample": text,
            "kv_cache_tokens": cache.num_gpu_blocks * cache.block_size,
            "seconds": {"load": load_s, "score": score_s, "generate": generate_s}}


def run_transformers(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16).to(device)
    logprobs, correct = [], []
    started = time.monotonic()
    with torch.no_grad():
        for window in spec["windows"]:
            ids = torch.tensor([window], device=device)
            logits = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
            target = ids[0, 1:]
            logprobs.append(logits.gather(-1, target[:, None])[:, 0].tolist())
            correct.append((logits.argmax(-1) == target).int().tolist())
    score_s = time.monotonic() - started
    started = time.monotonic()
    continuations = greedy_with_cache(model, spec["prompts"], spec["gen_len"], device)
    return {"logprobs": logprobs, "correct": correct, "continuations": continuations,
            "seconds": {"score": score_s, "generate": time.monotonic() - started}}


def greedy_with_cache(model, prompts: list[list[int]], gen_len: int, device) -> list[list[int]]:
    """``gen_len`` greedy tokens (EOS ignored) per prompt with transformers' own BF16 KV cache.

    Prompts of one length run as one batch (no padding needed): one forward pass per step for
    the batch rather than per prompt.
    """
    import torch

    # transformers renamed the cache argument and output field from ``past_key_values`` to
    # ``cache`` (the old name warns, and goes in 5.40); vLLM 0.26.0 allows either side of that.
    cache_name = ("cache" if "cache" in inspect.signature(model.forward).parameters
                  else "past_key_values")
    continuations: list[list[int] | None] = [None] * len(prompts)
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    with torch.no_grad():
        for rows in by_length.values():
            ids = torch.tensor([prompts[i] for i in rows], device=device)
            out = model(input_ids=ids, use_cache=True)
            steps = [out.logits[:, -1].argmax(-1)]
            for _ in range(gen_len - 1):
                out = model(input_ids=steps[-1][:, None], use_cache=True,
                            **{cache_name: getattr(out, cache_name)})
                steps.append(out.logits[:, -1].argmax(-1))
            for row, tokens in zip(rows, torch.stack(steps, 1).tolist()):
                continuations[row] = tokens
    return continuations


def _child() -> None:
    spec = json.loads(sys.stdin.read())
    result = run_transformers(spec) if spec["run"] == HF_RUN else run_vllm(spec)
    print(RESULT_TAG + json.dumps(result), flush=True)


def run_in_subprocess(spec: dict, timeout: float) -> dict:
    """One run in a fresh process that loads this plugin from this tree, installed or not."""
    from vllm_snapmla.testing import subprocess_env

    proc = subprocess.Popen(script_command("eval.parity_tiny", "--child"),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=script_env(subprocess_env()))
    proc.stdin.write(json.dumps(spec))
    proc.stdin.close()
    result_line, tail = None, []
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    for line in proc.stdout:   # stream the child's progress; keep its result line
        if line.startswith(RESULT_TAG):
            result_line = line[len(RESULT_TAG):]
            continue
        tail = (tail + [line])[-80:]
        if any(k in line for k in ("KV cache size", "Loading weights took", "Error", "error")):
            log("    | " + line.rstrip()[:200])
    proc.wait()
    killer.cancel()
    if proc.returncode != 0 or result_line is None:
        raise RuntimeError(f"{spec['run']} failed (exit {proc.returncode}):\n" + "".join(tail))
    return json.loads(result_line)


# --- summary -------------------------------------------------------------------------------

def summarize(name: str, raw: dict, base: dict | None, chunk: int) -> dict:
    logprobs = [np.asarray(w) for w in raw["logprobs"]]
    correct = [np.asarray(w) for w in raw["correct"]]
    # Index j scores token j + 1 from the hidden state at position j.  A step computes at most
    # `chunk` tokens, so from position `chunk` on, part of the context attended to was
    # computed in an earlier step and is read back from the KV cache.
    cached = [lp[chunk:] for lp in logprobs]
    row = {"run": name,
           "ppl_cache_context": math.exp(-np.concatenate(cached).mean()),
           "ppl_all": math.exp(-np.concatenate(logprobs).mean()),
           "accuracy_cache_context": float(np.concatenate([c[chunk:] for c in correct]).mean()),
           "scored_tokens": int(sum(len(c) for c in cached)),
           "kv_cache_tokens": raw.get("kv_cache_tokens", ""),
           # per window, for paired comparisons between runs (not written to the CSV)
           "window_nll": [float(-lp.sum()) for lp in cached],
           "window_tokens": [len(lp) for lp in cached]}
    if base is not None:
        base_cached = np.concatenate([np.asarray(w)[chunk:] for w in base["logprobs"]])
        row["mean_abs_dlogprob_vs_bf16"] = float(np.abs(np.concatenate(cached)
                                                        - base_cached).mean())
        base_nll = [float(-np.asarray(w)[chunk:].sum()) for w in base["logprobs"]]
        row["dnll_vs_bf16"], row["dnll_vs_bf16_se"] = paired_delta(
            np.subtract(row["window_nll"], base_nll), row["window_tokens"])
        if "continuations" in raw and "continuations" in base:
            prefixes = []
            for ours, theirs in zip(raw["continuations"], base["continuations"]):
                same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                            min(len(ours), len(theirs)))
                prefixes.append(same)
            n = len(raw["continuations"])
            row["greedy_identical"] = sum(a == b for a, b in zip(
                raw["continuations"], base["continuations"])) / n
            row["greedy_mean_common_prefix"] = float(np.mean(prefixes))
    return row


COLUMNS = [("run", "run", "{}"),
           ("ppl_cache_context", "ppl (position ≥ chunk)", "{:.4f}"),
           ("ppl_delta_pct", "Δppl vs BF16", "{:+.3f}%"),
           ("dnll_vs_bf16", "ΔNLL vs BF16 (nats/token ± SE)", mean_se_cell("dnll_vs_bf16")),
           ("ppl_all", "ppl (all tokens)", "{:.4f}"),
           ("accuracy_cache_context", "next-token acc.", "{:.4f}"),
           ("mean_abs_dlogprob_vs_bf16", "mean abs Δlogprob vs BF16", "{:.2e}"),
           ("greedy_identical", "greedy identical to BF16", "{:.3f}"),
           ("greedy_mean_common_prefix", "mean common prefix (tokens)", "{:.1f}"),
           ("kv_cache_tokens", "KV-cache tokens", "{:,}")]
CSV_ONLY = ["dnll_vs_bf16_se", "scored_tokens"]


def write_report(out: pathlib.Path, rows: list[dict], args, train_log: dict | None,
                 samples: dict[str, str], failed: list[str] = ()) -> str:
    base = next((r for r in rows if r["run"] == "auto"), None)
    for r in rows:
        if base is not None and r["run"] != "auto":
            r["ppl_delta_pct"] = 100 * (r["ppl_cache_context"] / base["ppl_cache_context"] - 1)
    with open(out / "parity_tiny.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[k for k, _, _ in COLUMNS] + CSV_ONLY,
                                extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)

    lines = ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(markdown_cell(r, k, f) for k, _, f in COLUMNS) + " |"
              for r in rows]
    by_run = {r["run"]: r for r in rows}
    verdicts = []
    if {"auto", "fp8_snapmla"} <= by_run.keys():
        d = by_run["fp8_snapmla"]["ppl_delta_pct"]
        verdicts.append(f"- fp8_snapmla perplexity within 0.5% of BF16: "
                        f"{'PASS' if abs(d) <= 0.5 else 'FAIL'} ({d:+.3f}%)")
    if {"fp8", "fp8_snapmla"} <= by_run.keys():
        s, f8 = (by_run[k]["ppl_cache_context"] for k in ("fp8_snapmla", "fp8"))
        d, se = paired_delta(np.subtract(by_run["fp8_snapmla"]["window_nll"],
                                         by_run["fp8"]["window_nll"]),
                             by_run["fp8"]["window_tokens"])
        verdicts.append(f"- fp8_snapmla perplexity no worse than fp8: "
                        f"{'PASS' if s <= f8 else 'FAIL'} ({s:.4f} vs {f8:.4f}; NLL per token "
                        f"fp8_snapmla − fp8 "
                        f"{paired_text(d, se, len(by_run['fp8']['window_nll']), 'windows')})")
    model_line = f"model `{display_path(args.model)}`"
    if train_log:
        model_line += (f": {train_log['parameters'] / 1e6:.1f}M parameters, "
                       f"{train_log['steps']} steps, held-out loss "
                       f"{train_log['heldout_loss']:.4f} (trained at commit "
                       f"{train_log['git_commit']})")
    text = "\n".join([
        "# Tiny MLA model: KV-cache parity in vLLM", "",
        model_line + ".",
        f"Measured with {code_version()} (every row: a saved run is reused only for the same "
        "code, checkpoint and options).",
        f"{args.windows} held-out windows of {args.window_len} tokens, chunked prefill with "
        f"max_num_batched_tokens={args.chunk} (tokens past the first chunk attend to earlier "
        f"chunks through the KV cache; perplexity and accuracy are over those tokens); "
        f"{args.prompts} greedy continuations of {args.gen_len} tokens after "
        f"{args.prompt_len}-token prompts.  `{HF_RUN}` is the checkpoint's BF16 forward "
        "pass in transformers (scoring without a KV cache; greedy continuations with its BF16 "
        "KV cache): its distance from vLLM's BF16 run is what a different but equally exact "
        "BF16 implementation moves, the floor for the other rows.", "",
        *lines, "",
        ("ΔNLL: mean negative log-likelihood per token minus BF16's, over the same tokens "
         "(nats; Δppl = exp(ΔNLL) − 1), ± its paired standard error with the windows as the "
         "units (ratio estimator: neighbouring tokens' differences are correlated)."), "",
        *verdicts, "",
        *([f"**Failed, not in the table:** {', '.join(failed)} (the log says why).", ""]
          if failed else []),
        "Sample (text prompt through vLLM's tokenizer):", ""]
        + [f"- {name}: `{json.dumps(s)[:300]}`" for name, s in samples.items()]) + "\n"
    (out / "parity_tiny.md").write_text(text)
    return text


def run_fingerprint(args, n_windows: int) -> dict:
    """What a saved run's numbers depend on besides its KV dtype: the code (commit, uncommitted
    changes, vLLM version), the checkpoint (its files' sizes and times) and the options.  A
    saved run is reused only when this matches."""
    return {"code": code_version(), "checkpoint": checkpoint_fingerprint(args.model),
            "windows": n_windows,
            "window_len": args.window_len, "chunk": args.chunk, "prompts": args.prompts,
            "prompt_len": args.prompt_len, "gen_len": args.gen_len}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--child"]:   # a run, its spec on stdin (see run_in_subprocess)
        _child()
        return 0
    parser = argparse.ArgumentParser(prog="python -m eval.parity_tiny",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=pathlib.Path,
                        help="checkpoint directory written by eval.train_tiny_mla")
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--dtypes", default=",".join(DTYPES),
                        help=f"comma-separated KV-cache dtypes (default {','.join(DTYPES)}), "
                             f"or {', '.join(EXTRA_SETTINGS)}")
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--window-len", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256,
                        help="max_num_batched_tokens, i.e. the prefill chunk (default 256)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=256)
    parser.add_argument("--no-transformers", action="store_true",
                        help="skip the transformers reference run")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                        help="vLLM's memory share per run (default 0.5; lower to share the GPU)")
    parser.add_argument("--force", action="store_true", help="rerun runs already saved in --out")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    args = parser.parse_args(argv)
    if not 0 < args.chunk < args.window_len:
        parser.error(f"--chunk {args.chunk} must be positive and below --window-len "
                     f"{args.window_len}: only tokens past the first chunk are scored")
    args.out.mkdir(parents=True, exist_ok=True)
    tokens = np.load(args.model / "heldout_tokens.npy").astype(np.int64)
    n_windows = min(args.windows, len(tokens) // args.window_len)
    if n_windows < args.windows:
        log(f"held-out split has room for {n_windows} windows only")
    args.windows = n_windows
    windows = [tokens[i * args.window_len:(i + 1) * args.window_len].tolist()
               for i in range(n_windows)]
    stride = (len(tokens) - args.prompt_len) // max(1, args.prompts)
    prompts = [tokens[i * stride:i * stride + args.prompt_len].tolist()
               for i in range(args.prompts)]
    train_log_path = args.model / "train_log.json"
    train_log = json.loads(train_log_path.read_text()) if train_log_path.exists() else None
    max_model_len = max(args.window_len + 1, args.prompt_len + args.gen_len) + 64

    runs = [d for d in args.dtypes.split(",") if d]
    if not args.no_transformers:
        runs.append(HF_RUN)
    if n_windows == 0:
        parser.error(f"the held-out split ({len(tokens)} tokens) holds no --window-len "
                     f"{args.window_len} window")
    fingerprint = run_fingerprint(args, n_windows)
    raws: dict[str, dict] = {}
    failed: list[str] = []
    for run in runs:
        raw_path = args.out / f"raw_{run}.json"
        if raw_path.exists() and not args.force:
            saved = json.loads(raw_path.read_text())
            if saved.get("fingerprint") == fingerprint:
                log(f"[{run}] reusing {raw_path}")
                raws[run] = saved
                continue
            log(f"[{run}] {raw_path} is from another checkpoint or other options: rerunning")
        log(f"[{run}] starting ({n_windows} windows x {args.window_len} tokens, "
            f"{args.prompts} prompts x {args.gen_len} generated) ...")
        started = time.monotonic()
        spec = {"run": run, "model": str(args.model), "kv_cache_dtype": run,
                "windows": windows, "prompts": prompts, "gen_len": args.gen_len,
                "chunk": args.chunk, "max_model_len": max_model_len,
                "gpu_memory_utilization": args.gpu_memory_utilization}
        try:
            raws[run] = {**run_in_subprocess(spec, args.timeout), "fingerprint": fingerprint}
        except RuntimeError as error:
            log(f"[{run}] FAILED; continuing without it:\n{error}")
            failed.append(run)
            continue
        raw_path.write_text(json.dumps(raws[run]))
        log(f"[{run}] done in {time.monotonic() - started:.0f}s "
            f"({json.dumps({k: round(v, 1) for k, v in raws[run]['seconds'].items()})})")

    base = raws.get("auto")
    rows = [summarize(run, raws[run], base if run != "auto" else None, args.chunk)
            for run in runs if run in raws]
    samples = {run: raws[run]["text_sample"] for run in runs
               if run in raws and "text_sample" in raws[run]}
    log("\n" + write_report(args.out, rows, args, train_log, samples, failed))
    log(f"wrote {args.out / 'parity_tiny.md'} and {args.out / 'parity_tiny.csv'}")
    if failed:
        log(f"runs that failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
