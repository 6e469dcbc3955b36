"""``python -m vllm_snapmla.demo``: fp8_snapmla next to BF16 on a tiny DeepSeek-V3.

On a CUDA GPU with FP8 (sm_89+) it writes a tiny DeepSeek-V3 config, runs ``LLM.generate``
with ``kv_cache_dtype="auto"`` and ``"fp8_snapmla"`` (each in its own process, so each gets the
whole GPU), and prints both outputs, whether they match and the KV-cache capacity vLLM
reports.  Without such a GPU it prints the accuracy of the reference SnapMLA algorithm.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import tempfile

import torch

from vllm_snapmla import format as fmt
from vllm_snapmla import reference as ref
from vllm_snapmla.testing import generate_in_subprocess, has_fp8_gpu, write_tiny_deepseek_v3


def gpu_demo(random_weights: bool = False) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 4096, (n,), generator=gen).tolist() for n in (7, 100, 300)]
    load_format = "auto" if random_weights else "dummy"
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_deepseek_v3(pathlib.Path(tmp) / "tiny-deepseek-v3",
                                           random_weights=random_weights))
        print(f"tiny DeepSeek-V3 in {model} (load_format={load_format})")
        results = {}
        for dtype in ("auto", fmt.KV_CACHE_DTYPE):
            print(f"running LLM.generate with kv_cache_dtype={dtype!r} ...", flush=True)
            results[dtype] = generate_in_subprocess(
                {"model": model, "kv_cache_dtype": dtype, "rounds": [prompts],
                 "max_tokens": 16, "llm_kwargs": {"load_format": load_format}})
    for dtype, res in results.items():
        print(f"\nkv_cache_dtype={dtype}: {res['num_gpu_blocks']} blocks x "
              f"{res['block_size']} tokens = {res['kv_cache_tokens']:,} tokens of KV cache "
              f"(vLLM log: {res['log_kv_cache_tokens']})")
        for i, out in enumerate(res["rounds"][0]):
            print(f"  prompt {i} ({len(prompts[i])} tokens) -> {out['token_ids']}")
    base, snap = (results[d]["rounds"][0] for d in ("auto", fmt.KV_CACHE_DTYPE))
    same = sum(a == b for x, y in zip(base, snap)
               for a, b in zip(x["token_ids"], y["token_ids"]))
    total = sum(len(x["token_ids"]) for x in base)
    print(f"\noutputs match: {all(x['token_ids'] == y['token_ids'] for x, y in zip(base, snap))}"
          f" ({same}/{total} tokens equal)")
    ratio = results[fmt.KV_CACHE_DTYPE]["kv_cache_tokens"] / results["auto"]["kv_cache_tokens"]
    print(f"KV-cache capacity fp8_snapmla / bf16: {ratio:.3f}x "
          f"(bytes per token and layer: {2 * fmt.HEAD_SIZE} -> {fmt.BYTES_PER_TOKEN}, ideal "
          f"{2 * fmt.HEAD_SIZE / fmt.BYTES_PER_TOKEN:.3f}x)")
    if not random_weights:
        print("(dummy weights barely let attention move the logits: matching outputs show "
              "that the path runs, not how accurate it is; try --random-weights)")
    else:
        print("(random weights put many tokens within hundredths of a nat of each other, so "
              "greedy outputs may part at a near-tie; tests/e2e quantifies the agreement)")


def _rel_l2(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double() - y.double()).norm() / y.double().norm())


def cpu_report() -> None:
    gen = torch.Generator().manual_seed(0)
    print("No CUDA GPU with FP8 (sm_89+) here: the SnapMLA kernels and the vLLM run need one.\n"
          "Accuracy of the reference SnapMLA algorithm (vllm_snapmla.reference) instead:\n")

    kv_c = torch.randn(4096, fmt.KV_LORA_RANK, generator=gen).to(torch.bfloat16)
    k_pe = (3 * torch.randn(4096, fmt.ROPE_DIM, generator=gen)).to(torch.bfloat16)
    c, r = ref.dequantize_kv(ref.quantize_kv(kv_c, k_pe))
    print(f"format round trip (4096 tokens): content rel-L2 {_rel_l2(c, kv_c):.2e}, "
          f"RoPE rel-L2 {_rel_l2(r, k_pe):.2e}\n")

    print(f"{'batch':>5} {'heads':>5} {'seq_len':>8} | {'vs exact fp64':>14} "
          f"{'vs fp64 on dequant. cache':>26} {'lse max abs err':>16}")
    for B, H, n in ((1, 16, 64), (2, 16, 300), (4, 16, 1000), (1, 128, 2048)):
        seq_lens = torch.randint(max(1, n // 2), n + 1, (B,), generator=gen)
        seq_lens[0] = n
        pages = [(int(s) + fmt.PAGE_SIZE - 1) // fmt.PAGE_SIZE for s in seq_lens]
        cache = torch.zeros(sum(pages), fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN, dtype=torch.uint8)
        block_table = torch.zeros(B, max(pages), dtype=torch.int32)
        order = torch.randperm(sum(pages), generator=gen)
        kv, start = [], 0
        for b, s in enumerate(seq_lens.tolist()):
            block_table[b, :pages[b]] = order[start:start + pages[b]].int()
            start += pages[b]
            kv_c = torch.randn(s, fmt.KV_LORA_RANK, generator=gen).to(torch.bfloat16)
            k_pe = (3 * torch.randn(s, fmt.ROPE_DIM, generator=gen)).to(torch.bfloat16)
            slots = (block_table[b, :pages[b]].long()[:, None] * fmt.PAGE_SIZE
                     + torch.arange(fmt.PAGE_SIZE)).flatten()[:s]
            ref.append_kv(kv_c, k_pe, cache, slots)
            kv.append((kv_c.double(), k_pe.double()))
        q_nope = torch.randn(B, 1, H, fmt.KV_LORA_RANK, generator=gen).to(torch.bfloat16)
        q_pe = (3 * torch.randn(B, 1, H, fmt.ROPE_DIM, generator=gen)).to(torch.bfloat16)
        scale = 1.0 / math.sqrt(192)
        out, lse = ref.decode(q_nope, q_pe, cache, block_table, seq_lens.int(), scale)
        out_dq, _ = ref.decode(q_nope, q_pe, cache, block_table, seq_lens.int(), scale,
                               exact=True)
        truth, truth_lse = [], []
        for b, (kc, kp) in enumerate(kv):
            logits = (q_nope[b, 0].double() @ kc.T + q_pe[b, 0].double() @ kp.T) * scale
            truth.append(torch.softmax(logits, -1) @ kc)
            truth_lse.append(torch.logsumexp(logits, -1))
        truth = torch.stack(truth)[:, None]
        truth_lse = torch.stack(truth_lse)[:, :, None]
        print(f"{B:>5} {H:>5} {n:>8} | {_rel_l2(out, truth):>14.2e} "
              f"{_rel_l2(out, out_dq):>26.2e} {float((lse - truth_lse).abs().max()):>16.2e}")
    print("\n(rel-L2 of the attention output; 'exact fp64' attends over the original BF16 "
          "K/V, the second column isolates the FP8 query and probability quantization)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--random-weights", action="store_true",
                        help="write random weights of trained-model scale instead of "
                             "load_format=dummy (GPU run only)")
    args = parser.parse_args(argv)
    if has_fp8_gpu():
        gpu_demo(args.random_weights)
    else:
        cpu_report()


if __name__ == "__main__":
    main()
