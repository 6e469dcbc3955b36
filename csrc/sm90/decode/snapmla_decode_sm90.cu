// Host launcher of the sm_90a SnapMLA decode kernel: TMA tensor maps over the paged cache, launch.
#include "sm90/decode/snapmla_decode_sm90.cuh"
#include "sm90/decode/snapmla_decode_sm90_narrow.cuh"

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
// 656-byte row), copied as boxes of [1][64][box_width] elements.
bool page_map(CUtensorMap* map, const uint8_t* kv_cache, int64_t num_blocks, int64_t block_stride,
              int offset, CUtensorMapDataType type, int width, int box_width,
              CUtensorMapSwizzle swizzle) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(width), kPageSize,
                              static_cast<cuuint64_t>(num_blocks)};
  const cuuint64_t strides[2] = {kBytesPerToken, static_cast<cuuint64_t>(block_stride)};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_width), kPageSize, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  return encode_tiled()(map, type, 3, const_cast<uint8_t*>(kv_cache) + offset, dims, strides, box,
                        elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

const char* launch_decode_sm90(const DecodeParams& params, const uint8_t* kv_cache,
                               int64_t num_blocks, int64_t block_stride, int batch,
                               cudaStream_t stream) {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return "decode_sm90: cannot query the CUDA device";
  }
  if (major != 9 || minor != 0) {
    return "decode_sm90 needs an sm_90 (Hopper) GPU; use vllm_snapmla.triton.decode elsewhere";
  }
  const bool narrow = params.schedule == kScheduleNarrow || params.schedule == kScheduleNarrow16;
  if (params.schedule == kScheduleNarrow && params.num_rows > kNarrowMaxRows) {
    return "decode_sm90: the narrow kernel takes at most 32 query rows (s_q x heads)";
  }
  const bool narrow16 = narrow && (params.num_rows <= 16 || params.schedule == kScheduleNarrow16);
  const auto kernel = narrow16                                ? decode_narrow_kernel<16>
                      : narrow                                ? decode_narrow_kernel<32>
                      : !params.promote_pv                    ? decode_kernel<kScheduleFree, false>
                      : params.schedule == kScheduleSplitRoles
                          ? decode_kernel<kScheduleSplitRoles>
                          : decode_kernel<kScheduleFree>;
  const int threads = narrow ? kNarrowThreads : kThreads;
  const int smem_bytes = narrow16 ? NarrowConfig<16>::kSmemAlloc
                         : narrow ? NarrowConfig<32>::kSmemAlloc
                                  : kSmemAlloc;
  // The kernel body exists only in sm_90a code; compute_89 PTX JIT-compiled for this GPU would
  // run an empty kernel.
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess || attr.ptxVersion < 90 ||
      attr.binaryVersion != 90) {
    cudaGetLastError();
    return "decode_sm90: this build has no sm_90a code (build with SNAPMLA_ARCHS containing 90a)";
  }
  if (encode_tiled() == nullptr) return "decode_sm90: the driver has no cuTensorMapEncodeTiled";

  CUtensorMap content_map, rope_map, scale_map;
  if (!page_map(&content_map, kv_cache, num_blocks, block_stride, kContentOffset,
                CU_TENSOR_MAP_DATA_TYPE_UINT8, kKvLoraRank, kSwizzleRowBytes,
                CU_TENSOR_MAP_SWIZZLE_128B) ||
      !page_map(&rope_map, kv_cache, num_blocks, block_stride, kRopeOffset,
                CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, kRopeDim, kRopeDim,
                CU_TENSOR_MAP_SWIZZLE_128B) ||
      !page_map(&scale_map, kv_cache, num_blocks, block_stride, kScaleOffset,
                CU_TENSOR_MAP_DATA_TYPE_FLOAT32, kScaleBoxFloats, kScaleBoxFloats,
                CU_TENSOR_MAP_SWIZZLE_NONE)) {
    return "decode_sm90: cuTensorMapEncodeTiled rejected the kv_cache layout";
  }

  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes) !=
      cudaSuccess) {
    return cudaGetErrorString(cudaGetLastError());
  }
  // The narrow kernel's grid x is (request, row block) with the row block fastest; the 64-row
  // kernel's row blocks are its y.
  const int block_rows = narrow16 ? 16 : narrow ? kNarrowMaxRows : kBlockRows;
  const int row_blocks = (params.num_rows + block_rows - 1) / block_rows;
  const dim3 grid = narrow ? dim3(batch * row_blocks, 1, params.num_splits)
                           : dim3(batch, row_blocks, params.num_splits);
  kernel<<<grid, threads, smem_bytes, stream>>>(content_map, rope_map, scale_map, params);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace snapmla::sm90
