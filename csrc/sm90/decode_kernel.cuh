// The sm_90a SnapMLA split-KV decode kernel: TMA page ring, FP8/BF16 WGMMA, SnapMLA P pipeline.
//
// One CTA per (request, 64-row block of the request's (s_q, head) rows, KV split), 384 threads:
//   WG0      producer: one thread streams the split's 64-token pages with TMA into a 2-stage
//            ring (content as four 64x128 e4m3 tiles, RoPE as one 64x64 bf16 tile, both with the
//            128-byte swizzle WGMMA reads; the fp32 scales as a 64x16-byte box).
//   WG1, WG2 consumers: each applies every page's P8 . V8 to its own output columns.  With the
//            default schedule (kScheduleSplitRoles) WG1 computes every page's logit tile
//            S[64 rows, 64 tokens], softmax and P quantization and hands P8 to WG2 through
//            shared memory, WG2 transposes every page's V, and the columns are split 192 / 320;
//            the other schedules split the columns 256 / 256 and share the S and V^T work
//            differently (identical, deterministic results).
// Per page and row the math is exactly the Triton kernel's
// (vllm_snapmla/kernels/triton_decode.py) and reference.decode_quantized's: see docs/format.md
// "Decode".
//
// Device code exists only for sm_90a (WGMMA, TMA and setmaxnreg); other targets compile a stub
// that traps, and the host launcher refuses them.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "dependent_launch.h"
#include "sm90/config.h"
#include "sm90/decode.h"
#include "sm90/pipeline.cuh"
#include "sm90/ptx.h"
#include "sm90/vt_map.h"
#include "split_kv.h"

namespace snapmla::sm90 {

#ifdef SNAPMLA_SM90_DEVICE
namespace device {

// V^T of one 256-column half of a page (its per-lane map and the layout it writes: vt_map.h):
// `tile` the shared address of the half's first content tile in the stage, `vt` that of the
// half's V^T rows; `keep_lo`, `keep_hi` mask the 16-bit token halves of the words of tokens a,
// a + 1 and a + 8, a + 9 (all-ones for full pages).  All 8 loads are issued before the first
// store: the compiler cannot tell that the stores (V^T) never alias the loads (the stage).
__device__ __forceinline__ void build_vt(uint32_t tile, uint32_t vt, const VtMap& map, int buf,
                                         uint32_t keep_lo, uint32_t keep_hi) {
  constexpr int kSteps = kOutColsPerWarpgroup / 32;   // 8
  uint32_t d[kSteps][4];
#pragma unroll
  for (int q = 0; q < kSteps; ++q) {
    ldmatrix_x4_trans(tile + (q / 4) * kContentTileBytes + (map.load ^ (32 * (q % 4))), d[q]);
  }
  const uint32_t store = vt + (map.store ^ (64 * buf));
#pragma unroll
  for (int q = 0; q < kSteps; ++q) {
    const uint32_t lo0 = d[q][0] & keep_lo, hi0 = d[q][1] & keep_hi;
    const uint32_t lo1 = d[q][2] & keep_lo, hi1 = d[q][3] & keep_hi;
    const uint32_t w[4] = {__byte_perm(lo0, hi0, map.sel[0]), __byte_perm(lo0, hi0, map.sel[1]),
                           __byte_perm(lo1, hi1, map.sel[0]), __byte_perm(lo1, hi1, map.sel[1])};
    stmatrix_x4(store + q * 32 * kSwizzleRowBytes, w);
  }
}

// The calling thread's VtMap (in its 128-thread warpgroup) from a fresh (volatile) read of the
// thread index: built per page, the compiler cannot hoist its registers (or addresses derived
// from them) out of the caller's page loop, where they would hold registers across the QK and
// softmax.
__device__ __forceinline__ VtMap fresh_vt_map() {
  const uint32_t tid = fresh_thread_index();
  return make_vt_map(tid % 128 / 32, tid % 32);
}

// V^T of one half of a page of `live` tokens: zeros for the empty slots of a request's last page
// (their bytes are arbitrary, NaN included, and a zero P times a NaN V would still be NaN).
__device__ __forceinline__ void build_page_vt(uint32_t tile, uint32_t vt, const VtMap& map,
                                              int buf, int live) {
  if (live == kPageSize) {
    build_vt(tile, vt, map, buf, ~0u, ~0u);
  } else {
    const int a = map.token0;
    const auto keep = [&](int t) {
      return (t < live ? 0x0000FFFFu : 0u) | (t + 1 < live ? 0xFFFF0000u : 0u);
    };
    build_vt(tile, vt, map, buf, keep(a), keep(a + 8));
  }
}

// The split's pages in the shared-memory ring as the consumers see them: local page i is in
// stage i % kStages, holds live_of(i) real tokens, and is waited for and released through its
// stage's barriers.
struct PageRing {
  uint32_t smem_base;     // the shared-space address of the dynamic shared memory
  uint32_t full_bar;      // + 8 * stage: page landed
  uint32_t empty_bar;     // + 8 * stage: slot free
  int first_page, num_iters;
  // Only a split's last page can be partial: one register instead of seq_len and first_page.
  int last_live;

