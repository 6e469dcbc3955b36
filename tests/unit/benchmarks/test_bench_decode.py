"""benchmarks/bench_decode.py without a GPU: its plot and --replot (the panels follow the shapes
a run has), its CSV (older files without the later columns still read), and what it builds for
--shapes, --ragged and --table-width."""

import argparse
import csv
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench_decode as bench

_ROOT = Path(__file__).resolve().parents[3]


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


def test_h128_shapes_that_repeat_a_length_are_bars_not_a_line(tmp_path):
    # 1 x 512 and 64 x 512 at 128 heads: a line against the length would fold back on itself
    pytest.importorskip("matplotlib")
    shapes = [(1, 128, 512, 1), (64, 128, 512, 1), (8, 128, 65536, 1), (64, 16, 4096, 1)]
    panels = bench._plot(_rows(random.Random(7), shapes, True), tmp_path / "p.png")
    assert panels == ["speedup over BF16 FlashMLA"]
    assert _png(tmp_path / "p.png")


def test_flashattention_speedups_get_a_panel_over_every_shape(tmp_path):
    pytest.importorskip("matplotlib")
    shapes = [(64, 128, 4096, 1), (64, 16, 512, 1)]
    rows = _rows(random.Random(6), shapes, True)
    assert bench.FA3_PANEL not in bench._plot(rows, tmp_path / "p.png")
    for r in rows:
        r["speedup_vs_fa3"] = r["speedup_vs_bf16"] * 1.1
    panels = bench._plot(rows, tmp_path / "q.png")
    assert panels[-1] == bench.FA3_PANEL and len(panels) == 4
    assert _png(tmp_path / "q.png")


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
    subprocess.run([sys.executable, "-m", "benchmarks.bench_decode", "--replot",
                    str(tmp_path / "decode.csv"), "--out", str(out)], check=True,
                   capture_output=True, timeout=300, cwd=_ROOT)
    assert _png(out / "decode.png")


