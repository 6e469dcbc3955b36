// The narrow sm_90a SnapMLA decode kernels: requests of at most 16 or 32 query rows (s_q x
// heads), i.e. DeepSeek-V3 on one TP8 rank (16 heads), with MTP (s_q = 2) or on TP4 (32 heads).
//
// The 64-row kernel (decode_kernel.cuh) pads 16 rows to a 64-row WGMMA tile: three
// quarters of its tensor-core and softmax work are padding, and every page's V^T round trip
// through shared memory (32 KB written, 32 KB read) serves only 16 rows.  Here the roles of the
// operands are swapped, so that the 64 of WGMMA's M are the page's tokens and its N the kRows:
//   S^T[64 tokens, kRows] = K8 . Q8^T (+ RoPE in BF16): A = the page's content tile as TMA
//                           wrote it (K-major, 128-byte swizzle), B = the query tile;
//   O^T[512 cols, kRows] += V^T . P8^T: A = V^T from registers, transposed from the page's
//                           content rows (16 rows: 16-byte loads and 4x4 byte transposes during
//                           the QK; 32 rows: ldmatrix.trans and byte permutes per M tile during
//                           the PV); B = P8^T, written to shared memory by the softmax.
// O^T is 64 (16 rows) or 128 (32 rows) registers per thread, so one consumer warpgroup holds all
// 512 columns; two consumer warpgroups take alternate pages, each with its own running softmax
// state (m, peak, sigma_P) and O^T, and are merged at the end like two KV splits (a page is a
// serial chain in one warpgroup, and the other's warps hide its latencies).  Per page and row the
// arithmetic is the 64-row kernel's (docs/format.md "Decode"): FP32 promotion of the content QK
// (16 rows: after every WGMMA; 32 rows: every 64 columns, as the 64-row kernel), the page's
// sigma_P, a fresh FP32 accumulator for each page's PV.  The softmax's per-row reductions over
// the page's tokens run across the four warps (shared memory, one named barrier per page for the
// maxima), and the row sums l are kept per thread (in shared memory) and reduced once, at the
// end.  The 32-row form is bound by its per-page chain of dependent instructions (two consumer
// warps per scheduler hide little), so instruction counts on that chain are its speed.
//
// 384 threads: WG0 and WG1 the consumers (pages of even and odd split-local index), WG2 the TMA
// producer (one thread, a kNarrowStages ring).  The grid's x is the request: one block of at
// most kRows rows per request.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "dependent_launch.h"
#include "sm90/config.h"
#include "sm90/decode.h"
#include "sm90/pipeline.cuh"
#include "sm90/ptx.h"
#include "split_kv.h"

