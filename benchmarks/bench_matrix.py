"""fp8_snapmla against vLLM's BF16 and FP8 caches through vLLM, over the workloads users run.

    python -m benchmarks.bench_matrix --out out/matrix [--dry-run] [--budget-s 480]
        [--kv auto fp8_snapmla fp8] [--heads 16 128] [--contexts 512 2048 8192 32768 131072]
        [--batches 1 8 64 fill] [--max-model-len wide tight] [--modes graph eager]
        [--serve | --serve-only] [--concurrent-starts N | --interleave [--rounds N]]
        [--repeats N] [--below RATIO] [--unmeasured] [--twin]
        [--layers N] [--switch-interval MS]
    python -m benchmarks.bench_matrix --out out/matrix --replot      # no GPU: redraw md/png

The model is bench_e2e's: DeepSeek-V3.1's attention shapes with 4 dense layers and vLLM's dummy
weights (``benchmarks/vllm_engine.py``); 16 heads is one TP8 rank of DeepSeek-V3.1, 128 the whole
model.  ``--layers N`` gives it N dense layers: with CUDA graphs the engine's host work per step
stays while the GPU work grows, as in the 61-layer model (the default KV cache grows with the
layers, --kv-cache-gib).  The published figures are the long-context, capacity-filling
FULL-CUDA-graph steady state with a block table as wide as the context; this matrix measures what
users meet as well:

- kv: ``auto`` (vLLM's BF16 default, FLASH_ATTN_MLA on this model), ``fp8_snapmla``, ``fp8``
  (vLLM's per-tensor FP8 FlashMLA);
- context 512 ... 131072 tokens; batch 1, 8, 64 and ``fill`` (the batch that fills the engine's
  KV capacity, at most ``--max-batch``; it differs between kv formats, which is the point of a
  smaller format);
- max_model_len ``wide``: 163840 as DeepSeek-V3.1 ships, so every block table is as wide as
  that whatever the context: 2560 pages of 64 tokens (FlashMLA, fp8_snapmla), 10240 of 16 for
  vLLM's BF16 default on Hopper (FlashAttention MLA); ``tight``: the smallest max_model_len
  that holds the cell's context and generated tokens.  Tight engines are grouped by context:
  contexts in ascending order, a context joins the group of the smallest context not yet served
  while the group's table width (pages of its largest need) stays within TIGHT_WIDTH_FACTOR
  (2x) of that smallest context's need, so that no context runs with a table more than 2x wider
  than it needs.  (The default contexts are 4x apart, so each gets its own tight engine.)  A
  cell's need is its context + max_tokens; for ``fill`` cells max_tokens is bounded with the
  largest batch the cell could take (``--max-batch`` and ``--max-prefill-tokens``), so one tight
  max_model_len serves every kv format;
- mode ``graph``: default compilation (torch.compile, FULL and piecewise CUDA graphs); ``eager``:
  ``enforce_eager=True``.  (Steps that mix prefill and decode run attention eagerly even in
  graph mode.)

One engine (a child process) per (kv, heads, max_model_len, mode) runs all its cells; engines
run in the order of --heads, --modes and --max-model-len, with kv innermost, so that a budget
cut leaves whole comparisons and the first-named settings run first. Each cell: B random-token
prompts of ``context`` tokens (prefix caching off) go in at once; the engine is stepped through
the chunked prefill, then ``--windows`` windows of ``--steps`` decode steps are timed with the
engine core's timestamps, as in bench_e2e:

    TPOT = median over the windows of (window time / steps);  decode tok/s = B / TPOT

``--concurrent-starts N`` starts N engines at once, so that their compilation and CUDA-graph
capture (a minute or more each) overlap, and lets them measure one at a time, in plan order, once
all N are up: while one measures, the others sit idle with their memory held, and nothing
starts.  Each asks vLLM for 0.8/N of the GPU's memory to be free at its start.

``--interleave`` starts the engines of one comparison (each --kv format of the same heads,
table and mode) together and lets them measure in turns, a cell at a time: cell 1 on each
format, then cell 2 on each, so that the formats of a cell are measured seconds apart.  Steps
of 1-64 requests at short contexts are host-bound, and the host's speed moves: on an H100, 31
cells that one measurement had put under 1.0x came out at 0.71-1.91x that value when measured
again in rounds (benchmarks/RESULTS.md, "Workload matrix"), which a ratio of one measurement
per format takes for a difference between the formats.
``--rounds N`` (with ``--interleave``) measures each cell N times on the same engines, the
formats in turn: every cell once on each format (cell 1 on each, then cell 2, ...), then all of
them again, N rounds in all, each with fresh requests, the format that measures first moving
on by one each round (BF16 first in round 1, the next format in round 2, ...), so that the
median of N rounds and the range of the rounds' ratios tell a difference from a spell, and no
format always measures right after another.  A cell's rounds lie a whole pass
over the engine's cells apart, so that a spell as long as one cell (a few seconds) reaches one
of its rounds, not all of them; a budget cut leaves every cell with the same number of rounds,
give or take one.  Rows combine as with ``--repeats`` (a round is a run there).  On an H100 a
4-layer cell's highest round ratio was still a median 1.32x its lowest (its rounds back to
back); with ``--layers 16`` and CUDA graphs, within 9% in 8 of 9 cells.
``--twin`` (with ``--interleave``) adds a second BF16 engine, ``auto_twin``, to each
comparison, measured in turn with the others (last in each turn of round 1): its ratio to
BF16's engine is an A/A control, what the method reads between two engines of one format in
the same rounds.  A cell whose twin ratio is as far from 1.0x as a format's is does not tell
that format from BF16.  The twin is one more engine on the GPU (on an 80 GB GPU: BF16 and one
other format).
``--below RATIO`` keeps of the selected cells those whose recorded ratio in ``--out``'s
matrix.csv is below RATIO: ``--below 1.0 --interleave --rounds 3`` measures again, in rounds,
the cells a single measurement put under 1.0x.  ``--unmeasured`` keeps those that some selected
format has not settled in matrix.csv (no row, or one skipped for time, ``--budget-s``): the
same command again after a run the budget cut short measures only what it did not reach.

``--repeats N`` runs the whole plan N times over, each engine a fresh process (the plan in
order, then again), for cells whose step time moves between engine runs more than between the
windows of one: eager steps are host-bound, and on an H100 the eager TPOTs of three engines of
the same format and cell were up to 28% apart.  matrix.csv then holds per cell
and format the median TPOT over the runs that measured (decode tok/s = B / that), with the
runs' TPOTs and their spread; repeats.csv keeps every run's row.

``--switch-interval MS`` sets Python's GIL switch interval in each engine-core process
(``sys.setswitchinterval`` through ``LLM.collective_rpc``, checked by reading it back), for the
question of the engine core's threads waiting for the GIL (benchmarks/RESULTS.md): with
``fp8_snapmla`` a 0.2 ms interval removed a wait that Python's default 5 ms leaves.  Rows carry
the value, and a folder holds one value only (and one ``--layers``).

Every engine has the same KV-cache bytes (``--kv-cache-gib``, default 1 GiB a layer, 4 GiB for 4
layers: the token capacity DeepSeek-V3.1's 61 layers have in about 61 GiB, about 1.5x what a
TP8 rank of an 8xH200 deployment has left, 40 GiB by ``bench_deployment --budget-only``; 2.6 GiB
matches that, 0.65 GiB a layer), so fp8_snapmla holds 1.756x the BF16 tokens.  Only the ``fill``
cells depend on it.
``--max-batched-tokens`` is passed to vLLM (default 16384, vLLM's default for ``LLM`` on an
H200) so that the prefill's length is known when cells are planned.

Cells are skipped, with the reason in the CSV, never silently: a prefill of more than
``--max-prefill-tokens`` tokens (decided before any engine starts for fixed batches, by the
engine for ``fill``), a batch the KV cache does not hold, a need above max_model_len, and
``--budget-s``: before an engine starts and before each cell, the time left is compared with an
estimate (engine start, prefill from its GEMM and attention FLOPs, decode steps; in the
engine the estimate is rescaled by how the finished cells compared with theirs).  A cell (or
serve run) still running ``STALL_FACTOR`` (10) times its estimate, and at least 3 minutes, has
stalled: its engine is stopped after printing its processes' Python stacks and the GPU's
utilization (``vllm_engine.stall_watchdog``), the cell is recorded as failed ("stalled: ..."),
the engine's later cells as failed with it, and the run goes on with the next engine.

``--serve`` adds a continuous-batching run to the ``wide`` engine of each (kv, heads, mode)
(``--serve-only``: that run alone): ``--serve-requests`` requests with log-uniform prompt and
output lengths, Poisson arrivals at ``--serve-rate`` per second (seeded: the same workload for
every kv), added to the engine when the wall clock passes their arrival while it is stepped;
each token's time is the engine core's timestamp of its step.  Per request, TTFT = first token -
arrival and TPOT = (last token - first token) / (tokens - 1); output tok/s = all output tokens /
(last token - first arrival).

Outputs in ``--out`` (merged with earlier runs in the same folder, so a sweep can be split across
calls, a cell skipped by a later run keeping what an earlier one measured; each starts with the
runs' date, commit, GPU, vLLM version and command):
``matrix.csv`` (a row per cell and kv: status ok/skipped/failed and the reason), ``matrix.md``
(a table per (heads, max_model_len, mode) with fp8_snapmla/BF16 and fp8/BF16 throughput ratios,
those below 1.0 marked), ``matrix.png`` (heat maps of the fp8_snapmla/BF16 ratio), ``serve.csv``
and ``serve.md``; ``logs/`` holds the whole output of each engine that failed.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import textwrap
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from benchmarks.provenance import describe, described, run_info
from benchmarks.vllm_engine import (
    BASELINE_KV, BLOCK_SIZE, BUDGET_SKIP, DEEPSEEK_V31_ATTENTION, ENGINE_OVERHEAD_GIB,
    KV_BYTES_PER_TOKEN, KV_SETTINGS, SETTLE_STEPS, TWIN_KV, apply_switch_interval, batch_to_fill,
    build_llm, cache_dtype, child_main, concurrent_memory_problem, concurrent_start_spec,
    core_timestamp, enable_stall_dumps, end_turn, engine_log_facts, estimated_kv_blocks,
    estimated_prefill_s, merge_by_key, mla_projection_weights, model_config, not_lock_step,
    number, random_prompts, read_csv, run_child, run_engines_together, skipped_for_time,
    stall_watchdog, summarize_windows, timed_decode_windows, wait_for_turn, warm_tokens, warm_up,
    write_csv)
from vllm_snapmla.testing import write_tiny_deepseek_v3

KV_NAMES = {"auto": "BF16", "fp8_snapmla": "fp8_snapmla", "fp8": "fp8", TWIN_KV: "BF16 twin"}
HEADS = (16, 128)
CONTEXTS = (512, 2048, 8192, 32768, 131072)
BATCHES = ("1", "8", "64", "fill")
MAX_MODEL_LENS = ("wide", "tight")
MODES = ("graph", "eager")
WIDE_MAX_MODEL_LEN = DEEPSEEK_V31_ATTENTION["max_position_embeddings"]   # 163840
TIGHT_WIDTH_FACTOR = 2
NUM_LAYERS = DEEPSEEK_V31_ATTENTION["num_hidden_layers"]

# The time model for --budget-s, deliberately pessimistic for an H200 (the engine rescales it
# by the cells it has finished).  Against the first cells on the H200 (benchmarks/results/
# matrix.csv, 16 heads, 64 x 512 and 64 x 8192 tokens: 0.7-1.9 s each) it estimates 1.9-2.6x
# their time (a flat 1e5 prefill tokens/s, 8 ms steps and 2 s a cell had estimated 4.6-6.5x).
# The prefill estimate is vllm_engine's, shared with bench_deployment.
ENGINE_START_S = {"graph": 90.0, "eager": 30.0}
DECODE_STEP_S = {"graph": 0.005, "eager": 0.015}
HBM_BYTES_PER_S = 2e12
CELL_OVERHEAD_S = 0.5
# The default KV cache per layer: at 4 layers the token capacity DeepSeek-V3.1's 61 layers have
# in about 61 GiB (module docstring); with --layers N every N holds those tokens.
KV_CACHE_GIB_PER_LAYER = 1.0
CHILD_GRACE_S = 30.0   # how long past the budget a running engine may go before it is killed
# A measurement still running this many times its estimate, and at least STALL_MIN_S, has
# stalled: the engine is stopped with its stacks in the log (vllm_engine.stall_watchdog).  The
# recorded cells took 0.1-2.3x their estimates (cell_s against estimated_s in the results).
STALL_FACTOR = 10.0
STALL_MIN_S = 180.0


def stall_limit_s(estimate_s: float) -> float:
    return max(STALL_MIN_S, STALL_FACTOR * estimate_s)

MATRIX_FIELDS = [
    "heads", "max_model_len", "mode", "context", "batch", "kv", "status", "reason",
    "batch_size", "max_model_len_tokens", "block_size", "table_width", "max_tokens",
    "kv_cache_tokens",
    "backend", "prefill_steps", "lock_step", "timer", "spread_pct", "window_ms", "timing_ok",
    "decode_tok_s", "tpot_ms", "vs_bf16", "tpot_vs_bf16", "repeats", "repeat_tpot_ms",
    "repeat_spread_pct", "vs_bf16_runs",
    "cell_s", "estimated_s", "switch_interval_ms", "layers", "date", "commit"]
REPEAT_FIELDS = MATRIX_FIELDS + ["repeat"]
SERVE_FIELDS = [
    "heads", "mode", "kv", "status", "reason", "requests", "completed", "rate", "seed",
    "prompt_tokens", "output_tokens", "duration_s", "output_tok_s", "vs_bf16",
    "tpot_p50_vs_bf16", "ttft_p50_ms",
    "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "kv_cache_tokens", "backend",
    "switch_interval_ms", "layers", "date", "commit"]


# --- planning (pure; unit-tested on CPU) ---------------------------------------------------

@dataclass(frozen=True)
class Settings:
    steps: int = 64
    windows: int = 3
    max_batch: int = 512
    max_batched_tokens: int = 16384
    max_prefill_tokens: int = 2_000_000
    kv_cache_gib: float = KV_CACHE_GIB_PER_LAYER * NUM_LAYERS
    layers: int = NUM_LAYERS      # dense layers of the model (--layers)

    @property
    def timed_tokens(self) -> int:
        return SETTLE_STEPS + self.windows * self.steps


@dataclass
class Engine:
    kv: str
    heads: int
    max_model_len: str            # "wide" or "tight"
    max_model_len_tokens: int
    mode: str                     # "graph" or "eager"
    cells: list = field(default_factory=list)   # [(context, batch label)]
    serve: bool = False
    repeat: int = 1               # which run of the plan (--repeats)
    rounds: int = 1               # measurements of each cell in this engine (--rounds)

    @property
    def table_width(self) -> int:
        return math.ceil(self.max_model_len_tokens / BLOCK_SIZE)

    def cell_key(self, context: int, batch: str) -> tuple:
        """(heads, max_model_len, mode, context, batch): ``matrix_key(row)[:5]`` of its row."""
        return self.heads, self.max_model_len, self.mode, context, batch

    @property
    def turns(self) -> list:
        """The cells in the order this engine measures them: all of them, ``rounds`` times over
        (with --interleave the other formats measure each cell in the same turn, in an order
        that moves on by one engine each round)."""
        return [cell for _ in range(self.rounds) for cell in self.cells]

    def run_number(self, round_: int) -> int:
        """The ``repeat`` a row of this engine's ``round_`` carries: the round with --rounds,
        else the run of the plan (--repeats)."""
        return round_ if self.rounds > 1 else self.repeat

    def describe(self, repeats: int = 1) -> str:
        return (f"{self.kv} H={self.heads} {self.max_model_len} "
                f"({self.max_model_len_tokens} tokens, {self.table_width} pages) {self.mode}"
                + (f", run {self.repeat} of {repeats}" if repeats > 1 else "")
                + (f", {self.rounds} rounds a cell" if self.rounds > 1 else ""))


def parse_batch(label: str) -> str:
    """A --batches item: a positive integer or ``fill``."""
    if label != "fill" and not (label.isdigit() and int(label) > 0):
        raise ValueError(f"a batch is a positive integer or 'fill', got {label!r}")
    return label


def largest_batch(label: str, context: int, settings: Settings) -> int:
    """The batch of a cell; for ``fill``, the largest it can be (the engine sizes it)."""
    if label != "fill":
        return int(label)
    return max(1, min(settings.max_batch, settings.max_prefill_tokens // context))


def max_tokens_for(batch: int, context: int, max_batched_tokens: int, settings: Settings) -> int:
    """Tokens each request generates: the chunked prefill's warm-up, SETTLE_STEPS, the windows."""
    return warm_tokens(max(batch, 1), context, max_batched_tokens) + settings.timed_tokens


