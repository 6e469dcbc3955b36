"""``vllm serve --kv-cache-dtype fp8_snapmla`` answers an OpenAI completion request over HTTP."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from vllm_snapmla.demo import subprocess_env, write_tiny_deepseek_v3

pytestmark = pytest.mark.e2e

STARTUP_TIMEOUT_S = 600
VOCAB = 4096


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 120):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, json.loads(response.read() or b"null")


def _wait_healthy(base: str, server: subprocess.Popen, log: pathlib.Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"vllm serve exited with {server.returncode}:\n"
                        f"{log.read_text()[-6000:]}")
        try:
            if _http(f"{base}/health", timeout=5)[0] == 200:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    pytest.fail(f"vllm serve not healthy after {STARTUP_TIMEOUT_S} s:\n"
                f"{log.read_text()[-6000:]}")


def _stop(server: subprocess.Popen) -> None:
    # The server runs in its own session; the engine core and workers are in its group.
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_vllm_serve_completion_with_token_ids(tmp_path):
    model = str(write_tiny_deepseek_v3(tmp_path / "tiny-deepseek-v3"))
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
               "--served-model-name", "tiny", "--kv-cache-dtype", "fp8_snapmla",
               "--skip-tokenizer-init", "--load-format", "dummy", "--enforce-eager",
               "--max-model-len", "1024", "--gpu-memory-utilization", "0.3",
               "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as log_file:
        server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                  env=subprocess_env(), start_new_session=True)
    try:
        _wait_healthy(base, server, log)
        prompts = [[5, 17, 99, 1000, 4000] * 20, [7, 8, 9]]
        status, reply = _http(f"{base}/v1/completions", {
            "model": "tiny", "prompt": prompts, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True})
    finally:
        _stop(server)
    assert status == 200
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    assert len(choices) == len(prompts)
    for choice in choices:
        assert choice["finish_reason"] == "length"
        assert len(choice["token_ids"]) == 8
        assert all(0 <= t < VOCAB for t in choice["token_ids"])
    assert reply["usage"]["completion_tokens"] == 16
    assert "Using SNAPMLA attention backend" in log.read_text()
