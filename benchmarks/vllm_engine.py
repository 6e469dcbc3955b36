"""What the benchmarks through vLLM (``bench_e2e``, ``bench_matrix``, ``bench_deployment``)
share: the DeepSeek-V3.1-attention model, batch sizing, the timing of decode steps through
``LLMEngine``, one vLLM engine per child process with its results streamed back as they come,
engines started together; and the CSV helpers ``bench_decode`` and ``explain_matrix`` use too.

Timing method (``timed_decode_windows``): the requests go into the engine at once and it is
stepped (``LLMEngine.step``, the loop inside ``LLM.generate``) until every request has its first
token, that is until the chunked prefill is over, and SETTLE_STEPS steps more.  Then consecutive
windows of T steps are timed with the engine core's own timestamps of its steps, and the requests
are aborted.

    time per output token = median over the windows of (window time / T)
    decode tok/s = B / time per output token
"""

from __future__ import annotations

import contextlib
import csv
import faulthandler
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

from benchmarks.provenance import gpu_query

NOISE_FRACTION = 0.05   # largest spread of the timed windows, as a fraction of their median
SETTLE_STEPS = 4        # decode steps of all requests before the first timed window

# Rates the benchmarks' time estimates (--dry-run, --budget-s) assume, pessimistic for an H200:
# prefill GEMMs at half what these shapes reach (about 4e14 FLOP/s in BF16), prefill attention.
PREFILL_GEMM_FLOPS_PER_S = 2e14
ATTENTION_FLOPS_PER_S = 3e14
# 2 x (192 + 128): QK^T and PV FLOPs per (query, key) pair and head of MLA's prefill.
ATTENTION_FLOPS_PER_PAIR_AND_HEAD = 640


def mla_projection_weights(heads: int) -> int:
    """Weights of one MLA layer's projections (q_a, q_b, kv_a, kv_b, o) with DeepSeek-V3.1's
    attention shapes at ``heads`` heads: what a prefill token multiplies through in attention
    besides the attention itself."""
    c = DEEPSEEK_V31_ATTENTION
    hidden, q_rank, kv_rank = c["hidden_size"], c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    return (hidden * q_rank + q_rank * heads * (nope + rope) + hidden * (kv_rank + rope)
            + kv_rank * heads * (nope + v) + heads * v * hidden)


def estimated_prefill_s(batch: int, context: int, heads: int, layers: int,
                        weights_per_token: int) -> float:
    """Pessimistic seconds to prefill ``batch`` prompts of ``context`` tokens: 2 FLOPs per
    weight each token multiplies through, and causal attention in ``layers`` layers of
    ``heads`` heads, at the rates above."""
    tokens = batch * context
    pairs = tokens * context / 2
    return (2 * tokens * weights_per_token / PREFILL_GEMM_FLOPS_PER_S
            + layers * heads * pairs * ATTENTION_FLOPS_PER_PAIR_AND_HEAD / ATTENTION_FLOPS_PER_S)

# DeepSeek-V3.1 attention; 4 dense layers keep the non-attention work small, as in the baseline.
DEEPSEEK_V31_ATTENTION = {
    "hidden_size": 7168, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "num_hidden_layers": 4,
    "intermediate_size": 2048, "first_k_dense_replace": 4, "vocab_size": 129280,
    "max_position_embeddings": 163840,
}
BLOCK_SIZE = 64   # tokens per KV page of every MLA backend here (FlashMLA and fp8_snapmla)
# Cache bytes per token and layer of each --kv-cache-dtype: BF16 576-wide rows; vLLM's FP8 rows;
# fp8_snapmla's 512 FP8 + 4-byte scale + 64 BF16 RoPE, padded to 656.
KV_BYTES_PER_TOKEN = {"auto": 1152, "fp8": 576, "fp8_snapmla": 656}
# The --kv-cache-dtype settings every engine benchmark compares, and the one ratios are taken
# against (vLLM's BF16 default).
KV_SETTINGS = ("auto", "fp8_snapmla", "fp8")
BASELINE_KV = "auto"
# A second BF16 engine in a comparison (``bench_matrix --twin``): an A/A control.  Its ratio to
# BF16's engine is what the method reads between two engines of one format.
TWIN_KV = "auto_twin"

