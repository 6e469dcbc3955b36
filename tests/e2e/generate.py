"""``LLM.generate`` in a child process for the CUDA-graph and speculative-decoding e2e tests.

Like ``vllm_snapmla.testing.generate_in_subprocess``, plus what those tests need: the engine's
speculative-decoding counters (``LLM.get_metrics()``), ``echo`` rounds whose prompts are built
from the engine's own earlier outputs, and the batches vLLM ran with their CUDA-graph mode
(parsed from the model runner's DEBUG line "Running batch with cudagraph_mode: ...").

Run as ``python -m tests.e2e.generate`` with a JSON spec on stdin.
"""

from __future__ import annotations

import json
import re
import sys

from tests.e2e.server import KV_CACHE_BYTES
from vllm_snapmla.testing import RESULT_TAG, run_json_child

# gpu_model_runner.py logs this at DEBUG for every batch it runs (vLLM 0.26.0, V1 runner).
_BATCH_LOG = re.compile(
    r"Running batch with cudagraph_mode: (\w+), batch_descriptor: "
    r"BatchDescriptor\(num_tokens=(\d+), num_reqs=(\w+), uniform=(\w+)")
SPEC_METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens")


def _run(spec: dict) -> dict:
    """``spec``: ``model``, ``kv_cache_dtype``, ``prompts``, ``max_tokens``, ``logprobs``,
    ``llm_kwargs``, ``echo`` (extra rounds: prompt ``p + out(p) + p``, with ``out(p)`` the
    previous round's output for ``p``, or ``echo_outputs[k]`` for echo round k + 1 when given:
    another engine's outputs, so that every engine compared runs the same prompts) and ``solo``
    (a last round of the previous round's first prompt alone: every batch then holds one
    request)."""
    from vllm import LLM, SamplingParams

    kwargs = dict(load_format="auto", skip_tokenizer_init=True, dtype="bfloat16",
                  max_model_len=1024, gpu_memory_utilization=0.3, seed=0,
                  kv_cache_memory_bytes=KV_CACHE_BYTES,
                  disable_log_stats=False)
    kwargs.update(spec.get("llm_kwargs", {}))
    llm = LLM(model=spec["model"], kv_cache_dtype=spec["kv_cache_dtype"], **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                            logprobs=spec.get("logprobs"))
    rounds, prompts = [], spec["prompts"]
    for k in range(1 + spec.get("echo", 0)):
        if k:
            given = spec.get("echo_outputs")
            outs = given[k - 1] if given else [o["token_ids"] for o in rounds[-1]]
            prompts = [p + o + p for p, o in zip(spec["prompts"], outs)]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        rounds.append(_outputs(prompts, outputs))
    if spec.get("solo"):
        prompts = [rounds[-1][0]["prompt"]]
        rounds.append(_outputs(prompts, llm.generate([{"prompt_token_ids": prompts[0]}], params,
                                                     use_tqdm=False)))
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
               if m.name in SPEC_METRICS}
    return {"rounds": rounds, "metrics": metrics,
            "cudagraph_mode": llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name}


def _outputs(prompts, outputs) -> list[dict]:
    return [{
        "prompt": p,
        "token_ids": list(o.outputs[0].token_ids),
        "logprobs": [{str(t): lp.logprob for t, lp in step.items()}
                     for step in (o.outputs[0].logprobs or [])],
    } for p, o in zip(prompts, outputs)]


def generate(spec: dict, env: dict | None = None, timeout: float = 600) -> dict:
    """``_run(spec)`` in a fresh process; adds ``log`` and ``batches`` (mode, tokens, reqs,
    uniform)."""
    result, log = run_json_child(["-m", "tests.e2e.generate"], spec, env, timeout)
    result["log"] = log
    result["batches"] = [(mode, int(n), None if reqs == "None" else int(reqs), uniform == "True")
                         for mode, n, reqs, uniform in _BATCH_LOG.findall(log)]
    return result


if __name__ == "__main__":
    print(RESULT_TAG + json.dumps(_run(json.loads(sys.stdin.read()))), flush=True)
