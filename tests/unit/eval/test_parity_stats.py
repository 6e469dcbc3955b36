"""Paired statistics (``eval.common``) and the reports of ``eval.parity_tiny`` and
``eval.lm_eval_tiny`` on synthetic data.

Two KV-cache settings score the same tokens; the tables report the per-token difference of
their negative log-likelihoods with a paired standard error that takes the documents (windows,
files), not the tokens, as the independent units.
"""

import csv
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from eval import lm_eval_tiny, parity_tiny
from eval.common import paired_delta


def test_paired_delta_is_token_weighted_with_documents_as_units():
    rng = np.random.default_rng(0)
    # windows of one length: the mean over all tokens, the SE of the window means
    per_token = rng.normal(1e-3, 1e-2, size=(12, 500))
    mean, se = paired_delta(per_token.sum(1), [500] * 12)
    assert mean == pytest.approx(per_token.mean())
    assert se == pytest.approx(per_token.mean(1).std(ddof=1) / math.sqrt(12))
    # documents of different lengths weigh by their tokens: a constant per-token difference
    # is recovered exactly, with no spread
    lengths = np.array([30, 400, 12829, 7])
    mean, se = paired_delta(2e-4 * lengths, lengths)
    assert mean == pytest.approx(2e-4) and se == pytest.approx(0, abs=1e-15)
    mean, se = paired_delta([3.0], [10])
    assert mean == pytest.approx(0.3) and math.isnan(se)


