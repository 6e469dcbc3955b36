"""``python -m vllm_snapmla.demo``: fp8_snapmla next to BF16 on a tiny DeepSeek-V3.

On a CUDA GPU with FP8 (sm_89+) it writes a tiny DeepSeek-V3 config, runs ``LLM.generate``
with ``kv_cache_dtype="auto"`` and ``"fp8_snapmla"`` (each in its own process, so each gets the
whole GPU), and prints both outputs, whether they match and the KV-cache capacity vLLM
reports.  Without such a GPU it prints the accuracy of the reference SnapMLA algorithm.

The helpers here (``write_tiny_deepseek_v3``, ``generate_in_subprocess``) are reused by the
end-to-end tests.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import torch

from vllm_snapmla import format as fmt

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


def subprocess_env(extra: dict | None = None) -> dict:
    """Environment for a vLLM process that must load this plugin from this source tree.

    vLLM finds plugins through entry points, in the API server, the engine core and every
    worker; when vllm-snapmla is not pip-installed, a ``.dist-info`` on ``PYTHONPATH``
    declares the entry point.
    """
    env = dict(os.environ)
    paths = [str(pathlib.Path(__file__).resolve().parent.parent)]
    if not _plugin_visible():
        paths.append(_entry_point_dir())
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
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
    ``max_tokens``, optional ``logprobs`` and ``llm_kwargs``.  Returns per round and prompt
    the generated ``token_ids``, the top ``logprobs`` per step (``{token: logprob}``) and
    ``num_cached_tokens``, plus the KV-cache capacity.
    """
    from vllm import LLM, SamplingParams

    kwargs = dict(load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
                  dtype="bfloat16", max_model_len=2048, gpu_memory_utilization=0.4, seed=0)
    kwargs.update(spec.get("llm_kwargs", {}))
    llm = LLM(model=spec["model"], kv_cache_dtype=spec["kv_cache_dtype"], **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                            logprobs=spec.get("logprobs"))
    rounds = []
    for prompts in spec["rounds"]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        rounds.append([{
            "token_ids": list(o.outputs[0].token_ids),
            "logprobs": [{str(t): lp.logprob for t, lp in step.items()}
                         for step in (o.outputs[0].logprobs or [])],
            "num_cached_tokens": o.num_cached_tokens or 0,
        } for o in outputs])
    cache = llm.llm_engine.vllm_config.cache_config
    return {"rounds": rounds, "num_gpu_blocks": cache.num_gpu_blocks,
            "block_size": cache.block_size,
            "kv_cache_tokens": cache.num_gpu_blocks * cache.block_size}


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
    result, log = run_json_child(["-m", "vllm_snapmla.demo", "--child"], spec, env, timeout)
    logged = _KV_TOKENS_LOG.findall(log)
    result["log_kv_cache_tokens"] = int(logged[-1].replace(",", "")) if logged else None
    result["log"] = log
    return result


def _child() -> None:
    spec = json.loads(sys.stdin.read())
    result = run_generation(spec)
    print(RESULT_TAG + json.dumps(result), flush=True)


# --- the demo ------------------------------------------------------------------------------

def _has_fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def gpu_demo(random_weights: bool = False) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 4096, (n,), generator=gen).tolist() for n in (7, 100, 300)]
    load_format = "auto" if random_weights else "dummy"
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_deepseek_v3(pathlib.Path(tmp) / "tiny-deepseek-v3",
                                           random_weights=random_weights))
        print(f"tiny DeepSeek-V3 in {model} (load_format={load_format})")
        results = {}
        for dtype in ("auto", fmt.KV_CACHE_DTYPE):
            print(f"running LLM.generate with kv_cache_dtype={dtype!r} ...", flush=True)
            results[dtype] = generate_in_subprocess(
                {"model": model, "kv_cache_dtype": dtype, "rounds": [prompts],
                 "max_tokens": 16, "llm_kwargs": {"load_format": load_format}})
    for dtype, res in results.items():
        print(f"\nkv_cache_dtype={dtype}: {res['num_gpu_blocks']} blocks x "
              f"{res['block_size']} tokens = {res['kv_cache_tokens']:,} tokens of KV cache "
              f"(vLLM log: {res['log_kv_cache_tokens']})")
        for i, out in enumerate(res["rounds"][0]):
            print(f"  prompt {i} ({len(prompts[i])} tokens) -> {out['token_ids']}")
    base, snap = (results[d]["rounds"][0] for d in ("auto", fmt.KV_CACHE_DTYPE))
    same = sum(a == b for x, y in zip(base, snap)
               for a, b in zip(x["token_ids"], y["token_ids"]))
    total = sum(len(x["token_ids"]) for x in base)
    print(f"\noutputs match: {all(x['token_ids'] == y['token_ids'] for x, y in zip(base, snap))}"
          f" ({same}/{total} tokens equal)")
    ratio = results[fmt.KV_CACHE_DTYPE]["kv_cache_tokens"] / results["auto"]["kv_cache_tokens"]
    print(f"KV-cache capacity fp8_snapmla / bf16: {ratio:.3f}x "
          f"(bytes per token and layer: {2 * fmt.HEAD_SIZE} -> {fmt.BYTES_PER_TOKEN}, ideal "
          f"{2 * fmt.HEAD_SIZE / fmt.BYTES_PER_TOKEN:.3f}x)")
    if not random_weights:
        print("(dummy weights barely let attention move the logits: matching outputs show "
              "that the path runs, not how accurate it is; try --random-weights)")
    else:
        print("(random weights put many tokens within hundredths of a nat of each other, so "
              "greedy outputs may part at a near-tie; tests/e2e quantifies the agreement)")


