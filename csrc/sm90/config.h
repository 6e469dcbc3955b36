// Constants of the sm_90a SnapMLA decode kernels (decode_kernel.cuh, decode_narrow_kernel.cuh):
// tile shapes, shared-memory layouts, barrier ids, register budgets, the P pipeline's shift.
#pragma once

#include "format.h"

namespace snapmla::sm90 {

constexpr int kBlockRows = 64;           // query rows (s_q x head pairs) per CTA: one WGMMA M tile
constexpr int kConsumerWarpgroups = 2;   // WG1, WG2: each owns output columns (see kSchedule*)
constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);   // WG0 is the TMA producer
constexpr int kStages = 2;               // pages in flight in the shared-memory ring
// The even split of the output columns (kScheduleFree; kScheduleSplitRoles splits them at
// kQkWarpgroupCols below).
constexpr int kOutColsPerWarpgroup = kKvLoraRank / kConsumerWarpgroups;   // 256
constexpr int kPvN = 128;                // O's pieces in the even split (two; 64 registers each)

// How the consumer warpgroups divide the work (decode_kernel.cuh); DecodeParams::schedule.
constexpr int kScheduleFree = 0;         // both: S, softmax, V^T and PV of their 256 columns
constexpr int kScheduleSplitRoles = 1;   // WG1: S, softmax and P8 of every page; WG2: V^T
// Named barriers: 0 is __syncthreads, 1 the consumers' start, 2 + c consumer c's own.
// kScheduleSplitRoles: kPageBarrier the two consumers' meeting per page, kVtFreeBarrier + page
// parity WG1's release of a V^T buffer.  The narrow kernel: 1 both consumers (start, merge),
// 2 + c consumer c's reductions and P8^T hand-off.
constexpr int kPageBarrier = 4;
constexpr int kVtFreeBarrier = 5;        // and 6

// Register budgets after setmaxnreg (multiples of 8).  The CTA starts with its launch budget,
// 65536 / 384 = 168 per thread, and setmaxnreg moves registers within that pool: a consumer's
// setmaxnreg.inc waits until the producer's .dec has freed enough, so producer + 2 x consumer
// must not exceed 3 x 168 = 504, or the consumers wait forever.
constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;                          // 168
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;
static_assert(kProducerRegs + 2 * kConsumerRegs <= 3 * kLaunchRegs,
              "setmaxnreg budgets exceed the CTA's register pool: the consumers would hang");
// kScheduleSplitRoles: the QK warpgroup (WG1) keeps O for kQkWarpgroupCols output columns (96
// registers) beside kSplitQkParts 64-token QK accumulators; the V^T warpgroup (WG2) keeps O for
// the other 320 (160 registers); both have kConsumerRegs (a larger budget for WG2 would not
// help: ptxas allocated the whole kernel for the smallest setmaxnreg of its branches, 224 of
// 224/256).  Alternatives: 128 columns in WG1 spill 50 LDL/STL (WG2's 192-register O), three
// QK accumulators in WG1 39; 160 columns in 32-column pieces with three QK accumulators (13)
// timed within 2% of this on the H200 (`git show cb04609:benchmarks/RESULTS.md`, the split-roles
// measurements).
constexpr int kQkWarpgroupCols = 192;
constexpr int kQkPieceCols = 64;          // WG1's PV pieces (m64n32 or m64n64 WGMMAs)
constexpr int kSplitQkParts = 2;
static_assert(kQkWarpgroupCols % kQkPieceCols == 0 && (kKvLoraRank - kQkWarpgroupCols) % 32 == 0,
              "the split-roles PV runs in kQkPieceCols- (WG1) and 32-column (WG2) pieces");

// Hopper's FP8 WGMMA accumulates in reduced precision (about 14 mantissa bits, truncating).  The
// content QK (K = 512) therefore runs as chunks of this many columns, each into a fresh
// accumulator that is then added into the FP32 logit tile: the FP32 promotion point.  The
// Triton kernel measured LSE errors of 2.8e-2 without promotion and 1e-3 promoting every 64
// terms; on the H200 this kernel promoting every 128 (DeepSeek-V3's interval) missed the 1e-2
// LSE bound on sharp softmaxes (1.12e-2, tests/gpu test_peaked_attention).  Each chunk runs
// as two 32-token halves (m64n32k32, 16 accumulator registers each), so one half's promotion
// overlaps the other half's WGMMAs without more registers than one 64-token chunk.
constexpr int kQkPromoteCols = 64;
constexpr int kQkChunks = kKvLoraRank / kQkPromoteCols;                         // 8
// The V^T build (build_vt): each of a warpgroup's 4 warps transposes 16 of the page's tokens.
static_assert(kPageSize == 4 * 16, "the V^T build maps 16 tokens to each warp of a warpgroup");
constexpr int kWgmmaK8 = 32;             // K of one e4m3 WGMMA (32 bytes of a 128-byte row)
constexpr int kWgmmaK16 = 16;            // K of one bf16 WGMMA (also 32 bytes)

