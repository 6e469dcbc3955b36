"""benchmarks.bench_deployment without a GPU: the per-rank weight and KV-budget arithmetic, the
proxy models' routing and shards, vLLM's acceptance of the FP8 block-quantized proxy, and the
report writer."""

import csv
import os
from pathlib import Path

import pytest

from benchmarks import bench_deployment as dep


def test_whole_model_weights_are_deepseek_v31_sized():
    whole = dep.rank_weight_bytes(dep.Rank("whole", dp=1, tp=1, ep=1))
    # 671B parameters, mostly FP8 (one byte), the embedding and LM head in BF16.
    assert 660e9 < sum(whole.values()) < 700e9
    assert 650e9 < whole["routed_experts"] < 660e9
    # Every configuration holds an eighth of the routed experts, whichever way it shards them.
    for rank in dep.CONFIGS.values():
        share = dep.rank_weight_bytes(rank)["routed_experts"]
        assert share == pytest.approx(whole["routed_experts"] / 8, rel=1e-3)


def test_kv_budget_grows_with_tensor_parallelism_and_fits_the_gpu():
    budgets = {name: dep.kv_budget(rank, reserve_gib=6.0) for name, rank in dep.CONFIGS.items()}
    assert (budgets["dp8-tp1-ep8"]["kv_bytes"] < budgets["dp4-tp2-ep8"]["kv_bytes"]
            < budgets["dp1-tp8"]["kv_bytes"])
    for b in budgets.values():
        assert b["weight_bytes"] + b["reserve_bytes"] + b["kv_bytes"] <= b["usable_bytes"]
        assert b["kv_bytes_per_layer"] == b["kv_bytes"] // 61
        # fp8_snapmla holds 1152/656 times the BF16 tokens.
        assert b["tokens"]["fp8_snapmla"] / b["tokens"]["auto"] == pytest.approx(1152 / 656,
                                                                                 rel=1e-4)
    with pytest.raises(ValueError, match="no KV cache"):
        dep.kv_budget(dep.CONFIGS["dp8-tp1-ep8"], reserve_gib=40.0)


@pytest.mark.parametrize("name, heads, experts, top_k, width, vocab", [
    ("dp8-tp1-ep8", 128, 32, 8, 2048, 129280),   # 8B pairs over a rank's 32 experts
    ("dp4-tp2-ep8", 64, 32, 4, 2048, 64640),     # 4 DP groups: 4B pairs
    ("dp1-tp8", 16, 256, 8, 256, 16160),         # TP-sharded experts, DeepSeek's routing
])
def test_proxy_models_are_the_ranks_share(name, heads, experts, top_k, width, vocab):
    config = dep.proxy_model_config(dep.CONFIGS[name])
    assert config["num_attention_heads"] == heads
    assert (config["n_routed_experts"], config["num_experts_per_tok"]) == (experts, top_k)
    assert config["moe_intermediate_size"] == width and config["vocab_size"] == vocab
    assert config["num_hidden_layers"] == 4 and config["first_k_dense_replace"] == 1
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert config["n_group"] <= config["n_routed_experts"]


def _proxy_engine(name: str, mtp: bool) -> dict:
    import pathlib
    import tempfile

    from tests.unit._vllm_cpu import engine_config
    from vllm_snapmla.testing import write_tiny_deepseek_v3

    overrides = {**dep.proxy_model_config(dep.CONFIGS[name]),
                 **({"num_nextn_predict_layers": 1} if mtp else {})}
    model = write_tiny_deepseek_v3(pathlib.Path(tempfile.mkdtemp()) / name, **overrides)
    extra = {"speculative_config": dep.MTP_SPEC} if mtp else {}
    config = engine_config(str(model), kv_cache_dtype="fp8_snapmla", load_format="dummy",
                           skip_tokenizer_init=True, max_model_len=4096, **extra)
    spec = config.speculative_config
    return {"quantization": config.model_config.quantization,
            "heads": config.model_config.get_num_attention_heads(config.parallel_config),
            "use_mla": config.model_config.use_mla,
            "draft_tokens": spec.num_speculative_tokens if spec else 0}


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
@pytest.mark.parametrize("name", sorted(dep.CONFIGS))
def test_vllm_accepts_the_proxy_models(name, mtp):
    from tests.unit._vllm_cpu import shared_process

    got = shared_process().call(_proxy_engine, name=name, mtp=mtp)
    assert got == {"quantization": "fp8", "heads": dep.CONFIGS[name].heads, "use_mla": True,
                   "draft_tokens": 1 if mtp else 0}