  __device__ __forceinline__ int stage_of(int i) const { return i % kStages; }
  __device__ __forceinline__ int live_of(int i) const {
    return i + 1 < num_iters ? kPageSize : last_live;
  }
  __device__ __forceinline__ void wait(int i) const {
    mbar_wait(full_bar + 8 * stage_of(i), (i / kStages) & 1);
  }
  __device__ __forceinline__ void release(int i) const { mbar_arrive(empty_bar + 8 * stage_of(i)); }
};

// Fragment layouts used below (CuTe's CLayout_64xN and ALayout_64x32 for WGMMA m64):
// * FP32 accumulator, value v of a thread: row 16*warp + lane/4 + 8*((v>>1)&1),
//   column 8*(v>>2) + 2*(lane%4) + (v&1).  Each thread holds two rows ("h" = 0, 1 below).
// * e4m3 A operand from registers, per K=32 step: register j byte i holds row
//   16*warp + lane/4 + 8*(j&1), k = 4*(lane%4) + i + 16*(j>>1).
// The P accumulator becomes the PV A operand without any data exchange by permuting K (tokens):
// A position k of a 16-wide group carries token 8*((k>>1)&1) + 2*(k>>2) + (k&1) of that group,
// which is exactly what each thread already holds; V^T is written with the same token order.
//
// kSchedule divides the work between the consumer warpgroups (same arithmetic, bit-identical
// results):
//   kScheduleSplitRoles (the default): WG1 computes every page's S, softmax and P8 (its row
//                      state stays in registers); WG2 builds every page's V^T, all 512 columns;
//                      then both apply the page to their own columns, 192 and 320
//                      (qk_softmax_page, vt_pv_page).
//   kScheduleFree:     both compute every page's S and P8 and apply it to their own 256 columns:
//                      the plain form, the reference of the bit-identity tests.
// Two more were measured and removed (`git show cb04609:benchmarks/RESULTS.md`): the paper's
// Algorithm 1 (each page's P from one warpgroup, handed to the other), which split-roles beats
// by 1.22-1.30x, and alternating QK/PV turns, 1.05-1.13x slower still.

// The softmax state of a consumer thread's two rows (h = 0: lane/4, h = 1: lane/4 + 8 of its
// warp), advanced page by page.  (Row indices are recomputed in the epilogue rather than kept:
// registers are tight.  The field order fixes the order in which the compiler copies the
// loop-carried values, and with it the register allocation: keep it.)
struct RowState {
  float l[2];           // sum of exp, unscaled (= sigma_P * L)
  float amax_prev[2];   // 448 * sigma_P of the last page, times kPShift
  float peak[2];        // largest P'' so far, at the current m
  float m[2];           // running max logit (log2 units)
  float row_scale[2];   // the query row's scale times softmax_scale * log2(e)
  int visible[2];       // the row sees positions below this
};

// A consumer thread's constants for the whole split: its place in the CTA and the shared-memory
// operands; its member functions are the steps of a page.  It holds scalars only (the arrays,
// RowState and O, are passed by reference) and everything is inlined, so it lives in registers.
template <int kSchedule>
struct ConsumerState {
  // compute_s's group width and accumulators in flight: kScheduleSplitRoles's QK warpgroup has
  // the registers for two 64-token groups (Q8 read once per chunk, not once per 32-token half):
  // it keeps O for fewer columns and builds no V^T.
  static constexpr bool kSplitRoles = kSchedule == kScheduleSplitRoles;
  static constexpr int kQkN = kSplitRoles ? 64 : 32;
  static constexpr int kQkParts = kSplitRoles ? kSplitQkParts : 2;
  static_assert(kQkParts >= 2 && kQkParts <= 3, "compute_s waits with at most 2 groups pending");
  static constexpr int kQkHalves = kPageSize / kQkN;
  static constexpr int kQkGroups = kQkHalves * kQkChunks;

  const DecodeParams& p;
  uint8_t* const smem;          // the dynamic shared memory, 1024-byte aligned
  const uint32_t smem_base;     // its shared-space address
  const int b, split;
  const bool direct;    // the request's only run: final results instead of partials
  const int consumer;   // output columns [256 * consumer, +256), but see kSchedule
  const int wg_tid, warp, lane, quad, row0;
  uint8_t* const vt;    // this warpgroup's V^T buffer (kScheduleFree)
  const uint64_t vt_desc, q8_desc, qpe_desc;
  const uint64_t vt_cols0;     // kScheduleSplitRoles: the V^T row of output column 0
  const uint32_t wg_barrier;   // this warpgroup's named barrier
  uint32_t* const row_state;   // kScheduleSplitRoles: this thread's handed-over row state

  __device__ __forceinline__ ConsumerState(const DecodeParams& p, uint8_t* smem,
                                           uint32_t smem_base, int b, int row_block, int split,
                                           bool direct, int warpgroup)
      : p(p),
        smem(smem),
        smem_base(smem_base),
        b(b),
        split(split),
        direct(direct),
        consumer(warpgroup - 1),
        wg_tid(threadIdx.x % 128),
        warp(wg_tid / 32),
        lane(threadIdx.x % 32),
        quad(lane % 4),
        row0(row_block * kBlockRows),
        vt(smem + kSmemVt + consumer * kVtBytes),
        vt_desc(sw128_desc(smem_addr(vt))),
        q8_desc(sw128_desc(smem_base + kSmemQ8)),
        qpe_desc(sw128_desc(smem_base + kSmemQpe)),
        vt_cols0(sw128_desc(smem_base + kSmemVt)),
        wg_barrier(2 + consumer),
        row_state(reinterpret_cast<uint32_t*>(smem + kSmemRowState) + wg_tid) {}

