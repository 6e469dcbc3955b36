// The split planner (alone) and the combine of split-KV decode (split_kv.h).
#include <cuda_bf16.h>

#include <cmath>

#include "dependent_launch.h"
#include "split_kv.h"

namespace snapmla {
namespace {

__global__ void __launch_bounds__(32) split_plan_kernel(const SplitPlanParams p) {
  allow_dependent_launch();   // the decode kernel after it is a dependent launch
  plan_splits_warp(p, threadIdx.x);
}

constexpr int kCombineRowsPerBlock = 4;   // one warp per query row
constexpr int kColsPerLane = kKvLoraRank / 32;   // 16: four float4 per lane

// One warp merges one query row of one request: weights exp(lse_s - max) over the request's
// runs, skipping splits that saw nothing (their output was never written).
__global__ void __launch_bounds__(32 * kCombineRowsPerBlock) combine_kernel(const CombineParams p) {
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kCombineRowsPerBlock + threadIdx.x / 32;
  const int b = blockIdx.y;
  if (row >= p.num_rows) return;
  const int chunk = p.pages_per_split != nullptr ? *p.pages_per_split : 0;
  const int runs =
      split_range(p.seq_lens[b], p.table_pages, chunk, p.max_splits, 0).num_splits;
  if (runs == 1) return;   // the decode kernel wrote it directly

  const int64_t first = (static_cast<int64_t>(b) * p.max_splits) * p.num_rows + row;
  float m = -INFINITY;
  for (int s = lane; s < runs; s += 32) m = fmaxf(m, p.part_lse[first + int64_t(s) * p.num_rows]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const float m_ref = m == -INFINITY ? 0.f : m;

  float acc[kColsPerLane] = {};
  float total = 0.f;
  for (int s = 0; s < runs; ++s) {
    const int64_t part_row = first + int64_t(s) * p.num_rows;
    const float w = expf(p.part_lse[part_row] - m_ref);
    total += w;
    if (w == 0.f) continue;
    const float4* src = reinterpret_cast<const float4*>(p.part_out + part_row * kKvLoraRank);
#pragma unroll
    for (int j = 0; j < kColsPerLane / 4; ++j) {
      const float4 v = src[j * 32 + lane];
      acc[4 * j] += w * v.x;
      acc[4 * j + 1] += w * v.y;
      acc[4 * j + 2] += w * v.z;
      acc[4 * j + 3] += w * v.w;
    }
  }
  // A NaN partial (non-finite inputs, an invalid request) makes the total NaN: NaN out, not 0.
  const bool seen_any = !(total == 0.f);
  const float inv = seen_any ? 1.f / total : 0.f;
  const int64_t out_row = static_cast<int64_t>(b) * p.num_rows + row;
  __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.out) +
                                                          out_row * kKvLoraRank);
#pragma unroll
  for (int j = 0; j < kColsPerLane / 4; ++j) {
    const int col = 4 * (j * 32 + lane);
    dst[col / 2] = __floats2bfloat162_rn(acc[4 * j] * inv, acc[4 * j + 1] * inv);
    dst[col / 2 + 1] = __floats2bfloat162_rn(acc[4 * j + 2] * inv, acc[4 * j + 3] * inv);
  }
  if (lane == 0) {
    p.lse[(static_cast<int64_t>(b) * p.num_heads + row % p.num_heads) * p.s_q + row / p.num_heads] =
        seen_any ? m + logf(total) : -INFINITY;
  }
}

}  // namespace

cudaError_t launch_split_plan(const SplitPlanParams& params, cudaStream_t stream) {
  split_plan_kernel<<<1, 32, 0, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t launch_combine(const CombineParams& params, cudaStream_t stream) {
  if (params.batch == 0 || params.num_rows == 0) return cudaSuccess;
  const dim3 grid((params.num_rows + kCombineRowsPerBlock - 1) / kCombineRowsPerBlock,
                  params.batch);
  combine_kernel<<<grid, 32 * kCombineRowsPerBlock, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace snapmla
