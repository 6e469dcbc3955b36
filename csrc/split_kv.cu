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

constexpr int kColsPerLane = kKvLoraRank / 32;   // 16: four float4 per lane
// kCombineUnroll, kCombineWideWarps, kCombineWideFrom: split_kv.h.  Where a launch may cut
// requests into many splits, a row's splits are shared by several warps: one warp reading 100+
// splits one after another would wait on memory for each (60 us for one 128k-token request on
// an H100, longer than its decode).  With few splits the wide block's shared-memory sum costs
// more than it saves (8 requests x 128 heads x 8 splits: 9.2 against 6.6 us at max_splits 17),
// hence the threshold.
constexpr int kCombineRowsPerBlock = 4;   // below kCombineWideFrom: a warp per row, four a block

// One warp's share of a row's merge in the wide kernel: the splits warp_in_row, + warps, ... of
// the request's `runs`, weighted exp(lse_s - m_ref).  A split of weight 0 (it saw nothing and
// never wrote its partial, or its weight underflowed) is dropped: what is read there is not
// multiplied, since it may be NaN.  The loads of kCombineUnroll splits are all issued before
// any is used, so a never-written partial is read (allocated memory) and then dropped.
__device__ __forceinline__ void merge_splits(const CombineParams& p, int64_t first, int runs,
                                             float m_ref, int warp_in_row, int warps, int lane,
                                             float (&acc)[kColsPerLane], float& total) {
  for (int s0 = warp_in_row; s0 < runs; s0 += kCombineUnroll * warps) {
    float lse[kCombineUnroll];
    float4 v[kCombineUnroll][kColsPerLane / 4];
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      const int s = s0 + u * warps;
      const int64_t part_row = first + int64_t(s) * p.num_rows;
      const float4* src = reinterpret_cast<const float4*>(p.part_out + part_row * kKvLoraRank);
      lse[u] = s < runs ? p.part_lse[part_row] : -INFINITY;
#pragma unroll
      for (int j = 0; j < kColsPerLane / 4; ++j) {
        v[u][j] = s < runs ? src[j * 32 + lane] : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      const float w = expf(lse[u] - m_ref);
      total += w;
      const bool seen = w != 0.f;   // NaN weights stay: they make the row NaN
#pragma unroll
      for (int j = 0; j < kColsPerLane / 4; ++j) {
        acc[4 * j] += seen ? w * v[u][j].x : 0.f;
        acc[4 * j + 1] += seen ? w * v[u][j].y : 0.f;
        acc[4 * j + 2] += seen ? w * v[u][j].z : 0.f;
        acc[4 * j + 3] += seen ? w * v[u][j].w : 0.f;
      }
    }
  }
}

