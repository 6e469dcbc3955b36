// Host launcher of the sm_90a SnapMLA decode kernel: TMA tensor maps over the paged cache, launch.
#include "dependent_launch.h"
#include "sm90/decode_kernel.cuh"
#include "sm90/decode_narrow_kernel.cuh"

#include <cudaTypedefs.h>

namespace snapmla::sm90 {
namespace {

// cuTensorMapEncodeTiled from the driver, without linking libcuda (torch loads it already).
PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      ptr = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// A [num_blocks][64 tokens][width] view of one field of the cache rows (`offset` bytes into each
// 656-byte row), copied as boxes of [1][64][box_width] elements.  A box at a block id outside
// the cache is filled with `oob_fill` (zeros, or NaN for a float field).
bool page_map(CUtensorMap* map, const uint8_t* kv_cache, int64_t num_blocks, int64_t block_stride,
              int offset, CUtensorMapDataType type, int width, int box_width,
              CUtensorMapSwizzle swizzle,
              CUtensorMapFloatOOBfill oob_fill = CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(width), kPageSize,
                              static_cast<cuuint64_t>(num_blocks)};
  const cuuint64_t strides[2] = {kBytesPerToken, static_cast<cuuint64_t>(block_stride)};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_width), kPageSize, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  return encode_tiled()(map, type, 3, const_cast<uint8_t*>(kv_cache) + offset, dims, strides, box,
                        elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        oob_fill) == CUDA_SUCCESS;
}

// Whether the current device runs `kKernel` from sm_90a code: the kernel body exists only there
// (compute_89 PTX JIT-compiled for an sm_90 GPU would run the trapping stub).
template <auto kKernel>
bool has_sm90a_binary() {
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, kKernel) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.ptxVersion >= 90 && attr.binaryVersion == 90;
}

// What a launch needs of its kernel, checked and set once per device and kernel: sm_90a code
// (has_sm90a_binary), and more than 48 KB of dynamic shared memory.
// One instantiation per kernel (the four share a function type, so the kernel is a template
// argument, not a parameter).
template <auto kKernel>
const char* prepare_once(int smem_bytes, int device) {
  constexpr int kMaxDevices = 64;
  static bool ready[kMaxDevices] = {};
  if (device >= 0 && device < kMaxDevices && ready[device]) return nullptr;
  if (!has_sm90a_binary<kKernel>()) {
    return "decode_sm90: this build has no sm_90a code (build with SNAPMLA_ARCHS containing 90a)";
  }
  if (cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes) !=
      cudaSuccess) {
    return cudaGetErrorString(cudaGetLastError());
  }
  if (device >= 0 && device < kMaxDevices) ready[device] = true;
  return nullptr;
}

template <auto kKernel>
const char* launch(dim3 grid, int threads, int smem_bytes, int device,
                   const CUtensorMap& content_map, const CUtensorMap& rope_map,
                   const CUtensorMap& scale_map, const DecodeParams& params, cudaStream_t stream,
                   bool dependent) {
  if (const char* err = prepare_once<kKernel>(smem_bytes, device)) return err;
  // As a dependent launch (dependent_launch.h) the CTAs are placed while the query
  // quantization (or the planner) drains, and wait for it in the kernel.
  const cudaError_t err = launch_kernel(kKernel, grid, dim3(threads), smem_bytes, stream,
                                        dependent, content_map, rope_map, scale_map, params);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace

bool has_sm90a_code() {
  // The four kernels are built for the same targets: one stands for all.
  return has_sm90a_binary<decode_kernel<kScheduleSplitRoles>>();
}

const char* launch_decode_sm90(const DecodeParams& params, const uint8_t* kv_cache,
                               int64_t num_blocks, int64_t block_stride, int batch,
                               cudaStream_t stream, bool after_own_launch) {
  // The op layer (csrc/api) checked the GPU's architecture, the row count and the schedule.
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return "decode_sm90: cannot query the CUDA device";
  if (encode_tiled() == nullptr) return "decode_sm90: the driver has no cuTensorMapEncodeTiled";
  CUtensorMap content_map, rope_map, scale_map;
  if (!page_map(&content_map, kv_cache, num_blocks, block_stride, kContentOffset,
                CU_TENSOR_MAP_DATA_TYPE_UINT8, kKvLoraRank, kSwizzleRowBytes,
                CU_TENSOR_MAP_SWIZZLE_128B) ||
      !page_map(&rope_map, kv_cache, num_blocks, block_stride, kRopeOffset,
                CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, kRopeDim, kRopeDim,
                CU_TENSOR_MAP_SWIZZLE_128B) ||
      // Scales of a block id outside the cache read as NaN (checked_scale keeps it), so the
      // request's output shows the bad id; the content and RoPE boxes there read zeros.
      !page_map(&scale_map, kv_cache, num_blocks, block_stride, kScaleOffset,
                CU_TENSOR_MAP_DATA_TYPE_FLOAT32, kScaleBoxFloats, kScaleBoxFloats,
                CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA)) {
    return "decode_sm90: cuTensorMapEncodeTiled rejected the kv_cache layout";
  }
  if (params.schedule == kScheduleNarrow) {
    // One CTA per (request, split): the grid's x is the request.
    const dim3 grid(batch, 1, params.max_splits);
    return params.num_rows <= 16
               ? launch<decode_narrow_kernel<16>>(grid, kNarrowThreads,
                        NarrowConfig<16>::kSmemAlloc, device, content_map, rope_map, scale_map,
                        params, stream, after_own_launch)
               : launch<decode_narrow_kernel<32>>(grid, kNarrowThreads,
                        NarrowConfig<32>::kSmemAlloc, device, content_map, rope_map, scale_map,
                        params, stream, after_own_launch);
  }
  const dim3 grid(batch, (params.num_rows + kBlockRows - 1) / kBlockRows, params.max_splits);
  return params.schedule == kScheduleSplitRoles
             ? launch<decode_kernel<kScheduleSplitRoles>>(grid, kThreads, kSmemAlloc, device,
                      content_map, rope_map, scale_map, params, stream, after_own_launch)
             : launch<decode_kernel<kScheduleFree>>(grid, kThreads, kSmemAlloc, device,
                      content_map, rope_map, scale_map, params, stream, after_own_launch);
}

}  // namespace snapmla::sm90