def test_report_has_speedups_per_config_and_context(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"config": "dp1-tp8", "heads": 16, "kv": kv, "context": c, "batch": 4,
             "decode_tok_s": tok, "tpot_ms": 1.0}
            for c in (16384, 32768) for kv, tok in (("auto", 100.0), ("fp8_snapmla", 150.0))]
    rows.append({"config": "dp1-tp8", "heads": 16, "kv": "fp8", "context": 16384,
                 "error": "KV cache holds no request of this length"})
    # MTP rows compare with auto + MTP, not with plain auto.
    rows += [{"config": "dp1-tp8", "heads": 16, "kv": kv, "mtp": True, "context": 16384,
              "batch": 4, "decode_tok_s": tok, "tpot_ms": 1.2, "tokens_per_step": 1.02,
              "projected_output_tok_s": tok * 1.85}
             for kv, tok in (("auto", 80.0), ("fp8_snapmla", 100.0))]
    dep.write_outputs(rows, tmp_path, "header", "budget")
    with open(tmp_path / "deployment.csv") as f:
        got = [r for r in csv.DictReader(f for f in f if not f.startswith("#"))]
    speed = {(r["kv"], r["context"], r["mtp"]): r["speedup_vs_auto"] for r in got}
    assert float(speed[("fp8_snapmla", "32768", "")]) == pytest.approx(1.5)
    assert speed[("fp8", "16384", "")] == ""
    assert float(speed[("fp8_snapmla", "16384", "True")]) == pytest.approx(1.25)
    text = (tmp_path / "deployment.md").read_text()
    assert "1.50x" in text and "KV cache holds no request" in text
    assert "fp8_snapmla + MTP" in text and "185" in text
    assert (tmp_path / "deployment.png").stat().st_size > 0


def test_no_speedup_where_steps_were_not_lock_step(tmp_path):
    """A row without MTP whose timed steps were not one token per request (preemption, a
    finished request) overstates B / step: no speedup, saying why, also read back from the
    CSV; the lock-step flag and the timer are kept in the CSV."""
    pytest.importorskip("matplotlib")

    def row(kv, tok, lock_step=True, mtp=False):
        return {"config": "dp1-tp8", "heads": 16, "kv": kv, "mtp": mtp, "context": 32768,
                "batch": 8, "decode_tok_s": tok, "tpot_ms": 8 / tok * 1e3,
                "lock_step": lock_step, "timer": "engine core", "max_tokens": 1024,
                "kv_cache_tokens": 300_000}

    rows = dep.add_speedups([row("auto", 100.0), row("fp8_snapmla", 170.0, lock_step=False)])
    assert rows[1]["speedup_vs_auto"] == ""
    rows = dep.add_speedups([row("auto", 100.0, lock_step="False"), row("fp8_snapmla", 170.0)])
    assert rows[1]["speedup_vs_auto"] == ""
    # With MTP a step gives 1 + accepted tokens: lock-step does not apply.
    rows = dep.add_speedups([row("auto", 100.0, lock_step=False, mtp=True),
                             row("fp8_snapmla", 170.0, lock_step=False, mtp=True)])
    assert rows[1]["speedup_vs_auto"] == pytest.approx(1.7)
    dep.write_outputs([row("auto", 100.0), row("fp8_snapmla", 170.0, lock_step=False)],
                      tmp_path, "run", "budget")
    with open(tmp_path / "deployment.csv") as f:
        got = list(csv.DictReader(line for line in f if not line.startswith("#")))
    assert [(r["kv"], r["lock_step"], r["timer"], r["speedup_vs_auto"]) for r in got] == [
        ("auto", "True", "engine core", "1.0"), ("fp8_snapmla", "False", "engine core", "")]
    table = (tmp_path / "deployment.md").read_text()
    assert "not lock-step" in table
    assert "| 32768 | 8 | 90% |" in table     # 8 x (32768 + 1024) of 300,000 tokens


