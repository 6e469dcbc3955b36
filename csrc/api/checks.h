// The torch-facing layer's checks, shared by every op (csrc/api/*.cpp): each violation raises
// with the op, the argument, what was expected and what came.
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include "cache_kernels.h"
#include "format.h"

namespace snapmla::api {

inline std::string shape_of(const at::Tensor& t) { return c10::str(t.scalar_type(), t.sizes()); }

inline FloatType float_type(const char* op, const char* name, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return FloatType::kFloat32;
    case at::kHalf: return FloatType::kFloat16;
    case at::kBFloat16: return FloatType::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, op, ": ", name, " must be bfloat16, float16 or float32, got ",
                       t.scalar_type());
  }
}

inline void check_cuda(const char* op, const char* name, const at::Tensor& t,
                       const at::Device& device) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(), " but the op runs on ",
              device);
}

inline bool vector_aligned(const at::Tensor& t) {
  if (t.stride(-1) != 1 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if (t.size(d) > 1 && (t.stride(d) * t.element_size()) % 16 != 0) return false;
  }
  return true;
}

// The kernels read input rows with 16-byte vector loads.  Strided rows (a transposed bmm output,
// a split of a wider projection) are read in place when every row starts 16-byte aligned with
// unit stride along the row; anything else is copied into a fresh, aligned tensor first.
inline at::Tensor vector_ready(const at::Tensor& t) {
  return vector_aligned(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

// kv_c[T, 512] or k_pe[T, 64] / [T, 1, 64] as a 2-D [T, width] tensor.
inline at::Tensor token_rows(const char* op, const char* name, const at::Tensor& t, int64_t width) {
  const bool squeezable = t.dim() == 3 && t.size(1) == 1;
  TORCH_CHECK_VALUE((t.dim() == 2 || squeezable) && t.size(-1) == width, op, ": ", name,
                    " must be [tokens, ", width, "]",
                    width == kRopeDim ? " or [tokens, 1, 64]" : "",
                    ", got ", shape_of(t));
  return squeezable ? t.squeeze(1) : t;
}

inline void check_cache(const char* op, const at::Tensor& kv_cache, const at::Device& device) {
  check_cuda(op, "kv_cache", kv_cache, device);
  TORCH_CHECK_VALUE(kv_cache.scalar_type() == at::kByte && kv_cache.dim() == 3 &&
                        kv_cache.size(1) == kPageSize && kv_cache.size(2) == kBytesPerToken,
                    op, ": kv_cache must be uint8[num_blocks, ", kPageSize, ", ", kBytesPerToken,
                    "], got ", shape_of(kv_cache));
  // Blocks may be spaced (one layer's blocks within a larger allocation) but never overlap.
  TORCH_CHECK_VALUE(kv_cache.stride(2) == 1 && kv_cache.stride(1) == kBytesPerToken &&
                        kv_cache.stride(0) % 16 == 0 &&
                        (kv_cache.size(0) <= 1 ||
                         kv_cache.stride(0) >= int64_t(kPageSize) * kBytesPerToken) &&
                        reinterpret_cast<uintptr_t>(kv_cache.data_ptr()) % 16 == 0,
                    op, ": kv_cache blocks must be contiguous, non-overlapping [", kPageSize, ", ",
                    kBytesPerToken, "] byte arrays starting 16-byte aligned, got strides ",
                    kv_cache.strides());
}

// Indices as int32, as the kernels read them (vLLM's metadata is int32).  An int64 value
// outside int32's range becomes `out_of_range` instead of wrapping onto another value: the
// caller picks one that no valid index can be, so the kernels give NaN for it (gather_kv: its
// kernel's sign rules keep the other index of a position from cancelling it, cache_ops.cpp).
constexpr int32_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int32_t kInt32Min = std::numeric_limits<int32_t>::min();

inline at::Tensor narrowed_int32(const at::Tensor& t, int32_t out_of_range) {
  if (t.scalar_type() == at::kInt) return t;
  const at::Tensor fits = t.ge(kInt32Min).logical_and(t.le(kInt32Max));
  return t.masked_fill(fits.logical_not(), out_of_range).to(at::kInt);
}

// An index tensor as contiguous int32 (narrowed_int32).
inline at::Tensor int32_indices(const char* op, const char* name, const at::Tensor& t, int64_t dim,
                         const at::Device& device, int32_t out_of_range) {
  check_cuda(op, name, t, device);
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, ": ", name,
                   " must be int32 or int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, " must have ", dim, " dimension(s), got ",
                    shape_of(t));
  return narrowed_int32(t, out_of_range).contiguous();
}

inline PagedRows paged(const at::Tensor& kv_cache) {
  return {kv_cache.data_ptr<uint8_t>(), kv_cache.stride(0), kv_cache.size(0) * kPageSize};
}

inline StridedRows strided_rows(const at::Tensor& rows2d) {
  return {rows2d.data_ptr(), rows2d.stride(0), 0};
}

inline void check_launch(const char* op, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

// The query's two parts: CUDA tensors on `device` of one float type, which is returned.
inline FloatType query_pair_type(const char* op, const at::Tensor& q_nope, const at::Tensor& q_pe,
                                 const at::Device& device) {
  check_cuda(op, "q_nope", q_nope, device);
  check_cuda(op, "q_pe", q_pe, device);
  const FloatType dtype = float_type(op, "q_nope", q_nope);
  TORCH_CHECK_TYPE(q_pe.scalar_type() == q_nope.scalar_type(), op, ": q_pe is ",
                   q_pe.scalar_type(), " but q_nope is ", q_nope.scalar_type(),
                   "; they must match");
  return dtype;
}

// A tensor of exactly this dtype and shape.
inline void check_shape(const char* op, const char* name, const at::Tensor& t, at::ScalarType type,
                        at::IntArrayRef sizes) {
  TORCH_CHECK_TYPE(t.scalar_type() == type, op, ": ", name, " must be ", type, ", got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.sizes() == sizes, op, ": ", name, " must have shape ", sizes, ", got ",
                    shape_of(t));
}

}  // namespace snapmla::api