def prefill_limit_reason(batch: int, context: int, settings: Settings) -> str | None:
    prefill = batch * context
    if prefill > settings.max_prefill_tokens:
        return (f"prefill {batch} x {context} = {prefill:,} tokens > --max-prefill-tokens "
                f"{settings.max_prefill_tokens:,}")
    return None


def decide_cell(label: str, context: int, usable_blocks: int, block_size: int,
                max_model_len: int, max_batched_tokens: int, settings: Settings) -> dict:
    """``batch_size``, ``max_tokens`` and the skip ``reason`` (None: run it) of a cell in an
    engine with ``usable_blocks`` KV pages (its null block excluded).  ``fill`` is sized as
    bench_e2e does: on the timed tokens, then again on the warm-up that batch needs."""
    if label == "fill":
        batch = batch_to_fill(usable_blocks, block_size, context, settings.timed_tokens,
                              settings.max_batch)
        max_tokens = max_tokens_for(batch, context, max_batched_tokens, settings)
        batch = batch_to_fill(usable_blocks, block_size, context, max_tokens, settings.max_batch)
    else:
        batch = int(label)
        max_tokens = max_tokens_for(batch, context, max_batched_tokens, settings)
    reasons = []
    pages = math.ceil((context + max_tokens) / block_size)
    if batch < 1:
        reasons.append(f"the KV cache ({usable_blocks} pages) holds no request of {pages} pages")
    elif batch * pages > usable_blocks:
        reasons.append(f"batch {batch} x {pages} pages > the {usable_blocks} pages of the KV "
                       "cache")
    if batch >= 1 and (reason := prefill_limit_reason(batch, context, settings)):
        reasons.append(reason)
    if context + max_tokens > max_model_len:
        reasons.append(f"context {context} + {max_tokens} generated tokens > max_model_len "
                       f"{max_model_len}")
    return {"batch_size": batch, "max_tokens": max_tokens,
            "reason": "; ".join(reasons) or None}


def tight_groups(needs: dict[int, int], factor: int = TIGHT_WIDTH_FACTOR
                 ) -> list[tuple[int, list[int]]]:
    """(max_model_len, contexts) of the tight engines for ``needs`` (context -> tokens it needs):
    ascending contexts join the group of the smallest context not yet served while the group's
    table width stays within ``factor`` x that context's width.  max_model_len is the group's
    largest need rounded up to whole pages."""
    groups: list[tuple[int, list[int]]] = []
    first_width = None
    for context in sorted(needs):
        width = math.ceil(needs[context] / BLOCK_SIZE)
        if groups and width <= factor * first_width:
            groups[-1][1].append(context)
            groups[-1] = (max(groups[-1][0], width * BLOCK_SIZE), groups[-1][1])
        else:
            groups.append((width * BLOCK_SIZE, [context]))
            first_width = width
    return groups


def prefill_weights_per_token(heads: int, layers: int = NUM_LAYERS) -> int:
    """Weights a prefill token multiplies through (2 FLOPs each) in the benchmark's model:
    per layer the dense MLP and MLA's projections (q_a, q_b, kv_a, kv_b, o), most of them
    growing with the heads; the LM head runs on one token per request."""
    c = DEEPSEEK_V31_ATTENTION
    return layers * (3 * c["hidden_size"] * c["intermediate_size"]
                     + mla_projection_weights(heads))


def estimate_cell_s(heads: int, mode: str, kv: str, context: int, batch: int,
                    max_tokens: int, layers: int = NUM_LAYERS) -> float:
    """Pessimistic seconds for a cell: prefill (the projection and MLP GEMMs, and causal
    attention FLOPs of the layers) and max_tokens steps that each read the batch's KV cache
    (a step's fixed time grows with the layers beyond 4)."""
    prefill = estimated_prefill_s(batch, context, heads, layers,
                                  prefill_weights_per_token(heads, layers))
    kv_read = batch * context * KV_BYTES_PER_TOKEN[cache_dtype(kv)] * layers / HBM_BYTES_PER_S
    return CELL_OVERHEAD_S + prefill + max_tokens * (step_s(mode, layers) + kv_read)


def serve_workload(requests: int, rate: float, prompt_range: tuple[int, int],
                   output_range: tuple[int, int], seed: int) -> list[tuple[float, int, int]]:
    """(arrival s, prompt tokens, output tokens) of the continuous-batching run: Poisson arrivals
    at ``rate`` per second, log-uniform lengths within the (inclusive) ranges."""
    rng = random.Random(seed)

    def log_uniform(low: int, high: int) -> int:
        return min(high, max(low, round(math.exp(rng.uniform(math.log(low), math.log(high))))))

    arrival, workload = 0.0, []
    for _ in range(requests):
        arrival += rng.expovariate(rate)
        workload.append((round(arrival, 4), log_uniform(*prompt_range), log_uniform(*output_range)))
    return workload


def step_s(mode: str, layers: int) -> float:
    """A decode step's pessimistic fixed time: DECODE_STEP_S of the 4-layer model, growing with
    the layers beyond 4."""
    return DECODE_STEP_S[mode] * max(1.0, layers / NUM_LAYERS)


def extra_weights_gib(heads: int, layers: int) -> float:
    """BF16 weights of the layers beyond 4 (ENGINE_OVERHEAD_GIB holds those of 4)."""
    return max(0, layers - NUM_LAYERS) * prefill_weights_per_token(heads, 1) * 2 / 2**30


def estimate_serve_s(workload: list, mode: str, layers: int = NUM_LAYERS) -> float:
    """Arrivals, then the last requests' decode, pessimistically."""
    return (CELL_OVERHEAD_S + workload[-1][0]
            + 2 * max(out for _, _, out in workload) * step_s(mode, layers))