def test_runs_of_separate_configurations_merge(tmp_path):
    pytest.importorskip("matplotlib")

    def row(config, kv, tok, mtp=False):
        return {"config": config, "heads": dep.CONFIGS[config].heads, "kv": kv, "mtp": mtp,
                "context": 32768, "batch": 8, "decode_tok_s": tok, "tpot_ms": 8 / tok * 1e3}

    dep.write_outputs([row("dp1-tp8", "auto", 100.0), row("dp1-tp8", "fp8_snapmla", 170.0),
                       row("dp1-tp8", "auto", 80.0, mtp=True),
                       row("dp1-tp8", "fp8_snapmla", 120.0, mtp=True)], tmp_path, "one", "b")
    dep.write_outputs([row("dp8-tp1-ep8", "auto", 50.0), row("dp8-tp1-ep8", "fp8_snapmla", 60.0),
                       row("dp1-tp8", "fp8_snapmla", 150.0)], tmp_path, "two", "b")
    with open(tmp_path / "deployment.csv") as f:
        lines = f.read().splitlines()
    assert lines[:2] == ["# one", "# two"]
    got = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    # Configurations in CONFIGS order, plain before MTP; the rerun dp1-tp8 fp8_snapmla row
    # replaced the first, and gets no speedup: its auto row is from the other run.
    assert [(r["run"], r["config"], r["kv"], r["mtp"], r["speedup_vs_auto"]) for r in got] == [
        ("2", "dp8-tp1-ep8", "auto", "False", "1.0"),
        ("2", "dp8-tp1-ep8", "fp8_snapmla", "False", "1.2"),
        ("1", "dp1-tp8", "auto", "False", "1.0"),
        ("2", "dp1-tp8", "fp8_snapmla", "False", ""),
        ("1", "dp1-tp8", "auto", "True", "1.0"),
        ("1", "dp1-tp8", "fp8_snapmla", "True", "1.5")]
    text = (tmp_path / "deployment.md").read_text()
    assert text.startswith("run 1: one\n\nrun 2: two\n") and "1.20x" in text and "1.50x" in text


def test_a_run_whose_rows_were_all_replaced_is_dropped_and_the_rest_renumbered(tmp_path):
    pytest.importorskip("matplotlib")

    def row(kv, tok, context=32768):
        return {"config": "dp1-tp8", "heads": 16, "kv": kv, "mtp": False, "context": context,
                "batch": 8, "decode_tok_s": tok, "tpot_ms": 8 / tok * 1e3}

    dep.write_outputs([row("auto", 100.0), row("fp8_snapmla", 170.0)], tmp_path, "old", "b")
    dep.write_outputs([row("auto", 90.0, 131072)], tmp_path, "kept", "b")
    dep.write_outputs([row("auto", 110.0), row("fp8_snapmla", 160.0)], tmp_path, "new", "b")
    with open(tmp_path / "deployment.csv") as f:
        lines = f.read().splitlines()
    # "old" has no row left: it goes, and "kept" and "new" become runs 1 and 2.
    assert [line for line in lines if line.startswith("#")] == ["# kept", "# new"]
    got = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    assert [(r["run"], r["kv"], r["context"], r["decode_tok_s"]) for r in got] == [
        ("2", "auto", "32768", "110.0"), ("1", "auto", "131072", "90.0"),
        ("2", "fp8_snapmla", "32768", "160.0")]
    text = (tmp_path / "deployment.md").read_text()
    assert text.startswith("run 1: kept\n\nrun 2: new\n") and "old" not in text


def test_engine_runs_plain_mtp_and_mtp_only():
    kvs = ["auto", "fp8_snapmla", "fp8"]
    assert dep.engine_runs(kvs, False, False) == [(kv, False) for kv in kvs]
    assert dep.engine_runs(kvs, True, False) == [(kv, False) for kv in kvs] + [
        ("auto", True), ("fp8_snapmla", True)]
    assert dep.engine_runs(kvs, False, True) == [("auto", True), ("fp8_snapmla", True)]
    # vLLM's fp8 has no MTP engine here; a list without auto gets fp8_snapmla's alone.
    assert dep.engine_runs(["fp8_snapmla", "fp8"], False, True) == [("fp8_snapmla", True)]


def test_mtp_layer_takes_weights_and_a_share_of_the_kv_cache():
    for rank in dep.CONFIGS.values():
        plain = dep.kv_budget(rank, reserve_gib=6.0)
        mtp = dep.kv_budget(rank, reserve_gib=6.0, mtp=True)
        weights = dep.rank_weight_bytes(rank, mtp=True)
        # The MTP module is one more MoE decoder layer (the rank's share of each of its
        # parts) plus the BF16 eh_proj (2 x 7168 -> 7168, replicated).
        one_moe_layer = (weights["attention"] / 61 + (weights["routed_experts"]
                         + weights["shared_experts"] + weights["router"]) / 58)
        assert weights["mtp_layer"] == pytest.approx(one_moe_layer + 2 * 2 * 7168**2, rel=1e-9)
        assert mtp["weight_bytes"] - plain["weight_bytes"] == weights["mtp_layer"]
        assert mtp["kv_bytes_per_layer"] == mtp["kv_bytes"] // 62
        assert mtp["kv_bytes_per_layer"] < plain["kv_bytes_per_layer"]


def test_spread_cell_flags_noisy_windows():
    assert dep._spread_cell("") == ""
    assert dep._spread_cell(0.8) == "0.8%"
    assert dep._spread_cell(23.5) == "23.5% (noisy)"


