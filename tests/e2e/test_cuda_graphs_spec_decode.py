"""fp8_snapmla decode inside FULL CUDA graphs, and with speculative decoding (n-gram), on the GPU.

Five engines on the tiny random-weight DeepSeek-V3 (V1 model runner), each in its own process,
all fp8_snapmla and greedy:

* ``eager``: ``enforce_eager=True`` (no compilation, no graphs), the reference;
* ``compiled``: vLLM's default mode (torch.compile, FULL_AND_PIECEWISE graphs): with
  ``SnapMLAMetadataBuilder._cudagraph_support = UNIFORM_BATCH`` decode batches replay FULL graphs
  (attention included), padded to the next capture size (11 requests run in the 16 graph);
* ``ngram``: ``compiled`` plus n-gram speculation with 3 draft tokens, again with 2 and with 1
  (what DeepSeek-V3's MTP drafts): uniform verification batches decode 4, 3 or 2 query tokens
  per request (s_q = 4, 3, 2) in FULL graphs; the others go down the prefill path.

Each runs the same prompts: a batch of 11, then an echo round (``p + out(p) + p``, which makes
the n-gram proposer find matches; ``out(p)`` is the eager reference's output, so that an early
divergence of one engine does not change the prompts it is compared on), then the first echo
prompt alone (batches of one request, where every drafted step is a uniform s_q = 1 + drafts
decode).  Outputs are compared with the
near-tie rule (``vllm_snapmla.testing.compare_greedy``): equal tokens until the first
divergence, which must be a near-tie in the reference's log-probabilities, and the chosen
tokens' |d logprob| on a shared context within MEAN_DLOGPROB on average and MAX_DLOGPROB at
most.  Compilation and graphs change summation orders in other layers, so exact equality is not
expected.

On an H200 the four engines before the 3-draft one took 3-4 minutes; ``-k 3-drafts`` alone
(``compiled`` and that engine) took 162 s, before every engine needed the eager reference's
outputs (one engine more now).  The tiny model has 16 heads, so on an H200 plain
decode steps run the sm_90a narrow kernel's 16-row form, s_q = 2 its 32-row form and s_q = 3 and
4 the 64-row kernel (``auto`` picks them on sm_90, and tests/conftest.py refuses to run the
GPU tests on an sm_90 GPU whose build lacks them; ``SNAPMLA_DECODE_KERNEL=triton`` in the
environment puts the portable kernel under the same graphs).
"""

import importlib.util

import pytest
import torch

from tests.e2e.generate import generate
from vllm_snapmla.testing import compare_greedy, describe_comparison

pytestmark = pytest.mark.e2e

KV = "fp8_snapmla"
MAX_TOKENS = 24
TOP_LOGPROBS = 20
NUM_SPECS = (3, 2, 1)   # draft tokens: s_q = 4 (64 query rows with 16 heads), 3 (48) and 2 (32)
# vLLM's CPU n-gram proposer needs numba; without it, its GPU twin (same proposals).
NGRAM = {"method": "ngram" if importlib.util.find_spec("numba") else "ngram_gpu",
         "prompt_lookup_max": 4, "prompt_lookup_min": 2}
ENGINE = {"max_num_seqs": 16, "max_num_batched_tokens": 512, "enable_prefix_caching": True}
# The V1 runner logs every batch's cudagraph mode at DEBUG (tests/e2e/generate.py parses it).
DEBUG = {"VLLM_LOGGING_LEVEL": "DEBUG", "VLLM_USE_V2_MODEL_RUNNER": "0"}
# Bounds on the chosen tokens' |d logprob| on a shared context, over the near-tie rule.  One H100
# measured (2026-12-06): FULL graphs against eager mean 0.0053, max 0.216; n-gram against plain
# decoding mean 0.010-0.012, max 0.306 (same kernels, other batch compositions and s_q).
MEAN_DLOGPROB = 0.04
MAX_DLOGPROB = 1.0


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 60, (11,), generator=gen).tolist()
    prompts = [torch.randint(2, 4096, (n,), generator=gen).tolist() for n in lengths]
    # Some with repetition inside the prompt, for the n-gram proposer.
    for k in range(0, 11, 3):
        prompts[k] = (prompts[k][:7] * 5)[:max(len(prompts[k]), 21)]
    return prompts


def _spec(model_dir, reference=None, **llm_kwargs):
    """``reference``: the eager engine's result, whose first-round outputs build every engine's
    echo prompts (its own when None)."""
    spec = {"model": model_dir, "kv_cache_dtype": KV, "prompts": _prompts(),
            "max_tokens": MAX_TOKENS, "logprobs": TOP_LOGPROBS, "echo": 1, "solo": True,
            "llm_kwargs": {**ENGINE, **llm_kwargs}}
    if reference is not None:
        spec["echo_outputs"] = [[o["token_ids"] for o in reference["rounds"][0]]]
    return spec


