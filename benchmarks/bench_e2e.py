"""End-to-end vLLM decode throughput: KV cache ``auto`` (BF16) vs ``fp8_snapmla`` vs ``fp8``.

    python benchmarks/bench_e2e.py --out out/bench_e2e [--quick]
        [--heads 128 16] [--contexts 16384 32768 65536 131072] [--kv auto fp8_snapmla fp8]

The model has DeepSeek-V3.1's attention shapes (hidden 7168, q_lora 1536, kv_lora 512, RoPE 64,
nope 128, v 128), 4 dense layers (intermediate 2048), DeepSeek's vocabulary and vLLM's dummy
weights.  128 heads is the whole model on one GPU; 16 heads stands in for one rank of TP8.

Each (heads, kv) pair runs in its own process (it owns the GPU) and builds one ``LLM`` for all
contexts (engine start-up and graph capture took most of a setting's 80-110 s when each
(heads, context, kv) had its own).  The engine has a fixed KV-cache budget (``--kv-cache-gib``,
the same bytes for every setting, so a smaller format holds more tokens); for each context the
batch fills the capacity vLLM allocated: B = blocks // blocks per request (context + generated
tokens), at most ``--max-batch``.
Method: random-token prompts of ``context`` tokens, prefix caching off, ``ignore_eos``, default
compilation (CUDA graphs, torch.compile).  The B requests go into the engine at once, and it is
stepped (``LLMEngine.step``, the loop inside ``LLM.generate``) until every request has its
first token, that is until the chunked prefill is over, and SETTLE_STEPS steps more.  Then
``--windows`` consecutive windows of T steps are timed with the engine core's own timestamps of
its steps (``timer``), and the requests are aborted.

    time per output token = median over the windows of (window time / T)
    decode tok/s = B / time per output token

``lock_step``: in every timed step every request produced exactly one token (none preempted,
none finished).  ``spread_pct``: the windows' max - min over their median; ``timing_ok`` when it
is at most NOISE_FRACTION.  The requests' max_tokens outlast the prefill (``warm_tokens``: 1.25x
the steps it needs at most, + 16) plus the windows.

An earlier method timed two ``generate`` calls, of W and of W + T tokens, and divided by the
difference.  Both calls included the whole prefill, so its run-to-run jitter landed in the
difference.  On 2026-12-01, T = 64 after a 0.9M-token prefill gave a 90 ms window in 11.6 s runs,
below what the attention kernels alone need.

Results go to ``--out``: ``results.csv`` (merged with earlier runs into the same folder, so a
sweep can be split over several commands), ``results.md`` (table) and ``results.png`` (decode
tok/s and speedup vs BF16 against context, per head count).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_snapmla.demo import subprocess_env, write_tiny_deepseek_v3  # noqa: E402

KV_SETTINGS = ("auto", "fp8_snapmla", "fp8")
BASELINE_KV = "auto"
HEADS = (128, 16)
CONTEXTS = (16384, 32768, 65536, 131072)
QUICK = {"heads": (128,), "contexts": (16384, 65536), "gen_tokens": 128, "kv_cache_gib": 4.0}
NOISE_FRACTION = 0.05   # largest spread of the timed windows, as a fraction of their median
SETTLE_STEPS = 4        # decode steps of all requests before the first timed window

# DeepSeek-V3.1 attention; 4 dense layers keep the non-attention work small, as in the baseline.
DEEPSEEK_V31_ATTENTION = {
    "hidden_size": 7168, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "num_hidden_layers": 4,
    "intermediate_size": 2048, "first_k_dense_replace": 4, "vocab_size": 129280,
    "max_position_embeddings": 163840,
}

RESULT_TAG = "BENCH_E2E_RESULT "
_KV_TOKENS_LOG = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_BACKEND_LOG = re.compile(r"Using (\w+) attention backend")

CSV_FIELDS = ["heads", "context", "kv", "backend", "batch", "gen_tokens", "windows",
              "max_tokens", "prefill_steps", "lock_step", "timer", "spread_pct", "timing_ok",
              "kv_cache_tokens", "log_kv_cache_tokens", "capacity_vs_bf16", "decode_tok_s",
              "tpot_ms", "speedup_vs_bf16", "error"]


# --- pure helpers (unit-tested on CPU) -----------------------------------------------------

def model_config(heads: int) -> dict:
    """Overrides of the tiny DeepSeek-V3 config that give DeepSeek-V3.1's attention shapes."""
    return {**DEEPSEEK_V31_ATTENTION, "num_attention_heads": heads, "num_key_value_heads": heads}


