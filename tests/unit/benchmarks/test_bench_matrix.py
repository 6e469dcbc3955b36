"""benchmarks/bench_matrix.py without a GPU: which engines and cells it plans (tight max_model_len
groups, skip reasons, budget estimates), the cell decisions an engine makes, the continuous-
batching driver and its statistics against a stand-in engine, and the CSV merge, tables, heat
maps and --replot."""

import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_matrix as bm
from benchmarks import vllm_engine

_ROOT = Path(__file__).resolve().parents[3]
SETTINGS = bm.Settings()


# --- planning ------------------------------------------------------------------------------

def test_plan_runs_one_engine_per_kv_heads_table_and_mode_with_kv_innermost():
    engines, skipped = bm.plan_matrix(["auto", "fp8_snapmla"], [16], [512, 2048],
                                      ["1", "64", "fill"], ["wide", "tight"], ["eager", "graph"],
                                      SETTINGS)
    assert skipped == []
    described = [(e.mode, e.max_model_len, e.max_model_len_tokens, e.kv) for e in engines]
    # eager first as asked; wide, then one tight engine per context (4x apart); kv innermost.
    assert [d[:2] for d in described[:6]] == [("eager", "wide")] * 2 + [("eager", "tight")] * 4
    assert [d[3] for d in described] == ["auto", "fp8_snapmla"] * 6
    assert len(engines) == 12
    wide = engines[0]
    assert wide.max_model_len_tokens == 163840 and wide.table_width == 2560
    assert wide.cells == [(512, "1"), (512, "64"), (512, "fill"), (2048, "1"), (2048, "64"),
                          (2048, "fill")]
    tight = [e for e in engines if e.max_model_len == "tight" and e.mode == "eager"]
    assert [e.cells for e in tight[::2]] == [[(512, "1"), (512, "64"), (512, "fill")],
                                            [(2048, "1"), (2048, "64"), (2048, "fill")]]
    for engine in tight:
        assert engine.max_model_len_tokens % vllm_engine.BLOCK_SIZE == 0
        for context, label in engine.cells:
            batch = bm.largest_batch(label, context, SETTINGS)
            need = context + bm.max_tokens_for(batch, context, SETTINGS.max_batched_tokens,
                                               SETTINGS)
            # Room for the cell, and a table at most 2x as wide as the cell needs.
            assert need <= engine.max_model_len_tokens
            assert engine.table_width <= 2 * math.ceil(need / vllm_engine.BLOCK_SIZE)


def test_tight_groups_share_an_engine_only_within_twice_the_smallest_width():
    groups = bm.tight_groups({1000: 1300, 1500: 1800, 2600: 2700, 5000: 5300})
    # widths 21, 29, 43, 83 pages: 29 <= 42 joins 1000's group, 43 > 42 starts one, 83 > 86? no:
    # 83 <= 2 * 43 joins 2600's.
    assert groups == [(29 * 64, [1000, 1500]), (83 * 64, [2600, 5000])]
    assert bm.tight_groups({512: 726}) == [(768, [512])]
    assert bm.tight_groups({512: 726, 2048: 2300}, factor=1) == [(768, [512]), (2304, [2048])]


def test_prefill_above_the_limit_is_skipped_for_every_engine_with_the_reason():
    settings = bm.Settings(max_prefill_tokens=2_000_000)
    engines, skipped = bm.plan_matrix(["auto", "fp8"], [16, 128], [32768, 131072],
                                      ["8", "64", "fill"], ["wide"], ["graph"], settings)
    # 64 x 32768 = 2.1M and 64 x 131072 = 8.4M exceed 2M; 8 x 131072 = 1.05M does not.
    assert sorted({(r["context"], r["batch"]) for r in skipped}) == [(32768, "64"),
                                                                      (131072, "64")]
    assert len(skipped) == 2 * 2 * 2    # per heads and kv
    assert all(r["status"] == "skipped" and "--max-prefill-tokens" in r["reason"]
               for r in skipped)
    assert all((32768, "64") not in e.cells and (131072, "8") in e.cells for e in engines)
    # fill is sized by the engine, so it is never skipped before one starts.
    assert all((131072, "fill") in e.cells for e in engines)


def test_engine_decides_fill_batches_and_skips_what_does_not_fit():
    blocks = vllm_engine.estimated_kv_blocks("fp8_snapmla", 4.0, 4) - 1
    bf16_blocks = vllm_engine.estimated_kv_blocks("auto", 4.0, 4) - 1
    assert 1.75 < blocks / bf16_blocks < 1.76
    snap = bm.decide_cell("fill", 32768, blocks, 64, 163840, 16384, SETTINGS)
    bf16 = bm.decide_cell("fill", 32768, bf16_blocks, 64, 163840, 16384, SETTINGS)
    assert snap["reason"] is None and bf16["reason"] is None
    pages = math.ceil((32768 + snap["max_tokens"]) / 64)
    assert snap["batch_size"] * pages <= blocks < (snap["batch_size"] + 1) * pages
    assert snap["batch_size"] > 1.7 * bf16["batch_size"]
    assert snap["max_tokens"] == (vllm_engine.warm_tokens(snap["batch_size"], 32768, 16384)
                                  + SETTINGS.timed_tokens)
    capped = bm.decide_cell("fill", 512, blocks, 64, 163840, 16384, SETTINGS)
    assert capped["batch_size"] == SETTINGS.max_batch
    # A fixed batch the cache cannot hold, a fill with no room at all, a need above
    # max_model_len, and a fill whose prefill is above the limit.
    too_many = bm.decide_cell("64", 131072, bf16_blocks, 64, 163840, 16384,
                              bm.Settings(max_prefill_tokens=10**9))
    assert "pages of the KV cache" in too_many["reason"]
    none = bm.decide_cell("fill", 131072, 100, 64, 163840, 16384, SETTINGS)
    assert none["batch_size"] == 0 and "holds no request" in none["reason"]
    short = bm.decide_cell("1", 2048, blocks, 64, 2100, 16384, SETTINGS)
    assert "> max_model_len 2100" in short["reason"]
    big_fill = bm.decide_cell("fill", 131072, blocks, 64, 163840, 16384,
                              bm.Settings(max_prefill_tokens=500_000))
    assert "--max-prefill-tokens" in big_fill["reason"]


def test_serve_runs_on_the_wide_engine_or_on_one_of_its_own():
    engines, _ = bm.plan_matrix(["auto", "fp8_snapmla"], [16], [512], ["1"], ["wide", "tight"],
                                ["graph"], SETTINGS, serve=True)
    assert [(e.max_model_len, e.serve, len(e.cells)) for e in engines] == [
        ("wide", True, 1), ("wide", True, 1), ("tight", False, 1), ("tight", False, 1)]
    engines, _ = bm.plan_matrix(["auto", "fp8_snapmla"], [16], [512], ["1"], ["tight"],
                                ["graph"], SETTINGS, serve=True)
    assert [(e.max_model_len, e.serve, len(e.cells)) for e in engines] == [
        ("tight", False, 1), ("tight", False, 1), ("wide", True, 0), ("wide", True, 0)]
    engines, _ = bm.plan_matrix(["auto"], [16, 128], [512], ["1"], ["wide"], ["graph", "eager"],
                                SETTINGS, serve=True, serve_only=True)
    assert [(e.heads, e.mode, e.cells, e.serve) for e in engines] == [
        (16, "graph", [], True), (16, "eager", [], True), (128, "graph", [], True),
        (128, "eager", [], True)]


def test_estimates_grow_with_prefill_and_eager_steps():
    small = bm.estimate_cell_s(16, "graph", "auto", 512, 1, 100)
    assert small < bm.estimate_cell_s(16, "eager", "auto", 512, 1, 100)
    assert small < bm.estimate_cell_s(128, "graph", "auto", 131072, 8, 100)
    # Attention is quadratic in the context.
    long = bm.estimate_cell_s(128, "graph", "auto", 131072, 1, 0) - bm.CELL_OVERHEAD_S
    half = bm.estimate_cell_s(128, "graph", "auto", 65536, 1, 0) - bm.CELL_OVERHEAD_S
    assert long > 3 * half
    engine = bm.Engine("fp8_snapmla", 16, "wide", 163840, "graph", [(512, "1"), (512, "fill")])
    total, decisions = bm.estimate_engine_s(engine, SETTINGS)
    assert total == pytest.approx(bm.ENGINE_START_S["graph"]
                                  + sum(d["estimated_s"] for d in decisions))


def test_prefill_cost_counts_the_projections_that_grow_with_the_heads():
    # 16 heads by hand: MLP 3 x 7168 x 2048, q_a 7168 x 1536, q_b 1536 x 16 x 192,
    # kv_a 7168 x 576, kv_b 512 x 16 x 256, o 16 x 128 x 7168; four layers.
    by_hand = 4 * (3 * 7168 * 2048 + 7168 * 1536 + 1536 * 16 * 192 + 7168 * 576
                   + 512 * 16 * 256 + 16 * 128 * 7168)
    assert bm.prefill_weights_per_token(16) == by_hand
    grown = bm.prefill_weights_per_token(128) - bm.prefill_weights_per_token(16)
    assert grown == 4 * 112 * (1536 * 192 + 512 * 256 + 128 * 7168)


def test_time_model_is_pessimistic_but_not_far_off_on_the_measured_cells():
    """Every cell measured on the H200 (benchmarks/results/matrix.csv) is estimated at no less
    than its time, and at most 4x it: a budget-cut sweep neither overruns nor leaves most of
    its time unused."""
    _, measured_rows = vllm_engine.read_csv(_ROOT / "benchmarks/results/matrix.csv")
    rows = [r for r in measured_rows
            if r["status"] == "ok" and r.get("cell_s")]
    assert rows
    for r in rows:
        estimate = bm.estimate_cell_s(int(r["heads"]), r["mode"], r["kv"], int(r["context"]),
                                      int(r["batch_size"]), int(r["max_tokens"]))
        measured = float(r["cell_s"])
        assert measured <= estimate <= 4 * measured, (r["kv"], r["context"], measured, estimate)


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_matrix", "--dry-run",
                           "--out", str(tmp_path / "m"), "--heads", "16", "--kv", "auto",
                           "fp8_snapmla", "--contexts", "512", "131072", "--batches", "1", "64",
                           "--max-model-len", "wide", "--modes", "eager"],
                          capture_output=True, text=True, timeout=300, cwd=_ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "2 engines (0 graph, 2 eager), 6 cells" in proc.stdout
    assert "2 cell rows skipped now by --max-prefill-tokens" in proc.stdout
    assert "[1] auto H=16 wide (163840 tokens, 2560 pages) eager" in proc.stdout
    # Each engine's cells, per context: the fixed batches' estimates (64 x 128k is above
    # --max-prefill-tokens and not planned).
    assert re.search(r"context 512: 1: ~[\d.]+ s, 64: ~[\d.]+ s\n", proc.stdout)
    assert re.search(r"context 131072: 1: ~[\d.]+ s\n", proc.stdout)
    assert not (tmp_path / "m").exists()


def test_dry_run_cells_name_the_fill_batch_and_the_skip_reason():
    engine = bm.Engine("fp8_snapmla", 16, "wide", 163840, "graph",
                       [(512, "fill"), (512, "8"), (2048, "1")])
    decisions = [{"batch_size": 96, "reason": None, "estimated_s": 3.26},
                 {"batch_size": 8, "reason": None, "estimated_s": 0.74},
                 {"batch_size": 1, "reason": "context 2048 + 600 generated tokens > "
                                                "max_model_len 2048"}]
    assert bm.dry_run_cells(engine, decisions) == [
        "      context 512: fill (B=96): ~3.3 s, 8: ~0.7 s",
        "      context 2048: 1: skipped (context 2048 + 600 generated tokens > max_model_len "
        "2048)"]


