"""The pure-Python parts of benchmarks/bench_e2e.py and of benchmarks/vllm_engine.py, which it
shares with bench_matrix: model shapes, batch sizing, the decode timing against a stand-in
engine, the child process, result merging and the table/CSV/plot outputs (the vLLM runs
themselves need a GPU)."""

import json
import math
import os
import random
import sys
import time

from pathlib import Path

import pytest

from benchmarks import bench_e2e as bench
from benchmarks import vllm_engine as engine_lib
from vllm_snapmla import format as fmt
from vllm_snapmla.testing import write_tiny_deepseek_v3


@pytest.mark.parametrize("heads", [128, 16])
def test_model_config_has_deepseek_v31_attention_and_dense_layers(tmp_path, heads):
    path = write_tiny_deepseek_v3(tmp_path / "m", **engine_lib.model_config(heads))
    config = json.loads((path / "config.json").read_text())
    assert config["hidden_size"] == 7168
    assert config["num_attention_heads"] == config["num_key_value_heads"] == heads
    assert (config["q_lora_rank"], config["kv_lora_rank"]) == (1536, fmt.KV_LORA_RANK)
    assert config["qk_rope_head_dim"] == fmt.ROPE_DIM
    assert (config["qk_nope_head_dim"], config["v_head_dim"]) == (128, 128)
    assert config["num_hidden_layers"] == 4
    # vLLM makes layer i an MoE layer only from first_k_dense_replace on: all dense here.
    assert config["first_k_dense_replace"] >= config["num_hidden_layers"]
    assert (config["max_position_embeddings"]
            >= max(bench.CONTEXTS) + bench.MAX_WARM_TOKENS + engine_lib.SETTLE_STEPS + 2 * 512)