@pytest.fixture(scope="module")
def eager(model_dir):
    return generate(_spec(model_dir, enforce_eager=True), env={"VLLM_USE_V2_MODEL_RUNNER": "0"})


@pytest.fixture(scope="module")
def compiled(model_dir, eager):
    return generate(_spec(model_dir, eager, enforce_eager=False), env=DEBUG)


@pytest.fixture(scope="module", params=NUM_SPECS, ids=lambda k: f"{k}-drafts")
def ngram(model_dir, eager, request):
    config = {**NGRAM, "num_speculative_tokens": request.param}
    return request.param, generate(_spec(model_dir, eager, enforce_eager=False,
                                         speculative_config=config), env=DEBUG)


def _print_outputs(base, test, names):
    for r, (br, tr) in enumerate(zip(base["rounds"], test["rounds"])):
        for b, t in zip(br, tr):
            print(f"  round {r} {names[0]:>8} {b['token_ids']}\n  round {r} {names[1]:>8} "
                  f"{t['token_ids']}")


def _full_batches(result) -> list[tuple[int, int]]:
    return [(n, reqs) for mode, n, reqs, uniform in result["batches"]
            if mode == "FULL" and uniform]


def test_decode_replays_full_cuda_graphs(compiled):
    log = compiled["log"]
    assert "Using SNAPMLA attention backend" in log
    assert compiled["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert "Capturing CUDA graphs (decode, FULL)" in log
    assert "setting cudagraph_mode=PIECEWISE" not in log   # no downgrade for our backend
    full = _full_batches(compiled)
    print(f"{len(compiled['batches'])} batches, {len(full)} in FULL decode graphs "
          f"(num_tokens, num_reqs): {sorted(set(full))}")
    assert full, "no decode batch ran in a FULL CUDA graph"
    assert all(n == reqs for n, reqs in full)
    # 11 requests decode together at first: padded to the 16 graph (5 padded rows, seq_len 0).
    assert (16, 16) in full


def test_full_graph_outputs_match_eager(eager, compiled):
    stats = compare_greedy(eager["rounds"], compiled["rounds"], "compiled")
    compared, problems = stats["compared"], stats["problems"]
    _print_outputs(eager, compiled, ("eager", "compiled"))
    print(describe_comparison(stats, "FULL graphs against eager"))
    assert compared >= 5 * MAX_TOKENS   # a sanity floor: most prompts agree for long
    assert stats["skipped"] == 0        # the echo and solo rounds ran the same prompts
    assert not problems, "\n".join(problems)
    assert stats["mean |d logprob|"] <= MEAN_DLOGPROB and stats["max |d logprob|"] <= MAX_DLOGPROB


def test_ngram_speculation_matches_plain_decoding(compiled, ngram):
    num_spec, ngram = ngram
    m = ngram["metrics"]
    drafts = m.get("vllm:spec_decode_num_draft_tokens") or 0
    accepted = m.get("vllm:spec_decode_num_accepted_tokens") or 0
    full = _full_batches(ngram)
    multi = [(n, reqs) for n, reqs in full if n == (1 + num_spec) * reqs]
    print(f"{NGRAM['method']}: {m.get('vllm:spec_decode_num_drafts')} drafts, "
          f"{drafts} draft tokens, {accepted} accepted; FULL decode graphs with "
          f"s_q = {1 + num_spec}: {len(multi)} batches {sorted(set(multi))}")
    assert ngram["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert drafts > 0, "the n-gram proposer drafted nothing: no multi-token decode ran"
    # Uniform verification batches (every request with num_spec drafts) ran as s_q = 1 + num_spec
    # decodes in FULL graphs; the solo round makes every drafted step such a batch.
    assert multi, f"no s_q = {1 + num_spec} decode batch ran in a FULL CUDA graph"
    stats = compare_greedy(compiled["rounds"], ngram["rounds"], "ngram")
    compared, problems = stats["compared"], stats["problems"]
    _print_outputs(compiled, ngram, ("plain", "ngram"))
    print(describe_comparison(stats, f"n-gram ({num_spec} drafts) against plain decoding"))
    assert compared >= 5 * MAX_TOKENS   # a sanity floor: most prompts agree for long
    # The solo round (every drafted step an s_q = 1 + drafts decode in a FULL graph) is compared.
    assert stats["skipped"] == 0 and ngram["rounds"][-1][0]["prompt"] == \
        compiled["rounds"][-1][0]["prompt"]
    assert not problems, "\n".join(problems)
    assert stats["mean |d logprob|"] <= MEAN_DLOGPROB and stats["max |d logprob|"] <= MAX_DLOGPROB