def test_bad_batch_is_refused():
    with pytest.raises(ValueError):
        bm.parse_batch("0")
    assert bm.parse_batch("fill") == "fill" and bm.parse_batch("64") == "64"


# --- continuous batching -------------------------------------------------------------------

def test_workload_is_seeded_poisson_with_lengths_in_range():
    workload = bm.serve_workload(4000, 5.0, (256, 8192), (32, 512), seed=7)
    assert workload == bm.serve_workload(4000, 5.0, (256, 8192), (32, 512), seed=7)
    assert workload != bm.serve_workload(4000, 5.0, (256, 8192), (32, 512), seed=8)
    arrivals = [a for a, _, _ in workload]
    assert arrivals == sorted(arrivals)
    assert 4000 / arrivals[-1] == pytest.approx(5.0, rel=0.08)
    prompts = [p for _, p, _ in workload]
    assert min(prompts) >= 256 and max(prompts) <= 8192
    assert all(32 <= o <= 512 for _, _, o in workload)
    # Log-uniform: the median is near the geometric mean of the range.
    assert sorted(prompts)[2000] == pytest.approx(math.sqrt(256 * 8192), rel=0.15)


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        assert seconds >= 0
        self.now += seconds


class _Out:
    def __init__(self, request_id, tokens, stamp, finished):
        self.request_id, self.finished = request_id, finished
        self.outputs = [type("Completion", (), {"token_ids": [3] * tokens})()]
        self.metrics = type("Stats", (), {"last_token_ts": stamp})()


class _ServeEngine:
    """A request added at time t gets its first token at the end of the first step after it
    (that step takes prefill_s), then one per step of step_s; DELTA outputs with the core's
    timestamp; params = the request's output length."""

    def __init__(self, clock, step_s=0.01, prefill_s=0.05):
        self.clock, self.step_s, self.prefill_s = clock, step_s, prefill_s
        self.requests, self.added_at, self.aborted = {}, {}, []

    def add_request(self, request_id, prompt, params):
        self.requests[request_id] = [0, params]
        self.added_at[request_id] = self.clock()

    def has_unfinished_requests(self):
        return any(n < limit for n, limit in self.requests.values())

    def abort_request(self, ids):
        self.aborted += ids
        for request_id in ids:
            self.requests[request_id][0] = self.requests[request_id][1]

    def step(self):
        live = [r for r, (n, limit) in self.requests.items() if n < limit]
        prefill = any(self.requests[r][0] == 0 for r in live)
        self.clock.now += self.prefill_s if prefill else self.step_s
        outputs = []
        for r in live:
            self.requests[r][0] += 1
            n, limit = self.requests[r]
            outputs.append(_Out(r, 1, self.clock.now, n == limit))
        return outputs


def test_serve_adds_requests_at_their_arrival_and_records_core_token_times():
    clock = _Clock()
    engine = _ServeEngine(clock)
    workload = [(0.0, 300, 5), (0.5, 300, 3), (2.0, 300, 4)]
    requests = [(a, {"prompt_token_ids": [2] * p}, o) for a, p, o in workload]
    start, records = bm.run_serve(engine, requests, clock=clock, sleep=clock.sleep)
    assert start == 100.0
    for (arrival, _, out), record, request_id in zip(workload, records, engine.added_at):
        assert engine.added_at[request_id] >= start + arrival   # never before its arrival
        assert engine.added_at[request_id] < start + arrival + 0.06
        assert record["arrival"] == start + arrival and len(record["tokens"]) == out
    # The first request alone: prefill step, then 4 decode steps.
    assert records[0]["tokens"] == pytest.approx([100.05, 100.06, 100.07, 100.08, 100.09])
    summary = bm.serve_summary(start, records, [o for _, _, o in workload])
    assert summary["requests"] == 3 and summary["completed"] == 3
    assert summary["output_tokens"] == 12
    assert summary["ttft_p50_ms"] == pytest.approx(50.0, abs=0.5)
    assert summary["tpot_p50_ms"] == pytest.approx(10.0, abs=0.01)
    last = max(r["tokens"][-1] for r in records)
    assert summary["output_tok_s"] == pytest.approx(12 / (last - 100.0), abs=0.05)   # 0.1 tok/s


def test_serve_stops_at_the_deadline_and_counts_only_completed_requests():
    clock = _Clock()
    engine = _ServeEngine(clock)
    requests = [(0.0, {}, 1000), (0.0, {}, 2)]
    start, records = bm.run_serve(engine, requests, clock=clock, sleep=clock.sleep,
                                  stop_at=100.5)
    assert engine.aborted == ["serve-0"]
    assert 0 < len(records[0]["tokens"]) < 1000 and len(records[1]["tokens"]) == 2
    assert bm.serve_summary(start, records, [1000, 2])["completed"] == 1


def test_serve_statistics_from_synthetic_token_times():
    rng = random.Random(11)
    records, ttfts, tpots = [], [], []
    for i in range(101):
        arrival, ttft, tpot = i * 0.1, rng.uniform(0.05, 2.0), rng.uniform(0.005, 0.05)
        count = rng.randint(2, 50)
        records.append({"arrival": arrival,
                        "tokens": [arrival + ttft + k * tpot for k in range(count)]})
        ttfts.append(ttft)
        tpots.append(tpot)
    records.append({"arrival": 20.0, "tokens": []})   # never got a token: not in TTFT/TPOT
    summary = bm.serve_summary(0.0, records, [2] * 102)
    numpy = pytest.importorskip("numpy")
    assert summary["ttft_p50_ms"] == pytest.approx(1000 * numpy.percentile(ttfts, 50), abs=0.01)
    assert summary["ttft_p99_ms"] == pytest.approx(1000 * numpy.percentile(ttfts, 99), abs=0.01)
    assert summary["tpot_p50_ms"] == pytest.approx(1000 * numpy.percentile(tpots, 50), abs=1e-3)
    assert summary["tpot_p99_ms"] == pytest.approx(1000 * numpy.percentile(tpots, 99), abs=1e-3)
    assert summary["completed"] == 101 and summary["requests"] == 102
    assert bm.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert bm.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    with pytest.raises(ValueError):
        bm.serve_summary(0.0, [{"arrival": 0.0, "tokens": []}], [1])


# --- results -------------------------------------------------------------------------------

INFO = {"date": "2026-12-03 10:00 UTC", "commit": "abc1234", "gpu": "NVIDIA H200",
        "vllm": "0.26.0", "command": "python -m benchmarks.bench_matrix --heads 16"}


def _cell(kv, tok_s, context=512, batch="64", heads=16, mml="wide", mode="graph", **extra):
    row = {"heads": heads, "max_model_len": mml, "mode": mode, "context": context,
           "batch": batch, "kv": kv, "status": "ok", "batch_size": 64,
           "max_model_len_tokens": 163840, "table_width": 2560, "decode_tok_s": tok_s,
           "tpot_ms": 64000 / tok_s, "lock_step": True, "timing_ok": True, "spread_pct": 1.0}
    row.update(extra)
    return row


def _sweep():
    rows = []
    for mode in ("graph", "eager"):
        for context in (512, 8192):
            for batch in ("1", "fill"):
                base = 1000.0 * (2 if mode == "graph" else 1)
                rows += [_cell("auto", base, context, batch, mode=mode),
                         _cell("fp8_snapmla", base * (0.7 if context == 512 else 1.4), context,
                               batch, mode=mode),
                         _cell("fp8", base * 1.1, context, batch, mode=mode)]
    return rows


def test_outputs_merge_runs_replace_cells_and_compute_ratios(tmp_path):
    rows = _sweep()
    bm.write_outputs(tmp_path, INFO, rows[:12], run_fields=bm.run_fields_of())
    second = {**INFO, "commit": "def5678", "command": "python -m benchmarks.bench_matrix x"}
    skipped = {"heads": 16, "max_model_len": "wide", "mode": "eager", "context": 131072,
               "batch": "64", "kv": "auto", "status": "skipped",
               "reason": "prefill 64 x 131072 = 8,388,608 tokens > --max-prefill-tokens"}
    matrix, _ = bm.write_outputs(tmp_path, second, rows[12:] + [skipped],
                                 run_fields=bm.run_fields_of())
    assert len(matrix) == 25
    runs, on_disk = vllm_engine.read_csv(tmp_path / "matrix.csv")
    assert runs == [bm.describe(INFO), bm.describe(second)]
    assert [bm.matrix_key(r) for r in on_disk] == [bm.matrix_key(r) for r in matrix]
    assert on_disk[0]["commit"] == "abc1234" and on_disk[-1]["commit"] == "def5678"
    snap = [r for r in on_disk if r["kv"] == "fp8_snapmla"]
    assert {float(r["vs_bf16"]) for r in snap if r["context"] == "512"} == {0.7}
    assert {float(r["vs_bf16"]) for r in snap if r["context"] == "8192"} == {1.4}
    assert all(float(r["tpot_vs_bf16"]) == pytest.approx(1 / 1.4, abs=1e-3)
               for r in snap if r["context"] == "8192")
    # Re-running a cell replaces its row; a failure has no ratio.
    failed = _cell("fp8_snapmla", 1.0, 8192, "1", mode="eager", status="failed",
                   reason="exit 1: CUDA error")
    matrix, _ = bm.write_outputs(tmp_path, INFO, [failed], run_fields=bm.run_fields_of())
    assert len(matrix) == 25
    row = next(r for r in matrix if bm.matrix_key(r) == bm.matrix_key(failed))
    assert row["status"] == "failed" and row["vs_bf16"] == ""
    # A later run that skips cells (its budget ran out) keeps what earlier runs measured there,
    # a failure included; a cell that no run measured gets the skip.
    later = {**INFO, "commit": "0a1b2c3", "command": "python -m benchmarks.bench_matrix y"}
    budget = "--budget-s: engine start + first cell ~34 s, 0 s left"
    ok_cell = next(r for r in matrix if r["status"] == "ok" and r["kv"] == "fp8_snapmla"
                   and str(r["context"]) == "8192")
    new_cell = {**skipped, "context": 32768, "batch": "8", "kv": "fp8_snapmla"}
    skips = [{**r, "status": "skipped", "reason": budget, "tpot_ms": "", "decode_tok_s": ""}
             for r in (ok_cell, failed, new_cell)]
    matrix, _ = bm.write_outputs(tmp_path, later, skips, run_fields=bm.run_fields_of())
    by_key = {bm.matrix_key(r): r for r in matrix}
    assert len(matrix) == 26
    assert by_key[bm.matrix_key(ok_cell)]["status"] == "ok"
    assert by_key[bm.matrix_key(ok_cell)]["vs_bf16"] == ok_cell["vs_bf16"]
    assert by_key[bm.matrix_key(failed)]["status"] == "failed"
    assert by_key[bm.matrix_key(new_cell)]["status"] == "skipped"
    assert by_key[bm.matrix_key(new_cell)]["commit"] == "0a1b2c3"
    # A skip for another reason is this run's finding about the cell: it replaces the row.
    capacity = {**skips[0], "reason": "batch 64 x 8211 pages > the 58253 pages of the KV cache"}
    matrix, _ = bm.write_outputs(tmp_path, later, [capacity], run_fields=bm.run_fields_of())
    row = next(r for r in matrix if bm.matrix_key(r) == bm.matrix_key(ok_cell))
    assert row["status"] == "skipped" and row["reason"] == capacity["reason"]
    table = (tmp_path / "matrix.md").read_text()
    assert bm.describe(INFO) in table and bm.describe(second) in table
    assert "## H=16 (one TP8 rank of DeepSeek-V3.1), max_model_len wide, graph" in table
    assert "## H=16 (one TP8 rank of DeepSeek-V3.1), max_model_len wide, eager" in table
    line = next(ln for ln in table.splitlines()
                if ln.startswith("| 512 | fill |") and "2,000" in ln)
    assert "**0.70x** ▼" in line and "| 1.10x |" in line
    # The failure kept from the first run, beside the BF16 row of another, names its run.
    assert "fp8_snapmla failed (2026-12-03 10:00 UTC, abc1234): exit 1: CUDA error" in table
    assert "BF16 skipped: prefill 64 x 131072" in table
    assert table.count("x** ▼") == 4   # the four cells at 512 tokens


