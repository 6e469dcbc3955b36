"""The ``fp8_snapmla`` KV-cache format: constants and the scale rule.

One token of one layer is a 656-byte row::

    bytes [  0, 512)  float8_e4m3fn  c_KV / s            (latent content, 512 values)
    bytes [512, 516)  float32        s                   (the token's content scale)
    bytes [516, 528)  zero           padding             (keeps the RoPE part 16-byte aligned)
    bytes [528, 656)  bfloat16       k_pe / s            (RoPE key, 64 values, pre-divided by s)

A cache tensor is ``uint8[num_blocks, PAGE_SIZE, 656]``; slot ``b * PAGE_SIZE + i`` is row ``i``
of block ``b``.  Keeping RoPE in BF16 but in the content's scale domain (paper eq. 6) lets a kernel
accumulate the FP8 content product and the BF16 RoPE product into one FP32 tile and restore both
with the single factor ``s_q * s_k``.

The scale rule (``scale_from_amax``) is the paper's ``amax(|c_KV|) / 448`` with two floors:

* ``amax(|k_pe|) / ROPE_PRESCALED_MAX`` keeps ``|k_pe / s| <= 2**24``, so the pre-divided RoPE
  never overflows BF16 and a 64-term RoPE dot product of two such rows stays far inside FP32,
  even for rows whose content is zero or tiny next to their RoPE part;
* ``SCALE_FLOOR`` (the smallest normal float32) keeps ``s`` non-zero for all-zero rows.

For ordinary rows (``amax(|k_pe|) < 2**24 / 448 * amax(|c_KV|)``) the result is exactly
``amax(|c_KV|) / 448``.  The same rule quantizes queries, per (token, head).

Decode quantizes the fused probabilities ``P' = exp(logit - m) * s`` of each 64-token block with a
dynamic scale ``sigma_P = amax(P') / 448`` (paper §3.2).  We floor ``amax(P')`` at
``P_SCALE_RANGE`` times the largest ``P'`` seen so far (rescaled to the current running max).
Without that floor, a block whose probabilities underflow next to an earlier peak (logit gaps of
~80 nats, e.g. behind an attention sink) shrinks ``sigma_P`` so far that the rescaled accumulator
overflows FP32.  Tokens below 2**-32 of the peak are under FP32 resolution of the result anyway,
so the floor changes nothing measurable in ordinary attention.
"""

PAGE_SIZE = 64            # tokens per KV block; the decode kernels quantize P per 64-token block
KV_LORA_RANK = 512        # latent content width (DeepSeek-V2/V3, Kimi-K2, LongCat-Flash)
ROPE_DIM = 64             # decoupled RoPE key width
HEAD_SIZE = KV_LORA_RANK + ROPE_DIM   # 576: the width vLLM passes around for MLA

CONTENT_OFFSET = 0
SCALE_OFFSET = 512
PAD_OFFSET = 516
ROPE_OFFSET = 528
BYTES_PER_TOKEN = 656

FP8_MAX = 448.0                   # largest finite float8_e4m3fn
ROPE_PRESCALED_MAX = 2.0 ** 24    # bound on |k_pe / s| and |q_pe / s_q|
SCALE_FLOOR = 2.0 ** -126         # smallest normal float32
P_SCALE_FLOOR = 2.0 ** -126       # floor on a probability block's amax before dividing by 448
P_SCALE_RANGE = 2.0 ** -32        # a block's P scale never drops below this fraction of the peak

KV_CACHE_DTYPE = "fp8_snapmla"    # the --kv-cache-dtype string

assert CONTENT_OFFSET + KV_LORA_RANK == SCALE_OFFSET
assert ROPE_OFFSET + 2 * ROPE_DIM == BYTES_PER_TOKEN
assert ROPE_OFFSET % 16 == 0


def scale_from_amax(amax_content, amax_rope):
    """Per-row scale from the row's content and RoPE absolute maxima (tensors, float32)."""
    import torch

    # Divide by tensors, not Python scalars: on CUDA, PyTorch turns ``x / scalar`` into
    # ``x * (1 / scalar)``, which rounds differently from the kernels' IEEE division.
    c, r = amax_content.float(), amax_rope.float()
    s = torch.maximum(c / torch.full_like(c, FP8_MAX), r / torch.full_like(r, ROPE_PRESCALED_MAX))
    return torch.clamp_min(s, SCALE_FLOOR)
