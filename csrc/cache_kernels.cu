// Data-path kernels of the fp8_snapmla cache: fused quantize + paged scatter of K, the
// dequantizing gather, and per-(token, head) query quantization.
//
// All three are memory-bound streams.  One warp handles one 576-value row: every lane issues all of
// its loads (16 bytes each for the content) before it uses any of them, the row's amax is a warp
// shuffle reduction, and each warp-wide load or store touches one contiguous span, so accesses are
// fully coalesced with no shared memory at all.  The row quantization and its rounding rules are
// in quantize_row.cuh.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "cache_kernels.h"
#include "format.h"
#include "quantize_row.cuh"
#include "split_kv.h"

namespace snapmla {
namespace {

constexpr int kWarpsPerBlock = 8;  // one row per warp, eight rows per block
constexpr int kThreads = kWarp * kWarpsPerBlock;

// N floats rounded to nearest-even in OutT and packed into N * sizeof(OutT) bytes.
template <typename OutT, int N>
__device__ __forceinline__ typename Bytes<N * sizeof(OutT)>::type pack(const float (&in)[N]);

template <>
__device__ __forceinline__ uint4 pack<float, 4>(const float (&in)[4]) {
  return make_uint4(__float_as_uint(in[0]), __float_as_uint(in[1]), __float_as_uint(in[2]),
                    __float_as_uint(in[3]));
}

template <typename Pair, int N, typename Convert>
__device__ __forceinline__ typename Bytes<2 * N>::type pack_pairs(const float (&in)[N],
                                                                  Convert convert) {
  typename Bytes<2 * N>::type out;
  Pair* pairs = reinterpret_cast<Pair*>(&out);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) pairs[i] = convert(in[2 * i], in[2 * i + 1]);
  return out;
}

template <>
__device__ __forceinline__ uint4 pack<__nv_bfloat16, 8>(const float (&in)[8]) {
  return pack_pairs<__nv_bfloat162>(in, [](float a, float b) { return __floats2bfloat162_rn(a, b); });
}
template <>
__device__ __forceinline__ uint4 pack<__half, 8>(const float (&in)[8]) {
  return pack_pairs<__half2>(in, [](float a, float b) { return __floats2half2_rn(a, b); });
}

// The floats of N e4m3 bytes (exact).
template <int N>
__device__ __forceinline__ void unpack_e4m3(const typename Bytes<N>::type& raw, float (&out)[N]) {
  const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&raw);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3)));
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

