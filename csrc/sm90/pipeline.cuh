// What both sm_90a decode kernels (decode_kernel.cuh, decode_narrow_kernel.cuh) do the same
// way: the pages a CTA decodes, the producer thread's TMA page stream, the query staged into
// swizzled WGMMA tiles, and the scale and row-sum conventions of invalid requests and null
// blocks.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "sm90/config.h"
#include "sm90/decode.h"
#include "sm90/ptx.h"
#include "split_kv.h"

namespace snapmla::sm90 {

#ifdef SNAPMLA_SM90_DEVICE
namespace device {

// The pages a CTA decodes, [first_page, first_page + num_iters) of request b (split_kv.h), and
// whether they are the request's only run, whose result is then final (`direct`).  An invalid
// request (its length does not fit its table row) reads nothing and comes out NaN.
struct SplitPages {
  int seq_len, first_page, num_iters;
  bool direct, valid;
};

__device__ __forceinline__ SplitPages split_pages(const DecodeParams& p, int b, int split) {
  const int seq_len = p.seq_lens[b];
  const int chunk = p.pages_per_split != nullptr ? *p.pages_per_split : 0;
  const SplitRange r = split_range(seq_len, p.table_pages, chunk, p.max_splits, split);
  return {seq_len, r.first_page, r.num_pages, r.num_splits == 1, r.valid};
}

// The row sum a row starts from: 0, or NaN for an invalid request, which the epilogue's
// out = O / l and lse = m + log(l) carry into every output of the request.
__device__ __forceinline__ float initial_row_sum(bool valid) {
  return valid ? 0.f : __int_as_float(0x7fc00000);
}

// A live token's scale as the softmax uses it.  Every scale the cache format writes is positive
// (at least format.h's kScaleFloor).  A zero is a zero-filled row, such as vLLM's never-written
// null block 0 that dummy and padded requests point at: it reads as a zero token (logit 0,
// value 0), as in a BF16 cache.  NaN (what TMA fills in for a block id outside the cache) or a
// negative scale is not a cache row: NaN, so that the output shows it.
__device__ __forceinline__ float checked_scale(float s) {
  return s >= 0.f ? s : __int_as_float(0x7fc00000);
}

// The producer thread: the split's pages (`pages`, block numbers) in order into a ring of kRing
// stages (stage s at `stages` + s kStageBytes), each once the consumers have released its stage:
// four 64x128 e4m3 content boxes, one 64x64 bf16 RoPE box and the scales, on the stage's full
// barrier.  A fresh barrier counts as having completed the phase before phase 0: the first pass
// over the ring does not wait.
template <int kRing>
__device__ __forceinline__ void produce_pages(const CUtensorMap* content_map,
                                              const CUtensorMap* rope_map,
                                              const CUtensorMap* scale_map, const int32_t* pages,
                                              int num_iters, uint32_t stages, uint32_t full_bar,
                                              uint32_t empty_bar) {
  prefetch_tensor_map(content_map);
  prefetch_tensor_map(rope_map);
  prefetch_tensor_map(scale_map);
  for (int i = 0; i < num_iters; ++i) {
    const int stage = i % kRing;
    mbar_wait(empty_bar + 8 * stage, ((i / kRing) & 1) ^ 1);
    const int32_t block = pages[i];
    const uint32_t dst = stages + stage * kStageBytes;
    const uint32_t bar = full_bar + 8 * stage;
    mbar_arrive_expect_tx(bar, kStageTxBytes);
#pragma unroll
    for (int t = 0; t < kContentTiles; ++t) {
      tma_load_page(dst + kStageContent + t * kContentTileBytes, content_map, bar,
                    t * kSwizzleRowBytes, block);
    }
    tma_load_page(dst + kStageRope, rope_map, bar, 0, block);
    tma_load_page(dst + kStageScale, scale_map, bar, 0, block);
  }
}

// The producer warpgroup of either kernel: it gives its registers to the consumers
// (setmaxnreg), and its thread `producer` streams the split's pages into the kRing-stage ring
// at `stages`.
template <int kRing>
__device__ __forceinline__ void run_producer_warpgroup(const CUtensorMap& content_map,
                                                       const CUtensorMap& rope_map,
                                                       const CUtensorMap& scale_map,
                                                       const DecodeParams& p, int b,
                                                       int first_page, int num_iters,
                                                       uint32_t stages, uint32_t full_bar,
                                                       uint32_t empty_bar, int producer) {
  setmaxnreg_dec<kProducerRegs>();
  if (threadIdx.x == producer && num_iters > 0) {
    produce_pages<kRing>(&content_map, &rope_map, &scale_map,
                         p.block_table + b * p.block_table_stride + first_page, num_iters,
                         stages, full_bar, empty_bar);
  }
}

// One operand of the query: rows row0 .. row0 + kRows - 1 of request b, each kChunks 16-byte
// chunks of `src` (byte strides over (b, s_q, h)), zeros past num_rows, into the 128-byte-row
// swizzled tiles at `tiles`, `tile_bytes` apart.  Threads tid, tid + nthreads, ... share them.
template <int kRows, int kChunks>
__device__ __forceinline__ void stage_rows(uint8_t* tiles, int tile_bytes, const uint8_t* src,
                                           const int64_t (&stride)[3], const DecodeParams& p,
                                           int b, int row0, int tid, int nthreads) {
  constexpr int kRowChunks = kSwizzleRowBytes / 16;   // 16-byte chunks per tile row
  for (int idx = tid; idx < kRows * kChunks; idx += nthreads) {
    const int r = idx / kChunks;
    const int chunk = idx % kChunks;
    const int g = row0 + r;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (g < p.num_rows) {
      const int qi = g / p.num_heads, qh = g % p.num_heads;
      v = *reinterpret_cast<const uint4*>(src + b * stride[0] + qi * stride[1] +
                                          qh * stride[2] + chunk * 16);
    }
    *reinterpret_cast<uint4*>(tiles + chunk / kRowChunks * tile_bytes +
                              sw128_offset(r, (chunk % kRowChunks) * 16)) = v;
  }
}

// Query rows row0 .. row0 + kRows - 1 of request b (zeros past num_rows) into swizzled WGMMA
// tiles of 128-byte rows: q8 as four [kRows][128] tiles `q8_tile_bytes` apart, q_pe as one.
// Threads tid, tid + nthreads, ... share the 16-byte chunks.
template <int kRows>
__device__ __forceinline__ void stage_query(uint8_t* q8_tiles, int q8_tile_bytes, uint8_t* qpe_tile,
                                            const DecodeParams& p, int b, int row0, int tid,
                                            int nthreads) {
  stage_rows<kRows, kKvLoraRank / 16>(q8_tiles, q8_tile_bytes, p.q8, p.q8_stride, p, b, row0,
                                      tid, nthreads);
  stage_rows<kRows, kSwizzleRowBytes / 16>(qpe_tile, 0, p.q_pe, p.q_pe_stride, p, b, row0, tid,
                                           nthreads);
}

}  // namespace device
#endif  // SNAPMLA_SM90_DEVICE

}  // namespace snapmla::sm90
