"""The comparison and configuration helpers of ``vllm_snapmla.testing`` that the end-to-end tests
rely on (they run only on GPUs, so their yardsticks are checked here, on the CPU)."""

import pytest

from vllm_snapmla.testing import TINY_DEEPSEEK_V3, compare_greedy, tp_shard_problems


def _out(tokens, logprobs, prompt=(1, 2, 3)):
    return {"prompt": list(prompt), "token_ids": tokens,
            "logprobs": [{str(t): lp for t, lp in step.items()} for step in logprobs]}


# Base run: token 5 then 7 then 9; at step 1 token 8 is 0.3 nats below 7, token 6 is 2 below.
BASE = _out([5, 7, 9], [{5: -1.0, 4: -3.0}, {7: -2.0, 8: -2.3, 6: -4.0}, {9: -0.5, 3: -2.0}])


def test_identical_runs_agree_exactly():
    stats = compare_greedy([[BASE]], [[BASE]])
    assert stats["problems"] == []
    assert stats["match"] == 1.0 and stats["compared"] == 3 and stats["shared steps"] == 3
    assert stats["max |d logprob|"] == 0.0


def test_divergence_at_a_near_tie_is_accepted_and_ends_the_comparison():
    test = _out([5, 8, 9], [{5: -1.1}, {8: -2.1, 7: -2.2}, {9: -0.4}])
    stats = compare_greedy([[BASE]], [[test]])
    assert stats["problems"] == []
    assert stats["compared"] == 2 and stats["shared steps"] == 1
    # Step 0's chosen token (0.1) and, at the divergence, both chosen tokens (0.2 each).
    assert stats["mean |d logprob|"] == pytest.approx(0.5 / 3)
    assert stats["max |d logprob|"] == pytest.approx(0.2)
    assert stats["match"] == pytest.approx(2 / 3)      # step 2 agrees again, position-wise


def test_a_shift_at_the_divergence_shows_in_the_log_probabilities():
    """Both engines computed the divergence step from the same context: a test engine that moved
    the base choice down by 1.5 nats there (a misread cache) flips within the near-tie rule,
    but not within the log-probability bounds."""
    test = _out([5, 8, 9], [{5: -1.0}, {8: -2.3, 7: -3.5}, {9: -0.5}])
    stats = compare_greedy([[BASE]], [[test]])
    assert stats["problems"] == [] and stats["max |d logprob|"] == pytest.approx(1.5)


@pytest.mark.parametrize("token, message", [(6, "2.000 nats below the base run's 7"),
                                            (11, "not in the base run's top 3")])
def test_divergence_far_from_the_base_choice_is_a_problem(token, message):
    test = _out([5, token, 9], [{5: -1.0}, {token: -1.0}, {9: -0.5}])
    stats = compare_greedy([[BASE]], [[test]], "tp2")
    assert len(stats["problems"]) == 1
    assert stats["problems"][0].startswith(f"round 0 prompt 0 step 1: tp2 chose {token}")
    assert message in stats["problems"][0]
    if token == 6:     # a looser rule accepts it
        assert compare_greedy([[BASE]], [[test]], near_tie_nats=2.5)["problems"] == []


def test_other_prompts_are_skipped_and_missing_outputs_are_problems():
    other = _out([1, 1, 1], [{1: -0.1}] * 3, prompt=(4, 5))
    stats = compare_greedy([[BASE, BASE]], [[other, BASE]])
    assert stats["skipped"] == 1 and stats["problems"] == [] and stats["compared"] == 3
    assert compare_greedy([[BASE, BASE]], [[BASE]])["problems"] == [
        "round 0: 2 outputs in the base run, 1 in test"]
    assert compare_greedy([[BASE], [BASE]], [[BASE]])["problems"] == [
        "2 rounds in the base run, 1 in test"]
    short = _out([5, 7], [{5: -1.0}, {7: -2.0}])
    assert compare_greedy([[BASE]], [[short]])["problems"] == [
        "round 0 prompt 0: 3 tokens in the base run, 2 in test"]


def test_tp_shard_problems():
    assert tp_shard_problems({}, 1) == []
    assert tp_shard_problems({}, 16) == []            # 16 heads, 256-wide experts: all split
    assert tp_shard_problems({}, 3) == [
        f"{name} = {TINY_DEEPSEEK_V3[key]} does not split over 3 TP ranks"
        for name, key in [("num_attention_heads", "num_attention_heads"),
                          ("intermediate_size", "intermediate_size"),
                          ("moe_intermediate_size", "moe_intermediate_size")]
    ] + ["shared experts' intermediate size = 256 does not split over 3 TP ranks",
         "vocab_size = 4096 does not split over 3 TP ranks"]
    assert tp_shard_problems({}, 32) == ["num_attention_heads = 16 does not split over 32 TP "
                                         "ranks"]
    assert tp_shard_problems({}, 1, ep=2) == []
    assert tp_shard_problems({}, 1, ep=3) == ["n_routed_experts = 8 does not split over 3 EP "
                                              "ranks"]


