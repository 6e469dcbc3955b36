// The data-path ops of torch.ops._snapmla_C: quantize_kv, append_kv, gather_kv, quantize_q.
// Checks here, kernels in csrc/cache_kernels.cu.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "api/checks.h"
#include "api/ops.h"
#include "cache_kernels.h"
#include "format.h"

namespace snapmla::api {
namespace {

// Shared by quantize_kv and append_kv: validated, aligned [T, 512] and [T, 64] rows.
std::pair<at::Tensor, at::Tensor> kv_inputs(const char* op, const at::Tensor& kv_c,
                                            const at::Tensor& k_pe) {
  check_cuda(op, "kv_c", kv_c, kv_c.device());
  float_type(op, "kv_c", kv_c);
  check_cuda(op, "k_pe", k_pe, kv_c.device());
  TORCH_CHECK_TYPE(k_pe.scalar_type() == kv_c.scalar_type(), op, ": k_pe is ", k_pe.scalar_type(),
                   " but kv_c is ", kv_c.scalar_type(), "; they must match");
  return {token_rows(op, "kv_c", kv_c, kKvLoraRank), token_rows(op, "k_pe", k_pe, kRopeDim)};
}

}  // namespace

void quantize_kv(const at::Tensor& kv_c, const at::Tensor& k_pe, at::Tensor& out) {
  constexpr const char* op = "quantize_kv";
  auto [content, rope] = kv_inputs(op, kv_c, k_pe);
  const int64_t tokens = content.size(0);
  TORCH_CHECK_VALUE(rope.size(0) == tokens, op, ": kv_c has ", tokens, " rows but k_pe has ",
                    rope.size(0));
  check_cuda(op, "out", out, kv_c.device());
  TORCH_CHECK_VALUE(out.scalar_type() == at::kByte && out.dim() == 2 && out.size(0) == tokens &&
                        out.size(1) == kBytesPerToken && out.is_contiguous(),
                    op, ": out must be a contiguous uint8[", tokens, ", ", kBytesPerToken,
                    "], got ", shape_of(out));
  if (tokens == 0) return;
  const c10::cuda::CUDAGuard guard(kv_c.device());
  content = vector_ready(content);
  rope = vector_ready(rope);
  // The rows of `out` are the slots 0..T-1 of a cache of ceil(T / 64) blocks.
  const PagedRows rows{out.data_ptr<uint8_t>(), int64_t(kPageSize) * kBytesPerToken, tokens};
  check_launch(op, launch_quantize_kv(float_type(op, "kv_c", kv_c), strided_rows(content),
                                      strided_rows(rope), rows, nullptr, IndexType::kInt64, tokens,
                                      c10::cuda::getCurrentCUDAStream()));
}

void append_kv(const at::Tensor& kv_c, const at::Tensor& k_pe, at::Tensor& kv_cache,
               const at::Tensor& slot_mapping) {
  constexpr const char* op = "append_kv";
  auto [content, rope] = kv_inputs(op, kv_c, k_pe);
  check_cache(op, kv_cache, kv_c.device());
  check_cuda(op, "slot_mapping", slot_mapping, kv_c.device());
  TORCH_CHECK_TYPE(
      slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong, op,
      ": slot_mapping must be int32 or int64, got ", slot_mapping.scalar_type());
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1, op, ": slot_mapping must be 1-D, got ",
                    shape_of(slot_mapping));
  // Rows past len(slot_mapping) are CUDA-graph padding and are ignored.
  const int64_t tokens = slot_mapping.numel();
  TORCH_CHECK_VALUE(content.size(0) >= tokens && rope.size(0) >= tokens, op, ": slot_mapping has ",
                    tokens, " entries but kv_c / k_pe have ", content.size(0), " / ", rope.size(0),
                    " rows");
  if (tokens == 0) return;
  const c10::cuda::CUDAGuard guard(kv_c.device());
  content = vector_ready(content.slice(0, 0, tokens));
  rope = vector_ready(rope.slice(0, 0, tokens));
  const at::Tensor slots = slot_mapping.contiguous();
  check_launch(op, launch_quantize_kv(
                       float_type(op, "kv_c", kv_c), strided_rows(content), strided_rows(rope),
                       paged(kv_cache), slots.data_ptr(),
                       slots.scalar_type() == at::kInt ? IndexType::kInt32 : IndexType::kInt64,
                       tokens, c10::cuda::getCurrentCUDAStream()));
}

