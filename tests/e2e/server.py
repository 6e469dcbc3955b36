"""Start and stop ``vllm serve`` (OpenAI-compatible HTTP server) for the end-to-end tests.

The server listens on 127.0.0.1 only and runs in its own session, so stopping it kills its
whole process group (API server, engine core, workers) even when a test fails.
"""

from __future__ import annotations

import contextlib
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

from vllm_snapmla.testing import subprocess_env

STARTUP_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60
# A fixed KV-cache budget for every e2e engine: vLLM then skips its memory profiling, which
# fails when another process on the GPU frees memory meanwhile (seen on the H200 with the
# tiny-model training running beside the tests).  Equal bytes for every KV dtype also makes
# capacity ratios exact (1152 / 656 bytes per token and layer).
KV_CACHE_BYTES = 4 << 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 120,
         headers: dict | None = None):
    """GET (``body`` None) or POST JSON, with extra ``headers``; returns (status, decoded JSON
    body)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, json.loads(response.read() or b"null")


def http_text(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def _wait_healthy(base: str, server: subprocess.Popen, log: pathlib.Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"vllm serve exited with {server.returncode}:\n"
                        f"{log.read_text()[-6000:]}")
        try:
            if http(f"{base}/health", timeout=5)[0] == 200:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    pytest.fail(f"vllm serve not healthy after {STARTUP_TIMEOUT_S} s:\n"
                f"{log.read_text()[-6000:]}")


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=STOP_TIMEOUT_S)


@contextlib.contextmanager
def vllm_server(model: str, args: list[str], log: pathlib.Path, env: dict | None = None):
    """Run ``vllm serve model *args`` until the block ends; yields the base URL.

    The model is served as ``tiny``; everything it prints goes to ``log``.  ``env`` adds to
    ``subprocess_env()`` (which makes the plugin loadable from this source tree).
    """
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
               *args]
    with open(log, "w") as log_file:
        server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                  env=subprocess_env(env), start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base, server, log)
        yield base
    finally:
        _stop(server)
