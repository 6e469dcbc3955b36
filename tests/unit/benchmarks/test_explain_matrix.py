"""benchmarks/explain_matrix.py without a GPU: which cells it explains (from a matrix.csv that
bench_matrix wrote), the shape it times for a cell, the split of each side's step into attention
and the rest, and its CSV, table, plot and --replot."""

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_matrix as bm
from benchmarks import explain_matrix as ex
from benchmarks import vllm_engine

_ROOT = Path(__file__).resolve().parents[3]
INFO = {"date": "2026-12-05 10:00 UTC", "commit": "abc1234", "gpu": "NVIDIA H200",
        "vllm": "0.26.0", "command": "python -m benchmarks.bench_matrix --heads 16"}
BACKEND = {"auto": "FLASH_ATTN_MLA", "fp8_snapmla": "SNAPMLA", "fp8": "FLASHMLA"}


def _cell(kv, tok_s, context=512, batch="64", mode="graph", **extra):
    row = {"heads": 16, "max_model_len": "wide", "mode": mode, "context": context,
           "batch": batch, "kv": kv, "status": "ok", "batch_size": 64, "max_tokens": 216,
           "max_model_len_tokens": 163840, "table_width": 2560, "decode_tok_s": tok_s,
           "tpot_ms": 64000 / tok_s, "lock_step": True, "timing_ok": True, "spread_pct": 1.0,
           "backend": BACKEND[kv]}
    row.update(extra)
    return row


def _matrix(tmp_path, rows, info=INFO):
    bm.write_outputs(tmp_path, info, rows, plot=False, run_fields=bm.run_fields_of())
    return vllm_engine.read_csv(tmp_path / "matrix.csv")[1]


def test_cells_under_the_bound_are_picked_worst_first_within_one_run(tmp_path):
    rows = _matrix(tmp_path, [
        _cell("auto", 1000.0), _cell("fp8_snapmla", 800.0), _cell("fp8", 500.0),
        _cell("auto", 1000.0, 8192), _cell("fp8_snapmla", 1500.0, 8192),
        _cell("auto", 1000.0, 2048), _cell("fp8_snapmla", 600.0, 2048),
        _cell("auto", 1000.0, 32768), _cell("fp8_snapmla", 1.0, 32768, status="failed"),
        _cell("auto", 1000.0, 512, "1", mode="eager", lock_step=False),
        _cell("fp8_snapmla", 500.0, 512, "1", mode="eager")])
    pairs = ex.cells_to_explain(rows, 1.0)
    # 2048 (0.6x) before 512 (0.8x); 8192 is above the bound, 32768 failed, the eager cell's
    # BF16 side was not lock-step (no ratio).
    assert [(int(o["context"]), float(o["vs_bf16"])) for _, o in pairs] == [(2048, 0.6),
                                                                           (512, 0.8)]
    assert all(b["kv"] == "auto" and b["context"] == o["context"] for b, o in pairs)
    assert len(ex.cells_to_explain(rows, None)) == 3
    # A BF16 row of another run is never the baseline.
    other = _matrix(tmp_path / "other", [_cell("fp8_snapmla", 700.0, 65536)],
                    {**INFO, "commit": "def5678"})
    assert ex.cells_to_explain(rows + other + [_cell("auto", 1000.0, 65536)], None) == \
        ex.cells_to_explain(rows, None)


def test_shape_is_the_middle_of_the_timed_windows_in_the_engines_table():
    row = _cell("fp8_snapmla", 1.0, context=8192, batch="fill", batch_size=301, max_tokens=400,
                max_model_len_tokens=8600)
    settings = bm.Settings()
    B, H, N, width = ex.decode_shape(row, settings)
    assert (B, H, width) == (301, 16, 135)   # 8600 tokens / 64, rounded up
    assert N == 8192 + 400 - settings.windows * settings.steps // 2
    assert ex.decode_shape({**row, "max_tokens": 10}, settings)[2] == 8192


def test_each_side_runs_the_kernel_its_engine_logged():
    assert ex.decode_backend(_cell("auto", 1.0)) == "fa3-mla-bf16"
    assert ex.decode_backend(_cell("auto", 1.0, backend="FLASHMLA")) == "flashmla-bf16"
    assert ex.decode_backend(_cell("fp8", 1.0)) == "flashmla-fp8"
    assert ex.decode_backend(_cell("fp8_snapmla", 1.0)) == "snapmla"
    with pytest.raises(ValueError, match="TRITON_MLA"):
        ex.decode_backend(_cell("auto", 1.0, backend="TRITON_MLA"))


