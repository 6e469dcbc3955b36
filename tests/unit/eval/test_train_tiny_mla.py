"""``python -m eval.train_tiny_mla --smoke`` on CPU: it learns, and what it saves loads as vLLM
needs."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from eval import parity_tiny


@pytest.fixture(scope="module")
def smoke_run(smoke_checkpoint):
    return smoke_checkpoint, json.loads((smoke_checkpoint / "train_log.json").read_text())


def test_smoke_run_is_fast_and_learns(smoke_run):
    out, train_log = smoke_run
    # ~5 s on an idle 2-core CPU; the bound only catches a smoke run that stopped being small.
    assert train_log["wall_seconds"] < 60
    assert train_log["steps"] == 40 and train_log["smoke"]
    history = [loss for _, loss in train_log["loss_history"]]
    vocab = train_log["config"]["vocab_size"]
    # An untrained model starts near uniform over the vocabulary and must fall well below it.
    assert abs(history[0] - math.log(vocab)) < 0.5
    assert train_log["final_train_loss"] < history[0] - 0.5
    assert train_log["heldout_loss"] < math.log(vocab) - 0.5
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "heldout_tokens.npy"):
        assert (out / name).is_file(), name


def test_checkpoint_loads_in_transformers_with_the_logged_heldout_loss(smoke_run):
    from transformers import AutoModelForCausalLM

    out, train_log = smoke_run
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True,
                                                       dtype=torch.float32)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info.get("mismatched_keys")
    # The saved (BF16) weights reproduce the held-out loss measured before saving.
    tokens = torch.from_numpy(np.load(out / "heldout_tokens.npy")).long()
    seq_len, windows = train_log["seq_len"], 8
    rows = tokens[:windows * seq_len + 1]
    batch = torch.stack([rows[i * seq_len:(i + 1) * seq_len + 1] for i in range(windows)])
    with torch.no_grad():
        logits = model(input_ids=batch[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    assert abs(loss - train_log["heldout_loss"]) < 0.05


def test_tokenizer_round_trips_text(smoke_run):
    from transformers import AutoTokenizer

    out, train_log = smoke_run
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = 'def f(x):\n    """Üñíçødé — 数据"""\n\treturn {x: [1, 2.5e-3]}  # tab\n'
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert max(ids) < train_log["config"]["vocab_size"]
    assert tokenizer.eos_token_id == train_log["config"]["eos_token_id"]
    assert tokenizer.bos_token_id == train_log["config"]["bos_token_id"]


def test_weight_names_are_the_ones_vllm_loads(smoke_run):
    """Same tensor names and shapes as ``testing.write_tiny_deepseek_v3`` writes for this config:
    those load in vLLM 0.26's DeepseekV3ForCausalLM (checked on an H200), dense layers included.
    """
    from safetensors import safe_open

    from vllm_snapmla.testing import _random_deepseek_v3_weights

    out, _ = smoke_run
    config = json.loads((out / "config.json").read_text())
    # vLLM builds an MoE MLP iff n_routed_experts is set and layer >= first_k_dense_replace.
    assert config["first_k_dense_replace"] >= config["num_hidden_layers"]
    assert "head_dim" not in config and "index_topk" not in config
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["qk_nope_head_dim"],
            config["v_head_dim"]) == (512, 64, 128, 128)
    expected = {name: tuple(t.shape) for name, t in _random_deepseek_v3_weights(config, 0).items()}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
    assert saved == expected


def _in_vllm_parity_engine_config(model: str, kv_cache_dtype: str) -> dict:
    """vLLM's start-up configuration of an ``eval.parity_tiny`` run on ``model``."""
    from tests.unit._vllm_cpu import engine_config

    kwargs = parity_tiny.engine_kwargs(model, kv_cache_dtype, chunk=256, max_model_len=1024)
    config = engine_config(**kwargs, load_format="auto", skip_tokenizer_init=False)
    return {"use_mla": config.model_config.use_mla,
            "head_size": config.model_config.get_head_size(),
            "chunked_prefill": config.scheduler_config.enable_chunked_prefill,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "prefix_caching": config.cache_config.enable_prefix_caching,
            "cache_dtype": config.cache_config.cache_dtype,
            "calculate_kv_scales": config.cache_config.calculate_kv_scales}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_snapmla", "fp8", "fp8-calibrated"])
def test_vllm_accepts_the_checkpoint_with_parity_settings(smoke_run, kv_cache_dtype):
    from tests.unit._vllm_cpu import shared_process

    out, _ = smoke_run
    config = shared_process().call(_in_vllm_parity_engine_config, model=str(out),
                                   kv_cache_dtype=kv_cache_dtype)
    assert config == {"use_mla": True, "head_size": 576, "chunked_prefill": True,
                      "max_num_batched_tokens": 256, "prefix_caching": False,
                      "cache_dtype": kv_cache_dtype.removesuffix("-calibrated"),
                      "calculate_kv_scales": kv_cache_dtype == "fp8-calibrated"}


def test_parity_greedy_with_cache_matches_full_recompute(smoke_run):
    """The transformers greedy baseline in eval.parity_tiny uses the KV cache correctly."""
    from transformers import AutoModelForCausalLM

    out, _ = smoke_run
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = np.load(out / "heldout_tokens.npy").tolist()
    # Two prompts of one length (a batch) and one of another, in mixed order.
    prompts = [tokens[:40], tokens[100:125], tokens[200:240]]
    cached = parity_tiny.greedy_with_cache(model, prompts, 12, "cpu")
    assert len(cached) == len(prompts)
    for prompt, continuation in zip(prompts, cached):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(12):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert continuation == ids[len(prompt):]
