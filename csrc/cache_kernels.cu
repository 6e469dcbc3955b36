// Data-path kernels of the fp8_snapmla cache: fused quantize + paged scatter of K, the
// dequantizing gather, and per-(token, head) query quantization.
//
// All three are memory-bound streams.  One warp handles one 576-value row: every lane issues all of
// its loads (16 bytes each for the content) before it uses any of them, the row's amax is a warp
// shuffle reduction, and each warp-wide load or store touches one contiguous span, so accesses are
// fully coalesced with no shared memory at all.
//
// Rounding follows vllm_snapmla/reference.py bit for bit: exactly rounded FP32 division
// (ScaleDivider; never a plain x * (1/s)), round-to-nearest-even casts to e4m3 (saturating at 448,
// which equals the reference's clamp-then-cast) and to bf16.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "cache_kernels.h"
#include "dependent_launch.h"
#include "format.h"
#include "split_kv.h"

namespace snapmla {
namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;  // one row per warp, eight rows per block
constexpr int kThreads = kWarp * kWarpsPerBlock;

// An unsigned type of N bytes, for one vector access.
template <int N> struct Bytes;
template <> struct Bytes<4> { using type = uint32_t; };
template <> struct Bytes<8> { using type = uint2; };
template <> struct Bytes<16> { using type = uint4; };

// The N values of type T packed in `raw`, as floats (exact: every input type widens losslessly).
template <typename T, int N, typename Raw>
__device__ __forceinline__ void unpack(const Raw& raw, float (&out)[N]) {
  static_assert(sizeof(Raw) == N * sizeof(T), "vector size");
  const uint32_t* words = reinterpret_cast<const uint32_t*>(&raw);
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = __uint_as_float(words[i]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {  // a bf16 is the top half of a float
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      out[2 * i] = __uint_as_float(words[i] << 16);
      out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
  } else {
    static_assert(std::is_same_v<T, __half>, "input type");
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float2 f = __half22float2(reinterpret_cast<const __half2*>(words)[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
}

// Running max and min of |x| over the values one lane holds.  16-bit values are compared two at a
// time in their own format (exact: max and min only select), which halves the instructions.
template <typename T>
struct AbsRange {
  static constexpr bool kPacked = sizeof(T) == 2;
  using Pair = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
  using Acc = std::conditional_t<kPacked, Pair, float>;
  Acc max_abs;
  Acc min_abs;

  __device__ __forceinline__ AbsRange() {
    if constexpr (kPacked) {
      const uint32_t inf = std::is_same_v<T, __half> ? 0x7c007c00u : 0x7f807f80u;
      max_abs = bit_cast<Pair>(0u);
      min_abs = bit_cast<Pair>(inf);
    } else {
      max_abs = 0.0f;
      min_abs = INFINITY;
    }
  }

  template <typename Raw>
  __device__ __forceinline__ void add(const Raw& raw) {
    const uint32_t* words = reinterpret_cast<const uint32_t*>(&raw);
#pragma unroll
    for (int i = 0; i < int(sizeof(Raw) / 4); ++i) {
      if constexpr (kPacked) {
        const Pair a = bit_cast<Pair>(words[i] & 0x7fff7fffu);  // clear both sign bits
        max_abs = __hmax2(max_abs, a);
        min_abs = __hmin2(min_abs, a);
      } else {
        const float a = fabsf(__uint_as_float(words[i]));
        max_abs = fmaxf(max_abs, a);
        min_abs = fminf(min_abs, a);
      }
    }
  }

  __device__ __forceinline__ float max_value() const { return reduce(max_abs, true); }
  __device__ __forceinline__ float min_value() const { return reduce(min_abs, false); }

 private:
  template <typename To, typename From>
  __device__ __forceinline__ static To bit_cast(const From& from) {
    static_assert(sizeof(To) == sizeof(From), "bit_cast size");
    To to;
    memcpy(&to, &from, sizeof(To));
    return to;
  }
  __device__ __forceinline__ static float reduce(const Acc& acc, bool is_max) {
    if constexpr (kPacked) {
      float f[2];
      unpack<T>(acc, f);
      return is_max ? fmaxf(f[0], f[1]) : fminf(f[0], f[1]);
    } else {
      return acc;
    }
  }
};

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
  return pack_pairs<__nv_bfloat162>(in,
                                    [](float a, float b) { return __floats2bfloat162_rn(a, b); });
}
template <>
__device__ __forceinline__ uint4 pack<__half, 8>(const float (&in)[8]) {
  return pack_pairs<__half2>(in, [](float a, float b) { return __floats2half2_rn(a, b); });
}

// N floats as e4m3 bytes, round-to-nearest-even, finite values beyond +-448 saturated.
template <int N>
__device__ __forceinline__ typename Bytes<N>::type pack_e4m3(const float (&in)[N]) {
  typename Bytes<N>::type out;
  __nv_fp8x2_storage_t* pairs = reinterpret_cast<__nv_fp8x2_storage_t*>(&out);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    pairs[i] = __nv_cvt_float2_to_fp8x2(make_float2(in[2 * i], in[2 * i + 1]), __NV_SATFINITE,
                                        __NV_E4M3);
  }
  return out;
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

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

// The scale rule of format.scale_from_amax.
__device__ __forceinline__ float scale_from_amax(float amax_content, float amax_rope) {
  const float s = fmaxf(__fdiv_rn(amax_content, kFp8Max), __fdiv_rn(amax_rope, kRopePrescaledMax));
  return fmaxf(s, kScaleFloor);
}

// Division by a row's scale s, rounded exactly like the IEEE x / s of the reference.
//
// __fdiv_rn(x, s) costs a range check, a branch and a reciprocal per value.  This is the same
// instruction sequence as its fast path (reciprocal refined by one Newton step, quotient, one
// residual correction) with the reciprocal hoisted out of the row.  That path is exactly rounded
// whenever no intermediate overflows or underflows, which holds for |x| >= 2^-100 and
// 2^-126 <= s <= 2^26 (then y, x * y, the residual and the quotient are all normal); anything else
// (zeros, tiny values, huge scales) takes __fdiv_rn itself.  Checked bit for bit against __fdiv_rn
// on 2 * 10^11 random pairs in that range on an H200.
struct ScaleDivider {
  float s;
  float y;  // 1 / s refined as the hardware division does

  __device__ __forceinline__ explicit ScaleDivider(float scale) : s(scale) {
    float y0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y0) : "f"(scale));
    y = __fmaf_rn(y0, __fmaf_rn(-scale, y0, 1.0f), y0);
  }
  __device__ __forceinline__ bool fast_path_exact(float min_abs_x) const {
    return min_abs_x >= 0x1p-100f && s <= 0x1p26f;
  }
  __device__ __forceinline__ float fast(float x) const {
    const float q = __fmul_rn(x, y);
    return __fmaf_rn(y, __fmaf_rn(-s, q, x), q);
  }
  __device__ __forceinline__ float ieee(float x) const { return __fdiv_rn(x, s); }
};

// One 512 + 64 value row of type T held by one warp.  Lane l holds content values
// [(j * 32 + l) * kVec, +kVec) for each j and rope values [2 l, 2 l + 2), so every warp-wide load
// and store covers one contiguous span and every lane does the same work.
template <typename T>
struct RowQuantizer {
  static constexpr int kVec = 16 / sizeof(T);                          // values per 16-byte load
  // per lane: 2 (16-bit inputs), 4 (fp32)
  static constexpr int kContentVecs = kKvLoraRank / (kWarp * kVec);
  static constexpr int kRopePerLane = kRopeDim / kWarp;
  static_assert(kContentVecs * kWarp * kVec == kKvLoraRank && kRopePerLane == 2, "row split");
  using RopeRaw = typename Bytes<kRopePerLane * sizeof(T)>::type;

  uint4 content[kContentVecs];
  RopeRaw rope;

  // Input rows are read once: stream them past the caches.
  __device__ __forceinline__ void load(const T* content_row, const T* rope_row, int lane) {
#pragma unroll
    for (int j = 0; j < kContentVecs; ++j) {
      content[j] = __ldcs(reinterpret_cast<const uint4*>(content_row) + j * kWarp + lane);
    }
    rope = __ldcs(reinterpret_cast<const RopeRaw*>(rope_row) + lane);
  }

  // The row's scale; min_abs gets the smallest |value| this lane holds.
  __device__ __forceinline__ float scale(float& min_abs) const {
    AbsRange<T> content_range;
#pragma unroll
    for (int j = 0; j < kContentVecs; ++j) content_range.add(content[j]);
    AbsRange<T> rope_range;
    rope_range.add(rope);
    min_abs = fminf(content_range.min_value(), rope_range.min_value());
    return scale_from_amax(warp_max(content_range.max_value()), warp_max(rope_range.max_value()));
  }

  // Writes e4m3(content / s) to content_out[0, 512) and bf16(rope / s) to rope_out[0, 64).
  __device__ __forceinline__ void store(float s, float min_abs, uint8_t* content_out,
                                        __nv_bfloat16* rope_out, int lane) const {
    const ScaleDivider divider(s);
    if (divider.fast_path_exact(min_abs)) {
      store_with(content_out, rope_out, lane, [&](float x) { return divider.fast(x); });
    } else {
      store_with(content_out, rope_out, lane, [&](float x) { return divider.ieee(x); });
    }
  }

 private:
  template <typename Divide>
  __device__ __forceinline__ void store_with(uint8_t* content_out, __nv_bfloat16* rope_out,
                                             int lane, Divide divide) const {
    using ContentBytes = typename Bytes<kVec>::type;
#pragma unroll
    for (int j = 0; j < kContentVecs; ++j) {
      float f[kVec];
      unpack<T>(content[j], f);
#pragma unroll
      for (int i = 0; i < kVec; ++i) f[i] = divide(f[i]);
      reinterpret_cast<ContentBytes*>(content_out)[j * kWarp + lane] = pack_e4m3(f);
    }
    float f[kRopePerLane];
    unpack<T>(rope, f);
    reinterpret_cast<__nv_bfloat162*>(rope_out)[lane] =
        __floats2bfloat162_rn(divide(f[0]), divide(f[1]));
  }
};

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
  allow_dependent_launch();   // the decode kernel after it is a dependent launch
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
      return quantize_kv_typed<float>(kv_c, k_pe, cache, slot_mapping, slot_type, num_tokens,
                                      stream);
    case FloatType::kFloat16:
      return quantize_kv_typed<__half>(kv_c, k_pe, cache, slot_mapping, slot_type, num_tokens,
                                       stream);
    case FloatType::kBFloat16:
      return quantize_kv_typed<__nv_bfloat16>(kv_c, k_pe, cache, slot_mapping, slot_type,
                                              num_tokens, stream);
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
