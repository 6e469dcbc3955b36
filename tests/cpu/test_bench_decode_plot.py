"""benchmarks/bench_decode.py's plot and --replot: the panels follow the shapes a run has."""

import csv
import importlib.util
import random
import subprocess
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_decode.py"
_spec = importlib.util.spec_from_file_location("bench_decode", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _rows(rng, shapes, with_flashmla):
    rows = []
    for B, H, N, s_q in shapes:
        base = rng.uniform(100, 700)
        for backend, factor in (("flashmla-bf16", 1.0), ("flashmla-fp8", 1.5),
                                ("snapmla-sm90", rng.uniform(1.0, 2.0))):
            if backend.startswith("flashmla") and not with_flashmla:
                continue
            us = base / factor
            rows.append(dict(backend=backend, B=B, H=H, N=N, s_q=s_q, us=us,
                             tflops=rng.uniform(100, 600), gbps=rng.uniform(1000, 4000),
                             relerr=rng.uniform(0, 0.04),
                             speedup_vs_bf16=base / us if with_flashmla else None,
                             speedup_vs_fp8=base / 1.5 / us if with_flashmla else None))
    return rows


def _png(path):
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_the_h128_sweep_only_the_shape_panel_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    rows = _rows(random.Random(1), [(32, 32, 16384, 1), (64, 16, 32768, 2)], True)
    panels = bench._plot(rows, tmp_path / "p.png")
    assert panels == ["speedup over BF16 FlashMLA"]
    assert _png(tmp_path / "p.png")


def test_with_the_h128_sweep_its_two_panels_come_first(tmp_path):
    pytest.importorskip("matplotlib")
    shapes = [(64, 128, n, 1) for n in (4096, 16384, 65536)] + [(32, 16, 65536, 1)]
    panels = bench._plot(_rows(random.Random(2), shapes, True), tmp_path / "p.png")
    assert len(panels) == 3 and panels[0].startswith("H=128") and panels[1].startswith("H=128")
    assert panels[2].startswith("other shapes")
    sweep_only = _rows(random.Random(3), shapes[:3], False)
    assert len(bench._plot(sweep_only, tmp_path / "q.png")) == 2


def test_replot_reads_back_the_csv_it_writes(tmp_path):
    pytest.importorskip("matplotlib")
    rows = _rows(random.Random(4), [(128, 16, 8192, 1), (128, 16, 8192, 2)], False)
    with open(tmp_path / "decode.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=bench.CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    back = bench._read_csv(tmp_path / "decode.csv")
    assert [r["backend"] for r in back] == [r["backend"] for r in rows]
    assert all(isinstance(r["H"], int) and r["speedup_vs_bf16"] is None for r in back)
    assert back[1]["us"] == pytest.approx(rows[1]["us"])
    out = tmp_path / "plot"
    subprocess.run([sys.executable, str(_PATH), "--replot", str(tmp_path / "decode.csv"),
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    assert _png(out / "decode.png")