def test_no_ratio_where_a_side_was_not_lock_step():
    for flag in (False, "False"):   # a fresh row, or one read back from the CSV
        rows = bm.add_ratios([_cell("auto", 100.0, lock_step=flag), _cell("fp8_snapmla", 150.0)])
        assert rows[1]["vs_bf16"] == "" and rows[1]["tpot_vs_bf16"] == ""
        rows = bm.add_ratios([_cell("auto", 100.0), _cell("fp8_snapmla", 150.0, lock_step=flag)])
        assert rows[1]["vs_bf16"] == "" and rows[0]["vs_bf16"] == 1.0
    rows = bm.add_ratios([_cell("auto", 100.0), _cell("fp8_snapmla", 150.0)])
    assert rows[1]["vs_bf16"] == 1.5


def test_ratios_only_within_one_run():
    """A BF16 row another command measured (another date or commit: maybe another budget or
    GPU) is no baseline; the matrix's and the serve rows' ratios alike."""
    run_a = {"date": "2026-12-03 22:24 UTC", "commit": "aaa"}
    run_b = {"date": "2026-12-04 09:10 UTC", "commit": "bbb"}
    rows = bm.add_ratios([_cell("auto", 100.0, **run_a), _cell("fp8_snapmla", 300.0, **run_b)])
    assert rows[1]["vs_bf16"] == "" and rows[1]["tpot_vs_bf16"] == ""
    rows = bm.add_ratios([_cell("auto", 100.0, **run_b), _cell("fp8_snapmla", 300.0, **run_b)])
    assert rows[1]["vs_bf16"] == 3.0
    # matrix.md says why the cell has no ratio.
    rows = bm.add_ratios([_cell("auto", 100.0, **run_a), _cell("fp8_snapmla", 300.0, **run_b)])
    line = next(ln for ln in bm.format_matrix(rows, []).splitlines() if ln.startswith("| 512 |"))
    assert "fp8_snapmla from another run (2026-12-04 09:10 UTC, bbb): no ratio" in line
    assert "from another run" not in bm.format_matrix(bm.add_ratios(
        [_cell("auto", 100.0, **run_b), _cell("fp8_snapmla", 300.0, **run_b)]), [])
    serve = [{"heads": 16, "mode": "graph", "kv": kv, "status": "ok", "output_tok_s": tok_s,
              **run} for kv, tok_s, run in (("auto", 100.0, run_a), ("fp8_snapmla", 90.0, run_b))]
    assert bm.add_serve_ratios(serve)[1]["vs_bf16"] == ""
    serve[0].update(run_b)
    assert bm.add_serve_ratios(serve)[1]["vs_bf16"] == 0.9
    # The TPOT ratio: BF16's median over ours.
    serve[0]["tpot_p50_ms"], serve[1]["tpot_p50_ms"] = 6.0, 4.0
    assert bm.add_serve_ratios(serve)[1]["tpot_p50_vs_bf16"] == 1.5


def test_a_cell_of_several_runs_compares_the_runs_both_formats_measured():
    """A round one format lost to the budget weighs on neither side: the ratio takes the medians
    of the runs both measured, while each row keeps its own median TPOT."""
    def combined(kv, tpots):   # a cell's rows of three rounds (None: skipped for time)
        runs = [_cell(kv, 64000 / (t or 1.0), batch="fill", repeat=k)
                for k, t in enumerate(tpots, 1)]
        for run, t in zip(runs, tpots):
            if t is None:
                run.update(status="skipped", reason="--budget-s: needs ~3 s, 0 s left")
        return bm.combine_repeats(runs)

    bf16 = combined("auto", [16.0, None, None])
    ours = combined("fp8_snapmla", [15.8, 13.6, None])
    assert ours["tpot_ms"] == 14.7   # its own two rounds
    rows = bm.add_ratios([bf16, ours])
    assert rows[1]["vs_bf16"] == round(16.0 / 15.8, 3)   # round 1 against round 1
    assert rows[1]["tpot_vs_bf16"] == round(15.8 / 16.0, 3)
    assert rows[1]["vs_bf16_runs"] == "1.013 - -"
    # Runs measured by both alike: the rows' own medians, as with a single run.
    bf16, ours = combined("auto", [16.0, 12.0, 14.0]), combined("fp8_snapmla", [15.0, 13.0, 9.0])
    assert bm.add_ratios([bf16, ours])[1]["vs_bf16"] == round(14.0 / 13.0, 3)
    # No run in common: no ratio.
    bf16, ours = combined("auto", [16.0, None]), combined("fp8_snapmla", [None, 13.0])
    assert bm.add_ratios([bf16, ours])[1]["vs_bf16"] == ""


def test_repeats_combine_into_the_median_tpot_with_the_runs_listed():
    runs = [_cell("fp8_snapmla", 64000 / t, repeat=k, spread_pct=s)
            for k, (t, s) in enumerate([(5.0, 1.0), (4.0, 7.0), (6.0, 2.0)], 1)]
    row = bm.combine_repeats(runs)
    assert row["tpot_ms"] == 5.0 and row["decode_tok_s"] == pytest.approx(64 * 1000 / 5.0)
    assert row["repeats"] == 3 and row["repeat_tpot_ms"] == "5.000 4.000 6.000"
    assert row["repeat_spread_pct"] == 40.0 and row["spread_pct"] == 7.0
    assert row["lock_step"] is True and row["timing_ok"] is True
    # A run that failed is left out and named; one not lock-step spoils the row's ratio.
    runs[2].update(status="failed", reason="exit 1")
    runs[1]["lock_step"] = "False"
    row = bm.combine_repeats(runs)
    assert row["tpot_ms"] == 4.5 and row["repeats"] == 2
    assert row["repeat_tpot_ms"] == "5.000 4.000 -"   # aligned with the passes
    assert row["reason"] == "1 of 3 runs failed: exit 1" and row["lock_step"] is False
    runs[0].update(status="skipped", reason="--budget-s")
    runs[1].update(status="failed", reason="exit 2")
    row = bm.combine_repeats(runs)
    assert row["status"] == "failed" and row["reason"] == "exit 1" and row["repeats"] == 0


def test_outputs_with_repeats_keep_every_run_and_put_medians_in_the_matrix(tmp_path):
    tpots = {"auto": (4.0, 5.0, 4.6), "fp8_snapmla": (5.2, 4.1, 4.4)}
    for k in range(3):
        rows = [_cell(kv, 64000 / t[k], mode="eager", repeat=k + 1) for kv, t in tpots.items()]
        matrix, _ = bm.write_outputs(tmp_path, INFO, rows, repeats=3, run_fields=bm.run_fields_of())
    assert len(matrix) == 2
    _, every = vllm_engine.read_csv(tmp_path / "repeats.csv")
    assert sorted((r["kv"], r["repeat"]) for r in every) == sorted(
        (kv, str(k)) for kv in tpots for k in (1, 2, 3))
    ours = next(r for r in matrix if r["kv"] == "fp8_snapmla")
    assert ours["tpot_ms"] == 4.4 and ours["repeats"] == 3
    assert ours["vs_bf16"] == pytest.approx(4.6 / 4.4, abs=1e-3)   # medians, not one run's
    # Each pass of the plan against BF16's of the same pass: 4.0/5.2, 5.0/4.1, 4.6/4.4.
    assert ours["vs_bf16_runs"] == "0.769 1.220 1.045"
    assert bm.ratio_range(ours) == (0.769, 1.22)
    table = (tmp_path / "matrix.md").read_text()
    assert "runs' TPOT ms: BF16 4.000/5.000/4.600, fp8_snapmla 5.200/4.100/4.400" in table
    assert "| 1.04x ≈ (runs 0.77-1.22) |" in table   # runs on both sides of 1.0x
    # Another command's runs are combined apart from this one's.
    later = {**INFO, "date": "2026-12-04 10:00 UTC"}
    matrix, _ = bm.write_outputs(tmp_path, later, [_cell("auto", 64000 / 9.0, mode="eager",
                                                         repeat=1)], repeats=2,
                                 run_fields=bm.run_fields_of())
    assert next(r for r in matrix if r["kv"] == "auto")["tpot_ms"] == 9.0


@pytest.mark.parametrize("runs, median, text", [
    ("0.940 0.950 0.990", 0.95, "| **0.95x** ▼ (runs 0.94-0.99) |"),   # slower in every run
    ("0.710 1.160 0.870", 0.87, "| **0.87x** ≈ (runs 0.71-1.16) |"),   # the runs disagree
    ("1.120 0.940 1.080", 1.08, "| 1.08x ≈ (runs 0.94-1.12) |"),
    ("1.000 1.200 1.100", 1.10, "| 1.10x (runs 1.00-1.20) |"),          # 1.0x is not slower
])
def test_cells_whose_runs_disagree_are_marked_apart_from_slower_ones(runs, median, text):
    ours = {**_cell("fp8_snapmla", 64000 / 4.0), "vs_bf16": median, "vs_bf16_runs": runs}
    assert bm.within_spread(ours) == ("≈" in text)
    table = bm.format_matrix([_cell("auto", 64000 / 4.0), ours], ["run"])
    assert text in table, table


def test_a_pass_skipped_by_the_budget_leaves_a_gap_in_the_per_run_ratios(tmp_path):
    # --budget-s skips the last format's second pass: its runs read "t -", and the ratios of
    # the pass that measured are still given (a "-" there once made the merge raise).
    for k, status in enumerate(("ok", "skipped"), 1):
        rows = [_cell("auto", 64000 / (4.0 + k), repeat=k),
                {**_cell("fp8_snapmla", 64000 / 3.0, repeat=k), "status": status}]
        matrix, _ = bm.write_outputs(tmp_path, INFO, rows, repeats=2, run_fields=bm.run_fields_of())
    ours = next(r for r in matrix if r["kv"] == "fp8_snapmla")
    assert ours["repeat_tpot_ms"] == "3.000 -" and ours["repeats"] == 1
    assert ours["vs_bf16_runs"] == "1.667 -"
    assert bm.ratio_range(ours) is None   # one measured pass is no range


def test_heat_maps_have_a_panel_per_heads_table_and_mode(tmp_path):
    pytest.importorskip("matplotlib")
    rows = bm.add_ratios(_sweep() + [_cell("auto", 50.0, heads=128, mml="tight")])
    titles = bm.plot_matrix(rows, tmp_path / "m.png", "title")
    assert titles == ["H=16, wide, graph", "H=16, wide, eager", "H=128, tight, graph"]
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert bm.plot_matrix([], tmp_path / "none.png", "t") == []


def test_heat_map_panels_from_several_commits_name_them(tmp_path):
    # A folder merges runs of different commits; the figure's title names one run only if
    # there is one, and each panel then says which commits its cells are from.
    pytest.importorskip("matplotlib")
    old = [{**r, "commit": "aaa1111"} for r in _sweep()]
    new = [{**_cell(kv, tok_s, heads=128, mml="tight"), "commit": "bbb2222"}
           for kv, tok_s in (("auto", 50.0), ("fp8_snapmla", 60.0))]
    titles = bm.plot_matrix(bm.add_ratios(old + new), tmp_path / "m.png", "title")
    assert titles == ["H=16, wide, graph\nat aaa1111", "H=16, wide, eager\nat aaa1111",
                      "H=128, tight, graph\nat bbb2222"]
    one = bm.plot_matrix(bm.add_ratios(old), tmp_path / "one.png", "title")
    assert one == ["H=16, wide, graph", "H=16, wide, eager"]
    runs = ["2026-12-03 10:00 UTC | commit aaa1111 | NVIDIA H100 | vLLM 0.26.0 | cmd a",
            "2026-12-05 09:00 UTC | commit bbb2222 | NVIDIA H200 | vLLM 0.26.0 | cmd b"]
    assert bm.plot_runs_line(runs[:1]) == runs[0]
    assert bm.plot_runs_line(runs) == ("2 runs, 2026-12-03 10:00 UTC to 2026-12-05 09:00 UTC, "
                                       "NVIDIA H100, NVIDIA H200 (matrix.md lists each run's "
                                       "commit and command)")
    assert bm.plot_runs_line([]) == ""


