"""benchmarks.provenance: the commit a result names says when the code differed from it."""

import os
import shutil
import subprocess

import pytest

from benchmarks import provenance


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_commit_is_flagged_when_tracked_files_changed(tmp_path, monkeypatch):
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                       check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "kernel.py").write_text("a = 1\n")
    git("add", "kernel.py")
    git("commit", "-qm", "first")
    monkeypatch.setattr(provenance, "REPO_ROOT", tmp_path)
    clean = provenance._git_commit()
    assert clean != "unknown" and not clean.endswith("+changes")
    (tmp_path / "untracked.txt").write_text("results\n")   # untracked output: still clean
    assert provenance._git_commit() == clean
    (tmp_path / "RESULTS.md").write_text("old\n")
    git("add", "RESULTS.md")
    git("commit", "-qm", "results")
    clean = provenance._git_commit()
    (tmp_path / "RESULTS.md").write_text("new results of a split sweep\n")
    assert provenance._git_commit() == clean                # results are not code
    (tmp_path / "kernel.py").write_text("a = 2\n")
    assert provenance._git_commit() == clean + "+changes"


def test_commit_outside_a_repository_is_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "REPO_ROOT", tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert provenance._git_commit() == "unknown"


def test_commands_name_no_folders_outside_the_repository():
    root = provenance.REPO_ROOT
    info = provenance.run_info("benchmarks.bench_x", [
        "--out", "/root/res/deployment", f"--model={root / 'eval' / 'results'}", "--heads", "16",
        "relative/out", "--data=/srv/data.txt"])
    assert info["command"] == ("python -m benchmarks.bench_x --out .../res/deployment "
                               "--model=eval/results --heads 16 relative/out "
                               "--data=.../data.txt")
    assert provenance.display_path("/tiny-mla") == ".../tiny-mla"
    assert provenance.display_path("/root/tiny-mla") == ".../tiny-mla"
    assert provenance.display_path("/root/sweep/rope1000/model") == ".../rope1000/model"
    assert provenance.display_path(root) == "."
    assert provenance._display_arg("KEY=/root/a/b") == "KEY=.../a/b"


def test_gpu_query_asks_for_the_visible_gpu(tmp_path, monkeypatch):
    """The GPU the benchmark runs on (first of CUDA_VISIBLE_DEVICES), not always GPU 0."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert provenance.gpu_query("name").endswith("--format=csv,noheader,nounits -i 3")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert provenance.gpu_query("name").endswith("--format=csv,noheader,nounits")


def test_code_version_tells_uncommitted_changes_apart(tmp_path, monkeypatch):
    """Eval reuse keys on it: two different uncommitted edits of one commit must differ."""
    import subprocess

    repo = tmp_path / "repo"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", *a], cwd=repo, check=True,  # noqa: E731
                                    capture_output=True)
    git("init", "-q")
    (repo / "k.py").write_text("x = 1\n")
    git("add", "k.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setattr(provenance, "REPO_ROOT", repo)
    clean = provenance.code_version()
    assert clean.startswith("commit ") and "+changes" not in clean and ", vLLM " in clean
    (repo / "k.py").write_text("x = 2\n")
    first = provenance.code_version()
    (repo / "k.py").write_text("x = 3\n")
    second = provenance.code_version()
    assert "+changes" in first and first != second
    (repo / "notes.md").write_text("results\n")      # not code: no effect
    assert provenance.code_version() == second


def test_described_reads_describes_line_back():
    info = {"date": "2026-12-07 21:31 UTC", "commit": "606f8e7", "gpu": "NVIDIA H100 80GB HBM3",
            "vllm": "0.26.0", "command": "python -m benchmarks.bench_decode --shapes 1x16x512"}
    assert provenance.described(provenance.describe(info)) == info
    assert provenance.described("2026-12-07 21:31 UTC | commit 606f8e7") == {
        "date": "2026-12-07 21:31 UTC", "commit": "606f8e7"}
