"""What one rank of an 8xH200 DeepSeek-V3.1 deployment gets from fp8_snapmla: decode throughput
per rank for DP8/TP1, DP4/TP2 and DP1/TP8 (the paper's Figure 1 configurations).

    python -m benchmarks.bench_deployment --out out/deployment [--configs dp8-tp1-ep8 ...]
        [--contexts 16384 32768 65536 131072] [--kv auto fp8_snapmla fp8]
        [--mtp | --mtp-only] [--routing uniform|weights] [--concurrent-starts N]
        [--profile-steps S] [--budget-only | --dry-run]

The model is the part of DeepSeek-V3.1 one rank runs, for a few layers: 1 dense layer and 3 MoE
layers (``--moe-layers``) with the rank's shards, FP8 block-quantized weights as the checkpoint
declares (``quantization_config``: e4m3, 128x128 blocks, dynamic activations), vLLM's dummy
weights:

- ``dp8-tp1-ep8``: 128 heads; 32 routed experts with top-8 routing.  With DP8 and EP8 the 8
  ranks' 8B tokens each pick 8 of 256 experts, so a rank's 32 experts get 8B x 8 x 32/256 = 8B
  token-expert pairs, B/4 per expert: what B tokens with top-8 over 32 experts give.
- ``dp4-tp2-ep8``: 64 heads, the TP2 shards of the projections (dense width 9216, vocabulary
  64640); experts as EP8, but the 4 DP groups' 4B tokens give a rank 4B pairs: top-4 over 32.
- ``dp1-tp8``: 16 heads, TP8 shards everywhere as vLLM shards without expert parallelism (dense
  width 2304, all 256 experts at width 256, DeepSeek's grouped top-8 routing, vocabulary
  16160).

The shared expert keeps its full width 2048 in the EP configurations (vLLM shards it by TP:
1024 at TP2), and the layer count is 4, not 61: the proxy's time per step is per layer what a
rank runs, plus one embedding, LM head and sampler per step instead of per 61 layers.  The
engine's host work per step (scheduling, input preparation, sampling, outputs) is the same for
4 layers as for 61, so in the proxy it is a far larger share of the step.  By arithmetic
(weight and cache bytes per step over the H200's bandwidth) a 61-layer rank's step is bound by
the GPU, while the GPU work of the 4-layer proxy's 2-4 ms steps is about half of them; its step
times also move with the batch more than its GPU work can explain.  ``--moe-layers N`` runs a deeper
proxy (the KV budget and batch per layer stay those of the full model) to see how a ratio
moves as the GPU's share grows.
**Communication is not modelled** (TP all-reduces, EP dispatch/combine, DP synchronization).
Which way it moves a ratio depends on how it scales.  A ratio is (B_ours / B_bf16) x (T_bf16 /
T_ours), and ours takes the longer step (the larger batch).  Time per step that is the same for
both formats, t, makes it (B_ours / B_bf16) x (T_bf16 + t) / (T_ours + t): higher, towards the
batch ratio.  Time that grows with the batch, like the GEMMs', pulls it towards 1.  At these
batches (tens of tokens per rank: a few MB per layer, microseconds on NVLink) the collectives
are latency-bound, the first case.  For scale: DeepEP's low-latency kernels take 77 us
(dispatch) and 114 us (combine) per MoE layer at EP8 with 128 tokens per rank (measured on H800
over RDMA: deepseek-ai/DeepEP, docs/legacy.md), up to 11 ms per step over 58 MoE layers if
nothing overlaps them; deployments overlap them with a second micro-batch.

**Routing.** vLLM's dummy weights (uniform in +-1e-3) make DeepSeek's router degenerate: the
sigmoid scores differ by ~1e-5 between experts, the score-correction bias by ~1e-3, so every
token goes to the same 8 experts, a rank's MoE reads 8 experts' weights whatever the batch, and
the expert load above does not hold (a test shows it).  ``--routing uniform`` (the default)
sets vLLM's routing simulator (``VLLM_MOE_ROUTING_SIMULATION_STRATEGY=uniform_random``): each
token picks top-k experts uniformly at random (with replacement, so a token's 8 picks may
repeat one), the balanced load DeepSeek's bias-based balancing aims at; ``--routing weights``
keeps the router.  Results before the option existed are ``weights``.  A row counts only if
the engine logged the simulator's warning (vLLM prints it once, from the engine core, at the
first MoE forward; seen on the H200 and the H100 with vLLM 0.26.0, piecewise and FULL CUDA
graphs).

KV budget: what a real deployment of the full 61-layer model leaves a rank per layer
(``kv_budget``): the H200's memory times vLLM's default ``gpu_memory_utilization`` (0.9), less
the rank's real weight bytes (``rank_weight_bytes``: FP8 block-quantized projections and
experts with their scales, BF16 embedding and LM head, vLLM's BF16 copy of the MLA up-projection
for the absorbed decode), less ``--reserve-gib`` for activations, CUDA graphs and non-torch
memory; divided by 61 layers and given to the proxy's layers as ``kv_cache_memory_bytes``.
``--budget-only`` prints that arithmetic and runs nothing; ``--dry-run`` also prints each
engine's batch per context and an estimate of the run's time (``estimate_plan``), and runs
nothing.  ``--concurrent-starts N`` starts N
engines of a configuration at once (their compilation and CUDA-graph capture overlap) and lets
them measure one at a time once all are up.

Engine start includes what vLLM does for FP8 block-quantized MoE on Hopper: DeepGEMM compiles
and warms up its kernels for the shapes the engine can meet (``VLLM_DEEP_GEMM_WARMUP``, default
``relax``), a few minutes for the first engine of a configuration (its cache serves the next
ones), so a configuration takes several minutes before its first context.  Progress is printed
as each engine comes up and each context finishes.

An engine's ``max_num_seqs`` is the largest batch its cache can hold at the shortest context
(``largest_batch``, a multiple of 8): vLLM captures CUDA graphs for batch sizes up to twice
that (four times with MTP) instead of up to 512 (at DP1/TP8 with ``fp8``, 25 sizes instead of
51; the capture took 3.7 of the 6.3 minutes five engines needed to start together on the
H200), and a batch pads to the same graph size as with vLLM's default limit.

Per (configuration, KV format) one engine; per context the batch that fills the KV budget,
decode steps timed after the prefill with the engine core's timestamps (``bench_e2e``'s
method).  ``--mtp`` adds engines with DeepSeek's own drafter (one MTP layer, one speculative
token) for ``auto`` and ``fp8_snapmla``.  Dummy weights make the drafter's acceptance
meaningless, so besides the measured tokens per step the report projects output tok/s =
decode steps/s x B x (1 + ``--mtp-acceptance``), the acceptance DeepSeek reports for its second
token (85-90%); the step time, which is what the KV format changes, is measured.  The MTP
layer's weights come off the rank's memory and its KV cache shares the budget (62 layers), so
the proxy gets one more layer's share.  In the 4-layer proxy the drafter is one layer in five,
not one in 62, so its cost per step is overstated: compare KV formats with MTP against each
other, not against the runs without it.

``--profile-steps S`` asks where a decode step's time goes instead: each engine runs its engine
core in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, where torch's profiler sees the
kernels) and, after the timed windows of each context, profiles S more decode steps of the same
batch (``benchmarks/step_profile.py``): GPU time per step by kernel and by group (attention,
MoE, GEMMs, other), the time the GPU was busy, the step's wall time and its host side.  Such a
run writes ``profile.md``, ``profile.csv`` (every kernel per step) and ``profile.png`` (GPU time
per step by group, and the wall time) to ``--out``, not deployment rows: with the engine core
in-process and the profiler on, its steps are not the ones the windows above time.

Writes ``deployment.csv``, ``deployment.md`` and ``deployment.png`` (per configuration, speedup
over ``auto`` against context, the paper's Figure 1 layout), merged with earlier runs in the same
``--out`` (a rerun row replaces the old one), so that each configuration can run in its own call;
each row names its run, and a speedup is only taken against ``auto`` of the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import bench_e2e
from benchmarks.provenance import describe, run_info
from benchmarks.step_profile import MOE_GROUPS, group_names, kernel_group
from benchmarks.vllm_engine import (BLOCK_SIZE, DEEPSEEK_V31_ATTENTION, ENGINE_OVERHEAD_GIB,
                                    KV_BYTES_PER_TOKEN, KV_SETTINGS, NOISE_FRACTION,
                                    SETTLE_STEPS,
                                    concurrent_memory_problem, concurrent_start_spec,
                                    drop_unused_runs,
                                    estimated_kv_blocks, estimated_prefill_s, merge_by_key,
                                    mla_projection_weights, not_lock_step, number, read_csv,
                                    run_engines_together, run_number, write_csv)

GIB = 2**30
H200_MEMORY_BYTES = int(139.8 * GIB)   # what torch reports as total memory on an H200
GPU_MEMORY_UTILIZATION = 0.9           # vLLM's default

# DeepSeek-V3.1 (config.json of deepseek-ai/DeepSeek-V3.1).
V31 = {"hidden": 7168, "layers": 61, "dense_layers": 3, "heads": 128, "q_lora": 1536,
       "kv_lora": 512, "rope": 64, "nope": 128, "v_head": 128, "dense_width": 18432,
       "experts": 256, "top_k": 8, "expert_width": 2048, "shared_experts": 1,
       "vocab": 129280, "n_group": 8, "topk_group": 4}
FP8_BLOCK = 128
MOE_LAYERS = 3            # the proxy's MoE layers after its one dense layer (--moe-layers)
CONTEXTS = (16384, 32768, 65536, 131072)


@dataclasses.dataclass(frozen=True)
class Rank:
    name: str
    dp: int
    tp: int
    ep: int          # 8: experts split over the 8 GPUs; 1: experts TP-sharded

    @property
    def heads(self) -> int:
        return V31["heads"] // self.tp


CONFIGS = {r.name: r for r in (Rank("dp8-tp1-ep8", 8, 1, 8), Rank("dp4-tp2-ep8", 4, 2, 8),
                               Rank("dp1-tp8", 1, 8, 1))}


def fp8_bytes(rows: int, cols: int) -> int:
    """An FP8 block-quantized matrix: one byte per weight and an FP32 scale per 128x128 block."""
    blocks = -(-rows // FP8_BLOCK) * -(-cols // FP8_BLOCK)
    return rows * cols + 4 * blocks


def rank_weight_bytes(rank: Rank, mtp: bool = False) -> dict[str, int]:
    """Bytes of the real 61-layer model's weights on one rank, by component; with ``mtp`` also
    DeepSeek's MTP module (one more MoE layer and its BF16 ``eh_proj``, 2 x hidden -> hidden;
    it shares the embedding and LM head)."""
    h, tp = V31["hidden"], rank.tp
    heads = rank.heads
    attention = (fp8_bytes(V31["q_lora"], h) + fp8_bytes(V31["kv_lora"] + V31["rope"], h)
                 + fp8_bytes(heads * (V31["nope"] + V31["rope"]), V31["q_lora"])
                 + fp8_bytes(heads * (V31["nope"] + V31["v_head"]), V31["kv_lora"])
                 + fp8_bytes(h, heads * V31["v_head"]))
    # vLLM's MLA keeps BF16 W_UK and W_UV (the absorbed decode) next to kv_b_proj.
    absorbed = 2 * heads * (V31["nope"] + V31["v_head"]) * V31["kv_lora"]
    dense = 3 * fp8_bytes(V31["dense_width"] // tp, h)
    if rank.ep > 1:
        routed = V31["experts"] // rank.ep * 3 * fp8_bytes(V31["expert_width"], h)
    else:
        routed = V31["experts"] * 3 * fp8_bytes(V31["expert_width"] // tp, h)
    shared = 3 * fp8_bytes(V31["shared_experts"] * V31["expert_width"] // tp, h)
    gate = 2 * V31["experts"] * h
    moe_layers = V31["layers"] - V31["dense_layers"]
    vocab = 2 * V31["vocab"] * h // tp        # BF16 embedding and LM head, vocabulary-parallel
    parts = {"attention": V31["layers"] * (attention + absorbed),
             "dense_mlp": V31["dense_layers"] * dense,
             "routed_experts": moe_layers * routed,
             "shared_experts": moe_layers * shared,
             "router": moe_layers * gate,
             "embedding_and_lm_head": 2 * vocab}
    if mtp:
        parts["mtp_layer"] = attention + absorbed + routed + shared + gate + 2 * 2 * h * h
    return parts


def kv_budget(rank: Rank, reserve_gib: float, mtp: bool = False,
              memory_bytes: int = H200_MEMORY_BYTES,
              utilization: float = GPU_MEMORY_UTILIZATION) -> dict:
    """The KV cache a rank of the real deployment has, in total and per layer; with ``mtp`` the
    MTP layer's weights come off the total and its KV cache shares it (62 layers)."""
    weights = sum(rank_weight_bytes(rank, mtp).values())
    usable = int(memory_bytes * utilization)
    total = usable - weights - int(reserve_gib * GIB)
    if total <= 0:
        raise ValueError(f"{rank.name}: weights ({weights / GIB:.1f} GiB) and reserve leave no "
                         f"KV cache in {usable / GIB:.1f} GiB")
    per_layer = total // (V31["layers"] + int(mtp))
    return {"usable_bytes": usable, "weight_bytes": weights,
            "reserve_bytes": int(reserve_gib * GIB), "kv_bytes": total,
            "kv_bytes_per_layer": per_layer,
            "tokens": {kv: per_layer // b for kv, b in KV_BYTES_PER_TOKEN.items()}}


def proxy_model_config(rank: Rank, moe_layers: int = MOE_LAYERS) -> dict:
    """The config.json overrides of the rank's proxy, 1 dense and ``moe_layers`` MoE layers
    (for ``write_tiny_deepseek_v3``)."""
    ep = rank.ep > 1
    return {
        **DEEPSEEK_V31_ATTENTION,
        "num_attention_heads": rank.heads, "num_key_value_heads": rank.heads,
        "num_hidden_layers": 1 + moe_layers, "first_k_dense_replace": 1,
        "intermediate_size": V31["dense_width"] // rank.tp,
        "vocab_size": V31["vocab"] // rank.tp,
        "n_routed_experts": V31["experts"] // rank.ep if ep else V31["experts"],
        "num_experts_per_tok": rank.dp if ep else V31["top_k"],
        "moe_intermediate_size": V31["expert_width"] if ep else V31["expert_width"] // rank.tp,
        "n_shared_experts": V31["shared_experts"],
        "n_group": 1 if ep else V31["n_group"], "topk_group": 1 if ep else V31["topk_group"],
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "moe_layer_freq": 1,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                "activation_scheme": "dynamic",
                                "weight_block_size": [FP8_BLOCK, FP8_BLOCK]},
    }


def proxy_weight_bytes(rank: Rank, mtp: bool = False, moe_layers: int = MOE_LAYERS) -> int:
    """The rank's proxy's weights: its share of each part of the real model's (1 + moe_layers
    of 61 attention layers, 1 of 3 dense MLPs, moe_layers of 58 MoE layers, the vocabulary,
    the MTP layer)."""
    w = rank_weight_bytes(rank, mtp)
    moe = w["routed_experts"] + w["shared_experts"] + w["router"]
    moe_total = V31["layers"] - V31["dense_layers"]
    return int(w["attention"] * (1 + moe_layers) / V31["layers"] + w["dense_mlp"] / 3
               + moe * moe_layers / moe_total + w["embedding_and_lm_head"]
               + w.get("mtp_layer", 0))


def budget_table(reserve_gib: float) -> str:
    lines = ["| configuration | heads | weights GiB | reserve GiB | KV GiB (61 layers) | "
             "KV MiB per layer | tokens BF16 | tokens fp8_snapmla | tokens fp8 | "
             "KV MiB per layer with MTP |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for rank in CONFIGS.values():
        b = kv_budget(rank, reserve_gib)
        t = b["tokens"]
        with_mtp = kv_budget(rank, reserve_gib, mtp=True)["kv_bytes_per_layer"]
        lines.append(f"| {rank.name} | {rank.heads} | {b['weight_bytes'] / GIB:.1f} | "
                     f"{reserve_gib:g} | {b['kv_bytes'] / GIB:.1f} | "
                     f"{b['kv_bytes_per_layer'] / 2**20:.0f} | {t['auto']:,} | "
                     f"{t['fp8_snapmla']:,} | {t['fp8']:,} | {with_mtp / 2**20:.0f} |")
    return "\n".join(lines)


def _steps_overstated(row: dict) -> bool:
    """A row without MTP whose timed steps were not one token per request each: its B / step
    overstates the throughput (with MTP a step gives 1 + accepted tokens, and
    ``tokens_per_step`` says how many)."""
    return not row.get("mtp") and not_lock_step(row)


def add_speedups(rows: list[dict]) -> list[dict]:
    """Speedup of each row's decode steps/s x B over ``auto``'s, same configuration, context,
    drafter (with MTP both sides project the same acceptance, so it cancels) and run (a row
    measured in another call, maybe on another commit or GPU, gets none); none where either
    side's steps were not lock-step."""
    key = lambda r: (r["config"], r["context"], bool(r.get("mtp")), r.get("run"))  # noqa: E731
    base = {key(r): r for r in rows if r["kv"] == "auto" and r.get("decode_tok_s")}
    for r in rows:
        b = base.get(key(r))
        usable = (b and r.get("decode_tok_s")
                  and not (_steps_overstated(r) or _steps_overstated(b)))
        r["speedup_vs_auto"] = r["decode_tok_s"] / b["decode_tok_s"] if usable else ""
    return rows


SERIES = {("fp8_snapmla", False): ("o-", "tab:blue"), ("fp8", False): ("^-", "tab:orange"),
          ("fp8_snapmla", True): ("s--", "tab:green")}


def speedup_uncertainty(row: dict, base: dict) -> float:
    """Half the range a speedup can take when each side's step time lies anywhere between its
    fastest and slowest window: speedup x (both spreads) / 2."""
    spreads = [number(r.get("spread_pct")) or 0.0 for r in (row, base)]
    return row["speedup_vs_auto"] * sum(spreads) / 200


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(1, len(configs), figsize=(4.2 * len(configs), 3.6), squeeze=False,
                             sharey=True)
    base = {(r["config"], r["context"], bool(r.get("mtp")), r.get("run")): r for r in rows
            if r["kv"] == "auto"}
    for ax, config in zip(axes[0], configs):
        depths = sorted({r.get("layers") or 1 + MOE_LAYERS for r in rows
                         if r["config"] == config})
        for ((kv, mtp), (style, color)), layers in itertools.product(SERIES.items(), depths):
            series = [r for r in rows if r["config"] == config and r["kv"] == kv
                      and bool(r.get("mtp")) == mtp and r["speedup_vs_auto"]
                      and (r.get("layers") or 1 + MOE_LAYERS) == layers]
            pts = sorted((r["context"], r["speedup_vs_auto"],
                          speedup_uncertainty(r, base[(config, r["context"], mtp, r.get("run"))]))
                         for r in series)
            # Runs of the router on dummy weights (every token to the same experts) say so.
            skewed = any(r.get("routing") == "weights" for r in series)
            if pts:
                # A deeper proxy in the same folder: its own dotted line.
                deeper = layers != depths[0]
                ax.errorbar([c // 1024 for c, _, _ in pts], [s for _, s, _ in pts],
                            yerr=[e for _, _, e in pts],
                            fmt=style.rstrip("-:.") + ":" if deeper else style, color=color,
                            capsize=3, mfc="none" if deeper else None,
                            label=kv + (" + MTP" if mtp else "")
                            + (f" ({layers} layers)" if len(depths) > 1 else "")
                            + (" (dummy-weight routing)" if skewed else ""))
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (k tokens)")
        ax.set_title(config)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[0][0].set_ylabel("decode tok/s per rank vs BF16\n(bars: the windows' spread)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


FIELDS = ["run", "config", "heads", "layers", "kv", "mtp", "routing", "context", "batch",
          "decode_tok_s", "tpot_ms", "spread_pct", "window_ms", "lock_step", "timer",
          "tokens_per_step",
          "projected_output_tok_s", "speedup_vs_auto", "kv_cache_tokens", "max_tokens",
          "kv_cache_mib", "start_s", "context_s",
          "backend", "error"]
MTP_SPEC = {"method": "mtp", "num_speculative_tokens": 1}
# --routing: vLLM's routing simulator (VLLM_MOE_ROUTING_SIMULATION_STRATEGY) or the router.
# "" is vLLM's "off", also when the variable is set in the caller's environment.
ROUTING_ENV = {"uniform": {"VLLM_MOE_ROUTING_SIMULATION_STRATEGY": "uniform_random"},
               "weights": {"VLLM_MOE_ROUTING_SIMULATION_STRATEGY": ""}}


def largest_batch(kv: str, kv_gib: float, layers: int, contexts, limit: int) -> int:
    """An upper bound on the batch any of ``contexts`` can fill in a ``kv_gib`` GiB cache over
    ``layers`` layers (the shortest context, no generated tokens, 1/8 slack over vLLM's page
    count), a multiple of 8, at most ``limit`` (rounded down to one; vLLM captures full decode
    graphs only up to max_num_seqs x query length, and a batch past the last multiple of 8 would
    pad beyond it): the engine's ``max_num_seqs``.  vLLM captures
    CUDA graphs up to 2 x max_num_seqs x query length, the sizes a larger limit would also
    capture, so a batch pads to the same graph as in a deployment with the default limit;
    most of an engine's start-up is that capture."""
    pages_per_request = -(-min(contexts) // BLOCK_SIZE)
    fits = estimated_kv_blocks(kv, kv_gib, layers) * 9 // 8 // pages_per_request
    return max(8, min(limit // 8 * 8, -(-fits // 8) * 8))


# --- the plan and time estimate of --dry-run (pure; unit-tested on CPU) ---------------------

# Meant to be pessimistic for an H200.  Against its H200 runs (each command's time from its
# header's timestamp to the next one's, to the minute) it estimated 1.3-2.8x their time.  Rows
# now record their engine's start-up and their context's time (start_s, context_s); a unit test
# keeps the estimate within 1x-4x of every recorded H200 time.  On an H100, two engines started
# together, the contexts took 0.35-2.8x their estimates (results/deployment).
FIRST_START_S = 420.0   # a group with a configuration's first engine: DeepGEMM compiles (199-366 s;
                        # 378 s for five engines started together)
NEXT_START_S = 90.0     # later groups, DeepGEMM's kernels cached (47-87 s measured)
DECODE_STEP_S = 0.006   # the proxies' steps measured 1.8-5.6 ms, MTP's included
CONTEXT_OVERHEAD_S = 2.0
LLM_MAX_BATCHED_TOKENS = 16384   # vLLM's default for LLM(...) on GPUs of 70 GiB and more


def prefill_weights_per_token(rank: Rank, moe_layers: int = MOE_LAYERS, mtp: bool = False) -> int:
    """Weights a prefill token multiplies through (2 FLOPs each) in the rank's proxy: every
    layer's MLA projections, the dense MLP once, per MoE layer (the drafter's too) the routed
    experts it picks and the shared one."""
    c = proxy_model_config(rank, moe_layers)
    h = V31["hidden"]
    attention = mla_projection_weights(rank.heads)
    expert = 3 * h * c["moe_intermediate_size"]
    moe = (c["num_experts_per_tok"] + c["n_shared_experts"]) * expert
    return ((1 + moe_layers + int(mtp)) * attention + 3 * h * c["intermediate_size"]
            + (moe_layers + int(mtp)) * moe)


@dataclasses.dataclass
class EnginePlan:
    """One engine of --dry-run's plan: its cache, and per context the batch that fills it (0:
    no request of that length fits) and the estimated seconds of its measurement."""
    config: str
    kv: str
    mtp: bool
    layers: int
    kv_gib: float
    max_batch: int
    batches: dict[int, int]
    seconds: dict[int, float]


def plan_engine(rank: Rank, kv: str, mtp: bool, args) -> EnginePlan:
    """What ``engine_launch`` and ``bench_e2e.run_engine`` (``bench_e2e.plan_context``) will
    decide for this engine, on the cache vLLM is expected to allocate (``estimated_kv_blocks``,
    less its null block; the engine uses its real one), and the time model above."""
    layers = 1 + args.moe_layers + int(mtp)
    kv_gib = layers * kv_budget(rank, args.reserve_gib, mtp)["kv_bytes_per_layer"] / GIB
    max_batch = largest_batch(kv, kv_gib, layers, args.contexts, args.max_batch)
    usable = estimated_kv_blocks(kv, kv_gib, layers) - 1
    draft = MTP_SPEC["num_speculative_tokens"] if mtp else 0
    timed = (SETTLE_STEPS + args.windows * args.gen_tokens + args.profile_steps) * (1 + draft)
    weights = prefill_weights_per_token(rank, args.moe_layers, mtp)
    batches, seconds = {}, {}
    for context in args.contexts:
        plan = bench_e2e.plan_context(usable, BLOCK_SIZE, context, timed, draft,
                                      LLM_MAX_BATCHED_TOKENS, max_batch)
        batches[context] = 0 if plan["reason"] else plan["batch"]
        if plan["reason"]:
            continue
        prefill = estimated_prefill_s(plan["batch"], context, rank.heads, layers, weights)
        # Dummy weights accept no drafted token: one token per request and step.
        seconds[context] = CONTEXT_OVERHEAD_S + prefill + plan["max_tokens"] * DECODE_STEP_S
    return EnginePlan(rank.name, kv, mtp, layers, kv_gib, max_batch, batches, seconds)


def estimate_plan(args) -> list[tuple[Rank, list[list[EnginePlan]], float]]:
    """Per configuration of ``args.configs``: its engines in --concurrent-starts groups (as
    ``main`` runs them) and its estimated seconds: per group the start-up its engines share,
    then their measurements one after the other."""
    plan = []
    for name in args.configs:
        rank = CONFIGS[name]
        engines = [plan_engine(rank, kv, mtp, args)
                   for kv, mtp in engine_runs(args.kv, args.mtp, args.mtp_only)]
        groups = [engines[i:i + args.concurrent_starts]
                  for i in range(0, len(engines), args.concurrent_starts)]
        seconds = sum((FIRST_START_S if k == 0 else NEXT_START_S)
                      + sum(sum(e.seconds.values()) for e in group)
                      for k, group in enumerate(groups))
        plan.append((rank, groups, seconds))
    return plan


def format_plan(plan, contexts) -> str:
    """--dry-run's report of ``estimate_plan``."""
    labels = "/".join(f"{c // 1024}k" if c % 1024 == 0 else str(c) for c in contexts)
    lines = ["Dry run: nothing started.  Times are pessimistic estimates for an H200 (engine "
             f"start-up {FIRST_START_S:.0f} s for a configuration's first group, "
             f"{NEXT_START_S:.0f} s for the others; prefill at about half the GPU's rates; "
             f"{DECODE_STEP_S * 1e3:.0f} ms decode steps)."]
    for rank, groups, seconds in plan:
        engines = sum(len(g) for g in groups)
        lines.append(f"{rank.name}, {rank.heads} heads: {engines} engines in {len(groups)} "
                     f"group(s), about {seconds / 60:.0f} min")
        for engine in itertools.chain.from_iterable(groups):
            batches = "/".join(str(engine.batches[c]) for c in contexts)
            lines.append(
                f"  {engine.kv}{' + MTP' if engine.mtp else ''}: {engine.layers} layers, KV "
                f"{engine.kv_gib:.2f} GiB, max_num_seqs {engine.max_batch}, B at {labels}: "
                f"{batches}; {sum(engine.seconds.values()):.0f} s of measurement")
    total = sum(seconds for *_, seconds in plan)
    lines.append(f"The whole run: about {total / 60:.0f} min.")
    return "\n".join(lines)


_INTEGER_FIELDS = ("run", "heads", "layers", "context", "batch", "kv_cache_tokens",
                   "max_tokens")
_FLOAT_FIELDS = ("decode_tok_s", "tpot_ms", "spread_pct", "tokens_per_step",
                 "projected_output_tok_s", "kv_cache_mib", "start_s", "context_s")


def _row_from_csv(row: dict) -> dict:
    """A ``deployment.csv`` row with its numbers and ``mtp`` flag as a fresh run has them."""
    r = dict(row)
    for name in _INTEGER_FIELDS + _FLOAT_FIELDS:
        value = number(r.get(name))
        r[name] = "" if value is None else int(value) if name in _INTEGER_FIELDS else value
    r["mtp"] = r.get("mtp") == "True"
    r["routing"] = r.get("routing") or "weights"   # runs before the column routed by weights
    r["layers"] = r["layers"] or 1 + MOE_LAYERS      # and had the default proxy
    return r


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with the rows of the same (configuration, proxy layers, kv, MTP, context)
    replaced by ``new``, in report order (configurations as ``CONFIGS``, layers, plain before
    MTP, kv, context)."""
    configs, kvs = list(CONFIGS), list(KV_SETTINGS)

    def order(k):
        config, layers, kv, mtp, context = k
        return (configs.index(config) if config in configs else len(configs), layers, mtp,
                kvs.index(kv) if kv in kvs else len(kvs), kv, context)

    return merge_by_key(old, new, lambda r: (r["config"], int(r.get("layers") or 1 + MOE_LAYERS),
                                             r["kv"], bool(r.get("mtp")), int(r["context"])),
                        order)


def _spread_cell(spread) -> str:
    """The windows' spread (slowest - fastest, % of the median), flagged past bench_e2e's
    noise bound."""
    if spread in (None, ""):
        return ""
    return f"{spread:.1f}%" + (" (noisy)" if spread > 100 * NOISE_FRACTION else "")


def _cache_used(row: dict) -> str:
    """B x (context + max_tokens) over the KV cache's tokens, as a percentage ("" unknown)."""
    batch, capacity = number(row.get("batch")), number(row.get("kv_cache_tokens"))
    generated = number(row.get("max_tokens"))
    if not (batch and capacity and generated is not None):
        return ""
    return f"{100 * batch * (int(row['context']) + generated) / capacity:.0f}%"


def write_outputs(rows: list[dict], out: Path, header: str, budget: str) -> None:
    """Merge ``rows`` into ``out``'s earlier results (so each configuration can run in its own
    call) and rewrite deployment.csv, .md and .png; ``header`` joins the runs listed on top, and
    each row's ``run`` is its run's number in that list (runs no row names any more are
    dropped)."""
    out.mkdir(parents=True, exist_ok=True)
    runs, old = read_csv(out / "deployment.csv")
    run = run_number(runs, header)
    runs, rows = drop_unused_runs(runs, merge_rows([_row_from_csv(r) for r in old],
                                                   [{**r, "run": run} for r in rows]))
    rows = add_speedups(rows)
    write_csv(rows, out / "deployment.csv", FIELDS, comments=runs)
    lines = ["\n\n".join(f"run {i}: {text}" for i, text in enumerate(runs, 1)), "",
             "KV budget per rank:", "", budget, "",
             "Throughput and step times are the proxy's (a few layers; a 61-layer rank's "
             "steps are far longer): compare the formats through the ratios. \"cache used\" "
             "is B x (context + generated tokens) over the cache's tokens: a batch rounded "
             "down leaves the rest idle, and a format that rounds down less gains from it.", "",
             "| run | configuration | heads | layers | kv | routing | context | batch | "
             "cache used | decode steps/s x B | step ms | windows apart | tokens per step | "
             "projected output tok/s | vs auto (same run) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tok, tpot, speedup = r.get("decode_tok_s"), r.get("tpot_ms"), r["speedup_vs_auto"]
        per_step, projected = r.get("tokens_per_step"), r.get("projected_output_tok_s")
        cells = [r["run"], r["config"], r["heads"], r.get("layers", ""),
                 _kv_label(r),
                 r.get("routing", ""), r["context"], r.get("batch", ""), _cache_used(r),
                 f"{tok:,.0f}" if tok else r.get("error", ""), f"{tpot:.2f}" if tpot else "",
                 _spread_cell(r.get("spread_pct")), f"{per_step:.3f}" if per_step else "",
                 f"{projected:,.0f}" if projected else "",
                 f"{speedup:.2f}x" if speedup else
                 "not lock-step" if _steps_overstated(r) and tok else ""]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    (out / "deployment.md").write_text("\n".join(lines) + "\n")
    if any(r["speedup_vs_auto"] for r in rows):
        plot(rows, out / "deployment.png")


PROFILE_FIELDS = ["config", "kv", "mtp", "context", "batch", "kernel", "group", "us_per_step",
                  "launches_per_step"]
PROFILE_TOP_KERNELS = 12


def _kv_label(row: dict) -> str:
    return row["kv"] + (" + MTP" if row.get("mtp") else "")


def _profile_label(row: dict) -> str:
    return f"{row['config']} {_kv_label(row)} {int(row['context']) // 1024}k"


def write_profile_outputs(rows: list[dict], out: Path, header: str) -> None:
    """``--profile-steps``: per engine and context, the profiled decode steps (``profile.md``,
    ``profile.csv``, ``profile.png``); rows without a profile (failed contexts) are listed as
    such."""
    out.mkdir(parents=True, exist_ok=True)
    profiled = [r for r in rows if r.get("profile")]
    groups = group_names(MOE_GROUPS)
    lines = [header, "",
             "Decode steps profiled after the timed windows, engine core in-process (the "
             "profiler adds its own cost to every op, so the wall and host figures compare "
             "formats; they are not what an unprofiled step costs). µs per step:", "",
             "| configuration | kv | context | B | window step ms (in-process) | wall | GPU busy | "
             + " | ".join(groups) + " | host µs in ops | waits per step |",
             "|---|---|---|---|---|---|---|" + "---|" * len(groups) + "---|---|"]
    for r in profiled:
        p = r["profile"]
        cells = [r["config"], _kv_label(r),
                 r["context"], r.get("batch", ""),
                 f"{r['tpot_ms']:.2f}" if r.get("tpot_ms") else "",
                 f"{p['wall_us']:,.1f}", f"{p['busy_us']:,.1f}",
                 *(f"{p['groups_us'][g]:,.1f}" for g in groups),
                 f"{p['host_us']:,.1f}", f"{p['waits_per_step']:.1f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    for r in profiled:
        lines += ["", f"{_profile_label(r)}, B={r.get('batch')}: largest kernels per step", "",
                  "| µs | launches | group | kernel |", "|---|---|---|---|"]
        for name, us, launches in r["profile"]["kernels"][:PROFILE_TOP_KERNELS]:
            lines.append(f"| {us:,.1f} | {launches:.1f} | {kernel_group(name, MOE_GROUPS)} | "
                         f"`{name[:90]}` |")
    failed = [r for r in rows if not r.get("profile")]
    if failed:
        lines += ["", "Not profiled:", ""] + [
            f"- {_profile_label(r)}: {r.get('error') or 'no profile'}" for r in failed]
    (out / "profile.md").write_text("\n".join(lines) + "\n")
    write_csv([{"config": r["config"], "kv": r["kv"], "mtp": bool(r.get("mtp")),
                "context": r["context"], "batch": r.get("batch", ""), "kernel": name,
                "group": kernel_group(name, MOE_GROUPS), "us_per_step": round(us, 3),
                "launches_per_step": round(launches, 3)}
               for r in profiled for name, us, launches in r["profile"]["kernels"]],
              out / "profile.csv", PROFILE_FIELDS, comments=[header])
    if profiled:
        plot_profiles(profiled, out / "profile.png")


def plot_profiles(rows: list[dict], path: Path) -> None:
    """GPU µs per decode step by kernel group (stacked) and the step's wall time, per engine and
    context; one panel per configuration."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = group_names(MOE_GROUPS)
    configs = [c for c in CONFIGS if any(r["config"] == c for r in rows)]
    fig, axes = plt.subplots(1, len(configs), figsize=(1.2 + 5 * len(configs), 4.5),
                             squeeze=False)
    for ax, config in zip(axes[0], configs):
        mine = [r for r in rows if r["config"] == config]
        bottom = [0.0] * len(mine)
        for group in groups:
            heights = [r["profile"]["groups_us"][group] / 1000 for r in mine]
            ax.bar(range(len(mine)), heights, bottom=bottom, label=group)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.plot(range(len(mine)), [r["profile"]["wall_us"] / 1000 for r in mine], "k_",
                markersize=24, label="step wall time")
        ax.set_xticks(range(len(mine)),
                      [f"{_kv_label(r)}\n{int(r['context']) // 1024}k, B={r.get('batch')}"
                       for r in mine],
                      fontsize=7, rotation=30, ha="right")
        ax.set_title(config)
        ax.set_ylabel("ms per decode step (profiled)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def say(line: str) -> None:
    """``line`` in one write: engines of a --concurrent-starts group report from threads."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def engine_runs(kvs: list[str], mtp: bool, mtp_only: bool) -> list[tuple[str, bool]]:
    """(KV format, with the MTP drafter) of each engine of a configuration: ``kvs`` plain
    unless ``mtp_only``, then ``auto`` and ``fp8_snapmla`` of ``kvs`` with MTP if asked."""
    runs = [] if mtp_only else [(kv, False) for kv in kvs]
    if mtp or mtp_only:
        runs += [(kv, True) for kv in ("auto", "fp8_snapmla") if kv in kvs]
    return runs


def engine_launch(rank: Rank, kv: str, mtp: bool, position: int, group_size: int, args,
                  tmp: Path, on_rows=None):
    """The launch (``run_engines_together``) of one engine of ``rank``: its proxy model, its
    KV budget, progress lines; returns the engine's rows, and hands them to ``on_rows`` first
    (so that they are saved as soon as the engine ends, not after its group)."""
    from vllm_snapmla.testing import write_tiny_deepseek_v3

    def run(go_file, on_up) -> list[dict]:
        overrides = {**proxy_model_config(rank, args.moe_layers),
                     **({"num_nextn_predict_layers": 1} if mtp else {})}
        model = str(write_tiny_deepseek_v3(tmp / f"{rank.name}{'-mtp' if mtp else ''}-{kv}",
                                           **overrides))
        # The drafter's layer holds KV too: the proxy's cache is its layers' share.
        layers = 1 + args.moe_layers + int(mtp)
        kv_bytes = layers * kv_budget(rank, args.reserve_gib, mtp)["kv_bytes_per_layer"]
        label = f"[{rank.name} kv={kv}{' + MTP' if mtp else ''}]"
        say(f"{label} {rank.heads} heads, KV {kv_bytes / GIB:.2f} GiB for {layers} layers, "
            f"contexts {args.contexts}; starting the engine (the first engine of a "
            "configuration also compiles DeepGEMM's FP8 kernels: minutes) ...")
        start = time.monotonic()
        max_batch = largest_batch(kv, kv_bytes / GIB, layers, args.contexts, args.max_batch)
        spec = {"model": model, "heads": rank.heads, "contexts": list(args.contexts),
                "kv": kv, "gen_tokens": args.gen_tokens, "windows": args.windows,
                "kv_cache_gib": kv_bytes / GIB, "max_batch": max_batch,
                "vocab": V31["vocab"] // rank.tp,
                "env": {**ROUTING_ENV[args.routing],
                        **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if args.profile_steps else {})},
                "speculative_config": MTP_SPEC if mtp else None,
                "profile_steps": args.profile_steps}
        spec.update(concurrent_start_spec(go_file, group_size))
        reported = set()

        def report(result):
            if result.get("kind") == "engine":
                on_up()
            else:
                reported.add(result["context"])
            bench_e2e.print_progress(result, start, prefix=label)
            if result.get("batch") == max_batch and max_batch < args.max_batch:
                say(f"{label} WARNING: context {result['context']}: B={max_batch} is the "
                    "engine's max_num_seqs, the cache may hold more")

        # An engine of a group waits for the ones before it.
        timeout = args.timeout * len(args.contexts) * (position + 1)
        rows = bench_e2e.run_in_subprocess(spec, timeout, on_result=report,
                                           startup_timeout=args.timeout)
        wanted = ROUTING_ENV[args.routing].get("VLLM_MOE_ROUTING_SIMULATION_STRATEGY", "")
        for row in rows:
            row.update(config=rank.name, layers=1 + args.moe_layers, mtp=mtp,
                       routing=args.routing, kv_cache_mib=kv_bytes / 2**20)
            if row.get("decode_tok_s") and row.get("simulated_routing", "") != wanted:
                # Not what --routing asked for: no number rather than a mislabelled one.
                row["error"] = (f"engine log shows routing simulator "
                                f"'{row.get('simulated_routing', '')}', expected '{wanted}'")
                for name in ("decode_tok_s", "tpot_ms", "window_ms", "spread_pct",
                             "tokens_per_step"):
                    row[name] = ""
                say(f"{label} context {row['context']}: {row['error']}")
            if row.get("decode_tok_s"):
                row["projected_output_tok_s"] = round(
                    row["decode_tok_s"] * (1 + (args.mtp_acceptance if mtp else 0)), 1)
            if row["context"] not in reported:   # the engine died or timed out first
                say(f"{label} context {row['context']}: {row.get('error')}")
        say(f"{label} engine done ({time.monotonic() - start:.0f} s)")
        if on_rows:
            on_rows(rows)
        return rows
    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/deployment")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--kv", nargs="+", default=list(KV_SETTINGS), choices=KV_SETTINGS)
    parser.add_argument("--reserve-gib", type=float, default=6.0,
                        help="activations, CUDA graphs and non-torch memory of a real rank "
                             "(default 6; the engines log their own figures)")
    parser.add_argument("--gen-tokens", type=int, default=128, help="decode steps per window")
    parser.add_argument("--windows", type=int, default=4,
                        help="timed windows; the step time is their median")
    parser.add_argument("--max-batch", type=int, default=512,
                        help="most requests at once (an engine's max_num_seqs is the smaller "
                             "of this and the largest batch its cache can hold)")
    parser.add_argument("--moe-layers", type=int, default=MOE_LAYERS,
                        help="MoE layers of the proxy after its dense layer (default 3; more "
                             "shrink the share of the per-step host work, see the docstring)")
    parser.add_argument("--routing", choices=list(ROUTING_ENV), default="uniform",
                        help="uniform: each token picks its experts uniformly at random "
                             "(vLLM's routing simulator), the idealised balanced load "
                             "DeepSeek's bias-based balancing aims at; "
                             "weights: the router on the dummy weights, which sends every "
                             "token to the same experts")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds for an engine to start, and per context (an engine of "
                             "a --concurrent-starts group also gets the time of those before)")
    parser.add_argument("--mtp", action="store_true",
                        help="also auto and fp8_snapmla with one MTP speculative token")
    parser.add_argument("--mtp-only", action="store_true",
                        help="only the MTP engines (auto and fp8_snapmla among --kv)")
    parser.add_argument("--mtp-acceptance", type=float, default=0.85,
                        help="acceptance of the MTP token for the projected output tok/s")
    parser.add_argument("--concurrent-starts", type=int, default=1, metavar="N",
                        help="start N engines of a configuration at once (their start-ups "
                             "overlap), measure them one at a time")
    parser.add_argument("--profile-steps", type=int, default=0, metavar="S",
                        help="profile S decode steps per context after the timed windows, "
                             "engine core in-process; writes profile.md/csv/png, not "
                             "deployment rows")
    parser.add_argument("--budget-only", action="store_true",
                        help="print the KV-budget arithmetic and stop")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the KV-budget arithmetic, each engine's batches and an "
                             "estimate of the run's time, and stop")
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 1 <= args.concurrent_starts <= 8:
        parser.error("--concurrent-starts must be 1 to 8")
    if args.windows < 1 or args.gen_tokens < 1:
        parser.error("--windows and --gen-tokens must be at least 1")
    if args.profile_steps < 0:
        parser.error("--profile-steps must be 0 (no profile) or more")
    if args.max_batch < 8:
        parser.error("--max-batch must be at least 8 (batches are sized in multiples of 8)")
    if not engine_runs(args.kv, args.mtp, args.mtp_only):
        parser.error("--mtp-only runs auto and fp8_snapmla with the drafter: give --kv one of "
                     "them")
    if not 1 <= args.moe_layers <= V31["layers"] - V31["dense_layers"]:
        parser.error("--moe-layers must be 1 to 58")
    for name in args.configs:
        rank = CONFIGS[name]
        kv_gib = (args.moe_layers + 2) * kv_budget(rank, args.reserve_gib, True)[
            "kv_bytes_per_layer"] / GIB
        problem = concurrent_memory_problem(
            args.concurrent_starts, kv_gib,
            proxy_weight_bytes(rank, True, args.moe_layers) / GIB + ENGINE_OVERHEAD_GIB)
        if problem:
            parser.error(f"{name}: {problem}")
    budget = budget_table(args.reserve_gib)
    print(budget, flush=True)
    if args.budget_only:
        return
    plan = estimate_plan(args)
    if args.dry_run:
        print(format_plan(plan, args.contexts), flush=True)
        return
    engines = sum(len(group) for _, groups, _ in plan for group in groups)
    print(f"{engines} engines over {len(plan)} configuration(s), estimated about "
          f"{sum(seconds for *_, seconds in plan) / 60:.0f} min on an H200 (pessimistic; "
          "--dry-run prints the plan)", flush=True)
    out = Path(args.out)
    header = describe(run_info("benchmarks.bench_deployment", argv))
    rows: list[dict] = []
    lock = threading.Lock()

    def save(engine_rows: list[dict]) -> None:
        """Each engine's rows into the outputs once it ends: an interrupted run keeps them."""
        with lock:
            rows.extend(engine_rows)
            if args.profile_steps:
                write_profile_outputs(rows, out, header)
            else:
                write_outputs(rows, out, header, budget)

    with tempfile.TemporaryDirectory(prefix="bench-deployment-") as tmp:
        for name in args.configs:
            rank = CONFIGS[name]
            runs = engine_runs(args.kv, args.mtp, args.mtp_only)
            for first in range(0, len(runs), args.concurrent_starts):
                group = runs[first:first + args.concurrent_starts]
                run_engines_together(
                    [engine_launch(rank, kv, mtp, position, len(group), args, Path(tmp), save)
                     for position, (kv, mtp) in enumerate(group)], Path(tmp))
    print(f"wrote {out}/" + ("profile.md, profile.csv, profile.png" if args.profile_steps
                             else "deployment.md, deployment.csv, deployment.png"))


if __name__ == "__main__":
    main()