def test_speedup_uncertainty_adds_both_sides_spreads():
    ours = {"speedup_vs_auto": 1.6, "spread_pct": 1.0}
    assert dep.speedup_uncertainty(ours, {"spread_pct": 23.0}) == pytest.approx(1.6 * 0.12)
    # A row without windows' spread (older results) counts as exact.
    assert dep.speedup_uncertainty(ours, {}) == pytest.approx(1.6 * 0.005)


def _context_result(context: int) -> dict:
    """What a fake engine child reports for a context it timed (run_in_subprocess's results)."""
    return {"context": context, "batch": 4, "decode_tok_s": 100.0, "tpot_ms": 40.0,
            "spread_pct": 1.0, "timing_ok": True, "lock_step": True, "prefill_steps": 3,
            "tokens_per_step": 1.0}


@pytest.mark.parametrize("concurrent", [1, 3])
def test_main_runs_a_configurations_engines_in_groups(tmp_path, monkeypatch, concurrent,
                                                       capsys):
    import threading

    logged_routing = "uniform_random"   # what vLLM's engine log says (engine_log_facts)

    from benchmarks import bench_e2e, vllm_engine

    specs, live, most_live, saved_before = [], [0], [0], {}
    lock = threading.Lock()

    def fake_engine(spec, timeout, on_result, startup_timeout=None):
        with lock:
            specs.append(spec)
            live[0] += 1
        on_result({"kind": "engine", "kv_cache_tokens": 1000})
        vllm_engine.wait_for_go(spec.get("go_file"), poll_s=0.005)
        with lock:
            most_live[0] = max(most_live[0], live[0])
            # What is saved when this engine starts measuring: the engines before it.
            saved = tmp_path / "deployment.csv"
            with open(saved) if saved.exists() else open(os.devnull) as f:
                saved_before[spec["kv"]] = {r["kv"] for r in csv.DictReader(
                    line for line in f if not line.startswith("#"))}
        rows = []
        for context in spec["contexts"]:
            result = _context_result(context)
            on_result(result)
            rows.append({"heads": spec["heads"], "kv": spec["kv"], **result,
                         "simulated_routing": logged_routing})
        with lock:
            live[0] -= 1
        return rows

    monkeypatch.setattr(bench_e2e, "run_in_subprocess", fake_engine)
    dep.main(["--out", str(tmp_path), "--configs", "dp1-tp8", "--contexts", "32768",
              "--concurrent-starts", str(concurrent)])
    assert "3 engines over 1 configuration(s), estimated about" in capsys.readouterr().out
    assert sorted(s["kv"] for s in specs) == sorted(dep.KV_SETTINGS)
    assert len({s["model"] for s in specs}) == 3          # one proxy folder per engine
    if concurrent == 1:
        assert most_live[0] == 1 and not any(s.get("go_file") for s in specs)
    else:
        assert most_live[0] == 3
        assert all(s["gpu_memory_utilization"] == pytest.approx(0.8 / 3) for s in specs)
    with open(tmp_path / "deployment.csv") as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    assert {r["kv"] for r in rows} == set(dep.KV_SETTINGS)
    assert all(float(r["speedup_vs_auto"]) == pytest.approx(1.0) for r in rows)
    # Each engine's rows are saved when it ends, also inside a group.
    assert saved_before == {"auto": set(), "fp8_snapmla": {"auto"},
                            "fp8": {"auto", "fp8_snapmla"}}
    # Balanced routing by default, and max_num_seqs no larger than the cache can use.
    assert all(s["env"] == {"VLLM_MOE_ROUTING_SIMULATION_STRATEGY": "uniform_random"}
               for s in specs)
    assert {r["routing"] for r in rows} == {"uniform"}
    assert all(8 <= s["max_batch"] < 512 for s in specs)


