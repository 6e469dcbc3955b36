"""``python -m vllm_snapmla.demo`` without a GPU: the reference's accuracy report, which the README
promises on any machine (the GPU branch is tests/e2e/test_demo.py)."""

import os
import subprocess
import sys

import pytest

from tests.unit._vllm_cpu import REPO_ROOT


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="the GPU branch runs instead (tests/e2e/test_demo.py)")
def test_demo_without_gpu_reports_reference_accuracy():
    from vllm_snapmla.testing import with_pythonpath

    env = with_pythonpath(os.environ, str(REPO_ROOT))
    out = subprocess.run([sys.executable, "-m", "vllm_snapmla.demo"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "need one" in out.stdout and "sm_89+" in out.stdout
    rows = [line.split("|") for line in out.stdout.splitlines() if line.count("|") == 1]
    errors = [float(x) for _, numbers in rows[1:] for x in numbers.split()[:2]]
    assert len(errors) == 8 and all(0 < e < 0.1 for e in errors)