def test_batch_to_fill_counts_whole_pages_per_request():
    rng = random.Random(1)
    for _ in range(200):
        block = rng.choice([16, 64])
        context, gen = rng.randint(1, 200_000), rng.randint(2, 1000)
        blocks = rng.randint(0, 200_000)
        batch = engine_lib.batch_to_fill(blocks, block, context, gen, max_batch=10**9)
        per_request = math.ceil((context + gen) / block)
        assert batch * per_request <= blocks < (batch + 1) * per_request
    assert engine_lib.batch_to_fill(10_000, 64, 16384, 513, max_batch=7) == 7
    # The same bytes hold 1152/656 = 1.76x more fp8_snapmla tokens: the batch grows with them.
    budget = 24 * 2**30
    bf16 = engine_lib.batch_to_fill(budget // (4 * 1152 * 64), 64, 16384, 513, 10**9)
    snap = engine_lib.batch_to_fill(budget // (4 * fmt.BYTES_PER_TOKEN * 64), 64, 16384, 513, 10**9)
    assert 1.7 < snap / bf16 < 1.8


def test_warm_tokens_outlast_the_chunked_prefill():
    rng = random.Random(3)
    for _ in range(200):
        batch, context = rng.randint(1, 512), rng.randint(1, 131072)
        budget = rng.randint(batch + 1, 65536)
        warm = engine_lib.warm_tokens(batch, context, budget)
        # Steps the prefill needs at most: every step has budget - batch prompt tokens.
        steps = math.ceil(batch * context / (budget - batch))
        assert steps + 16 <= warm <= math.ceil(1.25 * steps) + 16
    # 28 requests of 32k with vLLM's default 8192-token budget: about 113 prefill steps.
    assert engine_lib.warm_tokens(28, 32768, 8192) == math.ceil(1.25 * 113) + 16
    with pytest.raises(ValueError, match="no prefill budget"):
        engine_lib.warm_tokens(512, 16384, 512)


def test_plan_context_fills_the_cache_with_requests_that_outlast_the_prefill():
    rng = random.Random(5)
    for _ in range(300):
        block = rng.choice([16, 64])
        context, draft = rng.randint(1, 131072), rng.choice([0, 1, 3])
        timed = (engine_lib.SETTLE_STEPS + rng.randint(1, 1024)) * (1 + draft)
        blocks, budget = rng.randint(0, 100_000), rng.choice([2048, 8192, 16384])
        max_batch = rng.choice([8, 64, 512])
        plan = bench.plan_context(blocks, block, context, timed, draft, budget, max_batch)
        batch, max_tokens = plan["batch"], plan["max_tokens"]
        pages = math.ceil((context + max_tokens) / block)
        if plan["reason"]:
            assert batch < 1 or "warm tokens" in plan["reason"]
            continue
        # The batch fits, is as large as the cache allows, and its requests outlast its
        # prefill with every step's speculative tokens counted.
        assert 1 <= batch <= max_batch and batch * pages <= blocks
        assert batch == max_batch or (batch + 1) * pages > blocks
        warm = engine_lib.warm_tokens(batch, context, budget)
        assert max_tokens >= warm * (1 + draft) + timed
    # Where the cache is tight (room for 40 requests of 264 pages), the prefill's token budget
    # and the speculative tokens move the batch: 39 at vLLM's 16384 (265 pages), 40 at 65536,
    # 38 with one draft token per step.
    args = (40 * 264, 64, 16320)
    assert bench.plan_context(*args, 516, 0, 16384, 512)["batch"] == 39
    assert bench.plan_context(*args, 516, 0, 65536, 512)["batch"] == 40
    assert bench.plan_context(*args, 1032, 1, 16384, 512)["batch"] == 38


def test_engine_log_gives_a_row_per_context_and_keeps_finished_ones():
    spec = {"heads": 128, "contexts": [16384, 32768, 65536], "kv": "fp8_snapmla",
            "gen_tokens": 512}
    result = {"context": 32768, "batch": 49, "prefill_steps": 158, "lock_step": True,
              "kv_cache_tokens": 1636800, "decode_tok_s": 1953.0, "tpot_ms": 25.1}
    log = ("INFO ... GPU KV cache size: 1,636,800 tokens\n"
           "INFO ... Using SNAPMLA attention backend\n"
           + engine_lib.RESULT_TAG + json.dumps(result) + "\n")
    engine_up = {"kind": "engine", "kv_cache_tokens": 1636800}
    rows = bench.parse_engine_log(spec, [engine_up, result], log, "timed out after 600 s")
    assert [r["context"] for r in rows] == spec["contexts"]
    assert all(r["kv"] == "fp8_snapmla" and r["heads"] == 128 for r in rows)
    assert all(r["log_kv_cache_tokens"] == 1636800 and r["backend"] == "SNAPMLA" for r in rows)
    finished = rows[1]
    assert finished["decode_tok_s"] == 1953.0 and "error" not in finished
    assert rows[0]["error"] == rows[2]["error"] == "timed out after 600 s"
    # A clean exit that produced no result for a context still marks it as failed.
    assert bench.parse_engine_log(spec, [], "", None)[0]["error"] == "no result"


def _gone(pid: int) -> bool:
    """The process ``pid`` has exited (or is a zombie waiting for init)."""
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            return True
        time.sleep(0.1)
    return False


def _stand_in_child(tmp_path, monkeypatch, then: str = "") -> Path:
    """An engine child for ``run_in_subprocess``: reads the spec, starts a grandchild (as vLLM
    starts its engine core and workers), reports the first context, then runs ``then``.
    Returns the file the grandchild's pid is written to."""
    child = tmp_path / "child.py"
    pid_file = tmp_path / "grandchild.pid"
    child.write_text(
        "import json, subprocess, sys, time\n"
        "spec = json.loads(sys.stdin.read())\n"
        "core = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(core.pid))\n"
        f"print({engine_lib.RESULT_TAG!r} + json.dumps({{'context': spec['contexts'][0], "
        "'batch': 3, 'decode_tok_s': 10.0}), flush=True)\n" + then)
    monkeypatch.setattr(bench, "child_command", lambda: [sys.executable, str(child)])
    return pid_file


def test_engine_subprocess_leaves_no_process_behind_a_clean_exit(tmp_path, monkeypatch):
    # The child exits cleanly while its grandchild (as vLLM leaves a tensor-parallel worker
    # that outlives its shutdown grace) still runs.
    pid_file = _stand_in_child(tmp_path, monkeypatch)
    spec = {"heads": 16, "contexts": [16384], "kv": "fp8", "gen_tokens": 64}
    rows = bench.run_in_subprocess(spec, timeout=30)
    assert rows[0]["batch"] == 3 and "error" not in rows[0]
    worker = int(pid_file.read_text())
    assert _gone(worker), f"worker stand-in {worker} outlived its engine"


def test_engine_subprocess_streams_results_and_keeps_them_on_timeout(tmp_path, monkeypatch):
    # The child reports the first context, then hangs.
    pid_file = _stand_in_child(
        tmp_path, monkeypatch,
        "print('Using SNAPMLA attention backend', file=sys.stderr, flush=True)\n"
        "time.sleep(60)\n")
    seen = []
    spec = {"heads": 16, "contexts": [16384, 32768], "kv": "fp8", "gen_tokens": 64}
    rows = bench.run_in_subprocess(spec, timeout=5, on_result=seen.append)
    assert [r["context"] for r in seen] == [16384]
    assert rows[0]["batch"] == 3 and rows[0]["backend"] == "SNAPMLA" and "error" not in rows[0]
    assert rows[1]["error"] == "timed out after 5 s"
    # The whole session is killed: no engine process is left holding the GPU.
    grandchild = int(pid_file.read_text())
    assert _gone(grandchild), f"engine stand-in {grandchild} outlived the timeout"


def _row(heads, context, kv, tok_s, capacity, **extra):
    return {"heads": heads, "context": context, "kv": kv, "backend": kv.upper(), "batch": 8,
            "gen_tokens": 513, "kv_cache_tokens": capacity, "decode_tok_s": tok_s,
            "tpot_ms": 1.0, **extra}


def _sweep(rng):
    rows = []
    for heads in (128, 16):
        for context in (16384, 65536):
            base_speed, base_capacity = rng.uniform(1e3, 2e4), rng.randint(10**5, 10**7)
            rows.append(_row(heads, context, "auto", base_speed, base_capacity))
            rows.append(_row(heads, context, "fp8_snapmla", base_speed * 1.5,
                             round(base_capacity * 1.756)))
            rows.append(_row(heads, context, "fp8", base_speed * 0.9, base_capacity * 2))
    return rows


def test_relative_columns_compare_with_bf16_of_the_same_shape():
    rows = bench.add_relative_columns(_sweep(random.Random(3)))
    for row in rows:
        expected = {"auto": 1.0, "fp8_snapmla": 1.5, "fp8": 0.9}[row["kv"]]
        assert row["speedup_vs_bf16"] == pytest.approx(expected, abs=1e-3)
    snap = [r for r in rows if r["kv"] == "fp8_snapmla"]
    assert all(r["capacity_vs_bf16"] == pytest.approx(1.756, abs=2e-3) for r in snap)
    # No usable BF16 row: no ratio rather than a wrong one.
    lone = bench.add_relative_columns([
        _row(16, 8192, "auto", 0, 0, error="timed out"), _row(16, 8192, "fp8", 5.0, 7)])
    assert lone[1]["speedup_vs_bf16"] == "" and lone[1]["capacity_vs_bf16"] == ""
    # A side that was not lock-step (its B / step overstates the throughput): no speedup, also
    # when read back from a CSV; the capacity ratio stays.
    for flag in (False, "False"):
        pair = bench.add_relative_columns([_row(16, 8192, "auto", 4.0, 7, lock_step=flag),
                                           _row(16, 8192, "fp8", 5.0, 14)])
        assert pair[1]["speedup_vs_bf16"] == "" and pair[1]["capacity_vs_bf16"] == 2.0
        pair = bench.add_relative_columns([_row(16, 8192, "auto", 4.0, 7),
                                           _row(16, 8192, "fp8", 5.0, 14, lock_step=flag)])
        assert pair[1]["speedup_vs_bf16"] == "" and pair[0]["speedup_vs_bf16"] == 1.0


def test_outputs_merge_across_runs_and_survive_failures(tmp_path):
    rng = random.Random(4)
    first = _sweep(rng)
    bench.write_outputs(first[:6], tmp_path, "run A")          # H=128 in one command
    rows = bench.write_outputs(first[6:], tmp_path, "run B")   # H=16 in the next
    assert len(rows) == 12
    assert [bench._key(r) for r in rows] == sorted(
        (bench._key(r) for r in rows),
        key=lambda k: (k[0], -k[1], k[2], bench.KV_SETTINGS.index(k[3])))
    # Re-running one setting replaces its row; a failure is recorded, not dropped.
    failed = {"heads": 16, "context": 65536, "kv": "fp8", "gen_tokens": 513,
              "error": "exit 1: CUDA out of memory"}
    rows = bench.write_outputs([failed], tmp_path, "run B")
    assert len(rows) == 12
    comments, on_disk = engine_lib.read_csv(tmp_path / "results.csv")
    assert comments == ["run A", "run B"]
    assert [bench._key(r) for r in on_disk] == [bench._key(r) for r in rows]
    by_key = {bench._key(r): r for r in on_disk}
    assert by_key[(1, 16, 65536, "fp8")]["error"].startswith("exit 1")
    assert float(by_key[(1, 128, 16384, "fp8_snapmla")]["speedup_vs_bf16"]) == pytest.approx(1.5)
    table = (tmp_path / "results.md").read_text().splitlines()
    assert table[:3] == ["run 1: run A", "run 2: run B", ""]
    assert len(table) == 3 + 2 + 12
    assert any("failed: exit 1: CUDA out of memory" in line for line in table)
    snap_line = next(line for line in table if "| 1 | 128 | 16384 | fp8_snapmla |" in line)
    assert "1.50" in snap_line and "1.756" in snap_line


def test_ratios_only_against_bf16_of_the_same_run(tmp_path):
    """A setting measured by another command (here with a 6x smaller KV budget) gets no ratio
    against the folder's BF16 row; rerun together, it does."""
    bench.write_outputs([_row(128, 16384, "auto", 100.0, 24_000)], tmp_path, "24 GiB run")
    rows = bench.write_outputs([_row(128, 16384, "fp8_snapmla", 50.0, 7_000)], tmp_path,
                               "4 GiB run")
    snap = next(r for r in rows if r["kv"] == "fp8_snapmla")
    assert snap["run"] == 2 and snap["speedup_vs_bf16"] == "" and snap["capacity_vs_bf16"] == ""
    rows = bench.write_outputs([_row(128, 16384, "auto", 40.0, 4_000),
                                _row(128, 16384, "fp8_snapmla", 50.0, 7_000)], tmp_path,
                               "4 GiB run")
    snap = next(r for r in rows if r["kv"] == "fp8_snapmla")
    assert snap["speedup_vs_bf16"] == 1.25 and snap["capacity_vs_bf16"] == 1.75
    # Rows recorded before the run column pair among themselves.
    old = bench.add_relative_columns([_row(16, 8192, "auto", 4.0, 7),
                                      _row(16, 8192, "fp8", 5.0, 14)])
    assert old[1]["speedup_vs_bf16"] == 1.25


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = bench.add_relative_columns(_sweep(random.Random(5)))
    assert bench.plot(rows, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _Output:
    def __init__(self, request_id, new_tokens, core_ts):
        self.request_id = request_id
        self.outputs = [type("Completion", (), {"token_ids": [7] * new_tokens})()]
        self.metrics = None if core_ts is None else type("Stats", (), {"last_token_ts": core_ts})()


class _FakeEngine:
    """vLLM's LLMEngine as bench_e2e drives it: chunked prefill (request i gets its first token
    at step first_token[i]), then one token per step, DELTA outputs.  The core's clock (the
    outputs' metrics.last_token_ts, or none with `core_stamps=False`) advances by `decode_s` a
    step when every request decodes and by `mixed_s` otherwise; the front end's clock, `clock()`,
    by that plus a random lag of up to `lag_s` (output processing that falls behind).  `skip`:
    (step, request) pairs in which that request produces nothing (as if preempted)."""

    def __init__(self, first_token, max_tokens, decode_s, mixed_s, skip=(), lag_s=0.0,
                 core_stamps=True, seed=0, tokens_per_step=1):
        self.first_token, self.max_tokens = first_token, max_tokens
        self.tokens_per_step = tokens_per_step
        self.decode_s, self.mixed_s, self.skip = decode_s, mixed_s, set(skip)
        self.lag_s, self.core_stamps, self.rng = lag_s, core_stamps, random.Random(seed)
        self.core_now, self.now, self.steps, self.requests, self.aborted = 1.0, 0.0, 0, {}, []

    def clock(self):
        return self.now

    def add_request(self, request_id, prompt, params):
        assert params == "delta-params"
        self.requests[request_id] = 0

    def has_unfinished_requests(self):
        return any(n < self.max_tokens for n in self.requests.values())

    def step(self):
        live = [r for r, n in self.requests.items() if n < self.max_tokens]
        decoding = all(self.steps >= self.first_token[i] for i in range(len(self.requests)))
        step_s = self.decode_s if decoding else self.mixed_s
        self.core_now += step_s
        self.now += step_s + self.rng.uniform(0, self.lag_s)
        outputs = []
        for i, r in enumerate(self.requests):
            if r in live and self.steps >= self.first_token[i] and (self.steps, i) not in self.skip:
                n = self.tokens_per_step
                self.requests[r] += n
                outputs.append(_Output(r, n, self.core_now if self.core_stamps else None))
        self.steps += 1
        return outputs

    def abort_request(self, ids):
        self.aborted += ids
        for r in ids:
            self.requests[r] = self.max_tokens


def test_decode_windows_time_only_steps_in_which_every_request_decodes():
    rng = random.Random(6)
    batch = rng.randint(2, 40)
    first_token = sorted(rng.randint(0, 30) for _ in range(batch))
    steps, windows = rng.randint(5, 50), 3
    # The front end lags the core by up to 5 ms a step: the core's timestamps still give the
    # core's step time.
    engine = _FakeEngine(first_token, max_tokens=10_000, decode_s=0.0123, mixed_s=5.0,
                         lag_s=0.005)
    seconds, lock_step, prefill_steps, timer = engine_lib.timed_decode_windows(
        engine, [{}] * batch, "delta-params", steps, windows, clock=engine.clock)
    assert seconds == [pytest.approx(0.0123)] * windows   # no mixed (prefill) step timed
    assert lock_step and prefill_steps == first_token[-1] + 1 and timer == "engine core"
    assert len(engine.aborted) == batch and not engine.has_unfinished_requests()
    summary = engine_lib.summarize_windows(batch, seconds)
    assert summary["tpot_ms"] == pytest.approx(12.3)
    assert summary["decode_tok_s"] == pytest.approx(batch / 0.0123, rel=1e-4)
    assert summary["spread_pct"] == pytest.approx(0, abs=1e-6) and summary["timing_ok"] is True
    # Without core timestamps (stats off) the step() calls are timed instead.
    engine = _FakeEngine(first_token, max_tokens=10_000, decode_s=0.0123, mixed_s=5.0,
                         core_stamps=False)
    seconds, _, _, timer = engine_lib.timed_decode_windows(
        engine, [{}] * batch, "delta-params", steps, windows, clock=engine.clock)
    assert seconds == [pytest.approx(0.0123)] * windows and timer == "step() calls"


def test_decode_windows_count_the_tokens_of_speculative_steps():
    """With one accepted draft token per step, each request gains 2 tokens per step: the
    windows report them (and are not lock-step)."""
    engine = _FakeEngine([0, 2], max_tokens=10_000, decode_s=0.01, mixed_s=1.0,
                         tokens_per_step=2)
    gained = []
    seconds, lock_step, _, _ = engine_lib.timed_decode_windows(
        engine, [{}] * 2, "delta-params", 8, 3, clock=engine.clock, window_tokens=gained)
    assert gained == [2 * 2 * 8] * 3 and not lock_step
    assert seconds == [pytest.approx(0.01)] * 3


def test_decode_windows_flag_a_request_that_skips_a_timed_step():
    engine = _FakeEngine([0, 3, 5], max_tokens=10_000, decode_s=0.01, mixed_s=1.0,
                         skip=[(5 + 1 + engine_lib.SETTLE_STEPS + 4, 1)])
    _, lock_step, _, _ = engine_lib.timed_decode_windows(engine, [{}] * 3, "delta-params", 8, 2,
                                                    clock=engine.clock)
    assert not lock_step
    # Requests that finish inside the windows (max_tokens too small) are flagged the same way.
    engine = _FakeEngine([0, 3, 5], max_tokens=12, decode_s=0.01, mixed_s=1.0)
    _, lock_step, _, _ = engine_lib.timed_decode_windows(engine, [{}] * 3, "delta-params", 8, 2,
                                                    clock=engine.clock)
    assert not lock_step


def test_decode_windows_stop_when_the_engine_drops_requests_before_their_first_token():
    # An engine with nothing left to run while some request has no token would otherwise be
    # stepped forever.
    engine = _FakeEngine([0, 50], max_tokens=0, decode_s=0.01, mixed_s=1.0)
    with pytest.raises(RuntimeError, match="before all of them"):
        engine_lib.timed_decode_windows(engine, [{}] * 2, "delta-params", 4, 1, clock=engine.clock)
    assert engine.aborted   # cleaned up all the same


def test_window_summary_flags_windows_that_disagree():
    assert engine_lib.summarize_windows(10, [0.010, 0.0104])["timing_ok"] is True
    noisy = engine_lib.summarize_windows(10, [0.010, 0.012, 0.011])
    assert noisy["timing_ok"] is False
    assert noisy["spread_pct"] == pytest.approx(100 * 0.002 / 0.011, abs=0.01)
    assert engine_lib.summarize_windows(10, [0.010])["timing_ok"] == ""   # one window: unknown
    with pytest.raises(ValueError):
        engine_lib.summarize_windows(10, [])


@pytest.mark.parametrize("extra", [["--gen-tokens", "0"], ["--windows", "0"],
                                   ["--max-batch", "0"]])
def test_options_that_fail_after_engine_start_are_refused(extra, capsys):
    """--gen-tokens 0 became 512 silently; zero windows or steps failed only in the engine."""
    with pytest.raises(SystemExit):
        bench.main(["--out", "unused", *extra])
    assert "must be at least 1" in capsys.readouterr().err


def test_run_engine_sizes_each_context_with_plan_context(monkeypatch):
    # run_engine on a stand-in engine (the GPU path's bookkeeping): the batch and max_tokens of
    # each context are plan_context's on the engine's pages less the null block, with the
    # engine's token budget; a context no request fits in reports why and the next one runs.
    from types import SimpleNamespace

    timed_tokens = (engine_lib.SETTLE_STEPS + 16) * 2

    def batch(pages):
        return bench.plan_context(pages, 64, 16320, timed_tokens, 1, 16384, 512)["batch"]

    # A cache where the null block decides the batch: one page more would hold one more request.
    blocks = next(n for n in range(10_000, 12_000) if batch(n - 1) != batch(n))
    cache = SimpleNamespace(num_gpu_blocks=blocks, block_size=64)
    config = SimpleNamespace(cache_config=cache,
                             scheduler_config=SimpleNamespace(max_num_batched_tokens=16384))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config))
    built, timed = {}, []
    monkeypatch.setattr(bench, "build_llm", lambda *a, **k: built.update(args=a, kw=k) or llm)
    monkeypatch.setattr(bench, "warm_up", lambda *a: None)

    def windows(engine, prompts, params, gen, count, id_prefix, window_tokens,
                after_windows=None):
        assert after_windows is None                          # no --profile-steps
        timed.append((len(prompts), params.max_tokens))
        window_tokens += [len(prompts) * gen * 2] * count     # two tokens per request and step
        return [0.002] * count, True, 7, "engine core"

    monkeypatch.setattr(bench, "timed_decode_windows", windows)
    spec = {"model": "m", "kv": "fp8_snapmla", "contexts": [16320, 10**7], "gen_tokens": 8,
            "windows": 2, "kv_cache_gib": 1.0, "max_batch": 512, "vocab": 100,
            "speculative_config": {"method": "mtp", "num_speculative_tokens": 1},
            "tensor_parallel_size": 2}
    results = list(bench.run_engine(spec))
    assert built["kw"]["tensor_parallel_size"] == 2
    assert results[0]["kind"] == "engine" and results[0]["start_s"] >= 0
    assert results[0]["kv_cache_tokens"] == cache.num_gpu_blocks * 64
    assert results[1]["context_s"] >= 0
    # Each row carries its engine's start-up and its context's time (the time models' check).
    rows = bench.parse_engine_log(spec | {"heads": 16}, results, "", None)
    assert rows[0]["start_s"] == results[0]["start_s"]
    assert rows[0]["context_s"] == results[1]["context_s"]
    plan = bench.plan_context(blocks - 1, 64, 16320, timed_tokens, 1, 16384, 512)
    first, second = results[1:]
    assert (first["batch"], first["max_tokens"]) == (plan["batch"], plan["max_tokens"])
    assert timed == [(plan["batch"], plan["max_tokens"])]
    assert first["tokens_per_step"] == 2.0 and first["decode_tok_s"] == plan["batch"] / 0.002
    assert second["context"] == 10**7 and "no request" in second["error"]
    # max_model_len leaves room for the longest context's warm-up and timed tokens.
    assert built["args"][2] == 10**7 + bench.MAX_WARM_TOKENS + (engine_lib.SETTLE_STEPS + 16) * 2


def test_run_engine_profiles_extra_decode_steps_after_the_windows(monkeypatch):
    # With profile_steps the requests get room for them, the steps run after the timed windows
    # under the profiler, and the context's result carries their per-step profile.
    from types import SimpleNamespace

    cache = SimpleNamespace(num_gpu_blocks=2000, block_size=64)
    config = SimpleNamespace(cache_config=cache,
                             scheduler_config=SimpleNamespace(max_num_batched_tokens=16384))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config))
    monkeypatch.setattr(bench, "build_llm", lambda *a, **k: llm)
    monkeypatch.setattr(bench, "warm_up", lambda *a: None)
    steps_run, max_tokens = [], []

    def windows(engine, prompts, params, gen, count, id_prefix, window_tokens,
                after_windows=None):
        max_tokens.append(params.max_tokens)
        window_tokens += [len(prompts) * gen] * count
        after_windows(lambda: steps_run.append("step"), {})
        return [0.002] * count, True, 7, "engine core"

    def fake_profiled(work):
        work()
        kernels = [("void snapmla::sm90::decode_narrow_kernel<16>(x)", 10 * s, 10 * s + 4)
                   for s in range(3)]
        kernels += [("fused_moe_kernel", 10 * s + 4, 10 * s + 7) for s in range(3)]
        return 60.0, kernels, [("cudaGraphLaunch", 6.0)] * 3

    monkeypatch.setattr(bench, "timed_decode_windows", windows)
    monkeypatch.setattr(bench, "profiled", fake_profiled)
    spec = {"model": "m", "kv": "fp8_snapmla", "contexts": [4096], "gen_tokens": 8,
            "windows": 2, "kv_cache_gib": 1.0, "max_batch": 512, "vocab": 100,
            "profile_steps": 3}
    engine, result = list(bench.run_engine(spec))
    assert steps_run == ["step"] * 3
    without = bench.plan_context(1999, 64, 4096, engine_lib.SETTLE_STEPS + 16, 0, 16384, 512)
    assert max_tokens == [without["max_tokens"] + 3]
    profile = result["profile"]
    assert profile["wall_us"] == 20.0 and profile["busy_us"] == 7.0
    assert profile["groups_us"] == {"attention": 4.0, "MoE": 3.0, "GEMMs": 0.0, "other": 0.0}
    assert profile["host_us"] == 6.0 and profile["waits_per_step"] == 0


