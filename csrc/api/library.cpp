// torch.ops._snapmla_C: every op's schema, its CUDA implementation (csrc/api/*_ops.cpp) and its
// Meta implementation (shapes only, for tracing with fake tensors).  `import vllm_snapmla._C`
// loads this library, which registers the ops with the dispatcher.

#include <Python.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "api/ops.h"
#include "format.h"

namespace snapmla::api {
namespace {

// The data-path ops only write into tensors they are given: nothing to trace.
void quantize_kv_meta(const at::Tensor&, const at::Tensor&, at::Tensor&) {}
void append_kv_meta(const at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&) {}
void gather_kv_meta(const at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, int64_t, const std::optional<at::Tensor>&) {}
void quantize_q_meta(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&) {}
void split_plan_meta(const at::Tensor&, at::Tensor&, int64_t, int64_t, int64_t, int64_t,
                     int64_t) {}
void combine_splits_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const std::optional<at::Tensor>&, int64_t, at::Tensor&, at::Tensor&) {}

std::tuple<at::Tensor, at::Tensor> decode_outputs_meta(const at::Tensor& q) {
  const int64_t batch = q.size(0), s_q = q.size(1), heads = q.size(2);
  return {at::empty({batch, s_q, heads, kKvLoraRank}, q.options().dtype(at::kBFloat16)),
          at::empty({batch, heads, s_q}, q.options().dtype(at::kFloat))};
}

std::tuple<at::Tensor, at::Tensor> decode_sm90_meta(const at::Tensor& q_nope, const at::Tensor&,
                                                    const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, double, bool, int64_t,
                                                    int64_t, const std::optional<at::Tensor>&) {
  return decode_outputs_meta(q_nope);
}

std::tuple<at::Tensor, at::Tensor> decode_sm90_quantized_meta(
    const at::Tensor& q8, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, double, bool, int64_t, int64_t,
    const std::optional<at::Tensor>&) {
  return decode_outputs_meta(q8);
}

void plan_decode_sm90_meta(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                           at::Tensor&) {}

}  // namespace
}  // namespace snapmla::api

TORCH_LIBRARY(_snapmla_C, m) {
  // No tensor arguments: one kernel for every dispatch key.
  m.def("has_sm90a_code() -> bool", &snapmla::api::has_sm90a_code);
  m.def("quantize_kv(Tensor kv_c, Tensor k_pe, Tensor(a!) out) -> ()");
  m.def("append_kv(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def(
      "gather_kv(Tensor kv_cache, Tensor(a!) dst, Tensor block_table, Tensor cu_seq_lens, "
      "Tensor token_to_seq, int num_tokens, Tensor? seq_starts) -> ()");
  m.def(
      "quantize_q(Tensor q_nope, Tensor q_pe, Tensor(a!) q8, Tensor(a!) q_scale, "
      "Tensor(a!) q_pe_scaled) -> ()");
  m.def(
      "decode_sm90(Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor block_table, "
      "Tensor seq_lens, float softmax_scale, bool causal, int num_splits=0, int schedule=-1, "
      "Tensor? plan=None) -> (Tensor, Tensor)");
  m.def(
      "decode_sm90_quantized(Tensor q8, Tensor q_scale, Tensor q_pe_scaled, Tensor kv_cache, "
      "Tensor block_table, Tensor seq_lens, float softmax_scale, bool causal, int num_splits=0, "
      "int schedule=-1, Tensor? plan=None) -> (Tensor, Tensor)");
  m.def(
      "plan_decode_sm90(Tensor seq_lens, Tensor block_table, int batch, int s_q, int heads, "
      "Tensor(a!) plan) -> ()");
  m.def(
      "split_plan(Tensor seq_lens, Tensor(a!) pages_per_split, int table_pages, int batch, "
      "int programs, int slots, int max_splits) -> ()");
  m.def(
      "combine_splits(Tensor part_out, Tensor part_lse, Tensor seq_lens, Tensor? pages_per_split, "
      "int table_pages, Tensor(a!) out, Tensor(b!) lse) -> ()");
}

TORCH_LIBRARY_IMPL(_snapmla_C, CUDA, m) {
  m.impl("quantize_kv", &snapmla::api::quantize_kv);
  m.impl("append_kv", &snapmla::api::append_kv);
  m.impl("gather_kv", &snapmla::api::gather_kv);
  m.impl("quantize_q", &snapmla::api::quantize_q);
  m.impl("decode_sm90", &snapmla::api::decode_sm90);
  m.impl("decode_sm90_quantized", &snapmla::api::decode_sm90_quantized);
  m.impl("plan_decode_sm90", &snapmla::api::plan_decode_sm90);
  m.impl("split_plan", &snapmla::api::split_plan);
  m.impl("combine_splits", &snapmla::api::combine_splits);
}

TORCH_LIBRARY_IMPL(_snapmla_C, Meta, m) {
  m.impl("quantize_kv", &snapmla::api::quantize_kv_meta);
  m.impl("append_kv", &snapmla::api::append_kv_meta);
  m.impl("gather_kv", &snapmla::api::gather_kv_meta);
  m.impl("quantize_q", &snapmla::api::quantize_q_meta);
  m.impl("decode_sm90", &snapmla::api::decode_sm90_meta);
  m.impl("decode_sm90_quantized", &snapmla::api::decode_sm90_quantized_meta);
  m.impl("plan_decode_sm90", &snapmla::api::plan_decode_sm90_meta);
  m.impl("split_plan", &snapmla::api::split_plan_meta);
  m.impl("combine_splits", &snapmla::api::combine_splits_meta);
}

// A Python extension module with no members: importing it runs the registrations above.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C",
                               "SnapMLA kernels; the ops live in torch.ops._snapmla_C", -1,
                               nullptr};
  return PyModule_Create(&module);
}
