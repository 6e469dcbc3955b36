"""The kernel calls of a vLLM engine's eager steps, without vLLM, each step under a deadline.

``test_eager_schedule.py`` runs this in a child process, so that a stalled kernel costs the
child, not the test session.  It replays what one ``enforce_eager`` engine does for ``--batch``
requests of ``--context`` tokens over ``--layers`` layers: the chunked prefill (``--chunk``
tokens a step, one request after the other: ``append_kv`` of the chunk and ``gather_kv`` of its
context, 64k tokens at a time, per layer), with the requests already prefilled decoding in the
same step, then ``--decode-steps`` steps of every request.  Each decode step makes its split
plan once (``ops.plan_decode``) for all layers' ``ops.decode``, as vLLM's metadata builder does
(``--route noplan``: each decode plans for itself).  The block table is ``--width`` pages wide
(vLLM's: ``max_model_len / 64``).

A step not finished ``--deadline-s`` after its launch prints ``STALL: ...`` and ends the process
with status 2 (nothing can stop a running kernel; the process's end does); a decode output that
is not finite ends it with status 3.  Otherwise it prints a line per repetition and ``ok``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from vllm_snapmla import format as fmt
from vllm_snapmla import ops

GATHER_TOKENS = 65536   # vLLM's context workspace for chunked prefill (MLA), in tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--width", type=int, default=2054, help="block-table pages")
    parser.add_argument("--pages", type=int, default=25575, help="KV-cache pages")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=16384)
    parser.add_argument("--decode-steps", type=int, default=294)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--route", choices=["plan", "noplan"], default="plan")
    parser.add_argument("--deadline-s", type=float, default=10.0)
    parser.add_argument("--device", default="cuda", help="cpu: the schedule on the reference ops")
    args = parser.parse_args()
    if args.batch * args.width >= args.pages:
        parser.error("the cache must hold every request's table row (and block 0, unused)")
    # The first request also decodes while the others prefill.
    longest = (args.context + (args.batch - 1) * -(-args.context // args.chunk)
               + args.decode_steps)
    if -(-longest // fmt.PAGE_SIZE) > args.width:
        parser.error(f"--width must hold the longest request's {longest} tokens")

    device = torch.device(args.device)
    cache = torch.empty(args.pages, fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN, dtype=torch.uint8,
                        device=device)
    cache.random_(0, 256)   # bytes no request writes: never read
    # Distinct pages for every request's row; block 0 (vLLM's null block) unused.
    table = (torch.randperm(args.pages - 1, device=device)[:args.batch * args.width] + 1) \
        .int().view(args.batch, args.width)
    plan = torch.zeros(1, dtype=torch.int32, device=device)
    finite = torch.ones((), dtype=torch.bool, device=device)
    scale = fmt.HEAD_SIZE ** -0.5

    def finish(what: str, began: float) -> None:
        if device.type != "cuda":
            return
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + args.deadline_s
        while not done.query():
            if time.monotonic() > deadline:
                print(f"STALL: {what} not finished {args.deadline_s:g} s after its launch "
                      f"({time.monotonic() - began:.1f} s into the repetition)", flush=True)
                os._exit(2)
            time.sleep(0.001)

    def decode_step(lens: torch.Tensor, k: int) -> None:
        """The first ``k`` requests' next token: its KV written, then attention."""
        pos = lens[:k].long() - 1
        slots = table[torch.arange(k, device=device), pos // fmt.PAGE_SIZE].long() \
            * fmt.PAGE_SIZE + pos % fmt.PAGE_SIZE
        kv_c = torch.randn(k, fmt.KV_LORA_RANK, device=device, dtype=torch.bfloat16)
        k_pe = torch.randn(k, fmt.ROPE_DIM, device=device, dtype=torch.bfloat16)
        q_nope = torch.randn(k, 1, args.heads, fmt.KV_LORA_RANK, device=device,
                             dtype=torch.bfloat16)
        q_pe = torch.randn(k, 1, args.heads, fmt.ROPE_DIM, device=device, dtype=torch.bfloat16)
        step_plan = (ops.plan_decode(lens[:k], table[:k], args.heads, 1, out=plan)
                     if args.route == "plan" else None)
        for _ in range(args.layers):
            ops.append_kv(kv_c, k_pe, cache, slots)
            out, lse = ops.decode(q_nope, q_pe, cache, table, lens[:k], scale, plan=step_plan)
            finite.logical_and_(torch.isfinite(out).all() & torch.isfinite(lse).all())

    for rep in range(args.reps):
        began = time.monotonic()
        lens = torch.zeros(args.batch, dtype=torch.int32, device=device)
        steps = 0
        for r in range(args.batch):
            for start in range(0, args.context, args.chunk):
                n = min(args.chunk, args.context - start)
                kv_c = torch.randn(n, fmt.KV_LORA_RANK, device=device, dtype=torch.bfloat16)
                k_pe = torch.randn(n, fmt.ROPE_DIM, device=device, dtype=torch.bfloat16)
                pos = torch.arange(start, start + n, device=device)
                slots = table[r, pos // fmt.PAGE_SIZE].long() * fmt.PAGE_SIZE \
                    + pos % fmt.PAGE_SIZE
                # The chunk's context, 64k tokens at a time: the step's metadata, for every layer.
                gathers = [(torch.empty(m, fmt.HEAD_SIZE, device=device, dtype=torch.bfloat16),
                            torch.tensor([0, m], dtype=torch.int32, device=device),
                            torch.zeros(m, dtype=torch.int32, device=device), m,
                            torch.tensor([first], dtype=torch.int32, device=device))
                           for first in range(0, start, GATHER_TOKENS)
                           for m in [min(GATHER_TOKENS, start - first)]]
                for _ in range(args.layers):
                    ops.append_kv(kv_c, k_pe, cache, slots)
                    for dst, cu_seq_lens, token_to_seq, m, seq_starts in gathers:
                        ops.gather_kv(cache, dst, table[r:r + 1], cu_seq_lens, token_to_seq, m,
                                      seq_starts)
                if r:   # the requests already prefilled decode in the same step
                    lens[:r] += 1
                    decode_step(lens, r)
                steps += 1
                finish(f"repetition {rep}, prefill step {steps} ({r} decodes)", began)
            lens[r] = args.context
        for step in range(args.decode_steps):
            lens += 1
            decode_step(lens, args.batch)
            finish(f"repetition {rep}, decode step {step + 1}", began)
        if not bool(finite):
            print(f"NOT FINITE: a decode output of repetition {rep}", flush=True)
            os._exit(3)
        print(f"repetition {rep}: {steps} prefill steps and {args.decode_steps} decode steps in "
              f"{time.monotonic() - began:.2f} s", flush=True)
    print("ok", flush=True)


if __name__ == "__main__":
    main()
