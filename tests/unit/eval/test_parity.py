"""``eval.parity``: lm-eval command construction per KV setting and the parity table writer."""

import csv
import importlib.util
import json
import pathlib
import random
import sys
import types

import pytest
import yaml

from eval import parity


def _opts(*extra):
    return parity.parse_args(["--model", "deepseek-ai/DeepSeek-V3.1", "--out", "/tmp/p", *extra])


def test_model_args_per_setting_carry_kv_dtype_parallelism_and_overrides():
    opts = _opts("--kv", "auto,fp8_snapmla,fp8", "--tp", "8", "--dp", "1",
                 "--model-args",
                 "gpu_memory_utilization=0.9,max_model_len=65536,enforce_eager=true")
    assert opts.kv == ["auto", "fp8_snapmla", "fp8"]
    for setting in opts.kv:
        args = parity.model_args(opts.model, setting, opts.tp, opts.dp, opts.max_model_len,
                                 parity.parse_kv_pairs(opts.model_args))
        assert args["kv_cache_dtype"] == setting
        assert args["pretrained"] == "deepseek-ai/DeepSeek-V3.1"
        assert args["tensor_parallel_size"] == 8 and args["data_parallel_size"] == 1
        assert args["max_model_len"] == 65536                       # passthrough wins
        assert args["gpu_memory_utilization"] == 0.9 and args["enforce_eager"] is True
        cmd = parity.lm_eval_command(args, ["aime24", "ifeval"], pathlib.Path("/o"),
                                     pathlib.Path("/inc"), opts.gen_kwargs, None)
        assert cmd[:3] == ["lm_eval", "--model", "vllm"]
        assert json.loads(cmd[cmd.index("--model_args") + 1]) == args    # lm-eval takes JSON
        assert cmd[cmd.index("--tasks") + 1] == "aime24_avg16,ifeval"
        assert "--apply_chat_template" in cmd and "--log_samples" in cmd
        gen = parity.parse_kv_pairs(cmd[cmd.index("--gen_kwargs") + 1])
        assert gen == {"do_sample": True, "temperature": 0.6, "top_p": 0.95,
                       "max_gen_toks": 32768}


def test_child_command_runs_one_setting_with_all_options():
    opts = _opts("--tasks", "math500,gpqa_diamond", "--dp", "8", "--limit", "5",
                 "--model-args", "max_num_seqs=64", "--chat-template-args", '{"thinking": true}')
    cmd = parity.child_command("fp8_snapmla", opts)
    assert cmd[:3] == [sys.executable, "-m", "eval.parity"]
    assert cmd[cmd.index("--run-one") + 1] == "fp8_snapmla"
    assert cmd[cmd.index("--dp") + 1] == "8" and cmd[cmd.index("--tp") + 1] == "1"
    assert cmd[cmd.index("--limit") + 1] == "5"
    assert cmd[cmd.index("--model-args") + 1] == "max_num_seqs=64"
    child = parity.parse_args(cmd[3:])
    assert child.run_one == "fp8_snapmla" and child.tasks == ["math500", "gpqa_diamond"]
    assert child.gen_kwargs == opts.gen_kwargs and child.limit == 5
    assert child.chat_template_args == {"thinking": True}
    args = parity.model_args(child.model, "fp8_snapmla", child.tp, child.dp,
                             child.max_model_len, parity.parse_kv_pairs(child.model_args),
                             child.chat_template_args)
    assert args["chat_template_args"] == {"thinking": True} and args["max_num_seqs"] == 64
    assert args["data_parallel_size"] == 8
    # Thinking on: lm-eval scores the text after the trace; a marker given overrides ours.
    assert args["think_end_token"] == "</think>"
    assert "think_end_token" not in parity.model_args("m", "auto")
    assert parity.model_args("m", "auto", chat_template_args={"thinking": True},
                             extra={"think_end_token": "<END>"})["think_end_token"] == "<END>"


def test_bad_options_are_refused():
    with pytest.raises(SystemExit):
        _opts("--kv", "fp8_snapmla")                    # no baseline
    with pytest.raises(SystemExit):
        _opts("--tasks", "livecodebench")               # not in lm-eval 0.4.13
    with pytest.raises(ValueError):
        parity.format_model_args({"chat_template": "a,b"})
    with pytest.raises(SystemExit):                     # no room left for the prompt
        _opts("--max-model-len", "16384", "--gen-kwargs", "max_gen_toks=32768")