def test_csv_keeps_the_new_timings_and_reads_files_without_them(tmp_path):
    rows = _rows(random.Random(5), [(64, 16, 1024, 1)], True)
    for r in rows:
        r.update(table_width=2560, ragged=1, timing="graph", host_us=41.5, eager_us=55.25,
                 metadata_host_us=12.0 if r["backend"].startswith("flashmla") else None,
                 metadata_eager_us=None, metadata_us=3.5)
    bench.write_csv(rows, tmp_path / "decode.csv", bench.CSV_COLUMNS,
                    ["2026-12-04 | commit abc | H200"])
    back = bench._read_csv(tmp_path / "decode.csv")
    assert [r["table_width"] for r in back] == [2560] * 3 and back[0]["ragged"] == 1
    assert back[0]["timing"] == "graph" and back[2]["host_us"] == pytest.approx(41.5)
    assert back[0]["metadata_host_us"] == 12.0 and back[2]["metadata_host_us"] is None
    # A decode.csv written before those columns existed.
    old_columns = bench.CSV_COLUMNS[1:12]
    with open(tmp_path / "old.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=old_columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    old = bench._read_csv(tmp_path / "old.csv")
    assert old[1]["us"] == pytest.approx(rows[1]["us"])
    assert old[1]["table_width"] is None and old[1]["host_us"] is None


def test_a_run_replaces_only_what_it_measures_again():
    """A --heads subset run keeps the other shapes' rows; each row names its run."""
    first = [{"run": 1, "backend": b, "B": 64, "H": h, "N": 4096, "s_q": 1, "table_width": 64,
              "ragged": 0, "timing": "graph", "us": 10.0} for b in ("ours", "flashmla-bf16")
             for h in (16, 128)]
    again = [{**first[0], "run": 2, "us": 9.0}]
    merged = bench.merge_by_key(first, again, bench._row_key)
    assert len(merged) == 4 and merged[0]["run"] == 2 and merged[0]["us"] == 9.0
    assert [r["run"] for r in merged[1:]] == [1, 1, 1]
    assert len(bench.merge_by_key(first, [{**first[0], "timing": "eager"}], bench._row_key)) == 5


def test_each_shape_draws_its_own_inputs():
    """A shape's ragged lengths do not depend on which shapes ran before it."""
    a = bench.request_lengths(16, 8192, True, bench._shape_generator(16, 128, 8192, 1))
    bench.request_lengths(64, 4096, True, bench._shape_generator(64, 16, 4096, 1))
    b = bench.request_lengths(16, 8192, True, bench._shape_generator(16, 128, 8192, 1))
    c = bench.request_lengths(16, 8192, True, bench._shape_generator(16, 16, 8192, 1))
    assert a == b and a != c


def test_shapes_parse_as_b_h_n_and_optional_s_q():
    assert bench.parse_shape("64x16x1024") == (64, 16, 1024, 1)
    assert bench.parse_shape("8X128x131072x2") == (8, 128, 131072, 2)
    for bad in ("64x16", "64x16x0", "axbxc", "1x2x3x4x5"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_shape(bad)


def test_ragged_lengths_are_seeded_and_within_an_eighth_of_n_and_n():
    lengths = bench.request_lengths(500, 8192, True, torch.Generator().manual_seed(3))
    assert min(lengths) >= 1024 and max(lengths) <= 8192 and len(set(lengths)) > 100
    assert lengths == bench.request_lengths(500, 8192, True, torch.Generator().manual_seed(3))
    assert bench.request_lengths(4, 8192, False, torch.Generator()) == [8192] * 4


def test_block_table_pads_each_request_with_zeros_to_the_width():
    rows = bench.block_table_rows([[5, 9, 2], [7]], 6)
    assert rows == [[5, 9, 2, 0, 0, 0], [7, 0, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="more than the table"):
        bench.block_table_rows([[1, 2, 3]], 2)


def test_table_width_narrower_than_a_shape_is_refused_before_any_gpu_work():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_decode", "--shapes",
                           "1x16x8192", "--table-width", "64"], capture_output=True, text=True,
                          timeout=300, cwd=_ROOT)
    assert proc.returncode == 2 and "narrower than the pages" in proc.stderr


def test_fa3_table_reads_the_same_tokens_in_16_token_pages():
    # A cache whose every token holds its own position in the pool: gathering a request's
    # tokens through the 64-token table and through the 16-token one must give the same list.
    gen = torch.Generator().manual_seed(5)
    lengths = [1, 64, 65, 200, 17]
    pages = torch.randperm(40, generator=gen).tolist()
    rows, start = [], 0
    for n in lengths:
        used = -(-n // 64)
        rows.append(pages[start:start + used])
        start += used
    table = torch.tensor(bench.block_table_rows(rows, 6), dtype=torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    pool = torch.arange(40 * 64)
    small = bench.fa3_block_table(table, seq_lens, 4)
    assert small.shape == (5, 24) and small.dtype == torch.int32 and small.is_contiguous()
    for b, n in enumerate(lengths):
        positions = torch.arange(n)
        via_64 = pool.view(40, 64)[table[b, positions // 64].long(), positions % 64]
        via_16 = pool.view(160, 16)[small[b, positions // 16].long(), positions % 16]
        assert torch.equal(via_64, via_16)
        # vLLM pads a row with 0 past the request's pages.
        assert small[b, -(-n // 16):].eq(0).all()


@pytest.mark.parametrize("name, short", [
    ("void snapmla::sm90::decode_narrow_kernel<16>(CUtensorMap_st, CUtensorMap_st, "
     "snapmla::sm90::DecodeParams)", "decode_narrow_kernel<16>"),
    ("snapmla::(anonymous namespace)::combine_wide_kernel(snapmla::CombineParams)",
     "combine_wide_kernel"),
    ("void snapmla::(anonymous namespace)::quantize_q_kernel<__nv_bfloat16>(snapmla::StridedRows, "
     "long, snapmla::SplitPlanParams, bool)", "quantize_q_kernel<__nv_bfloat16>"),
    ("void flash_fwd_splitkv_mla_kernel<cutlass::bfloat16_t, 64>(Flash_fwd_mla_params)",
     "flash_fwd_splitkv_mla_kernel<cutlass::bfloat16_t, 64>"),
    ("nvjet_sm90_tst_512x64_64x2_2x1_v_bz_coopB_TNN",
     "nvjet_sm90_tst_512x64_64x2_2x1_v_bz_coopB_TNN"),
])
def test_kernel_names_lose_return_type_namespaces_and_arguments(name, short):
    assert bench.short_kernel_name(name) == short


def test_long_kernel_names_are_cut_to_60_characters():
    name = ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
            "cute::tuple<cute::C<64>, cute::C<64>>, 2, 128>>>(flash::Params)")
    short = bench.short_kernel_name(name)
    assert len(short) == 60 and short.startswith("device_kernel<flash::") and short.endswith("...")


def test_kernel_times_are_per_call_and_longest_first():
    events = [("decode", 20.0), ("quant", 2.0), ("decode", 22.0), ("combine", 3.0),
              ("quant", 2.5), ("combine", 3.5), ("combine", 1.0)]
    assert bench.kernels_per_call(events, calls=2) == [
        ("decode", 21.0, 1.0), ("combine", 3.75, 1.5), ("quant", 2.25, 1.0)]


def test_a_measurement_again_replaces_all_its_kernel_rows():
    def row(backend, N, kernel):
        return {"backend": backend, "B": 1, "H": 16, "N": N, "s_q": 1, "table_width": 2560,
                "ragged": 0, "kernel": kernel}
    old = [row("snapmla", 512, "quantize"), row("snapmla", 512, "decode"),
           row("snapmla", 512, "combine"), row("snapmla", 4096, "combine"),
           row("flashmla-bf16", 512, "flash")]
    new = [row("snapmla", 512, "quantize"), row("snapmla", 512, "decode")]
    merged = bench.merge_kernel_rows(old, new)
    assert [(r["backend"], r["N"], r["kernel"]) for r in merged] == [
        ("snapmla", 4096, "combine"), ("flashmla-bf16", 512, "flash"),
        ("snapmla", 512, "quantize"), ("snapmla", 512, "decode")]