def test_serve_rows_merge_with_ratios_and_a_table(tmp_path):
    serve = [{"heads": 16, "mode": "graph", "kv": kv, "status": "ok", "requests": 96,
              "completed": 96, "rate": 3.0, "output_tok_s": tok_s, "ttft_p50_ms": 80.0,
              "ttft_p99_ms": 400.0, "tpot_p50_ms": 9.0, "tpot_p99_ms": 20.0}
             for kv, tok_s in (("fp8", 900.0), ("auto", 1000.0), ("fp8_snapmla", 1200.0))]
    _, rows = bm.write_outputs(tmp_path, INFO, serve_rows=serve, run_fields=bm.run_fields_of())
    assert [r["kv"] for r in rows] == ["auto", "fp8_snapmla", "fp8"]
    assert [r["vs_bf16"] for r in rows] == [1.0, 1.2, 0.9]
    table = (tmp_path / "serve.md").read_text()
    assert bm.describe(INFO) in table and "**0.90x** ▼" in table and "1.20x" in table
    assert not (tmp_path / "matrix.csv").exists()


def test_engine_rows_mark_cells_without_a_result():
    engine = bm.Engine("fp8", 128, "tight", 8576, "eager", [(8192, "1"), (8192, "fill")],
                       serve=True)
    results = [{"kind": "engine", "kv_cache_tokens": 7000000, "block_size": 64},
               {"kind": "cell", "context": 8192, "batch": "1", "status": "ok",
                "decode_tok_s": 10.0}]
    matrix, serve = bm.engine_rows(engine, results, "timed out after 60 s",
                                   {"backend": "FLASHMLA", "log_kv_cache_tokens": 7000000})
    assert matrix[0]["status"] == "ok" and matrix[0]["table_width"] == 134
    assert "reason" not in matrix[0] and matrix[0]["backend"] == "FLASHMLA"
    assert matrix[1]["status"] == "failed" and matrix[1]["reason"] == "timed out after 60 s"
    assert matrix[1]["kv_cache_tokens"] == 7000000
    assert serve[0]["status"] == "failed" and serve[0]["heads"] == 128
    # The table's width in the engine's own pages: FlashAttention MLA (BF16's default) uses 16.
    bf16 = bm.Engine("auto", 16, "wide", 163840, "graph", [(512, "64")])
    matrix, _ = bm.engine_rows(bf16, [{"kind": "engine", "kv_cache_tokens": 932064,
                                       "block_size": 16}], None, {})
    assert matrix[0]["block_size"] == 16 and matrix[0]["table_width"] == 10240
    # An engine that never started (its cells skipped or failed) has no known block size: no
    # table width is made up for it (a BF16 engine's was once given in our 64-token pages).
    skipped = [{"kind": "cell", "context": 512, "batch": "64", "status": "skipped",
                "reason": "--budget-s: engine start + first cell ~34 s, 0 s left"}]
    matrix, _ = bm.engine_rows(bf16, skipped, None, {})
    assert matrix[0]["status"] == "skipped"
    assert matrix[0]["block_size"] == "" and matrix[0]["table_width"] == ""


def test_replot_redraws_md_and_png_from_the_csvs(tmp_path):
    pytest.importorskip("matplotlib")
    bm.write_outputs(tmp_path, INFO, _sweep(), run_fields=bm.run_fields_of())
    (tmp_path / "matrix.md").unlink()
    (tmp_path / "matrix.png").unlink()
    before = (tmp_path / "matrix.csv").read_text()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_matrix", "--replot", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=_ROOT)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "**0.70x** ▼" in (tmp_path / "matrix.md").read_text()
    assert (tmp_path / "matrix.csv").read_text() == before   # no run added by a replot
    empty = subprocess.run([sys.executable, "-m", "benchmarks.bench_matrix", "--replot",
                            "--out", str(tmp_path / "nothing")], capture_output=True, text=True,
                           timeout=300, cwd=_ROOT)
    assert empty.returncode != 0 and "no matrix.csv" in empty.stderr


def _fake_engine(k: int, start_s: float, log: list, fail_before_up: bool = False):
    """A launch for run_engines_together: 'starts up' for start_s, reports up, waits for its go
    file as the child does, then 'measures' for 20 ms; records each event with its time."""
    import time

    def run(go_file, on_up):
        time.sleep(start_s)
        if fail_before_up:
            log.append(("died", k, time.monotonic()))
            return ("failed", k)
        log.append(("up", k, time.monotonic()))
        on_up()
        vllm_engine.wait_for_go(go_file, poll_s=0.005)
        log.append(("measure", k, time.monotonic()))
        time.sleep(0.02)
        log.append(("done", k, time.monotonic()))
        return ("ok", k)
    return run


def test_concurrent_starts_overlap_start_ups_and_measure_one_engine_at_a_time(tmp_path):
    import time

    log: list = []
    # Engine 0 starts up slowest: nobody may measure before it is up.
    starts = [0.4, 0.25, 0.3, 0.2]
    began = time.monotonic()
    outcomes = vllm_engine.run_engines_together(
        [_fake_engine(k, s, log) for k, s in enumerate(starts)], tmp_path)
    assert outcomes == [("ok", k) for k in range(4)]
    # The start-ups overlapped: the whole group took about the slowest start, not the sum.
    assert max(t for e, _, t in log if e == "up") - began < sum(starts)
    last_up = max(t for e, _, t in log if e == "up")
    measures = [(k, t) for e, k, t in log if e == "measure"]
    assert [k for k, _ in measures] == [0, 1, 2, 3]             # in plan order
    assert all(t >= last_up for _, t in measures)               # after every start-up
    done = {k: t for e, k, t in log if e == "done"}
    for (k, t), (_, t_next) in zip(measures, measures[1:]):
        assert done[k] <= t_next                                # never two at once


def test_an_engine_that_dies_at_start_does_not_hold_the_others(tmp_path):
    log: list = []
    outcomes = vllm_engine.run_engines_together(
        [_fake_engine(0, 0.01, log, fail_before_up=True), _fake_engine(1, 0.03, log)], tmp_path)
    assert outcomes == [("failed", 0), ("ok", 1)]
    assert [k for e, k, _ in log if e == "measure"] == [1]


def test_a_launch_that_raises_is_reraised_after_the_others_end(tmp_path):
    log: list = []

    def broken(go_file, on_up):
        raise RuntimeError("launch broke")

    with pytest.raises(RuntimeError, match="launch broke"):
        vllm_engine.run_engines_together([broken, _fake_engine(1, 0.01, log)], tmp_path)
    assert [e for e, k, _ in log if k == 1] == ["up", "measure", "done"]


def _fake_turns_engine(k: int, cells: int, log: list, start_s: float = 0.01,
                       die_at: int | None = None, serve: bool = False, hang_at: int | None = None,
                       exit_s: float = 0.05):
    """A launch for run_engines_together(in_turns=True) whose child runs bench_matrix's
    measure_in_turns: each cell (and the serve run) 'measures' for 20 ms (``hang_at``: 0.6 s),
    with ``die_at`` it ends before that cell; its exit (vLLM's shutdown) takes ``exit_s``."""
    import time

    def measure(name):
        log.append(("measure", k, name, time.monotonic()))
        time.sleep(0.6 if name == hang_at else 0.02)
        log.append(("done", k, name, time.monotonic()))
        return {"kind": "cell", "k": k, "name": name}

    def run(go_file, on_up):
        spec = {**vllm_engine.concurrent_start_spec(go_file, 2, in_turns=True),
                "cells": [(512, str(turn)) for turn in range(cells)],
                "serve": {"workload": []} if serve else None}
        time.sleep(start_s)
        on_up()
        results = []
        for result in bm.measure_in_turns(spec, lambda context, label, _round: measure(int(label)),
                                          lambda: measure("serve")):
            results.append(result)
            if len(results) == die_at:
                return ("died", k)
        log.append(("exit", k, None, time.monotonic()))
        time.sleep(exit_s)
        log.append(("exited", k, None, time.monotonic()))
        return ("ok", k)
    return run


def test_engines_in_turns_measure_each_cell_on_every_engine_before_the_next(tmp_path):
    log: list = []
    # Engine 1 comes up last and also runs the serve workload; engine 2 has one cell fewer;
    # engine 3 dies after its first cell.
    launches = [_fake_turns_engine(0, 3, log), _fake_turns_engine(1, 3, log, start_s=0.2,
                                                                  serve=True),
                _fake_turns_engine(2, 2, log), _fake_turns_engine(3, 3, log, die_at=1)]
    outcomes = vllm_engine.run_engines_together(launches, tmp_path, in_turns=True)
    assert outcomes == [("ok", 0), ("ok", 1), ("ok", 2), ("died", 3)]
    measures = [(k, name) for e, k, name, _ in log if e == "measure"]
    assert measures == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (0, 2), (1, 2),
                        (1, "serve")]
    # Never two measurements at once, and none during another engine's exit (vLLM's shutdown):
    # an engine's last turn ends with its process, not with its last result.
    ends = {"measure": "done", "exit": "exited"}
    spans = [(t, next(t2 for e2, k2, n2, t2 in log if (e2, k2, n2) == (ends[e], k, name)), k)
             for e, k, name, t in log if e in ends]
    assert len(spans) == 10 + 3
    for start, end, k in spans:
        for start2, end2, k2 in spans:
            if (start, k) != (start2, k2):
                assert end <= start2 or end2 <= start, (k, k2)


def test_turn_order_moves_on_by_one_engine_every_rotate_every_turns(tmp_path):
    log: list = []
    # Rounds of two turns; engine 2 has one turn fewer.
    launches = [_fake_turns_engine(0, 4, log), _fake_turns_engine(1, 4, log),
                _fake_turns_engine(2, 3, log)]
    outcomes = vllm_engine.run_engines_together(launches, tmp_path, in_turns=True,
                                                rotate_every=2)
    assert outcomes == [("ok", 0), ("ok", 1), ("ok", 2)]
    measures = [(k, name) for e, k, name, _ in log if e == "measure"]
    assert measures == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1),
                        (1, 2), (2, 2), (0, 2), (1, 3), (0, 3)]


def test_an_engine_that_overruns_its_turn_gets_no_more_turns(tmp_path):
    import time

    log: list = []
    began = time.monotonic()
    launches = [_fake_turns_engine(0, 3, log, hang_at=1), _fake_turns_engine(1, 3, log)]
    outcomes = vllm_engine.run_engines_together(launches, tmp_path, in_turns=True,
                                                turn_limit_s=0.2)
    measures = [(k, name) for e, k, name, _ in log if e == "measure"]
    # Engine 1 goes on once engine 0's second cell overran; engine 0 measures its last cell
    # after engine 1 has ended.
    assert measures == [(0, 0), (1, 0), (0, 1), (1, 1), (1, 2), (0, 2)]
    t_hang = next(t for e, k, name, t in log if (e, k, name) == ("done", 0, 1))
    t_next = next(t for e, k, name, t in log if (e, k, name) == ("measure", 1, 1))
    assert t_next < t_hang and t_next - began < 0.6
    assert outcomes == [("ok", 0), ("ok", 1)]


