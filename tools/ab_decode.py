"""Is a decode change faster?  bench_decode on several source trees in turn, and the report.

    python -m tools.ab_decode --tree main=../main --tree change=. --rounds 2 --out out/ab \\
        -- --backends snapmla --shapes 1x16x512 1x128x2048 --table-width 2560
    python -m tools.ab_decode --summarize out/ab      # the report of the runs there, no GPU

Each round runs ``python -m benchmarks.bench_decode`` (the arguments after ``--``) once per
tree, the trees in the order given, in a process of its own with the tree first on
``PYTHONPATH``: its package, its built extension (build each tree first) and its benchmark,
into ``--out/<tree>/round<k>``.  The trees alternate so that whatever drifts between runs (the
GPU's clocks, the machine's other load) falls on every tree alike; ratios between runs move by
a few percent, so one run per tree cannot settle a change of that size.

The report, ``ab.md`` and ``ab.csv`` in ``--out``: per backend every tree measured and per
shape, each tree's median over its rounds of ``us`` (CUDA-graph replay, L2 flushed),
``eager_us`` and ``host_us`` (bench_decode's docstring says how each is timed), its ratio to the
first tree's, and a verdict: *faster* where all its rounds lie below all of the first tree's,
*slower* where all lie above, else *within the spread*; with fewer than two rounds on either
side, no verdict.  Two rounds a tree are a weak test: where two trees do not differ, all of one
tree's two rounds lie below or above the other's one time in three.  Per tree and time, the
geometric mean of the ratios over the shapes.  ``--out`` must be a new (or empty) folder, so
that no earlier run's rounds mix in.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.provenance import described
from benchmarks.vllm_engine import read_csv

# The times compared, as bench_decode's decode.csv names them, and what the report calls them.
TIMES = {"us": "graph replay", "eager_us": "eager calls", "host_us": "host time of a call"}
# What one measurement is of (bench_decode's key, less the backend).
SHAPE_COLUMNS = ("B", "H", "N", "s_q", "table_width", "ragged", "timing")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def parse_tree(text: str) -> tuple[str, Path]:
    """``NAME=PATH``: a source tree (a checkout of this repository, its extension built)."""
    name, sep, path = text.partition("=")
    if not sep or not _NAME.fullmatch(name) or not path:
        raise argparse.ArgumentTypeError(f"a tree is NAME=PATH (NAME of letters, digits, '.', "
                                         f"'_', '-'), got {text!r}")
    root = Path(path).resolve()
    if not (root / "benchmarks" / "bench_decode.py").is_file() or \
            not (root / "vllm_snapmla").is_dir():
        raise argparse.ArgumentTypeError(f"{path} is not a checkout of vllm-snapmla (no "
                                         "benchmarks/bench_decode.py or vllm_snapmla/)")
    # Without its extension the tree's ops.decode runs the portable path and would be timed as
    # that tree's kernels.
    if not list((root / "vllm_snapmla").glob("_C*.so")):
        raise argparse.ArgumentTypeError(f"{path} has no built extension (vllm_snapmla/_C*.so): "
                                         "build it first (docs/development.md, \"Build\")")
    return name, root


def _commit(root: Path) -> str:
    """The tree's commit, '+' when it has uncommitted changes; '?' outside git."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + ("+" if dirty else "")


def bench_command(bench_args: list[str], out: Path) -> list[str]:
    return [sys.executable, "-m", "benchmarks.bench_decode", *bench_args, "--out", str(out)]


