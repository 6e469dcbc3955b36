"""The README and benchmarks/RESULTS.md quote the recorded results: when a file under
benchmarks/results is replaced by a new run, the quoted numbers must follow it, and these tests
fail until they do."""

import math
from pathlib import Path

import pytest

from benchmarks import bench_decode
from benchmarks.bench_matrix import matrix_key
from benchmarks.vllm_engine import read_csv

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "benchmarks" / "results"
CONTEXTS = {32768: "32k", 65536: "64k", 131072: "128k"}
# The contexts RESULTS.md's tables name, by their labels.
CONTEXT_OF_LABEL = {label: c for c, label in {16384: "16k", **CONTEXTS}.items()}


def _readme_line(prefix: str) -> str:
    lines = [line for line in (ROOT / "README.md").read_text().splitlines()
             if line.startswith(prefix)]
    assert len(lines) == 1, (prefix, lines)
    return lines[0]


def _readme_item(prefix: str) -> str:
    """The README's list item that starts with ``prefix``, its wrapped lines joined."""
    lines = (ROOT / "README.md").read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(prefix)]
    assert len(starts) == 1, (prefix, starts)
    item = [lines[starts[0]]]
    for line in lines[starts[0] + 1:]:
        if not line.startswith("  ") or line.lstrip().startswith("- "):
            break
        item.append(line)
    return " ".join(" ".join(item).split())


def _ratio(value: str) -> str:
    return f"{float(value):.2f}x"


def _e2e_ratios(heads: int) -> dict[tuple[str, int], str]:
    rows = []
    for name in ("e2e.csv", "e2e-h16.csv"):
        rows += read_csv(RESULTS / name)[1]
    # The README quotes one-GPU runs (rows written before the tp column are one-GPU runs).
    rows = [r for r in rows if int(r["heads"]) == heads and int(r["context"]) in CONTEXTS
            and r["kv"] != "auto" and int(r.get("tp") or 1) == 1]
    ratios = {(r["kv"], int(r["context"])): _ratio(r["speedup_vs_bf16"]) for r in rows}
    # One row per cell: a new run in one file must not hide behind the other's.
    assert len(ratios) == len(rows) == 6, (heads, rows)
    return ratios


@pytest.mark.parametrize("heads", [16, 128])
def test_end_to_end_ratios_are_the_recorded_ones(heads):
    ratios = _e2e_ratios(heads)
    line = _readme_line(f"- {heads} heads: ")
    ours = ", ".join(f"{'**' if heads == 16 else ''}{ratios['fp8_snapmla', c]}"
                     f"{'**' if heads == 16 else ''} at {label}"
                     for c, label in CONTEXTS.items())
    fp8 = ", ".join(ratios["fp8", c] for c in CONTEXTS)
    assert ours in line, (ours, line)
    assert fp8 in line, (fp8, line)


def _range(values) -> str:
    values = sorted(float(v[:-1]) for v in values)
    return f"{values[0]:.2f}-{values[-1]:.2f}x"


def test_summary_table_ranges_are_the_recorded_ones():
    long16 = _range(v for (kv, _), v in _e2e_ratios(16).items() if kv == "fp8_snapmla")
    long128 = _range(v for (kv, _), v in _e2e_ratios(128).items() if kv == "fp8_snapmla")
    assert long16 in _readme_line("| long contexts (32k-128k)"), long16
    assert long128 in _readme_line("| the same at 128 heads"), long128
    _, rows = read_csv(RESULTS / "deployment" / "deployment.csv")
    plain = [_ratio(r["speedup_vs_auto"]) for r in rows
             if r["kv"] == "fp8_snapmla" and r["mtp"] == "False" and r["speedup_vs_auto"]]
    assert _range(plain) in _readme_line("| one rank of DeepSeek-V3.1"), _range(plain)


@pytest.mark.parametrize("config, label", [("dp8-tp1-ep8", "| DP8/TP1 with EP8"),
                                           ("dp4-tp2-ep8", "| DP4/TP2 with EP8"),
                                           ("dp1-tp8", "| DP1/TP8")])
