"""What a benchmark output records about the run that produced it: date, git commit, GPU, vLLM
version and command line.  Everything here works without a GPU and without vLLM ("unknown")."""

from __future__ import annotations

import datetime
import hashlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None


# What "+changes" looks at: code and build files, not results or documents (a sweep split over
# several calls into a tracked results folder must not mark its own later calls).
CODE_PATHS = ("*.py", "*.cu", "*.cuh", "*.h", "*.cpp", "*.toml", "*.cfg", "*.txt")


def _git_commit() -> str:
    """The short commit, with ``+changes`` when tracked code differs from it (the numbers then
    come from code that commit does not hold)."""
    head = _git("rev-parse", "--short", "HEAD")
    if head is None or head.returncode != 0 or not head.stdout.strip():
        return "unknown"
    status = _git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS)
    changed = status is not None and status.returncode == 0 and status.stdout.strip()
    return head.stdout.strip() + ("+changes" if changed else "")


def code_version() -> str:
    """The code a result comes from, precisely enough to decide whether a saved result can
    stand for a new run: the commit, a hash of the uncommitted changes to tracked code (if any)
    and the vLLM version."""
    commit = _git_commit()
    if commit.endswith("+changes"):
        diff = _git("diff", "HEAD", "--", *CODE_PATHS)
        digest = (hashlib.sha256(diff.stdout.encode()).hexdigest()[:12]
                  if diff is not None and diff.returncode == 0 else "unknown")
        commit += f" {digest}"
    return f"commit {commit}, vLLM {_vllm_version()}"


def gpu_query(field: str) -> str | None:
    """``field`` of the GPU the benchmark runs on (the first of ``CUDA_VISIBLE_DEVICES``, else
    the first GPU) as nvidia-smi reports it (numbers without units), or None.  nvidia-smi
    rather than torch: the parent process of an engine benchmark must not create a CUDA context
    of its own on the GPU its children measure."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    try:
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={field}",
                               "--format=csv,noheader,nounits",
                               *(["-i", visible] if visible else [])],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    values = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    return values[0] if proc.returncode == 0 and values else None


def _gpu_name() -> str:
    return gpu_query("name") or "unknown"


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("vllm")
    except PackageNotFoundError:
        return "unknown"


def display_path(path) -> str:
    """An absolute ``path`` as a record shows it: relative to the repository when inside it
    (also through a symlink), else its last folder and name (``.../<parent>/<name>``; just
    ``.../<name>`` right under the root), so that results name no machine's folders."""
    absolute = Path(os.path.abspath(path))
    for candidate in (absolute, absolute.resolve()):
        try:
            return str(candidate.relative_to(REPO_ROOT))
        except ValueError:
            pass
    tail = absolute.parts[-2:] if len(absolute.parts) > 3 else absolute.parts[-1:]
    return ".../" + "/".join(tail)


def _display_arg(arg: str) -> str:
    """A command-line argument with an absolute path as its value (``/x/y``, ``--opt=/x/y``,
    ``KEY=/x/y``) shown by ``display_path``."""
    key, eq, value = arg.partition("=") if "=" in arg else ("", "", arg)
    if not value.startswith("/"):
        return arg
    return f"{key}{eq}{display_path(value)}"


def run_info(module: str, argv: list[str] | None = None) -> dict:
    """date (UTC), commit, gpu, vllm and command of this run of ``python -m <module> argv``
    (absolute paths in it shown by ``display_path``)."""
    argv = sys.argv[1:] if argv is None else argv
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": _git_commit(), "gpu": _gpu_name(), "vllm": _vllm_version(),
            "command": shlex.join(["python", "-m", module, *map(_display_arg, argv)])}


def describe(info: dict) -> str:
    """One line: ``date | commit | GPU | vLLM | command``."""
    return (f"{info['date']} | commit {info['commit']} | {info['gpu']} | vLLM {info['vllm']} | "
            f"{info['command']}")


def described(line: str) -> dict:
    """``describe``'s line back into ``run_info``'s fields; a field a shorter line lacks is
    absent."""
    fields = dict(zip(("date", "commit", "gpu", "vllm", "command"), line.split(" | ", 4)))
    for key, prefix in (("commit", "commit "), ("vllm", "vLLM ")):
        if key in fields:
            fields[key] = fields[key].removeprefix(prefix)
    return fields
