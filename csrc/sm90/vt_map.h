// The V^T build's per-lane address map (decode_kernel.cuh, build_vt).  Host- and
// device-callable, so that tests/unit/kernels/test_vt_layout.py runs this very function through
// its lane-by-lane simulation of the build.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "sm90/config.h"

namespace snapmla::sm90 {

// V^T of one page: ldmatrix.trans of 16-bit pairs, two byte permutes per word, stmatrix.
// Warp w transposes tokens 16 w .. 16 w + 15; step q of a 256-column half takes the 32 columns
// 32 q .. + 31 of the half as four 8 x 8 matrices of 16-bit pairs (tokens 0-7 and 8-15 of the
// warp's 16, by two 16-column chunks).  ldmatrix.trans leaves lane l, per matrix, the column
// pair 2 (l / 4), +1 of tokens a = 2 (l % 4), a + 1 (of its 8); one permute of the words of
// tokens a, a + 1 and a + 8, a + 9 then gives column c's bytes for those 4 tokens, which is V^T
// row c at A positions 4 (l % 4) .. + 3 of the warp's 16 (the token order of the P
// accumulator's registers, which the PV's A operand keeps), and stmatrix writes each word at
// lane 4 r + word of matrix row r.  Each stmatrix matrix takes even columns for rows 0-3 and odd
// ones for rows 4-7 (or the reverse), so that its 8 rows fall in 8 different 16-byte bank groups
// of the 128-byte swizzle; the 8 rows of each ldmatrix matrix are 8 consecutive tokens, which
// the swizzle spreads likewise.  Per thread and 256-column half: 8 ldmatrix.x4, 32 permutes,
// 8 stmatrix.x4, where a build with 4-byte word loads and stores took 32, 64 and 32.
struct VtMap {
  uint32_t load;     // byte offset of lane's ldmatrix row (matrix l / 8, row l % 8) in the half's
                     // first content tile at step q = 0; step q XORs 32 (q % 4), adds 8 KB (q / 4)
  uint32_t store;    // byte offset of lane's stmatrix row in V^T buffer 0 at step 0; step q adds
                     // 4 KB q, buffer 1 XORs 64
  uint32_t sel[2];   // __byte_perm selectors of matrices 0, 2 and 1, 3: even or odd column
  int token0;        // a: the lane's data tokens are a, a + 1 (low, high pair), a + 8, a + 9
};

__host__ __device__ __forceinline__ VtMap make_vt_map(int warp, int lane) {
  VtMap map;
  const int token = 16 * warp + 8 * ((lane >> 3) & 1) + (lane & 7);
  map.load = token * kSwizzleRowBytes + ((((lane >> 4) ^ lane) & 7) << 4);
  const int m = lane >> 3, r = lane & 7;
  const int col = 2 * r + 16 * (m >> 1) + ((m & 1) ^ (r >= 4 ? 1 : 0));   // V^T row at step 0
  map.store = col * kSwizzleRowBytes + (((warp ^ col) & 7) << 4);
  const bool even_first = (lane >> 2) < 4;   // this lane's data row in every matrix < 4
  map.sel[0] = even_first ? 0x6420 : 0x7531;
  map.sel[1] = even_first ? 0x7531 : 0x6420;
  map.token0 = 16 * warp + 2 * (lane & 3);
  return map;
}

}  // namespace snapmla::sm90
