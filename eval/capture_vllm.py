"""Capture per-layer decode queries and BF16 KV from a vLLM run, for ``eval.fidelity`` (GPU).

Runs the checkpoint in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``enforce_eager``, one
GPU) with ``--kv-cache-dtype fp8_snapmla`` and wraps two methods of
``vllm_snapmla.integration.backend.SnapMLAImpl`` from here (the backend itself is untouched):

* ``do_kv_cache_update``: the BF16 ``kv_c_normed`` / ``k_pe`` rows *before* quantization and their
  slots (every prefill and decode write);
* ``forward_mqa``: the BF16 absorbed decode query ``(q_nope [B,H,512], q_pe [B,H,64])``, the
  block table and sequence lengths, for the first ``--decode-steps`` decode steps.

Each decode query's BF16 context is rebuilt from the captured writes by slot (positions
``0..seq_len-1`` through the block table), so the fidelity study sees exactly the values the model
produced.  Prefix caching is off and requests outlive the capture, so no slot is rewritten while
it is in use.  The context of a request is stored once; cases of earlier steps are prefix views
of it (``torch.save`` keeps the sharing).

    python -m eval.capture_vllm --model deepseek-ai/DeepSeek-V2-Lite-Chat --out runs/capture.pt
    python -m eval.capture_vllm --tiny --out runs/capture_tiny.pt        # smoke test
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from vllm_snapmla import format as fmt


class Recorder:
    """Captured tensors per attention impl (one impl per layer), on the CPU."""

    def __init__(self, decode_steps: int):
        self.decode_steps = decode_steps
        self.order: list[int] = []                      # impl ids in first-write (= layer) order
        self.names: dict[int, str] = {}
        self.scale: float | None = None
        self.writes: dict[int, list] = defaultdict(list)     # (kv_c, k_pe, slots)
        self.decodes: dict[int, list] = defaultdict(list)    # per step, see on_decode

    def done(self) -> bool:
        return bool(self.order) and all(len(self.decodes[i]) >= self.decode_steps
                                        for i in self.order)

    def on_write(self, impl, kv_c, k_pe, slot_mapping) -> None:
        key = id(impl)
        if key not in self.writes:
            self.order.append(key)
        if len(self.decodes[key]) >= self.decode_steps:
            return
        n = slot_mapping.numel()
        self.writes[key].append((kv_c[:n].detach().to("cpu", torch.bfloat16),
                                 k_pe[:n].reshape(n, fmt.ROPE_DIM).detach().to("cpu",
                                                                               torch.bfloat16),
                                 slot_mapping.detach().flatten().to("cpu", torch.int64)))

    def on_decode(self, impl, layer, q_nope, q_pe, decode) -> None:
        key = id(impl)
        self.names[key] = getattr(layer, "layer_name", f"layer.{len(self.names)}")
        self.scale = float(impl.scale)
        if len(self.decodes[key]) >= self.decode_steps:
            return
        b = decode.seq_lens.numel()
        self.decodes[key].append({
            "q_nope": q_nope[:b].detach().to("cpu", torch.bfloat16),
            "q_pe": q_pe[:b].detach().to("cpu", torch.bfloat16),
            "block_table": decode.block_table[:b].detach().to("cpu", torch.int64),
            "seq_lens": decode.seq_lens.detach().to("cpu", torch.int64),
            "num_writes": len(self.writes[key]),
        })


def install(recorder: Recorder) -> None:
    from vllm_snapmla.integration.backend import SnapMLAImpl

    write, forward = SnapMLAImpl.do_kv_cache_update, SnapMLAImpl.forward_mqa

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, *args, **kw):
        if kv_cache.numel() and slot_mapping is not None:
            recorder.on_write(self, kv_c_normed, k_pe, slot_mapping)
        return write(self, kv_c_normed, k_pe, kv_cache, slot_mapping, *args, **kw)

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        q_nope, q_pe = q if isinstance(q, tuple) else q.split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        recorder.on_decode(self, layer, q_nope, q_pe, attn_metadata.decode)
        return forward(self, q, kv_c_and_k_pe_cache, attn_metadata, layer)

    SnapMLAImpl.do_kv_cache_update = do_kv_cache_update
    SnapMLAImpl.forward_mqa = forward_mqa


def _slot_table(writes: list, count: int):
    """``(slots sorted, kv_c, k_pe)`` of the first ``count`` writes, latest write per slot."""
    kv_c = torch.cat([w[0] for w in writes[:count]])
    k_pe = torch.cat([w[1] for w in writes[:count]])
    slots = torch.cat([w[2] for w in writes[:count]])
    keep = slots >= 0
    kv_c, k_pe, slots = kv_c[keep], k_pe[keep], slots[keep]
    order = torch.arange(slots.numel())
    key = slots * (slots.numel() + 1) + order          # sort by slot, then by write order
    idx = torch.argsort(key)
    sorted_slots = slots[idx]
    _, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    last = idx[torch.cumsum(counts, 0) - 1]
    return slots[last], kv_c[last], k_pe[last]


def context_of(table, block_table_row: torch.Tensor, seq_len: int):
    """BF16 ``(kv_c [seq_len,512], k_pe [seq_len,64])`` of one request from the slot table."""
    slots, kv_c, k_pe = table
    pos = torch.arange(seq_len)
    wanted = block_table_row[pos // fmt.PAGE_SIZE] * fmt.PAGE_SIZE + pos % fmt.PAGE_SIZE
    where = torch.searchsorted(slots, wanted).clamp_max(slots.numel() - 1)
    if (slots[where] != wanted).any():
        raise RuntimeError("a decode context slot was never written during the capture")
    return kv_c[where], k_pe[where]


def build_cases(recorder: Recorder) -> dict:
    """The fidelity input: per layer, one case per (decode step, request)."""
    layers = []
    for index, key in enumerate(recorder.order):
        steps = recorder.decodes.get(key, [])
        contexts: dict[int, tuple] = {}      # request row of the last step -> full context
        cases = []
        if steps:
            last = steps[-1]
            table = _slot_table(recorder.writes[key], last["num_writes"])
            for b in range(last["seq_lens"].numel()):
                contexts[b] = context_of(table, last["block_table"][b], int(last["seq_lens"][b]))
        for step in steps:
            for b in range(step["seq_lens"].numel()):
                n = int(step["seq_lens"][b])
                full = contexts.get(b)
                if full is None or full[0].shape[0] < n:
                    table = _slot_table(recorder.writes[key], step["num_writes"])
                    full = context_of(table, step["block_table"][b], n)
                cases.append({"q_nope": step["q_nope"][b:b + 1], "q_pe": step["q_pe"][b:b + 1],
                              "kv_c": full[0][:n], "k_pe": full[1][:n]})
        layers.append({"name": recorder.names.get(key, f"layer.{index}"), "cases": cases})
    return {"softmax_scale": recorder.scale, "layers": layers}


def _literal(value: str):
    """``"0.9" -> 0.9``, ``"true" -> True``, other text unchanged (for ``--llm-arg``)."""
    import ast
    try:
        return ast.literal_eval({"true": "True", "false": "False"}.get(value, value))
    except (ValueError, SyntaxError):
        return value


def _prompts(args, tokenizer_vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    if args.prompt_file:
        return [args.prompt_file_tokens] * args.num_prompts
    # Random token ids: the context then has no meaning, but the KV statistics (content range,
    # RoPE outlier channels) come from the model's weights and positions, which is what counts.
    return [torch.randint(10, tokenizer_vocab - 10, (args.prompt_len,), generator=g).tolist()
            for _ in range(args.num_prompts)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.capture_vllm",
                                description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint path or name (MLA, kv_lora_rank 512, rope 64)")
    src.add_argument("--tiny", action="store_true",
                     help="random-weight tiny DeepSeek-V3 from vllm_snapmla.testing (smoke test)")
    p.add_argument("--out", default="runs/capture.pt")
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=4096, help="context length per request")
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--prompt-file", default=None,
                   help="text file used (tokenized, truncated to --prompt-len) as every "
                        "prompt: the requests then repeat one another's cases")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--llm-arg", action="append", default=[],
                   help="extra LLM(...) keyword as key=value (repeatable)")
    args = p.parse_args(argv)

    # The engine must run in this process for the patches below to reach the model.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm_snapmla
    vllm_snapmla.register()      # in case the plugin is not pip-installed (idempotent)
    from vllm import LLM, SamplingParams

    recorder = Recorder(args.decode_steps)
    install(recorder)
    kwargs = dict(kv_cache_dtype=fmt.KV_CACHE_DTYPE, enforce_eager=True, dtype="bfloat16",
                  enable_prefix_caching=False, tensor_parallel_size=1, seed=0,
                  max_model_len=args.prompt_len + args.decode_steps + 64,
                  gpu_memory_utilization=args.gpu_memory_utilization, trust_remote_code=True)
    if args.tiny:
        from vllm_snapmla.testing import TINY_DEEPSEEK_V3, write_tiny_deepseek_v3
        model = str(write_tiny_deepseek_v3(tempfile.mkdtemp(prefix="snapmla-tiny-"),
                                           random_weights=True))
        kwargs.update(skip_tokenizer_init=True, max_model_len=min(
            kwargs["max_model_len"], TINY_DEEPSEEK_V3["max_position_embeddings"]))
        vocab = TINY_DEEPSEEK_V3["vocab_size"]
        args.prompt_len = min(args.prompt_len, kwargs["max_model_len"] - args.decode_steps - 8)
    else:
        model = args.model
        from transformers import AutoConfig
        vocab = AutoConfig.from_pretrained(model, trust_remote_code=True).vocab_size
    for item in args.llm_arg:
        key, _, value = item.partition("=")
        kwargs[key] = _literal(value)
    if args.prompt_file:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
        args.prompt_file_tokens = tok.encode(Path(args.prompt_file).read_text())[:args.prompt_len]

    llm = LLM(model=model, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps + 1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": t} for t in _prompts(args, vocab)], params,
                 use_tqdm=False)
    if not recorder.done():
        print("[capture] fewer decode steps than requested were seen", file=sys.stderr)
    capture = build_cases(recorder)
    capture["meta"] = {"model": model, "prompt_len": args.prompt_len,
                       "num_prompts": args.num_prompts, "decode_steps": args.decode_steps}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(capture, out)
    cases = sum(len(layer["cases"]) for layer in capture["layers"])
    print(f"[capture] {len(capture['layers'])} layers, {cases} cases -> {out}")
    return 0 if cases else 1


if __name__ == "__main__":
    sys.exit(main())