RESULT_TAG = "BENCH_ENGINE_RESULT "
_KV_TOKENS_LOG = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_BACKEND_LOG = re.compile(r"Using (\w+) attention backend")
_ROUTING_LOG = re.compile(r"Simulating MoE routing using a (\w+) strategy")


# --- pure helpers (unit-tested on CPU) -----------------------------------------------------

def cache_dtype(kv: str) -> str:
    """vLLM's ``kv_cache_dtype`` of a benchmark format (the A/A twin's is BF16's)."""
    return BASELINE_KV if kv == TWIN_KV else kv


def model_config(heads: int, layers: int | None = None) -> dict:
    """Overrides of the tiny DeepSeek-V3 config that give DeepSeek-V3.1's attention shapes;
    ``layers``: that many dense layers instead of 4 (none of them MoE)."""
    config = {**DEEPSEEK_V31_ATTENTION, "num_attention_heads": heads, "num_key_value_heads": heads}
    if layers is not None:
        config.update(num_hidden_layers=layers, first_k_dense_replace=layers)
    return config


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


def estimated_kv_blocks(kv: str, kv_cache_gib: float, num_layers: int) -> int:
    """KV pages vLLM allocates for ``kv_cache_gib`` GiB over ``num_layers`` layers (its null
    block included), as vLLM divides ``kv_cache_memory_bytes``: for planning before an engine
    exists; the engine reports the real number."""
    page_bytes = BLOCK_SIZE * KV_BYTES_PER_TOKEN[cache_dtype(kv)] * num_layers
    return int(kv_cache_gib * 2**30) // page_bytes


def core_timestamp(output) -> float | None:
    """The engine core's ``time.monotonic()`` of the step that produced ``output``'s newest
    token (needs stats logging on), or None."""
    return getattr(getattr(output, "metrics", None), "last_token_ts", None) or None


def timed_decode_windows(engine, prompts: list, params, steps: int, windows: int,
                         clock=time.perf_counter, id_prefix: str = "bench",
                         window_tokens: list | None = None, after_windows=None
                         ) -> tuple[list[float], bool, int, str]:
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
    the ``step()`` calls.  ``window_tokens``, if given, receives the tokens all requests gained
    in each window (more than one per step with speculative decoding).  ``after_windows``, if
    given, is called after the last window with a function that runs one more engine step (the
    requests still decode: ``params`` must leave room for those steps too) and the tokens each
    request has gained so far, a dict that those steps keep up to date.  The requests are
    aborted after that."""
    ids = [f"{id_prefix}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    tokens = dict.fromkeys(ids, 0)

    def step() -> float | None:
        """One engine step; the core's timestamp of it, if its outputs carry one."""
        stamps = []
        for output in engine.step():
            tokens[output.request_id] += len(output.outputs[0].token_ids)
            stamp = core_timestamp(output)
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
            if window_tokens is not None:
                window_tokens.append(sum(tokens[i] - before[i] for i in ids))
        if after_windows is not None:
            after_windows(step, tokens)
    finally:
        engine.abort_request(ids)   # the front end forgets them at once; nothing to step
    return seconds, lock_step, prefill_steps, " + ".join(sorted(timers))


def summarize_windows(batch: int, seconds_per_step: list[float]) -> dict:
    """decode tok/s, time per output token (ms), the windows' spread (% of the median), each
    window's ms per step (space-separated: one slow window and a slow engine look different)
    and timing_ok ("" with one window) of the windows of ``timed_decode_windows``."""
    if batch < 1 or not seconds_per_step or min(seconds_per_step) <= 0:
        raise ValueError(f"no decode time: {batch=}, {seconds_per_step=}")
    step_s = statistics.median(seconds_per_step)
    spread = (max(seconds_per_step) - min(seconds_per_step)) / step_s
    return {"decode_tok_s": round(batch / step_s, 1), "tpot_ms": round(1000 * step_s, 3),
            "spread_pct": round(100 * spread, 2),
            "window_ms": " ".join(f"{1000 * s:.3f}" for s in seconds_per_step),
            "timing_ok": spread <= NOISE_FRACTION if len(seconds_per_step) > 1 else ""}


