"""``tests/gpu/eager_schedule.py``, the replay of an eager engine's kernel calls that the GPU
tests run at 128k tokens, small on the CPU's reference ops: its argument checks and its own
bookkeeping of steps and lengths."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCHEDULE = ROOT / "tests" / "gpu" / "eager_schedule.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCHEDULE), "--device", "cpu", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_the_schedule_runs_on_the_reference_ops():
    # The replay itself, small, on the CPU: the arguments it checks and its own bookkeeping.
    proc = _run("--batch", "3", "--heads", "2", "--context", "200", "--chunk", "64", "--width",
                "8", "--pages", "40", "--decode-steps", "4", "--layers", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Three requests of 200 tokens in chunks of 64: 4 prefill steps each.
    assert re.fullmatch(r"repetition 0: 12 prefill steps and 4 decode steps in [\d.]+ s\nok\n",
                        proc.stdout), proc.stdout
    # Request 0 decodes while the two others prefill (2 x 4 steps), then 4 steps: 212 tokens.
    proc = _run("--batch", "3", "--context", "200", "--chunk", "64",
                "--width", "3", "--pages", "40", "--decode-steps", "4")
    assert proc.returncode == 2 and "longest request's 212 tokens" in proc.stderr, proc.stderr
