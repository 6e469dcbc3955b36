"""benchmarks/bench_generate.py: the profile arithmetic, the summary and the orchestration,
with stand-ins for vLLM (the GPU run is in benchmarks/RESULTS.md)."""

import csv
import types

import pytest

from benchmarks import bench_generate as bench
from benchmarks import step_profile

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
    assert step_profile.busy_us([]) == 0
    assert step_profile.busy_us([(0, 10)]) == 10
    assert step_profile.busy_us([(20, 30), (0, 10)]) == 20              # apart, out of order
    assert step_profile.busy_us([(0, 10), (5, 15), (2, 3)]) == 15        # overlapping and nested
    assert step_profile.busy_us([(0, 10), (10, 12)]) == 12               # touching


class _ChunkedPrefillEngine:
    """vLLM's ``LLMEngine`` as ``profile_decode_steps`` drives it: request i gets its first
    token at step ``first_token[i]`` (chunked prefill, the later requests' prefill running in
    the earlier ones' decode steps), then one token a step up to ``max_tokens``; DELTA outputs.
    Records which requests were still in prefill at each step."""

    def __init__(self, first_token):
        self.first_token, self.steps, self.requests = first_token, 0, {}
        self.prefilling, self.max_tokens, self.aborted = [], None, []
        self.stalled = None   # a request that stops producing after 12 steps (pre-empted)

    def add_request(self, request_id, prompt, params):
        self.requests[request_id] = 0
        self.max_tokens = params.max_tokens

    def has_unfinished_requests(self):
        return any(n < self.max_tokens for n in self.requests.values())

    def step(self):
        outputs = []
        self.prefilling.append(sum(self.steps < f for f in self.first_token))
        for i, r in enumerate(self.requests):
            if i == self.stalled and self.steps >= 12:
                continue
            if self.steps >= self.first_token[i] and self.requests[r] < self.max_tokens:
                self.requests[r] += 1
                outputs.append(types.SimpleNamespace(
                    request_id=r, outputs=[types.SimpleNamespace(token_ids=[0])], metrics=None))
        self.steps += 1
        return outputs

    def abort_request(self, ids):
        self.aborted += ids


def test_profile_holds_only_decode_steps_of_the_whole_batch(monkeypatch):
    pytest.importorskip("vllm")   # SamplingParams
    engine = _ChunkedPrefillEngine(first_token=[0, 3, 9])
    windows = []

    def profiled(work):
        first = engine.steps
        work()
        windows.append((first, engine.steps))
        kernels = [(SNAPMLA, 10.0 * s, 10.0 * s + 4) for s in range(first, engine.steps)]
        return 50.0 * (engine.steps - first), kernels, [("cudaGraphLaunch", 3.0)] * 2

    monkeypatch.setattr(bench, "profiled", profiled)
    # The prefill takes 10 steps, and the first request decodes in all of them: a budget of
    # exactly that, so that any step the budget missed would end a request inside the window.
    prefill = 10
    profile = bench.profile_decode_steps(engine, [[1], [2], [3]], steps=6, prefill_tokens=prefill)
    (first, last), = windows
    assert last - first == 6
    # Every request had its first token and the settling steps before the window: no prefill
    # in it, and none finished inside it.
    assert first >= 9 + bench.SETTLE_STEPS and not any(engine.prefilling[first:last])
    assert all(n < engine.max_tokens for n in engine.requests.values())
    assert engine.max_tokens == bench.profile_tokens(6, prefill)
    assert profile["wall_us"] == 50.0 and profile["kernels"] == [(SNAPMLA, 4.0, 1.0)]
    assert profile["host"] == [("cudaGraphLaunch", 1.0, 1 / 3)]
    assert sorted(engine.aborted) == sorted(engine.requests)
    # A prefill longer than the budget (or a batch the cache cannot hold: requests that stop
    # producing) makes the window hold other steps than decode steps of the whole batch.
    with pytest.raises(RuntimeError, match="not all decode steps of the whole batch"):
        bench.profile_decode_steps(_ChunkedPrefillEngine(first_token=[0, 3, 9]), [[1], [2], [3]],
                                   steps=6, prefill_tokens=9)
    preempted = _ChunkedPrefillEngine(first_token=[0, 1])
    preempted.stalled = 1                       # request 1 stops producing after 12 steps
    with pytest.raises(RuntimeError, match="tokens per request in the window: [0-9]+-6"):
        bench.profile_decode_steps(preempted, [[1], [2]], steps=6, prefill_tokens=4)


@pytest.mark.parametrize("name, wait", [
    ("cudaStreamSynchronize", True), ("cudaDeviceSynchronize", True),
    ("cudaEventSynchronize", True), ("cudaMemcpy", True), ("cudaMemcpyAsync", False),
    ("cudaLaunchKernel", False), ("cudaGraphLaunch", False), ("aten::copy_", False),
    ("_C::decode_sm90", False), ("aten::_local_scalar_dense", False),
    ("cudaStreamSynchronize_wrapper", False),
])
def test_host_waits_are_the_runtime_calls_that_can_block(name, wait):
    assert bench.host_wait(name) is wait


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
                 ["--prompt-len", "2048", "--output-len", "512", "--max-model-len", "2048"],
                 # The profiled steps need room beside the prompt too.
                 ["--prompt-len", "2048", "--output-len", "16", "--max-model-len", "2100",
                  "--in-process", "--profile", "--profile-steps", "64"]):
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


def test_engine_profiles_after_the_prefill_of_its_own_batch(monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")   # SamplingParams
    engine = _ChunkedPrefillEngine(first_token=[0, 2])

    def vllm_config(max_model_len):
        return types.SimpleNamespace(
            scheduler_config=types.SimpleNamespace(max_num_batched_tokens=64),
            model_config=types.SimpleNamespace(max_model_len=max_model_len))

    llm = OneTokenLLM()
    llm.llm_engine = engine
    calls = []
    generate = llm.generate
    llm.generate = lambda *a, **k: (calls.append(1), generate(*a, **k))[1]
    monkeypatch.setattr(bench, "build_llm", lambda *a, **k: llm)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "profiled", lambda work: (work(), (10.0, [], []))[1])
    _unset_until_teardown(monkeypatch, "VLLM_ENABLE_V1_MULTIPROCESSING")
    spec = {"model": "m", "kv": "fp8_snapmla", "batch": 2, "prompt_len": 100, "output_len": 1,
            "calls": 1, "max_model_len": 4096, "kv_cache_gib": 1.0, "vocab": 1000,
            "profile": True, "profile_steps": 5}
    prefill = bench.warm_tokens(2, 100, 64)
    engine.vllm_config = vllm_config(100 + bench.profile_tokens(5, prefill))
    results = list(bench.run_engine(spec))
    assert [r["kind"] for r in results] == ["engine", "call", "profile"]
    assert results[-1]["steps"] == 5 and engine.max_tokens == bench.profile_tokens(5, prefill)
    # One token short of room: a clear error, before any request is added.
    engine.vllm_config, engine.requests = vllm_config(99 + bench.profile_tokens(5, prefill)), {}
    calls.clear()
    with pytest.raises(ValueError, match="--max-model-len"):
        list(bench.run_engine(spec))
    assert engine.requests == {} and calls == []     # before the warm-up and the timed calls
