// Programmatic dependent launch (PDL, sm_90 and later) of the Hopper decode kernel right after our
// own query quantization (with or without the split planner) or the planner alone.  After any
// other kernel (a pre-quantized query with a fixed split count or a given plan) it is an
// ordinary launch: that kernel's author made no promise about the kernels before it.  The
// combine is a programmatic dependent of our decode kernel, which never triggers its
// dependents early: the combine's CTAs are placed only once every decode CTA has exited (a
// trigger at the decode's start made 4 x 128 x 4k 6% slower, for reasons not established:
// docs/decode-kernels.md).  A failed launch clears the runtime's last error, as the caller
// reports it, so that the next launch does not.
//
// A kernel launched with the attribute may start before the kernel ahead of it in the stream
// has finished: its CTAs become resident while the previous grid drains, so the launch
// latency between the two (a few microseconds, which short decodes feel) is hidden.  The rules
// that keep this exact:
//   - a kernel launched with the attribute calls wait_for_prior_grids() before its first
//     access to global memory: the wait returns once the previous grid has completed and its
//     writes are visible.  Nothing before the wait may read or write global memory.
//   - a kernel calls allow_dependent_launch() when the next grid may be scheduled; the next
//     grid still waits for this one's completion before touching memory, so where the call
//     sits only decides how early the next grid's CTAs are placed.  The next grid is placed
//     only after every CTA of this one has called it or exited, so a waiting CTA never takes
//     an SM that this grid still needs.
// Both device calls are no-ops before sm_90 and in a kernel launched without the attribute.
#pragma once

#include <cuda_runtime.h>

namespace snapmla {

__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem_bytes, stream>>>(args...), as a programmatic dependent of the
// previous kernel in `stream` when `dependent` is true (the kernel must then follow the rules
// above).
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, int smem_bytes,
                          cudaStream_t stream, bool dependent, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = dependent ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, static_cast<Args&&>(args)...);
  if (err != cudaSuccess) cudaGetLastError();
  return err;
}

}  // namespace snapmla
