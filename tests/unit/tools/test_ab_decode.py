"""tools/ab_decode.py: the order of the runs, their environment, and the report (the runs are
faked: bench_decode needs a GPU)."""
import argparse
import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import ab_decode as tool

REPO = Path(__file__).resolve().parents[3]
COLUMNS = ["run", "backend", "B", "H", "N", "s_q", "us", "table_width", "ragged", "timing",
           "host_us", "eager_us"]


def _write_decode_csv(folder: Path, times: dict, gpu: str = "NVIDIA H100 80GB HBM3"):
    """A decode.csv as bench_decode writes it: times[(backend, B, H, N)] = (us, eager, host)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "decode.csv", "w", newline="") as f:
        f.write(f"# 2026-12-07 10:00 UTC | commit abc1234 | {gpu} | vLLM 0.26.0 | python -m "
                "benchmarks.bench_decode\n")
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for (backend, B, H, N), (us, eager, host) in times.items():
            writer.writerow({"run": 1, "backend": backend, "B": B, "H": H, "N": N, "s_q": 1,
                             "us": us, "table_width": 2560, "ragged": 0, "timing": "graph",
                             "host_us": host, "eager_us": eager})


class FakeRuns:
    """Stands in for subprocess.run: records each run and writes its decode.csv from
    ``times[tree][round]``."""

    def __init__(self, times, fail_at=None):
        self.times, self.fail_at, self.calls = times, fail_at, []

    def __call__(self, cmd, cwd, env, stdout, stderr):
        folder = Path(cmd[cmd.index("--out") + 1])
        tree, k = folder.parent.name, int(folder.name.removeprefix("round"))
        self.calls.append({"tree": tree, "round": k, "cmd": cmd, "cwd": cwd,
                           "pythonpath": env["PYTHONPATH"].split(os.pathsep)})
        if (tree, k) == self.fail_at:
            return subprocess.CompletedProcess(cmd, 1)
        _write_decode_csv(folder, self.times[tree][k])
        return subprocess.CompletedProcess(cmd, 0)


def _times():
    # shape 1: change faster in every round; shape 2: slower in every round; shape 3: overlaps
    s1, s2, s3 = ("snapmla", 1, 16, 512), ("snapmla", 8, 128, 2048), ("snapmla", 1, 128, 512)
    fa3 = ("fa3-mla-bf16", 1, 16, 512)
    return {"main": {1: {s1: (20.0, 30, 40), s2: (40.0, 50, 40), s3: (21.0, 30, 40),
                         fa3: (16.0, 30, 40)},
                     2: {s1: (20.4, 30, 40), s2: (40.4, 50, 40), s3: (21.4, 30, 40),
                         fa3: (16.0, 30, 40)}},
            "change": {1: {s1: (18.0, 28, 35), s2: (42.0, 50, 40), s3: (21.2, 30, 40)},
                       2: {s1: (18.2, 28, 35), s2: (42.2, 50, 40), s3: (20.8, 30, 40)}}}


def test_tree_must_be_a_named_checkout(tmp_path):
    assert tool.parse_tree(f"main={REPO}") == ("main", REPO)
    for bad in (f"={REPO}", "main=", str(REPO), f"a b={REPO}", f"x={tmp_path}"):
        with pytest.raises(argparse.ArgumentTypeError):
            tool.parse_tree(bad)


def test_rounds_alternate_the_trees_each_first_on_its_pythonpath(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    runs = FakeRuns(_times())
    tool.main(["--tree", f"main={REPO}", "--tree", f"change={REPO}", "--rounds", "2",
               "--out", str(tmp_path), "--", "--backends", "snapmla", "--table-width", "2560"],
              run=runs)
    assert [(c["tree"], c["round"]) for c in runs.calls] == [
        ("main", 1), ("change", 1), ("main", 2), ("change", 2)]
    for c in runs.calls:
        assert c["cwd"] == REPO and c["pythonpath"] == [str(REPO), "/elsewhere"]
        assert c["cmd"][:3] == [sys.executable, "-m", "benchmarks.bench_decode"]
        assert c["cmd"][3:6] == ["--backends", "snapmla", "--table-width"]
    meta = json.loads((tmp_path / "ab.json").read_text())
    assert [t["name"] for t in meta["trees"]] == ["main", "change"] and meta["rounds"] == 2


def test_report_medians_ratios_and_verdicts(tmp_path):
    tool.main(["--tree", f"main={REPO}", "--tree", f"change={REPO}", "--out", str(tmp_path)],
              run=FakeRuns(_times()))
    rows = {(r["B"], r["H"], r["N"], r["time"]): r
            for r in csv.DictReader(open(tmp_path / "ab.csv"))}
    # only the backend both trees measured
    assert {r["backend"] for r in csv.DictReader(open(tmp_path / "ab.csv"))} == {"snapmla"}
    fast, slow, tie = rows["1", "16", "512", "us"], rows["8", "128", "2048", "us"], \
        rows["1", "128", "512", "us"]
    assert fast["verdict"] == "faster" and slow["verdict"] == "slower"
    assert tie["verdict"] == "within the spread"
    assert float(fast["ratio"]) == pytest.approx(18.1 / 20.2)
    assert float(slow["ratio"]) == pytest.approx(42.1 / 40.2)
    assert rows["1", "16", "512", "host_us"]["verdict"] == "faster"
    report = (tmp_path / "ab.md").read_text()
    geo = math.exp((math.log(18.1 / 20.2) + math.log(42.1 / 40.2) + math.log(21.0 / 21.2)) / 3)
    assert f"Geometric mean of the ratios {geo:.3f} over 3 shapes; faster at 1, slower at 1, " \
        "within the spread at 1." in report
    assert "| 1 x 16 x 512 | 20.2 (20.0-20.4) | 18.1 (18.0-18.2) | 0.896 | faster |" in report
    assert "GPU: NVIDIA H100 80GB HBM3" in report and "different GPUs" not in report
    # --summarize rewrites the same report from the folder alone
    (tmp_path / "ab.md").unlink()
    tool.main(["--summarize", str(tmp_path)])
    assert (tmp_path / "ab.md").read_text() == report


def test_runs_on_different_gpus_are_flagged(tmp_path):
    tool.main(["--tree", f"main={REPO}", "--tree", f"change={REPO}", "--rounds", "1",
               "--out", str(tmp_path)], run=FakeRuns(_times()))
    _write_decode_csv(tmp_path / "change" / "round1", _times()["change"][1], gpu="NVIDIA H200")
    assert "different GPUs (NVIDIA H100 80GB HBM3, NVIDIA H200)" in tool.write_report(tmp_path)


def test_a_failed_run_stops_and_names_its_log(tmp_path):
    runs = FakeRuns(_times(), fail_at=("change", 1))
    with pytest.raises(SystemExit, match=r"tree change in round 1: see .*change/round1/run\.log"):
        tool.main(["--tree", f"main={REPO}", "--tree", f"change={REPO}", "--out",
                   str(tmp_path)], run=runs)
    assert [(c["tree"], c["round"]) for c in runs.calls] == [("main", 1), ("change", 1)]
    assert not (tmp_path / "ab.md").exists()


@pytest.mark.parametrize("argv", [
    ["--tree", f"main={REPO}", "--out", "x"],                               # one tree
    ["--tree", f"a={REPO}", "--tree", f"a={REPO}", "--out", "x"],           # same name twice
    ["--tree", f"a={REPO}", "--tree", f"b={REPO}"],                         # no --out
    ["--tree", f"a={REPO}", "--tree", f"b={REPO}", "--out", "x", "--rounds", "0"],
    ["--tree", f"a={REPO}", "--tree", f"b={REPO}", "--out", "x", "--", "--out", "y"],
    ["--summarize", "x", "--tree", f"a={REPO}"],
])
def test_refuses_bad_arguments(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = FakeRuns(_times())
    with pytest.raises(SystemExit) as exit_info:
        tool.main(argv, run=runs)
    assert exit_info.value.code == 2 and not runs.calls


def test_summarize_refuses_a_folder_without_common_shapes(tmp_path):
    tool.main(["--tree", f"main={REPO}", "--tree", f"change={REPO}", "--rounds", "1",
               "--out", str(tmp_path)], run=FakeRuns(_times()))
    (tmp_path / "change" / "round1" / "decode.csv").unlink()
    with pytest.raises(SystemExit, match="no shape that the first tree and another both"):
        tool.main(["--summarize", str(tmp_path)])
