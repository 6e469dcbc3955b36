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

COLUMNS = ["run", "backend", "B", "H", "N", "s_q", "us", "table_width", "ragged", "timing",
           "host_us", "eager_us"]
FAST, SLOW, TIE, HIGHER_TIE = (("snapmla", 1, 16, 512), ("snapmla", 8, 128, 2048),
                               ("snapmla", 1, 128, 512), ("snapmla", 64, 16, 4096))
FA3 = ("fa3-mla-bf16", 1, 16, 512)


def _checkout(root: Path, extension: bool = True) -> Path:
    """A tree as ab_decode accepts it: the benchmark, the package and its built extension."""
    (root / "benchmarks").mkdir(parents=True)
    (root / "benchmarks" / "bench_decode.py").write_text("")
    (root / "vllm_snapmla").mkdir()
    if extension:
        (root / "vllm_snapmla" / "_C.abi3.so").write_bytes(b"")
    return root


@pytest.fixture
def trees(tmp_path):
    return _checkout(tmp_path / "a"), _checkout(tmp_path / "b")


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
    """Three rounds: FAST below main in every round, SLOW above, TIE overlapping with a lower
    median, HIGHER_TIE overlapping with a higher median; medians differ from means."""
    main = {1: {FAST: (20.0, 30, 40), SLOW: (40.0, 50, 40), TIE: (21.0, 30, 40),
                HIGHER_TIE: (80.0, 90, 40), FA3: (16.0, 30, 40)},
            2: {FAST: (20.4, 30, 40), SLOW: (40.4, 50, 40), TIE: (21.4, 30, 40),
                HIGHER_TIE: (81.0, 90, 40), FA3: (16.0, 30, 40)},
            3: {FAST: (23.0, 30, 40), SLOW: (40.2, 50, 40), TIE: (21.2, 30, 40),
                HIGHER_TIE: (85.0, 90, 40), FA3: (16.0, 30, 40)}}
    change = {1: {FAST: (18.0, 28, 35), SLOW: (42.0, 50, 40), TIE: (21.2, 30, 40),
                  HIGHER_TIE: (80.5, 90, 40)},
              2: {FAST: (18.2, 28, 35), SLOW: (42.2, 50, 40), TIE: (20.8, 30, 40),
                  HIGHER_TIE: (84.0, 90, 40)},
              3: {FAST: (19.9, 28, 35), SLOW: (46.0, 50, 40), TIE: (21.0, 30, 40),
                  HIGHER_TIE: (82.0, 90, 40)}}
    return {"main": main, "change": change}


def _run(trees, out, rounds=3, extra=(), times=None, run=None):
    run = run or FakeRuns(times or _times())
    tool.main(["--tree", f"main={trees[0]}", "--tree", f"change={trees[1]}", "--rounds",
               str(rounds), "--out", str(out), *extra], run=run)
    return run


def test_tree_must_be_a_named_checkout_with_its_extension(tmp_path, trees):
    assert tool.parse_tree(f"main={trees[0]}") == ("main", trees[0])
    bare = _checkout(tmp_path / "bare", extension=False)
    for bad in (f"={trees[0]}", "main=", str(trees[0]), f"a b={trees[0]}", f"x={tmp_path}",
                f"x={bare}"):
        with pytest.raises(argparse.ArgumentTypeError):
            tool.parse_tree(bad)