def run_rounds(trees: list[tuple[str, Path]], rounds: int, bench_args: list[str], out: Path,
               run=subprocess.run, say=print) -> None:
    """Every round, bench_decode once per tree in turn; stops at the first failed run."""
    total, done, start = rounds * len(trees), 0, time.monotonic()
    for k in range(1, rounds + 1):
        for name, root in trees:
            folder = out / name / f"round{k}"
            folder.mkdir(parents=True, exist_ok=True)
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(
                [str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
            with open(folder / "run.log", "w") as log:
                result = run(bench_command(bench_args, folder), cwd=root, env=env, stdout=log,
                             stderr=subprocess.STDOUT)
            done += 1
            say(f"[{done}/{total}] {name}, round {k}: "
                f"{'done' if result.returncode == 0 else 'FAILED'}, "
                f"{time.monotonic() - start:.0f} s in all")
            if result.returncode != 0:
                raise SystemExit(f"bench_decode failed for tree {name} in round {k}: see "
                                 f"{folder / 'run.log'}")


def _round_files(out: Path, tree: str, rounds: int) -> list[Path]:
    return [p for k in range(1, rounds + 1)
            if (p := out / tree / f"round{k}" / "decode.csv").is_file()]


def read_rounds(out: Path, tree: str,
                rounds: int) -> tuple[dict[tuple, dict[str, list[float]]], set[str]]:
    """(backend, shape...) -> time -> the tree's values, one per round that measured it; and
    the GPUs its runs' provenance lines name."""
    found: dict[tuple, dict[str, list[float]]] = {}
    gpus: set[str] = set()
    for path in _round_files(out, tree, rounds):
        runs, rows = read_csv(path)
        gpus |= {f["gpu"] for f in map(described, runs) if "gpu" in f}
        for row in rows:
            key = (row["backend"], *(row[c] for c in SHAPE_COLUMNS))
            for t in TIMES:
                if row.get(t):
                    found.setdefault(key, {}).setdefault(t, []).append(float(row[t]))
    return found, gpus


def verdict(base: list[float], other: list[float]) -> str:
    if len(base) < 2 or len(other) < 2:
        return "too few rounds"
    if max(other) < min(base):
        return "faster"
    if min(other) > max(base):
        return "slower"
    return "within the spread"


def compare(measured: dict[str, dict], trees: list[str]) -> list[dict]:
    """One row per (tree after the first, backend, shape, time) both trees measured, from each
    tree's ``read_rounds`` values."""
    base_name, rows = trees[0], []
    base = measured[base_name]
    for name in trees[1:]:
        other = measured[name]
        for key in sorted(set(base) & set(other), key=_sort_key):
            for t in TIMES:
                b, o = base[key].get(t), other[key].get(t)
                if not b or not o:
                    continue
                rows.append({"tree": name, "baseline": base_name, "backend": key[0],
                             **dict(zip(SHAPE_COLUMNS, key[1:])), "time": t,
                             "baseline_median": statistics.median(b),
                             "median": statistics.median(o),
                             "ratio": statistics.median(o) / statistics.median(b),
                             "baseline_rounds": b, "rounds": o, "verdict": verdict(b, o)})
    return rows


def _sort_key(key: tuple) -> tuple:
    backend, B, H, N, s_q, *rest = key
    return (backend, int(H), int(N), int(B), int(s_q), *rest)


def _shape(row: dict) -> str:
    text = f"{row['B']} x {row['H']} x {row['N']}"
    text += f", s_q {row['s_q']}" if row["s_q"] != "1" else ""
    return text + (", ragged" if row["ragged"] not in ("0", "", "False") else "")


def _span(values: list[float], rounds: int) -> str:
    text = f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"
    return text if len(values) == rounds else f"{text}, {len(values)} of {rounds} rounds"


def format_report(rows: list[dict], meta: dict) -> str:
    trees, rounds = meta["trees"], meta["rounds"]
    times = dict(TIMES)
    if "--eager" in meta["bench_args"]:
        times["us"] = "eager calls, Python timed (--eager)"   # bench_decode's us under --eager
    lines = [f"# Decode A/B: {', '.join(t['name'] for t in trees[1:])} against "
             f"{trees[0]['name']}", "",
             f"{meta['date']} | {meta['rounds']} round(s), the trees in turn | "
             f"bench_decode {' '.join(meta['bench_args'])}", ""]
    lines += [f"- {t['name']}: commit {t['commit']}, {t['path']}" for t in trees]
    gpus = sorted(set().union(*(meta.get("gpus", {}).get(t["name"], []) for t in trees)))
    if len(gpus) > 1:
        lines += ["", f"**The runs were on different GPUs ({', '.join(gpus)}): the ratios "
                  "compare machines, not trees.**"]
    elif gpus:
        lines += [f"- GPU: {gpus[0]}"]
    lines += ["", "µs: the median over the rounds (lowest-highest round); ratio: the tree's "
              "median over the first tree's (under 1: faster). faster / slower: every round "
              "of the tree below / above every round of the first tree (with two rounds a tree, "
              "one time in three where the trees do not differ).", ""]
    for name in [t["name"] for t in trees[1:]]:
        for backend in sorted({r["backend"] for r in rows if r["tree"] == name}):
            for t, what in times.items():
                part = [r for r in rows if r["tree"] == name and r["backend"] == backend
                        and r["time"] == t]
                if not part:
                    continue
                geo = math.exp(sum(math.log(r["ratio"]) for r in part) / len(part))
                counts = {v: sum(r["verdict"] == v for r in part)
                          for v in ("faster", "slower", "within the spread")}
                lines += [f"## {backend}, {what} (`{t}`): {name} against {part[0]['baseline']}",
                          "", f"Geometric mean of the ratios {geo:.3f} over {len(part)} shapes; "
                          f"faster at {counts['faster']}, slower at {counts['slower']}, within "
                          f"the spread at {counts['within the spread']}.", "",
                          f"| B x H x N | {part[0]['baseline']} µs | {name} µs | ratio | |",
                          "|---|---|---|---|---|"]
                lines += [f"| {_shape(r)} | {_span(r['baseline_rounds'], rounds)} | "
                          f"{_span(r['rounds'], rounds)} | {r['ratio']:.3f} | {r['verdict']} |"
                          for r in part]
                lines.append("")
    return "\n".join(lines)


def write_report(out: Path) -> str:
    meta = json.loads((out / "ab.json").read_text())
    trees = [t["name"] for t in meta["trees"]]
    read = {name: read_rounds(out, name, meta["rounds"]) for name in trees}
    meta["gpus"] = {name: sorted(read[name][1]) for name in trees}
    rows = compare({name: read[name][0] for name in trees}, trees)
    if not rows:
        raise SystemExit(f"{out}: no shape that the first tree and another both measured")
    report = format_report(rows, meta)
    (out / "ab.md").write_text(report)
    with open(out / "ab.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for r in rows:
            writer.writerow({**r, "baseline_rounds": " ".join(f"{v:.2f}" for v in
                                                              r["baseline_rounds"]),
                             "rounds": " ".join(f"{v:.2f}" for v in r["rounds"])})
    return report


def main(argv: list[str] | None = None, run=subprocess.run) -> None:
    argv = sys.argv[1:] if argv is None else argv
    own, bench_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=parse_tree, action="append", default=[],
                        metavar="NAME=PATH", help="a source tree, its extension built; the "
                        "first is the baseline (at least two)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per tree (default 2)")
    parser.add_argument("--out", type=Path, help="folder for the runs and the report")
    parser.add_argument("--summarize", type=Path, metavar="FOLDER",
                        help="no runs: write the report of the runs in FOLDER")
    args = parser.parse_args(own)
    if args.summarize:
        if args.tree or bench_args:
            parser.error("--summarize takes no --tree and no bench_decode arguments")
        print(write_report(args.summarize))
        return
    names = [name for name, _ in args.tree]
    if len(names) < 2 or len(set(names)) != len(names):
        parser.error(f"give at least two --tree NAME=PATH with distinct names, got {names}")
    if args.out is None or args.rounds < 1:
        parser.error("--out is required and --rounds must be at least 1")
    if {"--out", "--replot"} & set(bench_args):
        parser.error("the bench_decode arguments may not contain --out or --replot: "
                     "ab_decode gives each run its folder")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} is not empty: give a new folder, so that no earlier "
                     "run's rounds mix into the report")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "rounds": args.rounds, "bench_args": bench_args,
            "trees": [{"name": name, "path": str(root), "commit": _commit(root)}
                      for name, root in args.tree]}
    (args.out / "ab.json").write_text(json.dumps(meta, indent=1))
    run_rounds(args.tree, args.rounds, bench_args, args.out, run=run)
    print(write_report(args.out))


if __name__ == "__main__":
    main()
