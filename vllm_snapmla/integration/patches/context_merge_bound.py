"""H15: the chunked-context merge covers every prefill that has cached context.

What it changes: after vLLM's MLA metadata builder, ``SnapMLAMetadataBuilder.build`` moves
``prefill.chunked_context.prefill_tokens_with_context`` to the end of the last prefill with
context (see ``fix_context_merge_bound``).  Not a patch of vLLM code: a correction of the
metadata vLLM builds, applied by our builder only.
Why: vLLM 0.26.0 assumes the prefills with context come first; the V2 model runner orders them
by query length, and a chunked prompt's cached context is then dropped (its first token comes
out wrong).
Checked by: tests/unit/integration/patches/test_context_merge_bound.py (metadata as both runners
order it) and the MRv2 e2e test (chunked prefill equals BF16).
Remove when: vLLM computes the bound from the prefills that have context (upstream fix).
"""

from __future__ import annotations

import torch


def fix_context_merge_bound(metadata, query_start_loc_cpu: torch.Tensor) -> None:
    """Make vLLM's prefix/suffix merge cover every prefill that has cached context.

    vLLM 0.26.0's MLA builder sets ``chunked_context.prefill_tokens_with_context`` to the
    query start of prefill number ``count(context > 0)``: it assumes the prefills that have
    context come first.  V1's batch reorder puts them first; the V2 model runner sorts
    requests by query length instead (``v1/worker/gpu/model_runner.py``
    ``sort_batch_req_ids``), and ``merge_attn_states`` then copies the new-token output
    for any prefill past that bound, dropping its cached context: the first token of a
    chunked prompt comes out wrong (DeepSeek-V2 models run on that runner by default).  The
    bound becomes the end of the last prefill with context.  Prefills without context
    before it are merged with an empty context, which ``mask_empty_context`` makes exact.
    ``query_start_loc_cpu`` is the whole batch's (decodes first).
    """
    prefill = getattr(metadata, "prefill", None)
    context = getattr(prefill, "chunked_context", None)
    if context is None:
        return
    with_context = torch.nonzero(context.seq_lens.sum(dim=0) > 0).flatten()
    if with_context.numel() == 0:
        return
    first_prefill = metadata.num_decodes
    last = first_prefill + int(with_context[-1])
    context.prefill_tokens_with_context = int(query_start_loc_cpu[last + 1]
                                              - query_start_loc_cpu[first_prefill])
