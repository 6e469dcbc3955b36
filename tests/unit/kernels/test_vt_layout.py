"""The sm_90a kernel's V^T build (csrc/sm90/decode_kernel.cuh, ``build_vt``), simulated lane by
lane: ldmatrix.x4.trans, the byte permutes and stmatrix.x4 with the addresses and selectors of
``make_vt_map`` (csrc/sm90/vt_map.h, compiled here for the host and run) must write the V^T
layout the PV WGMMA reads (K-major rows of 64 tokens in the permuted A order, 128-byte swizzle,
two page buffers), zeros for empty slots, nothing outside the page's buffer, and every 8-row
phase of both instructions in 8 different 16-byte bank groups.  The GPU tests check the kernel's
results; this pins the map down where a wrong one would be a hunt.  The per-step arithmetic of
``build_vt`` (step q's offsets) is mirrored in ``_build``: change the two together."""

import subprocess

import numpy as np
import pytest

from tests.unit.kernels.host_probe import build_probe

PAGE, COLS, ROW = 64, 256, 128          # tokens, columns of one half, swizzled row bytes
TILE = PAGE * ROW                       # one 64 x 128 e4m3 content tile


def _swizzled(row, byte):
    return row * ROW + ((((byte // 16) ^ row) & 7) << 4) + byte % 16


def _a_order_token(k):
    """Token at A position k of the page (what the P accumulator's registers hold)."""
    kk = k % 16
    return 16 * (k // 16) + 8 * ((kk >> 1) & 1) + 2 * (kk >> 2) + (kk & 1)


_PROBE = r"""
#include <cstdio>
#include "sm90/vt_map.h"
int main() {
  for (int warp = 0; warp < 4; ++warp)
    for (int lane = 0; lane < 32; ++lane) {
      const snapmla::sm90::VtMap m = snapmla::sm90::make_vt_map(warp, lane);
      std::printf("%u %u %u %u %d\n", m.load, m.store, m.sel[0], m.sel[1], m.token0);
    }
}
"""


@pytest.fixture(scope="module")
def vt_maps(tmp_path_factory):
    """``make_vt_map(warp, lane)`` of the header, for the 4 warps x 32 lanes of a warpgroup."""
    probe = build_probe(tmp_path_factory, "vt_map", _PROBE, "csrc/sm90/vt_map.h")
    rows = subprocess.run([str(probe)], capture_output=True, text=True, check=True,
                          timeout=60).stdout.split("\n")
    maps = {}
    for i, row in enumerate(r for r in rows if r):
        load, store, sel0, sel1, token0 = map(int, row.split())
        maps[divmod(i, 32)] = (load, store, (sel0, sel1), token0)
    assert len(maps) == 128
    return maps


def _byte_perm(a, b, sel):
    x = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    return int.from_bytes(bytes(x[(sel >> (4 * i)) & 7] for i in range(4)), "little")


def _distinct_bank_groups(addresses):
    return len({(a // 16) % 8 for a in addresses}) == 8


def _build(vt_maps, stage, buf, live):
    """V^T of one half as the kernel builds it, from the half's two swizzled content tiles."""
    vt = np.full(COLS * ROW, 0xEE, np.uint8)
    for warp in range(4):
        maps = [vt_maps[warp, lane] for lane in range(32)]
        keep = []
        for *_, a in maps:
            def pair(t):
                return (0xFFFF if t < live else 0) | (0xFFFF0000 if t + 1 < live else 0)
            keep.append((pair(a), pair(a + 8)))
        for q in range(COLS // 32):
            rows = [(q // 4) * TILE + (maps[lane][0] ^ (32 * (q % 4))) for lane in range(32)]
            mats = [[stage[rows[8 * j + r]:rows[8 * j + r] + 16].view(np.uint16) for r in range(8)]
                    for j in range(4)]
            for j in range(4):
                assert _distinct_bank_groups(rows[8 * j:8 * j + 8]), ("ldmatrix", warp, q, j)
            words = []
            for lane in range(32):
                # ldmatrix .trans: lane l gets, per matrix, element (row 2 (l % 4), +1; col l / 4)
                d = [int(mats[j][2 * (lane % 4)][lane // 4])
                     | int(mats[j][2 * (lane % 4) + 1][lane // 4]) << 16 for j in range(4)]
                lo, hi = keep[lane]
                sel = maps[lane][2]
                d = [d[0] & lo, d[1] & hi, d[2] & lo, d[3] & hi]
                words.append([_byte_perm(d[0], d[1], sel[0]), _byte_perm(d[0], d[1], sel[1]),
                              _byte_perm(d[2], d[3], sel[0]), _byte_perm(d[2], d[3], sel[1])])
            dst = [(maps[lane][1] ^ (64 * buf)) + q * 32 * ROW for lane in range(32)]
            for j in range(4):
                assert _distinct_bank_groups(dst[8 * j:8 * j + 8]), ("stmatrix", warp, q, j)
                for r in range(8):   # stmatrix: lane 4 r + w holds bytes 4 w .. 4 w + 3 of row r
                    for w in range(4):
                        at = dst[8 * j + r] + 4 * w
                        vt[at:at + 4] = np.frombuffer(words[4 * r + w][j].to_bytes(4, "little"),
                                                      np.uint8)
    return vt


@pytest.mark.parametrize("buf", [0, 1])
@pytest.mark.parametrize("live", [64, 37, 9, 1])
def test_vt_build_writes_the_pv_operand_layout(vt_maps, buf, live):
    rng = np.random.default_rng(live + 100 * buf)
    v = rng.integers(0, 256, size=(PAGE, COLS), dtype=np.uint8)      # a half's content
    stage = np.zeros(2 * TILE, np.uint8)
    for t in range(PAGE):
        for c in range(COLS):
            stage[(c // ROW) * TILE + _swizzled(t, c % ROW)] = v[t, c]
    vt = _build(vt_maps, stage, buf, live)
    written = np.zeros(vt.shape, bool)
    for col in range(COLS):
        for k in range(PAGE):
            at = _swizzled(col, buf * PAGE + k)
            written[at] = True
            t = _a_order_token(k)
            assert vt[at] == (v[t, col] if t < live else 0), (col, k, t)
    assert (vt[~written] == 0xEE).all(), "bytes outside the page's V^T buffer were written"
