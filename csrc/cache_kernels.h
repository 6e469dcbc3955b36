// Launchers of the data-path kernels (csrc/cache_kernels.cu).  Plain C++ so that the CUDA file
// needs no torch headers; csrc/api/cache_ops.cpp checks the tensors and fills these in.
// Every pointer given for 16-byte vector access is 16-byte aligned, and so is every row stride
// in bytes (csrc/api guarantees it).  Strides are in elements of the pointed-to type.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "split_kv.h"

namespace snapmla {

enum class FloatType { kFloat32, kFloat16, kBFloat16 };
enum class IndexType { kInt32, kInt64 };

// Rows of `width` values, row r = (outer, head) = (r / heads, r % heads) at
// data + outer * outer_stride + head * head_stride.
struct StridedRows {
  const void* data;
  int64_t outer_stride;
  int64_t head_stride;
};

// Paged cache rows: slot s at data + (s / kPageSize) * block_stride + (s % kPageSize) * 656 bytes.
struct PagedRows {
  uint8_t* data;
  int64_t block_stride;  // bytes
  int64_t num_slots;     // slots outside [0, num_slots) are skipped
};

// Quantizes rows t < num_tokens of kv_c[.,512] / k_pe[.,64] into slot slot_mapping[t] of `cache`
// (slot t when slot_mapping is null).  Rows come with heads = 1.
cudaError_t launch_quantize_kv(FloatType dtype, StridedRows kv_c, StridedRows k_pe, PagedRows cache,
                               const void* slot_mapping, IndexType slot_type, int64_t num_tokens,
                               cudaStream_t stream);

// Where gather_kv reads: the cache and vLLM's index tensors (int32; seq_starts may be null),
// with their extents, so that indices outside them are never followed.
struct GatherSource {
  const uint8_t* cache;
  int64_t block_stride;
  int64_t num_blocks;
  const int32_t* block_table;   // [num_seqs, table_pages]
  int64_t block_table_stride;
  int64_t table_pages;
  int64_t num_seqs;             // requests token_to_seq may name
  const int32_t* cu_seq_lens;   // [num_seqs + 1]
  const int32_t* token_to_seq;  // [>= num_tokens]
  const int32_t* seq_starts;    // [num_seqs] or null
};

// dst[t] = dequantized [kv_c ; k_pe] of position seq_starts[b] + (t - cu_seq_lens[b]) of request
// b = token_to_seq[t], for t < num_tokens; both terms are never negative.  A token whose
// request, position or block lies outside the source's extents gets a NaN row (nothing is read
// for it).
cudaError_t launch_gather_kv(FloatType dst_type, const GatherSource& src, void* dst,
                             int64_t dst_stride, int64_t num_tokens, cudaStream_t stream);

// Quantizes outer * heads query rows into contiguous q8[rows,512] (e4m3), q_scale[rows] and
// q_pe_scaled[rows,64] (bf16).  With `plan`, the same launch also runs the decode's split
// planner (split_kv.h) in one more block.
cudaError_t launch_quantize_q(FloatType dtype, StridedRows q_nope, StridedRows q_pe, int64_t outer,
                              int64_t heads, uint8_t* q8, float* q_scale, void* q_pe_scaled,
                              const SplitPlanParams* plan, cudaStream_t stream);

}  // namespace snapmla
