"""The contributor tools that time the Hopper kernels run on the GPU and write what they
promise (their timings themselves are not checked)."""

from __future__ import annotations

import csv

import pytest
import torch

from vllm_snapmla.kernels import sm90

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.hopper,
    pytest.mark.skipif(not sm90.available(), reason="needs an sm_90 GPU and the decode_sm90 op"),
]


def test_plan_sweep_times_every_run_length_the_grid_allows(tmp_path, monkeypatch):
    pytest.importorskip("triton", reason="the sweep times with triton's do_bench")
    from tools import plan_sweep

    monkeypatch.delenv("SNAPMLA_DECODE_KERNEL", raising=False)
    shapes = [(2, 16, 512), (64, 128, 512)]
    out = tmp_path / "sweep.csv"
    plan_sweep.main(["--out", str(out), "--shapes", *(f"{B}x{H}x{N}" for B, H, N in shapes)])
    header, *lines = out.read_text().splitlines()
    assert header.startswith("# ") and "tools.plan_sweep" in header
    rows = list(csv.DictReader(lines))
    assert [(int(r["B"]), int(r["H"]), int(r["N"])) for r in rows] == shapes
    slots = torch.cuda.get_device_properties(0).multi_processor_count
    for row, (B, H, N) in zip(rows, shapes):
        pages = N // 64
        expected = plan_sweep.run_lengths(pages, sm90.launch_max_splits(B, H, 2560, slots))
        timed = [int(k.split("_")[1]) for k, v in row.items() if k.startswith("run_") and v]
        assert timed == expected
        assert 1 <= int(row["step_pages_per_split"]) <= pages
        assert all(float(row[k]) > 0 for k in ("step_us", "no_split_us"))
