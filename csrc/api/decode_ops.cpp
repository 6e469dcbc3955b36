// The split-KV decode ops of torch.ops._snapmla_C: checks, the launch shape, and the launches of
// the split planner, the Hopper decode kernels (csrc/sm90/) and the combine (csrc/split_kv.cu).
//
// decode_sm90 is what vLLM calls once per layer and step, so its host cost matters as much as
// the kernels' (eager mode runs it for every mixed prefill+decode batch): one op call from
// Python, two or three launches (query quantization, with the split planner in one more block
// unless the step's plan from plan_decode_sm90 is given; the decode; the combine only when some
// request can be cut into several runs), no host sync, nothing computed per call that depends
// only on the device.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/safe_numerics.h>

#include "api/checks.h"
#include "api/ops.h"
#include "cache_kernels.h"
#include "format.h"
#include "sm90/config.h"
#include "sm90/decode.h"
#include "split_kv.h"

namespace snapmla::api {
namespace {

constexpr double kLog2E = 1.4426950408889634;

// The kernels copy query rows and store outputs with 16-byte vectors.
void check_rows_aligned(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(vector_aligned(t), op, ": ", name,
                    " rows must be contiguous and start 16-byte aligned, got strides ",
                    t.strides());
}

// [B, s_q, H, width]; the caller checks the dtype.
void check_query(const char* op, const char* name, const at::Tensor& t, int64_t width) {
  TORCH_CHECK_VALUE(t.dim() == 4 && t.size(3) == width, op, ": ", name,
                    " must be [batch, s_q, heads, ", width, "], got ", shape_of(t));
}

int64_t resolve_schedule(const char* op, int64_t schedule, int64_t rows) {
  if (schedule < 0) return rows <= sm90::kNarrowMaxRows ? sm90::kScheduleNarrow
                                                        : sm90::kScheduleSplitRoles;
  TORCH_CHECK_VALUE(schedule == sm90::kScheduleFree || schedule == sm90::kScheduleSplitRoles ||
                        schedule == sm90::kScheduleNarrow,
                    op, ": schedule must be -1 (by row count), ", sm90::kScheduleFree, " (free), ",
                    sm90::kScheduleSplitRoles, " (split-roles) or ", sm90::kScheduleNarrow,
                    " (narrow), got ", schedule);
  TORCH_CHECK_VALUE(schedule != sm90::kScheduleNarrow || rows <= sm90::kNarrowMaxRows, op,
                    ": the narrow kernel takes at most ", sm90::kNarrowMaxRows,
                    " query rows (s_q x heads), got ", rows);
  return schedule;
}

// What the launch shape needs of a GPU, read once per device.
struct DeviceInfo {
  int major = 0, minor = 0, multiprocessors = 0;
};

const DeviceInfo& device_info(const char* op, const at::Device& device) {
  constexpr int kMaxDevices = 64;
  static DeviceInfo infos[kMaxDevices];
  const int index = device.index();
  TORCH_CHECK(index >= 0 && index < kMaxDevices, op, ": CUDA device index ", index,
              " out of range");
  DeviceInfo& info = infos[index];
  if (info.multiprocessors == 0) {
    DeviceInfo read;
    check_launch(op, cudaDeviceGetAttribute(&read.major, cudaDevAttrComputeCapabilityMajor, index));
    check_launch(op, cudaDeviceGetAttribute(&read.minor, cudaDevAttrComputeCapabilityMinor, index));
    check_launch(op, cudaDeviceGetAttribute(&read.multiprocessors,
                                            cudaDevAttrMultiProcessorCount, index));
    info = read;
  }
  return info;
}

// The launch shape: CTAs per split index and how many run at once (one per SM for every Hopper
// kernel), from the device properties device_info reads once per device.
struct LaunchShape {
  int programs;
  int slots;
  int max_splits;
};

LaunchShape launch_shape(const char* op, const at::Device& device, int64_t batch, int64_t rows,
                         int64_t schedule, int64_t table_pages, int64_t num_splits) {
  const int64_t row_blocks =
      schedule == sm90::kScheduleNarrow ? 1 : (rows + sm90::kBlockRows - 1) / sm90::kBlockRows;
  const int64_t programs = batch * row_blocks;
  const int slots = device_info(op, device).multiprocessors;
  const int max_splits = num_splits > 0 ? static_cast<int>(num_splits)
                                        : max_splits_for(batch, programs, slots, table_pages);
  return {static_cast<int>(programs), slots, max_splits};
}

void check_sm90_device(const char* op, const at::Device& device) {
  const DeviceInfo& info = device_info(op, device);
  TORCH_CHECK(info.major == 9 && info.minor == 0, op, " needs an sm_90 (Hopper) GPU, but ",
              device, " is sm_", info.major, info.minor,
              "; vllm_snapmla.kernels.triton_decode serves other GPUs");
}

// The table and lengths as the kernels and the planner read them: the first `batch` rows, int32.
std::tuple<at::Tensor, at::Tensor> table_and_lens(const char* op, const at::Device& device,
                                                  int64_t batch, const at::Tensor& block_table,
                                                  const at::Tensor& seq_lens) {
  check_cuda(op, "block_table", block_table, device);
  TORCH_CHECK_TYPE(block_table.scalar_type() == at::kInt || block_table.scalar_type() == at::kLong,
                   op, ": block_table must be int32 (or int64, copied to int32), got ",
                   block_table.scalar_type());
  // vLLM's persistent buffers may hold more rows than the batch: the first `batch` are read.
  TORCH_CHECK_VALUE(block_table.dim() == 2 && block_table.size(0) >= batch &&
                        block_table.size(1) >= 1 &&
                        (block_table.size(1) == 1 || block_table.stride(1) == 1),
                    op, ": block_table must be [>= ", batch,
                    ", max_blocks >= 1] with unit column stride, got ", shape_of(block_table),
                    " strides ", block_table.strides());
  check_cuda(op, "seq_lens", seq_lens, device);
  TORCH_CHECK_TYPE(seq_lens.scalar_type() == at::kInt || seq_lens.scalar_type() == at::kLong, op,
                   ": seq_lens must be int32 (or int64, copied to int32), got ",
                   seq_lens.scalar_type());
  TORCH_CHECK_VALUE(seq_lens.dim() == 1 && seq_lens.size(0) >= batch, op,
                    ": seq_lens must be [>= ", batch, "], got ", shape_of(seq_lens));
  // Past int32: a block id past the cache, a length past the table.
  return {narrowed_int32(block_table.narrow(0, 0, batch), kInt32Max),
          narrowed_int32(seq_lens.narrow(0, 0, batch), kInt32Max).contiguous()};
}

// The checks both decode entries share: cache, table, lengths, scale; returns the table and the
// lengths as the kernels read them (the first `batch` rows, int32).
std::tuple<at::Tensor, at::Tensor> check_decode_inputs(const char* op, const at::Device& device,
                                                       int64_t batch, const at::Tensor& kv_cache,
                                                       const at::Tensor& block_table,
                                                       const at::Tensor& seq_lens,
                                                       double softmax_scale, int64_t num_splits) {
  // The kernels fold the scale into an exponent FFMA and take a row's largest scaled logit from
  // its largest unscaled one: both need a positive scale, and softmax_scale * log2(e) is a
  // float that must neither overflow (NaN outputs) nor flush to 0 (uniform attention).
  const double scale_log2 = softmax_scale * kLog2E;
  TORCH_CHECK_VALUE(softmax_scale > 0 && std::isfinite(softmax_scale) && scale_log2 >= FLT_MIN &&
                        scale_log2 <= FLT_MAX,
                    op, ": softmax_scale must be positive, with softmax_scale * log2(e) a normal "
                    "float32, got ", softmax_scale);
  check_cache(op, kv_cache, device);
  // The Hopper kernels' tensor maps need at least one block.
  TORCH_CHECK_VALUE(kv_cache.stride(0) > 0 && kv_cache.size(0) > 0 &&
                        kv_cache.size(0) <= kInt32Max,
                    op, ": kv_cache must have a positive block stride and 1 to 2^31 - 1 blocks, "
                    "got ", kv_cache.size(0), " blocks of stride ", kv_cache.stride(0));
  TORCH_CHECK_VALUE(num_splits >= 0 && num_splits <= 65535, op,
                    ": num_splits must be 0 (planned on the GPU) or in [1, 65535], got ",
                    num_splits);
  return table_and_lens(op, device, batch, block_table, seq_lens);
}

// A call's scratch memory (quantized query, split plan, partial results) in one allocation: vLLM
// calls decode once per layer and step, and in eager mode each at::empty is host time the GPU
// may wait for.  Each buffer starts 512-byte aligned, as the caching allocator aligns its blocks.
class Scratch {
 public:
  // Reserves the product of `factors` bytes.  The shapes are checked, but a direct op caller's
  // expanded (stride-0) inputs can still make that product pass int64: refuse rather than wrap.
  int64_t reserve(std::initializer_list<int64_t> factors) {
    int64_t bytes = 1;
    bool overflow = false;
    for (const int64_t factor : factors) overflow |= c10::mul_overflows(bytes, factor, &bytes);
    overflow |= c10::add_overflows(bytes, int64_t(511), &bytes);
    const int64_t offset = size_;
    overflow |= c10::add_overflows(size_, bytes / 512 * 512, &size_);
    TORCH_CHECK_VALUE(!overflow, "decode: the scratch memory of this batch exceeds 2^63 bytes");
    return offset;
  }
  void allocate(const at::TensorOptions& opts) {
    if (size_ > 0) buffer_ = at::empty({size_}, opts.dtype(at::kByte));
  }
  // The buffer reserved at `offset`; null for one not reserved (offset -1).
  template <class T>
  T* at(int64_t offset) const {
    if (offset < 0) return nullptr;
    return reinterpret_cast<T*>(static_cast<uint8_t*>(buffer_.data_ptr()) + offset);
  }

