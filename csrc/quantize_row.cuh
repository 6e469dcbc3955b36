// Quantization of one 512 + 64 value row (the latent content and its RoPE part) by one warp, as
// the fp8_snapmla format defines it: shared by the data-path kernels (csrc/cache_kernels.cu: the
// cache's rows, the query's rows) and the sm_90a decode kernels, which quantize their query rows
// in their prologue (csrc/sm90/decode_kernel.cuh, stage_query).
//
// Rounding follows vllm_snapmla/reference.py bit for bit: exactly rounded FP32 division
// (ScaleDivider; never a plain x * (1/s)), round-to-nearest-even casts to e4m3 (saturating at 448,
// which equals the reference's clamp-then-cast) and to bf16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "format.h"

namespace snapmla {

constexpr int kWarp = 32;

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
  static constexpr int kContentVecs = kKvLoraRank / (kWarp * kVec);   // per lane: 2 (16-bit), 4 (fp32)
  static constexpr int kRopePerLane = kRopeDim / kWarp;
  static_assert(kContentVecs * kWarp * kVec == kKvLoraRank && kRopePerLane == 2, "row split");
  using RopeRaw = typename Bytes<kRopePerLane * sizeof(T)>::type;
  using ContentBytes = typename Bytes<kVec>::type;   // kVec e4m3 values

  uint4 content[kContentVecs];
  RopeRaw rope;

  // kStream: the row is read once, so the loads stream past the caches; the decode kernels'
  // splits of one request read its query rows again and load them plainly.
  template <bool kStream = true>
  __device__ __forceinline__ void load(const T* content_row, const T* rope_row, int lane) {
#pragma unroll
    for (int j = 0; j < kContentVecs; ++j) {
      const uint4* src = reinterpret_cast<const uint4*>(content_row) + j * kWarp + lane;
      content[j] = kStream ? __ldcs(src) : *src;
    }
    const RopeRaw* rope_src = reinterpret_cast<const RopeRaw*>(rope_row) + lane;
    rope = kStream ? __ldcs(rope_src) : *rope_src;
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
    store_to(s, min_abs, lane, [&](int vec, ContentBytes v) {
      reinterpret_cast<ContentBytes*>(content_out)[vec] = v;
    }, [&](__nv_bfloat162 v) { reinterpret_cast<__nv_bfloat162*>(rope_out)[lane] = v; });
  }

  // The same values, handed to the caller's stores: content(vec, bytes) for content bytes
  // [vec * kVec, +kVec) (vec = j * 32 + lane) and rope(pair) for rope values [2 lane, 2 lane + 2).
  template <typename ContentStore, typename RopeStore>
  __device__ __forceinline__ void store_to(float s, float min_abs, int lane,
                                           ContentStore content, RopeStore rope_store) const {
    const ScaleDivider divider(s);
    if (divider.fast_path_exact(min_abs)) {
      store_with(lane, [&](float x) { return divider.fast(x); }, content, rope_store);
    } else {
      store_with(lane, [&](float x) { return divider.ieee(x); }, content, rope_store);
    }
  }

 private:
  template <typename Divide, typename ContentStore, typename RopeStore>
  __device__ __forceinline__ void store_with(int lane, Divide divide, ContentStore& content_store,
                                             RopeStore& rope_store) const {
#pragma unroll
    for (int j = 0; j < kContentVecs; ++j) {
      float f[kVec];
      unpack<T>(content[j], f);
#pragma unroll
      for (int i = 0; i < kVec; ++i) f[i] = divide(f[i]);
      content_store(j * kWarp + lane, pack_e4m3(f));
    }
    float f[kRopePerLane];
    unpack<T>(rope, f);
    rope_store(__floats2bfloat162_rn(divide(f[0]), divide(f[1])));
  }
};

}  // namespace snapmla
