"""Where a kernel's stall samples fall, from Nsight Compute's SASS source page.

    ncu -i report.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 -m tools.ncu_sass_summary sass.csv [--block 48] [--min-share 0.4]

For each profiled kernel in the CSV, prints the stall reasons of the whole kernel, then the SASS
in blocks of --block instructions: each block's share of the kernel's samples, how often its
instructions ran (the most of any of them), its three main stall reasons, and its landmark
instructions (WGMMAs, barriers, TMA and mbarrier waits, MUFU, shared-memory and local-memory
accesses).  In a warp-specialized kernel the execution counts and landmarks tell the
warpgroups' phases apart (run it on the source page that
`ncu --page source --csv --print-source sass` writes).
"""
from __future__ import annotations

import argparse
import collections
import csv
import re
import sys
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
LANDMARKS = re.compile(r"^(?:@!?U?P\w+\s+)?((?:[QH]GMMA|WARPGROUP\.(?:ARRIVE|DEPBAR)|BAR\.\w+|"
                       r"SYNCS\.\w+|UTMALDG|MUFU\.EX2|LDSM|STSM|LDS|STS|LDL|STL|SHFL)\S*)")


def _int(text: str) -> int:
    text = (text or "0").replace(",", "").strip()
    return int(float(text)) if text and text != "-" else 0


def read_kernels(path: Path) -> dict[str, list[dict]]:
    """{kernel name: [instruction rows]} from a `--page source --csv --print-source sass` dump."""
    kernels: dict[str, list[dict]] = {}
    name, header = None, None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                name, header = row[1], None
                kernels[name] = []
            elif name is not None and header is None:
                header = row
            elif name is not None:
                rec = dict(zip(header, row))
                if "Source" in rec:
                    kernels[name].append(rec)
    return kernels


def summarize(rows: list[dict], block: int, min_share: float) -> str:
    stalls = [k for k in (rows[0] if rows else {})
              if k.startswith("stall_") and "Not Issued" not in k]
    total = sum(_int(r.get(SAMPLES)) for r in rows) or 1
    by_reason = collections.Counter()
    for r in rows:
        for k in stalls:
            by_reason[k[6:]] += _int(r.get(k))
    lines = [f"{len(rows)} instructions, {total} samples; stall reasons: " +
             ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_reason.most_common(8))]
    for start in range(0, len(rows), block):
        part = rows[start:start + block]
        samples = sum(_int(r.get(SAMPLES)) for r in part)
        if 100 * samples / total < min_share:
            continue
        reasons = collections.Counter()
        for r in part:
            for k in stalls:
                reasons[k[6:]] += _int(r.get(k))
        marks = collections.Counter()
        for r in part:
            match = LANDMARKS.match(r["Source"].strip())
            if match:
                marks[match.group(1)] += 1
        lines.append(
            f"{start:6d} {part[0].get('Address', ''):>14s} {100 * samples / total:5.1f}% "
            f"ran {max(_int(r.get(EXECUTED)) for r in part):>8d} | " +
            " ".join(f"{k} {100 * v // max(samples, 1)}%" for k, v in reasons.most_common(3)) +
            " | " + " ".join(f"{k}:{v}" for k, v in marks.most_common(5)))
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--block", type=int, default=48, help="instructions per block")
    parser.add_argument("--min-share", type=float, default=0.4,
                        help="hide blocks with less than this %% of the kernel's samples")
    args = parser.parse_args(argv)
    if args.block < 1:
        parser.error("--block must be at least 1")
    kernels = read_kernels(args.csv)
    if not kernels:
        sys.exit(f"{args.csv}: no 'Kernel Name' section (expected ncu --page source --csv)")
    for name, rows in kernels.items():
        print(f"== {name}\n{summarize(rows, args.block, args.min_share)}\n")


if __name__ == "__main__":
    main()
