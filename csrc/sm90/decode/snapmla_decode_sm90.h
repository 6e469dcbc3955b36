// Host-side interface of the sm_90a SnapMLA decode kernel (snapmla_decode_sm90.cuh): plain C++,
// included by the torch op (csrc/sm90/decode_api.cpp).
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
  // One split: bf16 out [B, s_q*H, 512] and lse [B, H, s_q].  Several: fp32 partials
  // [B, splits, s_q*H, 512] and their lse [B, splits, s_q*H] (what the Triton combine reads).
  void* out;
  float* lse;
  int num_heads;
  int s_q;
  int num_rows;                   // s_q * num_heads
  int num_splits;
  int causal;
  float qk_scale_log2;            // softmax_scale * log2(e): exponentials run in base 2
  int schedule;                   // host-side choice of the kernel: kSchedule* of config.h
  int promote_pv;                 // 0: no per-page FP32 promotion of PV (measurement only)
};

// Launches the decode of `batch` requests over `kv_cache` (uint8 [num_blocks, 64, 656], blocks
// `block_stride` bytes apart).  Returns nullptr on success, else a description of the failure
// (a device that is not sm_90, a build without sm_90a code, a CUDA error).
const char* launch_decode_sm90(const DecodeParams& params, const uint8_t* kv_cache,
                               int64_t num_blocks, int64_t block_stride, int batch,
                               cudaStream_t stream);

}  // namespace snapmla::sm90
