// Split-KV decode, the part both decode kernels share (the Hopper kernels in csrc/sm90/ and the
// Triton kernel in vllm_snapmla/kernels/triton_decode.py): how a request's pages are cut into
// splits, the planner that picks the cut from the batch's real lengths on the GPU, and the
// combine that merges the splits' partial results.  Plain C++/CUDA, no torch.
//
// A decode launch has a fixed grid of `max_splits` splits per (request, row block): fixed, so
// that a CUDA graph captured once replays for any lengths.  Which of them work is decided on the
// GPU from the lengths: the planner (one warp: its own launch once per step for vLLM,
// plan_decode_sm90, or one more block of a decode call's query quantization) writes
// `pages_per_split` from the batch's lengths (a cost model that counts every request's runs,
// below), and each request's pages are cut into runs of that many pages (more only where
// `max_splits` runs would not cover it).  Splits past a request's last run have nothing to do
// and return at once; a request with one run writes its final output directly and the combine
// leaves it alone.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "format.h"

// `#pragma unroll` for nvcc; host compilers (the torch-facing API includes this header) have no
// such pragma and would warn.
#if defined(__CUDACC__)
#define SNAPMLA_UNROLL _Pragma("unroll")
#else
#define SNAPMLA_UNROLL
#endif

namespace snapmla {

// The pages of one split: [first_page, first_page + num_pages) of its request, which has
// `num_splits` non-empty runs in all.  `pages_per_split` 0 (no planner) cuts the request's pages
// into `max_splits` equal runs.
//
// A length outside [0, table_pages * kPageSize] cannot come from a block table `table_pages`
// wide: such a request is `valid == false`, gets no pages (nothing is read through its table
// row) and one run, and the kernels write NaN for it, so the error shows in the output instead
// of reading another request's blocks.
struct SplitRange {
  int first_page;
  int num_pages;
  int num_splits;
  bool valid;
};

__host__ __device__ __forceinline__ bool valid_length(int seq_len, int table_pages) {
  return seq_len >= 0 && static_cast<int64_t>(seq_len) <= int64_t(table_pages) * kPageSize;
}

__host__ __device__ __forceinline__ int request_pages(int seq_len, int table_pages) {
  return valid_length(seq_len, table_pages) ? (seq_len + kPageSize - 1) / kPageSize : 0;
}

__host__ __device__ __forceinline__ SplitRange split_range(int seq_len, int table_pages,
                                                           int pages_per_split, int max_splits,
                                                           int split) {
  const int pages = request_pages(seq_len, table_pages);
  int run = (pages + max_splits - 1) / max_splits;
  // A plan may hold any value (a caller's, or one made for other lengths): a run longer than the
  // request is one run of its pages, which also keeps pages + run and split x run in int.
  if (pages_per_split > run) run = pages_per_split < pages ? pages_per_split : pages;
  const int num_splits = run > 0 ? (pages + run - 1) / run : 1;
  // An int: with a plan, split x run < max_splits x table_pages (capped by max_splits_for); with
  // a forced split count, run = ceil(pages / max_splits).
  const int first = split * run;
  const int last = first + run < pages ? first + run : pages;
  return {first, last > first ? last - first : 0, num_splits > 0 ? num_splits : 1,
          valid_length(seq_len, table_pages)};
}

// The combine's shape (csrc/split_kv.cu), which the planner's cost model reads too.  Where a
// launch allows kCombineWideFrom splits or more (one long request, a few), kCombineWideWarps
// warps share a query row's splits, each with the loads of kCombineUnroll splits in flight: a
// row's merge takes one memory round trip per kCombineWideWarps x kCombineUnroll splits.  Below
// that, one warp merges a row split after split, one round trip each.
constexpr int kCombineUnroll = 4;
constexpr int kCombineWideWarps = 8;
constexpr int kCombineWideFrom = 32;

__host__ __device__ __forceinline__ bool combine_is_wide(int max_splits) {
  return max_splits >= kCombineWideFrom;
}

// The combine's cost for the longest request's `runs`, in the planner's units (the time a CTA
// takes to stream one page: about 1.1 µs at 16 heads on an H100, from one 8,192- and one
// 131,072-token request decoded in one run, 153 µs for 128 pages and 2.2 ms for 2,048).
// Measured on an H100, 2,560-column table:
// - wide: one 8,192-token request at 16 heads takes 22.7, 23.7 and 29.4 µs cut into 32, 64 and
//   128 runs (graph replay, the cut forced), though the shorter runs save 2 and 3 pages: a round
//   trip of 32 splits costs about 3 pages;
// - one warp a row: 16 splits took 10.2 µs at 8 x 16 x 4,096 (the cut forced to 16 splits, a
//   launch below kCombineWideFrom; eager, the combine's GPU time),
//   about half a page a split.
// A fixed part counts what merging costs at all (the partials written and read back; a
// combine launch over 64 x 128 rows that merged nothing took 2.6 µs, eager).
constexpr int kCombineFixedPages = 2;
// A split's fixed cost in pages of streaming (query load, partial write): the planner's
// `overhead_pages` (SplitPlanParams) for every kernel; the value it was tuned with on the H200.
constexpr int kSplitOverheadPages = 2;
constexpr int kCombineWideRoundPages = 3;
constexpr int kCombineNarrowSplitsPerPage = 2;

__host__ __device__ __forceinline__ long long combine_cost_pages(int runs, int max_splits) {
  if (runs <= 1) return 0;
  const long long variable =
      combine_is_wide(max_splits)
          ? (runs + kCombineUnroll * kCombineWideWarps - 1) / (kCombineUnroll * kCombineWideWarps) *
                static_cast<long long>(kCombineWideRoundPages)
          : (runs + kCombineNarrowSplitsPerPage - 1) / kCombineNarrowSplitsPerPage;
  return kCombineFixedPages + variable;
}

// The planner's inputs.  Cost model (the same for every kernel): the candidates are the run
// lengths L = ceil(longest request's pages / s) for s <= max_splits.  At run length L every
// request is cut into ceil(its pages / L) runs, each one CTA per row block and costing its pages
// plus a split's fixed cost (query load, partial write) of `overhead_pages` pages; the
// launch takes ceil(total cost / (slots x (L + overhead_pages))) waves of L + overhead_pages
// (exact when every run is L pages long; with ragged lengths the short runs fill the waves of
// the long ones), plus the combine's cost for the longest request's runs (combine_cost_pages).
// The planner takes the cheapest L (the longest on ties).  Counting every request's runs, not
// the longest one's times the batch, lets a ragged batch take shorter runs.
struct SplitPlanParams {
  const int32_t* seq_lens;     // [batch]
  int table_pages;             // the block table's columns (longer lengths are invalid)
  int batch;
  int programs;                // CTAs per split index: batch x row blocks
  int slots;                   // CTAs the GPU runs at once
  int max_splits;              // the launch's splits per (request, row block)
  int overhead_pages;
  int32_t* pages_per_split;    // out: one int32
};

// Inputs of the combine: partial outputs [batch, max_splits, num_rows, 512] (fp32, normalized
// within their split) and their natural-log LSEs [batch, max_splits, num_rows] (-inf: the split
// saw nothing and wrote no output).  Writes out[batch, num_rows, 512] (bf16) and
// lse[batch, num_heads, s_q] for every request with more than one run (a request with one run
// was written directly by the decode kernel).
struct CombineParams {
  const float* part_out;
  const float* part_lse;
  const int32_t* seq_lens;
  const int32_t* pages_per_split;   // as the decode launch read it (may be null)
  int table_pages;                  // the block table's columns
  int max_splits;
  void* out;
  float* lse;
  int batch;
  int num_heads;
  int s_q;
  int num_rows;                     // s_q x num_heads
};

// The planner alone (one warp); the decode ops fuse it into launch_quantize_q instead.
cudaError_t launch_split_plan(const SplitPlanParams& params, cudaStream_t stream);

// `after_own_decode`: the last kernel in `stream` is our Hopper decode kernel, which lets the
// combine be a programmatic dependent of it (csrc/dependent_launch.h).  The decode kernels never
// trigger their dependents early, so the combine's CTAs are placed only once every decode CTA
// has exited: the launch latency between the two is hidden without taking SMs from the decode.
cudaError_t launch_combine(const CombineParams& params, cudaStream_t stream,
                           bool after_own_decode);

// The launch's splits per (request, row block).  Several requests: enough for the GPU to run
// two waves of CTAs even when every request is as long as the table allows, so that a long
// request among short ones can still be cut finely.  One request: one wave (at least one split),
// since more runs than fit at once never pay for their overhead, and the planner then scores
// half the candidates (docs/decode-kernels.md, "Splits").  Never more than the table's pages.
inline int max_splits_for(int64_t batch, int64_t programs, int slots, int64_t table_pages) {
  if (programs < 1) programs = 1;
  int64_t splits = batch == 1 ? slots / programs : (2 * int64_t(slots) + programs - 1) / programs;
  if (splits > table_pages) splits = table_pages;
  if (splits > 65535) splits = 65535;
  // split x run stays an int in split_range: a run is at most the table's pages.
  if (table_pages > 0 && splits > 2147483647 / table_pages) splits = 2147483647 / table_pages;
  return splits > 1 ? static_cast<int>(splits) : 1;
}

// The planner's body for one warp: `warp.lane` (0-31) and `warp.xor_shuffle(v, offset)` (the
// value of lane ^ offset; every lane calls it at the same points).  A template over the warp, so
// that the unit test (tests/unit/kernels/test_split_planner.py) runs this code on the host with
// 32 threads for the lanes; kernels use plan_splits_warp.
template <typename Warp>
__host__ __device__ __forceinline__ int plan_splits(const SplitPlanParams& p, const Warp& warp) {
  const int lane = warp.lane;
  int max_pages = 0;
  long long total_pages = 0;
  for (int b = lane; b < p.batch; b += 32) {
    const int pages = request_pages(p.seq_lens[b], p.table_pages);
    max_pages = pages > max_pages ? pages : max_pages;
    total_pages += pages;
  }
SNAPMLA_UNROLL
  for (int o = 16; o > 0; o /= 2) {
    const int other = warp.xor_shuffle(max_pages, o);
    max_pages = other > max_pages ? other : max_pages;
    total_pages += warp.xor_shuffle(total_pages, o);
  }
  const int limit = max_pages < p.max_splits ? max_pages : p.max_splits;
  // Candidates go to groups of `group` lanes (a power of two) that share the sum over the
  // batch: with few candidates (a large batch) the whole warp still works on them, with many
  // (few long requests) each lane takes its own.  Every lane runs the same rounds and shuffles.
  int group_log2 = 5;
  while (group_log2 > 0 && (limit << group_log2) > 32) --group_log2;
  const int group = 1 << group_log2;
  const int per_round = 32 >> group_log2;
  const int member = lane & (group - 1);
  long long best_cost = -1;
  int best = 1;
  for (int first = 1; first <= limit; first += per_round) {
    const int s = first + (lane >> group_log2);
    const bool candidate = s <= limit;
    const int run = candidate ? (max_pages + s - 1) / s : 1;
    long long runs = 0;
    if (candidate) {
      for (int b = member; b < p.batch; b += group) {
        runs += (request_pages(p.seq_lens[b], p.table_pages) + run - 1) / run;
      }
    }
    for (int o = group / 2; o > 0; o /= 2) runs += warp.xor_shuffle(runs, o);
    if (!candidate) continue;
    // Total cost over all CTAs, in pages: row blocks (programs / batch) x (pages + runs x fixed).
    const long long work = p.programs * (total_pages + runs * p.overhead_pages);
    const long long wave = static_cast<long long>(p.batch) * p.slots * (run + p.overhead_pages);
    const long long cost = (work + wave - 1) / wave * (run + p.overhead_pages) +
                           combine_cost_pages((max_pages + run - 1) / run, p.max_splits);
    if (best_cost < 0 || cost < best_cost) {   // a lane's candidates rise: ties keep the first
      best_cost = cost;
      best = s;
    }
  }
  // Lanes without a candidate lose every comparison.
SNAPMLA_UNROLL
  for (int o = 16; o > 0; o /= 2) {
    const long long other_cost = warp.xor_shuffle(best_cost, o);
    const int other = warp.xor_shuffle(best, o);
    const bool take = other_cost >= 0 &&
                      (best_cost < 0 || other_cost < best_cost ||
                       (other_cost == best_cost && other < best));
    best_cost = take ? other_cost : best_cost;
    best = take ? other : best;
  }
  return max_pages > 0 ? (max_pages + best - 1) / best : 1;
}

#ifdef __CUDACC__
// A warp of the calling kernel (lane = threadIdx.x % 32) for plan_splits.
struct KernelWarp {
  int lane;
  template <typename T>
  __device__ __forceinline__ T xor_shuffle(T v, int offset) const {
    return __shfl_xor_sync(0xffffffffu, v, offset);
  }
};

// The planner in one warp of a kernel; lane 0 stores the plan.
__device__ __forceinline__ void plan_splits_warp(const SplitPlanParams& p, int lane) {
  const int pages_per_split = plan_splits(p, KernelWarp{lane});
  if (lane == 0) *p.pages_per_split = pages_per_split;
}
#endif  // __CUDACC__

}  // namespace snapmla