def test_deployment_table_is_the_recorded_runs(config, label):
    _, rows = read_csv(RESULTS / "deployment" / "deployment.csv")
    line = _readme_line(label)
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    for column, (kv, mtp) in enumerate([("fp8_snapmla", "False"), ("fp8", "False"),
                                        ("fp8_snapmla", "True")], start=1):
        found = {int(r["context"]): _ratio(r["speedup_vs_auto"]) for r in rows
                 if r["config"] == config and r["kv"] == kv and r["mtp"] == mtp
                 and r["speedup_vs_auto"]}
        if not found:
            assert cells[column] == "not run", (config, kv, mtp, cells[column])
            continue
        quoted = " / ".join(found[c] for c in sorted(found))
        assert cells[column].startswith(quoted), (config, kv, mtp, quoted, cells[column])


def test_matrix_cells_are_the_recorded_ones():
    _, rows = read_csv(RESULTS / "matrix.csv")
    cells = {int(r["context"]): _ratio(r["vs_bf16"]) for r in rows
             if r["kv"] == "fp8_snapmla" and r["vs_bf16"] and r["heads"] == "16"
             and r["batch"] == "64" and r["mode"] == "graph" and r["max_model_len"] == "wide"}
    assert set(cells) == {512, 8192}, cells
    assert _range(cells.values()) in _readme_line("| 64 requests of 512 and of 8k tokens")
    line = _readme_line("  `efac971`, 64 requests, vLLM's 2560-page table)")
    assert f"{cells[512]} (512 tokens) and {cells[8192]} (8k)" in line, (cells, line)


def test_flashattention_kernel_ratios_are_the_recorded_ones():
    rows = bench_decode._read_csv(RESULTS / "fa3-h100" / "decode.csv")
    ours = [_ratio(r["speedup_vs_fa3"]) for r in rows if r["backend"] == "snapmla"]
    fa3 = [_ratio(r["speedup_vs_bf16"]) for r in rows if r["backend"] == "fa3-mla-bf16"]
    assert len(ours) == len(fa3) == 10, (ours, fa3)
    item = _readme_item("- **The decode kernel against FlashAttention-3 MLA**")
    # the item's three groups: far below, just below and above FlashAttention-3
    for low, high in ((0, 0.9), (0.9, 1.0), (1.0, 99)):
        group = [v for v in ours if low <= float(v[:-1]) < high]
        assert group and _range(group) in item, (low, high, _range(group), item)
    assert f"ran {_range(fa3)} BF16 FlashMLA" in item, (_range(fa3), item)


def _matrix_range(heads: int, mode: str, tables: str, fill: bool,
                  folder: str = "matrix-h100") -> str:
    values = [float(r["vs_bf16"]) for r in _matrix_cells(folder)[0]
              if int(r["heads"]) == heads and r["mode"] == mode
              and r["max_model_len"] == tables and (r["batch"] == "fill") == fill
              and (not fill or tables == "tight" or int(r["context"]) >= 8192)]
    assert values, (heads, mode, fill)
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{low}x" if low == high else f"{low}-{high}x"


def _matrix_cells(folder: str = "matrix-h100") -> tuple[list[dict], dict]:
    """fp8_snapmla's rows with a ratio to BF16, and BF16's row of each cell."""
    _, rows = read_csv(RESULTS / folder / "matrix.csv")
    ours = [r for r in rows
            if r["kv"] == "fp8_snapmla" and r["status"] == "ok" and r["vs_bf16"]]
    bf16 = {matrix_key(r)[:5]: r for r in rows if r["kv"] == "auto"}
    return ours, bf16


def _runs(row: dict) -> list[float]:
    """A cell's ratio per round (one value when it was measured once)."""
    return [float(v) for v in (row["vs_bf16_runs"] or row["vs_bf16"]).split() if v != "-"]


