"""fp8_snapmla through ``LLM.generate`` on a tiny DeepSeek-V3, on both vLLM model runners.

Each runner runs the same batch twice (kv_cache_dtype "auto" = BF16, then fp8_snapmla), each
engine in its own process: a long prompt (300 tokens, > max_num_batched_tokens, so chunked
prefill reads its earlier chunks back from the cache) next to short ones, then the long
prompt again (a prefix-cache hit).  The model has random weights of trained-model scale (see
``write_tiny_deepseek_v3``): with vLLM's dummy weights attention hardly reaches the logits.

Random models put many tokens within hundredths of a nat of each other, so greedy outputs
of two correct KV formats part ways at such near-ties and never meet again.  The comparison
(``vllm_snapmla.testing.compare_greedy``) therefore checks, per prompt: the chosen token's
log-probability while both runs have seen the same tokens, and that the first divergence is a
near-tie under BF16.  (A CPU simulation of FP8 latents gave a mean |d logprob| of 0.025 and
flips at BF16 gaps up to 0.6 nats; a cache read from the wrong positions gave 1.3 and gaps
around 1.5.)
"""

import pytest

from tests.e2e.server import KV_CACHE_BYTES
from vllm_snapmla.testing import (compare_greedy, describe_comparison, generate_in_subprocess,
                                  short_and_long_prompts)

pytestmark = pytest.mark.e2e

KV = "fp8_snapmla"
MAX_TOKENS = 12
LONG_PROMPT = 300
ENGINE = {"load_format": "auto", "enable_prefix_caching": True, "max_num_batched_tokens": 128,
          "max_num_seqs": 16, "max_model_len": 1024, "gpu_memory_utilization": 0.3,
          "kv_cache_memory_bytes": KV_CACHE_BYTES}
RUNNERS = {"v1": "0", "mrv2": "1"}     # VLLM_USE_V2_MODEL_RUNNER

MEAN_LOGPROB_DIFF = 0.15     # mean |d logprob| of the chosen token over the shared steps
MAX_LOGPROB_DIFF = 1.0
MIN_MATCH_FRACTION = 0.3     # generated tokens equal, position by position
# Random models are flat (top tokens near -6 nats, five of them within 0.4 nats), so a
# near-tie can sit outside BF16's top 5: look at its top 20 (vLLM's default maximum).
TOP_LOGPROBS = 20


@pytest.fixture(scope="module", params=list(RUNNERS))
def runs(request, model_dir):
    short, long = short_and_long_prompts(0, long_len=LONG_PROMPT)
    spec = {"model": model_dir, "rounds": [short + [long], [long]], "max_tokens": MAX_TOKENS,
            "logprobs": TOP_LOGPROBS, "llm_kwargs": ENGINE}
    env = {"VLLM_USE_V2_MODEL_RUNNER": RUNNERS[request.param]}
    results = {dtype: generate_in_subprocess({**spec, "kv_cache_dtype": dtype}, env=env)
               for dtype in ("auto", KV)}
    return request.param, results


def test_engine_uses_snapmla_on_the_requested_runner(runs):
    runner, results = runs
    for dtype, result in results.items():
        assert ("Using V2 Model Runner" in result["log"]) == (runner == "mrv2"), dtype
    snap = results[KV]
    assert "Using SNAPMLA attention backend" in snap["log"]
    assert snap["block_size"] == 64
    # Same memory budget: 2 * 576 bytes per token and layer for BF16, 656 for fp8_snapmla.
    ratio = snap["kv_cache_tokens"] / results["auto"]["kv_cache_tokens"]
    print(f"[{runner}] KV-cache tokens: auto {results['auto']['kv_cache_tokens']:,}, "
          f"{KV} {snap['kv_cache_tokens']:,} ({ratio:.3f}x)")
    assert 1.6 < ratio < 1.9


def test_prefix_cache_hit_and_chunked_prefill(runs):
    runner, results = runs
    for dtype, result in results.items():
        first, repeat = result["rounds"][0][-1], result["rounds"][1][0]
        # The repeat reuses every full 64-token block of the long prompt.
        assert first["num_cached_tokens"] == 0, dtype
        assert repeat["num_cached_tokens"] >= LONG_PROMPT // 64 * 64, dtype
        assert len(repeat["token_ids"]) == MAX_TOKENS


def test_greedy_outputs_agree_with_bf16(runs):
    runner, results = runs
    base, snap = results["auto"]["rounds"], results[KV]["rounds"]
    stats = compare_greedy(base, snap, KV)
    print(f"[{runner}] " + describe_comparison(stats, f"{KV} vs BF16"))
    for b, s in zip((o for r in base for o in r), (o for r in snap for o in r)):
        print(f"  bf16 {b['token_ids']}\n  snap {s['token_ids']}")
    assert not stats["problems"], "\n".join(stats["problems"])
    assert stats["mean |d logprob|"] <= MEAN_LOGPROB_DIFF
    assert stats["max |d logprob|"] <= MAX_LOGPROB_DIFF
    assert stats["match"] >= MIN_MATCH_FRACTION
