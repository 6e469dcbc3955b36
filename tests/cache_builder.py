"""Random paged fp8_snapmla caches for tests: shuffled block tables, garbage in every unused byte."""

import torch

from vllm_snapmla import format as fmt
from vllm_snapmla import reference as ref

NAN_F32 = torch.tensor([float("nan")], dtype=torch.float32).view(torch.uint8)


def build_cache(seq_lens, kv=None, gen=None, device="cpu", extra_blocks=3, content_std=1.0,
                rope_std=3.0, kv_dtype=torch.bfloat16):
    """Return ``(cache uint8[nb,64,656], block_table int32[B,max_blocks], kv)``.

    ``kv[b] = (kv_c[n,512], k_pe[n,64])`` are the values written for request ``b`` (random unless
    given).  Every byte not written by ``append_kv`` is random, and every unused row's scale is NaN,
    so a kernel that reads past a request's length produces NaN.  Unused block-table entries point
    at real (other requests') blocks for the same reason.
    """
    gen = gen or torch.Generator().manual_seed(0)
    pages = [(n + fmt.PAGE_SIZE - 1) // fmt.PAGE_SIZE for n in seq_lens]
    nb = sum(pages) + extra_blocks
    cache = torch.randint(0, 256, (nb, fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN), dtype=torch.uint8,
                          generator=gen)
    cache[..., fmt.SCALE_OFFSET:fmt.PAD_OFFSET] = NAN_F32
    perm = torch.randperm(nb, generator=gen)
    width = max(max(pages, default=1), 1)
    block_table = torch.randint(0, nb, (len(seq_lens), width), dtype=torch.int32, generator=gen)
    kv_out, start = [], 0
    for b, n in enumerate(seq_lens):
        block_table[b, :pages[b]] = perm[start:start + pages[b]].int()
        start += pages[b]
        if kv is None:
            kv_c = (torch.randn(n, fmt.KV_LORA_RANK, generator=gen) * content_std).to(kv_dtype)
            k_pe = (torch.randn(n, fmt.ROPE_DIM, generator=gen) * rope_std).to(kv_dtype)
        else:
            kv_c, k_pe = kv[b]
        slots = (block_table[b, :pages[b]].long()[:, None] * fmt.PAGE_SIZE
                 + torch.arange(fmt.PAGE_SIZE)).flatten()[:n]
        ref.append_kv(kv_c, k_pe, cache, slots)
        kv_out.append((kv_c, k_pe))
    cache = cache.to(device)
    return cache, block_table.to(device), kv_out
