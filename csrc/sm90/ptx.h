// PTX wrappers of the sm_90a instructions the decode kernels use: mbarriers, TMA, named
// barriers, setmaxnreg, WGMMA (FP8 and BF16, shared-memory and register A operands) and their
// descriptors, the 128-byte swizzle, and a few approximate math and packing helpers.  Each is
// one instruction or a short fixed sequence; the kernels (decode_kernel.cuh,
// decode_narrow_kernel.cuh) read as algorithms over these.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "sm90/config.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SNAPMLA_SM90_DEVICE 1
#endif

namespace snapmla::sm90 {

#ifdef SNAPMLA_SM90_DEVICE
namespace device {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Makes the barriers' initialization visible to the other threads and to TMA, before any use.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Waits for the completion of the barrier phase with the given parity.  The suspend-time hint
// lets the thread sleep until the phase completes instead of polling: without it the producer's
// polling of the empty barrier took about 2,200 issue slots per page from the consumer warps
// sharing its scheduler (Nsight Compute).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  constexpr uint32_t kSuspendNs = 1000000;
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity), "r"(kSuspendNs)
        : "memory");
  } while (!done);
}

// A TMA box copy global -> shared at (x, token 0, block) of a [blocks][64][row] tensor map; it
// signals `bar` with its byte count.
__device__ __forceinline__ void tma_load_page(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                              int32_t x, int32_t block) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(x), "r"(0), "r"(block)
      : "memory");
}

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Generic-proxy shared-memory writes become visible to the async proxy (WGMMA operand reads).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Counts this thread at barrier `id` without waiting; shared-memory writes before it are visible
// to the threads whose bar.sync on `id` it completes.
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// Waits until at most kPending of this warpgroup's committed WGMMA groups are still in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Pins every access to WGMMA operand registers (accumulators, register A fragments) to its side
// of the neighbouring volatile asm: placed after wgmma_wait, reads of the results cannot move
// above the wait; placed before wgmma_fence, earlier reads and writes cannot sink between the
// fence and the WGMMA, which PTX makes undefined (CUTLASS's warpgroup_fence_operand).
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int N>
__device__ __forceinline__ void fence_operands(uint32_t (&a)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// WGMMA shared-memory descriptor of a K-major tile of 128-byte rows with the 128-byte swizzle:
// 8-row groups 1024 bytes apart (stride byte offset); the leading byte offset is unused for
// swizzled K-major tiles.  Stepping K by 32 bytes inside the row adds to the start address (the
// hardware applies the swizzle to the final address, hence the 1024-byte tile alignment).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// The descriptor of the tile `bytes` further on (start address field, in 16-byte units, of a
// shared-memory address below 256 KB: adding cannot carry out of the field).
__device__ __forceinline__ uint64_t desc_at(uint64_t desc, uint32_t bytes) {
  return desc + (bytes >> 4);
}

// Byte offset of (row, byte) in a [rows][128 bytes] tile with the 128-byte swizzle: the 16-byte
// chunk index is XORed with the row index mod 8 (what TMA SWIZZLE_128B writes).
__device__ __forceinline__ uint32_t sw128_offset(uint32_t row, uint32_t byte) {
  return row * kSwizzleRowBytes + ((((byte >> 4) ^ row) & 7) << 4) + (byte & 15);
}

// Flushing subnormal results to zero makes this one MUFU.EX2 (without .ftz: three more
// instructions per call, 100 per thread and page).  The arguments are m_old - m and s - m <= 0;
// a result below 2^-126 of the row's largest term changes neither l nor any FP8 P value.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1 / x by one MUFU.RCP (at most 1 ulp off) where the IEEE division would add a refinement and
// a slow-path branch (about 9 instructions): the narrow kernel's per-row sigma_P reciprocals.
// x is in [2^-126, 2^126] (kPScaleFloor), so the result is normal.
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Two floats to two e4m3 bytes (round to nearest even, saturating: min(x, 448) of the
// reference), x0 in the low byte.
__device__ __forceinline__ uint16_t pack_e4m3x2(float x0, float x1) {
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(x1), "f"(x0));
  return pair;
}

// Four floats to four e4m3 bytes, x0 in the lowest byte.
__device__ __forceinline__ uint32_t pack_e4m3x4(float x0, float x1, float x2, float x3) {
  return static_cast<uint32_t>(pack_e4m3x2(x0, x1)) |
         (static_cast<uint32_t>(pack_e4m3x2(x2, x3)) << 16);
}

// c ? a : b as one SELP: written as a conditional on two elements of a register array, nvcc
// may turn it into a dynamically indexed load, which puts the array in local memory.
__device__ __forceinline__ float select(bool c, float a, float b) {
  float r;
  asm("{\n .reg .pred p;\n setp.ne.u32 p, %1, 0;\n selp.f32 %0, %2, %3, p;\n}"
      : "=f"(r) : "r"(static_cast<uint32_t>(c)), "f"(a), "f"(b));
  return r;
}

// threadIdx.x by a volatile read: the compiler cannot hoist it, or registers derived from it,
// out of the caller's loop.
__device__ __forceinline__ uint32_t fresh_thread_index() {
  uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  return tid;
}

// Four 8x8 matrices of 16-bit elements from shared memory, transposed (ldmatrix .trans).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t (&d)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(addr)
               : "memory");
}