  // The rows' state before the first page; `seq_len` and `valid` of the request (split_pages).
  __device__ __forceinline__ void init_rows(RowState& rows, int seq_len, bool valid) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      rows.m[h] = -INFINITY;
      rows.peak[h] = 0.f;
      rows.amax_prev[h] = kPScaleFloor * kPShift;
      rows.l[h] = initial_row_sum(valid);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int g = row0 + 16 * warp + lane / 4 + 8 * h;
      const bool row_ok = g < p.num_rows;
      const int qi = row_ok ? g / p.num_heads : 0, qh = row_ok ? g % p.num_heads : 0;
      // Query i of s_q sees positions < seq_len - s_q + i + 1 when causal.
      rows.visible[h] = row_ok ? seq_len - p.causal * (p.s_q - 1 - qi) : 0;
      // Positive and normal (softmax's FFMA multiplies -inf by it), or NaN from a NaN query
      // scale, kept so that the row comes out NaN; padding rows' Q is zero.
      const float q_row_scale = row_ok ? p.q_scale[b * p.q_scale_stride[0] +
                                                   qi * p.q_scale_stride[1] +
                                                   qh * p.q_scale_stride[2]] * p.qk_scale_log2
                                       : 1.f;
      rows.row_scale[h] =
          q_row_scale != q_row_scale ? q_row_scale : fmaxf(q_row_scale, FLT_MIN);
    }
  }

  // V^T of page i (this warpgroup's 256 content columns) into V^T buffer `buf`: K-major rows
  // (tokens contiguous, in the permuted order above), buffer 0 in bytes 0-63 of each 128-byte
  // row, buffer 1 in bytes 64-127; slots past seq_len become zeros (build_vt).  Callers put a
  // warpgroup barrier before (the PV reading the buffer is done) and fence_proxy_async and a
  // warpgroup barrier after (the WGMMA sees the stores).
  __device__ __forceinline__ void build_own_vt(const PageRing& ring, int i, int buf) const {
    build_page_vt(smem_base + kSmemStages + ring.stage_of(i) * kStageBytes + kStageContent +
                      consumer * 2 * kContentTileBytes,
                  smem_addr(vt), fresh_vt_map(), buf, ring.live_of(i));
  }

  // S of page i = q8 . k8^T (FP8, promoted per chunk) + qpe' . kpe'^T (BF16, FP32
  // accumulation).  The FP8 part runs as groups of one chunk and kQkN tokens (two WGMMAs):
  // group g (chunk g / kQkHalves, tokens kQkN (g % kQkHalves) on).  Chunk 0's groups write s
  // itself, fresh, and the RoPE WGMMAs accumulate onto it, which saves chunk 0's promotion: a
  // BF16 WGMMA adds onto a running value in FP32, where an FP8 one would keep only about 14
  // bits of it (the errors of benchmarks/narrow_accuracy.py were unchanged to three digits).
  // Later groups go into accumulator part[g % kQkParts] and are then added into their tokens'
  // values of s; kQkParts - 1 of them stay in the tensor core while one is promoted, so a wait
  // rarely costs a whole WGMMA latency.
  __device__ __forceinline__ void compute_s(const PageRing& ring, int i, float (&s)[32]) const {
    const uint64_t stage_desc =
        sw128_desc(smem_base + kSmemStages + ring.stage_of(i) * kStageBytes);
    float part[kQkParts][kQkN / 2];
    wgmma_fence();
#pragma unroll
    for (int h = 0; h < kQkHalves; ++h) {
      qk_fp8_group(stage_desc, h, *reinterpret_cast<float(*)[kQkN / 2]>(s + (kQkN / 2) * h));
    }
#pragma unroll
    for (int k = 0; k < kRopeDim / kWgmmaK16; ++k) {
      wgmma_m64n64k16_bf16(s, desc_at(qpe_desc, k * 32),
                           desc_at(stage_desc, kStageRope + k * 32), 1);
    }
    wgmma_commit();
#pragma unroll
    for (int g = kQkHalves; g < kQkHalves + kQkParts; ++g) {
      issue_qk_group(stage_desc, g, part[g % kQkParts]);
    }
#pragma unroll
    for (int g = kQkHalves; g < kQkGroups; ++g) {
      // Groups g + 1 .. min(g + kQkParts - 1, last) may stay in flight (chunk 0's group, the
      // oldest, is complete with group g).
      const int pending = min(g + kQkParts - 1, kQkGroups - 1) - g;
      if (pending >= 2) {
        wgmma_wait<2>();
      } else if (pending == 1) {
        wgmma_wait<1>();
      } else {
        wgmma_wait<0>();
      }
      float(&acc)[kQkN / 2] = part[g % kQkParts];
      fence_operands(s);
      fence_operands(acc);
#pragma unroll
      for (int v = 0; v < kQkN / 2; ++v) s[(kQkN / 2) * (g % kQkHalves) + v] += acc[v];
      if (g + kQkParts < kQkGroups) {
        issue_qk_group(stage_desc, g + kQkParts, part[(g + kQkParts) % kQkParts]);
      }
    }
  }