def test_readme_matrix_row_is_the_recorded_matrix():
    ours, bf16 = _matrix_cells()
    long_fill = [r["vs_bf16"] for r in ours if r["batch"] == "fill" and int(r["context"]) >= 8192]
    fixed = [r["vs_bf16"] for r in ours if r["batch"] != "fill"]
    under = [r for r in ours if float(r["vs_bf16"]) < 1.0]
    noisy = [r for r in under if "False" in (r["timing_ok"], bf16[matrix_key(r)[:5]]["timing_ok"])]
    line = _readme_line("| workload matrix through vLLM on one H100").replace("**", "")
    assert f"({len(ours)} cells)" in line, (len(ours), line)
    assert f"{_range(map(_ratio, long_fill))} / {_range(map(_ratio, fixed))}" in line, line
    fill_under = [r for r in under if r["batch"] == "fill"]
    contexts = {int(r["context"]) for r in fill_under}
    assert contexts == {2048}, contexts
    assert (f"{len(under)} cells under 1.0x ({len(under) - len(fill_under)} of 1-64 requests, "
            f"{len(fill_under)} filling batches at 2k tokens), {len(noisy)} of them") in line, line


def test_results_matrix_panels_are_the_recorded_matrix():
    """RESULTS.md's table of the H100 matrix, a line per heads, tables and mode, against
    matrix.csv: the 1-64 request range, each filling batch, the cells under 1.0x and how many
    of those ran in rounds and were under in every round."""
    ours, _ = _matrix_cells()
    table = _markdown_table(ROOT / "benchmarks" / "RESULTS.md",
                            "| heads | tables | mode | 1, 8, 64 requests |")
    assert len(table) == 8, table
    panels = set()
    for row in table:
        panel = (row["heads"], row["tables"], row["mode"])
        panels.add(panel)
        cells = [r for r in ours if (r["heads"], r["max_model_len"], r["mode"]) == panel]
        fixed = [_ratio(r["vs_bf16"]) for r in cells if r["batch"] != "fill"]
        assert row["1, 8, 64 requests"] == _range(fixed), (panel, _range(fixed))
        fill = {int(r["context"]): float(r["vs_bf16"]) for r in cells if r["batch"] == "fill"}
        quoted = " / ".join(f"{fill[c]:.2f}" for c in (512, 2048, 8192, 32768, 131072)) + "x"
        assert row["filling batch: 512 / 2k / 8k / 32k / 128k tokens"] == quoted, (panel, quoted)
        under = [r for r in cells if float(r["vs_bf16"]) < 1.0]
        in_rounds = [r for r in under if len(_runs(r)) > 1]
        every = [r for r in in_rounds if max(_runs(r)) < 1.0]
        assert row["cells under 1.0x"] == str(len(under)), (panel, len(under))
        assert row["of those, in three rounds / under in every round"] == \
            f"{len(in_rounds)} / {len(every)}", (panel, len(in_rounds), len(every))
    assert len(panels) == 8 and len(ours) == 136, (panels, len(ours))


def test_deeper_model_range_is_the_recorded_one():
    line = _readme_line("| the 1-64 request cells at 512-8k tokens with 16 layers")
    _, rows = read_csv(RESULTS / "matrix-h100-16layers" / "matrix.csv")
    assert {r["layers"] for r in rows} == {"16"}, {r["layers"] for r in rows}
    fixed16 = _matrix_range(16, "graph", "wide", False, folder="matrix-h100-16layers")
    # at 128 heads the ratios are quoted to three decimals: two would hide them
    ratios128 = [float(r["vs_bf16"]) for r in _matrix_cells("matrix-h100-16layers")[0]
                 if r["heads"] == "128" and r["mode"] == "graph"]
    assert len(ratios128) == 9, ratios128
    fixed128 = f"{min(ratios128):.3f}-{max(ratios128):.3f}x"
    assert f"{fixed16} / {fixed128} (see" in line.replace("**", ""), (fixed16, fixed128, line)