namespace snapmla::sm90 {

#ifdef SNAPMLA_SM90_DEVICE
namespace device {

// out[b] byte i = in[i] byte b: four 4-byte rows to four 4-byte columns.
__device__ __forceinline__ void transpose_4x4_bytes(const uint32_t (&in)[4], uint32_t (&out)[4]) {
  const uint32_t lo01 = __byte_perm(in[0], in[1], 0x5140);   // in0.0 in1.0 in0.1 in1.1
  const uint32_t hi01 = __byte_perm(in[0], in[1], 0x7362);   // in0.2 in1.2 in0.3 in1.3
  const uint32_t lo23 = __byte_perm(in[2], in[3], 0x5140);
  const uint32_t hi23 = __byte_perm(in[2], in[3], 0x7362);
  out[0] = __byte_perm(lo01, lo23, 0x5410);
  out[1] = __byte_perm(lo01, lo23, 0x7632);
  out[2] = __byte_perm(hi01, hi23, 0x5410);
  out[3] = __byte_perm(hi01, hi23, 0x7632);
}

// The PV A fragments of one page for the calling thread (warp w, lane = 4 g + q): a[mt][kk][j]
// is register j of M tile mt (64 output columns) and K step kk (32 token positions).
//
// Which columns and tokens: WGMMA gives the thread A rows 16 w + g + 8 (j & 1) of every tile
// and K positions 4 q + i + 16 (j >> 1) (byte i).  Rows are output columns of our choosing:
// row 16 w + g + 8 h of tile mt is column 16 (8 w + g) + 2 mt + h, so the thread's 16 columns
// are one 16-byte chunk of a content row (chunk g of content tile w).  K position
// P = 32 kk + 16 jh + 4 q + i is token 8 (4 kk + 2 jh + i / 2) + 2 q + i % 2 (narrow_position
// below inverts it; P8^T is stored in the same order), so the thread reads tokens
// 8 a + 2 q + e, whose rows have (token mod 8) = 2 q + e: with the 128-byte swizzle, the eight
// lanes of each quarter-warp read eight different 16-byte bank groups.  Empty slots (token >=
// live, kMasked) read as zeros: their bytes may be NaN, and 0 x NaN is NaN.
template <bool kMasked>
__device__ __forceinline__ void load_v_fragments(const uint8_t* tile, int g, int q, int live,
                                                 uint32_t (&a)[kNarrowPTiles][2][4]) {
#pragma unroll
  for (int kk = 0; kk < 2; ++kk)
#pragma unroll
    for (int jh = 0; jh < 2; ++jh) {
      uint32_t rows[4][4];   // [i][u]: token of position i, columns 4u .. 4u + 3 of the chunk
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int e = i & 1;
        const int t = 8 * (4 * kk + 2 * jh + (i >> 1)) + 2 * q + e;
        const uint4 v = *reinterpret_cast<const uint4*>(tile + t * kSwizzleRowBytes +
                                                        ((g ^ (2 * q + e)) << 4));
        const uint32_t keep = (!kMasked || t < live) ? ~0u : 0u;
        rows[i][0] = v.x & keep;
        rows[i][1] = v.y & keep;
        rows[i][2] = v.z & keep;
        rows[i][3] = v.w & keep;
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const uint32_t in[4] = {rows[0][u], rows[1][u], rows[2][u], rows[3][u]};
        uint32_t out[4];
        transpose_4x4_bytes(in, out);
        // Column 4u + bb of the chunk = 2 mt + h: tile mt = 2u + bb / 2, row parity h = bb % 2.
#pragma unroll
        for (int bb = 0; bb < 4; ++bb) a[2 * u + (bb >> 1)][kk][2 * jh + (bb & 1)] = out[bb];
      }
    }
}

// The K position (0..63) of token t in the PV operands (load_v_fragments's order).
__device__ __forceinline__ int narrow_position(int t) {
  const int a = t >> 3, q = (t >> 1) & 3, i = 2 * (a & 1) + (t & 1);
  return 32 * (a >> 2) + 16 * ((a >> 1) & 1) + 4 * q + i;
}

// The 32-row form's PV A fragments of M tile mt (64 output columns) for the calling thread
// (warp w, lane = 4 g + q, 8 g + ... as in load_v_fragments): a[kk][j] is register j of K step
// kk.  Row 16 w + g + 8 h of tile mt is column 64 mt + 16 w + 2 g + h, so warp w reads one
// 16-byte chunk (4 (mt % 2) + w of content tile mt / 2) of every token.  ldmatrix.x4.trans on
// those chunks, as 8x8 matrices of 16-bit elements whose rows are the tokens 8 mi .. 8 mi + 7
// (matrix mi = 4 kk + register), gives the thread 16-bit column g of rows 2 q and 2 q + 1: the
// bytes of columns 2 g, 2 g + 1 of tokens 8 mi + 2 q, 8 mi + 2 q + 1.  Two matrices' registers
// permuted give the four tokens of one column, in load_v_fragments's K order (narrow_position):
// P8^T is the same for both forms.  Empty slots (token >= live) must hold zeros: the kernel
// clears them in the stage before the PV (their bytes may be NaN, and 0 x NaN is NaN).
__device__ __forceinline__ void load_v_tile(uint32_t content, int mt, int warp, int lane,
                                            uint32_t (&a)[2][4]) {
  const int row = lane & 7;
  const uint32_t base = content + (mt >> 1) * kContentTileBytes +
                        ((((4 * (mt & 1) + warp) ^ row) & 7) << 4);
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    uint32_t r[4];
    ldmatrix_x4_trans(base + (8 * (4 * kk + (lane >> 3)) + row) * kSwizzleRowBytes, r);
#pragma unroll
    for (int jh = 0; jh < 2; ++jh) {
      a[kk][2 * jh] = __byte_perm(r[2 * jh], r[2 * jh + 1], 0x6420);       // column 2 g
      a[kk][2 * jh + 1] = __byte_perm(r[2 * jh], r[2 * jh + 1], 0x7531);   // column 2 g + 1
    }
  }
}

// The WGMMAs of the kRows-row forms (N = kRows).
template <int kRows>
__device__ __forceinline__ void wgmma_qk_e4m3(float (&d)[kRows / 2], uint64_t desc_a,
                                              uint64_t desc_b, int accumulate) {
  if constexpr (kRows == 16) {
    wgmma_m64n16k32_e4m3(d, desc_a, desc_b, accumulate);
  } else {
    wgmma_m64n32k32_e4m3(d, desc_a, desc_b, accumulate);
  }
}

template <int kRows>
__device__ __forceinline__ void wgmma_qk_bf16(float (&d)[kRows / 2], uint64_t desc_a,
                                              uint64_t desc_b, int accumulate) {
  if constexpr (kRows == 16) {
    wgmma_m64n16k16_bf16(d, desc_a, desc_b, accumulate);
  } else {
    wgmma_m64n32k16_bf16(d, desc_a, desc_b, accumulate);
  }
}

template <int kRows>
__device__ __forceinline__ void wgmma_pv_e4m3(float (&d)[kRows / 2], const uint32_t (&a)[4],
                                              uint64_t desc_b, int accumulate) {
  if constexpr (kRows == 16) {
    wgmma_m64n16k32_e4m3_rs(d, a, desc_b, accumulate);
  } else {
    wgmma_m64n32k32_e4m3_rs(d, a, desc_b, accumulate);
  }
}

// O^T tile += its page's PV `acc` (promoted into FP32 O^T), after the rescale by gamma.
template <int kAcc, int kSlots>
__device__ __forceinline__ void promote_pv(float (&o_tile)[kAcc], float (&acc)[kAcc],
                                           const float (&gamma)[kSlots]) {
  fence_operands(acc);
#pragma unroll
  for (int v = 0; v < kAcc; ++v) {
    o_tile[v] = o_tile[v] * gamma[2 * (v >> 2) + (v & 1)] + acc[v];
  }
}

