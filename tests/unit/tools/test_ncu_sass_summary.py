"""tools/ncu_sass_summary.py on a synthetic Nsight Compute SASS page (two kernels)."""
import csv
import random

import pytest

from tools import ncu_sass_summary as tool

HEADER = ["Address", "Source", tool.SAMPLES, tool.EXECUTED, "stall_wait", "stall_barrier",
          "stall_wait (Not Issued)"]


def _write(path, kernels):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for name, rows in kernels.items():
            writer.writerow(["Kernel Name", name])
            writer.writerow(HEADER)
            writer.writerows(rows)


def _rows(rng, n, hot):
    """n instructions; those in `hot` carry all barrier samples, the rest a few wait samples."""
    rows = []
    for i in range(n):
        source = rng.choice(["FADD R1, R2, R3", "QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR4]",
                             "@!P0 BAR.SYNC.DEFER_BLOCKING 0x4, 0x100", "LDS R5, [R6]"])
        wait, barrier = (0, 50) if i in hot else (rng.randint(0, 3), 0)
        rows.append([hex(0x1000 + 16 * i), "      " + source, wait + barrier, "1,024",
                     wait, barrier, wait])
    return rows


def test_blocks_carry_their_share_of_the_samples_and_their_landmarks(tmp_path, capsys):
    rng = random.Random(0)
    a, b = _rows(rng, 100, hot=set(range(10, 20))), _rows(rng, 30, hot=set())
    _write(tmp_path / "sass.csv", {"kernel_a": a, "kernel_b": b})
    kernels = tool.read_kernels(tmp_path / "sass.csv")
    assert list(kernels) == ["kernel_a", "kernel_b"] and len(kernels["kernel_a"]) == 100
    text = tool.summarize(kernels["kernel_a"], block=10, min_share=0.0)
    lines = text.splitlines()
    total = sum(r[2] for r in a)
    # One line per block of 10, shares from the samples; block 10-19 holds all barrier samples.
    assert len(lines) == 1 + 10
    shares = [float(line.split("%")[0].split()[-1]) for line in lines[1:]]
    assert sum(shares) == pytest.approx(100, abs=0.2)
    assert shares[1] == pytest.approx(100 * 500 / total, abs=0.05)
    assert "barrier 100%" in lines[2]
    assert "ran     1024" in lines[2]
    landmarks = sum(1 for r in a[10:20] if "QGMMA" in r[1])
    if landmarks:
        assert f"QGMMA.64x64x32.F32.E4M3.E4M3:{landmarks}" in lines[2]
    # "(Not Issued)" columns are not counted twice.
    assert f"barrier {100 * 500 / total:.1f}%" in lines[0]
    # Blocks below --min-share are hidden.
    assert len(tool.summarize(kernels["kernel_a"], 10, 50.0).splitlines()) == 1 + 1
    tool.main([str(tmp_path / "sass.csv"), "--block", "10"])
    out = capsys.readouterr().out
    assert "== kernel_a" in out and "== kernel_b" in out


def test_refuses_a_file_without_kernel_sections(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit, match="no 'Kernel Name' section"):
        tool.main([str(tmp_path / "x.csv")])