def test_wait_for_go_returns_at_once_without_a_file_and_waits_for_it_otherwise(tmp_path):
    import threading

    assert vllm_engine.wait_for_go(None) == 0.0
    go = tmp_path / "go"
    threading.Timer(0.1, go.touch).start()
    assert vllm_engine.wait_for_go(str(go), poll_s=0.01) >= 0.09


def test_total_estimate_counts_one_start_up_per_group():
    settings = bm.Settings()
    engines, _ = bm.plan_matrix(["auto", "fp8_snapmla", "fp8"], [16], [8192], ["8"], ["wide"],
                                ["graph"], settings, False, False)
    estimates = [bm.estimate_engine_s(e, settings) for e in engines]
    one_by_one = bm.estimate_total_s(engines, estimates, 1)
    assert one_by_one == pytest.approx(sum(t for t, _ in estimates))
    assert bm.estimate_total_s(engines, estimates, 3) == pytest.approx(
        one_by_one - 2 * bm.ENGINE_START_S["graph"])
    assert bm.estimate_total_s(engines, estimates, 2) == pytest.approx(
        one_by_one - bm.ENGINE_START_S["graph"])


# What a stand-in child reports: the engine is up, then one cell (512 tokens x 1).
ENGINE_UP = {"kind": "engine", "kv_cache_tokens": 6400, "block_size": 64,
             "max_num_batched_tokens": 16384, "start_s": 0.0}


def _cell_result(tok_s: float, tpot_ms: float) -> dict:
    return {"kind": "cell", "context": 512, "batch": "1", "batch_size": 1, "max_tokens": 200,
            "kv_cache_tokens": 6400, "status": "ok", "decode_tok_s": tok_s, "tpot_ms": tpot_ms,
            "spread_pct": 1.0, "window_ms": f"{tpot_ms:.3f} {tpot_ms:.3f}", "timing_ok": True,
            "lock_step": True, "prefill_steps": 1,
            "timer": "core", "cell_s": 1.0, "estimated_s": 1.0}


def _child_in_turns(spec: dict, on_result, tpot_ms: float) -> tuple[list, str, None]:
    """What run_child returns for a stand-in child that runs the real turn loop
    (``measure_in_turns``, as run_engine does), each cell at ``tpot_ms``; a result handler that
    raises comes back as the engine's failure, as in run_child."""
    on_result(ENGINE_UP)
    results = []
    for result in bm.measure_in_turns(
            {**spec, "serve": None},
            lambda context, label, _round: {**_cell_result(1000 / tpot_ms, tpot_ms),
                                    "context": context, "batch": label}):
        on_result(result)
        results.append(result)
    return results, "", None


@pytest.mark.parametrize("concurrent", [1, 2])
def test_main_gives_grouped_engines_a_go_file_and_a_memory_share(tmp_path, monkeypatch,
                                                                 concurrent, capsys):
    import csv
    import threading

    specs, live, most_live, widths = [], [0], [0], []
    lock = threading.Lock()

    def fake_run_child(command, spec, timeout, on_result, startup_timeout=None):
        with lock:
            specs.append(spec)
            live[0] += 1
        on_result(ENGINE_UP)
        vllm_engine.wait_for_go(spec.get("go_file"), poll_s=0.005)
        with lock:
            most_live[0] = max(most_live[0], live[0])
        result = _cell_result(100.0 if spec["kv"] == "auto" else 150.0, 10.0)
        on_result(result)
        with lock:
            live[0] -= 1
            # The row written as the cell arrives already has the engine's block size.
            widths.extend(r["table_width"] for r in
                          vllm_engine.read_csv(tmp_path / "matrix.csv")[1]
                          if r["kv"] == spec["kv"])
        return [result], "", None

    monkeypatch.setattr(bm, "run_child", fake_run_child)
    bm.main(["--out", str(tmp_path), "--kv", "auto", "fp8_snapmla", "--heads", "16",
             "--contexts", "512", "--batches", "1", "--max-model-len", "wide", "--modes",
             "eager", "--concurrent-starts", str(concurrent)]
            + (["--switch-interval", "0.2"] if concurrent == 2 else []))
    assert sorted(s["kv"] for s in specs) == ["auto", "fp8_snapmla"]
    # The engine core's GIL switch interval only when asked for, in seconds.
    assert all(s["switch_interval_s"] == (0.0002 if concurrent == 2 else None) for s in specs)
    if concurrent == 1:
        assert [s["kv"] for s in specs] == ["auto", "fp8_snapmla"]
        assert all("go_file" not in s and "gpu_memory_utilization" not in s for s in specs)
        assert most_live[0] == 1
    else:
        assert all(s["go_file"] and s["gpu_memory_utilization"] == pytest.approx(0.4)
                   for s in specs)
        assert most_live[0] == 2          # both engines were up together
    with open(tmp_path / "matrix.csv") as f:
        rows = [r for r in csv.DictReader(line for line in f if not line.startswith("#"))]
    ours = next(r for r in rows if r["kv"] == "fp8_snapmla")
    assert ours["status"] == "ok" and float(ours["vs_bf16"]) == pytest.approx(1.5)
    assert ours["window_ms"] == "10.000 10.000"   # each window's step time is kept
    assert widths == ["2560", "2560"]
    assert {r["switch_interval_ms"] for r in rows} == {"0.2" if concurrent == 2 else ""}
    # The progress line of the cell measured second names its ratio to this run's BF16 cell.
    cell_lines = [line for line in capsys.readouterr().out.splitlines() if "tok/s, TPOT" in line]
    assert len(cell_lines) == 2 and ", 1.50x BF16," in cell_lines[1], cell_lines
    assert cell_lines[1].startswith("    [2] fp8_snapmla ctx    512 x    1 (B=1)"), cell_lines


def test_start_groups_keep_comparisons_together_when_interleaved():
    settings = bm.Settings()
    engines, _ = bm.plan_matrix(["auto", "fp8_snapmla", "fp8"], [16], [512, 131072], ["1"],
                                ["wide", "tight"], ["graph"], settings, False, False)
    # One wide engine per format, then one tight engine per format and context.
    assert [(e.max_model_len, e.kv) for e in engines][:4] == [
        ("wide", "auto"), ("wide", "fp8_snapmla"), ("wide", "fp8"), ("tight", "auto")]
    assert len(engines) == 9
    assert bm.start_groups(engines, 2) == [[0, 1], [2, 3], [4, 5], [6, 7], [8]]
    assert bm.start_groups(engines, 3, interleave=True) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    # A comparison is never split across start groups nor joined to the next.
    assert bm.start_groups(engines[1:], 3, interleave=True) == [[0, 1], [2, 3, 4], [5, 6, 7]]
    estimates = [(100.0, []) for _ in engines]
    start = bm.ENGINE_START_S["graph"]
    assert bm.estimate_total_s(engines, estimates, 3, interleave=True) == 900 - 6 * start


def test_main_interleave_measures_each_cell_on_every_format_in_turn(tmp_path, monkeypatch):
    import threading

    specs, order = [], []
    lock = threading.Lock()

    def fake_run_child(command, spec, timeout, on_result, startup_timeout=None):
        with lock:
            specs.append(spec)
        on_result(ENGINE_UP)
        results = []
        for turn, (context, label) in enumerate(spec["cells"]):
            vllm_engine.wait_for_turn(spec, turn, max_wait_s=10)
            with lock:
                order.append((context, spec["kv"]))
            result = {**_cell_result(100.0 if spec["kv"] == "auto" else 150.0, 10.0),
                      "context": context, "batch": label}
            on_result(result)
            results.append(result)
            vllm_engine.end_turn(spec, turn)
        return results, "", None

    monkeypatch.setattr(bm, "run_child", fake_run_child)
    bm.main(["--out", str(tmp_path), "--kv", "auto", "fp8_snapmla", "--heads", "16",
             "--contexts", "512", "2048", "--batches", "1", "--max-model-len", "wide",
             "--modes", "eager", "--interleave"])
    assert order == [(512, "auto"), (512, "fp8_snapmla"), (2048, "auto"), (2048, "fp8_snapmla")]
    assert all(s["in_turns"] and s["gpu_memory_utilization"] == pytest.approx(0.4)
               for s in specs)
    # The budget check of a cell counts the engines after this one in the turn.
    assert {s["kv"]: s["turn_engines"] for s in specs} == {"auto": 2, "fp8_snapmla": 1}
    _, rows = vllm_engine.read_csv(tmp_path / "matrix.csv")
    assert sorted(float(r["vs_bf16"]) for r in rows if r["kv"] == "fp8_snapmla") == [1.5, 1.5]
    # It starts the formats of a comparison together: no other --concurrent-starts.
    with pytest.raises(SystemExit):
        bm.main(["--out", str(tmp_path), "--kv", "auto", "fp8_snapmla", "--interleave",
                 "--concurrent-starts", "3"])
    with pytest.raises(SystemExit):
        bm.main(["--out", str(tmp_path), "--kv", "auto", "--interleave"])


def _run_child_in_turns(specs: list, lock, measure_for):
    """A run_child stand-in whose child runs the real turn loop (``measure_in_turns``), with
    ``measure_for(spec)`` as the cell measurement that stands in for the engine."""
    def fake_run_child(command, spec, timeout, on_result, startup_timeout=None):
        with lock:
            specs.append(spec)
        on_result(ENGINE_UP)
        results = []
        for result in bm.measure_in_turns({**spec, "serve": None}, measure_for(spec)):
            on_result(result)
            results.append(result)
        return results, "", None
    return fake_run_child


def test_main_rounds_alternate_the_formats_of_a_cell_and_combine_like_repeats(tmp_path,
                                                                             monkeypatch,
                                                                             capsys):
    import threading

    order, specs = [], []
    lock = threading.Lock()
    # Step times by round: round 2 is a slow spell for both formats.
    tpot_by_round = {"auto": [10.0, 20.0, 11.0], "fp8_snapmla": [9.0, 18.0, 12.0]}

    def measure_for(spec):
        done = {}

        def measure_cell(context, label, _round):
            done[context, label] = done.get((context, label), 0) + 1
            tpot = tpot_by_round[spec["kv"]][done[context, label] - 1]
            with lock:
                order.append((spec["kv"], done[context, label]))
            return {**_cell_result(1000 / tpot, tpot), "context": context, "batch": label}
        return measure_cell

    monkeypatch.setattr(bm, "run_child", _run_child_in_turns(specs, lock, measure_for))
    bm.main(["--out", str(tmp_path), "--kv", "auto", "fp8_snapmla", "--heads", "16",
             "--contexts", "512", "--batches", "1", "--max-model-len", "wide", "--modes",
             "eager", "--interleave", "--rounds", "3"])
    assert all(s["cells"] == [(512, "1")] * 3 for s in specs)
    # The format that measures first moves on by one each round.
    assert order == [("auto", 1), ("fp8_snapmla", 1), ("fp8_snapmla", 2), ("auto", 2),
                     ("auto", 3), ("fp8_snapmla", 3)]
    _, every = vllm_engine.read_csv(tmp_path / "repeats.csv")
    assert sorted((r["kv"], r["repeat"], r["tpot_ms"]) for r in every) == [
        ("auto", "1", "10.0"), ("auto", "2", "20.0"), ("auto", "3", "11.0"),
        ("fp8_snapmla", "1", "9.0"), ("fp8_snapmla", "2", "18.0"), ("fp8_snapmla", "3", "12.0")]
    _, rows = vllm_engine.read_csv(tmp_path / "matrix.csv")
    ours = next(r for r in rows if r["kv"] == "fp8_snapmla")
    # The median TPOTs (12 against 11 ms) make the ratio; each round's pair its range.
    assert float(ours["tpot_ms"]) == 12.0
    assert float(ours["vs_bf16"]) == pytest.approx(11 / 12, abs=1e-3)
    assert ours["repeat_tpot_ms"] == "9.000 18.000 12.000"
    assert ours["vs_bf16_runs"] == "1.111 1.111 0.917"
    assert "(runs 0.92-1.11)" in (tmp_path / "matrix.md").read_text()
    out = capsys.readouterr().out
    assert "3 rounds a cell" in out
    # A round's progress line compares it with BF16's of the same round, where BF16 measured
    # first.
    assert "fp8_snapmla ctx    512 x    1 round 3 (B=1): 83 tok/s, TPOT 12.00 ms, 0.92x BF16" in out
    for wrong, error in ((["--rounds", "2"], "it needs --interleave"),
                         (["--rounds", "2", "--interleave", "--repeats", "2"], "give one of them"),
                         (["--rounds", "11", "--interleave"], "--rounds must be 1 to 10")):
        with pytest.raises(SystemExit):
            bm.main(["--out", str(tmp_path), "--kv", "auto", "fp8_snapmla", *wrong])
        assert error in capsys.readouterr().err