def test_tensor_parallel_rows_pair_and_plot_apart_from_one_gpu_rows(tmp_path):
    # A TP8 run of the 128-head model into a folder holding one-GPU rows (written before the
    # tp column existed: no tp) keeps both, and each pairs with BF16 of its own parallelism.
    one_gpu = [_row(128, 32768, "auto", 100.0, 10), _row(128, 32768, "fp8_snapmla", 120.0, 17)]
    bench.write_outputs(one_gpu, tmp_path, "run A")
    tp8 = [_row(128, 32768, "auto", 300.0, 10, tp=8),
           _row(128, 32768, "fp8_snapmla", 600.0, 17, tp=8)]
    rows = bench.write_outputs(tp8, tmp_path, "run B")
    speedups = {(bench._tp(r), r["kv"]): r["speedup_vs_bf16"] for r in rows}
    assert speedups == {(1, "auto"): 1.0, (1, "fp8_snapmla"): 1.2,
                        (8, "auto"): 1.0, (8, "fp8_snapmla"): 2.0}
    table = (tmp_path / "results.md").read_text()
    assert "| 2 | 8 | 128 | 32768 | fp8_snapmla |" in table
    assert "| 1 | 1 | 128 | 32768 | fp8_snapmla |" in table


def test_tp_must_divide_the_heads_and_fit_the_visible_gpus(monkeypatch, capsys):
    for argv, message in ((["--heads", "128", "16", "--tp", "32"], "divide every head count"),
                          (["--heads", "128", "--tp", "0"], "must be at least 1"),
                          (["--tp", "8"], "--tp needs --heads")):
        with pytest.raises(SystemExit):
            bench.main(["--out", "unused", *argv])
        assert message in capsys.readouterr().err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(SystemExit):
        bench.main(["--out", "unused", "--heads", "128", "--tp", "8"])
    assert "--tp 8 needs 8 GPUs; 2 visible" in capsys.readouterr().err


