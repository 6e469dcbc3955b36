"""``vllm serve --kv-cache-dtype fp8_snapmla`` under concurrent streaming load, driven by
``openai``.

One server (tiny DeepSeek-V3 with random weights of trained-model scale, token-id prompts,
prefix caching on, default compilation settings) answers the same 16 greedy requests twice:

1. one at a time: a long prompt (3500 tokens of a 4096 context), the same long prompt again
   (a prefix-cache hit), then 14 short prompts;
2. under load, after resetting the prefix cache: the long prompt alone until its first token
   arrives (its prefill has then filled the cache), then its repeat and the 14 short prompts
   at once, so 16 streams decode together.

Every prompt fits one prefill chunk in both phases (``--max-num-batched-tokens`` exceeds all
of them together), so each request sees the same prompt path; only the batch around it
changes.  vLLM does not promise bit-identical results across batch shapes (GEMM tilings, and
the SnapMLA decode picks its KV split count from the batch size), and a random-weight model
puts many tokens within hundredths of a nat of each other.  So the check is: greedy tokens are
equal until the first divergence, which must be a near-tie in the one-at-a-time run, and the
top log-probabilities agree on every step both runs reached with the same tokens.  A request
reading another request's cache pages, or stale pages, moves them by about a nat.
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time

import pytest
import torch

from tests.e2e.server import KV_CACHE_BYTES, http, http_text, vllm_server
from vllm_snapmla import format as fmt
from vllm_snapmla.testing import write_tiny_deepseek_v3

pytestmark = pytest.mark.e2e

VOCAB = 4096
MAX_MODEL_LEN = 4096
LONG_PROMPT = 3500
NUM_SHORT = 14
MAX_TOKENS = 32
TOP_LOGPROBS = 20                 # vLLM's default maximum
REQUEST_TIMEOUT_S = 180
PHASE_TIMEOUT_S = 600

NEAR_TIE_NATS = 0.5               # one-at-a-time log-prob gap allowed where the outputs part
MAX_LOGPROB_DIFF = 0.5            # per token, over the top log-probs both runs report
MEAN_LOGPROB_DIFF = 0.05
MIN_PEAK_CONCURRENCY = 8          # streams decoding at the same instant under load

SERVER_ARGS = [
    "--kv-cache-dtype", fmt.KV_CACHE_DTYPE, "--skip-tokenizer-init", "--seed", "0",
    "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "8192",
    "--max-num-seqs", "32", "--enable-prefix-caching", "--enable-prompt-tokens-details",
    "--gpu-memory-utilization", "0.3", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
]
# /reset_prefix_cache is a development endpoint.
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


def _requests() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(0)
    long = torch.randint(2, VOCAB, (LONG_PROMPT,), generator=gen).tolist()
    lengths = torch.randint(8, 300, (NUM_SHORT,), generator=gen).tolist()
    short = {f"short{i}": torch.randint(2, VOCAB, (n,), generator=gen).tolist()
             for i, n in enumerate(lengths)}
    return {"long": long, "long_again": long, **short}


def _stream(client, prompt: list[int], first_token: threading.Event | None = None) -> dict:
    """One streaming greedy completion; token ids, top log-probs, chunk times and usage."""
    stream = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        logprobs=TOP_LOGPROBS, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True,
                    "return_tokens_as_token_ids": True})
    out = {"token_ids": [], "top_logprobs": [], "token_times": [], "finish_reason": None,
           "usage": None}
    for chunk in stream:
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for choice in chunk.choices:
            token_ids = (choice.model_extra or {}).get("token_ids") or []
            if token_ids:
                out["token_times"].append(time.monotonic())
                if first_token is not None:
                    first_token.set()
            out["token_ids"] += token_ids
            if choice.logprobs is not None:
                out["top_logprobs"] += [{int(k.removeprefix("token_id:")): v
                                         for k, v in step.items()}
                                        for step in choice.logprobs.top_logprobs]
            out["finish_reason"] = choice.finish_reason or out["finish_reason"]
    return out


def _prefix_cache_hits(base: str) -> float:
    text = http_text(f"{base}/metrics")
    return sum(float(v) for v in
               re.findall(r"^vllm:prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$", text, re.M))


def _reset_prefix_cache(base: str) -> None:
    # The reset is refused while any request still holds blocks; they are freed right after
    # the last response, so a refusal can only be brief.
    for _ in range(10):
        status, reply = http(f"{base}/reset_prefix_cache", {}, timeout=60)
        if status == 200 and reply["success"]:
            return
        time.sleep(1)
    pytest.fail(f"prefix cache not reset: {reply}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Both phases against one server; returns their results, the metrics and the log."""
    import openai

    tmp = tmp_path_factory.mktemp("serve-load")
    model = str(write_tiny_deepseek_v3(tmp / "tiny-deepseek-v3", random_weights=True))
    log = tmp / "server.log"
    requests = _requests()
    with vllm_server(model, SERVER_ARGS, log, env=SERVER_ENV) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused",
                               timeout=REQUEST_TIMEOUT_S, max_retries=0)
        one_at_a_time = {name: _stream(client, prompt) for name, prompt in requests.items()}
        hits_after_first_phase = _prefix_cache_hits(base)

        _reset_prefix_cache(base)

        burst = {name: p for name, p in requests.items() if name != "long"}
        start = threading.Barrier(len(burst))
        long_prefilled = threading.Event()

        def in_burst(prompt):
            start.wait(timeout=60)
            return _stream(client, prompt)

        with concurrent.futures.ThreadPoolExecutor(max_workers=len(requests)) as pool:
            long_future = pool.submit(_stream, client, requests["long"], long_prefilled)
            assert long_prefilled.wait(timeout=REQUEST_TIMEOUT_S), "long prompt: no token"
            futures = {name: pool.submit(in_burst, p) for name, p in burst.items()}
            under_load = {name: f.result(timeout=PHASE_TIMEOUT_S) for name, f in futures.items()}
            under_load["long"] = long_future.result(timeout=PHASE_TIMEOUT_S)
        hits_total = _prefix_cache_hits(base)
    return {"requests": requests, "one_at_a_time": one_at_a_time, "under_load": under_load,
            "hits": (hits_after_first_phase, hits_total), "log": log.read_text()}


