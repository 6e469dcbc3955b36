"""Where each KV-cache format starts to lose: the tiny model at growing RoPE-key ranges.

    python -m eval.value_range_sweep --model CKPT --out DIR [--targets 10 100 1000 10000]
        [--dtypes auto,fp8_snapmla,fp8,fp8-calibrated] [-- PARITY_TINY_OPTIONS...]

For each target RoPE abs-max, ``eval.reparametrize_rope`` gives the checkpoint that range
without changing its function (power-of-two rescaling of RoPE channel groups, logits
bit-identical in BF16), then ``eval.parity_tiny`` runs it in vLLM for every setting: perplexity
over cache-read context with the paired standard error against BF16, greedy continuations.
The unmodified checkpoint is the first point.  Needs a CUDA GPU with FP8 and vLLM 0.26.0 (each
parity run in its own process); finished points are reused, so an interrupted sweep resumes.

Writes to ``--out``: ``sweep.csv`` and ``sweep.md`` (one row per point and setting: the
measured RoPE and content abs-max, Δppl vs BF16 ± SE, greedy agreement), ``sweep.png`` (Δppl
against RoPE abs-max, one line per setting), and per point the checkpoint and parity report.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import subprocess
import sys

from eval.common import checkpoint_fingerprint, script_command, script_env
from vllm_snapmla import format as fmt

ORIGINAL = "original"


def log(msg: str) -> None:
    print(msg, flush=True)


def point_model(args, target: float | None) -> tuple[str, pathlib.Path, dict]:
    """The checkpoint of one point (made once) and its measured value ranges."""
    if target is None:
        return ORIGINAL, args.model, {}
    name = f"rope{target:g}"
    model = args.out / name / "model"
    report_path = model / "reparametrization.json"
    if report_path.exists():
        made = json.loads(report_path.read_text())
        if pathlib.Path(made["source"]).resolve() != args.model.resolve():
            raise SystemExit(f"{model} was made from {made['source']}, not {args.model}: use "
                             "another --out for another checkpoint")
        if made.get("source_fingerprint") != checkpoint_fingerprint(args.model):
            log(f"[{name}] {args.model} changed since {model} was made from it: remaking it")
            report_path.unlink()
    if not report_path.exists():
        log(f"[{name}] reparametrizing {args.model} to RoPE abs-max {target:g} ...")
        subprocess.run(script_command("eval.reparametrize_rope", "--model", str(args.model),
                                      "--out", str(model), "--rope-absmax", f"{target:g}",
                                      "--seed", str(args.seed)),
                       env=script_env(), check=True)
    return name, model, json.loads(report_path.read_text())


def run_parity(args, name: str, model: pathlib.Path) -> list[dict]:
    out = args.out / name / "parity"
    log(f"[{name}] parity runs ({args.dtypes}) ...")
    subprocess.run(script_command("eval.parity_tiny", "--model", str(model), "--out", str(out),
                                  "--dtypes", args.dtypes, "--no-transformers",
                                  *args.parity_args),
                   env=script_env(), check=True)
    with open(out / "parity_tiny.csv") as f:
        return list(csv.DictReader(f))


def _number(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.value_range_sweep",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=pathlib.Path)
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--targets", type=float, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--dtypes", default="auto,fp8_snapmla,fp8,fp8-calibrated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("parity_args", nargs="*", help="after --: options for eval.parity_tiny")
    args = parser.parse_args(argv)
    if "auto" not in args.dtypes.split(","):
        parser.error("--dtypes must include auto (the baseline of every point)")
    args.out.mkdir(parents=True, exist_ok=True)

    rows, trained_ranges = [], {}
    for target in [None, *args.targets]:
        name, model, report = point_model(args, target)
        layers = report.get("layers", [])
        rope = max((l["after"]["rope_absmax"] for l in layers), default=None)
        content = max((l["after"]["content_absmax"] for l in layers), default=None)
        if layers:   # each report also measured the unmodified checkpoint ("before")
            trained_ranges = {"rope_absmax": max(l["before"]["rope_absmax"] for l in layers),
                              "content_absmax": max(l["before"]["content_absmax"]
                                                    for l in layers)}
        for row in run_parity(args, name, model):
            rows.append({"point": name, "target_rope_absmax": target or "",
                         "rope_absmax": rope if rope is not None else "",
                         "content_absmax": content if content is not None else "",
                         **{k: row.get(k, "") for k in (
                             "run", "ppl_cache_context", "ppl_delta_pct", "dnll_vs_bf16",
                             "dnll_vs_bf16_se", "greedy_identical",
                             "greedy_mean_common_prefix")}})
    for row in rows:
        if row["point"] == ORIGINAL and trained_ranges:
            row.update(trained_ranges)
    with open(args.out / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| point | RoPE abs-max | setting | ppl | Δppl vs BF16 | greedy identical |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        delta = _number(r["ppl_delta_pct"])
        lines.append(f"| {r['point']} | {r['rope_absmax'] or 'as trained'} | {r['run']} | "
                     f"{float(r['ppl_cache_context']):.4f} | "
                     f"{'' if delta is None else f'{delta:+.3f}%'} | {r['greedy_identical']} |")
    (args.out / "sweep.md").write_text("\n".join(lines) + "\n")
    plot(rows, args.out / "sweep.png")
    log(f"wrote {args.out / 'sweep.md'}, sweep.csv, sweep.png")


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """Δppl vs BF16 (± 2 paired SE) against each point's measured RoPE-key abs-max."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def x_of(r):
        return _number(r["rope_absmax"]) or _number(r["target_rope_absmax"]) or 1.0

    def pct(nats):
        return 100.0 * math.expm1(nats)

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for run in dict.fromkeys(r["run"] for r in rows):
        if run == "auto":
            continue
        pts = sorted((x_of(r), _number(r["ppl_delta_pct"]), _number(r.get("dnll_vs_bf16")),
                      _number(r.get("dnll_vs_bf16_se"))) for r in rows
                     if r["run"] == run and _number(r["ppl_delta_pct"]) is not None)
        if not pts:
            continue
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        line, = ax.plot(xs, ys, "o-", label=run)
        for x, _, mean, se in pts:
            if mean is not None and se is not None and not math.isnan(se):
                ax.plot([x, x], [pct(mean - 2 * se), pct(mean + 2 * se)], "-",
                        color=line.get_color(), lw=3, alpha=0.35)
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=0.1)
    ax.axhline(0.5, color="grey", ls=":", lw=0.8)
    ax.text(ax.get_xlim()[1], 0.5, "0.5% target ", ha="right", va="bottom", fontsize=8,
            color="grey")
    ax.axvline(fmt.FP8_MAX, color="grey", ls="--", lw=0.8)
    ax.text(fmt.FP8_MAX, ax.get_ylim()[0], f" e4m3 max ({fmt.FP8_MAX:g})", va="bottom",
            fontsize=8, color="grey")
    ax.set_xlabel("RoPE-key abs-max of the cache (largest layer)")
    ax.set_ylabel("Δ perplexity vs BF16 cache (%)")
    ax.set_title("KV-cache formats against the RoPE-key range (bars: ±2 paired SE)")
    if ax.get_legend_handles_labels()[0]:   # only the BF16 baseline ran: nothing to label
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