// Four 8x8 matrices of 16-bit elements to shared memory (stmatrix).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&d)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
               "r"(d[0]), "r"(d[1]), "r"(d[2]), "r"(d[3])
               : "memory");
}

// op over the 16 accumulator values of row h (0, 1) of a thread's 64-column fragment, as a
// pairwise tree.
template <typename Op>
__device__ __forceinline__ float row_reduce(const float (&x)[32], int h, Op op) {
  float r[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) r[j] = op(x[4 * j + 2 * h], x[4 * j + 2 * h + 1]);
#pragma unroll
  for (int w = 4; w >= 1; w /= 2)
#pragma unroll
    for (int j = 0; j < w; ++j) r[j] = op(r[j], r[j + w]);
  return r[0];
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// Accumulator operand lists of the WGMMA wrappers below: "+f"(d[0]) .. "+f"(d[N - 1]).
#define SNAPMLA_ACC16(d)                                                                      \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),         \
      "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
      "+f"(d[14]), "+f"(d[15])
#define SNAPMLA_ACC32(d)                                                                      \
  SNAPMLA_ACC16(d), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),          \
      "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]),           \
      "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// The narrow kernel's (decode_narrow_kernel.cuh) N = 16 tiles, 8 accumulators per thread.
#define SNAPMLA_ACC8(d)                                                                       \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])

// D[64x16 fp32] (+)= A[64x32 e4m3] . B[16x32 e4m3]^T, both K-major in shared memory.
__device__ __forceinline__ void wgmma_m64n16k32_e4m3(float (&d)[8], uint64_t desc_a,
                                                     uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n}\n"
      : SNAPMLA_ACC8(d)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D[64x16 fp32] (+)= A[64x16 bf16] . B[16x16 bf16]^T, both K-major in shared memory.
__device__ __forceinline__ void wgmma_m64n16k16_bf16(float (&d)[8], uint64_t desc_a,
                                                     uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
      : SNAPMLA_ACC8(d)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D[64x16 fp32] (+)= A[64x32 e4m3, registers] . B[16x32 e4m3, K-major shared memory]^T.
__device__ __forceinline__ void wgmma_m64n16k32_e4m3_rs(float (&d)[8], const uint32_t (&a)[4],
                                                        uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"
      : SNAPMLA_ACC8(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

// D[64x32 fp32] (+)= A[64x32 e4m3] . B[32x32 e4m3]^T, both K-major in shared memory.
__device__ __forceinline__ void wgmma_m64n32k32_e4m3(float (&d)[16], uint64_t desc_a,
                                                     uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "%16, %17, p, 1, 1;\n}\n"
      : SNAPMLA_ACC16(d)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D[64x32 fp32] (+)= A[64x16 bf16] . B[32x16 bf16]^T, both K-major in shared memory.
__device__ __forceinline__ void wgmma_m64n32k16_bf16(float (&d)[16], uint64_t desc_a,
                                                     uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "%16, %17, p, 1, 1, 0, 0;\n}\n"
      : SNAPMLA_ACC16(d)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D[64x64 fp32] (+)= A[64x32 e4m3] . B[64x32 e4m3]^T, both K-major in shared memory.
__device__ __forceinline__ void wgmma_m64n64k32_e4m3(float (&d)[32], uint64_t desc_a,
                                                     uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1;\n}\n"
      : SNAPMLA_ACC32(d)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D[64x64 fp32] (+)= A[64x16 bf16] . B[64x16 bf16]^T, both K-major in shared memory.
__device__ __forceinline__ void wgmma_m64n64k16_bf16(float (&d)[32], uint64_t desc_a,
                                                     uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n}\n"
      : SNAPMLA_ACC32(d)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D[64x32 fp32] (+)= A[64x32 e4m3, registers] . B[32x32 e4m3, K-major shared memory]^T.
__device__ __forceinline__ void wgmma_m64n32k32_e4m3_rs(float (&d)[16], const uint32_t (&a)[4],
                                                        uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "{%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
      : SNAPMLA_ACC16(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

// D[64x64 fp32] (+)= A[64x32 e4m3, registers] . B[64x32 e4m3, K-major shared memory]^T.
__device__ __forceinline__ void wgmma_m64n64k32_e4m3_rs(float (&d)[32], const uint32_t (&a)[4],
                                                        uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : SNAPMLA_ACC32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

#undef SNAPMLA_ACC8
#undef SNAPMLA_ACC32
#undef SNAPMLA_ACC16

}  // namespace device
#endif  // SNAPMLA_SM90_DEVICE

}  // namespace snapmla::sm90
