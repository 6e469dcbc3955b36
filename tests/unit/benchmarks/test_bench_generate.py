"""benchmarks/bench_generate.py: the profile arithmetic, the summary and the orchestration,
with stand-ins for vLLM (the GPU run is in benchmarks/RESULTS.md)."""

import csv
import types

import pytest

from benchmarks import bench_generate as bench

# Kernel names as torch's profiler reported them for the two formats' decode steps (H100).
SNAPMLA = "void snapmla::sm90::decode_narrow_kernel<16>(CUtensorMap_st, CUtensorMap_st)"
FA3 = ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
       "flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>")
GEMM = "nvjet_sm90_tst_80x64_64x11_4x1_v_bz_TNN"


class OneTokenLLM:
    """An ``LLM`` stand-in whose every request generates one token."""

    def generate(self, prompts, params, use_tqdm):
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[0])])
                for _ in prompts]


def _one_call_child(specs: list):
    """A ``run_child`` stand-in: records each engine's spec, reports one timed call."""
    def run_child(command, spec, timeout, on_result=None):
        specs.append(spec)
        return ([{"kind": "engine", "start_s": 1.0},
                 {"kind": "call", "call": 1, "seconds": 1.0, "output_tokens": 4, "tok_s": 4.0}],
                "", None)
    return run_child


def _call_rows(out) -> list[dict]:
    with open(out / "generate.csv") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def _unset_until_teardown(monkeypatch, *names: str) -> None:
    """Unset ``names`` now and restore their earlier state after the test, also where the code
    under test sets them (``run_engine`` does): ``delenv`` of an absent variable records
    nothing to restore, so each is set first."""
    for name in names:
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)


