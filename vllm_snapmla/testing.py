"""Helpers shared by the tests, the benchmarks and the evaluation scripts.

- ``write_tiny_deepseek_v3``: a tiny DeepSeek-V3 checkpoint (config, optionally random weights
  of trained-model scale) that vLLM starts in seconds;
- ``generate_in_subprocess`` / ``run_json_child``: ``LLM.generate`` in a fresh process that
  loads this plugin from this source tree (``subprocess_env``), optionally with worker RPCs
  (``LLM.collective_rpc``) between the rounds;
- ``compare_greedy``: greedy outputs of two engines equal up to near-ties (how the end-to-end
  tests compare KV formats, compilation modes and parallel layouts);
- ``tp_shard_problems``: the dimensions of a tiny config that do not split over TP/EP ranks;
- ``build_cache``: a random paged ``fp8_snapmla`` cache with shuffled block tables and garbage
  (NaN scales) in every byte no request owns;
- ``has_fp8_gpu``: whether this machine has a GPU the kernels run on (the GPU demo and tests).

``python -m vllm_snapmla.testing`` is the child process of ``generate_in_subprocess``.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import torch

from vllm_snapmla import format as fmt
from vllm_snapmla import reference as ref

# Small enough to start in seconds, shaped like DeepSeek-V3 where it matters: MLA with the
# 512/64 latent/RoPE split, (128, 64, 128) head dims (what vLLM's SM90 MLA prefill accepts),
# one dense layer followed by one MoE layer.  No `head_dim`: transformers ties it to
# qk_rope_head_dim.  No `index_topk`: that would make it DeepSeek-V3.2 sparse attention.
TINY_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "torch_dtype": "bfloat16", "vocab_size": 4096, "hidden_size": 1024,
    "intermediate_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 16,
    "num_key_value_heads": 16, "q_lora_rank": 256, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "moe_intermediate_size": 256, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 10000.0,
    "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1,
}

RESULT_TAG = "SNAPMLA_RESULT "
_KV_TOKENS_LOG = re.compile(r"GPU KV cache size: ([\d,]+) tokens")


def has_fp8_gpu() -> bool:
    """A CUDA GPU with native e4m3 (sm_89 and newer), the plugin's minimum."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def write_tiny_deepseek_v3(path, *, random_weights: bool = False, seed: int = 0,
                           **overrides) -> pathlib.Path:
    """Write ``config.json`` of the tiny DeepSeek-V3 (``overrides`` replace or add keys).

    With ``random_weights`` also write ``model.safetensors`` holding random weights of
    trained-model scale (N(0, 0.02) matrices, unit norms).  vLLM's ``load_format="dummy"``
    weights are U(-1e-3, 1e-3) everywhere, norms included, which shrinks every attention
    output to ~1e-4 of the residual stream: attention, and so the KV cache, then barely
    moves the logits.  Use real weights to compare KV-cache formats.
    """
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**TINY_DEEPSEEK_V3, **overrides}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    if random_weights:
        from safetensors.torch import save_file

        save_file(_random_deepseek_v3_weights(config, seed), str(path / "model.safetensors"),
                  metadata={"format": "pt"})
    return path


