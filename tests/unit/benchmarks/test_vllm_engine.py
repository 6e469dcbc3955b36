"""vllm_engine's stall watchdog, in real processes: an engine child whose measurement stalls
must leave its stacks and its engine core's, report the cell as failed and end."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks.vllm_engine import RESULT_TAG, STALL_EXIT

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the watchdog finds its process group in /proc")


def _python(code: str, new_session: bool = True, timeout: float = 60):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONFAULTHANDLER", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout,
                          start_new_session=new_session)


def _results(stdout: str) -> list[dict]:
    return [json.loads(line[len(RESULT_TAG):]) for line in stdout.splitlines()
            if line.startswith(RESULT_TAG)]


def _gone(pid: int, wait_s: float = 5.0) -> bool:
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_a_stalled_measurement_reports_stacks_and_ends_the_engine():
    # The helper stands for vLLM's engine core: a Python process of the child's group.
    proc = _python("""
        import subprocess, sys, time
        from benchmarks.vllm_engine import enable_stall_dumps, stall_watchdog
        enable_stall_dumps()
        core = subprocess.Popen([sys.executable, "-c",
                                 "import time\\ndef engine_core_step():\\n    time.sleep(60)\\n"
                                 "engine_core_step()"])
        print("core", core.pid, flush=True)
        def measure_cell():
            with stall_watchdog(2.0, {"kind": "cell", "context": 512, "batch": "1"},
                                "cell ctx 512 x 1", settle_s=2.0):
                time.sleep(60)
        measure_cell()
        print("not reached", flush=True)
    """)
    assert proc.returncode == STALL_EXIT, (proc.returncode, proc.stderr[-2000:])
    assert "not reached" not in proc.stdout
    (result,) = _results(proc.stdout)
    assert result["status"] == "failed" and result["context"] == 512, result
    assert result["reason"].startswith("stalled: no result 2 s after it began"), result
    # This process's stack, then the helper's (SIGABRT through PYTHONFAULTHANDLER).
    assert "in measure_cell" in proc.stderr, proc.stderr[-2000:]
    assert "in engine_core_step" in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.rstrip().endswith(
        "engine stopped: cell ctx 512 x 1 " + result["reason"]), proc.stderr[-500:]
    core = int(next(line.split()[1] for line in proc.stdout.splitlines()
                    if line.startswith("core ")))
    assert _gone(core)


def test_a_measurement_that_ends_in_time_cancels_the_watchdog():
    proc = _python("""
        import time
        from benchmarks.vllm_engine import stall_watchdog
        with stall_watchdog(0.5, {"kind": "cell"}, "cell"):
            time.sleep(0.1)
        time.sleep(1.5)
        print("measured", flush=True)
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "measured", proc
    assert _results(proc.stdout) == [] and "stalled" not in proc.stderr


def test_the_watchdog_signals_no_group_it_does_not_lead():
    # The stalled process is not its group's leader (not started by run_child): the other
    # process of the group (here: the outer one's sleeper) must live on.
    inner = textwrap.dedent("""
        import time
        from benchmarks.vllm_engine import stall_watchdog
        with stall_watchdog(1.0, {"kind": "cell"}, "cell", settle_s=0.5):
            time.sleep(30)
    """)
    proc = _python(f"""
        import subprocess, sys
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        inner = subprocess.run([sys.executable, "-c", {inner!r}], capture_output=True,
                               text=True)
        print(inner.returncode, sleeper.poll(), flush=True)
        sleeper.kill()
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(STALL_EXIT), "None"], proc.stdout
