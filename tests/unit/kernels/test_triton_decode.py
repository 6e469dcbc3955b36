"""The Triton decode kernel run by Triton's CPU interpreter on tiny cases, and the split heuristic.

The interpreter must be switched on before Triton decorates the kernel, so the kernel runs in a
child process started with ``TRITON_INTERPRET=1``.  Triton 3.6's interpreter rounds float->fp8
and float->bf16 casts toward zero (with a carry bug) and multiplies bf16 operands as raw
integers; ``_exact_interpreter_casts`` replaces those two steps with PyTorch's exact casts so the
comparison tests the kernel, not the interpreter (and makes its scalars usable as loop bounds
under NumPy >= 2.5).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _exact_interpreter_casts():
    import numpy as np
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as interp

    torch_types = {tl.float8e4nv: torch.float8_e4m3fn, tl.bfloat16: torch.bfloat16,
                   tl.float16: torch.float16, tl.float32: torch.float32}
    bits = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32)}
    triton_cast = interp._convert_float

    def convert(data, src, dst, rounding):
        if src not in torch_types or dst not in torch_types:
            return triton_cast(data, src, dst, rounding)
        t = torch.from_numpy(np.ascontiguousarray(data))
        if src in (tl.float8e4nv, tl.bfloat16):         # stored as raw unsigned integers
            t = t.view(bits[torch_types[src].itemsize][0]).view(torch_types[src])
        out = t.to(torch_types[dst])
        raw_t, raw_np = bits[out.element_size()]
        return out.view(raw_t).numpy().view(raw_np)

    triton_dot = interp.InterpreterBuilder.create_dot

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16:
            widen = lambda x: interp.TensorHandle(  # noqa: E731
                (x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
            a, b = widen(a), widen(b)
        return triton_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    # NumPy >= 2.5 refuses int() of a one-element 1-d array, which the interpreter's scalars are.
    patch_tensor = interp._patch_lang_tensor

    def patch_tensor_with_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._convert_float = convert
    interp.InterpreterBuilder.create_dot = dot
    interp._patch_lang_tensor = patch_tensor_with_index


def _interpreted_cases():
    """Child process: run tiny cases through the interpreted kernel, print errors as JSON."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _exact_interpreter_casts()
    import torch

    from vllm_snapmla.testing import build_cache
    from vllm_snapmla import reference as ref
    from vllm_snapmla.kernels.triton_decode import snapmla_decode

    results = []
    gen = torch.Generator().manual_seed(0)
    for H, s_q, seq_lens, splits, causal in [(8, 2, [1, 70, 130, 0], 1, True),
                                             (8, 2, [1, 70, 130, 0], 3, True),
                                             (16, 2, [64, 65], 2, False),
                                             (8, 1, [1, 70, 900, 0], None, True)]:
        cache, bt, _ = build_cache(seq_lens, gen=gen)
        # Request 1's first page on an all-zero block (vLLM's null block, scale 0): zero tokens.
        cache = torch.cat([cache, torch.zeros_like(cache[:1])])
        bt[1, 0] = cache.shape[0] - 1
        B = len(seq_lens)
        q = torch.randn(B, s_q, H, 512, generator=gen).bfloat16()
        qp = (torch.randn(B, s_q, H, 64, generator=gen) * 3).bfloat16()
        q8, qs, qpe = ref.quantize_q(q, qp)
        sl = torch.tensor(seq_lens, dtype=torch.int32)
        out, lse = snapmla_decode(q8, qs, qpe, cache, bt, sl, 0.1, causal, num_splits=splits)
        r_out, r_lse = ref.decode_quantized(q8, qs, qpe, cache, bt, sl, 0.1, causal)
        seen = torch.isfinite(r_lse)
        results.append({
            "case": [H, s_q, seq_lens, splits, causal],
            "rel": ((out.double() - r_out).norm() / r_out.norm()).item(),
            "lse": (lse.double() - r_lse)[seen].abs().max().item(),
            "same_empty_rows": torch.equal(torch.isneginf(lse), ~seen),
            "empty_rows_zero": bool((out.permute(0, 2, 1, 3)[~seen] == 0).all()),
            "finite": bool(torch.isfinite(out).all()),
        })
    # Invalid indices and non-finite values: the same rows come out NaN as in the reference,
    # with and without splits, and the other rows are unaffected.
    for splits in (None, 1, 3):
        cache, bt, _ = build_cache([70, 130, 200, 300, 90], gen=gen)
        bt = bt.clone()
        bt[2, 1] = -1                          # live page of request 2: outside the cache
        bt[3, 4] = cache.shape[0] + 7          # live page of request 3: outside the cache
        sl = torch.tensor([70, 130, 200, 300, bt.shape[1] * 64 + 1], dtype=torch.int32)
        q = torch.randn(5, 1, 8, 512, generator=gen).bfloat16()
        qp = torch.randn(5, 1, 8, 64, generator=gen).bfloat16()
        q[0, 0, 3, 7] = float("nan")           # one head of request 0
        cache[bt[1, 1], 5, 100] = 0x7F         # an e4m3 NaN in a live row of request 1
        q8, qs, qpe = ref.quantize_q(q, qp)
        out, lse = snapmla_decode(q8, qs, qpe, cache, bt, sl, 0.1, True, num_splits=splits)
        r_out, r_lse = ref.decode_quantized(q8, qs, qpe, cache, bt, sl, 0.1, True)
        nan_rows = r_out.isnan().any(-1)
        ok = ~nan_rows
        results.append({
            "case": ["nan", splits],
            "same_nan_rows": torch.equal(out.isnan().any(-1), nan_rows)
            and torch.equal(lse.isnan(), r_lse.isnan()),
            "expected_nan_rows": nan_rows.sum().item(),
            "rel": ((out.double() - r_out)[ok].norm() / r_out[ok].norm()).item(),
        })
    # Index tensors as callers may pass them: int64 values 2^32 past a valid one (NaN for that
    # request, not the valid value they would wrap to), a strided seq_lens view (read as its
    # values), and a column-strided table (refused).
    cache, bt, _ = build_cache([70, 130, 200], gen=gen)
    sl = torch.tensor([70, 130, 200], dtype=torch.int32)
    q = torch.randn(3, 1, 8, 512, generator=gen).bfloat16()
    qp = torch.randn(3, 1, 8, 64, generator=gen).bfloat16()
    q8, qs, qpe = ref.quantize_q(q, qp)
    base_out, base_lse = snapmla_decode(q8, qs, qpe, cache, bt, sl, 0.1)
    wide_lens = sl.long()
    wide_lens[1] += 2**32
    wide_table = bt.long()
    wide_table[2, 3] += 2**32
    strided_lens = torch.stack([sl, sl.flip(0)], 1)[:, 0]
    checks = {}
    for name, table, lens, nan_request in [("int64 length", bt, wide_lens, 1),
                                           ("int64 block id", wide_table, sl, 2),
                                           ("strided lengths", bt, strided_lens, None)]:
        out, lse = snapmla_decode(q8, qs, qpe, cache, table, lens, 0.1)
        others = [b for b in range(3) if b != nan_request]
        checks[name] = (torch.equal(out[others], base_out[others])
                        and torch.equal(lse[others], base_lse[others])
                        and (nan_request is None
                             or bool(out[nan_request].isnan().all()
                                     and lse[nan_request].isnan().all())))
    # Causal s_q = 2: request 1 (65 tokens) has its last page read by its second query only. A
    # bad block id there makes that row NaN (output and LSE); the first query keeps its LSE, and
    # its output is the unbroken one or NaN (P' = 0 x NaN); the other requests do not change.
    cache, bt, _ = build_cache([129, 65, 70], gen=gen)
    sl = torch.tensor([129, 65, 70], dtype=torch.int32)
    q8, qs, qpe = ref.quantize_q(torch.randn(3, 2, 8, 512, generator=gen).bfloat16(),
                                 torch.randn(3, 2, 8, 64, generator=gen).bfloat16())
    for block in (-1, cache.shape[0] + 5):
        for splits in (None, 1, 2):
            base_out, base_lse = snapmla_decode(q8, qs, qpe, cache, bt, sl, 0.1,
                                                num_splits=splits)
            table = bt.clone()
            table[1, 1] = block
            out, lse = snapmla_decode(q8, qs, qpe, cache, table, sl, 0.1, num_splits=splits)
            checks[f"block {block} read by the last query only, splits {splits}"] = bool(
                out[1, 1].isnan().all() and lse[1, :, 1].isnan().all()
                and torch.equal(lse[1, :, 0], base_lse[1, :, 0])
                and (out[1, 0].isnan().all() or torch.equal(out[1, 0], base_out[1, 0]))
                and torch.equal(out[[0, 2]], base_out[[0, 2]])
                and torch.equal(lse[[0, 2]], base_lse[[0, 2]]))
    try:
        snapmla_decode(q8, qs, qpe, cache, bt.repeat_interleave(2, 1)[:, ::2], sl, 0.1)
        checks["column-strided table refused"] = False
    except ValueError as e:
        checks["column-strided table refused"] = "unit column stride" in str(e)
    results.append({"case": ["indices"], "checks": checks})
    print(json.dumps(results))