constexpr float kLn2 = 0.6931471805599453f;
// The 64-row kernel carries P' scaled by kPShift (decode_kernel.cuh, softmax): the
// quantization multiplier 448 / amax then stays finite down to the floor.
constexpr float kPShiftLog2 = 16.f;
constexpr float kPShift = 65536.f;   // 2^kPShiftLog2

// Shared memory: every WGMMA operand tile is [rows][128 bytes] with the 128-byte swizzle (the
// layout TMA writes with CU_TENSOR_MAP_SWIZZLE_128B), 1024-byte aligned.
constexpr int kSwizzleRowBytes = 128;
constexpr int kContentTileBytes = kPageSize * kSwizzleRowBytes;                 // 8 KB
constexpr int kContentTiles = kKvLoraRank / kSwizzleRowBytes;                   // 4
constexpr int kRopeTileBytes = kPageSize * 2 * kRopeDim;                        // 8 KB
constexpr int kScaleBoxFloats = 4;       // TMA boxes need 16-byte rows: the scale + 12 pad bytes
constexpr int kScaleTileBytes = kPageSize * kScaleBoxFloats * 4;                // 1 KB

constexpr int kStageContent = 0;
constexpr int kStageRope = kStageContent + kContentTiles * kContentTileBytes;
constexpr int kStageScale = kStageRope + kRopeTileBytes;
constexpr int kStageBytes = kStageScale + kScaleTileBytes;                      // 41 KB
constexpr int kStageTxBytes = kStageBytes;     // bytes the TMA delivers per page

constexpr int kSmemStages = 0;
constexpr int kSmemQ8 = kSmemStages + kStages * kStageBytes;
constexpr int kSmemQpe = kSmemQ8 + kContentTiles * kBlockRows * kSwizzleRowBytes;
// V^T of 256 output columns (one per row) x 64 tokens, padded to 128-byte swizzled rows; two of
// them hold all 512 columns, contiguously.
constexpr int kVtBytes = kOutColsPerWarpgroup * kSwizzleRowBytes;               // 32 KB
constexpr int kSmemVt = kSmemQpe + kBlockRows * kSwizzleRowBytes;
// kScheduleSplitRoles: per page, WG1 hands WG2's thread wg_tid the e4m3 P fragment (8 words) and
// gamma (2), stored word-major ([word][thread]) so a warp's accesses hit 32 banks; two buffers,
// by page parity.  After the last page WG1 hands over its row state m, peak, amax, l (2 each)
// for WG2's epilogue, in a buffer of its own.
constexpr int kHandOverWords = 8 + 2;
constexpr int kHandOverBytes = kHandOverWords * 128 * 4;                          // 5 KB
constexpr int kHandOverBuffers = 2;
constexpr int kRowStateBytes = 8 * 128 * 4;                                       // 4 KB
constexpr int kSmemHandOver = kSmemVt + kConsumerWarpgroups * kVtBytes;
constexpr int kSmemRowState = kSmemHandOver + kHandOverBuffers * kHandOverBytes;
constexpr int kSmemBarriers = kSmemRowState + kRowStateBytes;
// mbarriers: full[kStages], empty[kStages].
constexpr int kSmemBytes = kSmemBarriers + 2 * kStages * 8;
constexpr int kSmemAlloc = kSmemBytes + 1024;  // slack to align the dynamic base to 1024 bytes

static_assert(kStageBytes % 1024 == 0 && kSmemQ8 % 1024 == 0 && kSmemQpe % 1024 == 0 &&
                  kSmemVt % 1024 == 0, "swizzled tiles must be 1024-byte aligned");
static_assert(kSmemAlloc <= 227 * 1024, "exceeds Hopper's per-block shared memory");
static_assert(2 * kRopeDim == kSwizzleRowBytes, "a bf16 RoPE row is one 128-byte swizzle row");
static_assert((kQkPromoteCols % kWgmmaK8 == 0 && kSwizzleRowBytes % kQkPromoteCols == 0) ||
                  (kQkPromoteCols % kSwizzleRowBytes == 0 && kKvLoraRank % kQkPromoteCols == 0),
              "promotion chunks must tile the four 128-column content tiles");

// ------------------------------------------------------------------ the narrow kernels
// decode_narrow_kernel.cuh, for requests of at most kNarrowMaxRows query rows (DeepSeek-V3's
// 16 heads per TP8 rank, with MTP or 32 heads).  It computes S^T = K . Q^T (M = 64 tokens, N = 16
// or 32 rows), so nothing is padded to 64 rows, and O^T = V^T . P^T with V^T's A fragments built
// in registers (no V^T in shared memory).
constexpr int kScheduleNarrow = 2;       // DecodeParams::schedule of the narrow kernels
constexpr int kNarrowMaxRows = 32;       // the wider of its two forms (N of its WGMMAs)
// Two consumer warpgroups take alternate pages, each with its own softmax state and O^T, merged
// at the end: each one's page is a serial chain (QK, cross-warp reductions, PV), and a second
// warp per scheduler hides its latencies.  WG2 is the TMA producer (setmaxnreg as in the 64-row
// kernel).
constexpr int kNarrowConsumers = 2;
constexpr int kNarrowThreads = 128 * (kNarrowConsumers + 1);
constexpr int kNarrowStages = 4;         // pages in flight (no V^T buffers: the room is free)
// Consumer c takes split-local pages c, c + kNarrowConsumers, ...: with a ring of a multiple of
// kNarrowConsumers stages every stage (and its full barrier) belongs to one consumer, whose
// waits then see its phases in order.
static_assert(kNarrowStages % kNarrowConsumers == 0, "a ring stage would serve two consumers");
constexpr int kNarrowPTiles = kKvLoraRank / 64;  // O^T's 64-column M tiles (8)