// reduce_rows's combination of two values.
__device__ __forceinline__ float reduce_op(bool sum, float a, float b) {
  return sum ? a + b : fmaxf(a, b);
}

// A narrow consumer thread's constants for the whole split: its place in the CTA (warp w,
// lane = 4 g + q) and its shared-memory operands; its member functions are steps of a page and
// of the epilogue.  It holds scalars only (the arrays are passed by reference) and everything
// is inlined, so it lives in registers.
template <int kRows>
struct NarrowConsumer {
  using C = NarrowConfig<kRows>;
  static constexpr int kSlots = C::kSlots;

  const DecodeParams& p;
  uint8_t* const smem;   // the dynamic shared memory, 1024-byte aligned
  const int consumer;    // pages c, c + 2, ...
  const int wg_tid, warp, lane, g, q;
  const uint32_t wg_barrier;   // named barrier 1: both consumers
  float* const red;            // the cross-warp reductions: [2][2][kRows][4 warps]
  const uint64_t q8_desc, qpe_desc;
  const int pt_offset;         // this consumer's P8^T tile
  const uint64_t pt_desc;

  __device__ __forceinline__ NarrowConsumer(const DecodeParams& p, uint8_t* smem,
                                            uint32_t smem_base)
      : p(p),
        smem(smem),
        // Broadcast from lane 0, so that the compiler knows it is warp-uniform: the page, stage
        // and descriptor arithmetic derived from it then runs in uniform registers.
        consumer(__shfl_sync(0xffffffff, threadIdx.x / 128, 0)),
        wg_tid(threadIdx.x % 128),
        warp(wg_tid / 32),
        lane(threadIdx.x % 32),
        g(lane / 4),
        q(lane % 4),
        wg_barrier(2 + consumer),
        red(reinterpret_cast<float*>(smem + C::kRed + consumer * C::kRedBytes)),
        q8_desc(sw128_desc(smem_base + C::kQ8)),
        qpe_desc(sw128_desc(smem_base + C::kQpe)),
        pt_offset(C::kPt + consumer * C::kQTileBytes),
        pt_desc(sw128_desc(smem_base + pt_offset)) {}

  // The maxima (`sum` false) or sums over the warpgroup's 64 tokens of kSlots values per slot
  // (x[j * kSlots + k]: quantity j of slot k, j < 2).  First over the 8 lanes sharing q, as a
  // reduce-scatter: at each of the three butterfly steps a lane keeps half of its values and
  // trades the other half with its partner, so it ends with kN / 8 of them (kN / 4 + 2 kN / 8 +
  // ... shuffles instead of 3 kN).  Then over the 4 warps through `red` (one named barrier),
  // where every thread reads the results of its own slots.  `buf` alternates by page: the
  // page's later barriers already order its reads before the next page's writes, so the second
  // buffer is a margin, not a necessity.
  template <int kN>
  __device__ __forceinline__ void reduce_rows(float (&x)[kN], int buf, bool sum) const {
    static_assert(kN == kSlots || kN == 2 * kSlots, "one or two quantities per slot");
    constexpr int kKeep = kN >= 8 ? kN / 8 : 1;   // values a lane holds after the butterfly
    float y[kN];
#pragma unroll
    for (int j = 0; j < kN; ++j) y[j] = x[j];
    int first = 0;   // x index of y[0]
    constexpr int kWidth1 = kN > kKeep ? kN / 2 : kN;
    constexpr int kWidth2 = kWidth1 > kKeep ? kWidth1 / 2 : kWidth1;
    butterfly_step<kN, kKeep>(y, first, 16, sum);   // g's bit 2
    butterfly_step<kWidth1, kKeep>(y, first, 8, sum);
    butterfly_step<kWidth2, kKeep>(y, first, 4, sum);
    float* r = red + buf * 2 * kRows * 4;
#pragma unroll
    for (int j = 0; j < kKeep; ++j) r[red_offset(first + j) + warp] = y[j];
    named_barrier_sync(wg_barrier, 128);
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      const float4 w = *reinterpret_cast<const float4*>(r + red_offset(j));
      x[j] = sum ? (w.x + w.y) + (w.z + w.w) : fmaxf(fmaxf(w.x, w.y), fmaxf(w.z, w.w));
    }
  }

  // One butterfly step of reduce_rows with partner lane ^ d, `y` holding kWidth values before
  // it; `first` is the x index of y[0].
  template <int kWidth, int kKeep, int kN>
  __device__ __forceinline__ void butterfly_step(float (&y)[kN], int& first, int d,
                                                 bool sum) const {
    const bool upper = lane & d;
    if constexpr (kWidth > kKeep) {
      constexpr int kHalf = kWidth / 2;
#pragma unroll
      for (int j = 0; j < kHalf; ++j) {
        const float give = select(upper, y[j], y[kHalf + j]);
        const float keep = select(upper, y[kHalf + j], y[j]);
        y[j] = reduce_op(sum, keep, __shfl_xor_sync(0xffffffff, give, d));
      }
      first += upper ? kHalf : 0;
    } else {
#pragma unroll
      for (int j = 0; j < kWidth; ++j) {
        y[j] = reduce_op(sum, y[j], __shfl_xor_sync(0xffffffff, y[j], d));
      }
    }
  }

  // Consumer 1's O^T fragments and its rows' m, l, amax, for consumer 0's merge (the page ring
  // is free by then).
  __device__ __forceinline__ void store_for_merge(const float (&o)[kNarrowPTiles][C::kAcc],
                                                  const float (&m)[kSlots],
                                                  const float (&l_sum)[kSlots],
                                                  const float (&amax_prev)[kSlots]) const {
    float* const merge = reinterpret_cast<float*>(smem);   // [8 kAcc][128 threads], then rows
    float* const merge_rows = merge + C::kMergeOBytes / 4;    // [kRows][4]: m, l, amax
#pragma unroll
    for (int mt = 0; mt < kNarrowPTiles; ++mt)
#pragma unroll
      for (int v = 0; v < C::kAcc; ++v) merge[(mt * C::kAcc + v) * 128 + wg_tid] = o[mt][v];
    if (warp == 0 && g == 0) {
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        *reinterpret_cast<float4*>(merge_rows + row_of(k) * 4) =
            make_float4(m[k], l_sum[k], amax_prev[k], 0.f);
      }
    }
  }

  // The 16-row form's O^T = gamma O^T + V^T . P8^T (P8^T buffer own % 2), the page's A
  // fragments `a` in registers (load_v_fragments).
  __device__ __forceinline__ void pv_from_registers(float (&o)[kNarrowPTiles][C::kAcc],
                                                    uint32_t (&a)[kNarrowPTiles][2][4],
                                                    const float (&gamma)[kSlots], int own) const {
    // 16 rows: two groups of four M tiles; the first is promoted while the second runs.
    float pv[kNarrowPTiles][C::kAcc];
#pragma unroll
    for (int mt = 0; mt < kNarrowPTiles; ++mt) {
      fence_operands(a[mt][0]);
      fence_operands(a[mt][1]);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      wgmma_fence();
#pragma unroll
      for (int mt = half * kNarrowPTiles / 2; mt < (half + 1) * kNarrowPTiles / 2; ++mt)
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          wgmma_pv_e4m3<kRows>(pv[mt], a[mt][kk],
                               desc_at(pt_desc, 64 * (own & 1) + kk * kWgmmaK8), kk);
        }
      wgmma_commit();
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (half == 0) {
        wgmma_wait<1>();
      } else {
        wgmma_wait<0>();
      }
#pragma unroll
      for (int mt = half * kNarrowPTiles / 2; mt < (half + 1) * kNarrowPTiles / 2; ++mt) {
        promote_pv(o[mt], pv[mt], gamma);
      }
    }