def test_results_deeper_model_tables_are_the_recorded_runs():
    """RESULTS.md's two 16-layer tables (16 heads to two decimals, 128 heads to three), each
    cell's ratio, its rounds' range and bold exactly under 1.0x, against matrix.csv."""
    ours, _ = _matrix_cells("matrix-h100-16layers")
    tables = [rows for names, rows in _markdown_tables("| context | 1 request | 8 | 64 |",
                                                         ROOT / "benchmarks" / "RESULTS.md")
              if names == ["context", "1 request", "8", "64"]]
    assert len(tables) == 2, len(tables)
    for rows, heads, digits in ((tables[0], "16", 2), (tables[1], "128", 3)):
        cells = {(int(r["context"]), r["batch"]): r for r in ours
                 if r["heads"] == heads and r["mode"] == "graph"}
        assert len(rows) == 3 and len(cells) == 9, (heads, rows, len(cells))
        for context, *quoted in rows:
            for batch, text in zip(("1", "8", "64"), quoted):
                r = cells[(int(context), batch)]
                runs = _runs(r)
                want = (f"{float(r['vs_bf16']):.{digits}f}x",
                        f"{min(runs):.{digits}f}-{max(runs):.{digits}f}")
                ratio, span = text.replace("**", "").rstrip(")").split(" (")
                assert (ratio, span.removeprefix("rounds ")) == want, (heads, context, batch)
                assert text.startswith("**") == (float(r["vs_bf16"]) < 1.0), (heads, context)


def _twin_cells() -> list[tuple[dict, dict]]:
    """(ours, the A/A twin's) row of every H100 matrix cell that ran with a twin."""
    _, rows = read_csv(RESULTS / "matrix-h100" / "matrix.csv")
    twins = {matrix_key(r)[:5]: r for r in rows if r["kv"] == "auto_twin" and r["vs_bf16"]}
    return [(r, twins[matrix_key(r)[:5]]) for r in _matrix_cells()[0]
            if matrix_key(r)[:5] in twins]


def test_results_and_readme_quote_the_recorded_a_a_control():
    pairs = _twin_cells()
    assert len(pairs) == 26, len(pairs)
    table = _markdown_table(ROOT / "benchmarks" / "RESULTS.md",
                            "| heads | mode | cells | ours / BF16 (cells under 1.0x) |")
    quoted = 0
    for row in table:
        mine = [(o, t) for o, t in pairs if (o["heads"], o["mode"]) == (row["heads"], row["mode"])]
        assert row["cells"] == str(len(mine)), row
        for column, side in (("ours / BF16 (cells under 1.0x)", 0),
                             ("twin / BF16 (cells under 1.0x)", 1)):
            values = [float(pair[side]["vs_bf16"]) for pair in mine]
            under = sum(v < 1.0 for v in values)
            assert row[column] == f"{_range(map(_ratio, values))} ({under})", (row, column)
        outside = [float(o["vs_bf16"]) for o, t in mine
                   if abs(float(o["vs_bf16"]) - 1) > abs(float(t["vs_bf16"]) - 1)]
        below = sum(v < 1.0 for v in outside)
        assert row["cells where ours is further from 1.0x than the twin (above / below)"] == \
            f"{len(outside)} ({len(outside) - below} / {below})", row
        logs = [math.log(float(o["vs_bf16"]) / float(t["vs_bf16"])) for o, t in mine]
        assert row["ours / twin, geometric mean"] == _ratio(math.exp(sum(logs) / len(logs))), row
        quoted += len(mine)
    assert quoted == len(pairs)
    twin = _range(_ratio(t["vs_bf16"]) for _, t in pairs)
    ours = _range(_ratio(o["vs_bf16"]) for o, _ in pairs)
    item = _readme_item("  - The A/A control measures the method itself.")
    assert f"read {twin} the first over {len(pairs)} of these cells" in item, (twin, item)
    assert f"where ours read {ours}" in item, (ours, item)


