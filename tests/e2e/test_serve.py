"""``vllm serve --kv-cache-dtype fp8_snapmla`` answers an OpenAI completion request over HTTP."""

import pytest

from tests.e2e.server import KV_CACHE_BYTES, http, vllm_server
from vllm_snapmla.testing import write_tiny_deepseek_v3

pytestmark = pytest.mark.e2e

VOCAB = 4096


def test_vllm_serve_completion_with_token_ids(tmp_path):
    model = str(write_tiny_deepseek_v3(tmp_path / "tiny-deepseek-v3"))
    log = tmp_path / "server.log"
    args = ["--kv-cache-dtype", "fp8_snapmla", "--skip-tokenizer-init", "--load-format", "dummy",
            "--enforce-eager", "--max-model-len", "1024", "--gpu-memory-utilization", "0.3",
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
    with vllm_server(model, args, log) as base:
        prompts = [[5, 17, 99, 1000, 4000] * 20, [7, 8, 9]]
        status, reply = http(f"{base}/v1/completions", {
            "model": "tiny", "prompt": prompts, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True})
    assert status == 200
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    assert len(choices) == len(prompts)
    for choice in choices:
        assert choice["finish_reason"] == "length"
        assert len(choice["token_ids"]) == 8
        assert all(0 <= t < VOCAB for t in choice["token_ids"])
    assert reply["usage"]["completion_tokens"] == 16
    assert "Using SNAPMLA attention backend" in log.read_text()