def short_and_long_prompts(seed: int, *, num_short: int = 11, long_len: int = 300,
                           vocab: int = 4096) -> tuple[list[list[int]], list[int]]:
    """``num_short`` random prompts of 3-59 token ids and one of ``long_len`` (below ``vocab``,
    no special ids 0 and 1), seeded: the end-to-end tests' mix of short requests and one long
    enough for chunked prefill to read its earlier chunks back from the cache."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 60, (num_short,), generator=gen).tolist()
    short = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]
    long = torch.randint(2, vocab, (long_len,), generator=gen).tolist()
    return short, long


def _random_deepseek_v3_weights(c: dict, seed: int) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 checkpoint tensors (HF names, per-expert MoE layout) for config ``c``."""
    gen = torch.Generator().manual_seed(seed)

    def matrix(rows, cols):
        return (torch.randn(rows, cols, generator=gen) * 0.02).to(torch.bfloat16)

    def norm(n):
        return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(torch.bfloat16)

    H, N = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    rank = c["kv_lora_rank"]
    w = {"model.embed_tokens.weight": matrix(c["vocab_size"], H),
         "model.norm.weight": norm(H),
         "lm_head.weight": matrix(c["vocab_size"], H)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        a = p + "self_attn."
        if c.get("q_lora_rank"):
            w[a + "q_a_proj.weight"] = matrix(c["q_lora_rank"], H)
            w[a + "q_a_layernorm.weight"] = norm(c["q_lora_rank"])
            w[a + "q_b_proj.weight"] = matrix(N * (nope + rope), c["q_lora_rank"])
        else:
            w[a + "q_proj.weight"] = matrix(N * (nope + rope), H)
        w[a + "kv_a_proj_with_mqa.weight"] = matrix(rank + rope, H)
        w[a + "kv_a_layernorm.weight"] = norm(rank)
        w[a + "kv_b_proj.weight"] = matrix(N * (nope + v), rank)
        w[a + "o_proj.weight"] = matrix(H, N * v)
        is_moe = (c.get("n_routed_experts") and i >= c["first_k_dense_replace"]
                  and i % c["moe_layer_freq"] == 0)
        if not is_moe:
            mlp = {p + "mlp.": c["intermediate_size"]}
        else:
            E, inter = c["n_routed_experts"], c["moe_intermediate_size"]
            w[p + "mlp.gate.weight"] = matrix(E, H)
            if c.get("topk_method") == "noaux_tc":
                w[p + "mlp.gate.e_score_correction_bias"] = 0.01 * torch.randn(E, generator=gen)
            mlp = {f"{p}mlp.experts.{e}.": inter for e in range(E)}
            if c.get("n_shared_experts"):
                mlp[p + "mlp.shared_experts."] = inter * c["n_shared_experts"]
        for prefix, inter in mlp.items():
            w[prefix + "gate_proj.weight"] = matrix(inter, H)
            w[prefix + "up_proj.weight"] = matrix(inter, H)
            w[prefix + "down_proj.weight"] = matrix(H, inter)
    return w


# --- running vLLM in a child process -------------------------------------------------------

def _plugin_visible() -> bool:
    from importlib.metadata import entry_points

    return any(ep.value.startswith("vllm_snapmla") for ep in
               entry_points(group="vllm.general_plugins"))


@functools.cache
def _entry_point_dir() -> str:
    """A directory whose ``.dist-info`` declares the plugin's entry point (as pyproject does)."""
    meta = pathlib.Path(tempfile.mkdtemp(prefix="snapmla-entry-point-"))
    info = meta / "vllm_snapmla_source-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-snapmla-source\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nsnapmla = vllm_snapmla:register\n")
    return str(meta)


def with_pythonpath(env, *paths: str) -> dict:
    """A copy of ``env`` with ``paths`` first on ``PYTHONPATH``; what was there stays after them."""
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join([*paths, *[p for p in [env.get("PYTHONPATH")] if p]])
    return env


def subprocess_env(extra: dict | None = None) -> dict:
    """Environment for a vLLM process that must load this plugin from this source tree.

    vLLM finds plugins through entry points, in the API server, the engine core and every
    worker; when vllm-snapmla is not pip-installed, a ``.dist-info`` on ``PYTHONPATH``
    declares the entry point.
    """
    paths = [str(pathlib.Path(__file__).resolve().parent.parent)]
    if not _plugin_visible():
        paths.append(_entry_point_dir())
    env = with_pythonpath(os.environ, *paths)
    env.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"   # vLLM imports it for sampling by default
    env.update(extra or {})
    return env