def test_continuous_batching_ratios_are_the_recorded_ones():
    _, rows = read_csv(RESULTS / "matrix-h100" / "serve.csv")
    ours = {r["mode"]: _ratio(r["tpot_p50_vs_bf16"]) for r in rows
            if r["kv"] == "fp8_snapmla" and r["status"] == "ok" and r["heads"] == "16"}
    line = _readme_line("| continuous batching on one H100")
    assert f"{ours['graph']} / {ours['eager']}" in line, (ours, line)


_DEPLOYMENT_CONFIGS = {"DP8/TP1": "dp8-tp1-ep8", "DP4/TP2": "dp4-tp2-ep8", "DP1/TP8": "dp1-tp8"}


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _markdown_tables(header: str, path: Path = ROOT / "benchmarks" / "RESULTS.md"
                     ) -> list[tuple[list[str], list[list[str]]]]:
    """The tables of ``path`` whose header row starts with ``header``: each one's column names
    and its rows as lists of cells."""
    lines = path.read_text().splitlines()
    tables = []
    for i, line in enumerate(lines):
        if line.startswith(header):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(_cells(row))
            tables.append((_cells(line), rows))
    return tables


@pytest.mark.parametrize("mtp, value_column", [("False", "decode_tok_s"),
                                               ("True", "projected_output_tok_s")])
def test_results_deployment_tables_are_the_recorded_runs(mtp, value_column):
    """RESULTS.md's deployment tables (without and with MTP) against deployment.csv: per
    configuration, format and context the batch, step time, windows' spread, tokens per second
    and ratio to BF16."""
    _, rows = read_csv(RESULTS / "deployment" / "deployment.csv")
    recorded = {(r["config"], r["kv"], int(r["context"])): r for r in rows if r["mtp"] == mtp}
    header = ("| configuration | KV format | context | B | step ms (apart) | "
              + ("decode tok/s | vs BF16 |" if mtp == "False"
                 else "projected output tok/s | vs BF16 + MTP |"))
    tables = _markdown_tables(header)
    assert len(tables) == 1, header
    config, seen = None, 0
    for cells in tables[0][1]:
        label, kv_label, contexts, batches, steps, values, ratios = cells
        if label:
            config = _DEPLOYMENT_CONFIGS[label.split(",")[0]]
        kv = ("fp8_snapmla" if "fp8_snapmla" in kv_label
              else "fp8" if "`fp8`" in kv_label else "auto")
        for i, context in enumerate(c.strip() for c in contexts.split("/")):
            context = CONTEXT_OF_LABEL[context]
            r = recorded[(config, kv, context)]
            where = (config, kv, context)
            assert batches.split("/")[i].strip() == r["batch"], where
            step, spread = steps.split("/")[i].strip().rstrip("%)").split(" (")
            assert step == f"{float(r['tpot_ms']):.2f}", where
            assert spread == f"{float(r['spread_pct']):.1f}", where
            assert values.split("/")[i].strip() == f"{float(r[value_column]):,.0f}", where
            if kv != "auto":
                ratio = ratios.strip("*").split("/")[i].strip().strip("*")
                assert ratio == _ratio(r["speedup_vs_auto"]), where
            seen += 1
    assert seen == len(recorded), (seen, len(recorded))


def _markdown_table(path: Path, header: str) -> list[dict[str, str]]:
    """The one table of ``path`` whose header row starts with ``header``, as dicts by column."""
    tables = _markdown_tables(header, path)
    assert len(tables) == 1, (path, header, len(tables))
    names, rows = tables[0]
    return [dict(zip(names, row)) for row in rows]