  // The FP8 WGMMAs of compute_s's group g into `acc` (page tiles at `stage_desc`).
  __device__ __forceinline__ void qk_fp8_group(uint64_t stage_desc, int g,
                                               float (&acc)[kQkN / 2]) const {
#pragma unroll
    for (int k = 0; k < kQkPromoteCols / kWgmmaK8; ++k) {
      const int col = (g / kQkHalves) * kQkPromoteCols + k * kWgmmaK8;
      const uint32_t offset =
          (col / kSwizzleRowBytes) * kContentTileBytes + col % kSwizzleRowBytes;
      const uint64_t desc_b = desc_at(
          stage_desc, kStageContent + offset + (g % kQkHalves) * kQkN * kSwizzleRowBytes);
      if constexpr (kQkN == 64) {
        wgmma_m64n64k32_e4m3(acc, desc_at(q8_desc, offset), desc_b, k);
      } else {
        wgmma_m64n32k32_e4m3(acc, desc_at(q8_desc, offset), desc_b, k);
      }
    }
  }

  // Group g of compute_s as a WGMMA group of its own, into its accumulator `acc`.
  __device__ __forceinline__ void issue_qk_group(uint64_t stage_desc, int g,
                                                 float (&acc)[kQkN / 2]) const {
    fence_operands(acc);   // the previous `s += acc` stays above the fence
    wgmma_fence();
    qk_fp8_group(stage_desc, g, acc);
    wgmma_commit();
  }

