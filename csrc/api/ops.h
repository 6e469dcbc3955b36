// The ops of torch.ops._snapmla_C (schemas in csrc/api/library.cpp).  Every function checks its
// tensors completely (device, dtype, shape, strides) and raises with the op, the argument, what
// was expected and what came; the kernels below this layer trust what they are given.
#pragma once

#include <cstdint>
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace snapmla::api {

// Data path (cache_ops.cpp).
void quantize_kv(const at::Tensor& kv_c, const at::Tensor& k_pe, at::Tensor& out);
void append_kv(const at::Tensor& kv_c, const at::Tensor& k_pe, at::Tensor& kv_cache,
               const at::Tensor& slot_mapping);
void gather_kv(const at::Tensor& kv_cache, at::Tensor& dst, const at::Tensor& block_table,
               const at::Tensor& cu_seq_lens, const at::Tensor& token_to_seq, int64_t num_tokens,
               const std::optional<at::Tensor>& seq_starts);
void quantize_q(const at::Tensor& q_nope, const at::Tensor& q_pe, at::Tensor& q8,
                at::Tensor& q_scale, at::Tensor& q_pe_scaled);

// Split-KV decode (decode_ops.cpp).  `num_splits` 0 lets the planner choose on the GPU from the
// real lengths; a positive value cuts every request into that many equal runs.  `schedule` -1
// picks the kernel by row count (the narrow kernel up to 32 query rows, split-roles above).
// `plan` (int32[1], with num_splits 0): a plan_decode_sm90 result to use instead of planning in
// the call, so that the layers of one step plan once.  Any value gives exact results (a plan
// from other lengths or shapes costs only speed) if it is not rewritten while the call runs:
// write it on the decode's stream.
std::tuple<at::Tensor, at::Tensor> decode_sm90(const at::Tensor& q_nope, const at::Tensor& q_pe,
                                               const at::Tensor& kv_cache,
                                               const at::Tensor& block_table,
                                               const at::Tensor& seq_lens, double softmax_scale,
                                               bool causal, int64_t num_splits, int64_t schedule,
                                               const std::optional<at::Tensor>& plan);
std::tuple<at::Tensor, at::Tensor> decode_sm90_quantized(
    const at::Tensor& q8, const at::Tensor& q_scale, const at::Tensor& q_pe_scaled,
    const at::Tensor& kv_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
    double softmax_scale, bool causal, int64_t num_splits, int64_t schedule,
    const std::optional<at::Tensor>& plan);
// The split plan decode_sm90 would make for `batch` requests of `s_q` x `heads` query rows with
// this table and these lengths, written into `plan` (int32[1]) on the stream; nothing is written
// where that launch has one split.
void plan_decode_sm90(const at::Tensor& seq_lens, const at::Tensor& block_table, int64_t batch,
                      int64_t s_q, int64_t heads, at::Tensor& plan);
// Whether decode_sm90 can run on the current CUDA device (an sm_90 GPU and sm_90a code in this
// build); false without a GPU.
bool has_sm90a_code();
void split_plan(const at::Tensor& seq_lens, at::Tensor& pages_per_split, int64_t table_pages,
                int64_t batch, int64_t programs, int64_t slots, int64_t max_splits);
void combine_splits(const at::Tensor& part_out, const at::Tensor& part_lse,
                    const at::Tensor& seq_lens, const std::optional<at::Tensor>& pages_per_split,
                    int64_t table_pages, at::Tensor& out, at::Tensor& lse);

}  // namespace snapmla::api