def plan_matrix(kvs, heads, contexts, batches, max_model_lens, modes, settings: Settings,
                serve: bool = False, serve_only: bool = False):
    """The engines to start, in order, and the rows of the cells skipped before any engine
    starts (prefill above --max-prefill-tokens for a fixed batch).

    Order: heads, mode, max_model_len as given (tight groups by context), kv innermost.  With
    ``serve`` the wide engine of each (kv, heads, mode) also runs the continuous-batching
    workload (one is added for it where wide is not asked for or ``serve_only``)."""
    skipped, engines = [], []
    cells = [] if serve_only else [(c, b) for c in sorted(contexts) for b in batches]
    runnable = []
    for context, label in cells:
        reason = (prefill_limit_reason(int(label), context, settings) if label != "fill"
                  else None)
        if reason:
            skipped += [{"context": context, "batch": label, "batch_size": int(label),
                         "status": "skipped", "reason": reason, "heads": h, "kv": kv,
                         "max_model_len": m, "mode": mode}
                        for h in heads for mode in modes for m in max_model_lens for kv in kvs]
        else:
            runnable.append((context, label))
    # Needs do not depend on kv or heads: fixed batches are exact, fill cells take their bound.
    needs: dict[int, int] = {}
    for context, label in runnable:
        batch = largest_batch(label, context, settings)
        need = context + max_tokens_for(batch, context, settings.max_batched_tokens, settings)
        needs[context] = max(needs.get(context, 0), need)
    for h in dict.fromkeys(heads):
        for mode in dict.fromkeys(modes):
            wide_ran = False
            for mml in dict.fromkeys(max_model_lens):
                if mml == "wide":
                    groups = [(WIDE_MAX_MODEL_LEN, sorted(needs))] if (runnable or serve) else []
                else:
                    groups = tight_groups(needs)
                for tokens, group in groups:
                    for kv in dict.fromkeys(kvs):
                        engine = Engine(kv, h, mml, tokens, mode,
                                        [(c, b) for c, b in runnable if c in group],
                                        serve=serve and mml == "wide")
                        if engine.cells or engine.serve:
                            engines.append(engine)
                            wide_ran |= engine.serve
            if serve and not wide_ran:
                engines += [Engine(kv, h, "wide", WIDE_MAX_MODEL_LEN, mode, [], serve=True)
                            for kv in kvs]
    return engines, skipped


def cells_below(rows: list[dict], ratio: float) -> set[tuple]:
    """(heads, max_model_len, mode, context, batch) of the recorded cells whose fp8_snapmla/BF16
    ratio is below ``ratio`` (cells without a ratio are not among them)."""
    return {matrix_key(r)[:5] for r in rows if r["kv"] == "fp8_snapmla" and r.get("status") == "ok"
            and number(r.get("vs_bf16")) is not None and number(r["vs_bf16"]) < ratio}


def settled_cells(rows: list[dict], kvs: list[str]) -> set[tuple]:
    """(heads, max_model_len, mode, context, batch) of the recorded cells that every format of
    ``kvs`` has settled: measured (ok or failed), or skipped for a reason of its own (the KV
    cache, the prefill limit), not for time."""
    settled: dict[tuple, set] = {}
    for r in rows:
        if r.get("status") in ("ok", "failed", "skipped") and not skipped_for_time(r):
            settled.setdefault(matrix_key(r)[:5], set()).add(r["kv"])
    return {cell for cell, kvs_there in settled.items() if set(kvs) <= kvs_there}


def keep_cells(engines: list[Engine], skipped: list[dict], chosen: set[tuple]
               ) -> tuple[list[Engine], list[dict]]:
    """``plan_matrix``'s engines and skipped rows with only the ``chosen`` cells; an engine
    left without cells goes unless it runs the serve workload.  The tight engines keep the
    max_model_len of the whole selection, so a cell runs as it was recorded."""
    kept = []
    for engine in engines:
        cells = [(c, b) for c, b in engine.cells if engine.cell_key(c, b) in chosen]
        if cells or engine.serve:
            kept.append(replace(engine, cells=cells))
    return kept, [s for s in skipped if matrix_key(s)[:5] in chosen]


def estimate_engine_s(engine: Engine, settings: Settings, workload=None) -> tuple[float, list]:
    """Seconds for ``engine`` (start, cells, serve run) and per cell its estimated decision,
    with the KV capacity estimated from --kv-cache-gib."""
    usable = estimated_kv_blocks(engine.kv, settings.kv_cache_gib, settings.layers) - 1
    total, decisions = ENGINE_START_S[engine.mode], []
    for context, label in engine.cells:
        decision = decide_cell(label, context, usable, BLOCK_SIZE, engine.max_model_len_tokens,
                               settings.max_batched_tokens, settings)
        if not decision["reason"]:
            decision["estimated_s"] = estimate_cell_s(
                engine.heads, engine.mode, engine.kv, context, decision["batch_size"],
                decision["max_tokens"], settings.layers)
            total += decision["estimated_s"] * engine.rounds
        decisions.append(decision)
    if engine.serve and workload:
        total += estimate_serve_s(workload, engine.mode, settings.layers)
    return total, decisions


def dry_run_cells(engine: Engine, decisions: list[dict]) -> list[str]:
    """--dry-run's lines for ``engine``'s cells, one per context: per batch label the batch
    and the estimated seconds, or why the engine is expected to skip it."""
    by_context: dict[int, list[str]] = {}
    for (context, label), decision in zip(engine.cells, decisions):
        if decision["reason"]:
            text = f"{label}: skipped ({decision['reason']})"
        else:
            size = "" if label != "fill" else f" (B={decision['batch_size']})"
            text = f"{label}{size}: ~{decision['estimated_s']:.1f} s"
        by_context.setdefault(context, []).append(text)
    return [f"      context {context}: " + ", ".join(cells)
            for context, cells in by_context.items()]


# --- continuous batching (pure; unit-tested with a stand-in engine) ------------------------

def comparison_of(engine: Engine) -> tuple:
    """What the engines of one comparison share (all but the KV format): ``--interleave``
    starts them together and measures their cells in turns."""
    return (engine.heads, engine.max_model_len, engine.max_model_len_tokens, engine.mode,
            engine.repeat)


def start_groups(engines: list[Engine], at_once: int, interleave: bool = False
                 ) -> list[list[int]]:
    """The indices of the engines that start together: runs of ``at_once`` consecutive
    engines (``--concurrent-starts``); with ``interleave`` never across comparisons."""
    groups: list[list[int]] = []
    for k, engine in enumerate(engines):
        if (groups and len(groups[-1]) < at_once
                and (not interleave or comparison_of(engines[groups[-1][0]])
                     == comparison_of(engine))):
            groups[-1].append(k)
        else:
            groups.append([k])
    return groups


def estimate_total_s(engines: list[Engine], estimates: list[tuple], at_once: int,
                     interleave: bool = False) -> float:
    """The whole sweep's time: each engine's estimate, less the start-ups that overlap the
    first of their group (``start_groups``)."""
    total = sum(seconds for seconds, _ in estimates)
    for group in start_groups(engines, at_once, interleave):
        total -= sum(ENGINE_START_S[engines[k].mode] for k in group[1:])
    return total