  // The token scales of page i for this thread's 16 columns (token 8*j + 2*quad + e at
  // [2*j + e]); the bytes of empty slots are arbitrary until softmax's masking zeroes them.
  __device__ __forceinline__ void load_scales(const PageRing& ring, int i,
                                              float (&k_scale)[16]) const {
    const float* scale_tile = reinterpret_cast<const float*>(
        smem + kSmemStages + ring.stage_of(i) * kStageBytes + kStageScale);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        k_scale[2 * j + e] =
            checked_scale(scale_tile[(8 * j + 2 * quad + e) * kScaleBoxFloats]);
      }
  }

  // The SnapMLA P pipeline of page i from its S, the Triton kernel's operations up to FP32
  // rounding (the logit scale enters the exponent's FFMA, P's quantization is one multiply):
  // P8 (the PV A operand), gamma (O's rescale for this page: exp(m_old - m) * sigma_P old / new)
  // and the row state (m, peak, amax_prev, l) advanced past the page.  P' is carried as
  // P'' = kPShift P' (peak and amax_prev too; exact, a power of two, folded into the exponent)
  // so that 448 / amax(P'') is finite at the floor: 448 / 2^-126 overflows FP32.
  __device__ __forceinline__ void softmax(const PageRing& ring, RowState& rows, int i,
                                          float (&s)[32], float (&k_scale)[16],
                                          uint32_t (&p8)[2][4], float (&gamma)[2]) const {
    const int page = ring.first_page + i;
    // t = s sigma_K; the logit in log2 units is t * row_scale (> 0), so the row's largest t
    // gives its largest logit.
#pragma unroll
    for (int v = 0; v < 32; ++v) s[v] *= k_scale[2 * (v >> 2) + (v & 1)];
    // Positions a row may not see (past seq_len, causal, padding rows) get -inf by select,
    // which also drops NaN garbage, and empty slots a zero scale (P' = P sigma_V must be 0
    // there); only the pages at the end of a row's range have any.
    if ((page + 1) * kPageSize > min(rows.visible[0], rows.visible[1])) {
      const int live = ring.live_of(i);
#pragma unroll
      for (int c = 0; c < 16; ++c) {
        k_scale[c] = 8 * (c >> 1) + 2 * quad + (c & 1) < live ? k_scale[c] : 0.f;
      }
#pragma unroll
      for (int v = 0; v < 32; ++v) {
        const int pos = page * kPageSize + 8 * (v >> 2) + 2 * quad + (v & 1);
        s[v] = pos < rows.visible[(v >> 1) & 1] ? s[v] : -INFINITY;
      }
    }
    // The row reductions are trees (depth 4, not a chain of 16): the softmax is WG1's
    // critical path.
    const auto max_op = [](float a, float b) { return fmaxf(a, b); };
    const auto sum_op = [](float a, float b) { return a + b; };
    float m_ref[2], neg_m[2], alpha[2], amax[2], e_sum[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float t_max = quad_max(row_reduce(s, h, max_op));
      const float m_new =
          fmaxf(rows.m[h], t_max == -INFINITY ? -INFINITY : t_max * rows.row_scale[h]);
      m_ref[h] = m_new == -INFINITY ? 0.f : m_new;   // rows that have seen nothing yet
      neg_m[h] = kPShiftLog2 - m_ref[h];   // exp2(. + 16): P'' = kPShift P
      alpha[h] = exp2_approx(rows.m[h] - m_ref[h]);
      rows.m[h] = m_new;
    }
#pragma unroll
    for (int v = 0; v < 32; ++v) {
      const int h = (v >> 1) & 1;
      s[v] = exp2_approx(fmaf(s[v], rows.row_scale[h], neg_m[h]));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) e_sum[h] = row_reduce(s, h, sum_op);
#pragma unroll
    for (int v = 0; v < 32; ++v) s[v] *= k_scale[2 * (v >> 2) + (v & 1)];   // P'' sigma_V
#pragma unroll
    for (int h = 0; h < 2; ++h) amax[h] = row_reduce(s, h, max_op);   // P'' >= 0
    float to_fp8[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float page_amax = quad_max(amax[h]);
      rows.peak[h] = fmaxf(rows.peak[h] * alpha[h], page_amax);
      const float amax_new =
          fmaxf(fmaxf(page_amax, rows.peak[h] * kPScaleRange), kPScaleFloor * kPShift);
      const float inv_amax = 1.f / amax_new;                         // <= 2**110
      to_fp8[h] = inv_amax * kFp8Max;                                // finite
      gamma[h] = alpha[h] * (rows.amax_prev[h] * inv_amax);          // exp(m_old - m) s_old / s
      rows.l[h] = rows.l[h] * alpha[h] + quad_sum(e_sum[h]) * (1.f / kPShift);
      rows.amax_prev[h] = amax_new;
    }
#pragma unroll
    for (int k = 0; k < 2; ++k)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int v0 = 16 * k + 8 * (j >> 1) + 2 * (j & 1);
        const float x = to_fp8[j & 1];   // registers 0, 2: row h = 0; 1, 3: h = 1
        // min(x, 448) of the reference is the conversion's saturation (.satfinite).
        p8[k][j] = pack_e4m3x4(s[v0] * x, s[v0 + 1] * x, s[v0 + 4] * x, s[v0 + 5] * x);
      }
  }

  // Epilogue: out = sigma_P O / (sigma_P L) for the columns of `o` from col0 on (pieces of any
  // width, each an accumulator fragment); rows that saw nothing give 0 and LSE -inf, rows whose
  // sum is NaN (non-finite inputs, an invalid request) give NaN.
  template <int kPieces, int kVals>
  __device__ __forceinline__ void write_output(const RowState& rows,
                                               const float (&o_pieces)[kPieces][kVals],
                                               int col0) const {
    constexpr int kPieceN = 2 * kVals;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int g = row0 + 16 * warp + lane / 4 + 8 * h;
      if (g >= p.num_rows) continue;
      const bool seen_any = !(rows.l[h] == 0.f);   // NaN l: NaN out and LSE, never a quiet zero
      const float norm =
          seen_any ? rows.amax_prev[h] * (1.f / kPShift) / (kFp8Max * rows.l[h]) : 0.f;
      const float lse = seen_any ? (rows.m[h] + log2f(rows.l[h])) * kLn2 : -INFINITY;
      const bool writes_lse = consumer == 0 && quad == 0;
      if (direct) {
        __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.out) +
                             (static_cast<int64_t>(b) * p.num_rows + g) * kKvLoraRank + col0;
#pragma unroll
        for (int q = 0; q < kPieces; ++q)
#pragma unroll
          for (int j = 0; j < kPieceN / 8; ++j) {
            const int v = 4 * j + 2 * h;
            *reinterpret_cast<__nv_bfloat162*>(dst + q * kPieceN + 8 * j + 2 * quad) =
                __floats2bfloat162_rn(o_pieces[q][v] * norm, o_pieces[q][v + 1] * norm);
          }
        if (writes_lse) {
          p.lse[(static_cast<int64_t>(b) * p.num_heads + g % p.num_heads) * p.s_q +
                g / p.num_heads] = lse;
        }
      } else {
        const int64_t part_row =
            (static_cast<int64_t>(b) * p.max_splits + split) * p.num_rows + g;
        if (writes_lse) p.part_lse[part_row] = lse;
        if (!seen_any) continue;   // the combine skips splits with LSE -inf: no O needed
        float* dst = p.part_out + part_row * kKvLoraRank + col0;
#pragma unroll
        for (int q = 0; q < kPieces; ++q)
#pragma unroll
          for (int j = 0; j < kPieceN / 8; ++j) {
            const int v = 4 * j + 2 * h;
            *reinterpret_cast<float2*>(dst + q * kPieceN + 8 * j + 2 * quad) =
                make_float2(o_pieces[q][v] * norm, o_pieces[q][v + 1] * norm);
          }
      }
    }
  }

  // Hand-over buffer of page i (kScheduleSplitRoles), this thread's words: P8 (words 0-7) and
  // gamma (8-9); and the row state after the last page, m, peak, amax, l (2 words each), for
  // WG2's epilogue.
  __device__ __forceinline__ uint32_t* hand_over_of(int i) const {
    return reinterpret_cast<uint32_t*>(smem + kSmemHandOver) +
           (i % kHandOverBuffers) * kHandOverWords * 128 + wg_tid;
  }
  __device__ __forceinline__ void store_hand_over(int i, const uint32_t (&p8)[2][4],
                                                  const float (&gamma)[2]) const {
    uint32_t* x = hand_over_of(i);
#pragma unroll
    for (int w = 0; w < 8; ++w) x[w * 128] = p8[w / 4][w % 4];
#pragma unroll
    for (int h = 0; h < 2; ++h) x[(8 + h) * 128] = __float_as_uint(gamma[h]);
  }
  __device__ __forceinline__ void store_row_state(const RowState& rows) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_state[h * 128] = __float_as_uint(rows.m[h]);
      row_state[(2 + h) * 128] = __float_as_uint(rows.peak[h]);
      row_state[(4 + h) * 128] = __float_as_uint(rows.amax_prev[h]);
      row_state[(6 + h) * 128] = __float_as_uint(rows.l[h]);
    }
  }
  __device__ __forceinline__ void load_handed_over_state(RowState& rows) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      rows.m[h] = __uint_as_float(row_state[h * 128]);
      rows.peak[h] = __uint_as_float(row_state[(2 + h) * 128]);
      rows.amax_prev[h] = __uint_as_float(row_state[(4 + h) * 128]);
      rows.l[h] = __uint_as_float(row_state[(6 + h) * 128]);
    }
  }
  __device__ __forceinline__ void load_hand_over(int i, uint32_t (&p8)[2][4],
                                                 float (&gamma)[2]) const {
    const uint32_t* x = hand_over_of(i);
#pragma unroll
    for (int w = 0; w < 8; ++w) p8[w / 4][w % 4] = x[w * 128];
#pragma unroll
    for (int h = 0; h < 2; ++h) gamma[h] = __uint_as_float(x[(8 + h) * 128]);
  }
};

