"""eval.reparametrize_rope on the smoke checkpoint: the model's logits stay bit-identical while
its RoPE keys grow to the asked range, the content does not move, and vLLM's loader would see
the same tensor names."""

import json
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from eval.reparametrize_rope import (  # noqa: E402
    GROUPS, calibration_tokens, group_rows, load_model)

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_groups_are_closed_under_both_rope_pairings():
    rows = sorted(r for g in range(GROUPS) for r in group_rows(g))
    assert rows == list(range(64))
    for g in range(GROUPS):
        group = set(group_rows(g))
        for r in group:
            assert r ^ 1 in group                      # interleaved pair (2i, 2i+1)
            assert (r + 32) % 64 in group              # NeoX pair (i, i+32)


@pytest.mark.parametrize("target", [100.0, 1000.0])
def test_reparametrization_keeps_logits_and_moves_rope_keys(smoke_checkpoint, tmp_path, target):
    out = tmp_path / "model"
    proc = subprocess.run([sys.executable, "-m", "eval.reparametrize_rope", "--model",
                           str(smoke_checkpoint), "--out", str(out), "--rope-absmax", str(target),
                           "--calibration-tokens", "1024"],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "reparametrization.json").read_text())
    assert report["max_abs_logit_difference"] == 0.0
    assert report["nll_after"] == report["nll_before"]
    for layer in report["layers"]:
        before, after = layer["before"], layer["after"]
        assert after["content_absmax"] == before["content_absmax"]
        # Powers of two: within a factor of 2^0.5 of the target, up to the pair-norm bound.
        assert target / 2 <= max(after["group_absmax"]) <= target * 1.5
        assert all(a >= 1 and math_is_power_of_two(a) for a in layer["alphas"])
    old = load_file(smoke_checkpoint / "model.safetensors")
    new = load_file(out / "model.safetensors")
    assert old.keys() == new.keys()
    changed = {k for k in old if not torch.equal(old[k], new[k])}
    assert all("kv_a_proj_with_mqa" in k or "q_b_proj" in k for k in changed)
    # Both sides of every layer's rescaling were written (keys up, queries down).
    for kind in ("kv_a_proj_with_mqa", "q_b_proj"):
        assert len({k for k in changed if kind in k}) == len(report["layers"]), kind
    # The written checkpoint, loaded as a user would, gives the source's logits exactly: the
    # report alone describes the model in memory before it was saved.
    tokens = calibration_tokens(smoke_checkpoint, 256)
    with torch.no_grad():
        source_logits = load_model(smoke_checkpoint)(tokens).logits
        written_logits = load_model(out)(tokens).logits
    assert torch.equal(written_logits, source_logits)
    assert (out / "value_range.png").stat().st_size > 0
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()


def math_is_power_of_two(x: float) -> bool:
    import math
    m, _ = math.frexp(x)
    return m == 0.5
