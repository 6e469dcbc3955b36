"""The dummy batches of an idle data-parallel rank, run on one GPU with fp8_snapmla.

Under data parallelism every rank joins every forward pass (with expert parallelism the MoE
layers all-gather across ranks), so a rank with nothing scheduled runs
``Worker.execute_dummy_batch`` instead: ``EngineCoreProc.run_busy_loop`` does it for every step
another rank runs (``v1/engine/core.py:2055``; paths relative to vLLM 0.26.0's package).  That is
``model_runner._dummy_run(uniform_decode_query_len, uniform_decode=True)``
(``v1/worker/gpu_worker.py:1233``): one request of ``1 + num_speculative_tokens`` query tokens.
On the V1 runner (``v1/worker/gpu_model_runner.py``) its ``seq_len`` equals its query length
(:5972), padded rows get ``seq_len`` 0 and query length 0 (:5974, and the ``query_start_loc``
fill after it), its KV slots are -1 so nothing is written (:5942), and the block table is the
persistent batch's rows as they are (:6001; the padded count goes in as ``num_reqs`` (:6007), so
the null-block fill of padded rows at :2317 does nothing).  Attention metadata is built only
when the batch replays a FULL CUDA graph (:5951): in eager mode, or a PIECEWISE batch, vLLM's MLA
layer returns zeros without calling the backend (``mla_attention.py:706``).  The V2 runner builds
a dummy input batch of ``seq_len = query_len`` for every request, padded ones included
(``v1/worker/gpu/input_batch.py:123``), over the last real step's gathered block tables
(``v1/worker/gpu/block_table.py:166``), in every mode.

``LLM.collective_rpc("execute_dummy_batch")`` runs the same call on one GPU, so this module
checks that path here, on five engines: V1 eager; V1 with the default compilation (the dummy
replays the 1-request FULL decode graph); V1 with CUDA-graph sizes [2, 4, 8, 16] (the dummy is
padded to 2 requests, the second with ``seq_len`` 0: the shape an idle rank pads to when another
rank decodes a larger batch); V1 with n-gram speculation (1 draft token, as DeepSeek-V3's MTP)
and sizes [4, 8, 16, 32] (a ``s_q = 2`` dummy padded to 2 requests); and the V2 runner in eager
mode (its dummy calls our decode eagerly).  Each engine runs dummy batches before any request
(on the V1 runner the persistent block table is still empty: the dummy request reads block 0,
vLLM's null block; the V2 runner's start-up warm-up, ``warmup_kernels`` at
``v1/worker/gpu/warmup.py:155``, called from ``gpu_worker.py:863``, has run a prefill and a
decode on blocks numbered from 1 and left them in its table, so its dummy reads one of those),
between two rounds of real requests (chunked prefill, then a prefix-cache hit on the pages
written before the dummies) and after them; one of each three goes through
``tests/e2e/probes.py:dummy_batch``, which records the metadata our builder was given.  A twin
engine runs the same rounds without dummy batches: the real outputs must not change (a dummy
that wrote into the cache, or left state behind in the decode's CUDA graph, would move them by
about a nat).  Both twins run the engine core in the test's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where ``LLM.generate`` adds every request before the
first step.  With vLLM's separate engine-core process the requests reach the core one message
at a time and its loop (``EngineCore._process_input_queue``, ``v1/engine/core.py:1368``) starts
stepping with those that have arrived, so two engines need not run the same batches, nor, with
chunked prefill, the same chunks: their outputs may differ at a near-tie without any dummy.

The probe also reports whether the dummy's hidden states came out finite, and they must: vLLM
allocates the KV cache with ``torch.zeros`` (``gpu_model_runner.py:7264``) and never writes the
null block, whose zero per-token scale the decode reads as a zero token (logit 0, value 0), as
a BF16 cache holds there.  vLLM discards dummy outputs, but under expert parallelism they share
the MoE layer's all-gather with the other ranks' real tokens.
"""

import importlib.util

import pytest

from tests.e2e.server import KV_CACHE_BYTES
from vllm_snapmla.testing import (compare_greedy, describe_comparison, generate_in_subprocess,
                                  short_and_long_prompts)

pytestmark = pytest.mark.e2e

KV = "fp8_snapmla"
MAX_TOKENS = 12
LONG_PROMPT = 300
TOP_LOGPROBS = 20
ENGINE = {"load_format": "auto", "enable_prefix_caching": True, "max_num_batched_tokens": 128,
          "max_num_seqs": 16, "max_model_len": 1024, "gpu_memory_utilization": 0.3,
          "kv_cache_memory_bytes": KV_CACHE_BYTES}