// O before the first page.
template <int kPieces, int kVals>
__device__ __forceinline__ void fill_zero(float (&x)[kPieces][kVals]) {
#pragma unroll
  for (int q = 0; q < kPieces; ++q)
#pragma unroll
    for (int v = 0; v < kVals; ++v) x[q][v] = 0.f;
}

// Piece q of apply_page_to (kPieceN columns from V^T rows `vt_cols`, buffer `buf`) into the
// fresh accumulator `pv`, as a WGMMA group of its own.
template <int kPieceN>
__device__ __forceinline__ void issue_pv_piece(float (&pv)[kPieceN / 2], uint32_t (&p8)[2][4],
                                               uint64_t vt_cols, int buf, int q) {
  fence_operands(pv);   // the piece before it was promoted above the fence
  fence_operands(p8[0]);       // the e4m3 packing of P stays above the fence
  fence_operands(p8[1]);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < kPageSize / kWgmmaK8; ++k) {
    const uint64_t desc = desc_at(vt_cols, buf * kPageSize + q * kPieceN * kSwizzleRowBytes +
                                               k * kWgmmaK8);
    if constexpr (kPieceN == 64) {
      wgmma_m64n64k32_e4m3_rs(pv, p8[k], desc, k);
    } else {
      wgmma_m64n32k32_e4m3_rs(pv, p8[k], desc, k);
    }
  }
  wgmma_commit();
}

// PV: O = gamma O + P8 . V8 for the columns of `o_pieces`, kPieces pieces of kPieceN columns
// from the V^T rows at `vt_cols` (descriptor), through kAccs accumulators: each page's piece
// goes into a fresh accumulator (promoted into FP32 O), and piece q's promotion runs while
// piece q + 1 is in the tensor core.
template <int kPieces, int kVals>
__device__ __forceinline__ void apply_page_to(float (&o_pieces)[kPieces][kVals],
                                              uint32_t (&p8)[2][4], const float (&gamma)[2],
                                              uint64_t vt_cols, int buf) {
  constexpr int kAccs = 2;
  constexpr int kPieceN = 2 * kVals;   // kVals = kPieceN / 2 per thread
  static_assert(kPieceN == 32 || kPieceN == 64, "PV pieces are m64n32 or m64n64 WGMMAs");
  float pv[kAccs][kVals];
#pragma unroll
  for (int q = 0; q < kAccs && q < kPieces; ++q) {
    issue_pv_piece<kPieceN>(pv[q % kAccs], p8, vt_cols, buf, q);
  }
#pragma unroll
  for (int q = 0; q < kPieces; ++q) {
    if (q + 1 < kPieces) {
      wgmma_wait<1>();
    } else {
      wgmma_wait<0>();
    }
    fence_operands(pv[q % kAccs]);
#pragma unroll
    for (int v = 0; v < kVals; ++v) {
      o_pieces[q][v] = o_pieces[q][v] * gamma[(v >> 1) & 1] + pv[q % kAccs][v];
    }
    if (q + kAccs < kPieces) {
      issue_pv_piece<kPieceN>(pv[(q + kAccs) % kAccs], p8, vt_cols, buf, q + kAccs);
    }
  }
}

// ---------------------------------------------------------------------------------- the roles
// A page of each split-roles warpgroup (the producer is pipeline.cuh's
// run_producer_warpgroup).  The page loops stay in the kernel
// body, and the free schedule's page too: in functions of their own they change the generated
// code (a loop there makes the split-roles kernel keep `direct` in a general register instead
// of a predicate, and spill; the free page gets another instruction schedule).