def test_group_task_lengths_pool_every_subtask(tmp_path):
    """MMLU-Pro's lengths are recorded per subject (lm-eval's subtask names)."""
    _write_run(tmp_path, "auto", {}, {}, lengths={"mmlu_pro_biology": [100] * 10,
                                                  "mmlu_pro_law": [1000] * 90, "ifeval": [3]})
    assert parity.mean_lengths(tmp_path / "auto", "mmlu_pro", None) == pytest.approx(910.0)
    # From samples files too, the newest of each subtask.
    words = lambda n: " ".join(["tok"] * n)
    _write_run(tmp_path, "fp8", {}, {"mmlu_pro_biology": [[words(10)]],
                                     "mmlu_pro_law": [[words(30)], [words(50)]]})
    assert parity.mean_lengths(tmp_path / "fp8", "mmlu_pro",
                               lambda text: len(text.split())) == pytest.approx(30.0)
    # MMLU-Redux's subjects are named mmlu_redux_<subject>_generative by lm-eval 0.4.13.
    _write_run(tmp_path, "fp8_snapmla", {}, {},
               lengths={"mmlu_redux_anatomy_generative": [10, 30],
                        "mmlu_redux_virology_generative": [50], "mmlu_pro_law": [7]},
               cut={"mmlu_redux_anatomy_generative": [False, True],
                    "mmlu_redux_virology_generative": [False]})
    redux = parity.TASKS["mmlu_redux"].lm_eval_task
    assert parity.mean_lengths(tmp_path / "fp8_snapmla", redux, None) == pytest.approx(30.0)
    assert parity.cut_percent(tmp_path / "fp8_snapmla", redux) == pytest.approx(100 / 3)


def test_group_tasks_cover_the_subtasks_lm_eval_runs():
    """The subtask names of lm-eval 0.4.13's own index (lengths are recorded under them)."""
    from lm_eval.tasks import TaskManager

    index = TaskManager().task_index
    pro = index["mmlu_pro"].cfg["task"]
    redux = [name for name, entry in index.items() if entry.kind.name == "TASK"
             and "mmlu-redux/generative/" in str(entry.yaml_path)]
    assert len(pro) == 14 and len(redux) == 57
    assert all(parity.TASKS["mmlu_pro"].covers(name) for name in pro)
    assert all(parity.TASKS["mmlu_redux"].covers(name) for name in redux)
    assert not parity.TASKS["mmlu_redux"].covers("mmlu_redux_spanish")


def test_a_failed_setting_shows_no_earlier_results(tmp_path, monkeypatch):
    """An earlier run's results in OUT do not stand in for a setting that fails now."""
    T = parity.TASKS
    for setting, value in (("auto", 0.5), ("fp8_snapmla", 0.9)):
        _write_run(tmp_path, setting, {T["ifeval"].lm_eval_task: (T["ifeval"].metric, value)},
                   {})
    monkeypatch.setattr(parity.subprocess, "run",
                        lambda *a, **k: types.SimpleNamespace(returncode=1))
    monkeypatch.setattr(parity, "_tokenizer_counter", lambda model: None)
    assert parity.main(["--model", "m", "--out", str(tmp_path), "--tasks", "ifeval",
                        "--kv", "auto,fp8_snapmla"]) == 1
    md = (tmp_path / "parity.md").read_text()
    assert "50.00" not in md and "90.00" not in md
    assert "**Failed in this run, no results:** auto, fp8_snapmla" in md


