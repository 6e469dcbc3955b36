"""The Python and C++/CUDA sources stay at most 100 columns wide, so that they read in a
side-by-side diff: a longer line fails here with its place."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WIDTH = 100


def _tracked(*patterns: str) -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs a git checkout")
    return [ROOT / name for name in out.split()]


def test_no_line_is_wider_than_100_columns():
    files = _tracked("*.py", "*.h", "*.cuh", "*.cu", "*.cpp")
    assert len(files) > 50   # the listing found the source
    assert any(path.suffix == ".cuh" for path in files), files
    wide = [f"{path.relative_to(ROOT)}:{number}: {len(line)} columns"
            for path in files
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if len(line) > WIDTH]
    assert not wide, "\n".join(wide)
