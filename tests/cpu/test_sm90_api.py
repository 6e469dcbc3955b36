"""Argument checks of ``vllm_snapmla.sm90.snapmla_decode_sm90`` that run before any GPU work."""

import pytest
import torch

from vllm_snapmla import format as fmt
from vllm_snapmla import sm90


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


@pytest.mark.parametrize("schedule", ["split-roles", "narrow"])
def test_unpromoted_pv_only_with_the_free_schedule(schedule):
    with pytest.raises(ValueError, match="promote_pv=False exists only"):
        sm90.snapmla_decode_sm90(*_inputs(), 0.1, schedule=schedule, promote_pv=False)


def test_schedule_variants_are_fixed_partials():
    assert sm90.DEFAULT_SCHEDULE in sm90.SCHEDULES
    with pytest.raises(ValueError, match="schedule must be one of"):
        sm90.schedule_variant("fast")
    assert sm90.snapmla_decode_sm90_split_roles.__name__ == "snapmla_decode_sm90[split-roles]"
    assert set(sm90.SCHEDULES) == {"free", "split-roles", "narrow", "narrow-16"}


def test_narrow_takes_at_most_32_rows():
    q8, q_scale, q_pe, cache, block_table, seq_lens = _inputs()
    reps = sm90.NARROW_MAX_ROWS // q8.shape[2] + 1   # s_q x H just over the limit
    wide = (torch.cat([q8] * reps, 1), torch.cat([q_scale] * reps, 1), torch.cat([q_pe] * reps, 1))
    with pytest.raises(ValueError, match="at most 32 query rows"):
        sm90.snapmla_decode_sm90(*wide, cache, block_table, seq_lens, 0.1, schedule="narrow")