def test_recorded_lengths_and_cuts_follow_each_request(monkeypatch):
    """The recording model pairs vLLM's token counts and finish reasons with lm-eval's requests
    through the cache hook, whatever order lm-eval generates them in."""
    out = lambda n, reason: types.SimpleNamespace(
        outputs=[types.SimpleNamespace(token_ids=[0] * n, finish_reason=reason, text="x" * n)])
    # What vLLM returns per prompt (the same prompt twice: a repeated task's samples).
    replies = {"a": [out(5, "stop"), out(32, "length")], "bb": [out(7, "stop")],
               "ccc": [out(32, "length")]}

    class Hook:
        def add_partial(self, kind, key, value):
            pass

    class FakeVLLM:      # lm-eval 0.4.13's generate_until, reduced to its order of events
        def __init__(self, **kw):
            self.cache_hook = Hook()

        def _model_generate(self, requests, generate=False, sampling_params=None):
            return [replies[context].pop(0) for context in requests]

        def generate_until(self, requests, disable_tqdm=False):
            order = sorted(range(len(requests)), key=lambda i: -len(requests[i].args[0]))
            contexts = [requests[i].args[0] for i in order]
            res = {}
            for start in (0, 2):                          # two batches
                batch = contexts[start:start + 2]
                for i, output, context in zip(order[start:start + 2],
                                              self._model_generate(batch, generate=True), batch):
                    res[i] = output.outputs[0].text
                    self.cache_hook.add_partial("generate_until", (context, {}), res[i])
            return [res[i] for i in range(len(requests))]

    fake = types.ModuleType("lm_eval.models.vllm_causallms")
    fake.VLLM = FakeVLLM
    monkeypatch.setitem(sys.modules, "lm_eval.models.vllm_causallms", fake)
    lm = parity._length_recording_model({})
    req = lambda context, task: types.SimpleNamespace(args=(context, {}), task_name=task)
    texts = lm.generate_until([req("a", "gsm8k"), req("ccc", "aime24_avg16"),
                               req("bb", "gsm8k"), req("a", "gsm8k")])
    assert sorted(map(len, texts)) == [5, 7, 32, 32]
    assert sorted(zip(lm.lengths_by_task["gsm8k"], lm.cut_by_task["gsm8k"])) == [
        (5, False), (7, False), (32, True)]
    assert lm.lengths_by_task["aime24_avg16"] == [32] and lm.cut_by_task["aime24_avg16"] == [True]


def _write_run(out, setting, scores, samples, lengths=None, cut=None):
    """Files shaped like lm-eval 0.4.13 output (results JSON, per-task samples JSONL)."""
    run = out / setting / "deepseek-ai__DeepSeek-V3.1"
    run.mkdir(parents=True)
    results = {task: {"alias": task, metric: value, metric.replace(",", "_stderr,"): 0.01}
               for task, (metric, value) in scores.items()}
    (run / "results_2026-11-30T06-00-00.json").write_text(json.dumps(
        {"results": results, "groups": {}, "configs": {}, "n-samples": {}}))
    for task, docs in samples.items():
        with open(run / f"samples_{task}_2026-11-30T06-00-00.jsonl", "w") as f:
            for doc_id, resps in enumerate(docs):
                for filt in ("strict-match", "flexible-extract"):    # one entry per filter
                    f.write(json.dumps({"doc_id": doc_id, "doc": {}, "target": "1",
                                        "arguments": {}, "resps": [resps],
                                        "filtered_resps": [resps[0]], "filter": filt,
                                        "metrics": ["exact_match"]}) + "\n")
    if lengths is not None:
        (out / setting / parity.LENGTHS_FILE).write_text(json.dumps(lengths))
    if cut is not None:
        (out / setting / parity.CUT_FILE).write_text(json.dumps(cut))