// kScheduleSplitRoles.  Page i: WG1 (qk_softmax_page) computes S(i), the softmax and P8(i),
// puts P8(i) and gamma in hand-over buffer i % 2 and applies the page to output columns
// [0, kQkWarpgroupCols); WG2 (vt_pv_page) builds V^T(i) of all 512 columns into V^T buffer
// i % 2 and applies the page to the other columns with the handed-over P8.  WG1's chain (QK,
// softmax, PV) is the longer one, hence its smaller share of the columns: its registers go to
// the QK accumulators instead (compute_s), and the PV time moves to WG2.  They meet at barrier
// kPageBarrier (a bar.sync of all 256) before their PVs, so while WG1 computes S(i + 1) and its
// softmax, WG2 builds V^T(i + 1).
// Buffer reuse, with rounds that never mix (every thread leaves a rendezvous only once it
// is complete):
// - V^T buffer i % 2: WG2 rewrites it for page i + 2 after WG1's arrival at
//   kVtFreeBarrier + i % 2 past its PV(i) (the same bar.sync holds WG2's warps until all
//   are past their own PV(i)).  WG1's arrivals for pages i and i + 2 there are separated
//   by page i + 2's rendezvous, which WG2 reaches only after its sync for page i.
// - Hand-over buffer i % 2: WG1 rewrites it for page i + 2 after page i + 1's rendezvous;
//   WG2 read it before page i + 1's.
constexpr int kQkPieces = kQkWarpgroupCols / kQkPieceCols;         // WG1's O pieces
constexpr int kVtPieces = (kKvLoraRank - kQkWarpgroupCols) / 32;   // WG2's: 32 columns each

// WG1, page i: S, softmax and P8, handed over; PV of its columns.
__device__ __forceinline__ void qk_softmax_page(const ConsumerState<kScheduleSplitRoles>& cs,
                                                const PageRing& ring, RowState& rows,
                                                float (&o_qk)[kQkPieces][kQkPieceCols / 2],
                                                int i) {
  uint32_t p8[2][4];
  float gamma[2];
  {
    float s[32], k_scale[16];
    ring.wait(i);
    cs.compute_s(ring, i, s);
    cs.load_scales(ring, i, k_scale);
    ring.release(i);   // QK and scales done (WG2 releases it after its V^T)
    cs.softmax(ring, rows, i, s, k_scale, p8, gamma);
  }
  cs.store_hand_over(i, p8, gamma);
  named_barrier_sync(kPageBarrier, 256);
  apply_page_to(o_qk, p8, gamma, cs.vt_cols0, i & 1);
  if (i + 2 < ring.num_iters) named_barrier_arrive(kVtFreeBarrier + (i & 1), 256);
}

// WG2, page i: V^T of all 512 columns; PV of its columns with the handed-over P8.
__device__ __forceinline__ void vt_pv_page(const ConsumerState<kScheduleSplitRoles>& cs,
                                           const PageRing& ring, float (&o_vt)[kVtPieces][16],
                                           int i) {
  ring.wait(i);
  if (i >= 2) named_barrier_sync(kVtFreeBarrier + (i & 1), 256);
  const VtMap vt_map = fresh_vt_map();
  const uint32_t content =
      ring.smem_base + kSmemStages + ring.stage_of(i) * kStageBytes + kStageContent;
#pragma unroll 1
  for (int c = 0; c < kConsumerWarpgroups; ++c) {   // one half at a time (registers)
    build_page_vt(content + c * 2 * kContentTileBytes, ring.smem_base + kSmemVt + c * kVtBytes,
                  vt_map, i & 1, ring.live_of(i));
  }
  fence_proxy_async();   // V^T becomes visible to both warpgroups' WGMMAs
  ring.release(i);
  named_barrier_sync(kPageBarrier, 256);
  uint32_t p8[2][4];
  float gamma[2];
  cs.load_hand_over(i, p8, gamma);
  apply_page_to(o_vt, p8, gamma, desc_at(cs.vt_cols0, kQkWarpgroupCols * kSwizzleRowBytes),
                i & 1);
}

}  // namespace device
#endif  // SNAPMLA_SM90_DEVICE

