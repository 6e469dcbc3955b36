"""The split planner against every cut: ops.decode timed with each run length it could choose.

    python -m tools.plan_sweep --out plan_sweep.csv [--shapes 8x16x512 64x128x512 ...]
        [--table-width 2560]

Per shape (B requests x H heads x N tokens each, one query token), ``ops.decode`` runs with:

- ``step``: the plan ``ops.plan_decode`` makes, as vLLM's metadata builder does once per step;
- ``run_R``: the plan forced to runs of R pages, R = 1, 2, 4, ... raised to the shortest run the
  launch's grid allows (``max_splits`` splits per request: ``splits.split_range`` raises a plan
  below ceil(pages / max_splits) to that), up to one run per request (the combine is then
  launched and merges nothing);
- ``no_split``: ``num_splits=1``, a grid of one split per request and no combine launch, which a
  captured vLLM graph cannot take (its grid must allow for long requests).

Each time is the median of CUDA-graph replays with the L2 flushed before each (triton's
``do_bench``), on the inputs ``benchmarks/bench_decode.py`` makes and as it times, in µs; every
forced cut's output is checked against the step plan's.  It tells whether the planner's cost model
(``csrc/split_kv.h``, ``kernels/splits.py``) picks the fastest cut on this GPU.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks import bench_decode
from benchmarks.provenance import describe, run_info
from benchmarks.vllm_engine import write_csv
from vllm_snapmla import format as fmt, ops
from vllm_snapmla.kernels import sm90

# 1-64 requests of 512-8k tokens: where a decode call is short and a cut's fixed costs show.
SHAPES = [(1, 16, 512), (8, 16, 512), (64, 16, 512), (1, 16, 2048), (8, 16, 2048),
          (1, 16, 8192), (8, 16, 8192), (64, 16, 2048),
          (1, 128, 512), (8, 128, 512), (64, 128, 512), (1, 128, 2048), (8, 128, 2048),
          (1, 128, 8192), (4, 128, 4096)]
# The largest difference from the step plan's output a forced plan may show (bf16 outputs of
# unit-variance data; only the order of the split merges differs).
MAX_CUT_DIFFERENCE = 0.05


def parse_shape(text: str) -> tuple[int, int, int]:
    """``BxHxN`` as (B, H, N): ``bench_decode``'s shapes, one query token."""
    if text.lower().count("x") != 2:
        raise argparse.ArgumentTypeError(f"a shape is BxHxN (one query token), got {text!r}")
    B, H, N, _ = bench_decode.parse_shape(text)
    return B, H, N


def run_lengths(pages: int, max_splits: int) -> list[int]:
    """The run lengths to force for a request of ``pages`` pages in a grid of ``max_splits``
    splits: the powers of two, each raised to the shortest run the grid allows
    (ceil(pages / max_splits)) and cut to ``pages``, without repeats; the last is one run."""
    shortest = -(-pages // max_splits)
    out, power = [], 1
    while not out or out[-1] < pages:
        run = min(max(power, shortest), pages)
        if run not in out:
            out.append(run)
        power *= 2
    return out


def _graph_us(call) -> float:
    """Median µs of CUDA-graph replays of ``call`` with the L2 flushed, as bench_decode times."""
    return bench_decode._time(call, rep=200, warmup=25, eager=False)


def sweep_shape(B: int, H: int, N: int, table_width: int) -> dict:
    """One shape's times (µs, rounded to ns) by plan, on ``bench_decode``'s inputs for it: random
    data in a fresh cache, a shuffled table as wide as vLLM's, zero past a request's pages."""
    pages = -(-N // fmt.PAGE_SIZE)
    if pages > table_width:
        raise ValueError(f"{N} tokens need {pages} pages, more than --table-width {table_width}")
    inputs = bench_decode.make_inputs(B, H, N, 1, bench_decode._shape_generator(B, H, N, 1),
                                      table_width=table_width)
    q_nope, q_pe, cache = inputs["q_nope"], inputs["q_pe"], inputs["snap"]
    table, lens = inputs["block_table"], inputs["seq_lens"]
    dev = lens.device
    scale = fmt.HEAD_SIZE ** -0.5
    step = ops.plan_decode(lens, table, H)
    expected, _ = ops.decode(q_nope, q_pe, cache, table, lens, scale, plan=step)
    row = {"B": B, "H": H, "N": N, "table_width": table_width,
           "step_pages_per_split": int(step.item()),
           "step_us": round(_graph_us(lambda: ops.decode(q_nope, q_pe, cache, table, lens,
                                                         scale, plan=step)), 3)}

    def checked(name, call):
        out, _ = call()
        difference = (out.float() - expected.float()).abs().max().item()
        if not difference <= MAX_CUT_DIFFERENCE:
            raise AssertionError(f"{B}x{H}x{N} {name}: output differs from the step plan's by "
                                 f"{difference}")
        row[f"{name}_us"] = round(_graph_us(call), 3)

    slots = torch.cuda.get_device_properties(dev).multi_processor_count
    for run in run_lengths(pages, sm90.launch_max_splits(B, H, table_width, slots)):
        forced = torch.full((1,), run, dtype=torch.int32, device=dev)
        checked(f"run_{run}", lambda forced=forced: ops.decode(q_nope, q_pe, cache, table, lens,
                                                                scale, plan=forced))
    checked("no_split", lambda: sm90.decode_sm90(q_nope, q_pe, cache, table, lens, scale, True,
                                                 num_splits=1))
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="CSV to write")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=SHAPES,
                        metavar="BxHxN")
    parser.add_argument("--table-width", type=int, default=2560, metavar="PAGES",
                        help="block-table columns (vLLM's: max_model_len / 64)")
    args = parser.parse_args(argv)
    if not (torch.cuda.is_available() and sm90.available()
            and ops.decode_kernel("cuda") == "sm90"):
        parser.error("needs an sm_90 GPU, the extension's Hopper kernels, and ops.decode using "
                     "them (not SNAPMLA_DECODE_KERNEL=triton)")
    info = run_info("tools.plan_sweep", argv)
    torch.manual_seed(0)
    rows = []
    for B, H, N in args.shapes:
        row = sweep_shape(B, H, N, args.table_width)
        rows.append(row)
        runs = {k: v for k, v in row.items() if k.startswith("run_")}
        best = min(runs, key=runs.get)
        print(f"{B} x {H} x {N}: step plan {row['step_pages_per_split']} pages per split "
              f"{row['step_us']:.1f} us; fastest forced {best[:-3]} {runs[best]:.1f} us; "
              f"no split {row['no_split_us']:.1f} us", flush=True)
    run_fields = sorted({k for row in rows for k in row if k.startswith("run_")},
                        key=lambda k: int(k.split("_")[1]))
    fields = ["B", "H", "N", "table_width", "step_pages_per_split", "step_us", *run_fields,
              "no_split_us"]
    write_csv(rows, Path(args.out), fields, comments=[describe(info)])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
