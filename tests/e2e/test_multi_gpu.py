"""fp8_snapmla under tensor and data parallelism, on 2, 4 or 8 GPUs.

A tiny DeepSeek-V3 with random weights of trained-model scale (``write_tiny_deepseek_v3``), its
second layer MoE; every engine in its own process, its workers spawned by vLLM and loading the
plugin through the ``vllm.general_plugins`` entry point, as in a deployment.  Three parts:

* **Tensor parallelism through ``LLM.generate``**: TP2 on the 16-head model (8 heads per rank),
  TP4 and TP8 on a 64-head one (16 and 8 heads per rank; one TP8 rank of DeepSeek-V3 has 16), in
  eager mode and with the default compilation (FULL decode graphs), prefix caching and chunked
  prefill on: the batch of ``test_llm_generate`` (a 300-token prompt over 128-token chunks next
  to 11 short ones, then the long prompt again, a prefix-cache hit).  fp8_snapmla at TP N is
  compared with the BF16 cache at TP N and with fp8_snapmla at TP1 (same model, same mode).
* **Data parallelism with expert parallelism**, ``vllm serve --data-parallel-size 2
  --enable-expert-parallel`` (the MoE layer's 8 experts split 4 and 4), eager and compiled:
  first the long prompt alone, pinned to rank 0 with the ``X-data-parallel-rank`` header, so
  that rank 1 has nothing scheduled and runs vLLM's dummy batch for every step (with expert
  parallelism its forward joins rank 0's all-gathers, so the request completes only if the
  dummies run; ``test_dummy_batch.py`` covers that path on one GPU); then five short prompts at
  once, pinned to rank 0 (under FULL graphs rank 1's dummy is padded to rank 0's 8-request graph:
  rows of ``seq_len`` 0); then the other six and the long prompt again, load-balanced.
* **``vllm serve --tensor-parallel-size 2``** answering the batch's requests at once.

Every fp8_snapmla output is compared with the TP1 fp8_snapmla run of the same prompt, and the
TP runs with BF16, by the near-tie rule (``vllm_snapmla.testing.compare_greedy``): equal greedy
tokens until the first divergence, which must be a near-tie in the reference; |d logprob| of
the chosen tokens small while the contexts agree.  TP changes the GEMM and all-reduce
summation orders and EP the MoE's, so exact equality is not expected; a rank reading the wrong
pages, or pages another rank wrote differently, moves log-probabilities by about a nat.

Each case skips when fewer GPUs are visible than it needs (2 for TP2, DP2 and the TP2 server,
4 for TP4, 8 for TP8).  With 8 GPUs the module starts 19 engines (4 TP1 references).
"""

from __future__ import annotations

import concurrent.futures
import re

import pytest
import torch

from tests.e2e.server import KV_CACHE_BYTES, http, http_text, vllm_server
from vllm_snapmla.testing import (compare_greedy, describe_comparison, generate_in_subprocess,
                                  short_and_long_prompts, tp_shard_problems,
                                  write_tiny_deepseek_v3)

pytestmark = pytest.mark.e2e

KV = "fp8_snapmla"
VOCAB = 4096
MAX_TOKENS = 12
LONG_PROMPT = 300
TOP_LOGPROBS = 20
NUM_SHORT = 11
MAX_NUM_BATCHED_TOKENS = 128       # < LONG_PROMPT: chunked prefill
ENGINE = {"load_format": "auto", "enable_prefix_caching": True,
          "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "max_num_seqs": 16,
          "max_model_len": 1024, "gpu_memory_utilization": 0.3,
          "kv_cache_memory_bytes": KV_CACHE_BYTES}