def test_step_splits_into_attention_and_rest():
    bf16, ours = _cell("auto", 20000.0), _cell("fp8_snapmla", 16000.0)   # 3.2 / 4.0 ms
    ours["vs_bf16"] = 0.8
    times = {"bf16": {"us": 150.0, "metadata_us": 8.0}, "ours": {"us": 100.0}}
    row = ex.explain(bf16, ours, times, layers=4)
    assert row["attention_bf16_ms"] == pytest.approx(0.608)    # 4 x 150 + 8 us
    assert row["attention_ours_ms"] == pytest.approx(0.4)
    assert row["rest_bf16_ms"] == pytest.approx(3.2 - 0.608)
    assert row["rest_ours_ms"] == pytest.approx(4.0 - 0.4)
    assert row["gap_ms"] == pytest.approx(0.8)
    assert row["gap_attention_ms"] + row["gap_rest_ms"] == pytest.approx(row["gap_ms"])
    assert row["mostly"] == "rest of the step" and row["bf16_backend"] == "fa3-mla-bf16"
    slow_kernel = ex.explain(bf16, ours, {**times, "ours": {"us": 400.0}}, layers=4)
    assert slow_kernel["mostly"] == "attention"
    faster = ex.explain(bf16, {**ours, "tpot_ms": 3.0, "vs_bf16": 1.07}, times, layers=4)
    assert faster["mostly"] == "no gap" and faster["gap_ms"] < 0


def test_eager_cells_count_the_host_time_where_it_is_longer():
    bf16, ours = _cell("auto", 20000.0, mode="eager"), _cell("fp8_snapmla", 16000.0, mode="eager")
    ours["vs_bf16"] = 0.8
    times = {"bf16": {"us": 150.0, "host_us": 40.0, "metadata_us": 8.0},
             "ours": {"us": 20.0, "host_us": 35.0}}
    row = ex.explain(bf16, ours, times, layers=4)
    assert (row["layer_bf16_us"], row["layer_ours_us"]) == (150.0, 35.0)
    assert row["attention_ours_ms"] == pytest.approx(0.14)
    graph = ex.explain({**bf16, "mode": "graph"}, {**ours, "mode": "graph"}, times, layers=4)
    assert graph["layer_ours_us"] == 20.0


def test_fill_cells_keep_each_sides_own_batch():
    # 4 GiB hold 1.76x the tokens in fp8_snapmla: the fill batches differ, and so may N.
    bf16 = _cell("auto", 20000.0, batch="fill", batch_size=109, max_tokens=300)
    ours = {**_cell("fp8_snapmla", 30000.0, batch="fill", batch_size=193, max_tokens=340),
            "vs_bf16": 1.5}
    row = ex.explain(bf16, ours, {"bf16": {"us": 1.0}, "ours": {"us": 1.0}})
    assert (row["batch_size_bf16"], row["batch_size"]) == (109, 193)
    assert row["N"] - row["N_bf16"] == 40
    assert ex.decode_shape(bf16)[0] == 109 and ex.decode_shape(ours)[0] == 193


def test_outputs_merge_by_cell_and_replot_without_a_gpu(tmp_path):
    pytest.importorskip("matplotlib")
    times = {"bf16": {"us": 150.0, "metadata_us": 8.0}, "ours": {"us": 100.0}}
    rows = [ex.explain(_cell("auto", 20000.0, c), {**_cell("fp8_snapmla", t, c), "vs_bf16": v},
                       times) for c, t, v in ((512, 16000.0, 0.8), (2048, 14000.0, 0.7))]
    ex.write_outputs(tmp_path, INFO, rows)
    again = ex.write_outputs(tmp_path, {**INFO, "commit": "def5678"}, rows[:1])
    assert len(again) == 2 and [str(r["context"]) for r in again] == ["2048", "512"]   # worst
    assert {r["commit"] for r in again} == {"abc1234", "def5678"}
    table = (tmp_path / "explain.md").read_text()
    assert table.count("| 16 | wide | graph |") == 2 and "rest of the step" in table
    (tmp_path / "explain.md").unlink()
    (tmp_path / "explain.png").unlink()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.explain_matrix", "--replot",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          cwd=_ROOT)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "explain.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "explain.md").read_text() == table


