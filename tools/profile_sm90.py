"""One sm90 decode launch per schedule on random data, for Nsight Compute.

    ncu --clock-control none --kernel-name regex:'decode(_narrow)?_kernel' \
        python3 -m tools.profile_sm90
    python3 -m tools.profile_sm90 --time [--distinct-blocks 64]

--time prints each schedule's median time (CUDA events around 50 CUDA-graph replays) instead.
The narrow schedule runs only where a request has at most NARROW_MAX_ROWS (32) query rows.
--distinct-blocks K points every block-table entry at one of K cache blocks, so the pages come
from L2 rather than HBM: if the time per page drops, the kernel waits on its loads.
"""
import argparse
import time

import torch

from vllm_snapmla import format as fmt, ops, reference
from vllm_snapmla.kernels import sm90


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="32,128,16384,1", help="B,H,N,s_q")
    parser.add_argument("--schedules", default="",
                        help="comma-separated (default: every schedule the shape allows)")
    parser.add_argument("--time", action="store_true", help="print median times, no profiling")
    parser.add_argument("--distinct-blocks", type=int, default=0,
                        help="cache blocks the block table cycles over (0: all distinct)")
    args = parser.parse_args()
    B, H, N, s_q = (int(x) for x in args.shape.split(","))
    schedules = [s for s in args.schedules.split(",") if s] or [
        s for s in sm90.SCHEDULES if s != "narrow" or s_q * H <= sm90.NARROW_MAX_ROWS]
    gen = torch.Generator(device="cuda").manual_seed(0)
    pages = -(-N // fmt.PAGE_SIZE)   # every request's N tokens fit its table row
    nb = B * pages
    kv = torch.randn(nb * fmt.PAGE_SIZE, fmt.KV_LORA_RANK, device="cuda", generator=gen)
    pe = torch.randn(nb * fmt.PAGE_SIZE, fmt.ROPE_DIM, device="cuda", generator=gen)
    cache = reference.quantize_kv(kv.bfloat16(), pe.bfloat16()).view(nb, fmt.PAGE_SIZE, -1)
    block_table = torch.randperm(nb, device="cuda", generator=gen).view(B, pages).int()
    if args.distinct_blocks:
        block_table %= args.distinct_blocks
    seq_lens = torch.full((B,), N, dtype=torch.int32, device="cuda")
    q = torch.randn(B, s_q, H, fmt.KV_LORA_RANK, device="cuda", generator=gen).bfloat16()
    q_pe = torch.randn(B, s_q, H, fmt.ROPE_DIM, device="cuda", generator=gen).bfloat16()
    q8, qs, qpe = ops.quantize_q(q, q_pe)
    for schedule in schedules:
        def launch():
            return sm90.snapmla_decode_sm90(q8, qs, qpe, cache, block_table, seq_lens,
                                            fmt.HEAD_SIZE ** -0.5, schedule=schedule)
        launch()
        if args.time:
            # CUDA-graph replays, as in benchmarks/bench_decode.py: timed as eager calls, the
            # Python side of each launch left the GPU idle inside the events (medians varied 2x
            # between repeats).
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                launch()
            # Warm up for ~0.5 s first: timed from idle, the GPU's clocks were still ramping up
            # (3x slower medians).
            start_s = time.perf_counter()
            while time.perf_counter() - start_s < 0.5:
                graph.replay()
                torch.cuda.synchronize()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(50)]
            for start, end in events:
                start.record()
                graph.replay()
                end.record()
            torch.cuda.synchronize()
            us = sorted(1e3 * start.elapsed_time(end) for start, end in events)[len(events) // 2]
            print(f"{schedule:10s} B={B} H={H} N={N} s_q={s_q} distinct_blocks="
                  f"{args.distinct_blocks or nb}: {us:.1f} us, {us * 1e3 / (B * pages):.0f} ns "
                  f"per request page")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