def test_profile_steps_run_in_process_and_write_profiles_not_deployment_rows(tmp_path,
                                                                             monkeypatch):
    from benchmarks import bench_e2e

    specs = []
    attention = "void snapmla::sm90::decode_narrow_kernel<16>(x)"

    def fake_engine(spec, timeout, on_result, startup_timeout=None):
        specs.append(spec)
        on_result({"kind": "engine", "kv_cache_tokens": 1000})
        rows = []
        for context in spec["contexts"]:
            result = _context_result(context)
            on_result(result)
            if spec["kv"] != "fp8":   # fp8's context failed before its profile
                result["profile"] = {
                    "steps": 4, "wall_us": 3000.0, "busy_us": 2500.0,
                    "groups_us": {"attention": 1000.0, "MoE": 900.0, "GEMMs": 500.0,
                                  "other": 100.0},
                    "kernels": [(attention, 1000.0, 4.0), ("fused_moe_kernel", 900.0, 3.0)],
                    "host": [], "host_us": 800.0, "waits_per_step": 0.0, "waits_us": 0.0}
            rows.append({"heads": spec["heads"], "kv": spec["kv"], **result,
                         "simulated_routing": "uniform_random"})
        return rows

    monkeypatch.setattr(bench_e2e, "run_in_subprocess", fake_engine)
    dep.main(["--out", str(tmp_path), "--configs", "dp1-tp8", "--contexts", "16384",
              "--profile-steps", "4"])
    assert all(s["profile_steps"] == 4 for s in specs)
    assert all(s["env"] == {"VLLM_MOE_ROUTING_SIMULATION_STRATEGY": "uniform_random",
                            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"} for s in specs)
    assert not (tmp_path / "deployment.csv").exists()
    text = (tmp_path / "profile.md").read_text()
    assert "| dp1-tp8 | fp8_snapmla | 16384 | 4 | 40.00 | 3,000.0 | 2,500.0 | 1,000.0 | " \
           "900.0 | 500.0 | 100.0 | 800.0 | 0.0 |" in text
    assert "Not profiled:" in text and "dp1-tp8 fp8 16k" in text
    with open(tmp_path / "profile.csv") as f:
        kernels = list(csv.DictReader(line for line in f if not line.startswith("#")))
    assert {(r["kv"], r["group"]) for r in kernels} == {
        (kv, group) for kv in ("auto", "fp8_snapmla") for group in ("attention", "MoE")}
    if pytest.importorskip("matplotlib"):
        assert (tmp_path / "profile.png").stat().st_size > 0


def test_negative_profile_steps_are_refused(capsys):
    with pytest.raises(SystemExit):
        dep.main(["--profile-steps", "-1", "--budget-only"])
    assert "--profile-steps must be 0" in capsys.readouterr().err


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
@pytest.mark.parametrize("name", sorted(dep.CONFIGS))
def test_max_num_seqs_holds_every_batch_the_cache_fills(name, mtp):
    from benchmarks import bench_e2e, vllm_engine

    rank = dep.CONFIGS[name]
    layers = 1 + dep.MOE_LAYERS + int(mtp)
    kv_gib = layers * dep.kv_budget(rank, 6.0, mtp)["kv_bytes_per_layer"] / dep.GIB
    for kv in dep.KV_SETTINGS:
        bound = dep.largest_batch(kv, kv_gib, layers, dep.CONTEXTS, 512)
        assert bound % 8 == 0 and bound < 512
        # vLLM's page count is what estimated_kv_blocks computes; every context's batch fits.
        blocks = vllm_engine.estimated_kv_blocks(kv, kv_gib, layers)
        for context in dep.CONTEXTS:
            fills = vllm_engine.batch_to_fill(blocks, vllm_engine.BLOCK_SIZE, context,
                                              bench_e2e.SETTLE_STEPS, 10**6)
            assert fills <= bound
        # Not so generous that the short context's batch is far below it.
        shortest = vllm_engine.batch_to_fill(blocks, vllm_engine.BLOCK_SIZE, dep.CONTEXTS[0],
                                             0, 10**6)
        assert bound <= shortest * 9 // 8 + 8
    assert dep.largest_batch("fp8", 100.0, 4, [512], 512) == 512
    assert dep.largest_batch("fp8", 100.0, 4, [512], 100) == 96   # a multiple of 8


def test_the_router_on_dummy_weights_sends_every_token_to_the_same_experts():
    """Why --routing defaults to vLLM's routing simulator: with vLLM's dummy weights (uniform in
    +-1e-3) DeepSeek's sigmoid scores differ by ~1e-5 between experts while the score-correction
    bias differs by ~1e-3, so the bias alone picks the experts, the same ones for every token.
    If this fails, vLLM's dummy initialisation changed: revisit the default."""
    import torch

    from vllm.model_executor.model_loader.weight_utils import initialize_single_dummy_weight

    hidden, experts, top_k = 7168, 32, 8
    gate, bias, norm = torch.empty(experts, hidden), torch.empty(experts), torch.empty(hidden)
    for param in (gate, bias, norm):
        initialize_single_dummy_weight(param)
    x = torch.randn(1024, hidden, generator=torch.Generator().manual_seed(0))
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * norm     # RMSNorm
    picked = torch.topk(torch.sigmoid(h @ gate.T) + bias, top_k, dim=-1).indices
    assert len({tuple(sorted(row.tolist())) for row in picked}) == 1


def test_a_number_measured_without_the_asked_routing_is_not_reported(tmp_path, monkeypatch):
    from benchmarks import bench_e2e

    def fake_engine(spec, timeout, on_result, startup_timeout=None):
        on_result({"kind": "engine", "kv_cache_tokens": 1000})
        result = {"context": 32768, "batch": 4, "decode_tok_s": 100.0, "tpot_ms": 40.0,
                  "spread_pct": 1.0, "timing_ok": True, "lock_step": True, "prefill_steps": 3}
        on_result(result)
        # The engine log never mentioned the routing simulator.
        return [{"heads": spec["heads"], "kv": spec["kv"], **result, "simulated_routing": ""}]

    monkeypatch.setattr(bench_e2e, "run_in_subprocess", fake_engine)
    dep.main(["--out", str(tmp_path), "--configs", "dp1-tp8", "--contexts", "32768",
              "--kv", "auto"])
    with open(tmp_path / "deployment.csv") as f:
        (row,) = list(csv.DictReader(line for line in f if not line.startswith("#")))
    assert row["decode_tok_s"] == "" and "expected 'uniform_random'" in row["error"]
    # With --routing weights the same log is what was asked for.
    dep.main(["--out", str(tmp_path), "--configs", "dp1-tp8", "--contexts", "32768",
              "--kv", "auto", "--routing", "weights"])
    with open(tmp_path / "deployment.csv") as f:
        (row,) = list(csv.DictReader(line for line in f if not line.startswith("#")))
    assert float(row["decode_tok_s"]) == 100.0 and row["routing"] == "weights"


def test_a_deeper_proxy_keeps_the_per_layer_budget_and_its_own_rows(tmp_path, monkeypatch):
    import json

    from benchmarks import bench_e2e

    specs = []

    def fake_engine(spec, timeout, on_result, startup_timeout=None):
        with open(Path(spec["model"]) / "config.json") as f:
            specs.append({**spec, "layers": json.load(f)["num_hidden_layers"]})
        on_result({"kind": "engine", "kv_cache_tokens": 1000})
        result = {"context": 32768, "batch": 4, "decode_tok_s": 100.0 + len(specs),
                  "tpot_ms": 40.0, "spread_pct": 1.0, "timing_ok": True, "lock_step": True,
                  "prefill_steps": 3}
        on_result(result)
        return [{"heads": spec["heads"], "kv": spec["kv"], **result,
                 "simulated_routing": "uniform_random"}]

    monkeypatch.setattr(bench_e2e, "run_in_subprocess", fake_engine)
    common = ["--out", str(tmp_path), "--configs", "dp8-tp1-ep8", "--contexts", "32768",
              "--kv", "auto"]
    dep.main(common)
    dep.main(common + ["--moe-layers", "7"])
    shallow, deep = specs
    assert deep["kv_cache_gib"] == pytest.approx(shallow["kv_cache_gib"] * 8 / 4)
    assert (shallow["layers"], deep["layers"]) == (4, 8)
    with open(tmp_path / "deployment.csv") as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    assert [(r["layers"], r["decode_tok_s"]) for r in rows] == [("4", "101.0"), ("8", "102.0")]
    rank = dep.CONFIGS["dp8-tp1-ep8"]
    assert dep.proxy_weight_bytes(rank, moe_layers=7) > dep.proxy_weight_bytes(rank)
    with pytest.raises(SystemExit):
        dep.main(common + ["--moe-layers", "59"])


def test_plot_draws_a_deeper_proxy_with_mtp(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"config": "dp8-tp1-ep8", "heads": 128, "layers": layers, "kv": kv, "mtp": mtp,
             "context": c, "run": run, "decode_tok_s": tok, "spread_pct": 1.0}
            for run, layers in ((1, 4), (2, 16)) for mtp in (False, True)
            for c in (32768, 131072) for kv, tok in (("auto", 100.0), ("fp8_snapmla", 160.0))]
    dep.plot(dep.add_speedups(rows), tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


@pytest.mark.parametrize("extra, message", [
    (["--mtp-only", "--kv", "fp8"], "--mtp-only runs auto and fp8_snapmla"),
    (["--max-batch", "4"], "--max-batch must be at least 8"),
    (["--windows", "0"], "--windows and --gen-tokens must be at least 1"),
    (["--gen-tokens", "0"], "--windows and --gen-tokens must be at least 1"),
])
def test_options_that_would_run_nothing_or_fail_late_are_refused(extra, message, capsys):
    with pytest.raises(SystemExit):
        dep.main(["--out", "unused", "--configs", "dp8-tp1-ep8", *extra])
    assert message in capsys.readouterr().err


# Flags that give the recorded runs' settings under today's defaults, by the commit a run
# names: those runs predate the defaults of four 128-step windows and uniform routing
# (benchmarks/RESULTS.md gives the same flags).
RECORDED_DEFAULTS = {"9861e7f": ["--windows", "2", "--gen-tokens", "256", "--routing", "weights"]}
DEPLOYMENT_CSV = Path(dep.__file__).parent / "results" / "deployment" / "deployment.csv"
# The H200 runs the time model was calibrated on (the headers of results/deployment at
# `92e505f`); the uniform-routing runs on an H100 have replaced them all in the results file.
CALIBRATION_HEADERS = [
    f"2026-12-04 {t} UTC | commit 9861e7f | NVIDIA H200 | vLLM 0.26.0 | python -m "
    f"benchmarks.bench_deployment --out .../res/deployment --configs {args} --contexts 32768 131072"
    for t, args in [("12:09", "dp8-tp1-ep8 --kv auto fp8_snapmla"), ("12:17", "dp1-tp8"),
                    ("12:25", "dp4-tp2-ep8 --kv auto fp8_snapmla"),
                    ("12:30", "dp8-tp1-ep8 --mtp-only"), ("12:34", "dp1-tp8 --mtp-only")]]


def _run_args(header: str) -> tuple[float, list[str]]:
    """(start time in seconds, arguments as today's parser needs them) of a recorded run."""
    import datetime
    import shlex

    stamp, commit, *_, command = (part.strip() for part in header.split("|"))
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "benchmarks.bench_deployment"], command
    assert commit.startswith("commit "), header
    when = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M UTC").timestamp()
    return when, words[3:] + RECORDED_DEFAULTS.get(commit.split()[1], [])


def _estimate_problems(path: Path, calibration: list[str] = ()) -> tuple[int, list[str]]:
    """How many recorded times of ``path`` the dry run's estimate was checked against, and where
    it is not within 1x-4x of them.  The model is meant for an H200: runs on other GPUs are not
    checked.  Rows that recorded their engine's start-up and their context's time (start_s,
    context_s) are checked one by one.  The runs of RECORDED_DEFAULTS' commits (the file's and
    those of ``calibration``) predate those columns; they ran back to back, so each one's time
    is from its header's timestamp (to the minute) to the next one's."""
    from benchmarks.vllm_engine import read_csv

    comments, rows = read_csv(path)
    parser = dep.build_parser()
    checked, problems = 0, []
    legacy = sorted(_run_args(header) for header in dict.fromkeys(comments + list(calibration))
                    if header.split("|")[1].split()[1] in RECORDED_DEFAULTS)
    for (start, argv), (end, _) in zip(legacy, legacy[1:]):
        estimate = sum(seconds for *_, seconds in dep.estimate_plan(parser.parse_args(argv)))
        took = end - start
        checked += 1
        if not took - 60 <= estimate <= 4 * (took + 60):
            problems.append(f"{argv}: took {took:.0f} s, estimated {estimate:.0f} s")
    for row in rows:
        if not row.get("context_s") or row["error"]:
            continue
        header = comments[int(row["run"]) - 1]
        if "H200" not in header.split("|")[2]:
            continue
        args = parser.parse_args(_run_args(header)[1])
        args.contexts = [int(row["context"])]
        engine = dep.plan_engine(dep.CONFIGS[row["config"]], row["kv"], row["mtp"] == "True",
                                 args)
        took, estimate = float(row["context_s"]), engine.seconds[int(row["context"])]
        checked += 1
        if not took <= estimate <= 4 * took + 10:
            problems.append(f"{row['config']} {row['kv']} {row['context']}: took {took} s, "
                            f"estimated {estimate:.0f} s")
        if float(row["start_s"]) > dep.FIRST_START_S:
            problems.append(f"{row['config']} {row['kv']}: started in {row['start_s']} s")
    return checked, problems


def test_dry_run_estimates_within_1x_to_4x_of_the_recorded_runs():
    # New data outside the range means the time model needs recalibrating.
    checked, problems = _estimate_problems(DEPLOYMENT_CSV, CALIBRATION_HEADERS)
    assert checked >= 3 and not problems, problems


def test_recorded_engine_and_context_times_are_checked(tmp_path):
    # Rows of a run with the start_s and context_s columns: each context against its estimate.
    args = dep.build_parser().parse_args(["--contexts", "32768"])
    estimate = dep.plan_engine(dep.CONFIGS["dp1-tp8"], "fp8_snapmla", False, args).seconds[32768]
    header = ("2026-12-06 10:00 UTC | commit 0000000 | NVIDIA H200 | vLLM 0.26.0 | python -m "
              "benchmarks.bench_deployment --configs dp1-tp8 --contexts 32768")
    fields = ["run", "config", "kv", "mtp", "context", "start_s", "context_s", "error"]

    def problems(context_s, start_s=100.0):
        path = tmp_path / "deployment.csv"
        from benchmarks.vllm_engine import write_csv
        write_csv([{"run": 1, "config": "dp1-tp8", "kv": "fp8_snapmla", "mtp": False,
                    "context": 32768, "start_s": start_s, "context_s": context_s}],
                  path, fields, comments=[header])
        return _estimate_problems(path)

    assert problems(estimate / 2) == (1, [])
    assert len(problems(estimate * 1.5)[1]) == 1        # slower than estimated
    assert len(problems(estimate / 40)[1]) == 1         # far faster (4x, and 10 s)
    assert len(problems(estimate / 2, start_s=dep.FIRST_START_S + 1)[1]) == 1


def test_dry_run_plans_the_batches_the_recorded_runs_filled():
    # The decision bench_e2e.run_engine makes, on the cache vLLM is expected to allocate, with
    # each row's own run settings.  Rows with MTP are left out: they ran before the drafter's
    # layer got its own share of the KV budget.
    from benchmarks.vllm_engine import read_csv

    comments, rows = read_csv(DEPLOYMENT_CSV)
    parser = dep.build_parser()
    checked = 0
    for row in rows:
        if row["mtp"] == "True" or not row["batch"]:
            continue
        args = parser.parse_args(_run_args(comments[int(row["run"]) - 1])[1])
        args.contexts = [int(row["context"])]
        engine = dep.plan_engine(dep.CONFIGS[row["config"]], row["kv"], False, args)
        assert engine.batches[int(row["context"])] == int(row["batch"]), row
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_dry_run_plans_with_what_the_engine_will_have(monkeypatch, mtp):
    # What plan_engine hands bench_e2e.plan_context: the expected pages less vLLM's null
    # block, the timed tokens and the speculative ones, vLLM's LLM(...) token budget on an
    # H200, and the engine's max_num_seqs.
    from benchmarks import bench_e2e, vllm_engine

    calls = []
    monkeypatch.setattr(bench_e2e, "plan_context", lambda *a: calls.append(a) or
                        {"batch": 4, "max_tokens": 700, "reason": None})
    args = dep.build_parser().parse_args(["--contexts", "32768", "131072"])
    rank = dep.CONFIGS["dp4-tp2-ep8"]
    engine = dep.plan_engine(rank, "fp8_snapmla", mtp, args)
    layers = 1 + args.moe_layers + int(mtp)
    kv_gib = layers * dep.kv_budget(rank, args.reserve_gib, mtp)["kv_bytes_per_layer"] / dep.GIB
    draft = int(mtp)
    timed = (vllm_engine.SETTLE_STEPS + args.windows * args.gen_tokens) * (1 + draft)
    usable = vllm_engine.estimated_kv_blocks("fp8_snapmla", kv_gib, layers) - 1
    max_batch = dep.largest_batch("fp8_snapmla", kv_gib, layers, args.contexts, args.max_batch)
    assert calls == [(usable, 64, c, timed, draft, 16384, max_batch) for c in (32768, 131072)]
    assert engine.batches == {32768: 4, 131072: 4} and engine.max_batch == max_batch


def test_dry_run_prints_the_plan_and_starts_no_engine(monkeypatch, capsys):
    from benchmarks import bench_e2e

    def no_engine(*args, **kwargs):
        raise AssertionError("--dry-run started an engine")

    monkeypatch.setattr(bench_e2e, "run_in_subprocess", no_engine)
    dep.main(["--out", "unused", "--configs", "dp1-tp8", "dp8-tp1-ep8", "--mtp",
              "--concurrent-starts", "3", "--dry-run"])
    out = capsys.readouterr().out
    assert "dp1-tp8, 16 heads: 5 engines in 2 group(s)" in out
    assert "fp8_snapmla + MTP: 5 layers" in out
    assert "The whole run: about" in out
    assert not Path("unused").exists()


def test_estimate_grows_with_context_heads_and_groups():
    args = dep.build_parser().parse_args(["--contexts", "32768", "131072"])
    engine = dep.plan_engine(dep.CONFIGS["dp8-tp1-ep8"], "fp8_snapmla", False, args)
    # Prefill attention grows with the context squared: 128k costs more than 32k per token.
    assert engine.seconds[131072] > engine.seconds[32768]
    narrow = dep.plan_engine(dep.CONFIGS["dp1-tp8"], "fp8_snapmla", False, args)
    assert sum(narrow.seconds.values()) < sum(engine.seconds.values())
    # One engine at a time pays a start-up per engine; groups share theirs.
    one = dep.estimate_plan(dep.build_parser().parse_args(["--configs", "dp1-tp8"]))
    three = dep.estimate_plan(dep.build_parser().parse_args(
        ["--configs", "dp1-tp8", "--concurrent-starts", "3"]))
    assert one[0][2] - three[0][2] == pytest.approx(2 * dep.NEXT_START_S)
