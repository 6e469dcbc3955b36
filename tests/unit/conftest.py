"""Fixtures shared by the CPU tests."""

import os
import pathlib
import subprocess
import sys

import pytest

from tests.unit._vllm_cpu import shared_process

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vllm_cpu():
    """The shared fake-CUDA vLLM process (``tests/unit/_vllm_cpu.py``)."""
    return shared_process()


@pytest.fixture(scope="session")
def smoke_checkpoint(tmp_path_factory) -> pathlib.Path:
    """``python -m eval.train_tiny_mla --smoke`` on the CPU, trained once per session; read-only."""
    out = tmp_path_factory.mktemp("tiny-mla-smoke")
    proc = subprocess.run([sys.executable, "-m", "eval.train_tiny_mla",
                           "--out", str(out), "--smoke", "--seed", "0"],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out