def test_results_profile_table_is_the_recorded_profile():
    """RESULTS.md's TP8 step profile (ms) against the profile the benchmark wrote (µs)."""
    folder = RESULTS / "deployment"
    recorded = {(r["kv"], int(r["context"])): r for r in
                _markdown_table(folder / "profile.md", "| configuration | kv | context |")}
    columns = {"step, in-process windows": "window step ms (in-process)", "GPU busy": "GPU busy",
               "attention": "attention", "MoE": "MoE", "GEMMs": "GEMMs", "other": "other"}
    seen = 0
    for row in _markdown_table(ROOT / "benchmarks" / "RESULTS.md",
                               "| KV format | context | B | step, in-process windows |"):
        kv = ("fp8_snapmla" if "fp8_snapmla" in row["KV format"]
              else "fp8" if "`fp8`" in row["KV format"] else "auto")
        contexts = [CONTEXT_OF_LABEL[c.strip()] for c in row["context"].split("/")]
        for i, context in enumerate(contexts):
            r = recorded[(kv, context)]
            assert row["B"].split("/")[i].strip() == r["B"], (kv, context)
            for quoted, column in columns.items():
                value = float(r[column].replace(",", ""))
                ms = value if column.startswith("window") else value / 1000
                assert row[quoted].split("/")[i].strip() == f"{ms:.2f}", (kv, context, quoted)
            seen += 1
    assert seen == len(recorded), (seen, len(recorded))


def test_three_format_matrix_table_is_the_recorded_run():
    """RESULTS.md's one-measurement 16-head matrix with vLLM's ``fp8`` against its CSV."""
    _, rows = read_csv(RESULTS / "matrix-h100-three-formats" / "matrix.csv")
    ratio = {(r["kv"], int(r["context"]), r["batch"]): r["vs_bf16"] for r in rows}
    batches = {"1 request": "1", "8": "8", "64": "64", "filling batch": "fill"}
    table = _markdown_table(ROOT / "benchmarks" / "RESULTS.md",
                            "| context | 1 request | 8 | 64 | filling batch |")
    assert len(table) == 5, table
    for row in table:
        context = int(row["context"])
        for column, batch in batches.items():
            cell = row[column].replace("**", "")
            ours, fp8 = ratio[("fp8_snapmla", context, batch)], ratio[("fp8", context, batch)]
            if not ours:
                assert cell.startswith("-"), (context, batch, cell)
                continue
            assert cell == f"{_ratio(ours)} ({_ratio(fp8)})", (context, batch, cell)
            # bold exactly where a ratio is under 1.0x
            bold = row[column].count("**") // 2
            assert bold == (float(ours) < 1) + (float(fp8) < 1), (context, batch, row[column])


def test_short_call_table_is_the_recorded_run():
    """RESULTS.md's table of where a short call's time goes: graph replays from decode.csv, each
    kernel's time from kernels.csv, for every shape the run measured."""
    folder = RESULTS / "short-calls-h100"
    rows = bench_decode._read_csv(folder / "decode.csv")
    _, kernels = read_csv(folder / "kernels.csv")
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()

    def times(backend, r):
        return {k["kernel"]: float(k["us_per_call"]) for k in kernels
                if k["backend"] == backend and (int(k["B"]), int(k["H"]), int(k["N"])) ==
                (r["B"], r["H"], r["N"])}

    ours = [r for r in rows if r["backend"] == "snapmla"]
    assert len(ours) == 6
    for r in ours:
        fa3 = next(x for x in rows if x["backend"] == "fa3-mla-bf16"
                   and (x["B"], x["H"], x["N"]) == (r["B"], r["H"], r["N"]))
        mine, theirs = times("snapmla", r), times("fa3-mla-bf16", r)
        q = next(v for k, v in mine.items() if "quantize" in k)
        d = next(v for k, v in mine.items() if "decode" in k)
        c = next(v for k, v in mine.items() if "combine" in k)
        fc = next(v for k, v in theirs.items() if "Combine" in k)
        fd = next(v for k, v in theirs.items() if "Combine" not in k)
        assert len(mine) == 3 and len(theirs) == 2, (mine, theirs)
        line = (f"| {r['B']} x {r['H']} x {r['N']:,} | {fa3['us']:.1f} | {r['us']:.1f} | "
                f"{fa3['us'] / r['us']:.2f}x | {fd:.1f} + {fc:.1f} = {fd + fc:.1f} | "
                f"{q:.1f} + {d:.1f} + {c:.1f} = {q + d + c:.1f} | "
                f"{fa3['us'] - (fd + fc):.1f} / {r['us'] - (q + d + c):.1f} |")
        assert line in text, line