// One CTA per (request, 64-row block, KV split): WG0 the producer (run_producer_warpgroup), WG1
// and WG2 the consumers, by kSchedule.
template <int kSchedule>
__global__ void __launch_bounds__(kThreads, 1)
    decode_kernel(const __grid_constant__ CUtensorMap content_map,
                  const __grid_constant__ CUtensorMap rope_map,
                  const __grid_constant__ CUtensorMap scale_map, const DecodeParams p) {
#ifdef SNAPMLA_SM90_DEVICE
  using namespace device;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const uint32_t smem_base = smem_addr(smem);
  const uint32_t full_bar = smem_base + kSmemBarriers;           // + 8 * stage: page landed
  const uint32_t empty_bar = full_bar + 8 * kStages;             // + 8 * stage: slot free

  const int b = blockIdx.x;
  const int row_block = blockIdx.y;
  const int split = blockIdx.z;
  const int warpgroup = threadIdx.x / 128;

  // A dependent launch (dependent_launch.h): no global memory before the wait.
  wait_for_prior_grids();
  const auto [seq_len, first_page, num_iters, direct, valid] = split_pages(p, b, split);
  // Splits past the request's last run (the planner cut it into fewer): nothing to do.  Split 0
  // always runs, so that a request with no tokens still gets its zeros and LSE -inf.
  if (split > 0 && num_iters == 0) return;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full_bar + 8 * s, 1);
      mbar_init(empty_bar + 8 * s, 256);   // every thread of both consumers releases a page
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    run_producer_warpgroup<kStages>(content_map, rope_map, scale_map, p, b, first_page,
                                    num_iters, smem_base + kSmemStages, full_bar, empty_bar, 0);
    return;
  }

  // ------------------------------------------------------------------ consumers
  setmaxnreg_inc<kConsumerRegs>();
  const ConsumerState<kSchedule> cs(p, smem, smem_base, b, row_block, split, direct, warpgroup);
  // The block's query rows into the swizzled WGMMA A tiles (zeros past num_rows), once; threads
  // 0..255 over both consumer warpgroups.
  stage_query<kBlockRows>(smem + kSmemQ8, kContentTileBytes, smem + kSmemQpe, p, b, cs.row0,
                          threadIdx.x - 128, 256);
  fence_proxy_async();
  named_barrier_sync(1, 256);
  RowState rows;
  cs.init_rows(rows, seq_len, valid);
  // The last page's live tokens.  Never read without pages (num_iters 0: an empty or invalid
  // request, whose length may then be near INT_MAX and this difference wrap).  Guarding it with
  // max(num_iters, 1) moved the split-roles kernel's page addressing off the uniform datapath,
  // so it stays unguarded.
  const PageRing ring{smem_base, full_bar, empty_bar, first_page, num_iters,
                      min(seq_len - (first_page + num_iters - 1) * kPageSize, kPageSize)};

  // Each role accumulates O, in the current sigma_P domain, for its output columns.
  if constexpr (kSchedule == kScheduleFree) {
    // Both warpgroups compute every page's S and P8 (identical), each applies it to its columns.
    float o[2][kPvN / 2];   // columns [256 * consumer, +256), two 128-column halves
    fill_zero(o);
    for (int i = 0; i < num_iters; ++i) {
      ring.wait(i);
      named_barrier_sync(cs.wg_barrier, 128);   // every warp's previous PV WGMMA has read vt
      cs.build_own_vt(ring, i, 0);
      fence_proxy_async();   // V^T becomes visible to the WGMMA (async) proxy
      named_barrier_sync(cs.wg_barrier, 128);
      uint32_t p8[2][4];
      float gamma[2];
      {
        float s[32], k_scale[16];
        cs.compute_s(ring, i, s);
        cs.load_scales(ring, i, k_scale);
        ring.release(i);   // this thread's QK WGMMAs completed, V^T built, scales read
        cs.softmax(ring, rows, i, s, k_scale, p8, gamma);
      }
      // O = gamma O + P8 . V8 (V^T buffer 0), as four 64-column quarters of O (the same
      // registers, viewed as pieces).
      apply_page_to(reinterpret_cast<float(&)[4][kPvN / 4]>(o), p8, gamma, cs.vt_desc, 0);
    }
    cs.write_output(rows, o, cs.consumer * kOutColsPerWarpgroup);
  } else if (cs.consumer == 0) {
    // kScheduleSplitRoles, WG1 (see qk_softmax_page).
    float o_qk[kQkPieces][kQkPieceCols / 2];   // columns [0, kQkWarpgroupCols)
    fill_zero(o_qk);
    // Unrolled by the ring's stages: with the stage a constant of each copy, the WGMMA
    // descriptors of the page's tiles are uniform-register constants instead of 64-bit
    // values rebuilt in vector registers for every WGMMA (the page counter is not uniform
    // to the compiler): 1,065 instead of 1,224 static SASS instructions per page.
    for (int i0 = 0; i0 < num_iters; i0 += kStages) {
#pragma unroll
      for (int i = i0; i < i0 + kStages; ++i) {
        if (i >= num_iters) break;
        qk_softmax_page(cs, ring, rows, o_qk, i);
      }
    }
    if (num_iters > 0) cs.store_row_state(rows);   // for WG2's epilogue
    named_barrier_sync(kPageBarrier, 256);
    cs.write_output(rows, o_qk, 0);
  } else {
    // kScheduleSplitRoles, WG2: the other columns, in 32-column pieces (two accumulators fit
    // beside them).
    float o_vt[kVtPieces][16];
    fill_zero(o_vt);
    // Unrolled by the ring's stages as WG1's loop: with the page parity a constant, the PV
    // descriptors are uniform-register constants (and the loop has no spill).
    for (int i0 = 0; i0 < num_iters; i0 += kStages) {
#pragma unroll
      for (int i = i0; i < i0 + kStages; ++i) {
        if (i >= num_iters) break;
        vt_pv_page(cs, ring, o_vt, i);
      }
    }
    named_barrier_sync(kPageBarrier, 256);
    if (num_iters > 0) cs.load_handed_over_state(rows);
    cs.write_output(rows, o_vt, kQkWarpgroupCols);
  }
#elif defined(__CUDA_ARCH__)
  // Not sm_90a (e.g. a plain sm_90 build): fail loudly rather than return garbage.  The launcher
  // never starts this on the sm_89 build.
  __trap();
#endif  // SNAPMLA_SM90_DEVICE
}

}  // namespace snapmla::sm90
