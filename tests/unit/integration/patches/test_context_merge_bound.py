"""H15: the chunked-context merge bound under the V2 model runner's batch order (no GPU).

vLLM's own ``build_mla_chunked_context_metadata`` builds the metadata; its pinned host buffers
are made ordinary ones so that it runs without a GPU.
"""

import itertools
import types

import pytest
import torch

from vllm_snapmla.integration.patches import context_merge_bound


@pytest.fixture
def chunked_context(monkeypatch):
    from vllm.model_executor.layers.attention import mla_attention

    for name in ("empty", "zeros"):
        original = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, pin_memory=False, _f=original, **k: _f(*a, **k))

    def build(context_lens, query_lens):
        starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
        return mla_attention.build_mla_chunked_context_metadata(
            context_lens_cpu=torch.tensor(context_lens, dtype=torch.int32),
            prefill_query_start_loc_cpu=starts, num_prefills=len(query_lens),
            chunked_prefill_workspace=torch.empty(8192, 576),
            chunked_prefill_workspace_size=8192, block_size=64, align_chunk_to_block=True,
            device=torch.device("cpu"), dcp_world_size=1, dcp_local_block_size=1,
            dcp_virtual_block_size=1)
    return build


def _bound(context, num_decodes, query_lens):
    """The bound after the fix, for a batch of ``num_decodes`` one-token decodes first."""
    metadata = types.SimpleNamespace(num_decodes=num_decodes,
                                     prefill=types.SimpleNamespace(chunked_context=context))
    query_start_loc = torch.tensor(
        [0, *itertools.accumulate([1] * num_decodes + list(query_lens))], dtype=torch.int32)
    context_merge_bound.fix_context_merge_bound(metadata, query_start_loc)
    return context.prefill_tokens_with_context


def test_v2_runner_order_keeps_the_context(chunked_context):
    # The H200 batch that lost a prompt's context: 2 decodes, then prefills sorted by query
    # length (V2 model runner); only the third prefill (14 tokens) has cached context (27).
    query_lens, context_lens = [3, 9, 14, 48, 52], [0, 0, 27, 0, 0]
    context = chunked_context(context_lens, query_lens)
    # vLLM's bound stops after the first prefill, so the third one's tokens (12..25) are not
    # merged with their context.  (If this fails, vLLM fixed it and H15 can go.)
    assert context.prefill_tokens_with_context == 3
    assert _bound(context, 2, query_lens) == 3 + 9 + 14


def test_v1_order_is_unchanged(chunked_context):
    # V1 puts the prefills with context first: the bound is vLLM's.
    query_lens, context_lens = [14, 3, 9, 48, 52], [27, 0, 0, 0, 0]
    context = chunked_context(context_lens, query_lens)
    assert context.prefill_tokens_with_context == 14
    assert _bound(context, 2, query_lens) == 14


def test_bound_ends_at_the_last_prefill_with_context(chunked_context):
    query_lens, context_lens = [5, 7, 2, 30, 11], [0, 64, 0, 200, 0]
    context = chunked_context(context_lens, query_lens)
    assert _bound(context, 0, query_lens) == 5 + 7 + 2 + 30


def test_batches_without_chunked_context_are_left_alone():
    metadata = types.SimpleNamespace(num_decodes=3, prefill=None)
    context_merge_bound.fix_context_merge_bound(metadata, torch.arange(4, dtype=torch.int32))
    metadata = types.SimpleNamespace(num_decodes=1,
                                     prefill=types.SimpleNamespace(chunked_context=None))
    context_merge_bound.fix_context_merge_bound(metadata, torch.arange(3, dtype=torch.int32))


def test_a_context_whose_chunks_hold_no_tokens_keeps_vllms_bound(chunked_context):
    # vLLM builds no chunked context for a batch without cached tokens; one whose chunk lengths
    # are all zero must leave the bound as vLLM set it.
    query_lens = [3, 9, 14]
    context = chunked_context([0, 64, 0], query_lens)
    context.seq_lens.zero_()
    before = context.prefill_tokens_with_context
    assert _bound(context, 2, query_lens) == before