def test_twin_is_a_second_bf16_engine_measured_in_turn_as_an_a_a_control(tmp_path,
                                                                          monkeypatch, capsys):
    import threading

    order, specs = [], []
    lock = threading.Lock()
    # The twin runs BF16's format; here its engine is 10% slower than the first one.
    tpot = {"auto": 10.0, "fp8_snapmla": 9.0, vllm_engine.TWIN_KV: 11.0}

    def measure_for(spec):
        def measure_cell(context, label, round_):
            with lock:
                order.append((spec["kv"], round_))
            t = tpot[spec["kv"]]
            return {**_cell_result(1000 / t, t), "context": context, "batch": label}
        return measure_cell

    monkeypatch.setattr(bm, "run_child", _run_child_in_turns(specs, lock, measure_for))
    bm.main(["--out", str(tmp_path), "--kv", "auto", "fp8_snapmla", "--twin", "--heads", "16",
             "--contexts", "512", "--batches", "1", "--max-model-len", "wide", "--modes",
             "eager", "--interleave", "--rounds", "2"])
    twin = vllm_engine.TWIN_KV
    assert order == [("auto", 1), ("fp8_snapmla", 1), (twin, 1),
                     ("fp8_snapmla", 2), (twin, 2), ("auto", 2)]
    # With rounds any engine may measure first in a turn: each budgets for all three.
    assert {s["kv"]: s["turn_engines"] for s in specs} == {"auto": 3, "fp8_snapmla": 3, twin: 3}
    # The twin's engine is vLLM's BF16 cache, and plans like BF16's.
    assert vllm_engine.cache_dtype(twin) == "auto"
    assert vllm_engine.cache_dtype("fp8_snapmla") == "fp8_snapmla"
    assert vllm_engine.estimated_kv_blocks(twin, 4.0, 4) == \
        vllm_engine.estimated_kv_blocks("auto", 4.0, 4)
    assert bm.estimate_cell_s(16, "graph", twin, 8192, 64, 100) == \
        bm.estimate_cell_s(16, "graph", "auto", 8192, 64, 100)
    import sys
    from types import ModuleType

    made = []
    fake = ModuleType("vllm")
    fake.LLM = lambda **kwargs: made.append(kwargs)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    vllm_engine.build_llm("m", twin, 4096, 1.0, 8)
    assert made[0]["kv_cache_dtype"] == "auto"                  # what vLLM is asked for
    _, rows = vllm_engine.read_csv(tmp_path / "matrix.csv")
    ratio = {r["kv"]: float(r["vs_bf16"]) for r in rows if r["kv"] != "auto"}
    assert ratio == {"fp8_snapmla": pytest.approx(10 / 9, abs=1e-3),
                     twin: pytest.approx(10 / 11, abs=1e-3)}
    table = (tmp_path / "matrix.md").read_text()
    assert "| BF16 twin tok/s |" in table and "| BF16 twin / BF16 (A/A) |" in table
    line = next(ln for ln in table.splitlines() if ln.startswith("| 512 | 1 |"))
    assert "| 10.00 / 9.00 / - / 11.00 |" in line and line.count("|") == 14
    assert "**0.91x**" in line                                  # the A/A ratio, under 1.0x
    assert "B: batch per format (BF16 / fp8_snapmla / fp8 / BF16 twin)" in table
    for wrong in (["--twin"], ["--twin", "--interleave", "--kv", "fp8_snapmla", "fp8"]):
        with pytest.raises(SystemExit):
            bm.main(["--out", str(tmp_path), *wrong])
        assert "--twin measures a second BF16 engine" in capsys.readouterr().err


def test_a_panel_with_a_twin_says_what_the_a_a_control_tells():
    twin = vllm_engine.TWIN_KV
    # ours / BF16 and twin / BF16 per cell: ours outside the twin's spread in two cells (one
    # above, one below), inside it in one; a cell without a twin is not counted.
    cells = {512: (1.30, 1.10), 2048: (0.80, 0.90), 8192: (1.05, 0.90), 32768: (0.70, None)}
    rows = []
    for context, (ours, other) in cells.items():
        rows += [_cell("auto", 100.0, context), _cell("fp8_snapmla", 100.0 * ours, context)]
        if other is not None:
            rows.append(_cell(twin, 100.0 * other, context))
    rows = bm.add_ratios(rows)
    geo = math.exp((math.log(1.30 / 1.10) + math.log(0.80 / 0.90) + math.log(1.05 / 0.90)) / 3)
    summary = bm.twin_summary(rows)
    assert summary == ("A/A control (3 cells with a BF16 twin): the twin read 0.90-1.10x BF16; "
                       "fp8_snapmla is further from 1.0x than the twin in 2 of them (1 above, 1 "
                       f"below); fp8_snapmla / twin, geometric mean: {geo:.2f}x.")
    assert summary in bm.format_matrix(rows, ["run"])
    without = [r for r in rows if r["kv"] != twin]
    assert bm.twin_summary(without) is None
    assert "A/A control" not in bm.format_matrix(without, ["run"])


def test_rounds_multiply_the_estimate_and_each_round_gets_a_row():
    settings = bm.Settings()
    engines, _ = bm.plan_matrix(["auto"], [16], [512, 2048], ["1"], ["wide"], ["eager"],
                                settings, False, False)
    once = bm.estimate_engine_s(engines[0], settings)[0]
    thrice = bm.replace(engines[0], rounds=3)
    # Round-major: every cell once, then again, so that a cell's rounds are a pass apart.
    assert thrice.turns == [(512, "1"), (2048, "1")] * 3
    # The child numbers each cell's rounds as they come in that order.
    seen = [(r["context"], r["round"]) for r in bm.measure_in_turns(
        {"cells": thrice.turns, "serve": None},
        lambda context, label, round_: {"context": context, "batch": label})]
    assert seen == [(512, 1), (2048, 1), (512, 2), (2048, 2), (512, 3), (2048, 3)]
    start = bm.ENGINE_START_S["eager"]
    assert bm.estimate_engine_s(thrice, settings)[0] - start == pytest.approx(3 * (once - start))
    # A round without a result is a row of its own, marked failed.
    results = [ENGINE_UP, {**_cell_result(100.0, 10.0), "round": 1},
               {**_cell_result(100.0, 10.0), "round": 3}]
    matrix, _ = bm.engine_rows(thrice, results, None, {})
    got = [(r["context"], r["repeat"], r["status"]) for r in matrix]
    assert got == [(512, 1, "ok"), (512, 2, "failed"), (512, 3, "ok"), (2048, 1, "failed"),
                   (2048, 2, "failed"), (2048, 3, "failed")]


def test_interleave_names_its_own_way_out_of_the_memory_check(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vllm_engine, "gpu_memory_gib", lambda: 79.6)   # an H100
    with pytest.raises(SystemExit):
        bm.main(["--out", str(tmp_path), "--interleave", "--dry-run"])   # three formats
    error = capsys.readouterr().err
    assert "--interleave: 3 engines x (4 GiB KV" in error and "smaller --kv-cache-gib" in error
    bm.main(["--out", str(tmp_path), "--interleave", "--kv-cache-gib", "3.5", "--dry-run"])
    bm.main(["--out", str(tmp_path), "--interleave", "--kv", "auto", "fp8_snapmla", "--dry-run"])


def test_main_repeats_the_plan_with_fresh_engines(tmp_path, monkeypatch, capsys):
    specs, step_ms = [], {"auto": iter([10.0, 12.0, 11.0]), "fp8_snapmla": iter([9.0, 13.0, 10.0])}

    def fake_run_child(command, spec, timeout, on_result, startup_timeout=None):
        specs.append(spec["kv"])
        return _child_in_turns(spec, on_result, next(step_ms[spec["kv"]]))

    monkeypatch.setattr(bm, "run_child", fake_run_child)
    bm.main(["--out", str(tmp_path), "--kv", "auto", "fp8_snapmla", "--heads", "16",
             "--contexts", "512", "--batches", "1", "--max-model-len", "wide", "--modes",
             "eager", "--repeats", "3"])
    assert specs == ["auto", "fp8_snapmla"] * 3          # the plan in order, three times
    _, rows = vllm_engine.read_csv(tmp_path / "matrix.csv")
    ours = next(r for r in rows if r["kv"] == "fp8_snapmla")
    assert float(ours["tpot_ms"]) == 10.0 and float(ours["vs_bf16"]) == pytest.approx(1.1)
    assert ours["repeat_tpot_ms"] == "9.000 13.000 10.000"
    out = capsys.readouterr().out
    assert "run 3 of 3" in out
    # Every run's progress line came out (the third run's cells too).
    assert out.count("fp8_snapmla ctx    512 x    1 (B=1)") == 3, out
    with pytest.raises(SystemExit):
        bm.main(["--out", str(tmp_path), "--repeats", "0"])


def test_waiting_engine_exits_when_the_go_folder_is_gone_or_after_its_limit(tmp_path):
    folder = tmp_path / "go-group"
    folder.mkdir()
    with pytest.raises(SystemExit, match="no go after"):
        vllm_engine.wait_for_go(str(folder / "0"), poll_s=0.01, max_wait_s=0.05)
    folder.rmdir()   # the parent ended and its temporary folder went with it
    with pytest.raises(SystemExit, match="has ended"):
        vllm_engine.wait_for_go(str(folder / "0"), poll_s=0.01)


def _child(tmp_path, body: str) -> list[str]:
    script = tmp_path / "child.py"
    script.write_text("import json, sys, time\nsys.stdin.read()\n" + body)
    return [sys.executable, str(script)]


def _result_line(payload: dict) -> str:
    import json

    return f"print({vllm_engine.RESULT_TAG!r} + {json.dumps(json.dumps(payload))}, flush=True)\n"


def test_run_child_kills_a_child_that_does_not_come_up_in_time(tmp_path):
    import time

    began = time.monotonic()
    results, _, failure = vllm_engine.run_child(_child(tmp_path, "time.sleep(60)\n"), {},
                                                timeout=60, startup_timeout=1)
    assert results == [] and failure == "not up after 1 s"
    assert time.monotonic() - began < 10
    # Once up, the start-up limit no longer applies.
    body = _result_line({"kind": "engine"}) + "time.sleep(1.5)\n" + _result_line({"n": 1})
    results, _, failure = vllm_engine.run_child(_child(tmp_path, body), {}, timeout=30,
                                                startup_timeout=1)
    assert failure is None and [r.get("n") for r in results] == [None, 1]


def test_a_failing_result_handler_does_not_stall_the_child(tmp_path):
    # The child writes well past a pipe buffer after its first result.
    body = (_result_line({"kind": "engine"}) + "print('x' * 200000, flush=True)\n"
            + _result_line({"n": 2}))

    def handler(result):
        raise ValueError("bad row")

    results, log, failure = vllm_engine.run_child(_child(tmp_path, body), {}, timeout=30,
                                                  on_result=handler)
    assert failure == "result handler: ValueError: bad row"
    assert len(results) == 2 and len(log) > 200000