def number(value) -> float | None:
    """A CSV cell as a float; None when empty."""
    return None if value in (None, "") else float(value)


def kernel_totals(launches) -> dict[str, list[float]]:
    """``{name: [µs, launches]}`` summed over ``launches``, ``(name, µs)`` of every kernel launch
    a profile saw: how the benchmarks that profile (bench_decode, step_profile) count kernels."""
    totals: dict[str, list[float]] = {}
    for name, us in launches:
        entry = totals.setdefault(name, [0.0, 0])
        entry[0] += us
        entry[1] += 1
    return totals


# How a skip for want of time starts its reason (``--budget-s``): the run did not get to the cell.
BUDGET_SKIP = "--budget-s:"


def skipped_for_time(row: dict) -> bool:
    """A row its run did not get to (``BUDGET_SKIP``): it says nothing about the cell."""
    return row.get("status") == "skipped" and str(row.get("reason") or "").startswith(BUDGET_SKIP)


def merge_by_key(old: list[dict], new: list[dict], key, order=None) -> list[dict]:
    """``old`` with each row whose ``key(row)`` a row of ``new`` shares replaced by that row, the
    rest of ``new`` added; sorted by ``order(key)``, or in the order keys first appear without
    one.  How every benchmark merges a run into the results already in its output folder.  A
    new row skipped for want of time (status ``skipped``, reason ``BUDGET_SKIP``) does not
    replace an old one that ran (``ok`` or ``failed``): a shorter run into the same folder must
    not erase what an earlier one measured.  Any other skip (a cache too small, say, with this
    run's settings) replaces it."""
    merged = {key(r): r for r in old}
    for row in new:
        kept = merged.get(key(row))
        if skipped_for_time(row) and kept is not None and kept.get("status") in ("ok", "failed"):
            continue
        merged[key(row)] = row
    return [merged[k] for k in (merged if order is None else sorted(merged, key=order))]


def read_csv(path: Path) -> tuple[list[str], list[dict]]:
    """The ``# `` comment lines at the top of a CSV (without the ``# ``) and its rows."""
    if not path.exists():
        return [], []
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    comments = [line[2:] for line in lines if line.startswith("# ")]
    return comments, list(csv.DictReader(line for line in lines if not line.startswith("#")))


def run_number(runs: list[str], header: str) -> int:
    """The 1-based number of the run ``header`` describes among a results file's ``runs`` (its
    ``# `` comment lines), appending it when new: rows name their run by this number."""
    if header not in runs:
        runs.append(header)
    return runs.index(header) + 1


def drop_unused_runs(runs: list[str], rows: list[dict]) -> tuple[list[str], list[dict]]:
    """The runs some row still names (a rerun replaces all of an older run's rows), numbered
    again from 1 in their order, and the rows renumbered to match."""
    used = sorted({int(r["run"]) for r in rows})
    renumber = {old: new for new, old in enumerate(used, 1)}
    return ([runs[old - 1] for old in used],
            [{**r, "run": renumber[int(r["run"])]} for r in rows])


def write_csv(rows: list[dict], path: Path, fields: list[str], comments=()) -> None:
    """``rows`` under a header of ``# `` comment lines; unknown keys dropped, missing ones empty."""
    with open(path, "w", newline="") as f:
        for comment in comments:
            f.write(f"# {comment}\n")
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def engine_log_facts(log: str) -> dict:
    """The KV capacity (tokens), the attention backend and the MoE routing simulator's strategy
    a vLLM engine logged ("" if not)."""
    logged = _KV_TOKENS_LOG.findall(log)
    backends = _BACKEND_LOG.findall(log)
    routing = _ROUTING_LOG.findall(log)
    return {"log_kv_cache_tokens": int(logged[-1].replace(",", "")) if logged else "",
            "backend": backends[-1] if backends else "",
            "simulated_routing": routing[-1] if routing else ""}


# --- one engine in a child process -------------------------------------------------------------