 private:
  int64_t size_ = 0;
  at::Tensor buffer_;
};

// Where a call's split plan and partial results live in its Scratch (-1: not needed).
struct SplitSpace {
  int64_t plan = -1, part_out = -1, part_lse = -1;
};

SplitSpace reserve_splits(Scratch& scratch, int64_t batch, int64_t rows, const LaunchShape& shape,
                          bool own_plan) {
  SplitSpace space;
  if (batch == 0 || rows == 0) return space;
  if (own_plan) space.plan = scratch.reserve({sizeof(int32_t)});
  if (shape.max_splits > 1) {
    space.part_out = scratch.reserve({batch, shape.max_splits, rows, kKvLoraRank, sizeof(float)});
    space.part_lse = scratch.reserve({batch, shape.max_splits, rows, sizeof(float)});
  }
  return space;
}

// The query rows the decode reads: pointers and strides of DecodeParams.
struct QueryRows {
  const uint8_t* q8;
  const float* q_scale;
  const uint8_t* q_pe;
  int64_t q8_stride[3];       // bytes
  int64_t q_scale_stride[3];  // elements
  int64_t q_pe_stride[3];     // bytes
};

// The rows of contiguous [batch, s_q, heads, ...] buffers at `q8`, `q_scale`, `q_pe`.
QueryRows contiguous_rows(const uint8_t* q8, const float* q_scale, const uint8_t* q_pe,
                          int64_t s_q, int64_t heads) {
  QueryRows q{q8, q_scale, q_pe, {}, {}, {}};
  const int64_t per_token[3] = {s_q * heads, heads, 1};
  for (int d = 0; d < 3; ++d) {
    q.q8_stride[d] = per_token[d] * kKvLoraRank;
    q.q_scale_stride[d] = per_token[d];
    q.q_pe_stride[d] = per_token[d] * kRopeDim * 2;
  }
  return q;
}

// The decode and, where some request may take several runs, the combine, for `batch` requests of
// `s_q` x `heads` query rows.  `plan` is the split plan, the call's own or a given one (null:
// equal cut); `part_out` and `part_lse` are set exactly when shape.max_splits > 1
// (reserve_splits); `after_own_launch`: the last kernel in the stream is our quantization or
// planner.
std::tuple<at::Tensor, at::Tensor> run_decode(const char* op, const QueryRows& query,
                                              int64_t batch, int64_t s_q, int64_t heads,
                                              const at::TensorOptions& opts,
                                              const at::Tensor& kv_cache,
                                              const at::Tensor& table, const at::Tensor& lens,
                                              double softmax_scale, bool causal,
                                              const LaunchShape& shape, int64_t schedule,
                                              const int32_t* plan, float* part_out,
                                              float* part_lse, bool after_own_launch) {
  const int64_t rows = s_q * heads;
  at::Tensor out = at::empty({batch, s_q, heads, kKvLoraRank}, opts.dtype(at::kBFloat16));
  at::Tensor lse = at::empty({batch, heads, s_q}, opts.dtype(at::kFloat));
  if (batch == 0 || rows == 0) return {out, lse};
  sm90::DecodeParams p{};
  p.q8 = query.q8;
  p.q_scale = query.q_scale;
  p.q_pe = query.q_pe;
  for (int d = 0; d < 3; ++d) {
    p.q8_stride[d] = query.q8_stride[d];
    p.q_scale_stride[d] = query.q_scale_stride[d];
    p.q_pe_stride[d] = query.q_pe_stride[d];
  }
  p.block_table = table.data_ptr<int32_t>();
  p.block_table_stride = table.stride(0);
  p.seq_lens = lens.data_ptr<int32_t>();
  p.table_pages = static_cast<int>(table.size(1));
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.part_out = part_out;
  p.part_lse = part_lse;
  p.pages_per_split = plan;
  p.num_heads = static_cast<int>(heads);
  p.s_q = static_cast<int>(s_q);
  p.num_rows = static_cast<int>(rows);
  p.max_splits = shape.max_splits;
  p.causal = causal ? 1 : 0;
  p.qk_scale_log2 = static_cast<float>(softmax_scale * kLog2E);
  p.schedule = static_cast<int>(schedule);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const char* err = sm90::launch_decode_sm90(
      p, static_cast<const uint8_t*>(kv_cache.data_ptr()), kv_cache.size(0), kv_cache.stride(0),
      static_cast<int>(batch), stream, after_own_launch);
  TORCH_CHECK(err == nullptr, op, ": ", err);
  if (shape.max_splits > 1) {
    CombineParams c{};
    c.part_out = p.part_out;
    c.part_lse = p.part_lse;
    c.seq_lens = p.seq_lens;
    c.pages_per_split = p.pages_per_split;
    c.table_pages = p.table_pages;
    c.max_splits = shape.max_splits;
    c.out = p.out;
    c.lse = p.lse;
    c.batch = static_cast<int>(batch);
    c.num_heads = p.num_heads;
    c.s_q = p.s_q;
    c.num_rows = p.num_rows;
    check_launch(op, launch_combine(c, stream, /*after_own_decode=*/true));
  }
  return {out, lse};
}

SplitPlanParams plan_params(const at::Tensor& lens, int64_t table_pages, int64_t batch,
                            int32_t* pages_per_split, const LaunchShape& shape) {
  SplitPlanParams plan{};
  plan.seq_lens = lens.data_ptr<int32_t>();
  plan.table_pages = static_cast<int>(table_pages);
  plan.batch = static_cast<int>(batch);
  plan.programs = shape.programs;
  plan.slots = shape.slots;
  plan.max_splits = shape.max_splits;
  plan.overhead_pages = kSplitOverheadPages;
  plan.pages_per_split = pages_per_split;
  return plan;
}

// What both decode entries settle before their first launch: the limits, the GPU, the inputs,
// the kernel and the launch shape.  The caller holds the device guard.
struct DecodeSetup {
  at::Tensor table, lens;   // the first `batch` rows, int32
  int64_t schedule;
  LaunchShape shape;
};

DecodeSetup setup_decode(const char* op, const at::Device& device, int64_t batch, int64_t rows,
                         const at::Tensor& kv_cache, const at::Tensor& block_table,
                         const at::Tensor& seq_lens, double softmax_scale, int64_t num_splits,
                         int64_t schedule) {
  TORCH_CHECK_VALUE(rows <= 65535 * 64 && batch <= kInt32Max, op, ": batch ", batch,
                    " (at most 2^31 - 1) or query rows per request ", rows,
                    " (at most 65535 x 64) exceed the launch limits");
  check_sm90_device(op, device);
  auto [table, lens] = check_decode_inputs(op, device, batch, kv_cache, block_table, seq_lens,
                                           softmax_scale, num_splits);
  schedule = resolve_schedule(op, schedule, rows);
  const LaunchShape shape =
      launch_shape(op, device, batch, rows, schedule, table.size(1), num_splits);
  // The combine's grid holds the requests in y.  Planned splits give more programs than two
  // waves of the GPU one split (max_splits_for), so only a fixed count reaches this.
  TORCH_CHECK_VALUE(shape.max_splits == 1 || batch <= 65535, op, ": ", batch,
                    " requests cut into ", shape.max_splits, " splits each: more than 65535 "
                    "requests take num_splits 1 or 0 (planned)");
  return {table, lens, schedule, shape};
}

// A split plan buffer, as plan_decode_sm90 writes it and the decode reads it: int32[1] on the
// op's GPU.
void check_plan(const char* op, const at::Tensor& plan, const at::Device& device) {
  check_cuda(op, "plan", plan, device);
  check_shape(op, "plan", plan, at::kInt, {1});
}

// Which split plan a decode call's kernels read: the call's own, made in its first launch (the
// query quantization, or the planner alone), a given one (plan_decode_sm90's, made once per
// step), or none (one split, or a fixed split count: equal cuts).
struct PlanSource {
  bool own = false;                // the call reserves a plan buffer and plans into it
  const int32_t* given = nullptr;  // the caller's plan, read in place of the call's own