#pragma unroll
    for (int mt = 0; mt < kNarrowPTiles; ++mt) {
      fence_operands(a[mt][0]);   // the next page's loads stay below the completed PV
      fence_operands(a[mt][1]);
    }
  }

  // Content chunk c of the page's QK (at `stage_desc`) into the fresh accumulator `acc`, as a
  // WGMMA group of its own.
  __device__ __forceinline__ void issue_qk_chunk(float (&acc)[C::kAcc], uint64_t stage_desc,
                                                 int c) const {
    fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < C::kQkPromoteCols / kWgmmaK8; ++k) {
      const int col = c * C::kQkPromoteCols + k * kWgmmaK8;
      const uint32_t tile = col / kSwizzleRowBytes, byte = col % kSwizzleRowBytes;
      wgmma_qk_e4m3<kRows>(acc,
                           desc_at(stage_desc, kStageContent + tile * kContentTileBytes + byte),
                           desc_at(q8_desc, tile * C::kQTileBytes + byte), k);
    }
    wgmma_commit();
  }

  // The 32-row form's PV of M tile mt into `pv`: its A fragments `frag` loaded from the stage's
  // `content` tiles, B = P8^T buffer own % 2; a WGMMA group of its own.
  __device__ __forceinline__ void issue_pv_tile(uint32_t (&frag)[2][4], float (&pv)[C::kAcc],
                                                uint32_t content, int mt, int own) const {
    load_v_tile(content, mt, warp, lane, frag);
    fence_operands(frag[0]);
    fence_operands(frag[1]);
    fence_operands(pv);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      wgmma_pv_e4m3<kRows>(pv, frag[kk], desc_at(pt_desc, 64 * (own & 1) + kk * kWgmmaK8), kk);
    }
    wgmma_commit();
  }

  // The thread's rows' softmax state at the split's start, and (warp 0 of consumer 0, g = 0)
  // each row's q * kQk scale and visible length into row_scale and row_visible.  Returns the
  // smallest visible length of the thread's rows: pages below it need no mask.
  __device__ __forceinline__ int init_rows(float (&m)[kSlots], float (&peak)[kSlots],
                                           float (&amax_prev)[kSlots], float* row_scale,
                                           int* row_visible, float* l, int b, int seq_len,
                                           bool valid) const {
    int min_visible = seq_len;
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      const int r = row_of(k);
      const bool row_ok = r < p.num_rows;
      const int qi = row_ok ? r / p.num_heads : 0, qh = row_ok ? r % p.num_heads : 0;
      min_visible = min(min_visible, visible_of(k, seq_len));
      if (threadIdx.x < 4) {
        row_scale[k] = row_ok ? p.q_scale[b * p.q_scale_stride[0] + qi * p.q_scale_stride[1] +
                                          qh * p.q_scale_stride[2]] * p.qk_scale_log2
                              : 0.f;
        row_visible[k] = visible_of(k, seq_len);
      }
      m[k] = -INFINITY;              // running max logit (log2 units)
      peak[k] = 0.f;                 // largest P' so far, at the current m
      amax_prev[k] = kPScaleFloor;   // 448 * sigma_P of the last page
      l[k * 128] = initial_row_sum(valid);   // sum of exp (sigma_P * L), this thread's tokens
    }
    return min_visible;
  }

  // Quantity j / kSlots of slot j % kSlots in a reduction buffer ([2][kRows][4 warps]).
  __device__ __forceinline__ int red_offset(int j) const {
    return ((j / kSlots) * kRows + row_of(j % kSlots)) * 4;
  }

  // The block row (query row of the request) of the thread's slot k.
  __device__ __forceinline__ int row_of(int k) const { return 8 * (k >> 1) + 2 * q + (k & 1); }

  // Query i of s_q sees positions < seq_len - s_q + i + 1 when causal; padded rows see nothing.
  __device__ __forceinline__ int visible_of(int k, int seq_len) const {
    const int r = row_of(k);
    return r < p.num_rows ? seq_len - p.causal * (p.s_q - 1 - r / p.num_heads) : 0;
  }
};

}  // namespace device
#endif  // SNAPMLA_SM90_DEVICE