def run_serve(engine, requests: list[tuple[float, object, object]], clock=time.monotonic,
              sleep=time.sleep, stop_at: float | None = None) -> tuple[float, list[dict]]:
    """Drive ``engine`` (vLLM's ``LLMEngine``) with ``requests`` (arrival s, prompt, params with
    DELTA outputs), each added once ``clock()`` has passed its arrival.  Returns the start time
    and per request its arrival (on ``clock``) and the times of its tokens: the engine core's
    timestamps (``time.monotonic`` in the core process, the same clock as the default one here)
    where the outputs carry them, else ``clock()`` when ``step`` returned them.  At ``stop_at``
    (on ``clock``) the requests still running are aborted."""
    start = clock()
    pending = deque(enumerate(requests))
    records = [{"arrival": start + arrival, "tokens": []} for arrival, _, _ in requests]
    live: set[str] = set()
    while pending or live:
        now = clock()
        if stop_at is not None and now >= stop_at:
            engine.abort_request(sorted(live))
            break
        while pending and start + pending[0][1][0] <= now:
            index, (_, prompt, params) = pending.popleft()
            engine.add_request(f"serve-{index}", prompt, params)
            live.add(f"serve-{index}")
        if not live:
            sleep(max(0.0, start + pending[0][1][0] - now))
            continue
        outputs = engine.step()
        returned = clock()
        for output in outputs:
            new = len(output.outputs[0].token_ids)
            stamp = core_timestamp(output) or returned
            records[int(output.request_id.split("-")[1])]["tokens"] += [stamp] * new
            if output.finished:
                live.discard(output.request_id)
        if not engine.has_unfinished_requests():
            live.clear()   # nothing of ours is left, whatever the outputs said
    return start, records


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's
    default)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    k = (len(ordered) - 1) * q / 100
    low = math.floor(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def serve_summary(start: float, records: list[dict], output_lens: list[int]) -> dict:
    """Throughput and p50/p99 TTFT and TPOT (ms) of ``run_serve``'s records; a request is
    completed when it has all ``output_lens[i]`` tokens."""
    ttft = [r["tokens"][0] - r["arrival"] for r in records if r["tokens"]]
    tpot = [(r["tokens"][-1] - r["tokens"][0]) / (len(r["tokens"]) - 1)
            for r in records if len(r["tokens"]) > 1]
    tokens = sum(len(r["tokens"]) for r in records)
    if not ttft:
        raise ValueError("no request produced a token")
    end = max(r["tokens"][-1] for r in records if r["tokens"])
    first_arrival = min(r["arrival"] for r in records)
    summary = {
        "requests": len(records),
        "completed": sum(len(r["tokens"]) >= n for r, n in zip(records, output_lens)),
        "output_tokens": tokens, "duration_s": round(end - start, 3),
        "output_tok_s": round(tokens / (end - first_arrival), 1),
        "ttft_p50_ms": round(1000 * percentile(ttft, 50), 2),
        "ttft_p99_ms": round(1000 * percentile(ttft, 99), 2)}
    if tpot:
        summary.update(tpot_p50_ms=round(1000 * percentile(tpot, 50), 3),
                       tpot_p99_ms=round(1000 * percentile(tpot, 99), 3))
    return summary


# --- one engine, in a child process --------------------------------------------------------

def run_engine(spec: dict):
    """Build the engine of ``spec``, run its cells and its serve workload; yields a result per
    cell (``kind: cell``), one when the engine is up (``kind: engine``) and one for the serve run
    (``kind: serve``)."""
    import torch
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    settings = Settings(**spec["settings"])
    started = time.monotonic()
    enable_stall_dumps()
    switch_interval = spec.get("switch_interval_s")
    if switch_interval:
        # apply_switch_interval sends a function to the engine core.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    llm = build_llm(spec["model"], spec["kv"], spec["max_model_len_tokens"],
                    settings.kv_cache_gib, settings.max_batch,
                    enforce_eager=spec["mode"] == "eager",
                    max_num_batched_tokens=settings.max_batched_tokens,
                    gpu_memory_utilization=spec.get("gpu_memory_utilization"))
    config = llm.llm_engine.vllm_config
    cache = config.cache_config
    max_batched_tokens = config.scheduler_config.max_num_batched_tokens
    generator = torch.Generator().manual_seed(0)
    if switch_interval:
        apply_switch_interval(llm, switch_interval)
    warm_up(llm, generator)
    # Block 0 is vLLM's null block: a batch sized on all blocks could be preempted.
    usable = cache.num_gpu_blocks - 1
    capacity = cache.num_gpu_blocks * cache.block_size
    yield {"kind": "engine", "kv_cache_tokens": capacity, "block_size": cache.block_size,
           "max_num_batched_tokens": max_batched_tokens,
           "start_s": round(time.monotonic() - started, 1)}
    deadline = spec.get("deadline")   # time.time() after which no cell starts
    spent = estimated = 0.0           # of the finished cells, to rescale the estimates
    measured = 0                      # cells measured so far: each gets its own request ids
    # With --interleave a cell is only worth starting if the engines after this one in the
    # turn can measure it too: the budget check counts them (this one included).
    turn_engines = spec.get("turn_engines", 1)

    def measure_cell(context: int, label: str, round_: int) -> dict:
        nonlocal spent, estimated, measured
        decision = decide_cell(label, context, usable, cache.block_size,
                               spec["max_model_len_tokens"], max_batched_tokens, settings)
        result = {"kind": "cell", "context": context, "batch": label,
                  "batch_size": decision["batch_size"], "max_tokens": decision["max_tokens"],
                  "kv_cache_tokens": capacity}
        if decision["reason"]:
            return {**result, "status": "skipped", "reason": decision["reason"]}
        estimate = estimate_cell_s(spec["heads"], spec["mode"], spec["kv"], context,
                                   decision["batch_size"], decision["max_tokens"],
                                   settings.layers)
        scale = min(4.0, max(0.25, spent / estimated)) if estimated else 1.0
        need = scale * estimate * turn_engines
        if deadline is not None and time.time() + need > deadline:
            return {**result, "status": "skipped",
                    "reason": f"{BUDGET_SKIP} needs ~{need:.0f} s, "
                              f"{max(0.0, deadline - time.time()):.0f} s left"}
        cell_start = time.monotonic()
        measured += 1
        watch = stall_watchdog(stall_limit_s(scale * estimate),
                               {**result, "estimated_s": round(estimate, 1),
                                "round": round_},
                               f"cell ctx {context} x {label}")
        try:
            params = SamplingParams(temperature=0.0, max_tokens=decision["max_tokens"],
                                    ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            with watch:
                seconds, lock_step, prefill_steps, timer = timed_decode_windows(
                    llm.llm_engine, random_prompts(generator, decision["batch_size"], context),
                    params, settings.steps, settings.windows,
                    id_prefix=f"cell{measured}-{context}-{label}")
            summary = summarize_windows(decision["batch_size"], seconds)
        except Exception as exc:  # noqa: BLE001  (record this cell; the next ones still try)
            return {**result, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:300]}
        cell_s = time.monotonic() - cell_start
        spent, estimated = spent + cell_s, estimated + estimate
        return {**result, **summary, "status": "ok", "lock_step": lock_step,
                "prefill_steps": prefill_steps, "timer": timer, "cell_s": round(cell_s, 1),
                "estimated_s": round(estimate, 1)}

    def measure_serve() -> dict:
        workload = [tuple(r) for r in spec["serve"]["workload"]]
        result = {"kind": "serve", "kv_cache_tokens": capacity}
        estimate = estimate_serve_s(workload, spec["mode"], settings.layers)
        need = estimate * turn_engines
        if deadline is not None and time.time() + need > deadline:
            return {**result, "status": "skipped",
                    "reason": f"{BUDGET_SKIP} needs ~{need:.0f} s, "
                              f"{max(0.0, deadline - time.time()):.0f} s left"}
        serve_generator = torch.Generator().manual_seed(spec["serve"]["seed"])
        requests = [(arrival, random_prompts(serve_generator, 1, prompt_len)[0],
                     SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                                    output_kind=RequestOutputKind.DELTA))
                    for arrival, prompt_len, output_len in workload]
        try:
            # Stop at the budget, on the monotonic clock the token times are on.
            stop_at = (None if deadline is None
                       else time.monotonic() + deadline - time.time() + CHILD_GRACE_S / 2)
            with stall_watchdog(stall_limit_s(estimate), result, "serve run"):
                start, records = run_serve(llm.llm_engine, requests, stop_at=stop_at)
            summary = serve_summary(start, records, [out for _, _, out in workload])
        except Exception as exc:  # noqa: BLE001  (report it like a cell)
            return {**result, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:300]}
        return {**result, **summary, "status": "ok",
                "prompt_tokens": sum(p for _, p, _ in workload)}

    yield from measure_in_turns(spec, measure_cell, measure_serve)


def measure_in_turns(spec: dict, measure_cell, measure_serve=None):
    """An engine child's measurements, each in its turn (``wait_for_turn``): every cell of
    ``spec["cells"]`` (``measure_cell(context, label, round)``), then with ``spec["serve"]`` the
    serve run (``measure_serve()``); yields each result.  Alone or in a --concurrent-starts group
    only the first waits, for the group's go; with --interleave each waits for its turn and, once
    its result is out, gives the next engine its turn (``end_turn``), except the last: that turn
    ends with this engine's process, so that no engine measures during another one's shutdown.
    A cell listed more than once (--rounds) is measured each time; its round (1, 2, ...) goes
    to ``measure_cell`` and into its result as ``round``."""
    rounds: dict = {}
    turns = []
    for c, b in spec["cells"]:
        rounds[c, b] = rounds.get((c, b), 0) + 1
        turns.append(lambda c=c, b=b, r=rounds[c, b]: {**measure_cell(c, b, r), "round": r})
    if spec.get("serve"):
        turns.append(measure_serve)
    for turn, measure in enumerate(turns):
        wait_for_turn(spec, turn)
        yield measure()
        if turn < len(turns) - 1:
            end_turn(spec, turn)


# --- results (pure; unit-tested on CPU) ----------------------------------------------------

def matrix_key(row: dict) -> tuple:
    return (int(row["heads"]), row["max_model_len"], row["mode"], int(row["context"]),
            row["batch"], row["kv"])


def _order(value, known: tuple) -> int:
    return known.index(value) if value in known else len(known)


def batch_order(batch: str) -> tuple:
    """Numeric batches ascending, then ``fill``."""
    return (batch == "fill", int(batch) if batch.isdigit() else 0)


def _matrix_order(key: tuple) -> tuple:
    heads, mml, mode, context, batch, kv = key
    return (heads, _order(mml, MAX_MODEL_LENS), _order(mode, MODES), context,
            batch_order(batch), _order(kv, KV_SETTINGS), kv)


def _serve_order(key: tuple) -> tuple:
    heads, mode, kv = key
    return heads, _order(mode, MODES), _order(kv, KV_SETTINGS), kv


def merge_rows(old: list[dict], new: list[dict], key=None) -> list[dict]:
    """``old`` with the rows of the same key (``matrix_key`` or ``serve_key``) replaced by
    ``new``, in report order."""
    key = key or matrix_key
    return merge_by_key(old, new, key, _matrix_order if key is matrix_key else _serve_order)


def repeat_key(row: dict) -> tuple:
    return (*matrix_key(row), *run_of(row), int(row.get("repeat") or 1))


def combine_repeats(rows: list[dict]) -> dict:
    """The matrix row of one cell and format from its ``--repeats`` runs (rows of one run of the
    command, in run order): TPOT the median over the runs that measured (``ok``), decode tok/s
    = B / that; ``repeat_tpot_ms`` every run's TPOT ("-" where it did not measure),
    ``repeat_spread_pct`` (largest - smallest) / median; lock-step and timing_ok only if every
    measured run's was; the other fields from the run nearest the median.  No run measured: the
    last run's row (its status and reason)."""
    ok = [r for r in rows if r.get("status") == "ok" and number(r.get("tpot_ms"))]
    if not ok:
        return {**rows[-1], "repeats": 0, "repeat_tpot_ms": "", "repeat_spread_pct": ""}
    tpots = [number(r["tpot_ms"]) for r in ok]
    median = statistics.median(tpots)
    nearest = min(ok, key=lambda r: abs(number(r["tpot_ms"]) - median))
    missed = [r for r in rows if r not in ok]
    combined = {**nearest,
                "tpot_ms": round(median, 3),
                "decode_tok_s": round(number(nearest["batch_size"]) * 1000 / median, 1),
                "repeats": len(ok),
                "repeat_tpot_ms": " ".join(f"{number(r['tpot_ms']):.3f}" if r in ok else "-"
                                           for r in rows),
                "repeat_spread_pct": round(100 * (max(tpots) - min(tpots)) / median, 2),
                "lock_step": not any(not_lock_step(r) for r in ok),
                "timing_ok": all(str(r.get("timing_ok")) != "False" for r in ok),
                "spread_pct": max(number(r.get("spread_pct")) or 0.0 for r in ok)}
    if missed:
        combined["reason"] = (f"{len(missed)} of {len(rows)} runs {missed[-1].get('status')}: "
                              f"{missed[-1].get('reason')}")
    return combined


def run_of(row: dict) -> tuple:
    """The run a row comes from (its date and commit stamp): ratios are only taken within one,
    never against a BF16 row another command measured, maybe with other settings or GPU."""
    return row.get("date") or "", row.get("commit") or ""


def baseline_of(rows: list[dict], key=None, width: int = 5):
    """A lookup: row -> the ``ok`` BF16 (``auto``) row of ``rows`` with the same first ``width``
    fields of ``key`` (default ``matrix_key``: the same cell) and the same run, or None."""
    key = key or matrix_key
    base = {(*key(r)[:width], *run_of(r)): r for r in rows
            if r["kv"] == BASELINE_KV and r.get("status") == "ok"}
    return lambda row: base.get((*key(row)[:width], *run_of(row)))


def add_ratios(rows: list[dict]) -> list[dict]:
    """``vs_bf16`` (decode tok/s over BF16's) and ``tpot_vs_bf16`` (TPOT over BF16's) against the
    ``auto`` row of the same cell and run; empty where either is not ``ok`` or was not lock-step
    (its B / step would overstate the throughput).  A cell of several runs (``--repeats``,
    ``--rounds``) compares the median TPOTs of the runs both formats measured
    (``unpaired_runs_medians``), so that a run one format lost to the budget does not weigh on
    one side only."""
    reference = baseline_of(rows)
    for row in rows:
        ref = reference(row) if row.get("status") == "ok" else None
        if ref and (not_lock_step(row) or not_lock_step(ref)):
            ref = None
        paired = unpaired_runs_medians(row, ref) if ref else None
        if paired is None:   # each row's own median (or its one run)
            rates = [number(r.get("decode_tok_s")) if r else None for r in (row, ref)]
            tpots = [number(r.get("tpot_ms")) if r else None for r in (row, ref)]
        else:                # the medians of the runs both formats measured
            tpots = list(paired)
            rates = [number(r["batch_size"]) / t if t else None for r, t in zip((row, ref), tpots)]
        for column, (ours, theirs) in (("vs_bf16", rates), ("tpot_vs_bf16", tpots)):
            row[column] = round(ours / theirs, 3) if ours and theirs else ""
        row["vs_bf16_runs"] = _ratios_per_run(row, ref) if ref else ""
    return rows