  const int32_t* read(const int32_t* own_plan) const { return own ? own_plan : given; }
};

PlanSource plan_source(const char* op, const std::optional<at::Tensor>& plan,
                       const at::Device& device, int64_t num_splits, const DecodeSetup& d,
                       int64_t batch, int64_t rows) {
  PlanSource source;
  if (plan.has_value()) {
    check_plan(op, *plan, device);
    TORCH_CHECK_VALUE(num_splits == 0, op, ": a plan goes with num_splits 0 (planned), got ",
                      num_splits);
  }
  // With one split (or nothing to decode) no kernel reads a plan.
  if (num_splits != 0 || d.shape.max_splits == 1 || batch == 0 || rows == 0) return source;
  if (plan.has_value()) {
    source.given = plan->data_ptr<int32_t>();
  } else {
    source.own = true;
  }
  return source;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decode_sm90(const at::Tensor& q_nope, const at::Tensor& q_pe,
                                               const at::Tensor& kv_cache,
                                               const at::Tensor& block_table,
                                               const at::Tensor& seq_lens, double softmax_scale,
                                               bool causal, int64_t num_splits, int64_t schedule,
                                               const std::optional<at::Tensor>& plan) {
  constexpr const char* op = "decode_sm90";
  const at::Device device = q_nope.device();
  const FloatType dtype = query_pair_type(op, q_nope, q_pe, device);
  check_query(op, "q_nope", q_nope, kKvLoraRank);
  check_query(op, "q_pe", q_pe, kRopeDim);
  TORCH_CHECK_VALUE(q_pe.sizes().slice(0, 3) == q_nope.sizes().slice(0, 3), op,
                    ": q_pe must be [batch, s_q, heads, ", kRopeDim, "] with q_nope's ",
                    shape_of(q_nope), " leading shape, got ", shape_of(q_pe));
  const int64_t batch = q_nope.size(0), s_q = q_nope.size(1), heads = q_nope.size(2);
  const int64_t rows = s_q * heads;
  const c10::cuda::CUDAGuard guard(device);
  const DecodeSetup d = setup_decode(op, device, batch, rows, kv_cache, block_table, seq_lens,
                                     softmax_scale, num_splits, schedule);
  const PlanSource plans = plan_source(op, plan, device, num_splits, d, batch, rows);

  const int64_t tokens = batch * s_q;
  Scratch scratch;
  const int64_t q8_at = scratch.reserve({tokens, heads, kKvLoraRank});
  const int64_t q_scale_at = scratch.reserve({tokens, heads, sizeof(float)});
  const int64_t q_pe_at = scratch.reserve({tokens, heads, kRopeDim, 2});
  const SplitSpace space = reserve_splits(scratch, batch, rows, d.shape, plans.own);
  scratch.allocate(q_nope.options());
  if (tokens == 0 || heads == 0) {
    return run_decode(op, {}, batch, s_q, heads, q_nope.options(), kv_cache, d.table, d.lens,
                      softmax_scale, causal, d.shape, d.schedule, nullptr, nullptr, nullptr,
                      false);
  }
  uint8_t* q8 = scratch.at<uint8_t>(q8_at);
  float* q_scale = scratch.at<float>(q_scale_at);
  uint8_t* q_pe_scaled = scratch.at<uint8_t>(q_pe_at);
  int32_t* own_plan = scratch.at<int32_t>(space.plan);
  SplitPlanParams plan_of_batch{};
  if (plans.own) plan_of_batch = plan_params(d.lens, d.table.size(1), batch, own_plan, d.shape);
  // Rows are (b * s_q + i, head): vLLM's [T, H, 512] bmm output viewed as [B, s_q, H, 512]
  // folds into [B * s_q, H] rows without a copy.
  const at::Tensor nope = vector_ready(q_nope.reshape({tokens, heads, kKvLoraRank}));
  const at::Tensor pe = vector_ready(q_pe.reshape({tokens, heads, kRopeDim}));
  check_launch(op, launch_quantize_q(dtype, {nope.data_ptr(), nope.stride(0), nope.stride(1)},
                                     {pe.data_ptr(), pe.stride(0), pe.stride(1)}, tokens, heads,
                                     q8, q_scale, q_pe_scaled,
                                     plans.own ? &plan_of_batch : nullptr,
                                     c10::cuda::getCurrentCUDAStream()));
  // The quantization (with the planner, unless a plan was given) is the last kernel in the stream.
  return run_decode(op, contiguous_rows(q8, q_scale, q_pe_scaled, s_q, heads), batch, s_q, heads,
                    q_nope.options(), kv_cache, d.table, d.lens, softmax_scale, causal, d.shape,
                    d.schedule, plans.read(own_plan), scratch.at<float>(space.part_out),
                    scratch.at<float>(space.part_lse), /*after_own_launch=*/true);
}

std::tuple<at::Tensor, at::Tensor> decode_sm90_quantized(
    const at::Tensor& q8, const at::Tensor& q_scale, const at::Tensor& q_pe_scaled,
    const at::Tensor& kv_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
    double softmax_scale, bool causal, int64_t num_splits, int64_t schedule,
    const std::optional<at::Tensor>& plan) {
  constexpr const char* op = "decode_sm90_quantized";
  const at::Device device = q8.device();
  check_cuda(op, "q8", q8, device);
  check_query(op, "q8", q8, kKvLoraRank);
  const int64_t batch = q8.size(0), s_q = q8.size(1), heads = q8.size(2);
  const int64_t rows = s_q * heads;
  check_shape(op, "q8", q8, at::kFloat8_e4m3fn, {batch, s_q, heads, kKvLoraRank});
  check_rows_aligned(op, "q8", q8);
  check_cuda(op, "q_scale", q_scale, device);
  check_shape(op, "q_scale", q_scale, at::kFloat, {batch, s_q, heads});
  check_cuda(op, "q_pe_scaled", q_pe_scaled, device);
  check_shape(op, "q_pe_scaled", q_pe_scaled, at::kBFloat16, {batch, s_q, heads, kRopeDim});
  check_rows_aligned(op, "q_pe_scaled", q_pe_scaled);
  const c10::cuda::CUDAGuard guard(device);
  const DecodeSetup d = setup_decode(op, device, batch, rows, kv_cache, block_table, seq_lens,
                                     softmax_scale, num_splits, schedule);
  const PlanSource plans = plan_source(op, plan, device, num_splits, d, batch, rows);
  Scratch scratch;
  const SplitSpace space = reserve_splits(scratch, batch, rows, d.shape, plans.own);
  scratch.allocate(q8.options());
  int32_t* own_plan = scratch.at<int32_t>(space.plan);
  if (plans.own) {
    check_launch(op, launch_split_plan(plan_params(d.lens, d.table.size(1), batch, own_plan,
                                                   d.shape),
                                       c10::cuda::getCurrentCUDAStream()));
  }
  QueryRows query{static_cast<const uint8_t*>(q8.data_ptr()), q_scale.data_ptr<float>(),
                  static_cast<const uint8_t*>(q_pe_scaled.data_ptr()), {}, {}, {}};
  for (int d3 = 0; d3 < 3; ++d3) {
    query.q8_stride[d3] = q8.stride(d3);
    query.q_scale_stride[d3] = q_scale.stride(d3);
    query.q_pe_stride[d3] = q_pe_scaled.stride(d3) * 2;
  }
  return run_decode(op, query, batch, s_q, heads, q8.options(), kv_cache, d.table, d.lens,
                    softmax_scale, causal, d.shape, d.schedule, plans.read(own_plan),
                    scratch.at<float>(space.part_out), scratch.at<float>(space.part_lse),
                    /*after_own_launch=*/plans.own);
}

void plan_decode_sm90(const at::Tensor& seq_lens, const at::Tensor& block_table, int64_t batch,
                      int64_t s_q, int64_t heads, at::Tensor& plan) {
  constexpr const char* op = "plan_decode_sm90";
  const at::Device device = seq_lens.device();
  TORCH_CHECK_VALUE(batch >= 0 && batch <= kInt32Max && s_q >= 1 && heads >= 1 &&
                        s_q <= 65535 * 64 && heads <= 65535 * 64 && s_q * heads <= 65535 * 64,
                    op, ": batch, s_q or heads out of range (batch ", batch, ", s_q ", s_q,
                    ", heads ", heads, ")");
  check_plan(op, plan, device);
  const c10::cuda::CUDAGuard guard(device);
  check_sm90_device(op, device);
  auto [table, lens] = table_and_lens(op, device, batch, block_table, seq_lens);
  const int64_t rows = s_q * heads;
  // The launch shape decode_sm90 takes for these shapes (its kernel chosen by row count).
  const LaunchShape shape = launch_shape(op, device, batch, rows, resolve_schedule(op, -1, rows),
                                         table.size(1), 0);
  if (shape.max_splits == 1 || batch == 0) return;   // one split: the plan is not read
  check_launch(op, launch_split_plan(plan_params(lens, table.size(1), batch,
                                                 plan.data_ptr<int32_t>(), shape),
                                     c10::cuda::getCurrentCUDAStream()));
}

bool has_sm90a_code() { return sm90::has_sm90a_code(); }

void split_plan(const at::Tensor& seq_lens, at::Tensor& pages_per_split, int64_t table_pages,
                int64_t batch, int64_t programs, int64_t slots, int64_t max_splits) {
  constexpr const char* op = "split_plan";
  const at::Device device = seq_lens.device();
  check_cuda(op, "seq_lens", seq_lens, device);
  TORCH_CHECK_TYPE(seq_lens.scalar_type() == at::kInt, op, ": seq_lens must be int32, got ",
                   seq_lens.scalar_type());
  TORCH_CHECK_VALUE(seq_lens.dim() == 1 && seq_lens.size(0) >= batch && seq_lens.is_contiguous(),
                    op, ": seq_lens must be a contiguous [>= ", batch, "], got ",
                    shape_of(seq_lens));
  check_cuda(op, "pages_per_split", pages_per_split, device);
  check_shape(op, "pages_per_split", pages_per_split, at::kInt, {1});
  TORCH_CHECK_VALUE(batch >= 0 && programs >= 1 && slots >= 1 && max_splits >= 1 &&
                        max_splits <= 65535 && programs <= kInt32Max && table_pages >= 1 &&
                        table_pages <= kInt32Max / kPageSize,
                    op, ": out of range: table_pages ", table_pages, " (1 to (2^31 - 1) / ",
                    kPageSize, "), batch ", batch, " (>= 0), programs ", programs,
                    " (1 to 2^31 - 1), slots ", slots, " (>= 1) or max_splits ", max_splits,
                    " (1 to 65535)");
  const c10::cuda::CUDAGuard guard(device);
  const LaunchShape shape{static_cast<int>(programs), static_cast<int>(slots),
                          static_cast<int>(max_splits)};
  check_launch(op, launch_split_plan(plan_params(seq_lens, table_pages, batch,
                                                 pages_per_split.data_ptr<int32_t>(), shape),
                                     c10::cuda::getCurrentCUDAStream()));
}

void combine_splits(const at::Tensor& part_out, const at::Tensor& part_lse,
                    const at::Tensor& seq_lens, const std::optional<at::Tensor>& pages_per_split,
                    int64_t table_pages, at::Tensor& out, at::Tensor& lse) {
  constexpr const char* op = "combine_splits";
  const at::Device device = part_out.device();
  check_cuda(op, "part_out", part_out, device);
  TORCH_CHECK_VALUE(part_out.dim() == 4 && part_out.size(3) == kKvLoraRank &&
                        part_out.scalar_type() == at::kFloat && part_out.is_contiguous(),
                    op, ": part_out must be a contiguous float32[batch, splits, rows, ",
                    kKvLoraRank, "], got ", shape_of(part_out));
  const int64_t batch = part_out.size(0), splits = part_out.size(1), rows = part_out.size(2);
  // A request's runs are counted against the splits (split_range divides by them).
  TORCH_CHECK_VALUE(splits >= 1 && splits <= 65535, op,
                    ": part_out must hold 1 to 65535 splits per request, got ", splits);
  TORCH_CHECK_VALUE(batch <= 65535, op, ": part_out must hold at most 65535 requests (the "
                    "combine's grid), got ", batch);
  check_cuda(op, "part_lse", part_lse, device);
  check_shape(op, "part_lse", part_lse, at::kFloat, {batch, splits, rows});
  TORCH_CHECK_VALUE(part_lse.is_contiguous(), op, ": part_lse must be contiguous");
  check_cuda(op, "seq_lens", seq_lens, device);
  TORCH_CHECK_VALUE(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 &&
                        seq_lens.size(0) >= batch && seq_lens.is_contiguous(),
                    op, ": seq_lens must be a contiguous int32[>= ", batch, "], got ",
                    shape_of(seq_lens));
  if (pages_per_split.has_value()) {
    check_cuda(op, "pages_per_split", *pages_per_split, device);
    check_shape(op, "pages_per_split", *pages_per_split, at::kInt, {1});
  }
  check_cuda(op, "out", out, device);
  TORCH_CHECK_VALUE(out.scalar_type() == at::kBFloat16 && out.dim() == 4 && out.size(0) == batch &&
                        out.size(1) * out.size(2) == rows && out.size(3) == kKvLoraRank &&
                        out.is_contiguous(),
                    op, ": out must be a contiguous bfloat16[", batch, ", s_q, heads, ",
                    kKvLoraRank, "] with s_q x heads = ", rows, ", got ", shape_of(out));
  check_cuda(op, "lse", lse, device);
  check_shape(op, "lse", lse, at::kFloat, {batch, out.size(2), out.size(1)});
  TORCH_CHECK_VALUE(lse.is_contiguous(), op, ": lse must be contiguous");
  TORCH_CHECK_VALUE(table_pages >= 1 && table_pages <= kInt32Max / kPageSize, op,
                    ": table_pages must be in [1, 2^31 / 64), got ", table_pages);
  const c10::cuda::CUDAGuard guard(device);
  CombineParams c{};
  c.part_out = part_out.data_ptr<float>();
  c.part_lse = part_lse.data_ptr<float>();
  c.seq_lens = seq_lens.data_ptr<int32_t>();
  c.pages_per_split = pages_per_split.has_value() ? pages_per_split->data_ptr<int32_t>() : nullptr;
  c.table_pages = static_cast<int>(table_pages);
  c.max_splits = static_cast<int>(splits);
  c.out = out.data_ptr();
  c.lse = lse.data_ptr<float>();
  c.batch = static_cast<int>(batch);
  c.num_heads = static_cast<int>(out.size(2));
  c.s_q = static_cast<int>(out.size(1));
  c.num_rows = static_cast<int>(rows);
  check_launch(op, launch_combine(c, c10::cuda::getCurrentCUDAStream(),
                                  /*after_own_decode=*/false));
}

}  // namespace snapmla::api
