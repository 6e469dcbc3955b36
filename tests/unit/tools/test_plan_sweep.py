"""tools/plan_sweep.py: its shapes and run lengths (the timing itself needs an sm_90 GPU)."""
import argparse

import pytest
import torch

from tools import plan_sweep as tool
from vllm_snapmla.kernels import sm90, splits


@pytest.mark.parametrize("pages, max_splits, expected", [
    (1, 132, [1]), (8, 132, [1, 2, 4, 8]), (12, 33, [1, 2, 4, 8, 12]),
    (8, 5, [2, 4, 8]), (32, 5, [7, 8, 16, 32]), (8, 3, [3, 4, 8]), (8, 1, [8])])
def test_run_lengths_start_at_the_shortest_run_the_grid_allows(pages, max_splits, expected):
    assert tool.run_lengths(pages, max_splits) == expected


@pytest.mark.parametrize("pages, max_splits", [(8, 5), (32, 5), (128, 33), (8, 3), (64, 132)])
def test_each_forced_run_is_the_run_the_kernels_take(pages, max_splits):
    """split_range turns the forced plan into exactly that run length: no two columns of the
    CSV time the same launch."""
    for run in tool.run_lengths(pages, max_splits):
        _, first_run, _ = splits.split_range(pages * 64, 2560, run, max_splits, 0)
        assert first_run == run


def test_shape_parsing():
    assert tool.parse_shape("64x128x512") == (64, 128, 512)
    for bad in ("64x128", "64x128x512x2", "0x16x512", "8xax512"):
        with pytest.raises(argparse.ArgumentTypeError):
            tool.parse_shape(bad)


def test_default_shapes_fit_vllm_width_table():
    assert all(-(-N // 64) <= 2560 for _, _, N in tool.SHAPES)


@pytest.mark.skipif(torch.cuda.is_available() and sm90.available(),
                    reason="the refusal is for machines without the Hopper kernels")
def test_refuses_without_hopper_kernels(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tool.main(["--out", str(tmp_path / "x.csv")])
    assert exit_info.value.code == 2
    assert "sm_90" in capsys.readouterr().err
    assert not (tmp_path / "x.csv").exists()