SERVER_ARGS = ["--kv-cache-dtype", KV, "--skip-tokenizer-init", "--seed", "0",
               "--max-model-len", "1024", "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
               "--max-num-seqs", "16", "--enable-prefix-caching",
               "--gpu-memory-utilization", "0.3", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
REQUEST_TIMEOUT_S = 300

# The tiny model (16 heads, moe_intermediate_size 256) for TP2 and DP2, and a 64-head one for
# TP4 and TP8, with routed-expert MLPs of 512 so that a TP8 shard is 64 wide.
MODELS = {16: {}, 64: {"num_attention_heads": 64, "num_key_value_heads": 64,
                       "moe_intermediate_size": 512}}
TP_CASES = {2: 16, 4: 64, 8: 64}            # TP size: model (heads)

MEAN_LOGPROB_DIFF = 0.15     # as test_llm_generate (fp8_snapmla against BF16 at TP1)
MAX_LOGPROB_DIFF = 1.0
MIN_MATCH_FRACTION = 0.3

_VISIBLE = torch.cuda.device_count()


def _needs_gpus(n: int):
    return pytest.mark.skipif(_VISIBLE < n, reason=f"needs {n} GPUs, {_VISIBLE} visible")


def _mode(eager: bool) -> str:
    return "eager" if eager else "compiled"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Heads -> checkpoint directory, written on first use."""
    written = {}

    def get(heads: int) -> str:
        if heads not in written:
            written[heads] = str(write_tiny_deepseek_v3(
                tmp_path_factory.mktemp(f"tiny-deepseek-v3-{heads}-heads"),
                random_weights=True, **MODELS[heads]))
        return written[heads]
    return get


def _prompts():
    return short_and_long_prompts(0, num_short=NUM_SHORT, long_len=LONG_PROMPT, vocab=VOCAB)


def _rounds():
    short, long = _prompts()
    return [short + [long], [long]]


def _generate(models, heads: int, kv: str, eager: bool, tp: int = 1) -> dict:
    spec = {"model": models(heads), "kv_cache_dtype": kv, "rounds": _rounds(),
            "max_tokens": MAX_TOKENS, "logprobs": TOP_LOGPROBS,
            "llm_kwargs": {**ENGINE, "enforce_eager": eager, "tensor_parallel_size": tp}}
    return generate_in_subprocess(spec, timeout=1800)


@pytest.fixture(scope="module")
def tp1(models):
    """(heads, eager) -> the TP1 fp8_snapmla run of the batch, run on first use."""
    runs = {}

    def get(heads: int, eager: bool) -> dict:
        if (heads, eager) not in runs:
            runs[heads, eager] = _generate(models, heads, KV, eager)
        return runs[heads, eager]
    return get


def _snapmla_processes(log: str) -> set[str]:
    """Names of the processes (vLLM prefixes worker output with ``(name pid=N)``) that selected
    the SnapMLA backend."""
    return set(re.findall(r"\((\S+) pid=\d+\)[^\n]*Using SNAPMLA attention backend", log))


def _assert_agree(base: list[list[dict]], test: list[list[dict]], what: str) -> None:
    stats = compare_greedy(base, test, what)
    print(describe_comparison(stats, what))
    assert not stats["problems"], "\n".join(stats["problems"])
    assert stats["mean |d logprob|"] <= MEAN_LOGPROB_DIFF, what
    assert stats["max |d logprob|"] <= MAX_LOGPROB_DIFF, what
    assert stats["match"] >= MIN_MATCH_FRACTION, what


# --- tensor parallelism through LLM.generate ---------------------------------------------------

@pytest.fixture(scope="module", params=[
    pytest.param((tp, eager), marks=_needs_gpus(tp), id=f"tp{tp}-{_mode(eager)}")
    for tp in TP_CASES for eager in (True, False)])
def tp_runs(request, models):
    tp, eager = request.param
    heads = TP_CASES[tp]
    problems = tp_shard_problems(MODELS[heads], tp)
    assert not problems, problems
    return tp, heads, eager, {kv: _generate(models, heads, kv, eager, tp)
                              for kv in ("auto", KV)}


def test_tp_engine_runs_snapmla_on_every_rank(tp_runs):
    tp, heads, eager, results = tp_runs
    for kv, result in results.items():
        assert result["tensor_parallel_size"] == tp, kv
    snap = results[KV]
    assert snap["cudagraph_mode"] == ("NONE" if eager else "FULL_AND_PIECEWISE")
    ranks = _snapmla_processes(snap["log"])
    print(f"tp{tp}: processes that selected SNAPMLA: {sorted(ranks)}")
    for rank in range(tp):
        assert any(name.endswith(f"_TP{rank}") for name in ranks), (rank, ranks)
    assert snap["block_size"] == 64
    if not eager:
        assert "Capturing CUDA graphs (decode, FULL)" in snap["log"]
    # Same memory budget per rank; the latent cache is replicated on every rank, so the ratio
    # is the format's, as on one GPU (1152 / 656 bytes per token and layer).
    ratio = snap["kv_cache_tokens"] / results["auto"]["kv_cache_tokens"]
    assert 1.6 < ratio < 1.9, ratio


def test_tp_prefix_cache_hit_and_chunked_prefill(tp_runs):
    *_, results = tp_runs
    for kv, result in results.items():
        first, repeat = result["rounds"][0][-1], result["rounds"][1][0]
        assert first["num_cached_tokens"] == 0, kv
        assert repeat["num_cached_tokens"] >= LONG_PROMPT // 64 * 64, kv
        assert all(len(o["token_ids"]) == MAX_TOKENS for r in result["rounds"] for o in r), kv


def test_tp_greedy_outputs_agree_with_bf16(tp_runs):
    tp, _, eager, results = tp_runs
    _assert_agree(results["auto"]["rounds"], results[KV]["rounds"],
                  f"tp{tp} {_mode(eager)}: {KV} vs BF16")


def test_tp_greedy_outputs_agree_with_tp1(tp_runs, tp1):
    tp, heads, eager, results = tp_runs
    _assert_agree(tp1(heads, eager)["rounds"], results[KV]["rounds"],
                  f"tp{tp} {_mode(eager)}: {KV} vs {KV} at TP1")


# --- through vllm serve --------------------------------------------------------------------------

def _complete(base: str, prompt: list[int], rank: int | None = None) -> dict:
    """One greedy completion (``rank``: the data-parallel rank to run it on), as
    ``run_generation`` reports an output."""
    headers = None if rank is None else {"X-data-parallel-rank": str(rank)}
    status, reply = http(f"{base}/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "ignore_eos": True, "logprobs": TOP_LOGPROBS, "return_token_ids": True,
        "return_tokens_as_token_ids": True}, timeout=REQUEST_TIMEOUT_S, headers=headers)
    assert status == 200
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == MAX_TOKENS
    assert all(0 <= t < VOCAB for t in choice["token_ids"])
    return {"prompt": prompt, "token_ids": choice["token_ids"],
            "logprobs": [{k.removeprefix("token_id:"): v for k, v in step.items()}
                         for step in choice["logprobs"]["top_logprobs"]]}


def _at_once(base: str, prompts: list[list[int]], rank: int | None = None) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(pool.map(lambda p: _complete(base, p, rank), prompts))


def _generation_tokens_per_engine(base: str) -> dict[str, float]:
    counts = {}
    for labels, value in re.findall(r"^vllm:generation_tokens_total\{([^}]*)\} (\S+)$",
                                    http_text(f"{base}/metrics"), re.M):
        engine = re.search(r'engine="(\d+)"', labels)
        if engine:
            counts[engine.group(1)] = counts.get(engine.group(1), 0.0) + float(value)
    return counts


@pytest.fixture(scope="module", params=[
    pytest.param(eager, marks=_needs_gpus(2), id=f"dp2-ep-{_mode(eager)}")
    for eager in (True, False)])
def dp_served(request, models, tmp_path_factory):
    eager = request.param
    assert not tp_shard_problems(MODELS[16], 1, ep=2)
    short, long = _prompts()
    log = tmp_path_factory.mktemp("dp2-ep") / "server.log"
    args = SERVER_ARGS + ["--data-parallel-size", "2", "--enable-expert-parallel"]
    args += ["--enforce-eager"] if eager else []
    with vllm_server(models(16), args, log) as base:
        alone = [_complete(base, long, rank=0)]
        tokens_after_alone = _generation_tokens_per_engine(base)
        rank0_batch = _at_once(base, short[:5], rank=0)
        balanced = _at_once(base, short[5:] + [long])
    return {"eager": eager, "phases": [alone, rank0_batch, balanced],
            "tokens_after_alone": tokens_after_alone, "log": log.read_text()}


def test_dp_ep_server_runs_snapmla_on_both_ranks(dp_served):
    names = _snapmla_processes(dp_served["log"])
    print(f"processes that selected SNAPMLA: {sorted(names)}")
    for rank in (0, 1):
        assert any(f"DP{rank}" in name for name in names), (rank, names)
    # The request pinned to rank 0 ran there only: rank 1 generated nothing meanwhile.
    tokens = dp_served["tokens_after_alone"]
    assert tokens.get("0") == MAX_TOKENS and tokens.get("1", 0.0) == 0, tokens


def test_dp_ep_outputs_agree_with_tp1(dp_served, tp1):
    reference = tp1(16, dp_served["eager"])["rounds"]
    short_ref, long_ref, long_again_ref = (reference[0][:NUM_SHORT], reference[0][-1],
                                           reference[1][0])
    base = [[long_ref], short_ref[:5], short_ref[5:] + [long_again_ref]]
    _assert_agree(base, dp_served["phases"],
                  f"dp2 ep {_mode(dp_served['eager'])} server vs {KV} at TP1")


@pytest.fixture(scope="module")
def tp2_served(models, tmp_path_factory):
    short, long = _prompts()
    log = tmp_path_factory.mktemp("tp2-serve") / "server.log"
    with vllm_server(models(16), SERVER_ARGS + ["--tensor-parallel-size", "2"], log) as base:
        batch = _at_once(base, short + [long])
        repeat = [_complete(base, long)]
    return {"rounds": [batch, repeat], "log": log.read_text()}


@_needs_gpus(2)
def test_tp2_server_answers_concurrent_requests(tp2_served, tp1):
    names = _snapmla_processes(tp2_served["log"])
    assert any(n.endswith("_TP0") for n in names) and any(n.endswith("_TP1") for n in names), \
        names
    _assert_agree(tp1(16, False)["rounds"], tp2_served["rounds"],
                  f"tp2 server (compiled) vs {KV} at TP1")
