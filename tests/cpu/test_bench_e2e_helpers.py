"""The pure-Python parts of benchmarks/bench_e2e.py: model shapes, batch sizing, decode rates,
result merging and the table/CSV/plot outputs (the vLLM runs themselves need a GPU)."""

import importlib.util
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import pytest

from vllm_snapmla import format as fmt
from vllm_snapmla.demo import write_tiny_deepseek_v3

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_e2e.py"
_spec = importlib.util.spec_from_file_location("bench_e2e", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("heads", [128, 16])
def test_model_config_has_deepseek_v31_attention_and_dense_layers(tmp_path, heads):
    path = write_tiny_deepseek_v3(tmp_path / "m", **bench.model_config(heads))
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
            >= max(bench.CONTEXTS) + bench.MAX_WARM_TOKENS + 512)


def test_batch_to_fill_counts_whole_pages_per_request():
    rng = random.Random(1)
    for _ in range(200):
        block = rng.choice([16, 64])
        context, gen = rng.randint(1, 200_000), rng.randint(2, 1000)
        blocks = rng.randint(0, 200_000)
        batch = bench.batch_to_fill(blocks, block, context, gen, max_batch=10**9)
        per_request = math.ceil((context + gen) / block)
        assert batch * per_request <= blocks < (batch + 1) * per_request
    assert bench.batch_to_fill(10_000, 64, 16384, 513, max_batch=7) == 7
    # The same bytes hold 1152/656 = 1.76x more fp8_snapmla tokens: the batch grows with them.
    budget = 24 * 2**30
    bf16 = bench.batch_to_fill(budget // (4 * 1152 * 64), 64, 16384, 513, 10**9)
    snap = bench.batch_to_fill(budget // (4 * fmt.BYTES_PER_TOKEN * 64), 64, 16384, 513, 10**9)
    assert 1.7 < snap / bf16 < 1.8


def test_decode_rates_divide_the_extra_tokens_by_the_extra_time():
    rng = random.Random(2)
    batch, steps = rng.randint(1, 512), rng.randint(1, 600)
    short = rng.uniform(1, 50)
    long = short + rng.uniform(0.5, 30)
    tok_s, tpot_ms = bench.decode_rates(batch, steps, short, long)
    assert tok_s == pytest.approx(batch * steps / (long - short))
    assert tpot_ms == pytest.approx(1000 * (long - short) / steps)
    assert tok_s * tpot_ms / 1000 == pytest.approx(batch)
    with pytest.raises(ValueError):
        bench.decode_rates(batch, 0, short, long)
    with pytest.raises(ValueError):
        bench.decode_rates(batch, steps, long, short)


def test_warm_tokens_outlast_the_chunked_prefill():
    rng = random.Random(3)
    for _ in range(200):
        batch, context = rng.randint(1, 512), rng.randint(1, 131072)
        budget = rng.randint(batch + 1, 65536)
        warm = bench.warm_tokens(batch, context, budget)
        # Steps the prefill needs at most: every step has budget - batch prompt tokens.
        steps = math.ceil(batch * context / (budget - batch))
        assert steps + 16 <= warm <= math.ceil(1.25 * steps) + 16
    # 28 requests of 32k with vLLM's default 8192-token budget: about 113 prefill steps.
    assert bench.warm_tokens(28, 32768, 8192) == math.ceil(1.25 * 113) + 16
    with pytest.raises(ValueError, match="no prefill budget"):
        bench.warm_tokens(512, 16384, 512)


def test_decode_window_needs_every_request_decoding_at_once():
    # Request 1 finished (last token at 5.0) before request 2 got its first token (6.0).
    assert not bench.decode_window_ok([1.0, 6.0], [5.0, 9.0])
    assert bench.decode_window_ok([1.0, 4.0], [5.0, 9.0])
    assert bench.decode_window_ok([2.0, 2.0], [2.0, 3.0])


def test_engine_log_gives_a_row_per_context_and_keeps_finished_ones():
    spec = {"heads": 128, "contexts": [16384, 32768, 65536], "kv": "fp8_snapmla",
            "gen_tokens": 512}
    result = {"context": 32768, "batch": 49, "warm_tokens": 158, "window_ok": True,
              "kv_cache_tokens": 1636800, "decode_tok_s": 1953.0, "tpot_ms": 25.1}
    log = ("INFO ... GPU KV cache size: 1,636,800 tokens\n"
           "INFO ... Using SNAPMLA attention backend\n"
           + bench.RESULT_TAG + json.dumps(result) + "\n")
    rows = bench.parse_engine_log(spec, log, "timed out after 600 s")
    assert [r["context"] for r in rows] == spec["contexts"]
    assert all(r["kv"] == "fp8_snapmla" and r["heads"] == 128 for r in rows)
    assert all(r["log_kv_cache_tokens"] == 1636800 and r["backend"] == "SNAPMLA" for r in rows)
    finished = rows[1]
    assert finished["decode_tok_s"] == 1953.0 and "error" not in finished
    assert rows[0]["error"] == rows[2]["error"] == "timed out after 600 s"
    # A clean exit that produced no result for a context still marks it as failed.
    assert bench.parse_engine_log(spec, "", None)[0]["error"] == "no result"


def test_engine_subprocess_streams_results_and_keeps_them_on_timeout(tmp_path, monkeypatch):
    # A stand-in child: reads the spec, starts a grandchild (as vLLM starts its engine core),
    # reports the first context, then hangs.
    child = tmp_path / "child.py"
    pid_file = tmp_path / "grandchild.pid"
    child.write_text(
        "import json, subprocess, sys, time\n"
        "spec = json.loads(sys.stdin.read())\n"
        "core = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(core.pid))\n"
        f"print({bench.RESULT_TAG!r} + json.dumps({{'context': spec['contexts'][0], "
        "'batch': 3, 'decode_tok_s': 10.0}), flush=True)\n"
        "print('Using SNAPMLA attention backend', file=sys.stderr, flush=True)\n"
        "time.sleep(60)\n")
    monkeypatch.setattr(bench, "child_command", lambda: [sys.executable, str(child)])
    seen = []
    spec = {"heads": 16, "contexts": [16384, 32768], "kv": "fp8", "gen_tokens": 64}
    rows = bench.run_in_subprocess(spec, timeout=5, on_result=seen.append)
    assert [r["context"] for r in seen] == [16384]
    assert rows[0]["batch"] == 3 and rows[0]["backend"] == "SNAPMLA" and "error" not in rows[0]
    assert rows[1]["error"] == "timed out after 5 s"
    # The whole session is killed: no engine process is left holding the GPU.
    grandchild = int(pid_file.read_text())
    for _ in range(50):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        if open(f"/proc/{grandchild}/stat").read().split()[2] == "Z":   # reaped by init later
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"engine stand-in {grandchild} outlived the timeout")


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


def test_outputs_merge_across_runs_and_survive_failures(tmp_path):
    rng = random.Random(4)
    first = _sweep(rng)
    bench.write_outputs(first[:6], tmp_path)          # H=128 in one command
    rows = bench.write_outputs(first[6:], tmp_path)   # H=16 in the next
    assert len(rows) == 12
    assert [bench._key(r) for r in rows] == sorted(
        (bench._key(r) for r in rows),
        key=lambda k: (-k[0], k[1], bench.KV_SETTINGS.index(k[2])))
    # Re-running one setting replaces its row; a failure is recorded, not dropped.
    failed = {"heads": 16, "context": 65536, "kv": "fp8", "gen_tokens": 513,
              "error": "exit 1: CUDA out of memory"}
    rows = bench.write_outputs([failed], tmp_path)
    assert len(rows) == 12
    on_disk = bench.read_csv(tmp_path / "results.csv")
    assert [bench._key(r) for r in on_disk] == [bench._key(r) for r in rows]
    by_key = {bench._key(r): r for r in on_disk}
    assert by_key[(16, 65536, "fp8")]["error"].startswith("exit 1")
    assert float(by_key[(128, 16384, "fp8_snapmla")]["speedup_vs_bf16"]) == pytest.approx(1.5)
    table = (tmp_path / "results.md").read_text().splitlines()
    assert len(table) == 2 + 12
    assert any("failed: exit 1: CUDA out of memory" in line for line in table)
    snap_line = next(line for line in table if "| 128 | 16384 | fp8_snapmla |" in line)
    assert "1.50" in snap_line and "1.756" in snap_line


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = bench.add_relative_columns(_sweep(random.Random(5)))
    assert bench.plot(rows, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_repeated_runs_use_medians_and_flag_a_spread_above_a_tenth_of_the_decode_time():
    rng = random.Random(5)
    shorts = [rng.uniform(10, 12) for _ in range(3)]
    longs = [s + rng.uniform(2, 3) for s in shorts]
    time_short, time_long, spread, ok = bench.repeated_times(shorts, longs)
    assert time_short == sorted(shorts)[1] and time_long == sorted(longs)[1]
    assert spread == pytest.approx(max(max(shorts) - min(shorts), max(longs) - min(longs)))
    assert ok is (spread <= bench.NOISE_FRACTION * (time_long - time_short))
    # The 2026-12-01 case: a 90 ms decode window in 11.6 s runs that vary by 0.1 s.
    assert bench.repeated_times([11.55, 11.65], [11.64, 11.74])[3] is False
    assert bench.repeated_times([11.55, 11.56], [13.0, 13.02])[3] is True
    assert bench.repeated_times([11.55], [11.64])[3] == ""   # one run: unknown
    with pytest.raises(ValueError):
        bench.repeated_times([1.0, 2.0], [3.0])