def test_every_stream_completes(served):
    assert "Using SNAPMLA attention backend" in served["log"]
    for phase in ("one_at_a_time", "under_load"):
        for name, prompt in served["requests"].items():
            out = served[phase][name]
            assert out["finish_reason"] == "length", (phase, name)
            assert len(out["token_ids"]) == MAX_TOKENS, (phase, name)
            assert all(0 <= t < VOCAB for t in out["token_ids"]), (phase, name)
            assert len(out["top_logprobs"]) == MAX_TOKENS, (phase, name)
            assert len(out["token_times"]) >= 2, (phase, name, "not streamed")
            assert out["usage"].prompt_tokens == len(prompt), (phase, name)
            assert out["usage"].completion_tokens == MAX_TOKENS, (phase, name)


def test_streams_decode_concurrently(served):
    intervals = [(out["token_times"][0], out["token_times"][-1])
                 for out in served["under_load"].values()]
    peak = max(sum(first <= t <= last for first, last in intervals)
               for t, _ in intervals)
    assert peak >= MIN_PEAK_CONCURRENCY, f"only {peak} streams overlapped"


def test_repeated_long_prompt_hits_prefix_cache(served):
    # vLLM caches full pages and always recomputes the prompt's last token.
    expected = (LONG_PROMPT - 1) // fmt.PAGE_SIZE * fmt.PAGE_SIZE
    for phase in ("one_at_a_time", "under_load"):
        details = {name: served[phase][name]["usage"].prompt_tokens_details
                   for name in served["requests"]}
        assert details["long"].cached_tokens == 0, phase
        assert details["long_again"].cached_tokens == expected, phase
        assert all(d.cached_tokens == 0 for name, d in details.items()
                   if name.startswith("short")), phase
    after_first, total = served["hits"]
    assert after_first >= expected
    assert total - after_first >= expected


def _compare(alone: dict, loaded: dict) -> tuple[int | None, list[float]]:
    """First diverging step (None if equal) and |d logprob| over steps with equal context."""
    a, b = alone["token_ids"], loaded["token_ids"]
    diverge = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    last_shared = len(a) - 1 if diverge is None else diverge
    diffs = []
    for step in range(last_shared + 1):
        top_a, top_b = alone["top_logprobs"][step], loaded["top_logprobs"][step]
        diffs += [abs(top_a[t] - top_b[t]) for t in top_a.keys() & top_b.keys()]
    return diverge, diffs


def test_greedy_outputs_under_load_match_one_at_a_time(served):
    all_diffs, diverged = [], []
    for name in served["requests"]:
        alone, loaded = served["one_at_a_time"][name], served["under_load"][name]
        diverge, diffs = _compare(alone, loaded)
        assert diffs, name
        all_diffs += diffs
        if diverge is not None:
            step = alone["top_logprobs"][diverge]
            ours, theirs = alone["token_ids"][diverge], loaded["token_ids"][diverge]
            assert theirs in step, (name, diverge, "load picked a token outside the top 20")
            gap = step[ours] - step[theirs]
            assert gap <= NEAR_TIE_NATS, (name, diverge, gap)
            diverged.append((name, diverge, round(gap, 4)))
    mean = sum(all_diffs) / len(all_diffs)
    print(f"diverged (request, step, one-at-a-time gap): {diverged}; "
          f"|d logprob| mean {mean:.4f} max {max(all_diffs):.4f}")
    assert max(all_diffs) <= MAX_LOGPROB_DIFF
    assert mean <= MEAN_LOGPROB_DIFF
