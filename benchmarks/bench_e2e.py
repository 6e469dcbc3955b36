"""End-to-end vLLM decode throughput: KV cache ``auto`` (BF16) vs ``fp8_snapmla`` vs ``fp8``.

    python -m benchmarks.bench_e2e --out out/bench_e2e [--quick]
        [--heads 128 16] [--contexts 16384 32768 65536 131072] [--kv auto fp8_snapmla fp8]
        [--tp N]

The model has DeepSeek-V3.1's attention shapes (hidden 7168, q_lora 1536, kv_lora 512, RoPE 64,
nope 128, v 128), 4 dense layers (intermediate 2048), DeepSeek's vocabulary and vLLM's dummy
weights.  128 heads is the whole model on one GPU; 16 heads stands in for one rank of TP8.
``--tp N`` runs the model with tensor parallelism over N GPUs instead (``--heads 128 --tp 8``:
DeepSeek-V3.1's attention as a TP8 deployment runs it, 16 heads per rank, the all-reduces
included); every rank holds the whole latent cache, so ``--kv-cache-gib`` is per GPU and the
capacity is what one GPU with that budget holds.

Each (heads, kv) pair runs in its own process (it owns the GPU) and builds one ``LLM`` for all
contexts (engine start-up and graph capture took most of a setting's 80-110 s when each
(heads, context, kv) had its own).  The engine has a fixed KV-cache budget (``--kv-cache-gib``,
the same bytes for every setting, so a smaller format holds more tokens); for each context the
batch fills the capacity vLLM allocated: B = blocks // blocks per request (context + generated
tokens), at most ``--max-batch``.
Method: random-token prompts of ``context`` tokens, prefix caching off, ``ignore_eos``, default
compilation (CUDA graphs, torch.compile).  The B requests go into the engine at once, and it is
stepped until every request has its first token, then ``--windows`` windows of T decode steps
are timed with the engine core's own timestamps (``timer``), as ``benchmarks/vllm_engine.py``
describes:

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
tok/s and speedup vs BF16 against context, per head count).  Each row names its run (date,
commit, GPU, vLLM, command, listed on top), and a ratio is only taken against ``auto`` of the
same run: a row measured by another command, maybe with another KV budget, commit or GPU,
gets none.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.provenance import describe, run_info
from benchmarks.step_profile import MOE_GROUPS, profiled, window_profile
from benchmarks.vllm_engine import (
    BASELINE_KV, DEEPSEEK_V31_ATTENTION, KV_SETTINGS, SETTLE_STEPS, batch_to_fill, build_llm,
    child_main, engine_log_facts, merge_by_key, model_config, not_lock_step, number,
    random_prompts, read_csv, run_child, run_number, summarize_windows, timed_decode_windows,
    visible_gpus, wait_for_go, warm_tokens, warm_up, write_csv)
from vllm_snapmla.testing import write_tiny_deepseek_v3

HEADS = (128, 16)
CONTEXTS = (16384, 32768, 65536, 131072)
QUICK = {"heads": (128,), "contexts": (16384, 65536), "gen_tokens": 128, "kv_cache_gib": 4.0}

CSV_FIELDS = ["run", "tp", "heads", "context", "kv", "backend", "batch", "gen_tokens", "windows",
              "max_tokens", "prefill_steps", "lock_step", "timer", "spread_pct", "window_ms",
              "timing_ok",
              "kv_cache_tokens", "log_kv_cache_tokens", "capacity_vs_bf16", "decode_tok_s",
              "tpot_ms", "speedup_vs_bf16", "start_s", "context_s", "error"]


# --- results (unit-tested on CPU) ------------------------------------------------------------

def _tp(row: dict) -> int:
    """The row's tensor-parallel size (rows recorded before the ``tp`` column ran on one GPU)."""
    return int(row.get("tp") or 1)


def _key(row: dict) -> tuple[int, int, int, str]:
    return _tp(row), int(row["heads"]), int(row["context"]), row["kv"]


def _pair_key(row: dict) -> tuple:
    """What a row and its BF16 row share: parallelism, shape and run (rows recorded before the
    ``run`` column have none, and pair among themselves)."""
    return (*_key(row)[:3], str(row.get("run") or ""))