def test_interpreted_kernel_matches_reference():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    child = subprocess.run(
        [sys.executable, "-c",
         "from tests.unit.kernels.test_triton_decode import _interpreted_cases as f; f()"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]
    for r in json.loads(child.stdout.strip().splitlines()[-1]):
        if r["case"][0] == "indices":
            assert all(r["checks"].values()), r
            continue
        if r["case"][0] == "nan":
            # Request 0: one head; requests 1-4: every head (16 + ... rows of 8 heads).
            assert r["same_nan_rows"] and r["expected_nan_rows"] == 1 + 4 * 8, r
            assert r["rel"] < 4e-3, r
            continue
        # FP32 kernel vs float64 reference of the same algorithm, then a bf16 output cast.
        assert r["rel"] < 4e-3 and r["lse"] < 1e-4, r
        assert r["same_empty_rows"] and r["empty_rows_zero"] and r["finite"], r


def test_split_planner_model():
    import torch

    from vllm_snapmla.kernels import splits

    # Enough programs already (one 64-row block per SM): one split, the whole request.
    assert splits.pages_per_split_for([128 * 64] * 66, programs=132, slots=132, max_splits=4,
                                      table_pages=128) == 128
    # Half the GPU: two splits of half the pages.
    assert splits.pages_per_split_for([128 * 64] * 66, programs=66, slots=132, max_splits=4,
                                      table_pages=128) == 64
    # One long request on an empty GPU: spread over many splits, never more than max_splits.
    per_split = splits.pages_per_split_for([131072], programs=1, slots=132, max_splits=132,
                                           table_pages=2048)
    assert 2048 / 132 <= per_split <= 64
    # Every request's runs count, not the longest one's times the batch: at 128 heads (two row
    # blocks) 16 requests of 32k tokens fill the 132 SMs with runs of 128 pages, but one 32k
    # request among 4k ones takes shorter runs, and they still fit in one wave.
    uniform = splits.pages_per_split_for([32768] * 16, 32, 132, 9, 2560)
    ragged = splits.pages_per_split_for([32768] + [4096] * 15, 32, 132, 9, 2560)
    assert uniform == 128
    assert ragged < uniform and -(-512 // ragged) <= 9
    assert 2 * (-(-512 // ragged) + 15 * -(-64 // ragged)) <= 132
    # Empty batches take one page per split.
    assert splits.pages_per_split_for([0, 0], 2, 132, 8, 64) == 1
    # Invalid lengths (negative, longer than the table) count as empty requests: they read
    # nothing.
    assert splits.pages_per_split_for([-5, 10**9, 64 * 64], 3, 132, 100, 64) == \
        splits.pages_per_split_for([0, 0, 64 * 64], 3, 132, 100, 64)
    # Whatever the lengths, the run length is one of the candidates, so the longest request
    # needs at most max_splits runs.
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        batch = int(torch.randint(1, 40, (1,), generator=gen))
        lens = torch.randint(0, 20000, (batch,), generator=gen).tolist()
        max_splits = int(torch.randint(1, 40, (1,), generator=gen))
        per_split = splits.pages_per_split_for(lens, 2 * batch, 132, max_splits, 512)
        longest = max(-(-n // 64) for n in lens)
        assert per_split >= 1 and -(-longest // per_split) <= max(max_splits, 1)
        assert longest == 0 or per_split in {-(-longest // s) for s in range(1, max_splits + 1)}


def test_split_ranges_cover_each_request_once():
    from vllm_snapmla.kernels import splits

    for seq_len in (0, 1, 64, 65, 700, 131072):
        for per_split in (0, 1, 3, 64):
            for max_splits in (1, 2, 7, 264):
                ranges = [splits.split_range(seq_len, 2048, per_split, max_splits, s)
                          for s in range(max_splits)]
                runs = ranges[0][2]
                assert 1 <= runs <= max_splits
                pages = [p for first, n, _ in ranges for p in range(first, first + n)]
                assert pages == list(range(-(-seq_len // 64))), (seq_len, per_split, max_splits)
                assert all(n == 0 for _, n, _ in ranges[runs:])
    # A length the table cannot hold: no pages, one run (written directly, as NaN).
    for seq_len, table_pages in ((-1, 4), (4 * 64 + 1, 4), (10**9, 2048)):
        assert splits.split_range(seq_len, table_pages, 0, 8, 0) == (0, 0, 1)
        assert not splits.valid_length(seq_len, table_pages)
    assert splits.valid_length(4 * 64, 4) and splits.valid_length(0, 4)
    # The grid: two waves of CTAs at most for several requests, one for a single request, never
    # more splits than the table has pages.
    assert splits.max_splits_for(batch=64, programs=64, slots=132, table_pages=2560) == 5
    assert splits.max_splits_for(batch=2, programs=2, slots=132, table_pages=2560) == 132
    assert splits.max_splits_for(batch=1, programs=1, slots=132, table_pages=2560) == 132
    assert splits.max_splits_for(batch=1, programs=2, slots=132, table_pages=2560) == 66
    assert splits.max_splits_for(batch=1, programs=4, slots=114, table_pages=2560) == 28
    assert splits.max_splits_for(batch=1, programs=1, slots=132, table_pages=16) == 16
    assert splits.max_splits_for(batch=1, programs=200, slots=132, table_pages=2560) == 1
    assert splits.max_splits_for(batch=1000, programs=1000, slots=132, table_pages=2560) == 1
