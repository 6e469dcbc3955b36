"""Compiling a small C++ program against csrc/ headers for the host, for the unit tests that run
host-callable kernel code (the V^T map, the split planner) on the CPU."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[3] / "csrc"


def nvcc() -> str | None:
    """The CUDA compiler: on the PATH, or under CUDA_HOME (default /usr/local/cuda)."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidate = os.path.join(home, "bin", "nvcc")
    return candidate if os.access(candidate, os.X_OK) else None


def build_probe(tmp_path_factory, name: str, source: str, header: str) -> Path:
    """``source`` compiled with nvcc (host code, csrc/ on the include path) into an executable;
    skips the test where there is no nvcc to compile ``header`` with."""
    compiler = nvcc()
    if compiler is None:
        pytest.skip(f"no nvcc to compile {header} with")
    tmp = tmp_path_factory.mktemp(name)
    (tmp / "probe.cu").write_text(source)
    build = subprocess.run([compiler, "-std=c++17", f"-I{CSRC}", "-o", str(tmp / "probe"),
                            str(tmp / "probe.cu")], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    return tmp / "probe"