def unpaired_runs_medians(row: dict, ref: dict) -> tuple[float | None, float | None] | None:
    """Where a cell's runs (``--repeats``, ``--rounds``) were not all measured by both formats:
    each format's median TPOT over the runs both measured ((None, None) if they share none);
    else None (each row's own median is the one to compare)."""
    ours, theirs = _per_run(row, "repeat_tpot_ms"), _per_run(ref, "repeat_tpot_ms")
    if len(ours) < 2 or len(ours) != len(theirs) or \
            [o is None for o in ours] == [t is None for t in theirs]:
        return None
    pairs = [(o, t) for o, t in zip(ours, theirs) if o and t]
    if not pairs:
        return None, None
    return statistics.median(o for o, _ in pairs), statistics.median(t for _, t in pairs)


def _ratios_per_run(row: dict, ref: dict) -> str:
    """With ``--repeats`` or ``--rounds``: the decode tok/s ratio of each run of the cell to
    BF16's of the same run ("-" where either did not measure), space-separated; "" for one
    run."""
    ours, theirs = _per_run(row, "repeat_tpot_ms"), _per_run(ref, "repeat_tpot_ms")
    batch, ref_batch = number(row.get("batch_size")), number(ref.get("batch_size"))
    if len(ours) < 2 or len(ours) != len(theirs) or not batch or not ref_batch:
        return ""
    return " ".join(f"{batch * t / (ref_batch * o):.3f}" if o and t else "-"
                    for o, t in zip(ours, theirs))


def _per_run(row: dict, column: str) -> list[float | None]:
    """A per-run column (space-separated, "-" for a run that did not measure) as numbers."""
    return [None if v == "-" else number(v) for v in str(row.get(column) or "").split()]


def ratio_range(row: dict) -> tuple[float, float] | None:
    """The lowest and highest per-run ratio of ``vs_bf16_runs``, or None."""
    runs = [v for v in _per_run(row, "vs_bf16_runs") if v]
    return (min(runs), max(runs)) if len(runs) > 1 else None


def layers_of(row: dict) -> int:
    """The layers of the model a row was measured with (rows from before --layers have none:
    4)."""
    return int(row.get("layers") or NUM_LAYERS)


def within_spread(row: dict) -> bool:
    """Whether the cell's per-run ratios lie on both sides of 1.0x: its runs do not agree on
    which format is faster, whatever side their median falls on."""
    span = ratio_range(row)
    return span is not None and span[0] < 1.0 <= span[1]


def serve_key(row: dict) -> tuple:
    return int(row["heads"]), row["mode"], row["kv"]


def add_serve_ratios(rows: list[dict]) -> list[dict]:
    """``vs_bf16``: output tok/s over the ``auto`` row's of the same heads, mode and run;
    ``tpot_p50_vs_bf16``: the ``auto`` row's median TPOT over ours (above 1: ours is faster).
    Arrivals are open-loop, so while an engine keeps up its output tok/s follows the arrival
    rate and ``vs_bf16`` stays near 1 whatever the kernels do: TPOT is then the comparison."""
    reference = baseline_of(rows, serve_key, 2)
    for row in rows:
        ref = reference(row) if row.get("status") == "ok" else None
        ours = number(row.get("output_tok_s"))
        theirs = number(ref.get("output_tok_s")) if ref else None
        row["vs_bf16"] = round(ours / theirs, 3) if ours and theirs else ""
        ours = number(row.get("tpot_p50_ms"))
        theirs = number(ref.get("tpot_p50_ms")) if ref else None
        row["tpot_p50_vs_bf16"] = round(theirs / ours, 3) if ours and theirs else ""
    return rows


def _fmt(value, digits: int = 0) -> str:
    value = number(value)
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(value) -> str:
    value = number(value)
    if value is None:
        return "-"
    return f"**{value:.2f}x** ▼" if value < 1.0 else f"{value:.2f}x"


def _ratio_with_runs(row: dict) -> str:
    text = _ratio(row.get("vs_bf16"))
    span = ratio_range(row)
    if span is None:
        return text
    if within_spread(row):
        text = text.removesuffix(" ▼") + " ≈"
    return f"{text} (runs {span[0]:.2f}-{span[1]:.2f})"


def _runs_header(title: str, runs: list[str]) -> list[str]:
    return [f"# {title}", "", "Runs (date | commit | GPU | vLLM | command), oldest first:", ""] + \
        [f"- {run}" for run in runs] + [""]


def matrix_panels(rows: list[dict]) -> list[tuple]:
    """(heads, max_model_len, mode) of the rows, in report order."""
    return sorted({matrix_key(r)[:3] for r in rows},
                  key=lambda k: (k[0], _order(k[1], MAX_MODEL_LENS), _order(k[2], MODES)))


def twin_summary(rows: list[dict], kv: str = "fp8_snapmla") -> str | None:
    """What the A/A control says about ``kv`` in ``rows`` (one panel's), or None without a
    twin: the range of the twin's ratios to BF16, in how many cells ``kv``'s ratio is further
    from 1.0x than the twin's (and on which side), and ``kv`` over the twin as a geometric mean.
    A format the twin's spread covers is not told apart from BF16 by these cells."""
    by_cell: dict[tuple, dict] = {}
    for r in rows:
        if r.get("status") == "ok" and number(r.get("vs_bf16")):
            by_cell.setdefault(matrix_key(r)[:5], {})[r["kv"]] = number(r["vs_bf16"])
    pairs = [(c[kv], c[TWIN_KV]) for c in by_cell.values() if kv in c and TWIN_KV in c]
    if not pairs:
        return None
    twins = [t for _, t in pairs]
    outside = [o for o, t in pairs if abs(o - 1) > abs(t - 1)]
    below = sum(o < 1 for o in outside)
    mean = math.exp(sum(math.log(o / t) for o, t in pairs) / len(pairs))
    return (f"A/A control ({len(pairs)} cells with a BF16 twin): the twin read "
            f"{min(twins):.2f}-{max(twins):.2f}x BF16; {KV_NAMES[kv]} is further from 1.0x than "
            f"the twin in {len(outside)} of them ({len(outside) - below} above, {below} below); "
            f"{KV_NAMES[kv]} / twin, geometric mean: {mean:.2f}x.")


