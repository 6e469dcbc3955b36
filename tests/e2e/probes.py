"""Functions the end-to-end tests send to vLLM's workers with ``LLM.collective_rpc``.

vLLM pickles a callable by reference, so the worker imports this module (the engine's
``PYTHONPATH`` holds the repository root, see ``vllm_snapmla.testing.subprocess_env``); sending
callables needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in the engine's environment.  Each
function takes the worker (vLLM's ``WorkerWrapperBase``, which forwards to the ``Worker``) and
returns plain lists and numbers.
"""

from __future__ import annotations


def dummy_batch(worker) -> dict:
    """``worker.execute_dummy_batch()`` (what an idle data-parallel rank runs for every step),
    reporting what it handed the SnapMLA backend.

    While it runs, ``SnapMLAMetadataBuilder.build`` records each batch it is given (the
    common metadata's shape, ``seq_lens``, ``query_start_loc``, the block table's first column,
    and how the builder split it into decodes and prefills), and the model runner's
    ``_dummy_run`` hands back its hidden states, of which the finiteness of every row is
    reported.  Both wrappers are removed afterwards.
    """
    import torch

    from vllm_snapmla.integration.backend import SnapMLAMetadataBuilder

    runner = worker.model_runner
    builds, outputs = [], []
    original_build = SnapMLAMetadataBuilder.build
    original_dummy_run = runner._dummy_run

    def build(self, *args, **kwargs):   # keywords: gpu_model_runner.py:2510, gpu/attn_utils.py:649
        metadata = original_build(self, *args, **kwargs)
        common = kwargs["common_attn_metadata"] if "common_attn_metadata" in kwargs else args[1]
        builds.append({
            "num_reqs": common.num_reqs, "num_actual_tokens": common.num_actual_tokens,
            "max_query_len": common.max_query_len, "seq_lens": common.seq_lens.tolist(),
            "query_start_loc": common.query_start_loc_cpu.tolist(),
            "block_table_first_column": common.block_table_tensor[:, 0].tolist(),
            "num_decodes": metadata.num_decodes, "num_prefills": metadata.num_prefills,
            "num_decode_tokens": metadata.num_decode_tokens,
        })
        return metadata

    def dummy_run(*args, **kwargs):
        result = original_dummy_run(*args, **kwargs)
        outputs.append(result)
        return result

    SnapMLAMetadataBuilder.build = build
    runner._dummy_run = dummy_run            # an instance attribute over the class's method
    try:
        worker.execute_dummy_batch()
        torch.cuda.synchronize()
    finally:
        SnapMLAMetadataBuilder.build = original_build
        del runner._dummy_run
    hidden = outputs[0][0] if outputs else None
    return {"runner": type(runner).__name__, "dummy_runs": len(outputs), "builds": builds,
            "hidden_rows_finite": (None if hidden is None
                                   else torch.isfinite(hidden).all(-1).tolist())}