def test_multi_gpu_models_split_over_their_ranks():
    # The configurations tests/e2e/test_multi_gpu.py runs on 2, 4 and 8 GPUs.
    from tests.e2e import test_multi_gpu as m

    heads_per_rank = {}
    for tp, heads in m.TP_CASES.items():
        assert tp_shard_problems(m.MODELS[heads], tp) == [], tp
        heads_per_rank[tp] = {**TINY_DEEPSEEK_V3, **m.MODELS[heads]}["num_attention_heads"] // tp
    assert heads_per_rank == {2: 8, 4: 16, 8: 8}
    assert tp_shard_problems(m.MODELS[16], 1, ep=2) == []
    moe = {**TINY_DEEPSEEK_V3, **m.MODELS[16]}
    assert moe["first_k_dense_replace"] < moe["num_hidden_layers"]   # an MoE layer for EP


def test_run_generation_runs_rpcs_between_rounds(monkeypatch):
    # The child of generate_in_subprocess, with LLM replaced by a recorder: RPC slot k runs
    # before round k, a slot past the last round after it, "module:function" as a callable.
    from types import SimpleNamespace

    import vllm

    from tests.e2e import probes
    from vllm_snapmla import testing

    calls = []

    class FakeLLM:
        def __init__(self, model, kv_cache_dtype, **kwargs):
            calls.append(("init", kwargs["enforce_eager"]))
            self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(
                cache_config=SimpleNamespace(num_gpu_blocks=10, block_size=64),
                parallel_config=SimpleNamespace(tensor_parallel_size=2),
                compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name="NONE"))))

        def collective_rpc(self, method):
            calls.append(("rpc", method))
            return [f"{getattr(method, '__name__', method)} done"] * 2

        def generate(self, prompts, params, use_tqdm):
            calls.append(("generate", len(prompts)))
            return [SimpleNamespace(num_cached_tokens=0, outputs=[SimpleNamespace(
                token_ids=[7], logprobs=[{7: SimpleNamespace(logprob=-0.5)}])])
                for _ in prompts]

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    result = testing.run_generation({
        "model": "m", "kv_cache_dtype": "fp8_snapmla", "rounds": [[[1, 2]], [[3], [4]]],
        "max_tokens": 1, "llm_kwargs": {"enforce_eager": False},
        "rpcs": [["execute_dummy_batch"], [], ["tests.e2e.probes:dummy_batch"]]})
    assert calls == [("init", False), ("rpc", "execute_dummy_batch"), ("generate", 1),
                     ("generate", 2), ("rpc", probes.dummy_batch)]
    assert result["rpc_results"] == [[["execute_dummy_batch done"] * 2], [],
                                     [["dummy_batch done"] * 2]]
    assert result["rounds"][1] == [
        {"prompt": [p], "token_ids": [7], "logprobs": [{"7": -0.5}], "num_cached_tokens": 0}
        for p in (3, 4)]
    assert (result["tensor_parallel_size"], result["cudagraph_mode"]) == (2, "NONE")
    assert result["kv_cache_tokens"] == 640


def test_tiny_deepseek_v3_checkpoint_loads_in_transformers(tmp_path):
    # The e2e tests load this checkpoint in vLLM; transformers reads the same DeepSeek-V3
    # layout (per-expert MoE tensors), so a missing or misnamed tensor shows up here.
    import torch
    from transformers import DeepseekV3ForCausalLM

    from vllm_snapmla.testing import write_tiny_deepseek_v3

    path = write_tiny_deepseek_v3(tmp_path, random_weights=True, seed=3)
    model, info = DeepseekV3ForCausalLM.from_pretrained(str(path), output_loading_info=True,
                                                        dtype=torch.bfloat16)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    config = model.config
    assert (config.kv_lora_rank, config.qk_rope_head_dim) == (512, 64)
    assert not hasattr(config, "index_topk")
    with torch.no_grad():
        logits = model(torch.randint(2, 4096, (1, 9))).logits.float()
    assert torch.isfinite(logits).all() and logits.std() > 0.1   # not dummy-weight flat