// The shared-memory layout and register-shaped constants of the kRows-row form (16 or 32).
//   16 rows: O^T is 64 registers, so the page's whole V^T (64 A registers) is built during the
//            QK and the stage released before the softmax;
//   32 rows: O^T is 128 registers, so V^T is built one 64-column M tile at a time during the PV
//            (ldmatrix.trans from the stage), and the stage is released after the PV.
template <int kRows>
struct NarrowConfig {
  static_assert(kRows == 16 || kRows == 32, "the narrow kernel exists for 16 and 32 rows");
  static constexpr bool kVtInPv = kRows == 32;
  static constexpr int kAcc = kRows / 2;       // accumulator registers of one 64 x kRows tile
  static constexpr int kSlots = kRows / 4;     // query rows per thread
  // The 16-row form has tensor-core time to spare, so its content QK promotes after every WGMMA
  // (32 columns): the tensor core's reduced-precision accumulation then spans one instruction's
  // 32 terms.  The 32-row form promotes every kQkPromoteCols (64) like the 64-row kernel: half
  // the FP32 adds, 4-5% faster, and the same LSE error as split-roles on sharp softmaxes
  // (5.0-6.5e-3 at q_std 8, benchmarks/narrow_accuracy.py; benchmarks/RESULTS.md, "Accuracy
  // of the decode kernels").
  static constexpr int kQkPromoteCols = kRows == 32 ? sm90::kQkPromoteCols : kWgmmaK8;
  static constexpr int kQkChunks = kKvLoraRank / kQkPromoteCols;               // 16 or 8
  static constexpr int kQkParts = kRows == 16 ? 4 : 3;   // QK chunks in flight (kAcc each)
  static_assert(kQkParts >= 1 && kQkParts <= 4, "the QK wait ladder goes up to 3 pending");
  static constexpr int kQTileBytes = kRows * kSwizzleRowBytes;                 // 2 or 4 KB
  static constexpr int kQ8 = kNarrowStages * kStageBytes;
  static constexpr int kQpe = kQ8 + kContentTiles * kQTileBytes;
  // Per consumer, P^T: [kRows rows][64 token positions] e4m3, two buffers (bytes 0-63 and
  // 64-127 of each row).
  static constexpr int kPt = kQpe + kQTileBytes;
  // Per consumer, cross-warp reductions: [2 page parities][2: max, amax][kRows][4 warps] floats.
  static constexpr int kRedBytes = 2 * 2 * kRows * 4 * 4;
  static constexpr int kRed = kPt + kNarrowConsumers * kQTileBytes;
  // Row state kept in shared memory to spare the 32-row form's registers: the rows' score
  // scales and causal limits ([4 q][kSlots] floats and ints: a thread's slots are contiguous)
  // and, per consumer, each thread's share of the row sums l ([kSlots][128 threads] floats).
  static constexpr int kRowScale = kRed + kNarrowConsumers * kRedBytes;
  static constexpr int kRowVisible = kRowScale + kRows * 4;
  static constexpr int kRowSums = kRowVisible + kRows * 4;
  static constexpr int kRowSumsBytes = kSlots * 128 * 4;
  static constexpr int kBarriers = kRowSums + kNarrowConsumers * kRowSumsBytes;
  static constexpr int kSmemAlloc = kBarriers + 2 * kNarrowStages * 8 + 1024;
  // The merge reuses the page ring (idle by then): consumer 1's O^T fragments ([kRows / 2 x 8
  // values][128 threads] floats), then its rows' final m, l and amax ([kRows][4] floats).
  static constexpr int kMergeOBytes = kNarrowPTiles * kAcc * 128 * 4;
  static constexpr int kMergeBytes = kMergeOBytes + kRows * 4 * 4;
  static_assert(kQ8 % 1024 == 0 && kQTileBytes % 1024 == 0 && kQpe % 1024 == 0 &&
                    kPt % 1024 == 0, "swizzled tiles must be 1024-byte aligned");
  static_assert(kSmemAlloc <= 227 * 1024, "exceeds Hopper's per-block shared memory");
  static_assert(kMergeBytes <= kQ8, "the merge does not fit into the page ring");
};

}  // namespace snapmla::sm90