def test_concurrent_memory_check():
    assert vllm_engine.concurrent_memory_problem(1, 100.0, 10.0, total_gib=10.0) is None
    assert vllm_engine.concurrent_memory_problem(4, 4.0, 10.0, total_gib=139.8) is None
    problem = vllm_engine.concurrent_memory_problem(8, 24.0, 10.0, total_gib=139.8)
    assert problem and "start fewer at once" in problem


def test_budget_counts_the_measurements_queued_before_an_engine_of_a_group(tmp_path,
                                                                           monkeypatch):
    import csv

    settings = bm.Settings()
    engines, _ = bm.plan_matrix(["auto", "fp8_snapmla"], [16], [512], ["1"], ["wide"],
                                ["eager"], settings, False, False)
    (first_s, first_dec), (_, second_dec) = [bm.estimate_engine_s(e, settings) for e in engines]
    need_first = bm.ENGINE_START_S["eager"] + first_dec[0]["estimated_s"]
    need_second = (bm.ENGINE_START_S["eager"] + first_s - bm.ENGINE_START_S["eager"]
                   + second_dec[0]["estimated_s"])
    assert need_first < need_second
    launched = []

    def fake_run_child(command, spec, timeout, on_result, startup_timeout=None):
        launched.append(spec["kv"])
        on_result({"kind": "engine", "kv_cache_tokens": 6400, "block_size": 64,
                   "max_num_batched_tokens": 16384, "start_s": 0.0})
        return [], "", None

    monkeypatch.setattr(bm, "run_child", fake_run_child)
    bm.main(["--out", str(tmp_path), "--kv", "auto", "fp8_snapmla", "--heads", "16",
             "--contexts", "512", "--batches", "1", "--max-model-len", "wide", "--modes",
             "eager", "--concurrent-starts", "2",
             "--budget-s", str((need_first + need_second) / 2)])
    assert launched == ["auto"]          # the second would only start to skip its cells
    with open(tmp_path / "matrix.csv") as f:
        rows = [r for r in csv.DictReader(line for line in f if not line.startswith("#"))]
    second = next(r for r in rows if r["kv"] == "fp8_snapmla")
    assert second["status"] == "skipped" and "--budget-s" in second["reason"]


def test_a_dead_engine_core_reports_its_own_exception(tmp_path, capsys):
    # vLLM's engine core prints its traceback (prefixed with its pid) long before the front
    # end raises EngineDeadError; the failure names the core's exception.
    # As vLLM prints it: the core's logger on stdout (a header on every line), then the
    # traceback multiprocessing writes to stderr.
    body = (_result_line({"kind": "engine"})
            + "core = '(EngineCore pid=77) '\n"
            + "log = core + 'ERROR 12-04 14:15:01 [core.py:1330] '\n"
            + "print(log + 'EngineCore encountered a fatal error.')\n"
            + "print(log + 'torch.OutOfMemoryError: CUDA out of memory. Tried 2.00 GiB', "
              "flush=True)\n"
            + "print(core + 'Traceback (most recent call last):', file=sys.stderr)\n"
            + "print(core + 'torch.OutOfMemoryError: CUDA out of memory. Tried 2.00 GiB', "
              "file=sys.stderr, flush=True)\n"
            + "print('filler ' * 2000, file=sys.stderr)\n"
            + "print('Traceback (most recent call last):', file=sys.stderr)\n"
            + "print('vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an "
              "issue. See stack trace (above) for the root cause.', file=sys.stderr)\n"
            + "sys.exit(1)\n")
    results, log, failure = vllm_engine.run_child(_child(tmp_path, body), {}, timeout=30)
    assert len(results) == 1
    assert failure == "exit 1: torch.OutOfMemoryError: CUDA out of memory. Tried 2.00 GiB"
    # The printed excerpt shows the core's traceback although 14 kB of output followed it.
    assert "EngineCore encountered a fatal error" in capsys.readouterr().err