template <typename T, typename SlotT>
__global__ void __launch_bounds__(kThreads)
quantize_kv_kernel(StridedRows kv_c, StridedRows k_pe, PagedRows cache, const SlotT* slot_mapping,
                   int64_t num_tokens) {
  const int lane = threadIdx.x % kWarp;
  const int64_t token = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (token >= num_tokens) return;
  // The slot and the row are fetched together; a skipped slot costs a wasted read, not latency.
  const int64_t slot = slot_mapping != nullptr ? int64_t(slot_mapping[token]) : token;
  RowQuantizer<T> row;
  row.load(static_cast<const T*>(kv_c.data) + token * kv_c.outer_stride,
           static_cast<const T*>(k_pe.data) + token * k_pe.outer_stride, lane);
  // vLLM pads with slot -1; out-of-range slots are dropped rather than written out of bounds.
  if (slot < 0 || slot >= cache.num_slots) return;

  float min_abs;
  const float s = row.scale(min_abs);
  uint8_t* dst = cache.data + (slot / kPageSize) * cache.block_stride +
                 (slot % kPageSize) * kBytesPerToken;
  row.store(s, min_abs, dst + kContentOffset, reinterpret_cast<__nv_bfloat16*>(dst + kRopeOffset),
            lane);
  if (lane == 0) {  // the scale and the zero padding fill one 16-byte vector
    static_assert(kPadOffset + 12 == kRopeOffset && kScaleOffset % 16 == 0, "scale vector");
    *reinterpret_cast<uint4*>(dst + kScaleOffset) = make_uint4(__float_as_uint(s), 0, 0, 0);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
quantize_q_kernel(StridedRows q_nope, StridedRows q_pe, int64_t heads, int64_t num_rows,
                  uint8_t* q8, float* q_scale, __nv_bfloat16* q_pe_scaled, SplitPlanParams plan,
                  bool with_plan) {
  const int lane = threadIdx.x % kWarp;
  // The decode's split planner rides in the last block of this launch: one launch fewer.
  if (with_plan && blockIdx.x == gridDim.x - 1) {
    if (threadIdx.x < kWarp) plan_splits_warp(plan, lane);
    return;
  }
  const int64_t r = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (r >= num_rows) return;
  const int64_t outer = r / heads;
  const int64_t head = r % heads;
  RowQuantizer<T> row;
  const T* nope = static_cast<const T*>(q_nope.data);
  const T* pe = static_cast<const T*>(q_pe.data);
  row.load(nope + outer * q_nope.outer_stride + head * q_nope.head_stride,
           pe + outer * q_pe.outer_stride + head * q_pe.head_stride, lane);
  float min_abs;
  const float s = row.scale(min_abs);
  row.store(s, min_abs, q8 + r * kKvLoraRank, q_pe_scaled + r * kRopeDim, lane);
  if (lane == 0) q_scale[r] = s;
}

// Lane l writes output values [(j * 32 + l) * kVec, +kVec) of the content and, for l < kRopeLanes,
// rope values [l * kVec, +kVec): one 16-byte store each, contiguous across the warp.
template <typename OutT>
__global__ void __launch_bounds__(kThreads)
gather_kv_kernel(const GatherSource src_desc, OutT* dst, int64_t dst_stride, int64_t num_tokens) {
  constexpr int kVec = 16 / sizeof(OutT);
  constexpr int kContentVecs = kKvLoraRank / (kWarp * kVec);
  constexpr int kRopeLanes = kRopeDim / kVec;
  using ContentBytes = typename Bytes<kVec>::type;    // kVec e4m3 values
  using RopeBytes = typename Bytes<2 * kVec>::type;   // kVec bf16 values

  const int lane = threadIdx.x % kWarp;
  const int64_t token = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (token >= num_tokens) return;
  OutT* out = dst + token * dst_stride;
  const GatherSource& g = src_desc;
  const int64_t seq = g.token_to_seq[token];
  int64_t block = -1;
  int64_t pos = -1;
  if (seq >= 0 && seq < g.num_seqs) {
    // The token's place in its request and the request's start are never negative, so an index
    // narrowed to its out-of-range value (INT_MIN for cu_seq_lens, INT_MAX for a start:
    // csrc/api/checks.h) puts the position past the table whatever the other one holds.
    const int64_t offset = token - g.cu_seq_lens[seq];
    const int64_t start = g.seq_starts != nullptr ? g.seq_starts[seq] : 0;
    if (offset >= 0 && start >= 0 && start + offset < g.table_pages * kPageSize) {
      pos = start + offset;
      block = g.block_table[seq * g.block_table_stride + pos / kPageSize];
    }
  }
  if (block < 0 || block >= g.num_blocks) {   // an index outside the source: NaN, not a guess
    const float nan = __int_as_float(0x7fc00000);
    float f[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) f[i] = nan;
#pragma unroll
    for (int j = 0; j < kContentVecs; ++j) {
      reinterpret_cast<uint4*>(out)[j * kWarp + lane] = pack<OutT>(f);
    }
    if (lane < kRopeLanes) reinterpret_cast<uint4*>(out + kKvLoraRank)[lane] = pack<OutT>(f);
    return;
  }
  const uint8_t* src = g.cache + block * g.block_stride + (pos % kPageSize) * kBytesPerToken;

  ContentBytes content[kContentVecs];
#pragma unroll
  for (int j = 0; j < kContentVecs; ++j) {
    content[j] =
        __ldg(reinterpret_cast<const ContentBytes*>(src + kContentOffset) + j * kWarp + lane);
  }
  RopeBytes rope{};
  if (lane < kRopeLanes) rope = __ldg(reinterpret_cast<const RopeBytes*>(src + kRopeOffset) + lane);
  const float s = __ldg(reinterpret_cast<const float*>(src + kScaleOffset));

#pragma unroll
  for (int j = 0; j < kContentVecs; ++j) {
    float f[kVec];
    unpack_e4m3<kVec>(content[j], f);
#pragma unroll
    for (int i = 0; i < kVec; ++i) f[i] = __fmul_rn(f[i], s);
    reinterpret_cast<uint4*>(out)[j * kWarp + lane] = pack<OutT>(f);
  }
  if (lane < kRopeLanes) {
    float f[kVec];
    unpack<__nv_bfloat16>(rope, f);
#pragma unroll
    for (int i = 0; i < kVec; ++i) f[i] = __fmul_rn(f[i], s);
    reinterpret_cast<uint4*>(out + kKvLoraRank)[lane] = pack<OutT>(f);
  }
}

unsigned int blocks_for(int64_t rows) {
  return static_cast<unsigned int>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

template <typename T>
cudaError_t quantize_kv_typed(StridedRows kv_c, StridedRows k_pe, PagedRows cache,
                              const void* slot_mapping, IndexType slot_type, int64_t num_tokens,
                              cudaStream_t stream) {
  if (slot_type == IndexType::kInt32) {
    quantize_kv_kernel<T, int32_t><<<blocks_for(num_tokens), kThreads, 0, stream>>>(
        kv_c, k_pe, cache, static_cast<const int32_t*>(slot_mapping), num_tokens);
  } else {
    quantize_kv_kernel<T, int64_t><<<blocks_for(num_tokens), kThreads, 0, stream>>>(
        kv_c, k_pe, cache, static_cast<const int64_t*>(slot_mapping), num_tokens);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t quantize_q_typed(StridedRows q_nope, StridedRows q_pe, int64_t outer, int64_t heads,
                             uint8_t* q8, float* q_scale, void* q_pe_scaled,
                             const SplitPlanParams* plan, cudaStream_t stream) {
  const int64_t rows = outer * heads;
  quantize_q_kernel<T><<<blocks_for(rows) + (plan != nullptr ? 1 : 0), kThreads, 0, stream>>>(
      q_nope, q_pe, heads, rows, q8, q_scale, static_cast<__nv_bfloat16*>(q_pe_scaled),
      plan != nullptr ? *plan : SplitPlanParams{}, plan != nullptr);
  return cudaGetLastError();
}

template <typename OutT>
cudaError_t gather_kv_typed(const GatherSource& src, void* dst, int64_t dst_stride,
                            int64_t num_tokens, cudaStream_t stream) {
  gather_kv_kernel<OutT><<<blocks_for(num_tokens), kThreads, 0, stream>>>(
      src, static_cast<OutT*>(dst), dst_stride, num_tokens);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_quantize_kv(FloatType dtype, StridedRows kv_c, StridedRows k_pe, PagedRows cache,
                               const void* slot_mapping, IndexType slot_type, int64_t num_tokens,
                               cudaStream_t stream) {
  if (num_tokens <= 0) return cudaSuccess;
  switch (dtype) {
    case FloatType::kFloat32:
      return quantize_kv_typed<float>(kv_c, k_pe, cache, slot_mapping, slot_type, num_tokens, stream);
    case FloatType::kFloat16:
      return quantize_kv_typed<__half>(kv_c, k_pe, cache, slot_mapping, slot_type, num_tokens, stream);
    case FloatType::kBFloat16:
      return quantize_kv_typed<__nv_bfloat16>(kv_c, k_pe, cache, slot_mapping, slot_type, num_tokens,
                                              stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_gather_kv(FloatType dst_type, const GatherSource& src, void* dst,
                             int64_t dst_stride, int64_t num_tokens, cudaStream_t stream) {
  if (num_tokens <= 0) return cudaSuccess;
  switch (dst_type) {
    case FloatType::kFloat32:
      return gather_kv_typed<float>(src, dst, dst_stride, num_tokens, stream);
    case FloatType::kFloat16:
      return gather_kv_typed<__half>(src, dst, dst_stride, num_tokens, stream);
    case FloatType::kBFloat16:
      return gather_kv_typed<__nv_bfloat16>(src, dst, dst_stride, num_tokens, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_quantize_q(FloatType dtype, StridedRows q_nope, StridedRows q_pe, int64_t outer,
                              int64_t heads, uint8_t* q8, float* q_scale, void* q_pe_scaled,
                              const SplitPlanParams* plan, cudaStream_t stream) {
  if ((outer <= 0 || heads <= 0) && plan == nullptr) return cudaSuccess;
  if (outer <= 0 || heads <= 0) outer = heads = 0;
  switch (dtype) {
    case FloatType::kFloat32:
      return quantize_q_typed<float>(q_nope, q_pe, outer, heads, q8, q_scale, q_pe_scaled, plan,
                                     stream);
    case FloatType::kFloat16:
      return quantize_q_typed<__half>(q_nope, q_pe, outer, heads, q8, q_scale, q_pe_scaled, plan,
                                      stream);
    case FloatType::kBFloat16:
      return quantize_q_typed<__nv_bfloat16>(q_nope, q_pe, outer, heads, q8, q_scale, q_pe_scaled,
                                             plan, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace snapmla