def test_table_has_scores_deltas_lengths_and_marks_missing(tmp_path):
    rng = random.Random(6)   # fixed, so that a failure replays
    a = {t: rng.uniform(0.2, 0.9) for t in ("aime24", "ifeval", "math500")}
    s = {t: v + rng.uniform(-0.05, 0.05) for t, v in a.items()}
    words = lambda n: " ".join(["tok"] * n)
    T = parity.TASKS
    # auto: lengths from samples only (re-tokenized; every repeat of every doc counts once).
    _write_run(tmp_path, "auto",
               {T[t].lm_eval_task: (T[t].metric, a[t]) for t in a},
               {"aime24_avg16": [[words(10), words(30)], [words(50), words(70)]],
                "ifeval": [[words(7)]]})
    # fp8_snapmla: recorded token counts (preferred over samples); math500 missing entirely.
    _write_run(tmp_path, "fp8_snapmla",
               {T[t].lm_eval_task: (T[t].metric, s[t]) for t in ("aime24", "ifeval")},
               {"aime24_avg16": [[words(1)]]},
               lengths={"aime24_avg16": [100, 300], "ifeval": [5]},
               cut={"aime24_avg16": [False, True, True, True], "ifeval": [False]})
    settings = ["auto", "fp8_snapmla"]
    rows = parity.build_table(tmp_path, settings, ["aime24", "ifeval", "math500", "mmlu_pro"],
                              count_tokens=lambda text: len(text.split()))
    by = {r["task"]: r for r in rows}
    aime = by["AIME-24"]
    assert aime["score[auto]"] == pytest.approx(100 * a["aime24"])
    assert aime["delta[fp8_snapmla]"] == pytest.approx(100 * (s["aime24"] - a["aime24"]))
    assert aime["se[auto]"] == pytest.approx(1.0)               # lm-eval's stderr, in percent
    assert aime["delta_se[fp8_snapmla]"] == pytest.approx(2 ** 0.5)
    assert aime["len[auto]"] == pytest.approx(40.0)
    assert aime["len[fp8_snapmla]"] == pytest.approx(200.0)
    assert by["IFEval"]["len[auto]"] == 7 and by["IFEval"]["len[fp8_snapmla]"] == 5
    # Generations stopped at the token limit: recorded only by our own runs.
    assert aime["cut%[fp8_snapmla]"] == pytest.approx(75.0) and aime["cut%[auto]"] is None
    assert by["IFEval"]["cut%[fp8_snapmla]"] == 0.0
    math = by["MATH-500"]
    assert math["score[auto]"] == pytest.approx(100 * a["math500"])
    assert math["score[fp8_snapmla]"] is None and math["delta[fp8_snapmla]"] is None
    assert math["delta_se[fp8_snapmla]"] is None
    assert math["len[auto]"] is None
    assert by["MMLU-Pro"]["score[auto]"] is None

    csv_path, md_path = parity.write_table(rows, settings, tmp_path)
    table = list(csv.DictReader(open(csv_path)))
    assert [r["task"] for r in table] == ["AIME-24", "IFEval", "MATH-500", "MMLU-Pro"]
    assert float(table[0]["delta[fp8_snapmla]"]) == pytest.approx(
        100 * (s["aime24"] - a["aime24"]))
    assert table[2]["score[fp8_snapmla]"] == ""
    md = md_path.read_text()
    assert "| MATH-500 |" in md and "n/a" in md
    assert f"{100 * (s['aime24'] - a['aime24']):+.2f}" in md
    assert "| 1.41 |" in md and "delta_se" in md                  # unsigned, beside the delta
    assert "cut%[fp8_snapmla]" in md and "| 75.00 |" in md
    for missing in ("HMMT-25", "BeyondAIME", "ZebraLogic", "LiveCodeBench", "Arena-Hard"):
        assert missing in md


def test_repeat_overlay_renders_and_averages_over_samples(tmp_path, monkeypatch):
    lm_tasks = tmp_path / "lm_eval_tasks"
    (lm_tasks / "aime").mkdir(parents=True)
    parity.write_overlays(tmp_path / "overlays", lm_tasks)
    text = (tmp_path / "overlays" / "aime24_avg16.yaml").read_text()
    loader = type("L", (yaml.SafeLoader,), {})
    loader.add_constructor("!function", lambda ld, node: ("function", ld.construct_scalar(node)))
    cfg = yaml.load(text, Loader=loader)
    assert cfg["include"] == str(lm_tasks / "aime" / "aime24.yaml")
    assert cfg["task"] == "aime24_avg16" and cfg["repeats"] == 16
    assert cfg["filter_list"][0]["filter"][0] == {"function": "take_first_k", "k": 16}
    assert cfg["process_results"] == ("function", "repeat_utils.aime_mean_over_samples")

    # The scorer averages lm-eval's AIME scorer over every sample (stand-in scorer here).
    fake = types.ModuleType("lm_eval.tasks.aime.utils")
    fake.process_results = lambda doc, results: {"exact_match": int(results[0] == doc["Answer"])}
    aime_pkg = types.ModuleType("lm_eval.tasks.aime")
    aime_pkg.utils = fake
    for name, mod in {"lm_eval": types.ModuleType("lm_eval"),
                      "lm_eval.tasks": types.ModuleType("lm_eval.tasks"),
                      "lm_eval.tasks.aime": aime_pkg, "lm_eval.tasks.aime.utils": fake}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    # Loaded from the rendered copy, as lm-eval loads it (``!function`` beside the YAML).
    spec = importlib.util.spec_from_file_location("snapmla_repeat_utils",
                                                  tmp_path / "overlays" / "repeat_utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    answers = [str(random.randrange(1000)) for _ in range(16)]
    doc = {"Answer": answers[3]}
    expected = sum(a == doc["Answer"] for a in answers) / 16
    assert utils.aime_mean_over_samples(doc, [answers]) == {"exact_match": expected}
