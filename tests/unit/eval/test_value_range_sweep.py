"""eval.value_range_sweep's bookkeeping on the CPU: one reparametrized point of the smoke model,
the parity runs stubbed (they need a GPU), the table, CSV and plot written."""

import csv

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from eval import value_range_sweep as sweep  # noqa: E402


def test_sweep_tables_every_point_and_setting(smoke_checkpoint, tmp_path, monkeypatch):
    seen = []

    def fake_parity(args, name, model):
        seen.append((name, model))
        return [{"run": "auto", "ppl_cache_context": "8.0", "ppl_delta_pct": "",
                 "greedy_identical": ""},
                {"run": "fp8", "ppl_cache_context": "9.0", "ppl_delta_pct": "12.5",
                 "dnll_vs_bf16": "0.1178", "dnll_vs_bf16_se": "0.01",
                 "greedy_identical": "0.25"}]

    monkeypatch.setattr(sweep, "run_parity", fake_parity)
    sweep.main(["--model", str(smoke_checkpoint), "--out", str(tmp_path), "--targets", "100",
                "--dtypes", "auto,fp8"])
    assert [name for name, _ in seen] == ["original", "rope100"]
    assert seen[0][1] == smoke_checkpoint
    assert (seen[1][1] / "reparametrization.json").exists()
    with open(tmp_path / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["point"], r["run"]) for r in rows] == [
        ("original", "auto"), ("original", "fp8"), ("rope100", "auto"), ("rope100", "fp8")]
    assert float(rows[2]["rope_absmax"]) > 50
    # The unmodified point gets the ranges the reparametrization measured before rescaling.
    assert 0 < float(rows[0]["rope_absmax"]) < 50
    assert float(rows[0]["content_absmax"]) == float(rows[2]["content_absmax"])
    assert "+12.500%" in (tmp_path / "sweep.md").read_text()
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_sweep_refuses_points_of_another_checkpoint(smoke_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "run_parity", lambda args, name, model: [
        {"run": "auto", "ppl_cache_context": "8.0", "ppl_delta_pct": "", "greedy_identical": ""}])
    sweep.main(["--model", str(smoke_checkpoint), "--out", str(tmp_path), "--targets", "100",
                "--dtypes", "auto"])
    other = tmp_path / "other-checkpoint"
    other.mkdir()
    with pytest.raises(SystemExit, match="made from"):
        sweep.main(["--model", str(other), "--out", str(tmp_path), "--targets", "100",
                    "--dtypes", "auto"])
    # The same folder retrained (its files changed): the point is made again from it.
    report = tmp_path / "rope100" / "model" / "reparametrization.json"
    made = report.stat().st_mtime_ns
    retrained = smoke_checkpoint / "retrained.txt"      # shared fixture: removed again below
    retrained.write_text("new weights\n")
    try:
        sweep.main(["--model", str(smoke_checkpoint), "--out", str(tmp_path), "--targets", "100",
                    "--dtypes", "auto"])
    finally:
        retrained.unlink()
    assert report.stat().st_mtime_ns > made


def test_sweep_needs_the_bf16_baseline(tmp_path):
    with pytest.raises(SystemExit):
        sweep.main(["--model", str(tmp_path), "--out", str(tmp_path), "--dtypes", "fp8"])
