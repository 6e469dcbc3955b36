"""Bandwidth of the fp8_snapmla data-path kernels against the GPU's own copy bandwidth.

For each op and size: median time (triton.testing.do_bench, or CUDA events without Triton), the
bytes it must read and write, the resulting GB/s and its share of a device-to-device copy measured
in the same run.  Sizes go well past the L2 (50 MB on an H200) so DRAM, not cache, is measured.

    python -m benchmarks.bench_cache_ops --out out/bench_cache_ops.csv
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys

import torch

from vllm_snapmla import format as fmt
from vllm_snapmla._native import native

FLOAT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def median_ms(fn) -> float:
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))
    for _ in range(5):
        fn()
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_case(nbytes: int):
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * nbytes


def kv_inputs(T: int, dtype: torch.dtype):
    # vLLM's layout: kv_c and k_pe are views into one [T, 576] projection output.
    fused = torch.randn(T, fmt.HEAD_SIZE, device="cuda").to(dtype)
    return fused.split([fmt.KV_LORA_RANK, fmt.ROPE_DIM], dim=1)


def quantize_kv_case(T: int, dtype: torch.dtype):
    kv_c, k_pe = kv_inputs(T, dtype)
    out = torch.empty(T, fmt.BYTES_PER_TOKEN, dtype=torch.uint8, device="cuda")
    C = native()
    nbytes = T * (fmt.HEAD_SIZE * kv_c.element_size() + fmt.BYTES_PER_TOKEN)
    return (lambda: C.quantize_kv(kv_c, k_pe, out)), nbytes


def append_kv_case(T: int, dtype: torch.dtype):
    kv_c, k_pe = kv_inputs(T, dtype)
    blocks = -(-T // fmt.PAGE_SIZE)
    cache = torch.empty(blocks, fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN, dtype=torch.uint8,
                        device="cuda")
    # Tokens fill pages in order; the pages themselves are scattered, as vLLM allocates them.
    page = torch.randperm(blocks, device="cuda")
    pos = torch.arange(T, device="cuda")
    slots = page[pos // fmt.PAGE_SIZE] * fmt.PAGE_SIZE + pos % fmt.PAGE_SIZE
    C = native()
    nbytes = T * (fmt.HEAD_SIZE * kv_c.element_size() + fmt.BYTES_PER_TOKEN + slots.element_size())
    return (lambda: C.append_kv(kv_c, k_pe, cache, slots)), nbytes


def gather_kv_case(T: int, dtype: torch.dtype, num_seqs: int = 8):
    per_seq = -(-T // num_seqs)
    pages = -(-per_seq // fmt.PAGE_SIZE)
    blocks = num_seqs * pages
    cache = torch.randint(0, 120, (blocks, fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN), dtype=torch.uint8,
                          device="cuda")
    cache[..., fmt.SCALE_OFFSET:fmt.PAD_OFFSET] = torch.tensor(
        [0, 0, 0x80, 0x3F], dtype=torch.uint8, device="cuda")            # scale 1.0
    block_table = torch.randperm(blocks, device="cuda").int().view(num_seqs, pages)
    lens = torch.full((num_seqs,), per_seq, dtype=torch.int32, device="cuda")
    lens[-1] = T - per_seq * (num_seqs - 1)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32, device="cuda")
    cu[1:] = lens.cumsum(0)
    token_to_seq = torch.repeat_interleave(torch.arange(num_seqs, device="cuda"), lens).int()
    dst = torch.empty(T, fmt.HEAD_SIZE, dtype=dtype, device="cuda")
    C = native()
    nbytes = T * (fmt.BYTES_PER_TOKEN + fmt.HEAD_SIZE * dst.element_size() + 4)
    return (lambda: C.gather_kv(cache, dst, block_table, cu, token_to_seq, T, None)), nbytes


def quantize_q_case(T: int, dtype: torch.dtype, heads: int = 128):
    # q_nope as vLLM hands it over: the [H, T, 512] bmm output transposed to [T, H, 512].
    q_nope = torch.randn(heads, T, fmt.KV_LORA_RANK, device="cuda").to(dtype).transpose(0, 1)
    q_pe = torch.randn(T, heads, fmt.ROPE_DIM, device="cuda").to(dtype)
    q8 = torch.empty(T, heads, fmt.KV_LORA_RANK, dtype=torch.float8_e4m3fn, device="cuda")
    scale = torch.empty(T, heads, dtype=torch.float32, device="cuda")
    qpe = torch.empty(T, heads, fmt.ROPE_DIM, dtype=torch.bfloat16, device="cuda")
    C = native()
    rows = T * heads
    nbytes = rows * (fmt.HEAD_SIZE * q_pe.element_size() + fmt.KV_LORA_RANK + 4 + 2 * fmt.ROPE_DIM)
    return (lambda: C.quantize_q(q_nope, q_pe, q8, scale, qpe)), nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="CSV file to write")
    p.add_argument("--tokens", default="65536,1048576,4194304",
                   help="token counts for quantize_kv / append_kv / gather_kv")
    p.add_argument("--q-tokens", default="64,1024,8192",
                   help="token counts for quantize_q (x 128 heads)")
    p.add_argument("--dtypes", default="bf16,fp16,fp32", help="input / output dtypes")
    p.add_argument("--copy-bytes", type=int, default=4 << 30, help="size of the reference copy")
    args = p.parse_args()

    if not torch.cuda.is_available():
        sys.exit("bench_cache_ops needs a CUDA GPU")
    if native() is None:
        sys.exit("the native extension vllm_snapmla._C is not built")
    tokens = [int(x) for x in args.tokens.split(",") if x]
    q_tokens = [int(x) for x in args.q_tokens.split(",") if x]
    dtypes = [d for d in args.dtypes.split(",") if d]
    log(f"device: {torch.cuda.get_device_name()}")

    log(f"copy: {args.copy_bytes / 2**30:.1f} GiB device-to-device ...")
    fn, nbytes = copy_case(args.copy_bytes)
    copy_gbps = nbytes / median_ms(fn) / 1e6
    del fn
    torch.cuda.empty_cache()
    log(f"copy: {copy_gbps:.0f} GB/s (read + written)")

    plan = []
    for d in dtypes:
        for T in tokens:
            plan += [("quantize_kv", d, T, quantize_kv_case), ("append_kv", d, T, append_kv_case),
                     ("gather_kv", d, T, gather_kv_case)]
        for T in q_tokens:
            plan.append(("quantize_q", d, T, quantize_q_case))

    rows = [{"op": "copy", "dtype": "uint8", "tokens": 0, "bytes": nbytes,
             "time_us": nbytes / copy_gbps / 1e3, "GB/s": copy_gbps, "pct_of_copy": 100.0}]
    for i, (name, d, T, make) in enumerate(plan, 1):
        log(f"[{i}/{len(plan)}] {name} {d} T={T} ...")
        fn, nbytes = make(T, FLOAT_DTYPES[d])
        ms = median_ms(fn)
        del fn
        torch.cuda.empty_cache()
        gbps = nbytes / ms / 1e6
        rows.append({"op": name, "dtype": d, "tokens": T, "bytes": nbytes, "time_us": ms * 1e3,
                     "GB/s": gbps, "pct_of_copy": 100.0 * gbps / copy_gbps})
        log(f"    {ms * 1e3:10.1f} us  {gbps:7.0f} GB/s  {100 * gbps / copy_gbps:5.1f}% of copy")

    header = f"{'op':<12} {'dtype':<6} {'tokens':>9} {'MB moved':>10} {'time us':>10} " \
             f"{'GB/s':>8} {'% copy':>7}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['op']:<12} {r['dtype']:<6} {r['tokens']:>9} {r['bytes'] / 1e6:>10.1f} "
              f"{r['time_us']:>10.1f} {r['GB/s']:>8.0f} {r['pct_of_copy']:>6.1f}%")
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