def add_relative_columns(rows: list[dict]) -> list[dict]:
    """Fill ``speedup_vs_bf16`` and ``capacity_vs_bf16`` against the ``auto`` row of the same
    (tp, heads, context) and run; empty where that row or the value is missing, and no speedup where
    either row was not lock-step."""
    base = {_pair_key(r): r for r in rows if r["kv"] == BASELINE_KV and not r.get("error")}
    for row in rows:
        ref = base.get(_pair_key(row))
        lock_step = not (ref and (not_lock_step(row) or not_lock_step(ref)))
        for column, field in (("speedup_vs_bf16", "decode_tok_s"),
                              ("capacity_vs_bf16", "kv_cache_tokens")):
            ours, theirs = number(row.get(field)), number(ref.get(field)) if ref else None
            usable = ours and theirs and (lock_step or column == "capacity_vs_bf16")
            row[column] = round(ours / theirs, 3) if usable else ""
    return rows


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with rows of the same (tp, heads, context, kv) replaced by ``new``, sorted."""
    order = {kv: i for i, kv in enumerate(KV_SETTINGS)}
    return merge_by_key(old, new, _key,
                        lambda k: (k[0], -k[1], k[2], order.get(k[3], 99), k[3]))


def _fmt(value, digits: int = 0) -> str:
    value = number(value)
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def format_table(rows: list[dict], runs: list[str] = ()) -> str:
    """Markdown table of the rows, under the list of ``runs`` the ``run`` column numbers."""
    lines = [f"run {i}: {text}" for i, text in enumerate(runs, 1)] + ([""] if runs else [])
    lines += [("| run | TP | H | context | KV | backend | B | prefill steps | lock-step | "
               "timing (spread) | KV capacity (tokens per GPU) | capacity vs BF16 (same run) | "
               "decode tok/s | TPOT ms | vs BF16 (same run) |"),
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r.get('run') or '-'} | {_tp(r)} | {r['heads']} | {r['context']} "
                         f"| {r['kv']} | failed: {str(r['error'])[:80]} | | | | | | | | | |")
            continue
        lock_step = {"True": "yes", "False": "**no**"}.get(str(r.get("lock_step")), "-")
        timing = {"True": "ok", "False": "**noisy**"}.get(str(r.get("timing_ok")), "-")
        spread = number(r.get("spread_pct"))
        timing += f" ({spread:.1f}%)" if spread is not None else ""
        lines.append(
            f"| {r.get('run') or '-'} | {_tp(r)} | {r['heads']} | {r['context']} | {r['kv']} | "
            f"{r.get('backend') or '-'} | "
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

    ok = [r for r in rows if not r.get("error") and number(r.get("decode_tok_s"))]
    panels = sorted({(_tp(r), int(r["heads"])) for r in ok}, key=lambda p: (p[0], -p[1]))
    panels = panels or [(1, 0)]
    fig, axes = plt.subplots(2, len(panels), figsize=(5.5 * len(panels), 7.5), squeeze=False,
                             sharex="col")
    for col, (tp, h) in enumerate(panels):
        top, bottom = axes[0][col], axes[1][col]
        for kv in sorted({r["kv"] for r in ok}, key=lambda k: (k != BASELINE_KV, k)):
            series = sorted((int(r["context"]), r) for r in ok
                            if (_tp(r), int(r["heads"])) == (tp, h) and r["kv"] == kv)
            if not series:
                continue
            x = [c for c, _ in series]
            top.plot(x, [float(r["decode_tok_s"]) for _, r in series], "o-", label=kv)
            speed = [(c, number(r.get("speedup_vs_bf16"))) for c, r in series]
            speed = [(c, s) for c, s in speed if s]
            if speed:
                bottom.plot(*zip(*speed), "o-", label=kv)
        top.set_title(f"{h} heads, TP{tp} ({h // tp} per GPU)" if tp > 1 else
                      f"{h} heads" + (" (one TP8 rank)" if h == 16 else ""))
        top.set_ylabel("decode tok/s")
        bottom.set_ylabel("speedup vs BF16")
        bottom.axhline(1.0, color="gray", lw=0.8)
        bottom.set_xlabel("context (tokens)")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:   # a panel may have no series
                ax.legend()
    fig.suptitle("vLLM decode throughput, batch filling a fixed KV-cache budget")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(rows: list[dict], out: Path, header: str) -> list[dict]:
    """Merge ``rows``, the rows of the run ``header`` describes, into ``out/results.csv`` and
    rewrite the table and plot; returns all rows."""
    out.mkdir(parents=True, exist_ok=True)
    runs, old = read_csv(out / "results.csv")
    run = run_number(runs, header)
    rows = add_relative_columns(merge_rows(old, [{**r, "run": run} for r in rows]))
    write_csv(rows, out / "results.csv", CSV_FIELDS, comments=runs)
    (out / "results.md").write_text(format_table(rows, runs))
    plot(rows, out / "results.png")
    return rows


# --- one engine per (heads, KV setting), in a child process ----------------------------------

# Room for W in max_model_len (fixed before the batch, hence W, is known).
MAX_WARM_TOKENS = 4096


def plan_context(usable_blocks: int, block_size: int, context: int, timed_tokens: int,
                 draft: int, max_batched_tokens: int, max_batch: int) -> dict:
    """The batch ``run_engine`` fills at ``context`` in ``usable_blocks`` pages: ``batch``,
    its requests' ``max_tokens`` (the prefill's warm-up tokens, times ``1 + draft`` speculative
    tokens per step, and the ``timed_tokens``) and the ``reason`` it cannot run (None: it can).
    The prefill's steps depend on the batch and the batch on them: size it without them, bound
    the steps for that (larger) batch, then size it again."""
    batch = batch_to_fill(usable_blocks, block_size, context, timed_tokens, max_batch)
    warm = warm_tokens(max(batch, 1), context, max_batched_tokens)
    max_tokens = warm * (1 + draft) + timed_tokens
    batch = batch_to_fill(usable_blocks, block_size, context, max_tokens, max_batch)
    reason = None
    if warm > MAX_WARM_TOKENS:
        reason = f"prefill needs {warm} warm tokens > {MAX_WARM_TOKENS}"
    elif batch < 1:
        reason = "KV cache holds no request of this length"
    return {"batch": batch, "max_tokens": max_tokens, "reason": reason}


def run_engine(spec: dict):
    """Build one engine and, for each context, fill its KV cache with a batch and time its decode
    steps (``timed_decode_windows``).  Yields ``{"kind": "engine", ...}`` once the engine is up
    and warm, then one result per context (with ``context``).  ``spec["env"]``, if given, is
    set before vLLM starts (its engine-core process inherits it)."""
    os.environ.update(spec.get("env") or {})
    import torch
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    gen, windows = spec["gen_tokens"], spec["windows"]
    profile_steps = spec.get("profile_steps") or 0
    timed_tokens = SETTLE_STEPS + windows * gen + profile_steps
    # With speculative decoding a step can add 1 + k tokens to a request.
    draft = (spec.get("speculative_config") or {}).get("num_speculative_tokens", 0)
    timed_tokens *= 1 + draft
    started = time.monotonic()
    llm = build_llm(spec["model"], spec["kv"],
                    max(spec["contexts"]) + MAX_WARM_TOKENS + timed_tokens,
                    spec["kv_cache_gib"], spec["max_batch"],
                    speculative_config=spec.get("speculative_config"),
                    gpu_memory_utilization=spec.get("gpu_memory_utilization"),
                    tensor_parallel_size=spec.get("tensor_parallel_size", 1))
    config = llm.llm_engine.vllm_config
    cache = config.cache_config
    capacity = cache.num_gpu_blocks * cache.block_size

    gen_ids = torch.Generator().manual_seed(0)
    vocab = spec.get("vocab", DEEPSEEK_V31_ATTENTION["vocab_size"])
    warm_up(llm, gen_ids, vocab)
    yield {"kind": "engine", "kv_cache_tokens": capacity,
           "start_s": round(time.monotonic() - started, 1)}
    wait_for_go(spec.get("go_file"))   # the other engines of a concurrent start come up
    # Block 0 is vLLM's null block: a batch sized on all blocks could be preempted.
    usable_blocks = cache.num_gpu_blocks - 1
    for context in spec["contexts"]:
        plan = plan_context(usable_blocks, cache.block_size, context, timed_tokens, draft,
                            config.scheduler_config.max_num_batched_tokens, spec["max_batch"])
        batch, max_tokens = plan["batch"], plan["max_tokens"]
        result = {"context": context, "batch": batch, "windows": windows,
                  "max_tokens": max_tokens, "kv_cache_tokens": capacity}
        if plan["reason"]:
            yield {**result, "error": plan["reason"]}
            continue
        context_started = time.monotonic()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                    output_kind=RequestOutputKind.DELTA)
            gained: list[int] = []
            profile: dict = {}

            def profile_window(step, _tokens):
                profile.update(window_profile(
                    profiled(lambda: [step() for _ in range(profile_steps)]), profile_steps,
                    MOE_GROUPS))

            seconds, lock_step, prefill_steps, timer = timed_decode_windows(
                llm.llm_engine, random_prompts(gen_ids, batch, context, vocab), params, gen,
                windows, id_prefix=f"bench-e2e-{context}", window_tokens=gained,
                after_windows=profile_window if profile_steps else None)
            summary = summarize_windows(batch, seconds)
            # Tokens per request and step (1 without speculative decoding; decode_tok_s counts
            # one per request and step).
            per_step = sum(gained) / (batch * gen * windows)
            summary.update(tokens_per_step=round(per_step, 4))
        except (RuntimeError, ValueError) as exc:   # this context fails; the next ones run
            yield {**result, "error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        yield {**result, **summary, "lock_step": lock_step, "prefill_steps": prefill_steps,
               "timer": timer, "context_s": round(time.monotonic() - context_started, 1),
               **({"profile": profile} if profile else {})}


def parse_engine_log(spec: dict, results: list[dict], log: str, failure: str | None
                     ) -> list[dict]:
    """One row per context of ``spec`` from a child's results and output: the KV capacity and
    backend vLLM logged, and ``failure`` for the contexts that have no result."""
    by_context = {result["context"]: result for result in results
                  if result.get("kind") != "engine"}
    facts = engine_log_facts(log)
    # The engine's start-up (build and warm-up), in every row: what time estimates check.
    facts.update({"start_s": r["start_s"] for r in results
                  if r.get("kind") == "engine" and "start_s" in r})
    rows = []
    for context in spec["contexts"]:
        row = {"tp": spec.get("tensor_parallel_size", 1), "heads": spec["heads"],
               "context": context, "kv": spec["kv"], "gen_tokens": spec["gen_tokens"], **facts}
        row.update(by_context.get(context) or {"error": failure or "no result"})
        rows.append(row)
    return rows


def print_progress(result: dict, start: float, prefix: str = "") -> None:
    """One line per message of an engine child as it arrives: the engine up, or a context's
    result or failure; ``start`` is the engine's ``time.monotonic()`` start.  One write per
    line, so that engines reporting from several threads do not interleave within a line."""
    elapsed = f"({time.monotonic() - start:.0f} s)"
    if result.get("kind") == "engine":
        line = f"    engine up, KV cache {result['kv_cache_tokens']:,} tokens {elapsed}"
    elif result.get("error"):
        line = f"    context {result['context']}: failed: {result['error']} {elapsed}"
    else:
        flags = "".join([" NOT LOCK-STEP" if not result["lock_step"] else "",
                         " NOISY" if result["timing_ok"] is False else ""])
        line = (f"    context {result['context']}: B={result['batch']}, prefill "
                f"{result['prefill_steps']} steps, {result['decode_tok_s']:,.0f} decode tok/s, "
                f"TPOT {result['tpot_ms']:.2f} ms, windows {result['spread_pct']:.1f}% "
                f"apart{flags} {elapsed}")
    sys.stdout.write(prefix + line + "\n")
    sys.stdout.flush()


def child_command() -> list[str]:
    return [sys.executable, "-m", "benchmarks.bench_e2e", "--child"]


def run_in_subprocess(spec: dict, timeout: float, on_result=None,
                      startup_timeout: float | None = None) -> list[dict]:
    """Run one engine in a child process; ``on_result(result)`` sees each context's result
    as it arrives.  A crash or timeout keeps the contexts finished before it."""
    results, log, failure = run_child(child_command(), spec, timeout, on_result,
                                      startup_timeout=startup_timeout)
    return parse_engine_log(spec, results, log, failure)


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
                        help="KV-cache budget per setting (default 24; --quick 4), per GPU "
                             "with --tp; 0 lets vLLM fill 90%% of the GPU")
    parser.add_argument("--windows", type=int, default=2,
                        help="timed windows of T steps per context (median; spread reported)")
    parser.add_argument("--max-batch", type=int, default=512,
                        help="cap on the batch (vLLM captures CUDA graphs up to 512)")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds per context (an engine gets this times its contexts)")
    parser.add_argument("--tp", type=int, default=1, metavar="N",
                        help="tensor parallelism over N GPUs (every --heads a multiple of N; "
                             "--kv-cache-gib is then per GPU)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.windows < 1:
        parser.error(f"--windows must be at least 1, got {args.windows}")
    if args.gen_tokens is not None and args.gen_tokens < 1:
        parser.error(f"--gen-tokens must be at least 1, got {args.gen_tokens}")
    if args.max_batch < 1:
        parser.error(f"--max-batch must be at least 1, got {args.max_batch}")
    if args.child:
        child_main(run_engine)
        return

    quick = QUICK if args.quick else {}
    heads = args.heads or quick.get("heads", HEADS)
    if args.tp > 1 and not args.heads:
        parser.error("--tp needs --heads: the model's head count (128 for DeepSeek-V3.1)")
    if args.tp < 1 or any(h % args.tp for h in heads):
        parser.error(f"--tp {args.tp} must be at least 1 and divide every head count {heads}")
    if args.tp > 1 and (gpus := visible_gpus()) is not None and gpus < args.tp:
        parser.error(f"--tp {args.tp} needs {args.tp} GPUs; {gpus} visible")
    contexts = args.contexts or quick.get("contexts", CONTEXTS)
    gen = args.gen_tokens or quick.get("gen_tokens", 512)
    kv_gib = args.kv_cache_gib if args.kv_cache_gib is not None else quick.get("kv_cache_gib",
                                                                               24.0)
    out = Path(args.out)
    header = describe(run_info("benchmarks.bench_e2e", argv))
    engines = [(h, kv) for h in heads for kv in args.kv]
    budget = f"{kv_gib} GiB" if kv_gib else "90% of the GPU"
    if args.tp > 1:
        budget = (f"{kv_gib} GiB per GPU" if kv_gib else "90% of each GPU") + f", TP{args.tp}"
    print(f"{len(engines)} engines x {len(contexts)} contexts, T={gen}, KV budget {budget}, "
          f"results in {out}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        models = {h: str(write_tiny_deepseek_v3(Path(tmp) / f"deepseek-v31-attn-h{h}",
                                                **model_config(h))) for h in heads}
        for i, (h, kv) in enumerate(engines, 1):
            print(f"[{i}/{len(engines)}] H={h} kv={kv}{f' TP{args.tp}' if args.tp > 1 else ''}, "
                  f"contexts {list(contexts)} ...", flush=True)
            start = time.monotonic()
            spec = {"model": models[h], "heads": h, "contexts": list(contexts), "kv": kv,
                    "gen_tokens": gen, "kv_cache_gib": kv_gib, "max_batch": args.max_batch,
                    "windows": args.windows, "tensor_parallel_size": args.tp}
            rows += run_in_subprocess(spec, args.timeout * len(contexts),
                                      on_result=functools.partial(print_progress, start=start))
            # After every engine: a cut-short sweep keeps its rows.
            write_outputs(rows, out, header)
    print("\n" + (out / "results.md").read_text())
    if not (out / "results.png").exists():
        print("(no results.png: matplotlib is not installed; pip install matplotlib)")


if __name__ == "__main__":
    main()