def _rel_l2(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double() - y.double()).norm() / y.double().norm())


def cpu_report() -> None:
    from vllm_snapmla import reference as ref

    gen = torch.Generator().manual_seed(0)
    print("No CUDA GPU with FP8 (sm_89+) here: the SnapMLA kernels and the vLLM run need one.\n"
          "Accuracy of the reference SnapMLA algorithm (vllm_snapmla.reference) instead:\n")

    kv_c = torch.randn(4096, fmt.KV_LORA_RANK, generator=gen).to(torch.bfloat16)
    k_pe = (3 * torch.randn(4096, fmt.ROPE_DIM, generator=gen)).to(torch.bfloat16)
    c, r = ref.dequantize_kv(ref.quantize_kv(kv_c, k_pe))
    print(f"format round trip (4096 tokens): content rel-L2 {_rel_l2(c, kv_c):.2e}, "
          f"RoPE rel-L2 {_rel_l2(r, k_pe):.2e}\n")

    print(f"{'batch':>5} {'heads':>5} {'seq_len':>8} | {'vs exact fp64':>14} "
          f"{'vs fp64 on dequant. cache':>26} {'lse max abs err':>16}")
    for B, H, n in ((1, 16, 64), (2, 16, 300), (4, 16, 1000), (1, 128, 2048)):
        seq_lens = torch.randint(max(1, n // 2), n + 1, (B,), generator=gen)
        seq_lens[0] = n
        pages = [(int(s) + fmt.PAGE_SIZE - 1) // fmt.PAGE_SIZE for s in seq_lens]
        cache = torch.zeros(sum(pages), fmt.PAGE_SIZE, fmt.BYTES_PER_TOKEN, dtype=torch.uint8)
        block_table = torch.zeros(B, max(pages), dtype=torch.int32)
        order = torch.randperm(sum(pages), generator=gen)
        kv, start = [], 0
        for b, s in enumerate(seq_lens.tolist()):
            block_table[b, :pages[b]] = order[start:start + pages[b]].int()
            start += pages[b]
            kv_c = torch.randn(s, fmt.KV_LORA_RANK, generator=gen).to(torch.bfloat16)
            k_pe = (3 * torch.randn(s, fmt.ROPE_DIM, generator=gen)).to(torch.bfloat16)
            slots = (block_table[b, :pages[b]].long()[:, None] * fmt.PAGE_SIZE
                     + torch.arange(fmt.PAGE_SIZE)).flatten()[:s]
            ref.append_kv(kv_c, k_pe, cache, slots)
            kv.append((kv_c.double(), k_pe.double()))
        q_nope = torch.randn(B, 1, H, fmt.KV_LORA_RANK, generator=gen).to(torch.bfloat16)
        q_pe = (3 * torch.randn(B, 1, H, fmt.ROPE_DIM, generator=gen)).to(torch.bfloat16)
        scale = 1.0 / math.sqrt(192)
        out, lse = ref.decode(q_nope, q_pe, cache, block_table, seq_lens.int(), scale)
        out_dq, _ = ref.decode(q_nope, q_pe, cache, block_table, seq_lens.int(), scale,
                               exact=True)
        truth, truth_lse = [], []
        for b, (kc, kp) in enumerate(kv):
            logits = (q_nope[b, 0].double() @ kc.T + q_pe[b, 0].double() @ kp.T) * scale
            truth.append(torch.softmax(logits, -1) @ kc)
            truth_lse.append(torch.logsumexp(logits, -1))
        truth = torch.stack(truth)[:, None]
        truth_lse = torch.stack(truth_lse)[:, :, None]
        print(f"{B:>5} {H:>5} {n:>8} | {_rel_l2(out, truth):>14.2e} "
              f"{_rel_l2(out, out_dq):>26.2e} {float((lse - truth_lse).abs().max()):>16.2e}")
    print("\n(rel-L2 of the attention output; 'exact fp64' attends over the original BF16 "
          "K/V, the second column isolates the FP8 query and probability quantization)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--random-weights", action="store_true",
                        help="write random weights of trained-model scale instead of "
                             "load_format=dummy (GPU run only)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child()
    elif _has_fp8_gpu():
        gpu_demo(args.random_weights)
    else:
        cpu_report()


if __name__ == "__main__":
    main()