// The largest LSE of a row's splits, over the whole warp.
__device__ __forceinline__ float max_lse(const CombineParams& p, int64_t first, int runs,
                                         int lane) {
  float m = -INFINITY;
  for (int s = lane; s < runs; s += 32) m = fmaxf(m, p.part_lse[first + int64_t(s) * p.num_rows]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// A merged row's natural-log LSE: -inf where no split saw anything; NaN where a split's LSE
// was NaN (the total is NaN then, not 0, and so is the whole output row acc / total).  A NaN
// element of a partial under a finite LSE makes only that output column NaN.
__device__ __forceinline__ float row_lse(float m, float total) {
  return total == 0.f ? -INFINITY : m + logf(total);
}

__device__ __forceinline__ void store_lse(const CombineParams& p, int b, int row, float lse) {
  p.lse[(static_cast<int64_t>(b) * p.num_heads + row % p.num_heads) * p.s_q + row / p.num_heads] =
      lse;
}

__device__ __forceinline__ __nv_bfloat16* out_row(const CombineParams& p, int b, int row) {
  return static_cast<__nv_bfloat16*>(p.out) +
         (static_cast<int64_t>(b) * p.num_rows + row) * kKvLoraRank;
}

// The number of runs of request b (1: the decode kernel wrote its output directly).
__device__ __forceinline__ int request_runs(const CombineParams& p, int b) {
  const int chunk = p.pages_per_split != nullptr ? *p.pages_per_split : 0;
  return split_range(p.seq_lens[b], p.table_pages, chunk, p.max_splits, 0).num_splits;
}

// One warp merges one query row of one request, split after split (few splits: the loads of
// other rows' warps keep memory busy).
__global__ void __launch_bounds__(32 * kCombineRowsPerBlock) combine_kernel(const CombineParams p) {
  wait_for_prior_grids();   // after our decode kernel, a dependent launch: its partials
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kCombineRowsPerBlock + threadIdx.x / 32;
  const int b = blockIdx.y;
  if (row >= p.num_rows) return;
  const int runs = request_runs(p, b);
  if (runs == 1) return;

  const int64_t first = (static_cast<int64_t>(b) * p.max_splits) * p.num_rows + row;
  const float m = max_lse(p, first, runs, lane);
  const float m_ref = m == -INFINITY ? 0.f : m;
  float acc[kColsPerLane] = {};
  float total = 0.f;
  for (int s = 0; s < runs; ++s) {
    const int64_t part_row = first + int64_t(s) * p.num_rows;
    const float w = expf(p.part_lse[part_row] - m_ref);
    total += w;
    if (w == 0.f) continue;   // saw nothing (never written), or a weight that underflowed
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
  const float inv = total == 0.f ? 0.f : 1.f / total;
  __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out_row(p, b, row));
#pragma unroll
  for (int j = 0; j < kColsPerLane / 4; ++j) {
    const int col = 4 * (j * 32 + lane);
    dst[col / 2] = __floats2bfloat162_rn(acc[4 * j] * inv, acc[4 * j + 1] * inv);
    dst[col / 2 + 1] = __floats2bfloat162_rn(acc[4 * j + 2] * inv, acc[4 * j + 3] * inv);
  }
  if (lane == 0) store_lse(p, b, row, row_lse(m, total));
}

// kCombineWideWarps warps merge one query row of one request and add up their shares.
__global__ void __launch_bounds__(32 * kCombineWideWarps) combine_wide_kernel(
    const CombineParams p) {
  __shared__ __align__(16) float shares[kCombineWideWarps][kKvLoraRank];   // float4 stores
  __shared__ float totals[kCombineWideWarps];
  wait_for_prior_grids();   // as combine_kernel
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int row = blockIdx.x;
  const int b = blockIdx.y;
  const int runs = request_runs(p, b);
  if (runs == 1) return;   // the same for the whole block

  const int64_t first = (static_cast<int64_t>(b) * p.max_splits) * p.num_rows + row;
  const float m = max_lse(p, first, runs, lane);
  const float m_ref = m == -INFINITY ? 0.f : m;
  float acc[kColsPerLane] = {};
  float total = 0.f;
  merge_splits(p, first, runs, m_ref, warp, kCombineWideWarps, lane, acc, total);
#pragma unroll
  for (int j = 0; j < kColsPerLane / 4; ++j) {
    *reinterpret_cast<float4*>(&shares[warp][4 * (j * 32 + lane)]) =
        make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
  }
  if (lane == 0) totals[warp] = total;
  __syncthreads();

  float sum_total = 0.f;
#pragma unroll
  for (int w = 0; w < kCombineWideWarps; ++w) sum_total += totals[w];
  const float inv = sum_total == 0.f ? 0.f : 1.f / sum_total;
  static_assert(2 * 32 * kCombineWideWarps == kKvLoraRank, "two columns a thread");
  const int col = 2 * threadIdx.x;
  float2 sum = make_float2(0.f, 0.f);
#pragma unroll
  for (int w = 0; w < kCombineWideWarps; ++w) {
    const float2 x = *reinterpret_cast<const float2*>(&shares[w][col]);
    sum.x += x.x;
    sum.y += x.y;
  }
  reinterpret_cast<__nv_bfloat162*>(out_row(p, b, row))[col / 2] =
      __floats2bfloat162_rn(sum.x * inv, sum.y * inv);
  if (threadIdx.x == 0) store_lse(p, b, row, row_lse(m, sum_total));
}

}  // namespace

cudaError_t launch_split_plan(const SplitPlanParams& params, cudaStream_t stream) {
  split_plan_kernel<<<1, 32, 0, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t launch_combine(const CombineParams& params, cudaStream_t stream,
                           bool after_own_decode) {
  if (params.batch == 0 || params.num_rows == 0) return cudaSuccess;
  if (combine_is_wide(params.max_splits)) {
    return launch_kernel(combine_wide_kernel, dim3(params.num_rows, params.batch),
                         dim3(32 * kCombineWideWarps), 0, stream, after_own_decode, params);
  }
  const dim3 grid((params.num_rows + kCombineRowsPerBlock - 1) / kCombineRowsPerBlock,
                  params.batch);
  return launch_kernel(combine_kernel, grid, dim3(32 * kCombineRowsPerBlock), 0, stream,
                       after_own_decode, params);
}

}  // namespace snapmla