def build_llm(model: str, kv: str, max_model_len: int, kv_cache_gib: float, max_batch: int, *,
              enforce_eager: bool = False, max_num_batched_tokens: int | None = None,
              speculative_config: dict | None = None,
              gpu_memory_utilization: float | None = None, tensor_parallel_size: int = 1):
    """The ``LLM`` every benchmark engine is: dummy weights, no tokenizer, prefix caching off,
    stats logging on (for the core's timestamps), a KV cache of ``kv_cache_gib`` GiB whatever
    the dtype (0: 90% of the GPU; per GPU with ``tensor_parallel_size``), default compilation
    unless ``enforce_eager``.
    ``gpu_memory_utilization`` with a fixed KV size only lowers the free memory vLLM demands at
    start-up, so that several engines can share the GPU."""
    from vllm import LLM

    memory = ({"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)} if kv_cache_gib
              else {"gpu_memory_utilization": 0.9})
    if gpu_memory_utilization is not None and kv_cache_gib:
        memory["gpu_memory_utilization"] = gpu_memory_utilization
    if max_num_batched_tokens:
        memory["max_num_batched_tokens"] = max_num_batched_tokens
    if speculative_config:
        memory["speculative_config"] = speculative_config
    if tensor_parallel_size > 1:
        memory["tensor_parallel_size"] = tensor_parallel_size
    return LLM(model=model, kv_cache_dtype=cache_dtype(kv), load_format="dummy",
               skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_model_len,
               enable_prefix_caching=False, max_num_seqs=max_batch, seed=0,
               disable_log_stats=False, enforce_eager=enforce_eager, **memory)


def random_prompts(generator, batch: int, length: int,
                   vocab: int = DEEPSEEK_V31_ATTENTION["vocab_size"]) -> list[dict]:
    """``batch`` prompts of ``length`` random token ids below ``vocab`` (no special tokens 0
    and 1)."""
    import torch

    return [{"prompt_token_ids": ids}
            for ids in torch.randint(2, vocab, (batch, length), generator=generator).tolist()]


def not_lock_step(row: dict) -> bool:
    """The timed steps were not one token per request each (``decode_tok_s`` = B / step then
    overstates the throughput), as a fresh row or one read back from a CSV says it."""
    return str(row.get("lock_step")) == "False"


def warm_up(llm, generator, vocab: int = DEEPSEEK_V31_ATTENTION["vocab_size"]) -> None:
    """A few short requests, so that the first measured cell does not pay for first-use costs."""
    from vllm import SamplingParams

    llm.generate(random_prompts(generator, 4, 256, vocab),
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)


def set_switch_interval(worker, seconds: float) -> tuple[int, float]:
    """For ``LLM.collective_rpc``: Python's GIL switch interval (``sys.setswitchinterval``) of
    the process running ``worker`` (vLLM's engine core) set to ``seconds``; returns that
    process's pid and the interval it now has."""
    sys.setswitchinterval(seconds)
    return os.getpid(), sys.getswitchinterval()


def apply_switch_interval(llm, seconds: float) -> None:
    """Set the GIL switch interval in every process of ``llm`` that runs a worker (a callable
    through ``collective_rpc`` needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 set before the engine
    starts).  Raises RuntimeError if a process does not report the interval back."""
    reports = llm.collective_rpc(set_switch_interval, args=(seconds,))
    if not reports:
        raise RuntimeError("no engine process reported its switch interval")
    for pid, interval in reports:
        # CPython keeps the interval in whole microseconds.
        if round(interval * 1e6) != round(seconds * 1e6):
            raise RuntimeError(f"engine process {pid} has switch interval {interval} s, "
                               f"not {seconds} s")


# An engine child stopped by stall_watchdog exits with this status.
STALL_EXIT = 3


def enable_stall_dumps() -> None:
    """In an engine child, before vLLM starts its engine core: a fatal signal (SIGABRT from
    ``stall_watchdog``) makes this process and every Python process it starts print their
    threads' stacks to stderr, forked (faulthandler's state) or spawned (the environment)."""
    faulthandler.enable(all_threads=True)
    os.environ["PYTHONFAULTHANDLER"] = "1"


def _group_pids() -> list[int]:
    """The other processes of this process's group (Linux: /proc)."""
    me, group = os.getpid(), os.getpgid(0)
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            try:
                if os.getpgid(int(entry)) == group:
                    pids.append(int(entry))
            except OSError:   # gone meanwhile
                pass
    return pids


@contextlib.contextmanager
def stall_watchdog(limit_s: float, result: dict, what: str, settle_s: float = 5.0):
    """In an engine child: if the body is still running ``limit_s`` after it began, the
    measurement has stalled (a hung kernel or a deadlocked engine).  Then, from a timer thread:
    the GPU's utilization and this process's stacks go to stderr, every other process of its
    group gets SIGABRT (vLLM's engine core prints its stacks, ``enable_stall_dumps``), ``result``
    goes out as this measurement's result with status "failed" and the stall as its reason,
    and the process exits with ``STALL_EXIT`` (the engine's later cells then come back
    without a result).  So a hang costs one cell and leaves its evidence in the engine's log,
    instead of holding the run to its timeout.  The group is signalled only when this process
    leads it (``run_child`` starts a child in a session of its own)."""
    began = time.monotonic()

    def stalled() -> None:
        utilization = gpu_query("utilization.gpu")
        reason = (f"stalled: no result {time.monotonic() - began:.0f} s after it began"
                  + (f" (GPU utilization {utilization}%)" if utilization else ""))
        sys.stderr.write(f"\n=== {what}: {reason}; the stacks of this process, then of the "
                         "others of its group ===\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if os.getpgid(0) == os.getpid():
            for pid in _group_pids():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGABRT)
            time.sleep(settle_s)   # their stacks, before this process's exit ends the log
        print(RESULT_TAG + json.dumps({**result, "status": "failed", "reason": reason}),
              flush=True)
        sys.stderr.write(f"engine stopped: {what} {reason}\n")
        sys.stderr.flush()
        os._exit(STALL_EXIT)

    timer = threading.Timer(limit_s, stalled)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def child_main(run) -> None:
    """Body of a benchmark's ``--child``: the spec from stdin, each result of ``run(spec)`` to
    stdout as it comes."""
    spec = json.loads(sys.stdin.read())
    for result in run(spec):
        print(RESULT_TAG + json.dumps(result), flush=True)


def run_engines_together(launches: list, go_dir: Path, in_turns: bool = False,
                         turn_limit_s: float | None = None,
                         rotate_every: int | None = None) -> list:
    """Run several engines with overlapping start-ups but one measurement at a time.

    ``launches[k](go_file, on_up)`` runs engine k to the end and returns its outcome; its child
    calls ``on_up()`` (through the parent's result handler) once the engine is up and warm, then
    waits for its go (``wait_for_turn``) before it measures.  All engines start at once, so
    their compilation and CUDA-graph capture overlap; once every one is up (or has ended):

    - by default the go files are created one at a time, in order, each after the previous
      engine has ended, so no start-up and no other engine's work overlaps a measurement;
    - ``in_turns``: the engines measure in turns, one measurement (turn) each, in order, then
      the next turn: engine k's turn t starts when engine k-1 has ended its turn t (or its
      process), so that the same measurement on every engine lies within seconds, under the
      same state of the host.  An engine whose turn takes more than ``turn_limit_s`` is left
      out of the rounds (the others go on) and measures the rest of its turns after them.
      ``rotate_every`` N: after every N turns the order moves on by one engine (engine 1
      first, then 2, ...), so that with N = the turns of a round no engine always measures
      first or right after another one.

    Returns the outcomes in order; an exception in a launch is raised after all have ended."""
    go_dir.mkdir(parents=True, exist_ok=True)
    group = tempfile.mkdtemp(prefix="go-", dir=go_dir)
    ups = [threading.Event() for _ in launches]
    outcomes: list = [None] * len(launches)
    errors: list = [None] * len(launches)

    def body(k: int) -> None:
        try:
            outcomes[k] = launches[k](os.path.join(group, str(k)), ups[k].set)
        except BaseException as exc:  # noqa: BLE001  (re-raised below, after the others)
            errors[k] = exc
        finally:
            ups[k].set()   # an engine that ended without coming up must not hold the others

    threads = [threading.Thread(target=body, args=(k,), daemon=True)
               for k in range(len(launches))]
    for thread in threads:
        thread.start()
    for up in ups:
        up.wait()
    if in_turns:
        _give_turns(group, threads, turn_limit_s, rotate_every)
    for k, thread in enumerate(threads):
        Path(group, str(k)).touch()
        thread.join()
    for exc in errors:
        if exc is not None:
            raise exc
    return outcomes


def _give_turns(folder: str, threads: list, turn_limit_s: float | None = None,
                rotate_every: int | None = None, poll_s: float = 0.005) -> None:
    """``run_engines_together(in_turns=True)``: turn 0 to every engine still running, one after
    the other, then turn 1, ..., until every engine has ended; with ``rotate_every`` N the
    engine that goes first moves on by one every N turns.  An engine whose turn overruns
    ``turn_limit_s`` is left out of the rounds and gets its remaining turns after them."""
    next_turn = [0] * len(threads)

    def give_turn(k: int, limit: float | None) -> bool:
        """Engine k's next turn, to its end (or its process's); False if it overran ``limit``."""
        turn, next_turn[k] = next_turn[k], next_turn[k] + 1
        Path(folder, f"{k}.{turn}").touch()
        done, began = Path(folder, f"{k}.{turn}.done"), time.monotonic()
        while threads[k].is_alive() and not done.exists():
            if limit is not None and time.monotonic() - began > limit:
                return False
            time.sleep(poll_s)
        return True

    overran: set[int] = set()
    passes = 0
    while live := [k for k, thread in enumerate(threads)
                   if thread.is_alive() and k not in overran]:
        first = passes // rotate_every % len(threads) if rotate_every else 0
        for k in sorted(live, key=lambda k: (k - first) % len(threads)):
            if not give_turn(k, turn_limit_s):
                overran.add(k)
        passes += 1
    for k in sorted(overran):
        while threads[k].is_alive():
            give_turn(k, None)


def visible_gpus() -> int | None:
    """How many GPUs this process may use (``CUDA_VISIBLE_DEVICES``, else nvidia-smi's list), or
    None if that cannot be told; without creating a CUDA context, as ``gpu_query``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        # CUDA stops at the first invalid entry (such as -1: no GPU).
        count = 0
        for device in (d.strip() for d in visible.split(",")):
            if not device or device.startswith("-"):
                break
            count += 1
        return count
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return len(proc.stdout.split()) if proc.returncode == 0 else None


def gpu_memory_gib() -> float | None:
    """The first GPU's memory, or None if it cannot be read."""
    try:
        return float(gpu_query("memory.total")) / 1024   # MiB
    except (TypeError, ValueError):
        return None


# --concurrent-starts N: each engine asks vLLM for this fraction / N of the GPU's memory to be
# free at its start (its KV cache has a fixed size whatever the fraction).
CONCURRENT_MEMORY_FRACTION = 0.8
# An engine's memory besides its KV cache (activations, CUDA graphs, torch's pool, and the
# weights of bench_matrix's 4-layer model; bench_matrix --layers and bench_deployment add the
# weights of their deeper models): what
# the memory check of --concurrent-starts assumes.  An engine's memory grows past what it
# holds at start-up once it prefills long contexts (torch keeps the pool): on the H200 three
# DP8/TP1 proxy engines (10.5 GiB of weights, 1.8 of KV cache each) held 96 GiB while one of
# them ran 128k-token prefills, and of five such engines started together one died in a 64k
# prefill; 20 GiB besides the KV cache and weights is what those 32 GiB per engine leave.
ENGINE_OVERHEAD_GIB = 20.0


def concurrent_start_spec(go_file: str, group_size: int, in_turns: bool = False) -> dict:
    """What an engine's spec adds when it starts together with ``group_size - 1`` others: the
    go file to wait for once up (with ``in_turns``, for each measurement: ``wait_for_turn``),
    and its share of the free memory vLLM checks at start-up."""
    if group_size <= 1:
        return {}
    return {"go_file": go_file, "in_turns": in_turns,
            "gpu_memory_utilization": CONCURRENT_MEMORY_FRACTION / group_size}


def concurrent_memory_problem(engines: int, kv_cache_gib: float, overhead_gib: float,
                              total_gib: float | None = None, check_one: bool = False
                              ) -> str | None:
    """Why ``engines`` engines of ``kv_cache_gib`` KV cache and ``overhead_gib`` besides cannot
    be up on the GPU at once (90% of its memory), or None (also when it cannot be told).  One
    engine is only checked with ``check_one``."""
    if engines < 1 or (engines == 1 and not check_one):
        return None
    total_gib = gpu_memory_gib() if total_gib is None else total_gib
    if total_gib is None:
        return None
    need = engines * (kv_cache_gib + overhead_gib)
    if need > 0.9 * total_gib and engines == 1:
        return (f"one engine of {kv_cache_gib:g} GiB KV + ~{overhead_gib:.0f} GiB = {need:.0f} GiB "
                f"does not fit in 90% of the GPU's {total_gib:.0f} GiB; give a smaller "
                "--kv-cache-gib")
    if need > 0.9 * total_gib:
        return (f"--concurrent-starts {engines}: {engines} engines x ({kv_cache_gib:g} GiB KV "
                f"+ ~{overhead_gib:.0f} GiB) = {need:.0f} GiB do not fit in 90% of the GPU's "
                f"{total_gib:.0f} GiB; start fewer at once")
    return None


def wait_for_go(go_file: str | None, poll_s: float = 0.05, max_wait_s: float = 86400.0
                ) -> float:
    """In an engine child: wait until ``go_file`` exists (``run_engines_together``); returns the
    seconds waited (0 without a go file).  Exits the child if its parent is gone or the go
    file's folder was removed (the parent ended without giving the go), or after
    ``max_wait_s``: a waiting engine must never outlive the benchmark with its GPU memory."""
    if not go_file:
        return 0.0
    parent, folder = os.getppid(), os.path.dirname(go_file)
    start = time.monotonic()
    while not os.path.exists(go_file):
        if os.getppid() != parent or not os.path.isdir(folder):
            raise SystemExit("the benchmark that started this engine has ended")
        if time.monotonic() - start > max_wait_s:
            raise SystemExit(f"no go after {max_wait_s:.0f} s")
        time.sleep(poll_s)
    return time.monotonic() - start


def wait_for_turn(spec: dict, turn: int, max_wait_s: float = 86400.0) -> None:
    """In an engine child, before its measurement number ``turn`` (from 0): alone, at once; in a
    group of ``run_engines_together``, once the group's go is given (turn 0); with ``in_turns``
    in the spec, once this turn's go is."""
    go_file = spec.get("go_file")
    if go_file and spec.get("in_turns"):
        wait_for_go(f"{go_file}.{turn}", max_wait_s=max_wait_s)
    elif turn == 0:
        wait_for_go(go_file, max_wait_s=max_wait_s)


def end_turn(spec: dict, turn: int) -> None:
    """In an engine child, after measurement ``turn``: with ``in_turns``, the next engine's go."""
    go_file = spec.get("go_file")
    if go_file and spec.get("in_turns"):
        Path(f"{go_file}.{turn}.done").touch()


def run_child(command: list[str], spec: dict, timeout: float, on_result=None,
              startup_timeout: float | None = None) -> tuple[list[dict], str, str | None]:
    """Run ``command`` (a ``child_main``) with ``spec`` on stdin in this plugin's environment;
    ``on_result(result)`` sees each result as it arrives.  Returns the results, everything the
    child printed, and why it failed (None on a clean exit).  A crash or timeout keeps the
    results that came before it.  ``startup_timeout``: the child is killed if it has given no
    result (the first is "engine up") by then, whatever is left of ``timeout``."""
    from vllm_snapmla.testing import subprocess_env

    with tempfile.TemporaryFile("w+") as err:
        # A session of its own, so that a timeout also kills vLLM's engine-core process, which
        # would otherwise keep its GPU memory while the next engine starts.
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, text=True, env=subprocess_env(),
                                start_new_session=True)
        proc.stdin.write(json.dumps(spec))
        proc.stdin.close()
        out, results, handler_errors = [], [], []
        first_result = threading.Event()

        def pump():
            for line in proc.stdout:
                out.append(line)
                if line.startswith(RESULT_TAG):
                    result = json.loads(line[len(RESULT_TAG):])
                    results.append(result)
                    first_result.set()
                    if on_result:
                        # A failing handler must not stop the draining: a child whose output
                        # pipe fills up blocks until it is killed.
                        try:
                            on_result(result)
                        except Exception as exc:  # noqa: BLE001  (reported as the failure)
                            handler_errors.append(f"result handler: {type(exc).__name__}: "
                                                  f"{exc}"[:200])

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        failure = None
        started = time.monotonic()
        if startup_timeout is not None:
            limit = started + min(startup_timeout, timeout)
            while (not first_result.is_set() and proc.poll() is None
                   and time.monotonic() < limit):
                first_result.wait(0.2)
            if not first_result.is_set() and proc.poll() is None:
                failure = f"not up after {min(startup_timeout, timeout):.0f} s"
        if failure is None:
            try:
                proc.wait(timeout=max(timeout - (time.monotonic() - started), 1))
            except subprocess.TimeoutExpired:
                failure = f"timed out after {timeout:.0f} s"
        # Whatever is left of the child's session goes: the child itself where it failed, and
        # also after a clean exit, since vLLM gives its engine core and tensor-parallel workers
        # a few seconds to exit, then leaves them holding GPU memory while the next engine
        # starts.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:   # the session is empty
            pass
        proc.wait()
        reader.join(10)
        err.seek(0)
        log = "".join(out) + err.read()
    if failure is None and handler_errors:
        failure = handler_errors[0]
    if failure is None and proc.returncode != 0:
        cause = root_cause(log)
        excerpt = log[-4000:]
        if cause and cause not in excerpt:   # the engine core's traceback came long before
            excerpt = f"{cause_context(log)}\n...\n{excerpt}"
        print(excerpt, file=sys.stderr)
        last = [ln for ln in log.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        failure = f"exit {proc.returncode}: " + (cause[:300] if cause else last[0][-300:])
    return results, log, failure


# The exception line of a traceback ("torch.OutOfMemoryError: CUDA out of memory ..."), after
# the "(EngineCore pid=N)" prefix vLLM puts on its engine-core process's lines and the header
# its logger puts on each line of a logged traceback ("ERROR 12-04 14:15:01 [core.py:1330] ").
_EXCEPTION_LINE = re.compile(r"^(?:\([\w ]+pid=\d+\)\s*)?"
                             r"(?:[A-Z]+ \d\d-\d\d [\d:.]+ \[[^\]]*\]\s*)?"
                             r"((?:[A-Za-z_]\w*\.)*\w*"
                             r"(?:Error|Exception|Interrupt|OutOfResources)(?::.*)?)$")
# What a front end raises when the engine core died or failed to start: consequences.
_CONSEQUENCES = ("EngineDeadError", "EngineCore encountered an issue",
                 "Engine core initialization failed")


def root_cause(log: str) -> str | None:
    """The last exception line in a child's output that is not the front end reporting a dead
    engine core: why an engine died, which vLLM prints in the core's traceback, often long
    before the front end's own ``EngineDeadError``.  None if there is none."""
    causes = [m.group(1).strip() for m in map(_EXCEPTION_LINE.match,
                                              (line.strip() for line in log.splitlines()))
              if m and not any(c in m.group(1) for c in _CONSEQUENCES)]
    return causes[-1] if causes else None


def cause_context(log: str, before: int = 25) -> str:
    """The ``before`` lines of ``log`` up to and including its ``root_cause`` line."""
    lines = log.splitlines()
    cause = root_cause(log)
    for i in reversed(range(len(lines))):
        if cause and cause in lines[i]:
            return "\n".join(lines[max(0, i - before):i + 1])
    return ""
