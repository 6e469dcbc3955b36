// Host-side interface of the sm_90a SnapMLA decode kernels (decode_kernel.cuh and
// decode_narrow_kernel.cuh): plain C++, included by the torch-facing layer
// (csrc/api/decode_ops.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace snapmla::sm90 {

struct DecodeParams {
  const uint8_t* q8;              // e4m3 [B, s_q, H, 512], rows 16-byte aligned
  const float* q_scale;           // [B, s_q, H]
  const uint8_t* q_pe;            // bf16 [B, s_q, H, 64] as bytes, rows 16-byte aligned
  int64_t q8_stride[3];           // bytes, over (b, s_q, h)
  int64_t q_scale_stride[3];      // elements
  int64_t q_pe_stride[3];         // bytes
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
  const int32_t* pages_per_split; // the split plan (null: equal cut into max_splits)
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
// `after_own_launch`: the last kernel in `stream` is our query quantization or split planner,
// which lets the decode be a programmatic dependent of it (csrc/dependent_launch.h).
const char* launch_decode_sm90(const DecodeParams& params, const uint8_t* kv_cache,
                               int64_t num_blocks, int64_t block_stride, int batch,
                               cudaStream_t stream, bool after_own_launch);

}  // namespace snapmla::sm90