def test_tp_reaches_the_engine_and_its_rows(monkeypatch, tmp_path):
    specs = []

    def fake_engine(spec, timeout, on_result=None):
        specs.append(spec)
        return bench.parse_engine_log(spec, [], "", "stand-in: no engine")

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.setattr(bench, "run_in_subprocess", fake_engine)
    monkeypatch.setattr(bench, "write_tiny_deepseek_v3", lambda path, **kw: path)
    bench.main(["--out", str(tmp_path), "--heads", "128", "--tp", "8", "--kv", "auto",
                "--contexts", "32768"])
    assert [s["tensor_parallel_size"] for s in specs] == [8]
    _, rows = engine_lib.read_csv(tmp_path / "results.csv")
    assert [(r["tp"], r["heads"], r["error"]) for r in rows] == [("8", "128",
                                                                  "stand-in: no engine")]


def test_build_llm_passes_tensor_parallelism_only_when_asked(monkeypatch):
    import sys
    from types import ModuleType

    made = []
    fake = ModuleType("vllm")
    fake.LLM = lambda **kwargs: made.append(kwargs)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    engine_lib.build_llm("m", "fp8_snapmla", 4096, 1.0, 8)
    engine_lib.build_llm("m", "fp8_snapmla", 4096, 1.0, 8, tensor_parallel_size=8)
    assert "tensor_parallel_size" not in made[0]
    assert made[1]["tensor_parallel_size"] == 8
    assert made[1]["kv_cache_memory_bytes"] == 2**30      # per GPU, as vLLM reads it


@pytest.mark.parametrize("visible, count", [("0,1,2", 3), ("", 0), ("-1", 0), ("0,-1,2", 1),
                                            ("GPU-8f2c,GPU-11ab", 2)])
def test_visible_gpus_counts_what_cuda_would_use(monkeypatch, visible, count):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert engine_lib.visible_gpus() == count