def test_rounds_alternate_the_trees_each_first_on_its_pythonpath(tmp_path, trees, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    runs = _run(trees, tmp_path / "ab", extra=["--", "--backends", "snapmla"])
    assert [(c["tree"], c["round"]) for c in runs.calls] == [
        ("main", 1), ("change", 1), ("main", 2), ("change", 2), ("main", 3), ("change", 3)]
    for c in runs.calls:
        root = trees[0] if c["tree"] == "main" else trees[1]
        assert c["cwd"] == root and c["pythonpath"] == [str(root), "/elsewhere"]
        assert c["cmd"][:5] == [sys.executable, "-m", "benchmarks.bench_decode", "--backends",
                                "snapmla"]
    meta = json.loads((tmp_path / "ab" / "ab.json").read_text())
    assert [t["name"] for t in meta["trees"]] == ["main", "change"] and meta["rounds"] == 3


def test_report_medians_ratios_and_verdicts(tmp_path, trees):
    out = tmp_path / "ab"
    _run(trees, out)
    rows = list(csv.DictReader(open(out / "ab.csv")))
    assert {r["backend"] for r in rows} == {"snapmla"}   # only what both trees measured
    us = {(r["B"], r["H"], r["N"]): r for r in rows if r["time"] == "us"}
    verdicts = {k: us[k]["verdict"] for k in us}
    assert verdicts == {("1", "16", "512"): "faster", ("8", "128", "2048"): "slower",
                        ("1", "128", "512"): "within the spread",
                        ("64", "16", "4096"): "within the spread"}
    assert float(us["1", "16", "512"]["ratio"]) == pytest.approx(18.2 / 20.4)   # medians
    assert float(us["64", "16", "4096"]["ratio"]) == pytest.approx(82.0 / 81.0)
    host = {(r["B"], r["H"], r["N"]): r for r in rows if r["time"] == "host_us"}
    assert host["1", "16", "512"]["verdict"] == "faster"
    report = (out / "ab.md").read_text()
    ratios = [18.2 / 20.4, 42.2 / 40.2, 21.0 / 21.2, 82.0 / 81.0]
    geo = math.exp(sum(map(math.log, ratios)) / 4)
    assert f"Geometric mean of the ratios {geo:.3f} over 4 shapes; faster at 1, slower at 1, " \
        "within the spread at 2." in report
    assert "| 1 x 16 x 512 | 20.4 (20.0-23.0) | 18.2 (18.0-19.9) | 0.892 | faster |" in report
    assert "GPU: NVIDIA H100 80GB HBM3" in report and "different GPUs" not in report
    assert "graph replay (`us`)" in report
    # --summarize rewrites the same report from the folder alone
    (out / "ab.md").unlink()
    tool.main(["--summarize", str(out)])
    assert (out / "ab.md").read_text() == report


def test_a_shape_missing_from_a_round_is_shown_and_one_round_has_no_verdict(tmp_path, trees):
    times = _times()
    del times["change"][2][SLOW]
    out = tmp_path / "ab"
    _run(trees, out, times=times)
    report = (out / "ab.md").read_text()
    assert "| 8 x 128 x 2048 | 40.2 (40.0-40.4) | 44.0 (42.0-46.0), 2 of 3 rounds |" in report
    one = tmp_path / "one"
    _run(trees, one, rounds=1)
    assert {r["verdict"] for r in csv.DictReader(open(one / "ab.csv"))} == {"too few rounds"}


def test_eager_runs_are_labelled_as_such(tmp_path, trees):
    _run(trees, tmp_path / "ab", extra=["--", "--eager"])
    report = (tmp_path / "ab" / "ab.md").read_text()
    assert "eager calls, Python timed (--eager) (`us`)" in report
    assert "graph replay" not in report


def test_runs_on_different_gpus_are_flagged(tmp_path, trees):
    out = tmp_path / "ab"
    _run(trees, out, rounds=1)
    _write_decode_csv(out / "change" / "round1", _times()["change"][1], gpu="NVIDIA H200")
    assert "different GPUs (NVIDIA H100 80GB HBM3, NVIDIA H200)" in tool.write_report(out)


def test_a_failed_run_stops_and_names_its_log(tmp_path, trees):
    runs = FakeRuns(_times(), fail_at=("change", 1))
    with pytest.raises(SystemExit, match=r"tree change in round 1: see .*change/round1/run\.log"):
        _run(trees, tmp_path / "ab", run=runs)
    assert [(c["tree"], c["round"]) for c in runs.calls] == [("main", 1), ("change", 1)]
    assert not (tmp_path / "ab" / "ab.md").exists()


def test_refuses_an_out_folder_that_holds_runs(tmp_path, trees):
    out = tmp_path / "ab"
    _run(trees, out, rounds=1)
    runs = FakeRuns(_times())
    with pytest.raises(SystemExit) as exit_info:
        _run(trees, out, rounds=1, run=runs)
    assert exit_info.value.code == 2 and not runs.calls


@pytest.mark.parametrize("argv", [
    ["--tree", "main={a}", "--out", "x"],                             # one tree
    ["--tree", "a={a}", "--tree", "a={b}", "--out", "x"],             # same name twice
    ["--tree", "a={a}", "--tree", "b={b}"],                           # no --out
    ["--tree", "a={a}", "--tree", "b={b}", "--out", "x", "--rounds", "0"],
    ["--tree", "a={a}", "--tree", "b={b}", "--out", "x", "--", "--out", "y"],
    ["--summarize", "x", "--tree", "a={a}"],
])
def test_refuses_bad_arguments(argv, tmp_path, trees, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = FakeRuns(_times())
    with pytest.raises(SystemExit) as exit_info:
        tool.main([arg.format(a=trees[0], b=trees[1]) for arg in argv], run=runs)
    assert exit_info.value.code == 2 and not runs.calls


def test_summarize_refuses_a_folder_without_common_shapes(tmp_path, trees):
    out = tmp_path / "ab"
    _run(trees, out, rounds=1)
    (out / "change" / "round1" / "decode.csv").unlink()
    with pytest.raises(SystemExit, match="no shape that the first tree and another both"):
        tool.main(["--summarize", str(out)])