// Fragment of S^T and O^T (accumulators, N = kRows): value v (0 .. kRows / 2 - 1) of a thread is
// M row 16 warp + g + 8 ((v >> 1) & 1) and N column (query row) 8 (v >> 2) + 2 q + (v & 1).  In
// S^T the M row is the token; in O^T, M row 16 warp + g + 8 h of tile mt is output column
// 16 (8 warp + g) + 2 mt + h (16 rows, load_v_fragments) or 64 mt + 16 warp + 2 g + h (32 rows,
// load_v_tile).  A thread's kRows / 4 query rows ("slots" k = 2 (v >> 2) + (v & 1)) are
// 8 (k >> 1) + 2 q + (k & 1).
template <int kRows>
__global__ void __launch_bounds__(kNarrowThreads, 1)
    decode_narrow_kernel(const __grid_constant__ CUtensorMap content_map,
                         const __grid_constant__ CUtensorMap rope_map,
                         const __grid_constant__ CUtensorMap scale_map, const DecodeParams p) {
#ifdef SNAPMLA_SM90_DEVICE
  using namespace device;
  using C = NarrowConfig<kRows>;
  constexpr int kAcc = C::kAcc;
  constexpr int kSlots = C::kSlots;
  constexpr int kParts = C::kQkParts;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const uint32_t smem_base = smem_addr(smem);
  const uint32_t full_bar = smem_base + C::kBarriers;           // + 8 * stage: page landed
  const uint32_t empty_bar = full_bar + 8 * kNarrowStages;      // + 8 * stage: slot free

  // One CTA per (request, split): a request's rows (at most kRows) are one block.
  const int b = blockIdx.x;
  constexpr int row0 = 0;
  const int split = blockIdx.z;
  // A dependent launch (dependent_launch.h): no global memory before the wait.
  wait_for_prior_grids();
  const auto [seq_len, first_page, num_iters, direct, valid] = split_pages(p, b, split);
  // Splits past the request's last run: nothing to do (split 0 always runs, see decode_kernel).
  if (split > 0 && num_iters == 0) return;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kNarrowStages; ++s) {
      mbar_init(full_bar + 8 * s, 1);
      mbar_init(empty_bar + 8 * s, 128);   // every thread of the page's consumer releases it
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  if (threadIdx.x >= 128 * kNarrowConsumers) {
    // WG2, the producer: its first thread streams the pages into the kNarrowStages ring.
    run_producer_warpgroup<kNarrowStages>(content_map, rope_map, scale_map, p, b, first_page,
                                          num_iters, smem_base, full_bar, empty_bar,
                                          128 * kNarrowConsumers);
    return;
  }

  // ------------------------------------------------------------------ consumers
  setmaxnreg_inc<kConsumerRegs>();
  const NarrowConsumer<kRows> cs(p, smem, smem_base);

  // The query rows into the swizzled B tiles (zeros past num_rows), once.
  stage_query<kRows>(smem + C::kQ8, C::kQTileBytes, smem + C::kQpe, p, b, row0, threadIdx.x,
                     256);
  fence_proxy_async();

  // Per-row state of the thread's query rows (slots).  Query i of s_q sees positions
  // < seq_len - s_q + i + 1 when causal; padded rows see nothing.  Only the last pages need the
  // mask (pages past min_visible), which reads the per-row limits from row_visible.
  float m[kSlots], peak[kSlots], amax_prev[kSlots];
  float* const row_scale = reinterpret_cast<float*>(smem + C::kRowScale) + cs.q * kSlots;
  int* const row_visible = reinterpret_cast<int*>(smem + C::kRowVisible) + cs.q * kSlots;
  float* const l = reinterpret_cast<float*>(smem + C::kRowSums + cs.consumer * C::kRowSumsBytes) +
                   cs.wg_tid;   // l[k * 128]: this thread's share of row k's sum of exp
  const int min_visible =
      cs.init_rows(m, peak, amax_prev, row_scale, row_visible, l, b, seq_len, valid);
  named_barrier_sync(1, 256);   // the query tiles and row_scale are written

  // This thread's two tokens of every page (S^T rows) and their K positions in P8^T.
  const int token0 = 16 * cs.warp + cs.g;
  const int position[2] = {narrow_position(token0), narrow_position(token0 + 8)};

  float o[kNarrowPTiles][kAcc];   // O^T in the current sigma_P domain
#pragma unroll
  for (int mt = 0; mt < kNarrowPTiles; ++mt)
#pragma unroll
    for (int v = 0; v < kAcc; ++v) o[mt][v] = 0.f;

  int own = 0;   // pages this consumer has done: parity of its `red` and P8^T buffers
  for (int i = cs.consumer; i < num_iters; i += kNarrowConsumers, ++own) {
    const int stage = i % kNarrowStages;
    const int page = first_page + i;
    const int live = min(seq_len - page * kPageSize, kPageSize);
    const uint8_t* stage_ptr = smem + stage * kStageBytes;
    const uint64_t stage_desc = sw128_desc(smem_base + stage * kStageBytes);
    mbar_wait(full_bar + 8 * stage, (i / kNarrowStages) & 1);

    // S^T = RoPE (BF16, exact FP32 accumulation) + the content QK in 32-column chunks, each
    // into a fresh accumulator added into s (the FP32 promotion, NarrowConfig::kQkPromoteCols).
    float s[kAcc];
    float part[kParts][kAcc];
    fence_operands(s);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kRopeDim / kWgmmaK16; ++k) {
      wgmma_qk_bf16<kRows>(s, desc_at(stage_desc, kStageRope + k * 32),
                           desc_at(cs.qpe_desc, k * 32), k);
    }
    wgmma_commit();
#pragma unroll
    for (int c = 0; c < kParts; ++c) cs.issue_qk_chunk(part[c % kParts], stage_desc, c);

    // While the QK runs: the token scales and (16 rows) this page's V^T fragments.
    uint32_t a[C::kVtInPv ? 1 : kNarrowPTiles][2][4];
    if constexpr (!C::kVtInPv) {
      const uint8_t* content = stage_ptr + kStageContent + cs.warp * kContentTileBytes;
      if (live == kPageSize) {
        load_v_fragments<false>(content, cs.g, cs.q, live, a);
      } else {
        load_v_fragments<true>(content, cs.g, cs.q, live, a);
      }
    }
    float k_scale[2];
    const float* scale_tile = reinterpret_cast<const float*>(stage_ptr + kStageScale);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = token0 + 8 * h;
      k_scale[h] = t < live ? checked_scale(scale_tile[t * kScaleBoxFloats]) : 0.f;
    }