@pytest.mark.parametrize("name, group", [
    (SNAPMLA, "attention"),
    ("snapmla::(anonymous namespace)::combine_kernel(snapmla::CombineParams)", "attention"),
    ("void snapmla::(anonymous namespace)::quantize_q_kernel<__nv_bfloat16>(x)", "attention"),
    (FA3, "attention"),
    ("void cutlass::device_kernel<flash::FlashAttnFwdCombine<cute::tuple<cute::C<8>>", "attention"),
    ("void vllm::concat_and_cache_mla_kernel<__nv_bfloat16, __nv_bfloat16>(x)", "attention"),
    (GEMM, "GEMMs"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float>(x)", "GEMMs"),
    ("triton_red_fused_fused_add_rms_norm_2", "other"),
    ("Memcpy HtoD (Pinned -> Device)", "other"),
])
def test_kernels_fall_into_the_group_their_name_says(name, group):
    assert bench.kernel_group(name) == group


def test_busy_time_counts_overlapping_kernels_once():
    assert bench.busy_us([]) == 0
    assert bench.busy_us([(0, 10)]) == 10
    assert bench.busy_us([(20, 30), (0, 10)]) == 20              # apart, out of order
    assert bench.busy_us([(0, 10), (5, 15), (2, 3)]) == 15        # overlapping and nested
    assert bench.busy_us([(0, 10), (10, 12)]) == 12               # touching


def test_decode_profile_is_the_longer_call_less_the_prefill_per_step():
    prefill = (1000.0, [("prefill_gemm", 0, 400), (GEMM, 400, 410), (SNAPMLA, 410, 415)], [])
    decode = [(GEMM, 2000 + 100 * s, 2030 + 100 * s) for s in range(4)]
    decode += [(SNAPMLA, 2030 + 100 * s, 2050 + 100 * s) for s in range(4)]
    decode += [("triton_red_fused_4", 2040 + 100 * s, 2045 + 100 * s) for s in range(4)]
    full = (1800.0, prefill[1] + decode, [])
    profile = bench.decode_profile(prefill, full, steps=4)
    assert profile["wall_us"] == pytest.approx(200.0)
    assert profile["busy_us"] == pytest.approx(50.0)             # the norm overlaps the decode
    kernels = {name: (us, launches) for name, us, launches in profile["kernels"]}
    assert kernels == {GEMM: (30.0, 1.0), SNAPMLA: (20.0, 1.0), "triton_red_fused_4": (5.0, 1.0)}
    assert [name for name, _, _ in profile["kernels"]] == [GEMM, SNAPMLA, "triton_red_fused_4"]
    assert profile["groups_us"] == {"attention": 20.0, "GEMMs": 30.0, "other": 5.0}


@pytest.mark.parametrize("name, wait", [
    ("cudaStreamSynchronize", True), ("cudaDeviceSynchronize", True),
    ("cudaEventSynchronize", True), ("cudaMemcpy", True), ("cudaMemcpyAsync", False),
    ("cudaLaunchKernel", False), ("cudaGraphLaunch", False), ("aten::copy_", False),
    ("_C::decode_sm90", False), ("aten::_local_scalar_dense", False),
    ("cudaStreamSynchronize_wrapper", False),
])
def test_host_waits_are_the_runtime_calls_that_can_block(name, wait):
    assert bench.host_wait(name) is wait


def test_host_side_per_step_counts_ops_and_waits_of_the_decode_steps_only():
    prefill_host = [("aten::mm", 50.0), ("cudaLaunchKernel", 4.0), ("cudaMemcpyAsync", 9.0)]
    decode_host = [("cudaLaunchKernel", 3.0)] * 8 + [("cudaStreamSynchronize", 100.0)] * 4
    decode_host += [("aten::mm", 10.0)] * 4 + [("cudaMemcpyAsync", 2.0)] * 4
    # Called as often in both calls but longer in the longer one (the profiled call's own
    # synchronization): not a decode step's.
    prefill = (1000.0, [(GEMM, 0, 10)], prefill_host + [("cudaDeviceSynchronize", 5.0)])
    full = (1800.0, [(GEMM, 0, 10)] + [(GEMM, 100 * s, 100 * s + 30) for s in range(1, 5)],
            prefill_host + decode_host + [("cudaDeviceSynchronize", 80.0)])
    profile = bench.decode_profile(prefill, full, steps=4)
    host = {name: (us, calls) for name, us, calls in profile["host"]}
    assert host == {"cudaStreamSynchronize": (100.0, 1.0), "cudaLaunchKernel": (6.0, 2.0),
                    "aten::mm": (10.0, 1.0), "cudaMemcpyAsync": (2.0, 1.0)}
    assert [name for name, _, _ in profile["host"]][0] == "cudaStreamSynchronize"
    assert profile["host_us"] == pytest.approx(118.0)
    # The asynchronous copy is no wait: one synchronization per step.
    assert profile["waits_per_step"] == 1.0 and profile["waits_us"] == pytest.approx(100.0)


def test_summary_compares_medians_with_auto_of_the_same_layer_count():
    rows = [{"layers": 4, "kv": "auto", "tok_s": v} for v in (100, 120, 110)]
    rows += [{"layers": 4, "kv": "fp8_snapmla", "tok_s": v} for v in (132, 90, 140)]
    rows += [{"layers": 16, "kv": "fp8_snapmla", "tok_s": 50},
             {"layers": 16, "kv": "auto", "error": "exit 1: CUDA out of memory"}]
    summary = {(s["layers"], s["kv"]): s for s in bench.summarize(rows)}
    assert summary[(4, "auto")]["vs_auto"] == 1.0
    ours = summary[(4, "fp8_snapmla")]
    assert (ours["calls"], ours["median"], ours["low"], ours["high"]) == (3, 132, 90, 140)
    assert ours["vs_auto"] == pytest.approx(132 / 110)
    assert summary[(16, "fp8_snapmla")]["vs_auto"] is None      # auto failed: no ratio
    assert (16, "auto") not in summary


def test_options_are_checked_before_any_engine_starts(capsys):
    for argv in (["--profile"], ["--calls", "0"], ["--layers", "4", "0"],
                 ["--switch-interval", "0"], ["--switch-interval", "0.0025"],
                 ["--prompt-len", "2048", "--output-len", "512", "--max-model-len", "2048"]):
        with pytest.raises(SystemExit) as exc:
            bench.main(argv)
        assert exc.value.code == 2, argv


def test_run_writes_calls_profiles_and_failures(tmp_path, monkeypatch, capsys):
    specs = []

    def run_child(command, spec, timeout, on_result=None):
        specs.append(spec)
        layers = __import__("json").load(open(f"{spec['model']}/config.json"))[
            "num_hidden_layers"]
        if spec["kv"] == "fp8":
            return [{"kind": "engine", "start_s": 5.0}], "", "exit 1: CUDA out of memory"
        rate = {"auto": 100.0, "fp8_snapmla": 105.0}[spec["kv"]] * (4 / layers)
        results = [{"kind": "engine", "start_s": 40.0}]
        results += [{"kind": "call", "call": c, "seconds": 1.0, "output_tokens": 8,
                     "tok_s": rate + c} for c in (1, 2, 3)]
        if spec["profile"]:
            results.append({"kind": "profile", "steps": 8, "wall_us": 3000.0, "busy_us": 2900.0,
                            "groups_us": {"attention": 500.0, "GEMMs": 2000.0, "other": 300.0},
                            "kernels": [[GEMM, 2000.0, 3.0], [SNAPMLA, 400.0, 1.0]],
                            "host": [["cudaStreamSynchronize", 250.0, 2.0],
                                     ["cudaLaunchKernel", 120.0, 40.0]],
                            "host_us": 370.0, "waits_per_step": 2.0, "waits_us": 250.0})
        for r in results:
            if on_result:
                on_result(r)
        return results, "Using AttentionBackendEnum.SNAPMLA backend.", None

    monkeypatch.setattr(bench, "run_child", run_child)
    with pytest.raises(SystemExit) as exc:       # a failed engine fails the run, after writing
        bench.main(["--out", str(tmp_path), "--layers", "4", "16", "--kv", "auto",
                    "fp8_snapmla", "fp8", "--in-process", "--profile", "--calls", "3"])
    assert exc.value.code == 1
    assert [(s["kv"], s["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"]) for s in specs][:3] == [
        ("auto", "0"), ("fp8_snapmla", "0"), ("fp8", "0")]
    with open(tmp_path / "generate.csv") as f:
        assert f.readline().startswith("# run 1: ")
        rows = list(csv.DictReader(f))
    calls = [r for r in rows if not r["error"]]
    assert len(calls) == 12 and {r["engine_core"] for r in calls} == {"in-process"}
    assert {r["mode"] for r in calls} == {"graph"} and not specs[0]["enforce_eager"]
    assert [r["kv"] for r in rows if r["error"]] == ["fp8", "fp8"]
    report = (tmp_path / "generate.md").read_text()
    assert "| 4 | fp8_snapmla | 3 | 107 | 106 | 108 | 1.05x |" in report
    assert "| 16 | fp8_snapmla | 3 | 28 | 27 | 29 | 1.05x |" in report
    assert "| 4 | auto | 3,000.0 | 2,900.0 | 500.0 | 2,000.0 | 300.0 |" in report
    assert "| 4 | fp8_snapmla | 3,000.0 | 370.0 | 2.0 | 250.0 |" in report
    assert "| 250.0 | 2.0 | `cudaStreamSynchronize` (wait) |" in report
    assert "| 120.0 | 40.0 | `cudaLaunchKernel` |" in report
    with open(tmp_path / "host.csv") as f:
        host = [r for r in csv.DictReader(line for line in f if not line.startswith("#"))]
    assert len(host) == 8 and {r["waits"] for r in host} == {"0", "1"}
    assert "Failed engines:" in report and "CUDA out of memory" in report
    with open(tmp_path / "kernels.csv") as f:
        kernels = [r for r in csv.DictReader(line for line in f if not line.startswith("#"))]
    assert len(kernels) == 8 and {r["group"] for r in kernels} == {"GEMMs", "attention"}
    assert (tmp_path / "generate.png").stat().st_size > 0
    assert "[2/6] 4 layers, fp8_snapmla: call 3: 108 tok/s" in capsys.readouterr().out


def test_engine_times_each_call_on_fresh_prompts(monkeypatch):
    torch = pytest.importorskip("torch")
    vllm = pytest.importorskip("vllm")   # noqa: F841  (SamplingParams)
    seen = []

    class FakeLLM:
        def generate(self, prompts, params, use_tqdm):
            seen.append((prompts[0]["prompt_token_ids"][:4], params.max_tokens))
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(
                token_ids=[0] * params.max_tokens)]) for _ in prompts]

    monkeypatch.setattr(bench, "build_llm", lambda *a, **k: FakeLLM())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setenv("SNAPMLA_TEST_MARK", "0")   # run_engine sets it: restored afterwards
    spec = {"model": "m", "kv": "fp8_snapmla", "batch": 2, "prompt_len": 8, "output_len": 5,
            "calls": 2, "max_model_len": 64, "kv_cache_gib": 1.0, "vocab": 1000,
            "env": {"SNAPMLA_TEST_MARK": "1"}}
    intervals = []
    monkeypatch.setattr(bench, "apply_switch_interval", lambda llm, s: intervals.append(s))
    results = list(bench.run_engine(spec))
    assert intervals == []                                      # Python's default unless asked
    assert [r["kind"] for r in results] == ["engine", "call", "call"]
    assert [r["output_tokens"] for r in results[1:]] == [10, 10]
    assert all(r["tok_s"] > 0 for r in results[1:])
    assert [n for _, n in seen] == [bench.WARM_UP_TOKENS, 5, 5]
    assert len({tuple(p) for p, _ in seen}) == 3                # fresh prompts every call
    import os
    assert os.environ["SNAPMLA_TEST_MARK"] == "1"


