"""The README's demo command on a GPU: ``python -m vllm_snapmla.demo`` runs both KV formats
through ``LLM.generate`` and reports vLLM's cache capacity (the CPU branch is tested in
tests/unit/test_demo.py)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from vllm_snapmla.testing import with_pythonpath

pytestmark = pytest.mark.e2e

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_gpu_demo_runs_both_formats_and_reports_the_capacity():
    env = with_pythonpath(os.environ, str(REPO_ROOT))
    out = subprocess.run([sys.executable, "-m", "vllm_snapmla.demo"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    for dtype in ("auto", "fp8_snapmla"):
        assert f"kv_cache_dtype={dtype}:" in out.stdout
    assert len(re.findall(r"prompt \d \(\d+ tokens\) -> \[", out.stdout)) == 6
    ratio = float(re.search(r"KV-cache capacity fp8_snapmla / bf16: ([\d.]+)x", out.stdout)[1])
    # 1152 / 656 = 1.756 bytes for bytes; the demo lets vLLM size each cache from the free
    # memory, which the two backends' activations leave slightly different.
    assert 1.6 <= ratio <= 1.9