def run_generation(spec: dict) -> dict:
    """Build one ``LLM`` and run ``spec["rounds"]`` (lists of prompts) through it, in order.

    ``spec``: ``model``, ``kv_cache_dtype``, ``rounds`` (list of lists of token-id prompts),
    ``max_tokens``, optional ``logprobs``, ``llm_kwargs`` and ``rpcs``.  ``rpcs[k]`` (a list of
    names; ``rpcs`` may hold one entry more than ``rounds``, for after the last) runs before
    round ``k`` through ``LLM.collective_rpc``: a worker method name (``"execute_dummy_batch"``)
    or ``"module:function"``, imported here and sent as a callable taking the worker (needs
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).  Returns per round and prompt the generated
    ``token_ids``, the top ``logprobs`` per step (``{token: logprob}``) and
    ``num_cached_tokens``; the KV-cache capacity; the parallel sizes, the resolved CUDA-graph
    mode; and ``rpc_results[k]``, what each RPC returned (a list with one entry per worker).
    """
    import importlib

    from vllm import LLM, SamplingParams

    kwargs = dict(load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
                  dtype="bfloat16", max_model_len=2048, gpu_memory_utilization=0.4, seed=0)
    kwargs.update(spec.get("llm_kwargs", {}))
    llm = LLM(model=spec["model"], kv_cache_dtype=spec["kv_cache_dtype"], **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                            logprobs=spec.get("logprobs"))

    def rpc(name: str):
        if ":" in name:
            module, function = name.split(":")
            return llm.collective_rpc(getattr(importlib.import_module(module), function))
        return llm.collective_rpc(name)

    rpcs = spec.get("rpcs", [])
    rounds, rpc_results = [], []
    for k in range(max(len(spec["rounds"]), len(rpcs))):
        rpc_results.append([rpc(name) for name in (rpcs[k] if k < len(rpcs) else [])])
        if k >= len(spec["rounds"]):
            continue
        outputs = llm.generate([{"prompt_token_ids": p} for p in spec["rounds"][k]], params,
                               use_tqdm=False)
        rounds.append([{
            "prompt": list(p),
            "token_ids": list(o.outputs[0].token_ids),
            "logprobs": [{str(t): lp.logprob for t, lp in step.items()}
                         for step in (o.outputs[0].logprobs or [])],
            "num_cached_tokens": o.num_cached_tokens or 0,
        } for p, o in zip(spec["rounds"][k], outputs)])
    config = llm.llm_engine.vllm_config
    cache = config.cache_config
    return {"rounds": rounds, "rpc_results": rpc_results,
            "num_gpu_blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
            "kv_cache_tokens": cache.num_gpu_blocks * cache.block_size,
            "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
            "cudagraph_mode": config.compilation_config.cudagraph_mode.name}


def run_json_child(args: list[str], spec: dict, env: dict | None, timeout: float
                   ) -> tuple[dict, str]:
    """``python <args>`` with ``spec`` as JSON on stdin, in this plugin's environment: the JSON
    after its last ``RESULT_TAG`` line, and everything it printed."""
    proc = subprocess.run([sys.executable, *args], input=json.dumps(spec), capture_output=True,
                          text=True, timeout=timeout, env=subprocess_env(env))
    log = proc.stdout + proc.stderr
    result_lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not result_lines:
        raise RuntimeError(f"vLLM run failed (exit {proc.returncode}) for "
                           f"{spec['kv_cache_dtype']}; last output:\n{log[-6000:]}")
    return json.loads(result_lines[-1][len(RESULT_TAG):]), log


def generate_in_subprocess(spec: dict, env: dict | None = None, timeout: float = 900) -> dict:
    """``run_generation`` in a fresh Python process (it owns the GPU until it exits).

    Adds ``log`` (everything the processes printed) and ``log_kv_cache_tokens`` (the
    capacity vLLM logs) to the result.
    """
    result, log = run_json_child(["-m", "vllm_snapmla.testing"], spec, env, timeout)
    logged = _KV_TOKENS_LOG.findall(log)
    result["log_kv_cache_tokens"] = int(logged[-1].replace(",", "")) if logged else None
    result["log"] = log
    return result


def _child() -> None:
    spec = json.loads(sys.stdin.read())
    result = run_generation(spec)
    print(RESULT_TAG + json.dumps(result), flush=True)