def test_root_cause_skips_the_dead_engine_consequence_and_plain_text():
    assert vllm_engine.root_cause("no error here\nTraceback (most recent call last):\n") is None
    assert vllm_engine.root_cause(
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.") is None
    # The last cause wins (an exception handled during start-up came earlier).
    log = "ValueError: handled at start-up\nx\nRuntimeError: requests finished early\n"
    assert vllm_engine.root_cause(log) == "RuntimeError: requests finished early"
    # A core that fails to start: the front end's RuntimeError is the consequence.
    start_up = ("(EngineCore pid=3) ERROR 12-04 14:15:01 [core.py:1] triton.runtime.errors."
                "OutOfResources: out of resource: shared memory\n"
                "RuntimeError: Engine core initialization failed. See root cause above. "
                "Failed core proc(s): {}\n")
    assert vllm_engine.root_cause(start_up) == (
        "triton.runtime.errors.OutOfResources: out of resource: shared memory")
    # A long message keeps its beginning: the exception's name.
    long = "torch.OutOfMemoryError: CUDA out of memory. " + "x" * 600
    assert vllm_engine.root_cause(long).startswith("torch.OutOfMemoryError")
    assert vllm_engine.cause_context(log, before=1) == "x\nRuntimeError: requests finished early"


def test_window_times_are_kept_per_window():
    summary = vllm_engine.summarize_windows(8, [0.002, 0.0021, 0.003, 0.00205])
    assert summary["window_ms"] == "2.000 2.100 3.000 2.050"
    assert summary["tpot_ms"] == pytest.approx(2.075)   # the median resists the slow window


def test_engine_log_facts_read_the_routing_simulator():
    log = ("(EngineCore pid=5) INFO [gpu_model_runner.py:1] Using FLASHMLA attention backend\n"
           "(EngineCore pid=5) WARNING 12-04 14:15:00 [routing_simulator_router.py:292] "
           "Simulating MoE routing using a uniform_random strategy. This should only be used "
           "for performance testing. Model outputs will not be valid.\n")
    facts = vllm_engine.engine_log_facts(log)
    assert facts["simulated_routing"] == "uniform_random" and facts["backend"] == "FLASHMLA"
    assert vllm_engine.engine_log_facts("nothing")["simulated_routing"] == ""


def test_switch_interval_is_set_and_checked_in_the_engine_process():
    before = sys.getswitchinterval()
    try:
        pid, interval = vllm_engine.set_switch_interval(None, 0.0002)
        assert pid == os.getpid() and interval == pytest.approx(0.0002)
    finally:
        sys.setswitchinterval(before)

    class FakeLLM:
        def __init__(self, reported):
            self.reported = reported

        def collective_rpc(self, method, args=()):
            assert method is vllm_engine.set_switch_interval and args == (0.0002,)
            return [(123, self.reported)]

    vllm_engine.apply_switch_interval(FakeLLM(0.0002), 0.0002)
    # CPython's microsecond rounding of 0.2 ms is not a mismatch.
    vllm_engine.apply_switch_interval(FakeLLM(0.00019999999999999998), 0.0002)
    with pytest.raises(RuntimeError, match="engine process 123 has switch interval 0.005"):
        vllm_engine.apply_switch_interval(FakeLLM(0.005), 0.0002)
    with pytest.raises(RuntimeError, match="engine process 123 has switch interval 0.000199"):
        vllm_engine.apply_switch_interval(FakeLLM(0.000199), 0.0002)

    class SilentLLM:
        def collective_rpc(self, method, args=()):
            return []

    with pytest.raises(RuntimeError, match="no engine process reported"):
        vllm_engine.apply_switch_interval(SilentLLM(), 0.0002)


@pytest.mark.parametrize("ms", ["0", "-1", "nan", "inf", "0.0005", "0.0025"])
def test_switch_interval_python_cannot_hold_is_refused_before_any_engine(ms, capsys):
    with pytest.raises(SystemExit):
        bm.main(["--out", "unused", "--dry-run", "--heads", "16", "--contexts", "512",
                 "--switch-interval", ms])
    assert "--switch-interval" in capsys.readouterr().err
    assert bm.switch_interval_arg_problem(0.001) is None
    assert bm.switch_interval_arg_problem(0.2) is None
    assert bm.switch_interval_arg_problem(5) is None


def test_runs_with_another_switch_interval_or_layers_need_their_own_folder(tmp_path, capsys):
    serve = [{"heads": 16, "mode": "graph", "kv": "auto", "status": "ok", "requests": 4,
              "completed": 4, "output_tok_s": 100.0}]
    _, rows = bm.write_outputs(tmp_path, INFO, serve_rows=serve,
                               run_fields=bm.run_fields_of("0.2"))
    assert rows[0]["switch_interval_ms"] == "0.2" and rows[0]["layers"] == 4
    assert bm.folder_problem(tmp_path, bm.run_fields_of("0.2")) is None
    problem = bm.folder_problem(tmp_path, bm.run_fields_of(""))
    assert "0.2 ms" in problem and "Python's default" in problem
    assert bm.folder_problem(tmp_path / "empty", bm.run_fields_of("0.5")) is None
    problem = bm.folder_problem(tmp_path, bm.run_fields_of("0.2", 16))
    assert "4 layers" in problem and "--layers 16" in problem
    with pytest.raises(SystemExit):
        bm.main(["--out", str(tmp_path), "--dry-run", "--heads", "16", "--contexts", "512"])
    assert "0.2 ms" in capsys.readouterr().err
    bm.main(["--out", str(tmp_path), "--dry-run", "--heads", "16", "--contexts", "512",
             "--switch-interval", "0.2"])
    # Rows written before --layers existed count as 4 layers.
    legacy = tmp_path / "legacy"
    bm.write_outputs(legacy, INFO, serve_rows=serve,
                     run_fields={"switch_interval_ms": "", "layers": ""})
    assert vllm_engine.read_csv(legacy / "serve.csv")[1][0]["layers"] == ""
    assert bm.folder_problem(legacy, bm.run_fields_of()) is None
    assert bm.folder_problem(legacy, bm.run_fields_of("", 8)) is not None


def test_layers_set_the_model_the_kv_cache_and_the_estimates(tmp_path, monkeypatch, capsys):
    import json

    specs = []

    def fake_run_child(command, spec, timeout, on_result, startup_timeout=None):
        config = json.loads((Path(spec["model"]) / "config.json").read_text())
        specs.append((spec, config))
        on_result(ENGINE_UP)
        result = _cell_result(100.0, 10.0)
        on_result(result)
        return [result], "", None

    monkeypatch.setattr(bm, "run_child", fake_run_child)
    bm.main(["--out", str(tmp_path), "--kv", "auto", "--heads", "16", "--contexts", "512",
             "--batches", "1", "--max-model-len", "wide", "--modes", "eager", "--layers", "16"])
    (spec, config), = specs
    # Sixteen dense layers (none MoE), and the KV cache holds the tokens it does at 4 layers.
    assert config["num_hidden_layers"] == 16 and config["first_k_dense_replace"] == 16
    assert spec["settings"]["layers"] == 16
    assert spec["settings"]["kv_cache_gib"] == pytest.approx(16.0)
    _, rows = vllm_engine.read_csv(tmp_path / "matrix.csv")
    assert {r["layers"] for r in rows} == {"16"}
    assert "attention in 16 dense layers" in (tmp_path / "matrix.md").read_text()
    four, sixteen = bm.Settings(), bm.Settings(layers=16, kv_cache_gib=16.0)
    engine = bm.Engine("auto", 16, "wide", 163840, "eager", [(8192, "fill")])
    (t4, (d4,)), (t16, (d16,)) = (bm.estimate_engine_s(engine, s) for s in (four, sixteen))
    assert d4["batch_size"] == d16["batch_size"] and t16 > t4
    assert (bm.estimate_cell_s(16, "graph", "auto", 512, 8, 100, 16)
            > bm.estimate_cell_s(16, "graph", "auto", 512, 8, 100))
    with pytest.raises(SystemExit):
        bm.main(["--out", str(tmp_path / "x"), "--dry-run", "--layers", "0"])
    assert "--layers must be 1 to 61" in capsys.readouterr().err


def test_every_row_of_a_deeper_run_carries_its_layers(tmp_path, monkeypatch):
    def fake_run_child(command, spec, timeout, on_result, startup_timeout=None):
        return _child_in_turns(spec, on_result, 10.0)

    monkeypatch.setattr(bm, "run_child", fake_run_child)
    # Skipped before any engine (prefill limit), measured, repeated (repeats.csv), and skipped
    # by the budget: each kind of row is stamped with --layers.
    bm.main(["--out", str(tmp_path), "--kv", "auto", "fp8_snapmla", "--heads", "16",
             "--contexts", "512", "--batches", "1", "64", "--max-prefill-tokens", "1000",
             "--max-model-len", "wide", "--modes", "eager", "--layers", "16", "--repeats", "2"])
    for name in ("matrix", "repeats"):
        _, rows = vllm_engine.read_csv(tmp_path / f"{name}.csv")
        assert rows and {r["layers"] for r in rows} == {"16"}, name
        assert {r["status"] for r in rows} == ({"ok", "skipped"} if name == "matrix"
                                               else {"ok"})
    bm.main(["--out", str(tmp_path / "budget"), "--kv", "auto", "--heads", "16", "--contexts",
             "512", "--batches", "1", "--max-model-len", "wide", "--modes", "eager", "--layers",
             "16", "--budget-s", "1"])
    _, rows = vllm_engine.read_csv(tmp_path / "budget" / "matrix.csv")
    assert [(r["status"], r["layers"]) for r in rows] == [("skipped", "16")]
    # An eager step's fixed time grows with the layers.
    gap = (bm.estimate_cell_s(16, "eager", "auto", 512, 8, 100, 16)
           - bm.estimate_cell_s(16, "eager", "auto", 512, 8, 100))
    assert gap >= 100 * bm.DECODE_STEP_S["eager"] * 3
    workload = [(0.0, 100, 64), (1.0, 100, 64)]
    assert bm.estimate_serve_s(workload, "graph", 16) > bm.estimate_serve_s(workload, "graph")


def test_a_deeper_model_counts_its_weights_in_the_memory_check(monkeypatch, capsys):
    monkeypatch.setattr(vllm_engine, "gpu_memory_gib", lambda: 79.6)   # an H100
    assert bm.extra_weights_gib(128, 4) == 0 and bm.extra_weights_gib(128, 61) > 20
    # One engine of 61 layers: 61 GiB of KV cache and its weights do not fit an H100.
    with pytest.raises(SystemExit):
        bm.main(["--out", "unused", "--dry-run", "--layers", "61", "--kv", "auto"])
    assert "one engine of 61 GiB KV" in capsys.readouterr().err
    bm.main(["--out", "unused", "--dry-run", "--layers", "61", "--kv", "auto",
             "--kv-cache-gib", "8"])
    # Two interleaved engines of 16 layers: their weights tip them over at 128 heads.
    with pytest.raises(SystemExit):
        bm.main(["--out", "unused", "--dry-run", "--layers", "16", "--kv", "auto",
                 "fp8_snapmla", "--interleave", "--kv-cache-gib", "12"])
    assert "2 engines x (12 GiB KV + ~25 GiB)" in capsys.readouterr().err
    bm.main(["--out", "unused", "--dry-run", "--layers", "16", "--kv", "auto", "fp8_snapmla",
             "--interleave", "--kv-cache-gib", "12", "--heads", "16"])
    assert vllm_engine.concurrent_memory_problem(1, 60.0, 20.0, total_gib=79.6) is None


def test_write_outputs_needs_the_runs_fields(tmp_path):
    with pytest.raises(ValueError, match="run_fields"):
        bm.write_outputs(tmp_path / "out", INFO, [_cell("auto", 100.0)], run_fields=None)
    assert not (tmp_path / "out").exists()


def test_a_fixed_batch_above_max_batch_is_refused(capsys):
    """--max-batch is vLLM's max_num_seqs: a batch of 1024 would run 512 at a time, and its
    tok/s (1024 / step) would be overstated."""
    with pytest.raises(SystemExit):
        bm.main(["--out", "unused", "--dry-run", "--heads", "16", "--contexts", "512",
                 "--batches", "1024", "--max-batch", "512"])
    assert "--batches 1024 above --max-batch 512" in capsys.readouterr().err


def test_a_failed_engine_leaves_its_output_and_its_stalled_cell(tmp_path, monkeypatch, capsys):
    import csv

    stalled = {**{k: v for k, v in _cell_result(0, 0).items()
                  if k not in ("decode_tok_s", "tpot_ms")},
               "status": "failed", "reason": "stalled: no result 180 s after it began"}

    def fake_run_child(command, spec, timeout, on_result, startup_timeout=None):
        on_result(ENGINE_UP)
        if spec["kv"] == "auto":
            result = _cell_result(100.0, 10.0)
            on_result(result)
            return [ENGINE_UP, result], "", None
        on_result(stalled)
        log = "the engine's output\nThread 0x1 (most recent call first):\n"
        return [ENGINE_UP, stalled], log, "exit 3: engine stopped: cell ctx 512 x 1 stalled"

    monkeypatch.setattr(bm, "run_child", fake_run_child)
    bm.main(["--out", str(tmp_path), "--kv", "auto", "fp8_snapmla", "--heads", "16",
             "--contexts", "512", "--batches", "1", "--max-model-len", "wide", "--modes",
             "eager"])
    log = tmp_path / "logs" / "engine-2-fp8_snapmla-h16-163840-eager.log"
    assert log.read_text().startswith("the engine's output\nThread 0x1"), list(tmp_path.iterdir())
    assert not (tmp_path / "logs" / "engine-1-auto-h16-163840-eager.log").exists()
    out = capsys.readouterr().out
    assert "[2] fp8_snapmla ctx    512 x    1: failed: stalled: no result 180 s" in out, out
    assert f"[2] engine failed: exit 3: engine stopped: cell ctx 512 x 1 stalled; its output " \
           f"in {log}" in out, out
    with open(tmp_path / "matrix.csv") as f:
        rows = [r for r in csv.DictReader(line for line in f if not line.startswith("#"))]
    ours = next(r for r in rows if r["kv"] == "fp8_snapmla")
    assert ours["status"] == "failed" and ours["reason"].startswith("stalled"), ours


def test_stall_limit_is_ten_estimates_and_at_least_three_minutes():
    assert bm.stall_limit_s(1.0) == bm.STALL_MIN_S == 180.0
    assert bm.stall_limit_s(133.3) == pytest.approx(1333.0)


def _recorded(heads, mml, mode, context, batch, ratio, kv="fp8_snapmla", status="ok"):
    return {"heads": heads, "max_model_len": mml, "mode": mode, "context": context,
            "batch": batch, "kv": kv, "status": status, "vs_bf16": ratio}


def test_below_selects_the_recorded_cells_under_the_ratio(tmp_path, capsys):
    vllm_engine.write_csv([
        _recorded(16, "wide", "eager", 512, "8", 0.83),          # chosen
        _recorded(16, "wide", "eager", 512, "1", 1.02),
        _recorded(16, "wide", "eager", 512, "8", 1.0, kv="auto"),  # BF16's own row: 1.0
        _recorded(16, "tight", "eager", 2048, "fill", 0.78),     # chosen
        _recorded(16, "tight", "eager", 2048, "1", 0.5, status="failed"),
        _recorded(16, "wide", "graph", 512, "8", 0.7),           # a mode not selected
    ], tmp_path / "matrix.csv", bm.MATRIX_FIELDS)
    bm.main(["--out", str(tmp_path), "--dry-run", "--below", "1.0", "--heads", "16", "--kv",
             "auto", "fp8_snapmla", "--contexts", "512", "2048", "--batches", "1", "8",
             "fill", "--modes", "eager"])
    out = capsys.readouterr().out
    assert "4 engines (0 graph, 4 eager), 4 cells" in out, out
    # The tight engine keeps the max_model_len the whole selection gives the 2k context.
    assert "[3] auto H=16 tight (2368 tokens, 37 pages) eager: 1 cells" in out, out
    assert re.search(r"context 512: 8: ~[\d.]+ s\n", out), out
    assert re.search(r"context 2048: fill\b", out) and "context 512: 1:" not in out, out
    with pytest.raises(SystemExit):
        bm.main(["--out", str(tmp_path), "--dry-run", "--below", "0.6", "--heads", "16",
                 "--modes", "eager"])
    assert "--below 0.6: no selected cell" in capsys.readouterr().err


def test_unmeasured_selects_the_cells_a_format_has_not_settled(tmp_path, capsys):
    budget = f"{bm.BUDGET_SKIP} engine start + first cell ~34 s, 0 s left"
    cache = "batch 8 x 8211 pages > the 58253 pages of the KV cache"
    rows = [_recorded(16, "wide", "eager", 512, "1", 1.02, kv=kv) for kv in ("auto",
                                                                             "fp8_snapmla")]
    rows += [_recorded(16, "wide", "eager", 512, "8", 1.0, kv="auto"),         # ours missing
             _recorded(16, "wide", "eager", 2048, "1", "", kv="auto", status="failed"),
             _recorded(16, "wide", "eager", 2048, "1", "", status="skipped"),  # for time
             _recorded(16, "wide", "eager", 2048, "8", "", kv="auto", status="skipped"),
             _recorded(16, "wide", "eager", 2048, "8", 1.5)]                   # BF16: cache
    rows[-3]["reason"], rows[-2]["reason"] = budget, cache
    vllm_engine.write_csv(rows, tmp_path / "matrix.csv", bm.MATRIX_FIELDS)
    assert bm.settled_cells(rows, ["auto", "fp8_snapmla"]) == {
        (16, "wide", "eager", 512, "1"), (16, "wide", "eager", 2048, "8")}
    bm.main(["--out", str(tmp_path), "--dry-run", "--unmeasured", "--heads", "16", "--kv",
             "auto", "fp8_snapmla", "--contexts", "512", "2048", "--batches", "1", "8",
             "--max-model-len", "wide", "--modes", "eager"])
    out = capsys.readouterr().out
    # 512 x 8 (ours never ran) and 2048 x 1 (ours skipped for time), on both formats.
    assert "2 engines (0 graph, 2 eager), 4 cells" in out, out
    assert re.search(r"context 512: 8: ~[\d.]+ s\n", out) and "context 512: 1:" not in out, out
    assert "context 2048: 8:" not in out, out
    # BF16 alone has settled every cell it has a row for.
    with pytest.raises(SystemExit):
        bm.main(["--out", str(tmp_path), "--dry-run", "--unmeasured", "--heads", "16", "--kv",
                 "auto", "--contexts", "512", "2048", "--batches", "1", "8",
                 "--max-model-len", "wide", "--modes", "eager"])
    assert "--unmeasured: every selected cell is settled" in capsys.readouterr().err


def test_keep_cells_keeps_the_serve_engine_and_the_chosen_skips():
    settings = bm.Settings()
    engines, skipped = bm.plan_matrix(["auto", "fp8_snapmla"], [16], [512, 131072],
                                      ["1", "64"], ["wide"], ["graph"], settings, serve=True)
    assert {(s["context"], s["batch"]) for s in skipped} == {(131072, "64")}
    kept, kept_skips = bm.keep_cells(engines, skipped, {(16, "wide", "graph", 512, "64")})
    assert [(e.kv, e.cells, e.serve) for e in kept] == [
        ("auto", [(512, "64")], True), ("fp8_snapmla", [(512, "64")], True)]
    assert kept_skips == []
    kept, _ = bm.keep_cells(engines, skipped, set())
    assert [e.cells for e in kept] == [[], []]   # the serve run stays