#pragma unroll
    for (int c = 0; c < C::kQkChunks; ++c) {
      const int pending = min(c + kParts - 1, C::kQkChunks - 1) - c;
      if (pending >= 3) {
        wgmma_wait<3>();
      } else if (pending == 2) {
        wgmma_wait<2>();
      } else if (pending == 1) {
        wgmma_wait<1>();
      } else {
        wgmma_wait<0>();
      }
      float(&acc)[kAcc] = part[c % kParts];
      fence_operands(s);
      fence_operands(acc);
#pragma unroll
      for (int v = 0; v < kAcc; ++v) s[v] += acc[v];
      if (c + kParts < C::kQkChunks) {
        cs.issue_qk_chunk(part[(c + kParts) % kParts], stage_desc, c + kParts);
      }
    }
    if constexpr (!C::kVtInPv) {
      // 16 rows: QK done, V and the scales are in registers.
      mbar_arrive(empty_bar + 8 * stage);
    } else if (live < kPageSize) {
      // 32 rows, the request's last page: zeros into the empty token rows of the content tiles
      // for the PV's ldmatrix (load_v_tile).  This warp's QK is complete; another warp's may
      // still read these rows, but their logits are masked.  The barrier before the PV orders
      // the stores before every warp's loads, and the proxy fence before it the TMA's later
      // writes of the stage after them.
      uint8_t* const content = smem + stage * kStageBytes + kStageContent;
      constexpr int kChunks = kContentTiles * kSwizzleRowBytes / 16;   // 16-byte chunks per token
      for (int c = cs.wg_tid; c < (kPageSize - live) * kChunks; c += 128) {
        const int t = live + c / kChunks, tile = c % kChunks / 8, chunk = c % 8;
        *reinterpret_cast<uint4*>(content + tile * kContentTileBytes + t * kSwizzleRowBytes +
                                  16 * chunk) = make_uint4(0u, 0u, 0u, 0u);
      }
    }

    // The SnapMLA P pipeline of the page, per query row (the 64-row kernel's softmax).  It stays
    // in the body, as the PV and the merge below do: as a function it compiles to another order.
    float scale[kSlots];
#pragma unroll
    for (int k = 0; k < kSlots; k += 4) {
      const float4 w = *reinterpret_cast<const float4*>(row_scale + k);
      scale[k] = w.x, scale[k + 1] = w.y, scale[k + 2] = w.z, scale[k + 3] = w.w;
    }