# --- comparing greedy outputs ---------------------------------------------------------------

# Random-weight models put many tokens within hundredths of a nat of each other, so the greedy
# outputs of two correct engines (KV formats, compilation modes, parallel layouts, batch shapes)
# part ways at such near-ties and never meet again.  Where they part, the other engine's token
# must be a near-tie in the base engine's log-probabilities.  (A CPU simulation of FP8 latents
# flipped tokens at BF16 gaps up to 0.6 nats; a cache read from the wrong positions gave gaps
# around 1.5.)
NEAR_TIE_NATS = 1.0


def compare_greedy(base: list[list[dict]], test: list[list[dict]], what: str = "test",
                   near_tie_nats: float = NEAR_TIE_NATS) -> dict:
    """Greedy agreement of ``test`` with ``base``: rounds of per-prompt outputs, each a dict with
    ``token_ids`` and ``logprobs`` (per step ``{str(token): logprob}``, the top-k of that engine,
    which always holds the chosen token) and optionally ``prompt``.

    Per prompt, the steps up to the first divergence are compared: while the tokens agree, the
    chosen token's |d logprob| is collected; at the divergence (the last step both engines
    computed from the same context) so are the two chosen tokens' where both top-k hold them,
    and ``test``'s token must be in ``base``'s top-k and at most ``near_tie_nats`` below
    ``base``'s choice, otherwise it is a problem.  Pairs whose ``prompt`` differs (an echo of
    outputs that parted earlier) are skipped.  Returns ``match`` (the fraction of generated
    tokens equal position by position), ``compared`` (steps compared, the divergence included),
    ``shared steps`` (those before it), the mean and max ``|d logprob|`` over every value
    collected, ``skipped`` and ``problems`` (strings naming round, prompt and step).
    """
    equal = total = compared = skipped = shared_steps = 0
    shared_diffs, problems = [], []
    if len(base) != len(test):
        problems.append(f"{len(base)} rounds in the base run, {len(test)} in {what}")
    for r, (base_round, test_round) in enumerate(zip(base, test)):
        if len(base_round) != len(test_round):
            problems.append(f"round {r}: {len(base_round)} outputs in the base run, "
                            f"{len(test_round)} in {what}")
        for k, (b, t) in enumerate(zip(base_round, test_round)):
            if "prompt" in b and "prompt" in t and b["prompt"] != t["prompt"]:
                skipped += 1
                continue
            total += len(b["token_ids"])
            equal += sum(x == y for x, y in zip(b["token_ids"], t["token_ids"]))
            if len(b["token_ids"]) != len(t["token_ids"]):
                problems.append(f"round {r} prompt {k}: {len(b['token_ids'])} tokens in the "
                                f"base run, {len(t['token_ids'])} in {what}")
            for step, (x, y) in enumerate(zip(b["token_ids"], t["token_ids"])):
                compared += 1
                base_lp, test_lp = b["logprobs"][step], t["logprobs"][step]
                if x == y:
                    shared_steps += 1
                    shared_diffs.append(abs(base_lp[str(x)] - test_lp[str(x)]))
                    continue
                shared_diffs += [abs(base_lp[str(z)] - test_lp[str(z)]) for z in (x, y)
                                 if str(z) in base_lp and str(z) in test_lp]
                where = f"round {r} prompt {k} step {step}: {what} chose {y}"
                if str(y) not in base_lp:
                    problems.append(f"{where}, not in the base run's top {len(base_lp)} "
                                    f"{base_lp}")
                elif base_lp[str(x)] - base_lp[str(y)] > near_tie_nats:
                    problems.append(f"{where}, {base_lp[str(x)] - base_lp[str(y)]:.3f} nats "
                                    f"below the base run's {x}")
                break
    diffs = torch.tensor(shared_diffs or [0.0], dtype=torch.float64)
    return {"match": equal / max(total, 1), "compared": compared,
            "shared steps": shared_steps, "mean |d logprob|": float(diffs.mean()),
            "max |d logprob|": float(diffs.max()), "skipped": skipped, "problems": problems}


