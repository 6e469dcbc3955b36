"""Argument checks of ``vllm_snapmla.kernels.sm90`` that run in Python, before any GPU work
(the op's own checks, in ``csrc/api/decode_ops.cpp``, are tested in ``tests/gpu``)."""

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


def test_schedule_variants_are_fixed_partials():
    assert sm90.DEFAULT_SCHEDULE in sm90.SCHEDULES
    with pytest.raises(ValueError, match="schedule must be one of"):
        sm90.schedule_variant("fast")
    assert sm90.snapmla_decode_sm90_split_roles.__name__ == "snapmla_decode_sm90[split-roles]"
    assert set(sm90.SCHEDULES) == {"free", "split-roles", "narrow"}
