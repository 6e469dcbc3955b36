// Host-side interface of the sm_90a SnapMLA decode kernel (decode_kernel.cuh): plain C++,
// included by the torch-facing layer (csrc/api/decode_ops.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace snapmla::sm90 {

// How the query arrives: e4m3 rows with their scales and the RoPE part pre-divided (every
// kernel), or 16-bit rows of the model, which the 64-row kernel quantizes in its prologue (the
// format's query quantization, bit for bit that of quantize_q).
enum class QueryType : int { kE4m3 = 0, kBFloat16 = 1, kFloat16 = 2, kFloat32 = 3 };

struct DecodeParams {
  QueryType q_type;
  const uint8_t* q_nope;          // [B, s_q, H, 512] of q_type, rows 16-byte aligned (kFloat32:
                                  // no kernel takes it)
  const uint8_t* q_pe;            // [B, s_q, H, 64]: bf16 pre-divided (kE4m3) or of q_type
  const float* q_scale;           // [B, s_q, H] (kE4m3 only)
  int64_t q_nope_stride[3];       // bytes, over (b, s_q, h)
  int64_t q_pe_stride[3];         // bytes
  int64_t q_scale_stride[3];      // elements
  const int32_t* block_table;     // [B, max_blocks]
  int64_t block_table_stride;
  const int32_t* seq_lens;        // [B]
  int table_pages;                // block_table's columns: a longer seq_len is invalid (NaN out)
  // Final results: bf16 out [B, s_q*H, 512] and lse [B, H, s_q], written here for requests
  // decoded in one run.  Requests cut into several runs write fp32 partials [B, max_splits,
  // s_q*H, 512] and their lse [B, max_splits, s_q*H] instead, which the combine merges
  // (split_kv.h); null when max_splits is 1.
  void* out;
  float* lse;
  float* part_out;
  float* part_lse;
  // The split planner's output (null: equal cut into max_splits).  With plan_slots > 0 (the
  // 64-row kernel) every CTA plans the splits itself, as a split_plan launch with `slots` CTAs at
  // once and plan_overhead_pages would, and CTA (0, 0, 0) stores the plan here for the combine.
  int32_t* pages_per_split;
  int plan_slots;
  int plan_overhead_pages;
  int num_heads;
  int s_q;
  int num_rows;                   // s_q * num_heads
  int max_splits;                 // the grid's splits per (request, row block)
  int causal;
  float qk_scale_log2;            // softmax_scale * log2(e): exponentials run in base 2
  int schedule;                   // host-side choice of the kernel: kSchedule* of config.h
};

// Whether this build runs the decode kernels on the current device (an sm_90 GPU and a build
// with sm_90a code).
bool has_sm90a_code();

// Launches the decode of `batch` requests over `kv_cache` (uint8 [num_blocks, 64, 656], blocks
// `block_stride` bytes apart).  Returns nullptr on success, else a description of the failure
// (a device that is not sm_90, a build without sm_90a code, a CUDA error).
const char* launch_decode_sm90(const DecodeParams& params, const uint8_t* kv_cache,
                               int64_t num_blocks, int64_t block_stride, int batch,
                               cudaStream_t stream);

}  // namespace snapmla::sm90