def test_paired_delta_se_matches_the_spread_of_the_estimate():
    """Documents of uneven length, each with its own offset (neighbouring tokens correlated):
    over repeated draws the estimate spreads as the SE says; an SE over tokens taken as
    independent would be far too small."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(30, 4000, size=29)
    reps, sigma_doc, sigma_tok = 4000, 2e-3, 5e-2
    offsets = rng.normal(1e-4, sigma_doc, size=(reps, len(lengths)))
    sums = lengths * offsets + np.sqrt(lengths) * sigma_tok * rng.normal(size=offsets.shape)
    estimates, ses = zip(*(paired_delta(s, lengths) for s in sums))
    spread = np.std(estimates)
    assert np.mean(ses) == pytest.approx(spread, rel=0.1)
    token_iid_se = math.sqrt(sigma_doc ** 2 + sigma_tok ** 2) / math.sqrt(lengths.sum())
    assert token_iid_se < spread / 2


def _raw(logprobs, continuations):
    return {"logprobs": [list(map(float, w)) for w in logprobs],
            "correct": [[1] * len(w) for w in logprobs], "continuations": continuations,
            "kv_cache_tokens": 1000}


def test_parity_tiny_reports_paired_nll_differences(tmp_path):
    rng = np.random.default_rng(2)
    chunk, windows = 4, 3
    auto = rng.normal(-2.0, 1.0, size=(windows, 10))
    # fp8_snapmla: every token 1e-3 nats less likely; fp8: one offset per window, and the
    # first `chunk` positions (not read through the cache) perturbed without counting
    offsets = np.array([[-1e-3], [2e-3], [5e-3]])
    snap, fp8 = auto - 1e-3, auto - offsets
    fp8[:, :chunk] -= 1.0
    prompts = [[1, 2, 3]] * 2
    raws = {"auto": _raw(auto, prompts), "fp8_snapmla": _raw(snap, prompts),
            "fp8": _raw(fp8, [[1, 2, 3], [1, 2, 4]])}
    rows = [parity_tiny.summarize(name, raw, None if name == "auto" else raws["auto"], chunk)
            for name, raw in raws.items()]
    by = {r["run"]: r for r in rows}
    assert by["fp8_snapmla"]["dnll_vs_bf16"] == pytest.approx(1e-3)
    assert by["fp8_snapmla"]["dnll_vs_bf16_se"] == pytest.approx(0, abs=1e-12)
    assert by["fp8"]["dnll_vs_bf16"] == pytest.approx(2e-3)
    assert by["fp8"]["dnll_vs_bf16_se"] == pytest.approx(offsets.std(ddof=1) / math.sqrt(3))
    args = SimpleNamespace(model="m", windows=windows, window_len=11, chunk=chunk, prompts=2,
                           gen_len=3, prompt_len=2)
    text = parity_tiny.write_report(tmp_path, rows, args, None, {})
    assert "| fp8_snapmla | " in text and "+1.00e-03 ± " in text
    # fp8_snapmla − fp8 per window: 1e-3 − offset nats per token
    diff = 1e-3 - offsets[:, 0]
    se = diff.std(ddof=1) / math.sqrt(3)
    assert (f"no worse than fp8: PASS ({by['fp8_snapmla']['ppl_cache_context']:.4f} vs "
            f"{by['fp8']['ppl_cache_context']:.4f}; NLL per token fp8_snapmla − fp8 "
            f"{diff.mean():+.2e} ± {se:.1e} nats, {abs(diff.mean()) / se:.1f} paired SE over "
            f"3 windows)") in text
    with open(tmp_path / "parity_tiny.csv") as f:
        table = {r["run"]: r for r in csv.DictReader(f)}
    assert table["auto"]["dnll_vs_bf16"] == "" and "window_nll" not in table["auto"]
    assert float(table["fp8"]["dnll_vs_bf16_se"]) == pytest.approx(
        by["fp8"]["dnll_vs_bf16_se"])


def test_parity_tiny_reruns_stale_runs_and_reports_failures(tmp_path, monkeypatch):
    """A saved run is reused only for the same checkpoint and options; a failed run is named
    in the report and the exit status."""
    model, out = tmp_path / "model", tmp_path / "out"
    model.mkdir()
    np.save(model / "heldout_tokens.npy", np.arange(4 * 32) % 50)
    ran = []

    def fake_run(spec, timeout):
        ran.append((spec["run"], len(spec["windows"])))
        if spec["run"] == "fp8":
            raise RuntimeError("exit 1: out of memory")
        lp = [[-1.0] * (len(w) - 1) for w in spec["windows"]]
        return {**_raw(lp, [[1, 2]] * len(spec["prompts"])), "seconds": {"score": 1.0}}

    monkeypatch.setattr(parity_tiny, "run_in_subprocess", fake_run)
    common = ["--model", str(model), "--out", str(out), "--dtypes", "auto,fp8_snapmla,fp8",
              "--no-transformers", "--window-len", "32", "--chunk", "8", "--prompts", "2",
              "--prompt-len", "4", "--gen-len", "2"]
    assert parity_tiny.main(common + ["--windows", "2"]) == 1
    assert ran == [("auto", 2), ("fp8_snapmla", 2), ("fp8", 2)]
    assert "**Failed, not in the table:** fp8" in (out / "parity_tiny.md").read_text()
    ran.clear()
    assert parity_tiny.main(common + ["--windows", "2", "--dtypes", "auto,fp8_snapmla"]) == 0
    assert ran == []                                   # same checkpoint and options: reused
    assert parity_tiny.main(common + ["--windows", "4", "--dtypes", "auto,fp8_snapmla"]) == 0
    assert ran == [("auto", 4), ("fp8_snapmla", 4)]    # other options: rerun
    ran.clear()
    # Other code (a kernel change, another vLLM): rerun, and the report names the code.
    monkeypatch.setattr(parity_tiny, "code_version", lambda: "commit abc1234, vLLM 0.26.0")
    assert parity_tiny.main(common + ["--windows", "4", "--dtypes", "auto,fp8_snapmla"]) == 0
    assert ran == [("auto", 4), ("fp8_snapmla", 4)]
    assert "Measured with commit abc1234, vLLM 0.26.0" in (out / "parity_tiny.md").read_text()
    with pytest.raises(SystemExit):
        parity_tiny.main(common + ["--chunk", "32"])   # nothing past the first chunk to score


def _lm_eval_setting(out, setting, ppl_lls, ppl_tokens):
    d = out / setting
    d.mkdir(parents=True)
    results = {"tiny_mla_heldout_ppl": {"word_perplexity,none": 10.0,
                                        "byte_perplexity,none": 1.5,
                                        "bits_per_byte,none": 0.58},
               "tiny_mla_next_token": {"acc,none": 0.5, "perplexity,none": 3.0}}
    (d / "results.json").write_text(json.dumps({"results": results}))
    lm_eval_tiny.write_jsonl(d / "samples_tiny_mla_next_token.jsonl",
                             [{"doc_id": 0, "resps": [[[-1.0, True]]]}])
    lm_eval_tiny.write_jsonl(d / "samples_tiny_mla_heldout_ppl.jsonl",
                             [{"doc_id": i, "resps": [[float(ll)]], "doc": {"n_tokens": int(n)}}
                              for i, (ll, n) in enumerate(zip(ppl_lls, ppl_tokens))])


def test_lm_eval_tiny_reports_paired_nll_differences(tmp_path):
    tokens = np.array([100, 300, 50])
    auto = np.array([-200.0, -600.0, -80.0])
    snap = auto - [0.5, 0.1, 0.4]                  # per file: summed NLL differences
    fp8 = auto - [0.1, 0.3, -0.2]
    for setting, lls in (("auto", auto), ("fp8_snapmla", snap), ("fp8", fp8)):
        _lm_eval_setting(tmp_path, setting, lls, tokens)
    opts = SimpleNamespace(out=tmp_path, model=tmp_path, chunk=256, max_model_len=2050,
                           limit=None)
    rows = lm_eval_tiny.summarize(["auto", "fp8_snapmla", "fp8"], opts)
    by = {r["setting"]: r for r in rows}

    def ratio_se(d):
        mean = d.sum() / tokens.sum()
        return mean, math.sqrt(3 / 2 * ((d - mean * tokens) ** 2).sum()) / tokens.sum()

    mean, se = ratio_se(np.array([0.5, 0.1, 0.4]))
    assert by["fp8_snapmla"]["d_token_nll"] == pytest.approx(mean)
    assert by["fp8_snapmla"]["d_token_nll_se"] == pytest.approx(se)
    assert math.expm1(mean) * 100 == pytest.approx(by["fp8_snapmla"]["d_token_ppl_pct"])
    stats = {"tiny_mla_heldout_ppl": {"docs": 3, "tokens": 450, "bytes": 900,
                                      "dropped_reencode": 0},
             "tiny_mla_next_token": {"docs": 1, "per_window": 1, "windows": 1,
                                     "window_len": 2048, "seed": 0, "min_context_tokens": 257,
                                     "rejected_trailing_whitespace": 0, "rejected_reencode": 0,
                                     "missing": 0}}
    text = lm_eval_tiny.write_report(rows, stats, opts, failed=[])
    assert f"| {mean:+.2e} ± {se:.1e} |" in text
    mean, se = ratio_se(np.array([0.4, -0.2, 0.6]))      # fp8_snapmla − fp8
    assert (f"no worse than fp8: FAIL ({by['fp8_snapmla']['token_ppl']:.4f} vs "
            f"{by['fp8']['token_ppl']:.4f}; NLL per token fp8_snapmla − fp8 {mean:+.2e} ± "
            f"{se:.1e} nats, {mean / se:.1f} paired SE over 3 files)") in text
    with open(tmp_path / "lm_eval_tiny.csv") as f:
        table = {r["setting"]: r for r in csv.DictReader(f)}
    assert float(table["fp8"]["d_token_nll_se"]) == pytest.approx(by["fp8"]["d_token_nll_se"])
    assert "ppl_docs" not in table["fp8"] and "SE of ΔNLL" not in text