def batch_to_fill(num_blocks: int, block_size: int, context: int, gen_tokens: int,
                  max_batch: int) -> int:
    """Requests of ``context + gen_tokens`` tokens that fit in ``num_blocks`` pages at once."""
    blocks_per_request = math.ceil((context + gen_tokens) / block_size)
    return min(num_blocks // blocks_per_request, max_batch)


def warm_tokens(batch: int, context: int, max_batched_tokens: int) -> int:
    """Tokens per request that outlast the chunked prefill of ``batch`` prompts: 1.25x the steps
    it needs at most (each step's token budget less one decode token per request) + 16."""
    per_step = max_batched_tokens - batch
    if per_step < 1:
        raise ValueError(f"max_num_batched_tokens={max_batched_tokens} leaves no prefill budget "
                         f"next to {batch} decoding requests")
    return math.ceil(1.25 * math.ceil(batch * context / per_step)) + 16


def timed_decode_windows(engine, prompts: list, params, steps: int, windows: int,
                         clock=time.perf_counter) -> tuple[list[float], bool, int, str]:
    """Seconds per step of ``windows`` consecutive windows of ``steps`` engine steps in which
    every request decodes; whether every request gained exactly one token per timed step; the
    engine steps until every request had its first token (the prefill; it may include a few
    empty steps left over from the previous call's aborted requests); and the timer used.

    ``engine`` is a vLLM ``LLMEngine`` (``add_request``, ``step``, ``abort_request``,
    ``has_unfinished_requests``); ``params`` must return deltas (``RequestOutputKind.DELTA``) and
    leave room for the prefill, SETTLE_STEPS and the windows.  The engine core runs ahead of
    ``step()`` in its own process, so the windows are timed with the core's timestamps of its
    steps (``RequestOutput.metrics.last_token_ts``, with stats logging on): a front end that
    falls behind would otherwise time its own output processing.  Without them ``clock`` times
    the ``step()`` calls.  The requests are aborted after the last window."""
    ids = [f"bench-e2e-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    tokens = dict.fromkeys(ids, 0)

    def step() -> float | None:
        """One engine step; the core's timestamp of it, if its outputs carry one."""
        stamps = []
        for output in engine.step():
            tokens[output.request_id] += len(output.outputs[0].token_ids)
            stamp = getattr(getattr(output, "metrics", None), "last_token_ts", None)
            if stamp:
                stamps.append(stamp)
        return max(stamps) if stamps else None

    try:
        prefill_steps = 0
        while min(tokens.values()) == 0:
            if not engine.has_unfinished_requests():
                raise RuntimeError("requests finished before all of them had a token")
            step()
            prefill_steps += 1
        for _ in range(SETTLE_STEPS):
            stamp = step()
        seconds, lock_step, timers = [], True, set()
        for _ in range(windows):
            before = dict(tokens)
            start_stamp, start = stamp, clock()
            for _ in range(steps):
                stamp = step()
            end = clock()
            if start_stamp is not None and stamp is not None:
                seconds.append((stamp - start_stamp) / steps)
                timers.add("engine core")
            else:
                seconds.append((end - start) / steps)
                timers.add("step() calls")
            lock_step &= all(tokens[i] - before[i] == steps for i in ids)
    finally:
        engine.abort_request(ids)   # the front end forgets them at once; nothing to step
    return seconds, lock_step, prefill_steps, " + ".join(sorted(timers))


def summarize_windows(batch: int, seconds_per_step: list[float]) -> dict:
    """decode tok/s, time per output token (ms), the windows' spread (% of the median) and
    timing_ok ("" with one window) of the windows of ``timed_decode_windows``."""
    if batch < 1 or not seconds_per_step or min(seconds_per_step) <= 0:
        raise ValueError(f"no decode time: {batch=}, {seconds_per_step=}")
    step_s = statistics.median(seconds_per_step)
    spread = (max(seconds_per_step) - min(seconds_per_step)) / step_s
    return {"decode_tok_s": round(batch / step_s, 1), "tpot_ms": round(1000 * step_s, 3),
            "spread_pct": round(100 * spread, 2),
            "timing_ok": spread <= NOISE_FRACTION if len(seconds_per_step) > 1 else ""}


def _key(row: dict) -> tuple[int, int, str]:
    return int(row["heads"]), int(row["context"]), row["kv"]


def _num(value) -> float | None:
    return None if value in (None, "") else float(value)


def add_relative_columns(rows: list[dict]) -> list[dict]:
    """Fill ``speedup_vs_bf16`` and ``capacity_vs_bf16`` against the ``auto`` row of the same
    (heads, context); empty where that row or the value is missing."""
    base = {_key(r)[:2]: r for r in rows if r["kv"] == BASELINE_KV and not r.get("error")}
    for row in rows:
        ref = base.get(_key(row)[:2])
        for column, field in (("speedup_vs_bf16", "decode_tok_s"),
                              ("capacity_vs_bf16", "kv_cache_tokens")):
            ours, theirs = _num(row.get(field)), _num(ref.get(field)) if ref else None
            row[column] = round(ours / theirs, 3) if ours and theirs else ""
    return rows


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with rows of the same (heads, context, kv) replaced by ``new``, sorted."""
    merged = {_key(r): r for r in old}
    merged.update({_key(r): r for r in new})
    order = {kv: i for i, kv in enumerate(KV_SETTINGS)}
    return [merged[k] for k in sorted(merged, key=lambda k: (-k[0], k[1], order.get(k[2], 99),
                                                               k[2]))]


def read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _fmt(value, digits: int = 0) -> str:
    number = _num(value)
    if number is None:
        return "-"
    return f"{number:,.{digits}f}"


def format_table(rows: list[dict]) -> str:
    """Markdown table of the rows (as in h200-baselines.md)."""
    lines = [("| H | context | KV | backend | B | prefill steps | lock-step | timing (spread) | "
              "KV capacity (tokens) | capacity vs BF16 | decode tok/s | TPOT ms | vs BF16 |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['heads']} | {r['context']} | {r['kv']} | failed: "
                         f"{str(r['error'])[:80]} | | | | | | | | | |")
            continue
        lock_step = {"True": "yes", "False": "**no**"}.get(str(r.get("lock_step")), "-")
        timing = {"True": "ok", "False": "**noisy**"}.get(str(r.get("timing_ok")), "-")
        spread = _num(r.get("spread_pct"))
        timing += f" ({spread:.1f}%)" if spread is not None else ""
        lines.append(
            f"| {r['heads']} | {r['context']} | {r['kv']} | {r.get('backend') or '-'} | "
            f"{r['batch']} | {r.get('prefill_steps') or '-'} | {lock_step} | {timing} | "
            f"{_fmt(r['kv_cache_tokens'])} | {_fmt(r['capacity_vs_bf16'], 3)} | "
            f"{_fmt(r['decode_tok_s'])} | {_fmt(r['tpot_ms'], 2)} | "
            f"{_fmt(r['speedup_vs_bf16'], 2)} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> bool:
    """Decode tok/s (top) and speedup vs BF16 (bottom) against context, one column per head
    count.  Returns False (and writes nothing) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r.get("error") and _num(r.get("decode_tok_s"))]
    heads = sorted({int(r["heads"]) for r in ok}, reverse=True) or [0]
    fig, axes = plt.subplots(2, len(heads), figsize=(5.5 * len(heads), 7.5), squeeze=False,
                             sharex="col")
    for col, h in enumerate(heads):
        top, bottom = axes[0][col], axes[1][col]
        for kv in sorted({r["kv"] for r in ok}, key=lambda k: (k != BASELINE_KV, k)):
            series = sorted((int(r["context"]), r) for r in ok
                            if int(r["heads"]) == h and r["kv"] == kv)
            if not series:
                continue
            x = [c for c, _ in series]
            top.plot(x, [float(r["decode_tok_s"]) for _, r in series], "o-", label=kv)
            speed = [(c, _num(r.get("speedup_vs_bf16"))) for c, r in series]
            speed = [(c, s) for c, s in speed if s]
            if speed:
                bottom.plot(*zip(*speed), "o-", label=kv)
        top.set_title(f"{h} heads" + (" (one TP8 rank)" if h == 16 else ""))
        top.set_ylabel("decode tok/s")
        bottom.set_ylabel("speedup vs BF16")
        bottom.axhline(1.0, color="gray", lw=0.8)
        bottom.set_xlabel("context (tokens)")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle("vLLM decode throughput, batch filling a fixed KV-cache budget")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(rows: list[dict], out: Path) -> list[dict]:
    """Merge ``rows`` into ``out/results.csv`` and rewrite the table and plot; returns all rows."""
    out.mkdir(parents=True, exist_ok=True)
    rows = add_relative_columns(merge_rows(read_csv(out / "results.csv"), rows))
    write_csv(rows, out / "results.csv")
    (out / "results.md").write_text(format_table(rows))
    plot(rows, out / "results.png")
    return rows


# --- one engine per (heads, KV setting), in a child process ----------------------------------

# Room for W in max_model_len (fixed before the batch, hence W, is known).
MAX_WARM_TOKENS = 4096


def run_engine(spec: dict):
    """Build one engine and, for each context, fill its KV cache with a batch and time its decode
    steps (``timed_decode_windows``).  Yields one result per context (with ``context``)."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    gen, windows = spec["gen_tokens"], spec["windows"]
    timed_tokens = SETTLE_STEPS + windows * gen
    memory = ({"kv_cache_memory_bytes": int(spec["kv_cache_gib"] * 2**30)}
              if spec["kv_cache_gib"] else {"gpu_memory_utilization": 0.9})
    llm = LLM(model=spec["model"], kv_cache_dtype=spec["kv"], load_format="dummy",
              skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=max(spec["contexts"]) + MAX_WARM_TOKENS + timed_tokens,
              enable_prefix_caching=False, max_num_seqs=spec["max_batch"], seed=0,
              disable_log_stats=False, **memory)
    config = llm.llm_engine.vllm_config
    cache = config.cache_config
    capacity = cache.num_gpu_blocks * cache.block_size

    gen_ids = torch.Generator().manual_seed(0)
    vocab = DEEPSEEK_V31_ATTENTION["vocab_size"]
    llm.generate([{"prompt_token_ids": torch.randint(2, vocab, (256,), generator=gen_ids).tolist()}
                  for _ in range(4)],
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    # Block 0 is vLLM's null block: a batch sized on all blocks could be preempted.
    usable_blocks = cache.num_gpu_blocks - 1
    for context in spec["contexts"]:
        # The prefill's steps depend on B and B on them: size B without them, bound the steps
        # for that (larger) B, then size B again.
        batch = batch_to_fill(usable_blocks, cache.block_size, context, timed_tokens,
                              spec["max_batch"])
        warm = warm_tokens(max(batch, 1), context,
                           config.scheduler_config.max_num_batched_tokens)
        max_tokens = warm + timed_tokens
        batch = batch_to_fill(usable_blocks, cache.block_size, context, max_tokens,
                              spec["max_batch"])
        result = {"context": context, "batch": batch, "windows": windows,
                  "max_tokens": max_tokens, "kv_cache_tokens": capacity}
        if warm > MAX_WARM_TOKENS:
            yield {**result, "error": f"prefill needs {warm} warm tokens > {MAX_WARM_TOKENS}"}
            continue
        if batch < 1:
            yield {**result, "error": "KV cache holds no request of this length"}
            continue
        try:
            prompts = [{"prompt_token_ids": ids} for ids in
                       torch.randint(2, vocab, (batch, context), generator=gen_ids).tolist()]
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                    output_kind=RequestOutputKind.DELTA)
            seconds, lock_step, prefill_steps, timer = timed_decode_windows(
                llm.llm_engine, prompts, params, gen, windows)
            summary = summarize_windows(batch, seconds)
        except (RuntimeError, ValueError) as exc:   # this context fails; the next ones run
            yield {**result, "error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        yield {**result, **summary, "lock_step": lock_step, "prefill_steps": prefill_steps,
               "timer": timer}


def _child() -> None:
    spec = json.loads(sys.stdin.read())
    for result in run_engine(spec):
        print(RESULT_TAG + json.dumps(result), flush=True)


def parse_engine_log(spec: dict, log: str, failure: str | None) -> list[dict]:
    """One row per context of ``spec`` from a child's output: its results, the KV capacity and
    backend vLLM logged, and ``failure`` for the contexts that have no result."""
    results = {}
    for line in log.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
            results[result["context"]] = result
    logged = _KV_TOKENS_LOG.findall(log)
    backends = _BACKEND_LOG.findall(log)
    rows = []
    for context in spec["contexts"]:
        row = {"heads": spec["heads"], "context": context, "kv": spec["kv"],
               "gen_tokens": spec["gen_tokens"],
               "log_kv_cache_tokens": int(logged[-1].replace(",", "")) if logged else "",
               "backend": backends[-1] if backends else ""}
        row.update(results.get(context) or {"error": failure or "no result"})
        rows.append(row)
    return rows


def child_command() -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child"]


def run_in_subprocess(spec: dict, timeout: float, on_result=None) -> list[dict]:
    """Run one engine in a child process; ``on_result(result)`` sees each context's result
    as it arrives.  A crash or timeout keeps the contexts finished before it."""
    with tempfile.TemporaryFile("w+") as err:
        # A session of its own, so that a timeout also kills vLLM's engine-core process, which
        # would otherwise keep its GPU memory while the next engine starts.
        proc = subprocess.Popen(child_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, text=True, env=subprocess_env(),
                                start_new_session=True)
        proc.stdin.write(json.dumps(spec))
        proc.stdin.close()
        out = []

        def pump():
            for line in proc.stdout:
                out.append(line)
                if line.startswith(RESULT_TAG) and on_result:
                    on_result(json.loads(line[len(RESULT_TAG):]))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        failure = None
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            failure = f"timed out after {timeout:.0f} s"
        reader.join(10)
        err.seek(0)
        log = "".join(out) + err.read()
    if failure is None and proc.returncode != 0:
        print(log[-4000:], file=sys.stderr)
        last = [ln for ln in log.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        failure = f"exit {proc.returncode}: {last[0][-200:]}"
    return parse_engine_log(spec, log, failure)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/bench_e2e", help="folder for results.csv/md/png")
    parser.add_argument("--quick", action="store_true",
                        help=f"H=128 at 16k and 64k, T={QUICK['gen_tokens']}, "
                             f"{QUICK['kv_cache_gib']} GiB KV: 3 engines x 2 contexts")
    parser.add_argument("--heads", type=int, nargs="+", help=f"default {HEADS}")
    parser.add_argument("--contexts", type=int, nargs="+", help=f"default {CONTEXTS}")
    parser.add_argument("--kv", nargs="+", default=list(KV_SETTINGS), choices=KV_SETTINGS)
    parser.add_argument("--gen-tokens", type=int,
                        help="T, the decode steps of one timed window (default 512; "
                             f"--quick {QUICK['gen_tokens']})")
    parser.add_argument("--kv-cache-gib", type=float,
                        help="KV-cache budget per setting (default 24; --quick 4); 0 lets "
                             "vLLM fill 90%% of the GPU")
    parser.add_argument("--windows", type=int, default=2,
                        help="timed windows of T steps per context (median; spread reported)")
    parser.add_argument("--max-batch", type=int, default=512,
                        help="cap on the batch (vLLM captures CUDA graphs up to 512)")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds per context (an engine gets this times its contexts)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.windows < 1:
        parser.error(f"--windows must be at least 1, got {args.windows}")
    if args.child:
        _child()
        return

    quick = QUICK if args.quick else {}
    heads = args.heads or quick.get("heads", HEADS)
    contexts = args.contexts or quick.get("contexts", CONTEXTS)
    gen = args.gen_tokens or quick.get("gen_tokens", 512)
    kv_gib = args.kv_cache_gib if args.kv_cache_gib is not None else quick.get("kv_cache_gib",
                                                                               24.0)
    out = Path(args.out)
    engines = [(h, kv) for h in heads for kv in args.kv]
    print(f"{len(engines)} engines x {len(contexts)} contexts, T={gen}, KV budget "
          f"{f'{kv_gib} GiB' if kv_gib else '90% of the GPU'}, results in {out}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        models = {h: str(write_tiny_deepseek_v3(Path(tmp) / f"deepseek-v31-attn-h{h}",
                                                **model_config(h))) for h in heads}
        for i, (h, kv) in enumerate(engines, 1):
            print(f"[{i}/{len(engines)}] H={h} kv={kv}, contexts {list(contexts)} ...", flush=True)
            start = time.monotonic()

            def report(result, start=start):
                if result.get("error"):
                    print(f"    context {result['context']}: failed: {result['error']}",
                          flush=True)
                else:
                    flags = "".join(
                        [" NOT LOCK-STEP" if not result["lock_step"] else "",
                         " NOISY" if result["timing_ok"] is False else ""])
                    print(f"    context {result['context']}: B={result['batch']}, "
                          f"prefill {result['prefill_steps']} steps, "
                          f"{result['decode_tok_s']:,.0f} decode tok/s, TPOT "
                          f"{result['tpot_ms']:.2f} ms, windows {result['spread_pct']:.1f}% "
                          f"apart{flags} ({time.monotonic() - start:.0f} s)", flush=True)

            spec = {"model": models[h], "heads": h, "contexts": list(contexts), "kv": kv,
                    "gen_tokens": gen, "kv_cache_gib": kv_gib, "max_batch": args.max_batch,
                    "windows": args.windows}
            rows += run_in_subprocess(spec, args.timeout * len(contexts), on_result=report)
            write_outputs(rows, out)   # after every engine: a cut-short sweep keeps its rows
    print("\n" + format_table(write_outputs(rows, out)))
    if not (out / "results.png").exists():
        print("(no results.png: matplotlib is not installed; pip install matplotlib)")


if __name__ == "__main__":
    main()