void gather_kv(const at::Tensor& kv_cache, at::Tensor& dst, const at::Tensor& block_table,
               const at::Tensor& cu_seq_lens, const at::Tensor& token_to_seq, int64_t num_tokens,
               const std::optional<at::Tensor>& seq_starts) {
  constexpr const char* op = "gather_kv";
  const at::Device device = kv_cache.device();
  check_cache(op, kv_cache, device);
  const c10::cuda::CUDAGuard guard(device);
  check_cuda(op, "dst", dst, device);
  const FloatType dst_type = float_type(op, "dst", dst);
  TORCH_CHECK_VALUE(dst.dim() == 2 && dst.size(1) == kHeadSize, op, ": dst must be [tokens, ",
                    kHeadSize, "], got ", shape_of(dst));
  TORCH_CHECK_VALUE(vector_aligned(dst), op,
                    ": dst rows must have unit stride and start 16-byte aligned, got strides ",
                    dst.strides());
  TORCH_CHECK_VALUE(num_tokens >= 0 && num_tokens <= dst.size(0) &&
                        num_tokens <= token_to_seq.numel(),
                    op, ": num_tokens=", num_tokens, " must be within dst (", dst.size(0),
                    " rows) and token_to_seq (", token_to_seq.numel(), " entries)");
  TORCH_CHECK_VALUE(dst.size(0) <= 1 || dst.stride(0) >= kHeadSize, op,
                    ": dst rows must not overlap, got strides ", dst.strides());
  // Indices past int32 (narrowed_int32): a block past the cache, a request past the batch, and
  // for the position seq_starts + (token - cu_seq_lens) a start past int32's top and a
  // cumulative length past its bottom.  The kernel needs both terms non-negative, so either
  // puts the position at 2^31 - 1 or more: past any table of at most kMaxGatherPages columns.
  constexpr int64_t kMaxGatherPages = kInt32Max / kPageSize;
  TORCH_CHECK_VALUE(block_table.dim() != 2 ||
                        (block_table.size(1) >= 1 && block_table.size(1) <= kMaxGatherPages),
                    op, ": block_table must have 1 to ", kMaxGatherPages,
                    " columns (positions are int32), got ", shape_of(block_table));
  const at::Tensor table = int32_indices(op, "block_table", block_table, 2, device, kInt32Max);
  const at::Tensor cu = int32_indices(op, "cu_seq_lens", cu_seq_lens, 1, device, kInt32Min);
  const at::Tensor t2s = int32_indices(op, "token_to_seq", token_to_seq, 1, device, kInt32Max);
  std::optional<at::Tensor> starts;
  if (seq_starts.has_value()) {
    starts = int32_indices(op, "seq_starts", *seq_starts, 1, device, kInt32Max);
  }
  if (num_tokens == 0) return;
  // Requests token_to_seq may name: those with a table row, a cu_seq_lens pair and a start.
  int64_t num_seqs = std::min(table.size(0), cu.size(0) - 1);
  if (starts) num_seqs = std::min(num_seqs, starts->size(0));
  GatherSource src{};
  src.cache = kv_cache.data_ptr<uint8_t>();
  src.block_stride = kv_cache.stride(0);
  src.num_blocks = kv_cache.size(0);
  src.block_table = table.data_ptr<int32_t>();
  src.block_table_stride = table.stride(0);
  src.table_pages = table.size(1);
  src.num_seqs = num_seqs;
  src.cu_seq_lens = cu.data_ptr<int32_t>();
  src.token_to_seq = t2s.data_ptr<int32_t>();
  src.seq_starts = starts ? starts->data_ptr<int32_t>() : nullptr;
  check_launch(op, launch_gather_kv(dst_type, src, dst.data_ptr(), dst.stride(0), num_tokens,
                                    c10::cuda::getCurrentCUDAStream()));
}

void quantize_q(const at::Tensor& q_nope, const at::Tensor& q_pe, at::Tensor& q8,
                at::Tensor& q_scale, at::Tensor& q_pe_scaled) {
  constexpr const char* op = "quantize_q";
  const at::Device device = q_nope.device();
  const FloatType dtype = query_pair_type(op, q_nope, q_pe, device);
  TORCH_CHECK_VALUE(q_nope.dim() >= 1 && q_nope.size(-1) == kKvLoraRank, op,
                    ": q_nope must be [..., ", kKvLoraRank, "], got ", shape_of(q_nope));
  TORCH_CHECK_VALUE(q_pe.dim() == q_nope.dim() && q_pe.size(-1) == kRopeDim &&
                        q_pe.sizes().slice(0, q_pe.dim() - 1) ==
                            q_nope.sizes().slice(0, q_nope.dim() - 1),
                    op, ": q_pe must be [..., ", kRopeDim, "] with the leading shape of q_nope ",
                    shape_of(q_nope), ", got ", shape_of(q_pe));
  const c10::IntArrayRef lead = q_nope.sizes().slice(0, q_nope.dim() - 1);
  auto with_last = [&](int64_t width) {
    std::vector<int64_t> sizes(lead.begin(), lead.end());
    sizes.push_back(width);
    return sizes;
  };
  auto check_output = [&](const char* name, const at::Tensor& t, at::ScalarType type,
                          c10::IntArrayRef sizes) {
    check_cuda(op, name, t, device);
    TORCH_CHECK_VALUE(t.scalar_type() == type && t.sizes() == sizes && t.is_contiguous(), op, ": ",
                      name, " must be a contiguous ", c10::toString(type), sizes, ", got ",
                      shape_of(t));
  };
  check_output("q8", q8, at::kFloat8_e4m3fn, with_last(kKvLoraRank));
  check_output("q_scale", q_scale, at::kFloat, lead);
  check_output("q_pe_scaled", q_pe_scaled, at::kBFloat16, with_last(kRopeDim));
  if (q_scale.numel() == 0) return;

  // Rows are (outer, head) pairs: the last leading dimension is the head, the rest fold into
  // `outer` (a view when the strides allow it, as for vLLM's transposed [T, N, 512] bmm output).
  const int64_t heads = lead.empty() ? 1 : lead.back();
  const int64_t outer = q_scale.numel() / heads;
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor nope = vector_ready(q_nope.reshape({outer, heads, kKvLoraRank}));
  const at::Tensor pe = vector_ready(q_pe.reshape({outer, heads, kRopeDim}));
  check_launch(op, launch_quantize_q(
                       dtype, {nope.data_ptr(), nope.stride(0), nope.stride(1)},
                       {pe.data_ptr(), pe.stride(0), pe.stride(1)}, outer, heads,
                       static_cast<uint8_t*>(q8.data_ptr()), q_scale.data_ptr<float>(),
                       q_pe_scaled.data_ptr(), nullptr, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace snapmla::api
