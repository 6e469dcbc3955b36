"""A long-context engine's eager steps run to the end on the GPU (``eager_schedule.py``).

An ``enforce_eager`` engine of 8 requests of 128k tokens at 16 heads, with vLLM's 2054-page
table for that ``max_model_len``, once gave no result for minutes (README, Known limits) while
the same cell ran in seconds in CUDA graphs and with a 2560-page table.  These tests replay its
kernel calls (chunked prefill with decodes in the same steps, then decode steps, the split plan
made once per step as vLLM's builder makes it) in a child process, each step under a deadline,
with both tables, and require every step to finish and every output to be finite
(``tests/unit/test_eager_schedule.py`` runs the replay itself small on the CPU).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_snapmla.kernels import sm90

SCHEDULE = Path(__file__).with_name("eager_schedule.py")
ROOT = SCHEDULE.parents[2]


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCHEDULE), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.skipif(not torch.cuda.is_available() or not sm90.available(),
                    reason="needs an sm_90 GPU and the decode_sm90 op")
@pytest.mark.parametrize("width", [2054, 2560])
@pytest.mark.parametrize("route", ["plan", "noplan"])
def test_eager_steps_of_eight_128k_requests_finish(width, route):
    proc = _run("--width", str(width), "--route", route, "--reps", "2", timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), \
        (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
