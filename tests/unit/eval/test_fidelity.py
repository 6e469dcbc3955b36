"""``eval.fidelity`` (paper Appendix G) and ``eval.capture_vllm``'s context rebuild."""

import csv
import math
from types import SimpleNamespace

import torch

from eval import capture_vllm as capture
from eval import fidelity


def test_synthetic_study_orders_configs_as_the_paper_and_writes_files(tmp_path):
    layers = 6
    seed = 1   # fixed: the bounds below hold over about 200 seeds; a failure replays
    assert fidelity.main(["--synthetic", "--out", str(tmp_path), "--layers", str(layers),
                          "--tokens", "192", "--heads", "4", "--seed", str(seed)]) == 0
    for name in ("fidelity.md", "fidelity.csv", "fidelity.png", "value_range.png",
                 "value_range.csv"):
        assert (tmp_path / name).stat().st_size > 0, name
    rows = list(csv.DictReader(open(tmp_path / "fidelity.csv")))
    assert {r["config"] for r in rows} == set(fidelity.CONFIGS)
    assert len(rows) == layers * len(fidelity.CONFIGS)
    for r in rows:
        for metric in fidelity.METRICS:
            value = float(r[metric])
            assert math.isfinite(value) and value > 0, (seed, r)

    rel = {(int(r["layer"]), r["config"]): float(r["rel_l2"]) for r in rows}

    def deep(config):        # deeper half: where the RoPE outliers are large
        return sum(rel[(i, config)] for i in range(layers // 2, layers)) / (layers - layers // 2)

    def mean(config):
        return sum(rel[(i, config)] for i in range(layers)) / layers

    # Quantizing RoPE in FP8 (config A, vLLM fp8) blows up on deep layers; SnapMLA does not.
    # Over about 200 seeds the ratios ranged 1.7-8.6 (A), 1.5-10.9 (vllm_fp8) and 2.3-10.1
    # (A vs KV only), medians 4-5; each bound is at least 20% beyond the extreme seen.
    assert deep("A") > 1.3 * deep("snapmla"), seed
    assert deep("vllm_fp8") > 1.2 * deep("snapmla"), seed
    assert deep("A") > 1.5 * deep("snapmla_kv"), seed
    # SnapMLA (FP8 Q and P included) stays within a small factor of the content-only schemes,
    # which keep RoPE exactly as the model produced it (SnapMLA re-rounds k_pe / s to BF16):
    # over the same seeds 1.2-3.4 (medians 1.9) and, KV only, 1.1-3.2 (median 1.5).
    assert mean("snapmla") < 4.5 * min(mean("C"), mean("D")), seed
    assert mean("snapmla_kv") < 4.0 * min(mean("B"), mean("C"), mean("D")), seed
    ranges = list(csv.DictReader(open(tmp_path / "value_range.csv")))
    assert float(ranges[-1]["rope_absmax"]) > 100 * float(ranges[-1]["content_p99"])


def test_quantizers_keep_their_granularity():
    g = torch.Generator().manual_seed(2)
    kv_c = torch.randn(130, 512, generator=g)
    kv_c[:64, :128] *= 1e5                 # one loud tile
    k_pe = 600.0 * torch.randn(130, 64, generator=g)
    rel = lambda x, y: ((x - y).norm() / y.norm()).item()
    quiet = (slice(64, None), slice(128, None))
    # Per-block scales confine the loud tile; a per-tensor scale pushes the rest into subnormals.
    d_content, d_rope = fidelity.quantized_kv("D", kv_c, k_pe)
    b_content, _ = fidelity.quantized_kv("B", kv_c, k_pe)
    assert rel(d_content[quiet], kv_c[quiet].double()) < 0.05
    assert rel(b_content[quiet], kv_c[quiet].double()) > 2 * rel(d_content[quiet],
                                                                 kv_c[quiet].double())
    assert torch.equal(d_rope, k_pe.double())              # RoPE untouched by B-D
    # vLLM fp8 with scale 1.0 saturates RoPE at 448.
    _, v_rope = fidelity.quantized_kv("vllm_fp8", kv_c, k_pe)
    assert v_rope.abs().max().item() == 448.0


def _fake_impl_calls(recorder, steps, seqs, rng):
    """Drive the recorder like vLLM: prefill writes, then decode steps (write, then read)."""
    impl = SimpleNamespace(scale=0.125)
    layer = SimpleNamespace(layer_name="model.layers.0.self_attn.attn")
    pages = 16
    perm = torch.randperm(pages, generator=rng)
    block_table = perm[:len(seqs) * 4].view(len(seqs), 4).to(torch.int32)
    truth = {}

    def write(b, positions):
        n = len(positions)
        kv_c = torch.randn(n + 3, 512, generator=rng).bfloat16()     # padded rows beyond slots
        k_pe = torch.randn(n + 3, 1, 64, generator=rng).bfloat16()
        pos = torch.tensor(positions)
        slots = block_table[b, pos // 64].long() * 64 + pos % 64
        recorder.on_write(impl, kv_c, k_pe, slots)
        for i, p in enumerate(positions):
            truth[(b, p)] = (kv_c[i], k_pe[i, 0])

    # The first prefill writes position 0 with garbage, then rewrites it: the latest write wins.
    write(0, [0])
    for b, n in enumerate(seqs):
        write(b, list(range(n)))
    lens = list(seqs)
    for _ in range(steps):
        for b in range(len(seqs)):
            write(b, [lens[b]])
            lens[b] += 1
        q_nope = torch.randn(len(seqs) + 2, 4, 512, generator=rng).bfloat16()
        q_pe = torch.randn(len(seqs) + 2, 4, 64, generator=rng).bfloat16()
        decode = SimpleNamespace(block_table=block_table,
                                 seq_lens=torch.tensor(lens, dtype=torch.int32))
        recorder.on_decode(impl, layer, q_nope, q_pe, decode)
    return truth


def test_capture_rebuilds_each_decode_context_by_slot():
    rng = torch.Generator().manual_seed(3)
    recorder = capture.Recorder(decode_steps=2)
    seqs = [70, 130]
    truth = _fake_impl_calls(recorder, steps=3, seqs=seqs, rng=rng)
    out = capture.build_cases(recorder)
    assert out["softmax_scale"] == 0.125
    (layer,) = out["layers"]
    assert layer["name"] == "model.layers.0.self_attn.attn"
    assert len(layer["cases"]) == 2 * len(seqs)            # third step not recorded
    for i, case in enumerate(layer["cases"]):
        step, b = divmod(i, len(seqs))
        n = seqs[b] + step + 1
        assert case["q_nope"].shape == (1, 4, 512) and case["q_pe"].shape == (1, 4, 64)
        assert case["kv_c"].shape == (n, 512) and case["k_pe"].shape == (n, 64)
        want_c = torch.stack([truth[(b, p)][0] for p in range(n)])
        want_r = torch.stack([truth[(b, p)][1] for p in range(n)])
        assert torch.equal(case["kv_c"], want_c) and torch.equal(case["k_pe"], want_r)


def test_capture_file_feeds_the_study(tmp_path):
    rng = torch.Generator().manual_seed(4)
    recorder = capture.Recorder(decode_steps=1)
    _fake_impl_calls(recorder, steps=1, seqs=[65], rng=rng)
    path = tmp_path / "capture.pt"
    torch.save(capture.build_cases(recorder), path)
    assert fidelity.main(["--input", str(path), "--out", str(tmp_path / "study"),
                          "--configs", "B,snapmla"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "study" / "fidelity.csv")))
    assert [r["config"] for r in rows] == ["B", "snapmla"]
    assert all(0 < float(r["rel_l2"]) < 0.2 for r in rows)
