"""Argument checks of ``vllm_snapmla.kernels.sm90`` that run in Python, before any GPU work
(the op's own checks, in ``csrc/api/decode_ops.cpp``, are tested in ``tests/gpu``)."""

import contextlib

import pytest
import torch

from vllm_snapmla import format as fmt
from vllm_snapmla.kernels import sm90


def _inputs():
    q8 = torch.zeros(1, 1, 16, fmt.KV_LORA_RANK, dtype=torch.float8_e4m3fn)
    q_scale = torch.ones(1, 1, 16)
    q_pe = torch.zeros(1, 1, 16, fmt.ROPE_DIM, dtype=torch.bfloat16)
    cache = torch.zeros(1, fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN, dtype=torch.uint8)
    block_table = torch.zeros(1, 1, dtype=torch.int32)
    return q8, q_scale, q_pe, cache, block_table, torch.ones(1, dtype=torch.int32)


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="schedule must be one of"):
        sm90.snapmla_decode_sm90(*_inputs(), 0.1, schedule="fast")


def test_schedule_variants_are_fixed_partials(monkeypatch):
    with pytest.raises(ValueError, match="schedule must be one of"):
        sm90.schedule_variant("fast")
    assert set(sm90.SCHEDULES) == {"free", "split-roles", "narrow"}
    seen = {}
    monkeypatch.setattr(sm90, "snapmla_decode_sm90",
                        lambda *args, **kwargs: seen.update(kwargs) or "ran")
    free = sm90.schedule_variant("free")
    assert free.__name__ == "snapmla_decode_sm90[free]"
    assert free(*_inputs(), 0.1) == "ran" and seen["schedule"] == "free"


class _FakeOps:
    def __init__(self, has_code):
        self.has_code = has_code

    def has_sm90a_code(self):
        return self.has_code


@pytest.mark.parametrize("capability, has_code, expected", [
    ((9, 0), True, True),
    ((9, 0), False, False),    # an sm_90 GPU, a build without 90a: the Triton kernel serves it
    ((8, 9), True, False),
    ((10, 0), True, False),
])
def test_available_needs_an_sm90_gpu_and_sm90a_code(monkeypatch, capability, has_code, expected):
    monkeypatch.setattr(sm90, "native", lambda: _FakeOps(has_code))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    assert sm90.available(0) is expected


def test_available_without_the_extension_or_a_gpu(monkeypatch):
    monkeypatch.setattr(sm90, "native", lambda: None)
    assert sm90.available() is False
    monkeypatch.setattr(sm90, "native", lambda: _FakeOps(True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sm90.available() is False


def test_launch_max_splits_follows_the_kernel_choice():
    # narrow kernel up to 32 rows: one CTA a request; 64-row kernel: one per 64 rows.
    assert sm90.launch_programs(64, 16) == 64 and sm90.launch_programs(64, 32) == 64
    assert sm90.launch_programs(64, 128) == 128 and sm90.launch_programs(3, 2 * 64 + 1) == 9
    assert sm90.launch_max_splits(64, 16, 2560, 132) == 5
    assert sm90.launch_max_splits(64, 128, 2560, 132) == 3
    assert sm90.launch_max_splits(1, 128, 2560, 132) == 66
    assert sm90.launch_max_splits(1, 16, 2560, 132) == 132
    assert sm90.launch_max_splits(1, 16, 8, 132) == 8   # never more than the table's pages
