"""What a first benchmark of ``LLM.generate`` shows, and where its decode steps' GPU time goes.

    python -m benchmarks.bench_generate --out out/bench_generate [--kv auto fp8_snapmla fp8]
        [--layers 4 16] [--heads 16] [--batch 64] [--prompt-len 512] [--output-len 512]
        [--calls 3] [--max-model-len 131072] [--enforce-eager] [--in-process [--profile]]
        [--switch-interval MS]

``bench_e2e`` and ``bench_matrix`` time decode steps with the engine core's timestamps.  A
user's first benchmark times whole ``LLM.generate`` calls instead: the prefill, the decode
steps and the engine's CPU work between them.  This runs that, on ``bench_e2e``'s model
(DeepSeek-V3.1's attention shapes, vLLM's dummy weights) with ``--layers`` dense layers (more
layers: more GPU work per step beside the same CPU work): B random prompts of P tokens, each
generating O tokens (``ignore_eos``), one warm-up call, then ``--calls`` timed calls;

    output tok/s = B x O / seconds of the call

One engine per (layers, KV format), each in a child process, the formats of a layer count one
after another.  ``--in-process`` runs vLLM's engine core in the engine's own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) instead of the separate process ``LLM`` starts by default.

``--enforce-eager`` builds the engines with ``enforce_eager=True`` (no torch.compile, no CUDA
graphs): every op of every step is launched from Python (with the default compilation only the
attention of steps that mix prefill and decode runs so).

``--profile`` (with ``--in-process``, so that the kernels run in the profiled process) then
adds B fresh prompts of P tokens, steps the engine until every request has its first token and
a few steps more, and profiles the next S engine steps (``--profile-steps``) with torch's
profiler: decode steps of the whole batch, with no prefill in them.  Per step: GPU time by
kernel and by group (attention with the KV-cache write and the query quantization; GEMMs; the
rest), the time the GPU was busy and the step's wall time; and the host side: CPU time of each
op and CUDA runtime call the profiler saw (its own time on the host thread, children excluded,
time blocked in a call included), with the calls that make the host wait for the GPU
(synchronizations, synchronous copies) counted apart.  The profiler adds its own cost to every
op it records, which host-bound eager steps feel: the host figures compare formats, they are
not what an unprofiled step costs.  Profiled steps are not timed.

``--switch-interval MS`` sets Python's GIL switch interval in the process that runs the engine
core, as ``bench_matrix``'s option does, for the question of the engine core's threads waiting
for the GIL (benchmarks/RESULTS.md, "Through vLLM").

Writes ``generate.csv`` (a row per timed call), ``generate.md`` (per layer count and format the
median, lowest and highest tok/s and the median over ``auto``'s median; with ``--profile`` the
per-step groups, the largest kernels and the host side), ``kernels.csv`` and ``host.csv`` (with
``--profile``) and ``generate.png`` (every call's tok/s; with ``--profile`` also the GPU time
per step by group).  Each run replaces the files of the last one in ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_matrix import switch_interval_arg_problem
from benchmarks.provenance import describe, run_info
from benchmarks.step_profile import (group_names, host_wait, kernel_group, profiled,
                                     window_profile)
from benchmarks.vllm_engine import (
    BASELINE_KV,
    DEEPSEEK_V31_ATTENTION,
    KV_SETTINGS,
    SETTLE_STEPS,
    apply_switch_interval,
    build_llm,
    child_main,
    engine_log_facts,
    model_config,
    random_prompts,
    run_child,
    timed_decode_windows,
    warm_tokens,
    write_csv,
)
from vllm_snapmla.testing import write_tiny_deepseek_v3

WARM_UP_TOKENS = 32
TOP_KERNELS = 12
GROUP_NAMES = group_names()

CALL_FIELDS = ["run", "layers", "heads", "kv", "mode", "engine_core", "switch_interval_ms",
               "batch", "prompt_len", "output_len", "max_model_len", "call", "seconds",
               "output_tokens", "tok_s", "backend", "start_s", "error"]
KERNEL_FIELDS = ["layers", "kv", "kernel", "group", "us_per_step", "launches_per_step"]
HOST_FIELDS = ["layers", "kv", "op", "waits", "us_per_step", "calls_per_step"]
TOP_HOST_OPS = 12


def summarize(rows: list[dict]) -> list[dict]:
    """Per (layers, kv): calls, median / lowest / highest tok/s, and the median over the
    median of ``auto`` with the same layers (None without one)."""
    groups: dict[tuple, list[float]] = {}
    for row in rows:
        if not row.get("error"):
            groups.setdefault((int(row["layers"]), row["kv"]), []).append(float(row["tok_s"]))
    medians = {key: statistics.median(v) for key, v in groups.items()}
    summary = []
    for (layers, kv), values in groups.items():
        base = medians.get((layers, BASELINE_KV))
        summary.append({"layers": layers, "kv": kv, "calls": len(values),
                        "median": medians[(layers, kv)], "low": min(values),
                        "high": max(values),
                        "vs_auto": medians[(layers, kv)] / base if base else None})
    return summary


# --- outputs ------------------------------------------------------------------------------------

def format_report(header: str, rows: list[dict], profiles: dict, failures: list[str]) -> str:
    lines = [header, "", "| layers | kv | calls | median tok/s | lowest | highest | vs auto |",
             "|---|---|---|---|---|---|---|"]
    for s in summarize(rows):
        ratio = f"{s['vs_auto']:.2f}x" if s["vs_auto"] else "-"
        lines.append(f"| {s['layers']} | {s['kv']} | {s['calls']} | {s['median']:,.0f} | "
                     f"{s['low']:,.0f} | {s['high']:,.0f} | {ratio} |")
    if profiles:
        lines += ["", "GPU time per decode step (µs; the profiled decode steps, not timed):", "",
                  "| layers | kv | wall | GPU busy | " + " | ".join(GROUP_NAMES) + " |",
                  "|---|---|---|---|" + "---|" * len(GROUP_NAMES)]
        for (layers, kv), p in profiles.items():
            groups = " | ".join(f"{p['groups_us'][g]:,.1f}" for g in GROUP_NAMES)
            lines.append(f"| {layers} | {kv} | {p['wall_us']:,.1f} | {p['busy_us']:,.1f} | "
                         f"{groups} |")
        for (layers, kv), p in profiles.items():
            lines += ["", f"{layers} layers, {kv}: largest kernels per decode step", "",
                      "| µs | launches | group | kernel |", "|---|---|---|---|"]
            for name, us, launches in p["kernels"][:TOP_KERNELS]:
                lines.append(f"| {us:,.1f} | {launches:.1f} | {kernel_group(name)} | "
                             f"`{name[:90]}` |")
        hosts = {key: p for key, p in profiles.items() if p.get("host")}
        if hosts:
            lines += ["", "Host side of a decode step (µs per step on the host in the ops and "
                      "CUDA runtime calls the profiler saw, each without its children, time "
                      "blocked in waits included; waits: synchronizations and synchronous "
                      "copies):", "",
                      "| layers | kv | wall | host µs in ops | waits per step | µs in waits |",
                      "|---|---|---|---|---|---|"]
            for (layers, kv), p in hosts.items():
                lines.append(f"| {layers} | {kv} | {p['wall_us']:,.1f} | {p['host_us']:,.1f} | "
                             f"{p['waits_per_step']:.1f} | {p['waits_us']:,.1f} |")
            for (layers, kv), p in hosts.items():
                lines += ["", f"{layers} layers, {kv}: host ops with the most CPU time per "
                          "decode step", "", "| µs | calls | op |", "|---|---|---|"]
                for name, us, calls in p["host"][:TOP_HOST_OPS]:
                    wait = " (wait)" if host_wait(name) else ""
                    lines.append(f"| {us:,.1f} | {calls:.1f} | `{name[:90]}`{wait} |")
    if failures:
        lines += ["", "Failed engines:", ""] + [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], profiles: dict, path: Path) -> bool:
    """tok/s of every timed call per (layers, kv) and, with profiles, GPU time per decode step
    by group.  Returns False (and writes nothing) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r.get("error")]
    keys = sorted({(int(r["layers"]), r["kv"]) for r in ok},
                  key=lambda k: (k[0], k[1] != BASELINE_KV, k[1]))
    fig, axes = plt.subplots(1, 2 if profiles else 1, figsize=(12 if profiles else 6.5, 4.5),
                             squeeze=False)
    ax = axes[0][0]
    for i, key in enumerate(keys):
        values = [float(r["tok_s"]) for r in ok if (int(r["layers"]), r["kv"]) == key]
        ax.plot([i] * len(values), values, "o", alpha=0.7)
        ax.plot([i - 0.25, i + 0.25], [statistics.median(values)] * 2, "k-")
    ax.set_xticks(range(len(keys)), [f"{layers} layers\n{kv}" for layers, kv in keys],
                  fontsize=8)
    ax.set_ylabel("output tok/s per generate call")
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title("LLM.generate (dots: calls, bar: median)")
    if profiles:
        ax = axes[0][1]
        pkeys = list(profiles)
        bottom = [0.0] * len(pkeys)
        for group in GROUP_NAMES:
            heights = [profiles[k]["groups_us"][group] for k in pkeys]
            ax.bar(range(len(pkeys)), heights, bottom=bottom, label=group)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.plot(range(len(pkeys)), [profiles[k]["wall_us"] for k in pkeys], "k_",
                markersize=30, label="step wall time")
        ax.set_xticks(range(len(pkeys)), [f"{layers} layers\n{kv}" for layers, kv in pkeys],
                      fontsize=8)
        ax.set_ylabel("µs per decode step")
        ax.set_ylim(top=1.2 * max(profiles[k]["wall_us"] for k in pkeys))
        ax.set_title("GPU time per decode step (profiled decode steps)")
        ax.legend(fontsize=8, loc="upper center", ncols=4)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(out: Path, header: str, rows: list[dict], profiles: dict,
                  failures: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_csv([{**r, "run": 1} for r in rows], out / "generate.csv", CALL_FIELDS,
              comments=[f"run 1: {header}"])
    if profiles:
        kernel_rows = [{"layers": layers, "kv": kv, "kernel": name, "group": kernel_group(name),
                        "us_per_step": round(us, 3), "launches_per_step": round(launches, 3)}
                       for (layers, kv), p in profiles.items() for name, us, launches in
                       p["kernels"]]
        write_csv(kernel_rows, out / "kernels.csv", KERNEL_FIELDS, comments=[header])
        host_rows = [{"layers": layers, "kv": kv, "op": name, "waits": int(host_wait(name)),
                      "us_per_step": round(us, 3), "calls_per_step": round(calls, 3)}
                     for (layers, kv), p in profiles.items() for name, us, calls in
                     p.get("host", [])]
        if host_rows:
            write_csv(host_rows, out / "host.csv", HOST_FIELDS, comments=[header])
    (out / "generate.md").write_text(format_report(header, rows, profiles, failures))
    plot(rows, profiles, out / "generate.png")


# --- one engine in a child process --------------------------------------------------------------

def profile_tokens(steps: int, prefill_tokens: int = 0) -> int:
    """Tokens a request generates in ``profile_decode_steps``: ``prefill_tokens`` while the
    batch's chunked prefill runs (``warm_tokens``; the first requests decode meanwhile), the
    settling steps, one untimed window step, the profiled steps, and one more so that none
    finishes inside them."""
    return max(prefill_tokens, 1) + SETTLE_STEPS + 1 + steps + 1


def profile_decode_steps(engine, prompts: list, steps: int, prefill_tokens: int) -> dict:
    """Per step of ``steps`` engine steps of ``engine`` (vLLM's ``LLMEngine``, its engine core in
    this process) in which every request of ``prompts`` decodes: the requests are added, stepped
    until each has its first token and SETTLE_STEPS (and one) steps more, then the profiled
    steps run (``step_profile.window_profile``), and the requests are aborted.  Each request may
    generate ``profile_tokens(steps, prefill_tokens)`` tokens.  Raises ``RuntimeError`` where
    the profiled steps were not all decode steps of the whole batch (a prefill longer than
    ``prefill_tokens`` steps, or requests pre-empted for lack of KV cache)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=profile_tokens(steps, prefill_tokens), ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    profile: dict = {}
    gained: list[int] = []

    def window(step, tokens: dict) -> None:
        before = dict(tokens)
        profile.update(window_profile(profiled(lambda: [step() for _ in range(steps)]), steps))
        gained.extend(tokens[r] - before[r] for r in before)

    _, _, prefill_steps, _ = timed_decode_windows(engine, prompts, params, 1, 1,
                                                  id_prefix="profile", after_windows=window)
    if prefill_steps > prefill_tokens or set(gained) != {steps}:
        raise RuntimeError(
            f"the {steps} profiled steps were not all decode steps of the whole batch (prefill "
            f"took {prefill_steps} steps, {prefill_tokens} allowed; tokens per request in the "
            f"window: {min(gained, default=0)}-{max(gained, default=0)}): a larger "
            "--kv-cache-gib or a smaller --batch")
    return profile


def run_engine(spec: dict):
    """Yields ``{"kind": "engine"}`` once the engine is up and warm, a ``{"kind": "call"}``
    per timed call and, with ``spec["profile"]``, one ``{"kind": "profile"}``."""
    os.environ.update(spec.get("env") or {})
    switch_interval = spec.get("switch_interval_s")
    if switch_interval:
        # apply_switch_interval sends a function to the engine core.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    import torch
    from vllm import SamplingParams

    started = time.monotonic()
    batch, prompt_len, vocab = spec["batch"], spec["prompt_len"], spec["vocab"]
    llm = build_llm(spec["model"], spec["kv"], spec["max_model_len"], spec["kv_cache_gib"],
                    batch, enforce_eager=bool(spec.get("enforce_eager")))
    if spec.get("profile"):   # before the warm-up and the timed calls, which it would waste
        steps = spec["profile_steps"]
        config = llm.llm_engine.vllm_config
        prefill = warm_tokens(batch, prompt_len, config.scheduler_config.max_num_batched_tokens)
        needed = prompt_len + profile_tokens(steps, prefill)
        if needed > config.model_config.max_model_len:
            raise ValueError(f"--profile: {prompt_len} prompt tokens + {needed - prompt_len} "
                             f"generated while the batch's prefill runs and {steps} steps are "
                             f"profiled is more than --max-model-len "
                             f"{config.model_config.max_model_len}")
    if switch_interval:
        apply_switch_interval(llm, switch_interval)
    generator = torch.Generator().manual_seed(0)
    llm.generate(random_prompts(generator, batch, prompt_len, vocab),
                 SamplingParams(max_tokens=WARM_UP_TOKENS, ignore_eos=True), use_tqdm=False)
    yield {"kind": "engine", "start_s": round(time.monotonic() - started, 1)}
    params = SamplingParams(max_tokens=spec["output_len"], ignore_eos=True)
    for call in range(1, spec["calls"] + 1):
        prompts = random_prompts(generator, batch, prompt_len, vocab)
        torch.cuda.synchronize()
        call_started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - call_started
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        yield {"kind": "call", "call": call, "seconds": round(seconds, 4),
               "output_tokens": tokens, "tok_s": round(tokens / seconds, 1)}
    if spec.get("profile"):
        profile = profile_decode_steps(llm.llm_engine,
                                       random_prompts(generator, batch, prompt_len, vocab),
                                       steps, prefill)
        yield {"kind": "profile", **profile}


def child_command() -> list[str]:
    return [sys.executable, "-m", "benchmarks.bench_generate", "--child"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/bench_generate")
    parser.add_argument("--kv", nargs="+", default=["auto", "fp8_snapmla"], choices=KV_SETTINGS)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--heads", type=int, default=16, help="16: one TP8 rank of DeepSeek-V3.1")
    parser.add_argument("--batch", type=int, default=64, help="requests per generate call")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--calls", type=int, default=3, help="timed calls per engine")
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="enforce_eager=True: no torch.compile and no CUDA graphs")
    parser.add_argument("--in-process", action="store_true",
                        help="engine core in the engine's process (VLLM_ENABLE_V1_"
                             "MULTIPROCESSING=0), not vLLM's default separate process")
    parser.add_argument("--profile", action="store_true",
                        help="GPU time per decode step by kernel, and its host side (needs "
                             "--in-process)")
    parser.add_argument("--profile-steps", type=int, default=256)
    parser.add_argument("--switch-interval", type=float, metavar="MS",
                        help="Python's GIL switch interval in the engine core's process, in ms "
                             "(Python's default is 5)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per engine")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(run_engine)
        return
    for name in ("layers", "batch", "prompt_len", "output_len", "calls", "profile_steps"):
        values = getattr(args, name)
        if min(values if isinstance(values, list) else [values]) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.profile and not args.in_process:
        parser.error("--profile needs --in-process: with vLLM's separate engine-core process "
                     "the kernels run where the profiler does not see them")
    if args.switch_interval is not None:
        problem = switch_interval_arg_problem(args.switch_interval)
        if problem:
            parser.error(problem)
    if args.prompt_len + args.output_len > args.max_model_len:
        parser.error(f"--prompt-len + --output-len ({args.prompt_len + args.output_len}) is "
                     f"more than --max-model-len {args.max_model_len}")
    # At least this (the engine adds the tokens generated while the batch's prefill runs).
    profile_len = args.prompt_len + profile_tokens(args.profile_steps)
    if args.profile and profile_len > args.max_model_len:
        parser.error(f"--profile: --prompt-len + the profiled steps and those before them "
                     f"({profile_len}) is more than --max-model-len {args.max_model_len}")

    out = Path(args.out)
    header = describe(run_info("benchmarks.bench_generate", argv))
    engine_core = "in-process" if args.in_process else "separate"
    mode = "eager" if args.enforce_eager else "graph"
    engines = [(layers, kv) for layers in args.layers for kv in args.kv]
    print(f"{len(engines)} engines, {args.calls} timed calls each of {args.batch} x "
          f"({args.prompt_len} + {args.output_len}) tokens, {args.heads} heads, {mode} mode, "
          f"engine core {engine_core}"
          + (f", GIL switch interval {args.switch_interval:g} ms" if args.switch_interval else "")
          + f"; results in {out}", flush=True)
    rows, profiles, failures = [], {}, []
    with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
        for i, (layers, kv) in enumerate(engines, 1):
            model = model_config(args.heads)
            model.update(num_hidden_layers=layers, first_k_dense_replace=layers)
            path = write_tiny_deepseek_v3(Path(tmp) / f"l{layers}-{kv}", **model)
            spec = {"model": str(path), "kv": kv, "batch": args.batch,
                    "prompt_len": args.prompt_len, "output_len": args.output_len,
                    "calls": args.calls, "max_model_len": args.max_model_len,
                    "kv_cache_gib": args.kv_cache_gib, "enforce_eager": args.enforce_eager,
                    "profile": args.profile,
                    "profile_steps": args.profile_steps,
                    "vocab": DEEPSEEK_V31_ATTENTION["vocab_size"],
                    "switch_interval_s": (args.switch_interval / 1000
                                          if args.switch_interval else None),
                    "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if args.in_process else "1"}}
            prefix = f"[{i}/{len(engines)}] {layers} layers, {kv}"
            print(f"{prefix}: starting", flush=True)

            def progress(result, prefix=prefix):
                if result["kind"] == "engine":
                    print(f"{prefix}: up in {result['start_s']} s", flush=True)
                elif result["kind"] == "call":
                    print(f"{prefix}: call {result['call']}: {result['tok_s']:,.0f} tok/s",
                          flush=True)

            results, log, failure = run_child(child_command(), spec, args.timeout, progress)
            facts = engine_log_facts(log)
            start_s = next((r["start_s"] for r in results if r["kind"] == "engine"), "")
            base = {"layers": layers, "heads": args.heads, "kv": kv, "mode": mode,
                    "engine_core": engine_core,
                    "switch_interval_ms": (f"{args.switch_interval:g}"
                                           if args.switch_interval else ""),
                    "batch": args.batch, "prompt_len": args.prompt_len,
                    "output_len": args.output_len, "max_model_len": args.max_model_len,
                    "backend": facts["backend"], "start_s": start_s}
            rows += [{**base, **{k: r[k] for k in ("call", "seconds", "output_tokens",
                                                    "tok_s")}}
                     for r in results if r["kind"] == "call"]
            for r in results:
                if r["kind"] == "profile":
                    profiles[(layers, kv)] = r
            if failure:
                failures.append(f"{layers} layers, {kv}: {failure}")
                rows.append({**base, "error": failure})
                print(f"{prefix}: FAILED: {failure}", flush=True)
    write_outputs(out, header, rows, profiles, failures)
    print((out / "generate.md").read_text())
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
