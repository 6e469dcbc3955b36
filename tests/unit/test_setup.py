"""setup.py: a machine without a CUDA toolkit installs the pure-Python package and says so."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _setup_name(env_updates):
    env = {**os.environ, **env_updates}
    env.pop("SNAPMLA_SKIP_BUILD", None)
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_without_a_toolkit_setup_skips_the_extension_and_says_so(tmp_path):
    run = _setup_name({"CUDA_HOME": str(tmp_path / "no-cuda-here")})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith("vllm-snapmla")
    assert "no CUDA toolkit found" in run.stderr and "without the native extension" in run.stderr


def test_with_a_toolkit_setup_does_not_warn():
    toolkit = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    if not (toolkit / "bin" / "nvcc").exists():
        pytest.skip("no CUDA toolkit on this machine")
    run = _setup_name({"CUDA_HOME": str(toolkit)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "no CUDA toolkit found" not in run.stderr