def test_without_matrix_or_cells_it_says_so_before_any_gpu_work(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.explain_matrix", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=_ROOT)
    assert proc.returncode != 0 and "no matrix.csv" in proc.stderr
    _matrix(tmp_path, [_cell("auto", 1000.0), _cell("fp8_snapmla", 1200.0)])
    proc = subprocess.run([sys.executable, "-m", "benchmarks.explain_matrix", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=_ROOT)
    assert proc.returncode == 0 and "nothing to explain" in proc.stdout


def test_rows_follow_the_matrix_when_a_cell_is_measured_again(tmp_path):
    pytest.importorskip("matplotlib")
    first = _matrix(tmp_path, [_cell("auto", 20000.0), _cell("fp8_snapmla", 16000.0),
                               _cell("auto", 20000.0, 2048), _cell("fp8_snapmla", 14000.0, 2048),
                               _cell("auto", 20000.0, 8192), _cell("fp8_snapmla", 15000.0, 8192)])
    times = {"bf16": {"us": 150.0, "metadata_us": 8.0}, "ours": {"us": 100.0}}
    pairs = ex.cells_to_explain(first, 1.0)
    kernels = {**INFO, "commit": "k111111", "command": "python -m benchmarks.explain_matrix"}
    ex.write_outputs(tmp_path, kernels, [ex.explain(b, o, times) for b, o in pairs])
    # A later run measures 512 again (new TPOTs, same shapes) and 2048 with another batch;
    # 8192 is untouched.
    later = {**INFO, "date": "2026-12-06 10:00 UTC", "commit": "def5678"}
    _matrix(tmp_path, [_cell("auto", 20000.0), _cell("fp8_snapmla", 19000.0),
                       _cell("auto", 20000.0, 2048, batch_size=32),
                       _cell("fp8_snapmla", 14000.0, 2048, batch_size=32)], later)
    rows = {int(r["context"]): r for r in ex.write_outputs(tmp_path, None)}
    assert sorted(rows) == [512, 8192]    # 2048's kernel times were for another batch
    # --unexplained times only 2048 again: the held kernel times explain 512 and 8192.
    matrix = vllm_engine.read_csv(tmp_path / "matrix.csv")[1]
    held = vllm_engine.read_csv(tmp_path / "explain.csv")[1]
    todo = ex.unexplained(ex.cells_to_explain(matrix, 1.0), held, matrix)
    assert [int(o["context"]) for _, o in todo] == [2048]
    again = rows[512]
    assert float(again["vs_bf16"]) == pytest.approx(0.95)
    assert float(again["tpot_ours_ms"]) == pytest.approx(64000 / 19000.0)
    assert float(again["attention_ours_ms"]) == pytest.approx(0.4)       # the held kernel time
    assert float(again["rest_ours_ms"]) == pytest.approx(64000 / 19000.0 - 0.4)
    assert (again["matrix_date"], again["matrix_commit"]) == (later["date"], "def5678")
    assert again["commit"] == "k111111"                                  # when the kernels ran
    assert rows[8192]["matrix_commit"] == "abc1234" and float(rows[8192]["vs_bf16"]) == 0.75
    table = (tmp_path / "explain.md").read_text()
    assert "| 0.95x |" in table and "| 0.70x |" not in table and "commit k111111" in table
    # BF16 measured again on a backend with no kernel benchmark: left out, no error.
    _matrix(tmp_path, [_cell("auto", 20000.0, backend="TRITON_MLA"),
                       _cell("fp8_snapmla", 19000.0)],
            {**INFO, "date": "2026-12-06 11:00 UTC"})
    assert [int(r["context"]) for r in ex.write_outputs(tmp_path, None)] == [8192]
    # The cell gone from the matrix (no ratio any more): its explanation goes too.
    _matrix(tmp_path, [_cell("auto", 20000.0, 8192),
                       _cell("fp8_snapmla", 15000.0, 8192, status="failed")],
            {**INFO, "date": "2026-12-07 10:00 UTC"})
    assert ex.write_outputs(tmp_path, None) == []


def test_a_deeper_models_cells_count_its_layers(tmp_path):
    rows = [_cell("auto", 20000.0), _cell("fp8_snapmla", 16000.0)]
    bm.write_outputs(tmp_path, INFO, rows, plot=False, run_fields=bm.run_fields_of("", 16))
    matrix = vllm_engine.read_csv(tmp_path / "matrix.csv")[1]
    (bf16, ours), = ex.cells_to_explain(matrix, 1.0)
    assert ex.layers_of(ours) == 16 and ex.layers_of({"layers": ""}) == 4
    times = {"bf16": {"us": 150.0, "metadata_us": 8.0}, "ours": {"us": 100.0}}
    row = ex.explain(bf16, ours, times, ex.layers_of(ours))
    assert row["attention_ours_ms"] == pytest.approx(1.6) and row["layers"] == 16


def test_rows_of_a_deeper_model_follow_its_matrix_with_its_layers(tmp_path):
    fields = bm.run_fields_of("", 16)
    bm.write_outputs(tmp_path, INFO, [_cell("auto", 20000.0), _cell("fp8_snapmla", 16000.0)],
                     plot=False, run_fields=fields)
    matrix = vllm_engine.read_csv(tmp_path / "matrix.csv")[1]
    times = {"bf16": {"us": 150.0, "metadata_us": 8.0}, "ours": {"us": 100.0}}
    kernels = {**INFO, "commit": "k111111", "command": "python -m benchmarks.explain_matrix"}
    ex.write_outputs(tmp_path, kernels, [ex.explain(b, o, times, ex.layers_of(o))
                                         for b, o in ex.cells_to_explain(matrix, 1.0)])
    later = {**INFO, "date": "2026-12-06 10:00 UTC", "commit": "def5678"}
    bm.write_outputs(tmp_path, later, [_cell("auto", 20000.0), _cell("fp8_snapmla", 19000.0)],
                     plot=False, run_fields=fields)
    again, = ex.write_outputs(tmp_path, None)
    assert again["matrix_commit"] == "def5678"
    assert float(again["attention_ours_ms"]) == pytest.approx(1.6)    # 16 x 100 us
    assert float(again["attention_bf16_ms"]) == pytest.approx(2.408)  # 16 x 150 + 8 us


def test_our_split_plan_counts_once_per_step_and_follows_the_matrix(tmp_path):
    """Our split plan is made once per step (``ops.plan_decode``), like BF16's metadata: it
    counts once in the step's attention, and stays when the row follows a later matrix run;
    rows written before it existed read as none."""
    fields = bm.run_fields_of("", 16)
    bm.write_outputs(tmp_path, INFO, [_cell("auto", 20000.0), _cell("fp8_snapmla", 16000.0)],
                     plot=False, run_fields=fields)
    matrix = vllm_engine.read_csv(tmp_path / "matrix.csv")[1]
    times = {"bf16": {"us": 150.0, "metadata_us": 8.0}, "ours": {"us": 100.0, "metadata_us": 5.0}}
    (bf16, ours), = ex.cells_to_explain(matrix, 1.0)
    row = ex.explain(bf16, ours, times, 16)
    assert row["attention_ours_ms"] == pytest.approx(1.605) and row["metadata_ours_us"] == 5.0
    kernels = {**INFO, "commit": "k111111", "command": "python -m benchmarks.explain_matrix"}
    ex.write_outputs(tmp_path, kernels, [row])
    later = {**INFO, "date": "2026-12-06 10:00 UTC", "commit": "def5678"}
    bm.write_outputs(tmp_path, later, [_cell("auto", 20000.0), _cell("fp8_snapmla", 19000.0)],
                     plot=False, run_fields=fields)
    again, = ex.write_outputs(tmp_path, None)
    assert float(again["attention_ours_ms"]) == pytest.approx(1.605)
    # An explain.csv from before the column: the planner was inside each call.
    runs, rows = vllm_engine.read_csv(tmp_path / "explain.csv")
    vllm_engine.write_csv([{k: v for k, v in r.items() if k != "metadata_ours_us"} for r in rows],
                          tmp_path / "explain.csv",
                          [f for f in ex.FIELDS if f != "metadata_ours_us"], runs)
    latest = {**INFO, "date": "2026-12-06 11:00 UTC", "commit": "fed9876"}
    bm.write_outputs(tmp_path, latest, [_cell("auto", 20000.0), _cell("fp8_snapmla", 18000.0)],
                     plot=False, run_fields=fields)
    again, = ex.write_outputs(tmp_path, None)
    assert again["matrix_commit"] == "fed9876"
    assert float(again["attention_ours_ms"]) == pytest.approx(1.6)