def format_matrix(rows: list[dict], runs: list[str]) -> str:
    """matrix.md: a table per (heads, max_model_len, mode), a line per (context, batch)."""
    lines = _runs_header("fp8_snapmla vs vLLM's BF16 (`auto`) and FP8 caches: workload matrix",
                         runs)
    layers = sorted({layers_of(r) for r in rows})
    # The A/A twin's columns only where a run had one (--twin).
    twin = any(r["kv"] == TWIN_KV for r in rows)
    lines += [f"The model: DeepSeek-V3.1's attention in {'/'.join(map(str, layers))} dense "
              "layers (`--layers`).", ""]
    lines += ["decode tok/s = B / TPOT; TPOT = median over the timed windows of the engine "
              "core's step time.  Ratios: decode tok/s of the format over BF16's (`auto`) in the "
              "same cell (with `fill` the batches differ: the capacity gain is in the ratio); "
              "**bold** marks those below 1.0x, with ▼ where every run was below (or the cell "
              "ran once) and ≈ where the runs lie on both sides of 1.0x (they do not agree on "
              "which format is faster).  B: batch per format (BF16 / fp8_snapmla / "
              f"fp8{' / BF16 twin' if twin else ''}).  "
              "Where a note lists the runs' TPOTs, the cell ran that many times on each "
              "format (`--repeats`: a fresh engine each time; `--rounds`: the same engines, the "
              "formats in turn each round) and TPOT is their median; the ratio compares the "
              "medians of the runs both formats measured; `(runs a-b)` after a "
              "ratio: the lowest and highest ratio of one run to BF16's of the same run.", ""]
    by_key = {matrix_key(r): r for r in rows}
    shown = (*KV_SETTINGS, TWIN_KV) if twin else KV_SETTINGS
    twin_head = "BF16 twin tok/s | " if twin else ""
    twin_ratio = " | BF16 twin / BF16 (A/A)" if twin else ""
    for heads, mml, mode in matrix_panels(rows):
        panel_rows = [r for r in rows if matrix_key(r)[:3] == (heads, mml, mode)]
        cells = sorted({matrix_key(r)[3:5] for r in panel_rows},
                       key=lambda c: (c[0], batch_order(c[1])))
        tag = " (one TP8 rank of DeepSeek-V3.1)" if heads == 16 else ""
        lines += [f"## H={heads}{tag}, max_model_len {mml}, {mode}", ""]
        summary = twin_summary(panel_rows)
        if summary:
            lines += [summary, ""]
        lines += ["| context | batch | max_model_len (table pages per format) | B | BF16 tok/s | "
                  f"fp8_snapmla tok/s | fp8 tok/s | {twin_head}TPOT ms (BF16 / snap / fp8"
                  f"{' / twin' if twin else ''}) | fp8_snapmla / BF16 | fp8 / BF16"
                  f"{twin_ratio} | notes |",
                  "|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * (2 * twin)]
        for context, batch in cells:
            per_kv = {kv: by_key.get((heads, mml, mode, context, batch, kv)) or {}
                      for kv in shown}
            present = [r for r in per_kv.values() if r]
            tokens = next((r.get("max_model_len_tokens") for r in present
                           if r.get("max_model_len_tokens")), "")
            width = " / ".join(str(r.get("table_width") or "-") for r in per_kv.values() if r)
            notes = []
            bf16_run = run_of(per_kv[BASELINE_KV]) if per_kv[BASELINE_KV] else None
            for kv, r in per_kv.items():
                if r and r.get("status") == "ok" and bf16_run and run_of(r) != bf16_run:
                    # Ratios are only taken within a run: say why this one has none.
                    notes.append(f"{KV_NAMES[kv]} from another run ({r.get('date')}, "
                                 f"{r.get('commit')}): no ratio")
                if r and r.get("status") != "ok":
                    # From another run than BF16's (say, a failure kept while a later run
                    # skipped the cell for time): named, so it does not read as this run's.
                    when = (f" ({r.get('date')}, {r.get('commit')})"
                            if bf16_run and run_of(r) != bf16_run else "")
                    notes.append(f"{KV_NAMES[kv]} {r.get('status')}{when}: {r.get('reason')}")
                elif r and str(r.get("lock_step")) == "False":
                    notes.append(f"{KV_NAMES[kv]} not lock-step")
                elif r and str(r.get("timing_ok")) == "False":
                    notes.append(f"{KV_NAMES[kv]} noisy ({_fmt(r.get('spread_pct'), 1)}%)")
            repeated = [f"{KV_NAMES[kv]} {r['repeat_tpot_ms'].replace(' ', '/')}"
                        for kv, r in per_kv.items()
                        if r and (number(r.get("repeats")) or 0) > 1]
            if repeated:
                notes.append("runs' TPOT ms: " + ", ".join(repeated))
            ok = {kv: r if r.get("status") == "ok" else {} for kv, r in per_kv.items()}
            ratios = {kv: _ratio_with_runs(ok[kv]) for kv in shown if kv != BASELINE_KV}
            lines.append(
                f"| {context} | {batch} | {tokens} ({width}) | "
                + " / ".join(_fmt(r.get("batch_size")) for r in per_kv.values()) + " | "
                + " | ".join(_fmt(ok[kv].get("decode_tok_s")) for kv in shown) + " | "
                + " / ".join(_fmt(ok[kv].get("tpot_ms"), 2) for kv in shown) + " | "
                + " | ".join(ratios.values())
                + f" | {'; '.join(notes)} |")
        lines.append("")
    return "\n".join(lines)


def format_serve(rows: list[dict], runs: list[str]) -> str:
    lines = _runs_header("fp8_snapmla vs vLLM's BF16 (`auto`) and FP8 caches: continuous "
                         "batching", runs)
    lines += ["Requests arrive (Poisson) while the engine is stepped; token times are the engine "
              "core's.  TTFT = first token - arrival; TPOT per request = (last - first token) / "
              "(tokens - 1); output tok/s over the whole run.  **bold ▼**: below BF16.  While "
              "the engine keeps up with the arrivals, output tok/s follows the arrival rate on "
              "every KV format: then the TPOT ratio (BF16's median TPOT over this one's) is the "
              "comparison.", "",
              "| H | mode | KV | requests (completed) | rate /s | output tok/s | vs BF16 | "
              "TTFT p50 / p99 ms | TPOT p50 / p99 ms | TPOT p50 vs BF16 | notes |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        note = "" if r.get("status") == "ok" else f"{r.get('status')}: {r.get('reason')}"
        lines.append(
            f"| {r['heads']} | {r['mode']} | {KV_NAMES.get(r['kv'], r['kv'])} | "
            f"{_fmt(r.get('requests'))} ({_fmt(r.get('completed'))}) | {_fmt(r.get('rate'), 2)} | "
            f"{_fmt(r.get('output_tok_s'))} | {_ratio(r.get('vs_bf16'))} | "
            f"{_fmt(r.get('ttft_p50_ms'), 1)} / {_fmt(r.get('ttft_p99_ms'), 1)} | "
            f"{_fmt(r.get('tpot_p50_ms'), 2)} / {_fmt(r.get('tpot_p99_ms'), 2)} | "
            f"{_ratio(r.get('tpot_p50_vs_bf16'))} | {note} |")
    return "\n".join(lines) + "\n"


def plot_matrix(rows: list[dict], path: Path, title: str) -> list[str]:
    """Heat maps of the fp8_snapmla/BF16 decode tok/s ratio, one panel per (heads,
    max_model_len, mode): rows = context, columns = batch, a diverging colormap centred at 1.0
    with the ratio in each cell (under it, with ``--repeats`` or ``--rounds``, the range of the
    per-run ratios, and ≈ before it where they lie on both sides of 1.0x), missing cells grey
    and hatched.  Where the cells come from more than one commit, each panel's title names the
    commits of its cells.  Returns the panels' titles (empty, and no file, without
    matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.patches import Rectangle

    panels = matrix_panels(rows)
    if not panels:
        return []
    ours = {matrix_key(r)[:5]: r for r in rows
            if r["kv"] == "fp8_snapmla" and r.get("status") == "ok"}
    ratios = {cell: number(r.get("vs_bf16")) for cell, r in ours.items()}
    spans = {cell: ratio_range(r) for cell, r in ours.items()}
    values = [v for v in ratios.values() if v]
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min([0.5, *values]), vmax=max([2.0, *values]))
    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="lightgrey")
    columns = min(len(panels), 4)
    grid_rows = math.ceil(len(panels) / columns)
    width_in = 4.6 * columns + 1
    fig, axes = plt.subplots(grid_rows, columns, figsize=(width_in, 3.6 * grid_rows + 1),
                             squeeze=False, layout="constrained")
    titles, image = [], None
    several_commits = len({r.get("commit") for r in ours.values()}) > 1
    for ax, (heads, mml, mode) in zip(axes.flat, panels):
        mine = [matrix_key(r) for r in rows if matrix_key(r)[:3] == (heads, mml, mode)]
        contexts = sorted({k[3] for k in mine})
        batches = sorted({k[4] for k in mine}, key=batch_order)
        grid = np.full((len(contexts), len(batches)), np.nan)
        for i, context in enumerate(contexts):
            for j, batch in enumerate(batches):
                value = ratios.get((heads, mml, mode, context, batch))
                if value:
                    grid[i, j] = value
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto")
        for i in range(len(contexts)):
            for j in range(len(batches)):
                if np.isnan(grid[i, j]):
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//",
                                           edgecolor="grey", lw=0))
                    ax.text(j, i, "n/a", ha="center", va="center", fontsize=7, color="dimgrey")
                else:
                    cell = (heads, mml, mode, contexts[i], batches[j])
                    span = spans.get(cell)
                    mark = "≈" if within_spread(ours[cell]) else ""
                    ax.text(j, i, f"{mark}{grid[i, j]:.2f}x", ha="center",
                            va="bottom" if span else "center", fontsize=9,
                            fontweight="bold" if grid[i, j] < 1.0 else "normal")
                    if span:   # --repeats, --rounds: the per-run ratios' range
                        ax.text(j, i, f"{span[0]:.2f}-{span[1]:.2f}", ha="center", va="top",
                                fontsize=6.5, color="dimgrey")
        ax.set_xticks(range(len(batches)), batches)
        ax.set_yticks(range(len(contexts)), [str(c) for c in contexts])
        ax.set_xlabel("batch")
        ax.set_ylabel("context")
        titles.append(f"H={heads}, {mml}, {mode}")
        if several_commits:
            commits = sorted({r.get("commit") or "?" for cell, r in ours.items()
                              if cell[:3] == (heads, mml, mode)})
            titles[-1] += "\nat " + ", ".join(commits)
        ax.set_title(titles[-1])
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8,
                 label="fp8_snapmla / BF16 decode tok/s")
    lines = textwrap.wrap(title, int(width_in * 15))
    if any(spans.values()):
        lines.append("small numbers: the lowest and highest run's ratio; ≈: they lie on both "
                     "sides of 1.0x")
    fig.suptitle("\n".join(lines), fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return titles


def write_outputs(out: Path, info: dict | None, matrix_rows=(), serve_rows=(), *,
                  run_fields: dict | None, plot: bool = True, repeats: int = 1
                  ) -> tuple[list[dict], list[dict]]:
    """Merge the new rows into ``out``'s matrix.csv and serve.csv and rewrite them with their
    tables (and matrix.png with ``plot``).  ``info`` (this run's ``run_info``) is added to the
    runs in the headers; None (--replot) keeps them.  New rows are stamped with the run's date,
    commit and ``run_fields`` (``run_fields_of``: --switch-interval and --layers; required with
    ``info``, so that no row is stamped with defaults its run did not have).  With
    ``repeats`` > 1 the new cell rows (one run of the plan each, their ``repeat``) go into
    repeats.csv, and matrix.csv gets each cell's ``combine_repeats`` of this command's runs.
    Returns all rows."""
    if info is not None and run_fields is None:
        raise ValueError("write_outputs: a run's rows need its run_fields (run_fields_of)")
    out.mkdir(parents=True, exist_ok=True)
    if repeats > 1 and matrix_rows:
        matrix_rows = _record_repeats(out, info, matrix_rows, run_fields)
    results = []
    for name, fields, new, key, ratios, table in (
            ("matrix", MATRIX_FIELDS, matrix_rows, matrix_key, add_ratios, format_matrix),
            ("serve", SERVE_FIELDS, serve_rows, serve_key, add_serve_ratios, format_serve)):
        runs, old = read_csv(out / f"{name}.csv")
        if not (old or new):
            results.append([])
            continue
        if info is not None and new and describe(info) not in runs:
            runs.append(describe(info))
        stamp = {"date": info["date"], "commit": info["commit"], **run_fields} if info else {}
        rows = ratios(merge_rows(old, [{**stamp, **r} for r in new], key))
        write_csv(rows, out / f"{name}.csv", fields, runs)
        (out / f"{name}.md").write_text(table(rows, runs))
        if name == "matrix" and plot:
            plot_matrix(rows, out / "matrix.png", "fp8_snapmla / BF16 decode tok/s through vLLM; "
                        + plot_runs_line(runs))
        results.append(rows)
    return results[0], results[1]


def plot_runs_line(runs: list[str]) -> str:
    """The heat map's line about its runs: the run itself where there is one, else how many,
    from when to when and on which GPUs (matrix.md lists each with its command)."""
    if len(runs) <= 1:
        return runs[0] if runs else ""
    fields = [described(run) for run in runs]
    dates = sorted(f["date"] for f in fields)
    gpus = ", ".join(sorted({f["gpu"] for f in fields if "gpu" in f}))
    return (f"{len(runs)} runs, {dates[0]} to {dates[-1]}, {gpus} (matrix.md lists each run's "
            f"commit and command)")


def _record_repeats(out: Path, info: dict, rows, run_fields: dict) -> list[dict]:
    """Merge ``rows`` (runs of --repeats) into repeats.csv; the combined row of each of their
    cells over this command's runs so far."""
    runs, old = read_csv(out / "repeats.csv")
    if describe(info) not in runs:
        runs.append(describe(info))
    new = [{"date": info["date"], "commit": info["commit"], **run_fields, **r} for r in rows]
    every = merge_by_key(old, new, repeat_key, lambda k: (_matrix_order(k[:6]), k[6:]))
    write_csv(every, out / "repeats.csv", REPEAT_FIELDS, runs)
    cells = dict.fromkeys((*matrix_key(r), *run_of(r)) for r in new)
    return [combine_repeats([r for r in every if (*matrix_key(r), *run_of(r)) == cell])
            for cell in cells]


def switch_interval_arg_problem(ms: float) -> str | None:
    """Why ``--switch-interval ms`` cannot be set exactly, or None.  CPython keeps the interval
    in whole microseconds (2.5 µs becomes 2, under 1 µs becomes 0), and the engine's check that
    the interval took effect would fail only after the engine had started."""
    if not math.isfinite(ms) or ms <= 0:
        return f"--switch-interval must be a positive number of ms, not {ms:g}"
    microseconds = ms * 1000
    if microseconds < 1 or abs(microseconds - round(microseconds)) > 1e-6:
        return (f"--switch-interval {ms:g} ms: Python keeps the interval in whole microseconds "
                f"(at least 0.001 ms)")
    return None


def run_fields_of(switch_ms: str = "", layers: int = NUM_LAYERS) -> dict:
    """The fields every row of a run carries besides its date and commit: the GIL switch
    interval ("" for Python's default) and the model's layers."""
    return {"switch_interval_ms": switch_ms, "layers": layers}


def folder_problem(out: Path, run_fields: dict) -> str | None:
    """Why this run (``run_fields``) must not merge into ``out``: it holds rows measured with
    another --switch-interval or --layers (rows from before --layers have 4); None if it may."""
    asked_ms, asked_layers = run_fields["switch_interval_ms"], run_fields["layers"]
    for name in ("matrix", "serve"):
        _, rows = read_csv(out / f"{name}.csv")
        other = {r.get("switch_interval_ms") or "" for r in rows} - {asked_ms}
        if other:
            held = ", ".join(sorted(f"{v} ms" if v else "Python's default" for v in other))
            asked = f"{asked_ms} ms" if asked_ms else "Python's default"
            return (f"{out / name}.csv holds results measured with the GIL switch interval at "
                    f"{held}; this run's ({asked}) needs another --out")
        other = {layers_of(r) for r in rows} - {asked_layers}
        if other:
            return (f"{out / name}.csv holds results of a model with "
                    f"{', '.join(map(str, sorted(other)))} layers; this run's --layers "
                    f"{asked_layers} needs another --out")
    return None


# --- the sweep -------------------------------------------------------------------------------

def child_command() -> list[str]:
    return [sys.executable, "-m", "benchmarks.bench_matrix", "--child"]


def engine_rows(engine: Engine, results: list[dict], failure: str | None, facts: dict
                ) -> tuple[list[dict], list[dict]]:
    """The matrix and serve rows of an engine from its child's results; cells without a result
    get ``failure`` (or "no result").  With --rounds a row per cell and round, the round as its
    ``repeat``."""
    base = {"heads": engine.heads, "kv": engine.kv, "mode": engine.mode}
    started = next((r for r in results if r.get("kind") == "engine"), {})
    # The backend's block size (vLLM's BF16 default on Hopper, FlashAttention MLA, uses 16), as
    # the engine reported it; unknown ("") where it never started (its cells skipped or failed).
    block_size = started.get("block_size")
    cell_base = {**base, "max_model_len": engine.max_model_len,
                 "max_model_len_tokens": engine.max_model_len_tokens,
                 "block_size": block_size or "",
                 "table_width": math.ceil(engine.max_model_len_tokens / block_size)
                 if block_size else ""}
    capacity = started.get("kv_cache_tokens", "")
    by_cell = {(r["context"], r["batch"], r.get("round", 1)): r for r in results
               if r.get("kind") == "cell"}
    missing = {"status": "failed", "reason": failure or "no result", "kv_cache_tokens": capacity}
    matrix = []
    for context, label in engine.cells:
        for round_ in range(1, engine.rounds + 1):
            result = {k: v for k, v in (by_cell.get((context, label, round_)) or missing).items()
                      if k not in ("kind", "round")}
            matrix.append({**cell_base, **facts, "context": context, "batch": label, **result,
                           "repeat": engine.run_number(round_)})
    serve = []
    if engine.serve:
        result = next((r for r in results if r.get("kind") == "serve"), missing)
        serve.append({**base, **facts, **{k: v for k, v in result.items() if k != "kind"}})
    return matrix, serve


def write_engine_log(out: Path, number: int, engine: Engine, log: str) -> Path:
    """A failed engine's whole output (with a stalled cell's stacks) in ``out/logs``."""
    path = out / "logs" / (f"engine-{number}-{engine.kv}-h{engine.heads}-"
                           f"{engine.max_model_len_tokens}-{engine.mode}.log")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(log)
    return path


def _cell_line(row: dict, bf16: dict | None, engine_no: int, round_: int | None = None) -> str:
    """A cell's progress line; it names the engine (engines of a group report interleaved) and,
    with --rounds, the round."""
    head = (f"    [{engine_no}] {row['kv']} ctx {row['context']:>6} x {row['batch']:>4}"
            + (f" round {round_}" if round_ else ""))
    if row.get("status") != "ok":
        return f"{head}: {row.get('status')}: {row.get('reason')}"
    ratio = ""
    if bf16 and bf16.get("status") == "ok" and number(bf16.get("decode_tok_s")):
        ratio = f", {number(row['decode_tok_s']) / number(bf16['decode_tok_s']):.2f}x BF16"
    flags = (" NOT LOCK-STEP" if row.get("lock_step") is False else "") + \
        (" NOISY" if row.get("timing_ok") is False else "")
    return (f"{head} (B={row['batch_size']}): {row['decode_tok_s']:,.0f} tok/s, TPOT "
            f"{row['tpot_ms']:.2f} ms{ratio}, windows {row['spread_pct']:.1f}% apart{flags}, "
            f"{row.get('cell_s')} s (estimated {row.get('estimated_s')} s)")


def replot(out: Path) -> None:
    matrix, serve = write_outputs(out, None, run_fields=None)
    if not (matrix or serve):
        sys.exit(f"no matrix.csv or serve.csv in {out}")
    print(f"redrew {out}/matrix.md, matrix.png ({len(matrix)} rows) and serve.md "
          f"({len(serve)} rows)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/bench_matrix", help="folder of the outputs")
    parser.add_argument("--kv", nargs="+", default=list(KV_SETTINGS), choices=KV_SETTINGS)
    parser.add_argument("--heads", type=int, nargs="+", default=list(HEADS))
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--batches", type=parse_batch, nargs="+", default=list(BATCHES),
                        help="positive integers and/or 'fill'")
    parser.add_argument("--max-model-len", nargs="+", default=list(MAX_MODEL_LENS),
                        choices=MAX_MODEL_LENS, dest="max_model_lens")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--serve", action="store_true",
                        help="also a continuous-batching run per (kv, heads, mode)")
    parser.add_argument("--serve-only", action="store_true", help="that run and no cells")
    parser.add_argument("--serve-requests", type=int, default=96)
    parser.add_argument("--serve-rate", type=float, default=3.0, help="arrivals per second")
    parser.add_argument("--serve-prompt-range", type=int, nargs=2, default=[256, 8192])
    parser.add_argument("--serve-output-range", type=int, nargs=2, default=[32, 512])
    parser.add_argument("--serve-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=Settings.steps,
                        help="decode steps per timed window")
    parser.add_argument("--windows", type=int, default=Settings.windows)
    parser.add_argument("--layers", type=int, default=NUM_LAYERS,
                        help="layers of the model, all dense (DeepSeek-V3.1 has 61 layers, 58 "
                             "of them MoE)")
    parser.add_argument("--kv-cache-gib", type=float,
                        help="KV-cache GiB of every engine, the same for every KV format "
                             "(positive: the cells are planned on it); default 1 GiB a layer")
    parser.add_argument("--max-batch", type=int, default=Settings.max_batch)
    parser.add_argument("--max-batched-tokens", type=int, default=Settings.max_batched_tokens)
    parser.add_argument("--max-prefill-tokens", type=int, default=Settings.max_prefill_tokens)
    parser.add_argument("--budget-s", type=float,
                        help="wall-clock seconds for the whole command: no engine or cell "
                             "starts that the estimate says would end later")
    parser.add_argument("--below", type=float, metavar="RATIO",
                        help="only the selected cells whose recorded fp8_snapmla/BF16 ratio "
                             "in --out's matrix.csv is below RATIO (1.0: measure the cells "
                             "under 1.0x again, e.g. with --interleave --rounds 3)")
    parser.add_argument("--unmeasured", action="store_true",
                        help="only the selected cells that a format of --kv has no row for in "
                             "--out's matrix.csv, or one skipped for time (--budget-s)")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds for an engine to start, and for it to start and measure "
                             "(an engine of a --concurrent-starts group also gets the time of "
                             "those measuring before it, of an --interleave group that of all, "
                             "with --rounds N N times that; with --interleave also the most one "
                             "turn may take)")
    parser.add_argument("--concurrent-starts", type=int, default=1, metavar="N",
                        help="start N engines at once (their compilation and CUDA-graph "
                             "capture overlap), then let them measure one at a time; 1: one "
                             "engine after the other")
    parser.add_argument("--interleave", action="store_true",
                        help="start the engines of each comparison (every --kv format of one "
                             "heads, table and mode) together and let them measure cell by cell "
                             "in turns, so that a cell's formats are measured within seconds of "
                             "each other; starts as many engines at once as there are --kv "
                             "formats (instead of --concurrent-starts)")
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="with --interleave: measure every cell N times on the same "
                             "engines, the formats in turn, a pass over all cells per round; a "
                             "cell's TPOT is the median of its rounds' (repeats.csv has each)")
    parser.add_argument("--repeats", type=int, default=1, metavar="N",
                        help="run the whole plan N times over, a fresh engine each time; a "
                             "cell's TPOT is the median of its runs' (repeats.csv has each)")
    parser.add_argument("--twin", action="store_true",
                        help="with --interleave: a second BF16 engine (auto_twin) in each "
                             "comparison, measured in turn with the others; its ratio to BF16 "
                             "is an A/A control of the method (with --unmeasured, a cell "
                             "without a twin row is measured again on every format)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument("--switch-interval", type=float, metavar="MS",
                        help="Python's GIL switch interval in each engine-core process, in ms "
                             "(sys.setswitchinterval; Python's default is 5): for experiments "
                             "on the engine core's threads; results go to an --out of their own")
    parser.add_argument("--replot", action="store_true",
                        help="no GPU: redraw matrix.md/png and serve.md from --out's CSVs")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(run_engine)
        return
    out = Path(args.out)
    if args.replot:
        replot(out)
        return
    if args.steps < 1 or args.windows < 1:
        parser.error("--steps and --windows must be at least 1")
    # --max-batch is vLLM's max_num_seqs: a larger fixed batch would run in parts, not lock-step.
    too_large = [b for b in args.batches if b != "fill" and int(b) > args.max_batch]
    if args.max_batch < 1 or too_large:
        parser.error(f"--batches {' '.join(too_large)} above --max-batch {args.max_batch} (the "
                     "engine's max_num_seqs) would not decode in one batch; raise --max-batch")
    if not 1 <= args.concurrent_starts <= 8:
        parser.error("--concurrent-starts must be 1 to 8")
    args.kv = list(dict.fromkeys(args.kv))
    if args.twin:
        if not args.interleave or BASELINE_KV not in args.kv:
            parser.error("--twin measures a second BF16 engine in turn with the first: it needs "
                         f"--interleave and {BASELINE_KV} among --kv")
        args.kv.append(TWIN_KV)
    if args.interleave and args.concurrent_starts not in (1, len(args.kv)):
        parser.error(f"--interleave starts the {len(args.kv)} --kv formats of a comparison "
                     f"together: leave out --concurrent-starts (or give {len(args.kv)})")
    if args.interleave and len(args.kv) < 2:
        parser.error("--interleave compares formats in turns: give at least two --kv formats")
    at_once = len(args.kv) if args.interleave else args.concurrent_starts
    if not 1 <= args.repeats <= 10:
        parser.error("--repeats must be 1 to 10")
    if not 1 <= args.rounds <= 10:
        parser.error("--rounds must be 1 to 10")
    if args.rounds > 1 and not args.interleave:
        parser.error("--rounds alternates the formats of a cell: it needs --interleave")
    if args.rounds > 1 and args.repeats > 1:
        parser.error("--rounds and --repeats both number a cell's runs: give one of them")
    runs_per_cell = max(args.repeats, args.rounds)
    if not 1 <= args.layers <= 61:
        parser.error("--layers must be 1 to 61 (DeepSeek-V3.1's)")
    if args.kv_cache_gib is None:   # the same tokens per engine whatever the layers
        args.kv_cache_gib = KV_CACHE_GIB_PER_LAYER * args.layers
    # A deeper model holds more weights; with more than 4 layers one engine is checked too.
    problem = concurrent_memory_problem(
        at_once, args.kv_cache_gib,
        ENGINE_OVERHEAD_GIB + extra_weights_gib(max(args.heads), args.layers),
        check_one=args.layers > NUM_LAYERS)
    if problem and args.interleave:
        # e.g. three formats on an 80 GB GPU: 3 x (4 + 20) GiB is just over 90% of it.
        problem = (problem.replace(f"--concurrent-starts {at_once}", "--interleave"
                                   + (" (--twin is one of the engines)" if args.twin else ""))
                   .replace("start fewer at once", "compare fewer --kv formats, or give each "
                            "a smaller --kv-cache-gib"))
    if problem:
        parser.error(problem)
    if args.kv_cache_gib <= 0:
        parser.error("--kv-cache-gib must be positive: the cells are planned on it")
    if args.switch_interval is not None:
        problem = switch_interval_arg_problem(args.switch_interval)
        if problem:
            parser.error(problem)
    switch_ms = "" if args.switch_interval is None else f"{args.switch_interval:g}"
    run_fields = run_fields_of(switch_ms, args.layers)
    problem = folder_problem(out, run_fields)
    if problem:
        parser.error(problem)
    low, high = args.serve_prompt_range
    if not 1 <= low <= high or not 1 <= args.serve_output_range[0] <= args.serve_output_range[1]:
        parser.error("--serve-*-range wants LOW HIGH with 1 <= LOW <= HIGH")

    started = time.time()
    deadline = started + args.budget_s if args.budget_s else None
    settings = Settings(steps=args.steps, windows=args.windows, max_batch=args.max_batch,
                        max_batched_tokens=args.max_batched_tokens,
                        max_prefill_tokens=args.max_prefill_tokens,
                        kv_cache_gib=args.kv_cache_gib, layers=args.layers)
    serve = args.serve or args.serve_only
    workload = serve_workload(args.serve_requests, args.serve_rate,
                              tuple(args.serve_prompt_range), tuple(args.serve_output_range),
                              args.serve_seed) if serve else None
    engines, skipped = plan_matrix(args.kv, args.heads, args.contexts, args.batches,
                                   args.max_model_lens, args.modes, settings, serve,
                                   args.serve_only)
    recorded = (read_csv(out / "matrix.csv")[1]
                if args.below is not None or args.unmeasured else [])
    if args.below is not None:
        engines, skipped = keep_cells(engines, skipped, cells_below(recorded, args.below))
        if not any(e.cells for e in engines):
            parser.error(f"--below {args.below:g}: no selected cell in {out / 'matrix.csv'} has "
                         f"a fp8_snapmla/BF16 ratio below {args.below:g}")
    if args.unmeasured:
        settled = settled_cells(recorded, args.kv)
        every = {e.cell_key(c, b) for e in engines for c, b in e.cells}
        engines, skipped = keep_cells(engines, skipped, every - settled)
        if not any(e.cells for e in engines):
            parser.error(f"--unmeasured: every selected cell is settled in {out / 'matrix.csv'}")
    # The continuous-batching run (serve.csv keeps one row per format) runs once.
    engines = [replace(e, repeat=r, serve=e.serve and r == 1, rounds=args.rounds)
               for r in range(1, args.repeats + 1) for e in engines if e.cells or r == 1]
    info = run_info("benchmarks.bench_matrix", sys.argv[1:] if argv is None else argv)
    print(describe(info), flush=True)
    estimates = [estimate_engine_s(e, settings, workload) for e in engines]
    cells = sum(len(e.cells) for e in engines)
    est_skips = sum(1 for _, decisions in estimates for d in decisions if d["reason"])
    print(f"{len(engines)} engines ({sum(e.mode == 'graph' for e in engines)} graph, "
          f"{sum(e.mode == 'eager' for e in engines)} eager), {cells} cells"
          + (f" x {args.rounds} rounds" if args.rounds > 1 else "") + " "
          f"(about {est_skips} of them will be skipped by the engine: KV capacity, prefill, "
          f"max_model_len), {len(skipped)} cell rows skipped now by --max-prefill-tokens"
          + (f", {sum(e.serve for e in engines)} serve runs of {len(workload)} requests"
             if serve else "")
          + f"; estimated {estimate_total_s(engines, estimates, at_once, args.interleave) / 60:.1f}"
            " min"
          + (f", budget {args.budget_s / 60:.1f} min" if deadline else ""), flush=True)
    for i, (engine, (seconds, decisions)) in enumerate(zip(engines, estimates), 1):
        print(f"  [{i}] {engine.describe(args.repeats)}: {len(engine.cells)} cells"
              f"{' + serve' if engine.serve else ''}, ~{seconds:.0f} s", flush=True)
        if args.dry_run:
            print("\n".join(dry_run_cells(engine, decisions)), flush=True)
    if args.dry_run:
        return
    write_outputs(out, info, skipped, run_fields=run_fields)

    write_lock = threading.Lock()   # result handlers run on the children's reader threads
    bf16_rounds: dict = {}          # --rounds: BF16's row of each cell and round, for progress

    def launch(i: int, engine: Engine, models: dict, position: int, group_size: int):
        """What ``run_engines_together`` calls for engine ``i``: its child, with progress lines
        and each cell's row written as it arrives."""
        def run(go_file, on_up):
            engine_start = time.monotonic()

            started = []   # the engine's own record (its block size), once it is up

            def report(result):
                kind = result.get("kind")
                if kind == "engine":
                    started.append(result)
                    on_up()
                    print(f"    [{i}] engine up in {time.monotonic() - engine_start:.0f} s, "
                          f"KV cache {result['kv_cache_tokens']:,} tokens", flush=True)
                elif kind == "cell":
                    matrix, _ = engine_rows(engine, started + [result], None, {})
                    row = next(r for r in matrix
                               if (r["context"], r["batch"], r["repeat"])
                               == (result["context"], result["batch"],
                                   engine.run_number(result.get("round", 1))))
                    with write_lock:
                        rows, _ = write_outputs(out, info, [row], plot=False,
                                                run_fields=run_fields,
                                                repeats=runs_per_cell)
                    # BF16 of this run only, as the CSV's ratios (the row as stamped there); with
                    # --rounds BF16's row of the same round.
                    if engine.rounds > 1:
                        if row["kv"] == BASELINE_KV and row.get("status") == "ok":
                            bf16_rounds[(*matrix_key(row)[:5], row["repeat"])] = row
                        bf16 = bf16_rounds.get((*matrix_key(row)[:5], row["repeat"]))
                    else:
                        bf16 = baseline_of(rows)({**row, "date": info["date"],
                                                  "commit": info["commit"]})
                    print(_cell_line(row, bf16, i,
                                     row["repeat"] if engine.rounds > 1 else None), flush=True)
                elif kind == "serve":
                    print(f"    serve: {result.get('status')} "
                          + (f"{result['output_tok_s']:,.0f} output tok/s, TTFT p50/p99 "
                             f"{result['ttft_p50_ms']:.0f}/{result['ttft_p99_ms']:.0f} ms, TPOT "
                             f"p50/p99 {result.get('tpot_p50_ms', float('nan')):.2f}/"
                             f"{result.get('tpot_p99_ms', float('nan')):.2f} ms, "
                             f"{result['completed']}/{result['requests']} completed"
                             if result.get("status") == "ok" else str(result.get("reason"))),
                          flush=True)

            spec = {"model": models[engine.heads], "kv": engine.kv, "heads": engine.heads,
                    "mode": engine.mode, "max_model_len_tokens": engine.max_model_len_tokens,
                    "cells": engine.turns, "settings": asdict(settings), "deadline": deadline,
                    "switch_interval_s": (args.switch_interval / 1000
                                          if args.switch_interval else None),
                    "serve": ({"workload": workload, "seed": args.serve_seed}
                              if engine.serve else None)}
            spec.update(concurrent_start_spec(go_file, group_size, in_turns=args.interleave))
            if args.interleave:
                # The engines measuring after this one in a turn; with --rounds the order moves
                # each round, so any of them may be first.
                spec["turn_engines"] = group_size if args.rounds > 1 else group_size - position
            # An engine waits for the ones before it in its group (with --interleave, for all of
            # them); past the budget each gets its grace after the one before it, time to
            # record its cells as skipped.
            waits_for = group_size if args.interleave else position + 1
            timeout = args.timeout * waits_for * args.rounds
            if deadline is not None:
                timeout = min(timeout, deadline - time.time() + CHILD_GRACE_S * waits_for)
            return run_child(child_command(), spec, timeout, report,
                             startup_timeout=args.timeout)
        return run

    with tempfile.TemporaryDirectory(prefix="bench-matrix-") as tmp:
        models = {h: str(write_tiny_deepseek_v3(Path(tmp) / f"deepseek-v31-attn-h{h}",
                                                **model_config(h, args.layers)))
                  for h in args.heads}
        for indices in start_groups(engines, at_once, args.interleave):
            group, queued = [], 0.0   # queued: the measuring time of the group so far
            for k in indices:
                i, engine, (seconds, decisions) = k + 1, engines[k], estimates[k]
                first = next((d["estimated_s"] for d in decisions if not d["reason"]),
                             estimate_serve_s(workload, engine.mode, args.layers)
                             if engine.serve else 0.0)
                need = ENGINE_START_S[engine.mode] + queued + first
                if deadline is not None and time.time() + need > deadline:
                    reason = (f"{BUDGET_SKIP} engine start + first cell ~{need:.0f} s, "
                              f"{max(0.0, deadline - time.time()):.0f} s left")
                    print(f"[{i}/{len(engines)}] {engine.describe(args.repeats)}: skipped, "
                          f"{reason}", flush=True)
                    matrix, serve_rows = engine_rows(
                        engine, [{"kind": "cell", "context": c, "batch": b, "status": "skipped",
                                  "reason": reason, "round": r} for c, b in engine.cells
                                 for r in range(1, engine.rounds + 1)]
                        + ([{"kind": "serve", "status": "skipped", "reason": reason}]
                           if engine.serve else []), None, {})
                    write_outputs(out, info, matrix, serve_rows, plot=False,
                                  run_fields=run_fields, repeats=runs_per_cell)
                    continue
                print(f"[{i}/{len(engines)}] {engine.describe(args.repeats)}: "
                      f"{len(engine.cells)} cells"
                      f"{' + serve' if engine.serve else ''}, ~{seconds:.0f} s "
                      f"({time.time() - started:.0f} s into the run)", flush=True)
                group.append((i, engine))
                # In turns an engine's first cell waits for the others' first cells only.
                queued += first if args.interleave else seconds - ENGINE_START_S[engine.mode]
            if not group:
                continue
            outcomes = run_engines_together(
                [launch(i, engine, models, k, len(group)) for k, (i, engine) in enumerate(group)],
                Path(tmp), in_turns=args.interleave, turn_limit_s=args.timeout,
                # --rounds: the format that measures first moves on by one every round.
                rotate_every=len(engines[indices[0]].cells) if args.rounds > 1 else None)
            for (i, engine), (results, log, failure) in zip(group, outcomes):
                matrix, serve_rows = engine_rows(engine, results, failure, engine_log_facts(log))
                for row in serve_rows:
                    row.update(rate=args.serve_rate, seed=args.serve_seed)
                write_outputs(out, info, matrix, serve_rows, run_fields=run_fields,
                              repeats=runs_per_cell)
                if failure:
                    print(f"    [{i}] engine failed: {failure}; its output in "
                          f"{write_engine_log(out, i, engine, log)}", flush=True)
    matrix, serve_rows = write_outputs(out, None, run_fields=None)
    print(f"\nwrote {out}/matrix.csv, matrix.md, matrix.png"
          + (", serve.csv, serve.md" if serve_rows else "")
          + f" in {(time.time() - started) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
