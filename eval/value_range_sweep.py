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

from eval.common import script_command, script_env

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

    rows = []
    for target in [None, *args.targets]:
        name, model, report = point_model(args, target)
        layers = report.get("layers", [])
        rope = max((l["after"]["rope_absmax"] for l in layers), default=None)
        content = max((l["after"]["content_absmax"] for l in layers), default=None)
        for row in run_parity(args, name, model):
            rows.append({"point": name, "target_rope_absmax": target or "",
                         "rope_absmax": rope if rope is not None else "",
                         "content_absmax": content if content is not None else "",
                         **{k: row.get(k, "") for k in (
                             "run", "ppl_cache_context", "ppl_delta_pct", "dnll_vs_bf16",
                             "dnll_vs_bf16_se", "greedy_identical",
                             "greedy_mean_common_prefix")}})
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in dict.fromkeys(r["run"] for r in rows):
        if run == "auto":
            continue
        pts = [(_number(r["target_rope_absmax"]) or 1.0, _number(r["ppl_delta_pct"]))
               for r in rows if r["run"] == run and _number(r["ppl_delta_pct"]) is not None]
        if pts:
            ax.plot(*zip(*sorted(pts)), "o-", label=run)
    ax.axhline(0.5, color="grey", ls=":", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_xlabel("RoPE-key abs-max target (1 = as trained)")
    ax.set_ylabel("Δ perplexity vs BF16 cache (%)")
    ax.set_title("KV-cache formats against the RoPE-key range")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
