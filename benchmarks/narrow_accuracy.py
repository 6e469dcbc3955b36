"""Error of the narrow sm90 kernel against the CPU reference of the same algorithm, beside the
64-row kernel's (split-roles) on the same inputs: several seeds of a sharp softmax (q_std 8,
where the FP8 QK accumulation shows most) and of plain N(0,1) data, for each (H, s_q) asked for
(default: 16 x 1 for the 16-row form, 32 x 1 and 16 x 2 for the 32-row form).

    python -m benchmarks.narrow_accuracy [--seeds 6] [--shapes 16x1 32x1 16x2]
"""

import argparse

import torch

from vllm_snapmla import format as fmt
from vllm_snapmla import reference as ref
from vllm_snapmla.kernels import sm90
from vllm_snapmla.testing import build_cache

SCALE = 0.1147   # DeepSeek-V3's 1/sqrt(192) times its YaRN mscale, roughly


def _case(seq_lens, H, s_q, seed, q_std):
    """A paged cache (unused bytes random, unused scales NaN) and a bf16 query, on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    cache, bt, _ = build_cache(seq_lens, gen=gen)
    B = len(seq_lens)
    q = (torch.randn(B, s_q, H, fmt.KV_LORA_RANK, generator=gen) * q_std).bfloat16()
    qp = (torch.randn(B, s_q, H, fmt.ROPE_DIM, generator=gen) * q_std).bfloat16()
    return (q.cuda(), qp.cuda(), cache.cuda(), bt.cuda(),
            torch.tensor(seq_lens, dtype=torch.int32).cuda())


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-300)).item()


def errors(out, lse, r_out, r_lse):
    seen = ~torch.isneginf(r_lse)
    return (lse.double() - r_lse)[seen].abs().max().item(), _rel(out, r_out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--shapes", nargs="+", default=["16x1", "32x1", "16x2"],
                        help="HxS_Q: heads x query tokens per request")
    args = parser.parse_args()
    try:
        shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes]
    except ValueError:
        parser.error(f"--shapes wants HxS_Q items such as 16x2, got {args.shapes}")
    for H, s_q in shapes:
        if not 1 <= H * s_q <= sm90.NARROW_MAX_ROWS:
            parser.error(f"{H}x{s_q}: the narrow kernel takes 1-{sm90.NARROW_MAX_ROWS} rows")
    print("| H x s_q | data | seed | narrow LSE err | split-roles LSE err | narrow rel-L2 | "
          "split-roles rel-L2 |\n|---|---|---|---|---|---|---|")
    for (H, s_q), (q_std, seq_lens) in ((hs, case) for hs in shapes
                                        for case in ((8.0, [3000, 200]), (1.0, [5000, 64, 1]))):
        for seed in range(args.seeds):
            q, qp, cache, bt, sl = _case(seq_lens, H, s_q, seed=100 + seed, q_std=q_std)
            q8, qs, qpe = ref.quantize_q(q, qp)
            r_out, r_lse = ref.decode_quantized(q8, qs, qpe, cache, bt, sl, SCALE, True)
            res = {}
            for schedule in ("narrow", "split-roles"):
                out, lse = sm90.snapmla_decode_sm90(q8, qs, qpe, cache, bt, sl, SCALE,
                                                    num_splits=3, schedule=schedule)
                res[schedule] = errors(out, lse, r_out, r_lse)
            print(f"| {H} x {s_q} | q_std {q_std} | {seed} | {res['narrow'][0]:.2e} | "
                  f"{res['split-roles'][0]:.2e} | {res['narrow'][1]:.2e} | "
                  f"{res['split-roles'][1]:.2e} |", flush=True)


if __name__ == "__main__":
    main()