def test_switch_interval_reaches_the_engine_core_and_the_rows(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    specs = []
    monkeypatch.setattr(bench, "run_child", _one_call_child(specs))
    bench.main(["--out", str(tmp_path), "--layers", "4", "--kv", "auto", "--calls", "1",
                "--switch-interval", "0.2"])
    assert specs[0]["switch_interval_s"] == pytest.approx(2e-4)
    assert _call_rows(tmp_path)[0]["switch_interval_ms"] == "0.2"

    applied = []
    monkeypatch.setattr(bench, "build_llm", lambda *a, **k: OneTokenLLM())
    monkeypatch.setattr(bench, "apply_switch_interval", lambda llm, s: applied.append(s))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    _unset_until_teardown(monkeypatch, "VLLM_ALLOW_INSECURE_SERIALIZATION",
                          "VLLM_ENABLE_V1_MULTIPROCESSING")
    list(bench.run_engine({**specs[0], "calls": 1, "batch": 1, "prompt_len": 4,
                           "output_len": 1, "vocab": 100}))
    assert applied == [pytest.approx(2e-4)]
    import os
    # collective_rpc sends the setter as a function: vLLM refuses that without this.
    assert os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"


def test_enforce_eager_reaches_the_engine_and_the_rows(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    specs = []
    monkeypatch.setattr(bench, "run_child", _one_call_child(specs))
    bench.main(["--out", str(tmp_path), "--layers", "4", "--kv", "auto", "--calls", "1",
                "--enforce-eager"])
    assert specs[0]["enforce_eager"] is True
    assert _call_rows(tmp_path)[0]["mode"] == "eager"

    built = []

    def build_llm(*args, **kwargs):
        built.append(kwargs)
        return OneTokenLLM()

    monkeypatch.setattr(bench, "build_llm", build_llm)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    _unset_until_teardown(monkeypatch, "VLLM_ENABLE_V1_MULTIPROCESSING")
    for eager in (True, False):
        list(bench.run_engine({**specs[0], "enforce_eager": eager, "calls": 1, "batch": 1,
                               "prompt_len": 4, "output_len": 1, "vocab": 100}))
    assert [k["enforce_eager"] for k in built] == [True, False]


def test_profiled_call_returns_the_ops_own_cpu_time(monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")   # SamplingParams
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    class FakeLLM:
        def generate(self, prompts, params, use_tqdm):
            a = torch.randn(128, 128)
            for _ in range(3):
                a = a @ a
            return []

    wall_us, kernels, host = bench._profiled_call(FakeLLM(), [], 1)
    assert wall_us > 0 and kernels == []                        # no GPU here
    mm = [us for name, us in host if name == "aten::mm"]
    assert len(mm) == 3 and all(us > 0 for us in mm)
    matmul = sum(us for name, us in host if name == "aten::matmul")
    assert matmul < sum(mm)   # own time: the mm inside each matmul is not counted twice