#pragma unroll
    for (int v = 0; v < kAcc; ++v) {
      s[v] *= scale[2 * (v >> 2) + (v & 1)] * k_scale[(v >> 1) & 1];
    }
    if ((page + 1) * kPageSize > min_visible) {
      int visible[kSlots];
#pragma unroll
      for (int k = 0; k < kSlots; k += 4) {
        const int4 w = *reinterpret_cast<const int4*>(row_visible + k);
        visible[k] = w.x, visible[k + 1] = w.y, visible[k + 2] = w.z, visible[k + 3] = w.w;
      }
#pragma unroll
      for (int v = 0; v < kAcc; ++v) {
        const int pos = page * kPageSize + token0 + 8 * ((v >> 1) & 1);
        s[v] = pos < visible[2 * (v >> 2) + (v & 1)] ? s[v] : -INFINITY;
      }
    }
    // One reduction gives each row both its page maximum of s and that of s + log2 sigma_K:
    // amax(P') = max_t 2^(s_t - m) sigma_K,t = 2^(max_t (s_t + log2 sigma_K,t) - m), as exp2 is
    // monotonic, so the page's sigma_P needs no second cross-warp reduction after the exps.
    // (It differs from the max of the rounded P' by an ulp or two, far below what FP8 resolves;
    // empty or masked tokens give -inf.)
    float x[2 * kSlots];
    {
      const float log_k_scale[2] = {__log2f(k_scale[0]), __log2f(k_scale[1])};
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        const int v0 = 4 * (k >> 1) + (k & 1);
        x[k] = fmaxf(s[v0], s[v0 + 2]);
        x[kSlots + k] = fmaxf(s[v0] + log_k_scale[0], s[v0 + 2] + log_k_scale[1]);
      }
    }
    cs.reduce_rows(x, own & 1, false);
    float m_ref[kSlots], alpha[kSlots], e_sum[kSlots], amax[kSlots];
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      const float m_new = fmaxf(m[k], x[k]);
      m_ref[k] = m_new == -INFINITY ? 0.f : m_new;   // rows that have seen nothing yet
      alpha[k] = exp2_approx(m[k] - m_ref[k]);
      amax[k] = exp2_approx(x[kSlots + k] - m_ref[k]);
      m[k] = m_new;
      e_sum[k] = 0.f;
    }
#pragma unroll
    for (int v = 0; v < kAcc; ++v) {
      const int k = 2 * (v >> 2) + (v & 1);
      const float e = exp2_approx(s[v] - m_ref[k]);
      e_sum[k] += e;
      s[v] = e * k_scale[(v >> 1) & 1];    // scale fusion: P' = P * sigma_V
    }
    float inv_amax[kSlots], gamma[kSlots];
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      peak[k] = fmaxf(peak[k] * alpha[k], amax[k]);
      const float amax_new = fmaxf(fmaxf(amax[k], peak[k] * kPScaleRange), kPScaleFloor);
      inv_amax[k] = rcp_approx(amax_new);                            // <= 2**126: finite
      gamma[k] = alpha[k] * (amax_prev[k] * inv_amax[k]);            // exp(m_old - m) s_old / s
      l[k * 128] = l[k * 128] * alpha[k] + e_sum[k];
      amax_prev[k] = amax_new;
    }
    // P8^T into buffer own % 2 (bytes 64 (own % 2) .. + 63 of each row); its last reader, this
    // consumer's PV two pages back, has completed.
#pragma unroll
    for (int v = 0; v < kAcc; v += 2) {
      const int k = 2 * (v >> 2);
      const float hi = (s[v + 1] * inv_amax[k + 1]) * kFp8Max;   // first: nvcc's schedule
      const uint16_t pair = pack_e4m3x2((s[v] * inv_amax[k]) * kFp8Max, hi);
      const uint32_t byte = 64 * (own & 1) + position[(v >> 1) & 1];
      smem[cs.pt_offset + sw128_offset(cs.row_of(k), byte)] = static_cast<uint8_t>(pair & 0xFF);
      smem[cs.pt_offset + sw128_offset(cs.row_of(k + 1), byte)] = static_cast<uint8_t>(pair >> 8);
    }
    fence_proxy_async();   // P8^T becomes visible to the WGMMA (async) proxy
    named_barrier_sync(cs.wg_barrier, 128);

    // O^T = gamma O^T + V^T . P8^T: each page's PV into fresh accumulators, promoted into O^T
    // while the next M tiles are in the tensor core.  (The 32-row PV stays here, as the page
    // loop and the merge do: in a function of its own it compiles to another schedule.)
    if constexpr (!C::kVtInPv) {
      cs.pv_from_registers(o, a, gamma, own);
    } else {
      // 32 rows: one M tile at a time, its A fragments loaded while the previous tile runs
      // (two tiles' fragments and accumulators in flight); the stage is released afterwards.
      const uint32_t content = smem_base + stage * kStageBytes + kStageContent;
      uint32_t at[2][2][4];
      float pv[2][kAcc];
      cs.issue_pv_tile(at[0], pv[0], content, 0, own);
#pragma unroll
      for (int mt = 1; mt < kNarrowPTiles; ++mt) {
        cs.issue_pv_tile(at[mt & 1], pv[mt & 1], content, mt, own);
        wgmma_wait<1>();
        promote_pv(o[mt - 1], pv[(mt - 1) & 1], gamma);
        fence_operands(at[(mt - 1) & 1][0]);   // the next tile's loads stay below its PV
        fence_operands(at[(mt - 1) & 1][1]);
      }
      wgmma_wait<0>();
      promote_pv(o[kNarrowPTiles - 1], pv[(kNarrowPTiles - 1) & 1], gamma);
      fence_operands(at[(kNarrowPTiles - 1) & 1][0]);
      fence_operands(at[(kNarrowPTiles - 1) & 1][1]);
      mbar_arrive(empty_bar + 8 * stage);
    }
  }

  // Epilogue.  l over the warpgroup (buffer own % 2 is past its last reader), then consumer 1
  // hands its O^T and row state to consumer 0 through the page ring (free once both consumers
  // are past their last page: every TMA load has been waited for), and consumer 0 merges the two
  // like two KV splits: out = (sigma_0 w_0 O_0 + sigma_1 w_1 O_1) / (w_0 l_0 + w_1 l_1),
  // w_c = 2^(m_c - max(m_0, m_1)), sigma_c = amax_c / 448; rows that saw nothing give 0 and
  // LSE -inf.
  float l_sum[kSlots];