NGRAM = {"method": "ngram" if importlib.util.find_spec("numba") else "ngram_gpu",
         "num_speculative_tokens": 1, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# name: (LLM keyword arguments, VLLM_USE_V2_MODEL_RUNNER, what our builder must be given per
# dummy: None = nothing (no metadata); (num_reqs, seq_lens, query_start_loc, tokens) for the V1
# runner, traced in its code; "seq_len = query_len" for the V2 runner's dummy input batch)
CONFIGS = {
    "v1-eager": ({"enforce_eager": True}, "0", None),
    "v1-full": ({"enforce_eager": False}, "0", (1, [1], [0, 1], 1)),
    "v1-full-padded": ({"enforce_eager": False,
                        "compilation_config": {"cudagraph_capture_sizes": [2, 4, 8, 16]}},
                       "0", (2, [1, 0], [0, 1, 1], 2)),
    "v1-full-ngram1-padded": ({"enforce_eager": False, "speculative_config": NGRAM,
                               "compilation_config": {"cudagraph_capture_sizes": [4, 8, 16, 32]}},
                              "0", (2, [2, 0], [0, 2, 2], 4)),
    "mrv2-eager": ({"enforce_eager": True}, "1", "seq_len = query_len"),
}
PROBE = "tests.e2e.probes:dummy_batch"
# Before round 0, before round 1, after round 1: the probe and two plain calls each.
RPCS = [[PROBE, "execute_dummy_batch", "execute_dummy_batch"]] * 3
# Two engines with the same batches in two processes: their outputs should be identical; this
# leaves room for run-to-run noise, not for a corrupted page (about a nat).
MAX_LOGPROB_DIFF = 0.05


def _rounds():
    short, long = short_and_long_prompts(2, long_len=LONG_PROMPT)
    return [short + [long], [long] + short[:3]]


@pytest.fixture(scope="module", params=list(CONFIGS))
def runs(request, model_dir):
    llm_kwargs, runner, _ = CONFIGS[request.param]
    spec = {"model": model_dir, "kv_cache_dtype": KV, "rounds": _rounds(),
            "max_tokens": MAX_TOKENS, "logprobs": TOP_LOGPROBS,
            "llm_kwargs": {**ENGINE, **llm_kwargs}}
    # In-process engine cores: the same batches in both twins (module docstring).
    env = {"VLLM_USE_V2_MODEL_RUNNER": runner, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with_dummies = generate_in_subprocess({**spec, "rpcs": RPCS}, env=env)
    without = generate_in_subprocess(spec, env=env)
    return request.param, with_dummies, without


def _probes(result) -> list[dict]:
    """The probe's report from each slot (before round 0, before round 1, after round 1)."""
    return [slot[0][0] for slot in result["rpc_results"]]


def test_dummy_batches_give_the_backend_vllms_dummy_decode(runs):
    name, result, _ = runs
    expected = CONFIGS[name][2]
    assert "Using SNAPMLA attention backend" in result["log"]
    assert ("Using V2 Model Runner" in result["log"]) == name.startswith("mrv2")
    assert len(result["rpc_results"]) == len(RPCS)
    for slot, probe in zip(result["rpc_results"], _probes(result)):
        assert slot[1:] == [[None], [None]]   # one worker, nothing returned
        print(f"[{name}] {probe['runner']}: builds {probe['builds']}, hidden rows finite "
              f"{probe['hidden_rows_finite']}")
        assert probe["dummy_runs"] == 1
        if probe["hidden_rows_finite"] is not None:
            assert all(probe["hidden_rows_finite"]), probe["hidden_rows_finite"]
        if expected is None:
            # No attention metadata: vLLM's MLA layer zero-fills the output itself.
            assert probe["builds"] == []
            continue
        assert len(probe["builds"]) == 1, probe["builds"]
        build = probe["builds"][0]
        # Every row a decode, padded ones included: decode_uniform sees s_q = tokens / num_reqs.
        assert (build["num_decodes"], build["num_prefills"]) == (build["num_reqs"], 0)
        assert build["num_decode_tokens"] == build["num_actual_tokens"]
        if isinstance(expected, str):
            query_lens = [b - a for a, b in zip(build["query_start_loc"],
                                                build["query_start_loc"][1:])]
            assert build["seq_lens"] == query_lens[:len(build["seq_lens"])]
            continue
        num_reqs, seq_lens, query_start_loc, tokens = expected
        assert (build["num_reqs"], build["num_actual_tokens"]) == (num_reqs, tokens)
        assert build["seq_lens"] == seq_lens
        assert build["query_start_loc"] == query_start_loc
    if expected is not None:
        # Before any request: on the V1 runner the block table is all zeros, so the dummy reads
        # block 0, the null block (zero bytes, never written); the V2 runner's table holds its
        # start-up warm-up's blocks (module docstring), real ones written with finite values.
        first = _probes(result)[0]["builds"][0]
        if name.startswith("mrv2"):
            assert all(1 <= block < result["num_gpu_blocks"]
                       for block in first["block_table_first_column"]), first
        else:
            assert first["block_table_first_column"] == [0] * first["num_reqs"]


def test_real_outputs_are_unchanged_by_dummy_batches(runs):
    name, with_dummies, without = runs
    # The same engine and requests with and without dummies: a divergence is allowed only at a
    # true near-tie (a dummy that corrupted the cache moves logprobs by about a nat).
    stats = compare_greedy(without["rounds"], with_dummies["rounds"], "with dummy batches",
                           near_tie_nats=0.05)
    print(f"[{name}] " + describe_comparison(stats, "with vs without dummy batches"))
    for problem in stats["problems"]:   # printed as found: a lost run still shows where
        print(f"[{name}]   {problem}", flush=True)
    assert not stats["problems"], "\n".join(stats["problems"])
    assert stats["max |d logprob|"] <= MAX_LOGPROB_DIFF
    # The repeat of the long prompt reuses the pages written before the dummy batches.
    for result in (with_dummies, without):
        repeat = result["rounds"][1][0]
        assert repeat["num_cached_tokens"] >= LONG_PROMPT // 64 * 64
        assert all(len(o["token_ids"]) == MAX_TOKENS for r in result["rounds"] for o in r)
