// torch.ops._snapmla_C.decode_sm90: input checks and launch of the sm_90a SnapMLA decode kernel
// (csrc/sm90/decode/).  Registered as a fragment of the _snapmla_C library defined in api.cpp.
#include <cmath>
#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "sm90/decode/config.h"
#include "sm90/decode/snapmla_decode_sm90.h"
#include "snapmla_format.h"

namespace snapmla {
namespace {

constexpr const char* kOp = "decode_sm90";

std::string shape_of(const at::Tensor& t) { return c10::str(t.scalar_type(), t.sizes()); }

void check_on(const char* name, const at::Tensor& t, const at::Device& device) {
  TORCH_CHECK(t.is_cuda(), kOp, ": ", name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.device() == device, kOp, ": ", name, " is on ", t.device(),
              " but the op runs on ", device);
}

void check_shape(const char* name, const at::Tensor& t, at::ScalarType type,
                 at::IntArrayRef sizes) {
  TORCH_CHECK_TYPE(t.scalar_type() == type, kOp, ": ", name, " must be ", type, ", got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.sizes() == sizes, kOp, ": ", name, " must have shape ", sizes, ", got ",
                    shape_of(t));
}

// The kernel copies query rows with 16-byte vector loads.
void check_rows_aligned(const char* name, const at::Tensor& t) {
  bool ok = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    ok = ok && (t.size(d) <= 1 || (t.stride(d) * t.element_size()) % 16 == 0);
  }
  TORCH_CHECK_VALUE(ok, kOp, ": ", name, " rows must be contiguous and start 16-byte aligned, ",
                    "got strides ", t.strides());
}

void decode_sm90(const at::Tensor& q8, const at::Tensor& q_scale, const at::Tensor& q_pe_scaled,
                 const at::Tensor& kv_cache, const at::Tensor& block_table,
                 const at::Tensor& seq_lens, at::Tensor& out, at::Tensor& lse,
                 double softmax_scale, bool causal, int64_t num_splits, int64_t schedule,
                 bool promote_pv) {
  const at::Device device = q8.device();
  // The kernels fold the scale into an exponent FFMA and take a row's largest scaled logit from
  // its largest unscaled one: both need a positive scale.
  TORCH_CHECK_VALUE(softmax_scale > 0 && std::isfinite(softmax_scale), kOp,
                    ": softmax_scale must be positive and finite, got ", softmax_scale);
  check_on("q8", q8, device);
  TORCH_CHECK_VALUE(q8.dim() == 4 && q8.size(3) == kKvLoraRank, kOp,
                    ": q8 must be [batch, s_q, heads, ", kKvLoraRank, "], got ", shape_of(q8));
  const int64_t batch = q8.size(0), s_q = q8.size(1), heads = q8.size(2);
  const int64_t rows = s_q * heads;
  check_shape("q8", q8, at::kFloat8_e4m3fn, {batch, s_q, heads, kKvLoraRank});
  check_rows_aligned("q8", q8);
  check_on("q_scale", q_scale, device);
  check_shape("q_scale", q_scale, at::kFloat, {batch, s_q, heads});
  check_on("q_pe_scaled", q_pe_scaled, device);
  check_shape("q_pe_scaled", q_pe_scaled, at::kBFloat16, {batch, s_q, heads, kRopeDim});
  check_rows_aligned("q_pe_scaled", q_pe_scaled);

  check_on("kv_cache", kv_cache, device);
  TORCH_CHECK_VALUE(kv_cache.scalar_type() == at::kByte && kv_cache.dim() == 3 &&
                        kv_cache.size(1) == kPageSize && kv_cache.size(2) == kBytesPerToken,
                    kOp, ": kv_cache must be uint8[num_blocks, ", kPageSize, ", ", kBytesPerToken,
                    "], got ", shape_of(kv_cache));
  TORCH_CHECK_VALUE(kv_cache.stride(2) == 1 && kv_cache.stride(1) == kBytesPerToken &&
                        kv_cache.stride(0) % 16 == 0 && kv_cache.stride(0) > 0 &&
                        reinterpret_cast<uintptr_t>(kv_cache.data_ptr()) % 16 == 0,
                    kOp, ": kv_cache blocks must be contiguous [", kPageSize, ", ",
                    kBytesPerToken, "] byte arrays starting 16-byte aligned, got strides ",
                    kv_cache.strides());

  check_on("block_table", block_table, device);
  TORCH_CHECK_TYPE(block_table.scalar_type() == at::kInt, kOp, ": block_table must be int32, got ",
                   block_table.scalar_type());
  TORCH_CHECK_VALUE(block_table.dim() == 2 && block_table.size(0) == batch &&
                        block_table.stride(1) == 1,
                    kOp, ": block_table must be [", batch, ", max_blocks] with unit column stride, "
                    "got ", shape_of(block_table), " strides ", block_table.strides());
  check_on("seq_lens", seq_lens, device);
  check_shape("seq_lens", seq_lens, at::kInt, {batch});
  TORCH_CHECK_VALUE(seq_lens.is_contiguous(), kOp, ": seq_lens must be contiguous");

  TORCH_CHECK_VALUE(num_splits >= 1 && num_splits <= 65535, kOp,
                    ": num_splits must be in [1, 65535], got ", num_splits);
  TORCH_CHECK_VALUE(schedule == sm90::kScheduleFree || schedule == sm90::kScheduleSplitRoles ||
                        schedule == sm90::kScheduleNarrow || schedule == sm90::kScheduleNarrow16,
                    kOp, ": schedule must be ", sm90::kScheduleFree, " (free), ",
                    sm90::kScheduleSplitRoles, " (split-roles), ", sm90::kScheduleNarrow,
                    " (narrow) or ", sm90::kScheduleNarrow16, " (narrow-16), got ", schedule);
  TORCH_CHECK_VALUE(schedule != sm90::kScheduleNarrow || rows <= sm90::kNarrowMaxRows, kOp,
                    ": the narrow kernel takes at most ", sm90::kNarrowMaxRows,
                    " query rows (s_q x heads), got ", rows);
  TORCH_CHECK_VALUE(promote_pv || schedule == sm90::kScheduleFree, kOp,
                    ": promote_pv=False exists only with the free schedule (", sm90::kScheduleFree,
                    "), got schedule ", schedule);
  check_on("out", out, device);
  check_on("lse", lse, device);
  if (num_splits == 1) {
    check_shape("out", out, at::kBFloat16, {batch, s_q, heads, kKvLoraRank});
    check_shape("lse", lse, at::kFloat, {batch, heads, s_q});
  } else {
    check_shape("out (split partials)", out, at::kFloat, {batch, num_splits, rows, kKvLoraRank});
    check_shape("lse (split partials)", lse, at::kFloat, {batch, num_splits, rows});
  }
  TORCH_CHECK_VALUE(out.is_contiguous() && lse.is_contiguous(), kOp,
                    ": out and lse must be contiguous");
  check_rows_aligned("out", out);   // the epilogues store 16-byte vectors
  TORCH_CHECK_VALUE(batch <= 2147483647 && rows <= 65535 * 64 && kv_cache.size(0) <= 2147483647 &&
                        batch * ((rows + 15) / 16) <= 2147483647,
                    kOp, ": batch, rows or num_blocks exceeds the launch limits");
  if (batch == 0 || rows == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  sm90::DecodeParams p{};
  p.q8 = static_cast<const uint8_t*>(q8.data_ptr());
  p.q_scale = q_scale.data_ptr<float>();
  p.q_pe = static_cast<const uint8_t*>(q_pe_scaled.data_ptr());
  for (int d = 0; d < 3; ++d) {
    p.q8_stride[d] = q8.stride(d);
    p.q_scale_stride[d] = q_scale.stride(d);
    p.q_pe_stride[d] = q_pe_scaled.stride(d) * 2;
  }
  p.block_table = block_table.data_ptr<int32_t>();
  p.block_table_stride = block_table.stride(0);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.num_heads = static_cast<int>(heads);
  p.s_q = static_cast<int>(s_q);
  p.num_rows = static_cast<int>(rows);
  p.num_splits = static_cast<int>(num_splits);
  p.causal = causal ? 1 : 0;
  p.qk_scale_log2 = static_cast<float>(softmax_scale * 1.4426950408889634);
  p.schedule = static_cast<int>(schedule);
  p.promote_pv = promote_pv ? 1 : 0;
  const char* err = sm90::launch_decode_sm90(
      p, static_cast<const uint8_t*>(kv_cache.data_ptr()), kv_cache.size(0), kv_cache.stride(0),
      static_cast<int>(batch), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == nullptr, err);
}

// Writes only into the tensors it is given: nothing to do for fake-tensor tracing.
void decode_sm90_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, double, bool,
                      int64_t, int64_t, bool) {}

}  // namespace
}  // namespace snapmla

// The schema's default schedule is split-roles.
static_assert(snapmla::sm90::kScheduleSplitRoles == 1, "update decode_sm90's schema default");

TORCH_LIBRARY_FRAGMENT(_snapmla_C, m) {
  m.def(
      "decode_sm90(Tensor q8, Tensor q_scale, Tensor q_pe_scaled, Tensor kv_cache, "
      "Tensor block_table, Tensor seq_lens, Tensor(a!) out, Tensor(b!) lse, float softmax_scale, "
      "bool causal, int num_splits, int schedule=1, bool promote_pv=True) -> ()");
}

TORCH_LIBRARY_IMPL(_snapmla_C, CUDA, m) { m.impl("decode_sm90", &snapmla::decode_sm90); }

TORCH_LIBRARY_IMPL(_snapmla_C, Meta, m) { m.impl("decode_sm90", &snapmla::decode_sm90_meta); }