#pragma unroll
  for (int k = 0; k < kSlots; ++k) l_sum[k] = l[k * 128];
  cs.reduce_rows(l_sum, own & 1, true);
  named_barrier_sync(1, 256);
  float* const merge = reinterpret_cast<float*>(smem);   // [8 kAcc][128 threads], then rows
  float* const merge_rows = merge + C::kMergeOBytes / 4;    // [kRows][4]: m, l, amax
  if (cs.consumer == 1) cs.store_for_merge(o, m, l_sum, amax_prev);
  named_barrier_sync(1, 256);
  if (cs.consumer == 1) return;
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int r = row0 + cs.row_of(k);   // the request's row
    if (r >= p.num_rows) continue;
    const float4 other = *reinterpret_cast<const float4*>(merge_rows + cs.row_of(k) * 4);
    const float m_max = fmaxf(m[k], other.x);
    const float w0 = m_max == -INFINITY ? 0.f : exp2f(m[k] - m_max);
    const float w1 = m_max == -INFINITY ? 0.f : exp2f(other.x - m_max);
    const float total = l_sum[k] * w0 + other.y * w1;
    const bool seen_any = !(total == 0.f);   // NaN total: NaN out and LSE
    const float f0 = seen_any ? amax_prev[k] / kFp8Max * w0 / total : 0.f;
    const float f1 = seen_any ? other.z / kFp8Max * w1 / total : 0.f;
    const float lse = seen_any ? (m_max + log2f(total)) * kLn2 : -INFINITY;
    const bool writes_lse = cs.warp == 0 && cs.g == 0;
    const int v0 = 4 * (k >> 1) + (k & 1);   // the slot's values: v0 (M row parity 0), v0 + 2
    float res[kNarrowPTiles][2];
#pragma unroll
    for (int mt = 0; mt < kNarrowPTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int v = v0 + 2 * h;
        res[mt][h] = o[mt][v] * f0 + merge[(mt * kAcc + v) * 128 + cs.wg_tid] * f1;
      }
    // The thread's columns: 16 rows, 16 (8 warp + g) + 2 mt + h (16 contiguous); 32 rows,
    // 64 mt + 16 warp + 2 g + h (pairs).
    const int col0 = C::kVtInPv ? 16 * cs.warp + 2 * cs.g : 16 * (8 * cs.warp + cs.g);
    if (direct) {
      __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.out) +
                           (static_cast<int64_t>(b) * p.num_rows + r) * kKvLoraRank + col0;
      uint32_t packed[kNarrowPTiles];
#pragma unroll
      for (int mt = 0; mt < kNarrowPTiles; ++mt) {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(res[mt][0], res[mt][1]);
        packed[mt] = *reinterpret_cast<const uint32_t*>(&pair);
      }
      if constexpr (C::kVtInPv) {
#pragma unroll
        for (int mt = 0; mt < kNarrowPTiles; ++mt) {
          *reinterpret_cast<uint32_t*>(dst + 64 * mt) = packed[mt];
        }
      } else {
        reinterpret_cast<uint4*>(dst)[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        reinterpret_cast<uint4*>(dst)[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
      }
      if (writes_lse) {
        p.lse[(static_cast<int64_t>(b) * p.num_heads + r % p.num_heads) * p.s_q +
              r / p.num_heads] = lse;
      }
    } else {
      const int64_t part_row = (static_cast<int64_t>(b) * p.max_splits + split) * p.num_rows + r;
      if (writes_lse) p.part_lse[part_row] = lse;
      if (!seen_any) continue;   // the combine skips splits with LSE -inf: no O needed
      float* dst = p.part_out + part_row * kKvLoraRank + col0;
      if constexpr (C::kVtInPv) {
#pragma unroll
        for (int mt = 0; mt < kNarrowPTiles; ++mt) {
          *reinterpret_cast<float2*>(dst + 64 * mt) = make_float2(res[mt][0], res[mt][1]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          reinterpret_cast<float4*>(dst)[j] =
              make_float4(res[2 * j][0], res[2 * j][1], res[2 * j + 1][0], res[2 * j + 1][1]);
        }
      }
    }
  }
#elif defined(__CUDA_ARCH__)
  __trap();   // not sm_90a: the launcher never starts this on other builds
#endif  // SNAPMLA_SM90_DEVICE
}

}  // namespace snapmla::sm90