def describe_comparison(stats: dict, what: str) -> str:
    """One line for a test's output: the numbers of ``compare_greedy``."""
    return (f"{what}: {stats['match']:.1%} of generated tokens equal, {stats['shared steps']} "
            f"steps on the same context, mean |d logprob| {stats['mean |d logprob|']:.4f}, max "
            f"{stats['max |d logprob|']:.4f}, {len(stats['problems'])} problems")


def tp_shard_problems(config: dict, tp: int, ep: int = 1) -> list[str]:
    """What in a DeepSeek-V3 config (``TINY_DEEPSEEK_V3`` plus overrides) does not split over
    ``tp`` tensor-parallel ranks and ``ep`` expert-parallel ranks: vLLM shards the attention
    heads, the dense and shared-expert MLPs and each routed expert's MLP over TP (the latent
    projections are replicated), the vocabulary over TP, and places whole routed experts on
    the EP ranks."""
    c = {**TINY_DEEPSEEK_V3, **config}
    sharded = {"num_attention_heads": c["num_attention_heads"],
               "intermediate_size": c["intermediate_size"],
               "moe_intermediate_size": c["moe_intermediate_size"],
               "shared experts' intermediate size":
                   c["moe_intermediate_size"] * c.get("n_shared_experts", 0),
               "vocab_size": c["vocab_size"]}
    problems = [f"{name} = {value} does not split over {tp} TP ranks"
                for name, value in sharded.items() if value % tp]
    if ep > 1 and c["n_routed_experts"] % ep:
        problems.append(f"n_routed_experts = {c['n_routed_experts']} does not split over "
                        f"{ep} EP ranks")
    return problems


# --- random paged caches -------------------------------------------------------------------

NAN_F32 = torch.tensor([float("nan")], dtype=torch.float32).view(torch.uint8)


def build_cache(seq_lens, kv=None, gen=None, device="cpu", extra_blocks=3, content_std=1.0,
                rope_std=3.0, kv_dtype=torch.bfloat16):
    """Return ``(cache uint8[nb,64,656], block_table int32[B,max_blocks], kv)``.

    ``kv[b] = (kv_c[n,512], k_pe[n,64])`` are the values written for request ``b`` (random unless
    given).  Every byte not written by ``append_kv`` is random, and every unused row's scale is NaN,
    so a kernel that reads past a request's length produces NaN.  Unused block-table entries point
    at real (other requests') blocks for the same reason.
    """
    gen = gen or torch.Generator().manual_seed(0)
    pages = [(n + fmt.PAGE_SIZE - 1) // fmt.PAGE_SIZE for n in seq_lens]
    nb = sum(pages) + extra_blocks
    cache = torch.randint(0, 256, (nb, fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN), dtype=torch.uint8,
                          generator=gen)
    cache[..., fmt.SCALE_OFFSET:fmt.PAD_OFFSET] = NAN_F32
    perm = torch.randperm(nb, generator=gen)
    width = max(max(pages, default=1), 1)
    block_table = torch.randint(0, nb, (len(seq_lens), width), dtype=torch.int32, generator=gen)
    kv_out, start = [], 0
    for b, n in enumerate(seq_lens):
        block_table[b, :pages[b]] = perm[start:start + pages[b]].int()
        start += pages[b]
        if kv is None:
            kv_c = (torch.randn(n, fmt.KV_LORA_RANK, generator=gen) * content_std).to(kv_dtype)
            k_pe = (torch.randn(n, fmt.ROPE_DIM, generator=gen) * rope_std).to(kv_dtype)
        else:
            kv_c, k_pe = kv[b]
        slots = (block_table[b, :pages[b]].long()[:, None] * fmt.PAGE_SIZE
                 + torch.arange(fmt.PAGE_SIZE)).flatten()[:n]
        ref.append_kv(kv_c, k_pe, cache, slots)
        kv_out.append((kv_c, k_pe))
    cache = cache.to(device)
    return cache, block_table.to(device), kv_out


if __name__ == "__main__":
    _child()
