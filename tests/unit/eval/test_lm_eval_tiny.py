"""``eval.lm_eval_tiny`` on the smoke checkpoint: its lm-eval documents, tasks and report.

The documents must survive lm-eval's tokenization exactly (the next-token target is one token,
the context is the window's prefix).  Where lm-eval 0.4.13 is installed, its ``hf`` model runs
both tasks on CPU and its ``vllm`` model is built (engine replaced by vLLM's start-up
configuration, in the fake-CUDA vLLM process) to check the engine settings and its tokenization.
"""

import csv
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from eval import lm_eval_tiny as lmt

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
SCRIPT = [sys.executable, "-m", "eval.lm_eval_tiny"]      # run from REPO_ROOT


def _has(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


needs_lm_eval = pytest.mark.skipif(not _has("lm_eval"),
                                   reason="lm-eval not installed (pip install lm-eval==0.4.13)")


@pytest.fixture(scope="module")
def smoke_model(smoke_checkpoint):
    return smoke_checkpoint


@pytest.fixture(scope="module")
def tokenizer(smoke_model):
    return lmt.load_tokenizer(smoke_model)


@pytest.fixture(scope="module")
def docs_dir(smoke_model, tmp_path_factory):
    """The documents and rendered tasks, written through the command line (``--docs-only``)."""
    out = tmp_path_factory.mktemp("lm-eval-docs")
    proc = subprocess.run([*SCRIPT, "--model", str(smoke_model), "--out", str(out),
                           "--docs-only"],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _jsonl(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def test_next_token_docs_reproduce_the_token_ids(smoke_model, tokenizer, docs_dir):
    tokens = np.load(smoke_model / "heldout_tokens.npy").tolist()
    stats = json.loads((docs_dir / "docs_stats.json").read_text())
    docs = _jsonl(docs_dir / "data" / "tiny_mla_next_token.jsonl")
    nxt = stats["tiny_mla_next_token"]
    # 64 windows asked for; the smoke split holds len // 2048 of them, 4 positions in each.
    assert nxt["windows"] == min(64, len(tokens) // 2048) >= 40
    assert len(docs) == nxt["docs"] == 4 * nxt["windows"] and nxt["missing"] == 0
    assert not stats["tokenizer_adds_special_tokens"]
    by_window = {}
    for doc in docs:
        by_window.setdefault(doc["window"], []).append(doc["position"])
        window = tokens[doc["window"] * 2048:(doc["window"] + 1) * 2048]
        pos = doc["position"]
        # the prediction is made at position pos - 1 >= 256: past the first prefill chunk
        assert 257 <= pos < 2048 and doc["context_tokens"] == pos
        assert doc["token_id"] == window[pos]
        assert doc["context"] == doc["context"].rstrip()
        # lm-eval's own split of the pair gives back the window's ids, one target token
        context_enc, continuation_enc = lmt.lm_eval_pair(tokenizer, doc["context"],
                                                         doc["continuation"])
        assert context_enc == window[:pos] and continuation_enc == [window[pos]]
    assert all(len(set(p)) == 4 for p in by_window.values())
    # candidates with a context ending in whitespace were seen, skipped and counted
    assert nxt["rejected_trailing_whitespace"] > 0


def test_positions_are_seeded(smoke_model, tokenizer):
    tokens = np.load(smoke_model / "heldout_tokens.npy")
    args = dict(windows=4, window_len=1024, per_window=3, chunk=256)
    a, _ = lmt.build_next_token_docs(tokenizer, tokens, seed=0, **args)
    b, _ = lmt.build_next_token_docs(tokenizer, tokens, seed=0, **args)
    c, _ = lmt.build_next_token_docs(tokenizer, tokens, seed=1, **args)
    assert a == b and len(a) == 12
    assert [d["position"] for d in a] != [d["position"] for d in c]


def test_pairs_that_do_not_survive_tokenization_are_dropped_and_counted(tokenizer):
    eos = tokenizer.eos_token_id
    canonical = lmt.encode(tokenizer, "import os\nx = 1")
    # The same text spelled one byte-level token per character: it decodes to the same text
    # but re-encodes to the canonical (merged) ids, so it cannot be scored as spelled.
    spelled = [i for ch in "import os\nx = 1" for i in lmt.encode(tokenizer, ch)]
    assert spelled != canonical and lmt.decode(tokenizer, spelled) == "import os\nx = 1"
    doc, reason = lmt.check_position(tokenizer, spelled, 4)
    assert doc is None and reason == "reencode"
    newline = canonical.index(lmt.encode(tokenizer, "\n")[0])
    doc, reason = lmt.check_position(tokenizer, canonical, newline + 1)   # context ends "\n"
    assert doc is None and reason == "trailing_whitespace"
    doc, reason = lmt.check_position(tokenizer, canonical, newline)       # target is "\n"
    assert reason == "" and doc["continuation"] == "\n" and doc["token_id"] == canonical[newline]
    docs, stats = lmt.build_ppl_docs(tokenizer, np.array(canonical + [eos] + spelled + [eos]),
                                     eos)
    assert [d["n_tokens"] for d in docs] == [len(canonical)]
    assert stats["dropped_reencode"] == 1 and stats["dropped_tokens"] == len(spelled)


def test_perplexity_docs_are_the_heldout_files(smoke_model, tokenizer, docs_dir):
    tokens = np.load(smoke_model / "heldout_tokens.npy").tolist()
    docs = _jsonl(docs_dir / "data" / "tiny_mla_heldout_ppl.jsonl")
    stats = json.loads((docs_dir / "docs_stats.json").read_text())["tiny_mla_heldout_ppl"]
    eos = tokenizer.eos_token_id
    assert len(docs) == stats["docs"] == tokens.count(eos) and stats["dropped_reencode"] == 0
    rebuilt = []
    for doc in docs:
        ids = lmt.encode(tokenizer, doc["text"])
        assert len(ids) == doc["n_tokens"] and len(doc["text"].encode()) == doc["n_bytes"]
        rebuilt += ids + [eos]
    assert rebuilt == tokens           # every held-out token, in order, nothing else


def test_rendered_tasks_point_at_the_documents(docs_dir):
    import yaml

    for name in lmt.TASKS:
        template = (REPO_ROOT / "eval" / "tasks" / "tiny_mla" / f"{name}.yaml").read_text()
        assert lmt.DATA_PLACEHOLDER in template
        config = yaml.safe_load((docs_dir / "tasks" / f"{name}.yaml").read_text())
        path = pathlib.Path(config["dataset_kwargs"]["data_files"]["test"])
        assert config["task"] == name and config["dataset_path"] == "json"
        assert path.is_absolute() and path == docs_dir / "data" / f"{name}.jsonl"
        assert path.is_file()
    assert config["output_type"] == "loglikelihood"
    assert {m["metric"] for m in config["metric_list"]} == {"acc", "perplexity"}


def test_errors_are_explained(tmp_path, smoke_model, monkeypatch, capsys):
    with pytest.raises(SystemExit, match="heldout_tokens.npy not found"):
        lmt.main(["--model", str(tmp_path), "--out", str(tmp_path / "o"), "--docs-only"])
    monkeypatch.setitem(sys.modules, "lm_eval", None)        # as if not installed
    with pytest.raises(SystemExit, match=r"pip install lm-eval==0\.4\.13"):
        lmt.main(["--model", str(smoke_model), "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit):
        lmt.main(["--model", str(smoke_model), "--out", str(tmp_path / "o"),
                  "--max-model-len", "2048"])
    assert "--max-model-len must be at least" in capsys.readouterr().err


def _fake_setting(out, setting, results, next_lls, ppl_lls, ppl_tokens):
    d = out / setting
    d.mkdir(parents=True)
    (d / "results.json").write_text(json.dumps({"results": results}))
    lmt.write_jsonl(d / "samples_tiny_mla_next_token.jsonl",
                    [{"doc_id": i, "resps": [[[ll, g]]]} for i, (ll, g) in enumerate(next_lls)])
    lmt.write_jsonl(d / "samples_tiny_mla_heldout_ppl.jsonl",
                    [{"doc_id": i, "resps": [[ll]], "doc": {"n_tokens": n}}
                     for i, (ll, n) in enumerate(zip(ppl_lls, ppl_tokens))])


def test_report_compares_settings_with_auto(tmp_path):
    def results(word, acc):
        return {"tiny_mla_heldout_ppl": {"word_perplexity,none": word,
                                         "byte_perplexity,none": 1.5,
                                         "bits_per_byte,none": 0.58},
                "tiny_mla_next_token": {"acc,none": acc, "perplexity,none": 3.0}}

    tokens = [100, 300]
    _fake_setting(tmp_path, "auto", results(10.0, 0.5), [(-1.0, True), (-2.0, False)],
                  [-200.0, -600.0], tokens)
    _fake_setting(tmp_path, "fp8_snapmla", results(10.02, 0.5), [(-1.1, False), (-1.9, True)],
                  [-201.0, -601.0], tokens)
    _fake_setting(tmp_path, "fp8", results(10.5, 0.0), [(-1.5, False), (-2.5, False)],
                  [-210.0, -610.0], tokens)
    opts = SimpleNamespace(out=tmp_path, model=tmp_path, chunk=256, max_model_len=2050,
                           limit=None)
    rows = lmt.summarize(["auto", "fp8_snapmla", "fp8", "missing"], opts)
    by = {r["setting"]: r for r in rows}
    assert list(by) == ["auto", "fp8_snapmla", "fp8"]
    assert by["auto"]["token_ppl"] == pytest.approx(math.exp(800 / 400))
    assert by["fp8_snapmla"]["d_token_ppl_pct"] == pytest.approx(
        100 * (math.exp(802 / 400) / math.exp(800 / 400) - 1))
    assert by["fp8_snapmla"]["d_word_ppl_pct"] == pytest.approx(0.2)
    assert by["fp8_snapmla"]["next_token_flips"] == 2 and by["fp8"]["next_token_flips"] == 1
    assert by["fp8"]["d_next_token_acc"] == pytest.approx(-0.5)
    assert by["fp8_snapmla"]["next_token_mean_abs_dlogprob"] == pytest.approx(0.1)
    assert by["fp8"]["ppl_docs_sum_dloglik"] == pytest.approx(-20.0)
    doc_stats = {"tiny_mla_heldout_ppl": {"docs": 2, "tokens": 400, "bytes": 900,
                                          "dropped_reencode": 0},
                 "tiny_mla_next_token": {"docs": 2, "per_window": 2, "windows": 1,
                                         "window_len": 2048, "seed": 0,
                                         "min_context_tokens": 257,
                                         "rejected_trailing_whitespace": 3,
                                         "rejected_reencode": 0, "missing": 0}}
    text = lmt.write_report(rows, doc_stats, opts, failed=["missing"])
    assert "within 0.5% of BF16: FAIL (+0.501%)" in text
    assert "no worse than fp8: PASS" in text and "Failed settings" in text
    with open(tmp_path / "lm_eval_tiny.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["setting"] for r in table] == ["auto", "fp8_snapmla", "fp8"]
    assert table[0]["d_token_ppl_pct"] == ""


# --- with lm-eval installed ------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_run(smoke_model, docs_dir, tmp_path_factory):
    if not _has("lm_eval", "accelerate"):
        pytest.skip("lm-eval's hf model needs lm-eval==0.4.13 and accelerate")
    out = tmp_path_factory.mktemp("lm-eval-hf")
    cmd = [*SCRIPT, "--model", str(smoke_model), "--out", str(out),
           "--kv", "none", "--hf", "--limit", "3", "--ppl-docs", "1", "--device", "cpu"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_DATASETS_CACHE": str(out / "hf")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                          cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, cmd, env, proc.stdout


def test_lm_eval_hf_scores_the_intended_tokens(hf_run, smoke_model):
    import torch
    from transformers import AutoModelForCausalLM

    out, _, _, _ = hf_run
    results = json.loads((out / "transformers" / "results.json").read_text())["results"]
    for task, key, _ in lmt.METRICS:
        assert math.isfinite(results[task][key]), key
    # --ppl-docs 1: one perplexity document (a 3.6k-token file, two rolling windows)
    assert results["tiny_mla_heldout_ppl"]["sample_len"] == 1
    assert results["tiny_mla_next_token"]["sample_len"] == 3
    model = AutoModelForCausalLM.from_pretrained(smoke_model, dtype=torch.float32).eval()
    tokens = np.load(smoke_model / "heldout_tokens.npy").tolist()
    samples = _jsonl(out / "transformers" / "samples_tiny_mla_next_token.jsonl")
    docs = _jsonl(out / "data" / "tiny_mla_next_token.jsonl")
    assert len(samples) == 3
    for entry in samples:
        doc = docs[int(entry["doc_id"])]
        assert entry["arguments"][0][:2] == [doc["context"], doc["continuation"]]
        window = tokens[doc["window"] * 2048:][:doc["position"] + 1]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([window])).logits[0, -2].log_softmax(-1)
        ll, greedy = entry["resps"][0][0]
        assert ll == pytest.approx(logits[window[-1]].item(), abs=2e-3)
        assert greedy == (logits.argmax().item() == window[-1])
    # bits per byte and byte perplexity follow from the per-document log-likelihoods
    ppl = _jsonl(out / "transformers" / "samples_tiny_mla_heldout_ppl.jsonl")
    total_ll = sum(e["resps"][0][0] for e in ppl)
    total_bytes = sum(e["doc"]["n_bytes"] for e in ppl)
    assert results["tiny_mla_heldout_ppl"]["bits_per_byte,none"] == pytest.approx(
        -total_ll / total_bytes / math.log(2), rel=1e-6)


def test_hf_run_report_and_reuse(hf_run):
    out, cmd, env, stdout = hf_run
    text = (out / "lm_eval_tiny.md").read_text()
    assert "| transformers |" in text
    assert "--model_args" in (out / "transformers" / "lm_eval_command.txt").read_text()
    row = next(csv.DictReader(open(out / "lm_eval_tiny.csv")))
    assert row["setting"] == "transformers" and math.isfinite(float(row["token_ppl"]))
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env,
                           cwd=REPO_ROOT)
    assert again.returncode == 0 and "[transformers] reusing" in again.stdout


def _lm_eval_vllm_model(model: str, out: str, kv_cache_dtype: str) -> dict:
    """Runs in the fake-CUDA vLLM process: lm-eval's VLLM built with the script's arguments,
    the engine replaced by vLLM's own start-up configuration of those arguments."""
    from lm_eval.models import vllm_causallms
    from vllm.engine.arg_utils import EngineArgs

    from tests.unit._vllm_cpu import device_capability

    # The smoke model has 2048 positions (the real one 4096): max_model_len 2048, not 2050.
    opts = lmt.parse_args(["--model", model, "--out", out, "--kv", kv_cache_dtype,
                              "--max-model-len", "2048", "--window-len", "2047"])
    stats = json.loads((pathlib.Path(out) / "docs_stats.json").read_text())
    _, args = lmt.model_args(opts, kv_cache_dtype, stats["eos_id"])

    class EngineConfigOnly:
        def __init__(self, **kwargs):
            with device_capability(9, 0):
                self.config = EngineArgs(**kwargs).create_engine_config()
            self.llm_engine = SimpleNamespace(model_config=self.config.model_config)

    original, vllm_causallms.LLM = vllm_causallms.LLM, EngineConfigOnly
    try:
        lm = vllm_causallms.VLLM(**args)
    finally:
        vllm_causallms.LLM = original
    config = lm.model.config
    # lm-eval's split of each pair with vLLM's tokenizer: the intended ids
    tokens = np.load(pathlib.Path(model) / "heldout_tokens.npy").tolist()
    next_ok = []
    for doc in _jsonl(pathlib.Path(out) / "data" / "tiny_mla_next_token.jsonl")[:40]:
        window = tokens[doc["window"] * 2048:(doc["window"] + 1) * 2048]
        context_enc, continuation_enc = lm._encode_pair(doc["context"], doc["continuation"])
        next_ok.append(context_enc == window[:doc["position"]]
                       and continuation_enc == [doc["token_id"]])
    ppl_doc = _jsonl(pathlib.Path(out) / "data" / "tiny_mla_heldout_ppl.jsonl")[0]
    return {"cache_dtype": config.cache_config.cache_dtype,
            "prefix_caching": config.cache_config.enable_prefix_caching,
            "chunked_prefill": config.scheduler_config.enable_chunked_prefill,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "max_model_len": config.model_config.max_model_len,
            "dtype": str(config.model_config.dtype), "eager": config.model_config.enforce_eager,
            "use_mla": config.model_config.use_mla, "lm_max_length": lm.max_length,
            "prefix_token_id": lm.prefix_token_id, "next_token_pairs_ok": all(next_ok),
            "ppl_doc_tokens_ok": len(lm.tok_encode(ppl_doc["text"])) == ppl_doc["n_tokens"]}


@needs_lm_eval
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_snapmla", "fp8"])
def test_lm_eval_vllm_model_gets_the_parity_engine(smoke_model, docs_dir, kv_cache_dtype):
    from tests.unit._vllm_cpu import shared_process

    got = shared_process().call(_lm_eval_vllm_model, model=str(smoke_model), out=str(docs_dir),
                                kv_cache_dtype=kv_cache_dtype)
    assert got == {"cache_dtype": kv_cache_dtype, "prefix_caching": False,
                   "chunked_prefill": True, "max_num_batched_tokens": 256,
                   "max_model_len": 2048, "dtype": "torch.bfloat16", "eager": True,
                   "use_mla": True, "lm_max_length": 2048, "prefix_token_id": 1,
                   "next_token_pairs_ok": True, "ppl_doc_tokens_ok": True}
