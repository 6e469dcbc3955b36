import os

import pytest
import torch

from vllm_snapmla.testing import has_fp8_gpu


def _gpu_build_problem() -> str | None:
    """On a GPU machine, a build that would make the GPU tests skip instead of run: no native
    extension, or no sm_90a decode kernels on an sm_90 GPU (every Hopper test would skip and
    ``auto`` would test the Triton kernel only)."""
    from vllm_snapmla._native import missing_reason, native
    from vllm_snapmla.kernels import sm90

    if os.environ.get("SNAPMLA_TESTS_ALLOW_PARTIAL_BUILD") == "1":
        return None
    if native() is None:
        return missing_reason()
    if torch.cuda.get_device_capability() == (9, 0) and not sm90.available():
        return ("this sm_90 GPU has no sm_90a decode kernels in the extension (build with "
                "SNAPMLA_ARCHS containing 90a)")
    return None


def pytest_collection_modifyitems(config, items):
    if has_fp8_gpu():
        problem = _gpu_build_problem()
        if problem:
            raise pytest.UsageError(f"{problem}: the GPU tests would skip instead of running. "
                                    "Set SNAPMLA_TESTS_ALLOW_PARTIAL_BUILD=1 to run them anyway.")
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with FP8 support (sm_89+)")
    for item in items:
        if any(m in item.keywords for m in ("gpu", "hopper", "e2e")):
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """Under CI (``SNAPMLA_CI=1``, set by .ci/run) a skipped CPU test fails the run: every
    tests/unit test can run there, so a skip means a missing dependency or a broken build (an
    extension that does not load) that would otherwise pass unnoticed.  An expected failure
    (xfail, passing or not) fails it too: a CPU test states what holds."""
    if os.environ.get("SNAPMLA_CI") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    not_run = [(kind, report) for kind in ("skipped", "xfailed", "xpassed")
               for report in (reporter.stats.get(kind, []) if reporter else [])
               if report.nodeid.startswith("tests/unit")]
    if not_run:
        for kind, report in not_run:
            reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
            print(f"\n{kind.upper()} under CI: {report.nodeid}: {reason}")
        session.exitstatus = 1
