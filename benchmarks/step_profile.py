"""Where an engine step's time goes: torch's profiler around engine work, and the arithmetic that
turns what it saw into time per step by kernel, by group of kernels, and on the host.

Shared by ``bench_generate --profile``, ``bench_e2e`` and ``bench_deployment --profile-steps``:
each profiles a window of engine steps in which every request decodes.  The
profiler sees kernels only in its own process, so the engine core must run there
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import time

from benchmarks.vllm_engine import kernel_totals

# Kernel groups, by what a kernel's name contains (lower case), tried in this order: FA3's
# kernels are CUTLASS device kernels, so attention comes before the GEMMs.
GROUPS = (("attention", ("snapmla", "flash", "mla")),
          ("GEMMs", ("nvjet", "gemm", "cutlass", "cublas", "splitkreduce", "xmma", "matmul")))
# With MoE layers: their routing, token sorting and grouped GEMMs (DeepGEMM's names contain
# "gemm", hence before the GEMMs).
MOE_GROUPS = (GROUPS[0],
              ("MoE", ("moe", "expert", "grouped", "topk")),
              GROUPS[1])
OTHER = "other"
# CUDA runtime calls that make the host wait for the GPU: the synchronizations and the plain
# (synchronous) copies.  Counted per step apart from the rest: in an eager step each one stops
# the CPU from running ahead.  cudaMemcpyAsync is not one of them (vLLM copies its inputs from
# pinned memory with it every step); a blocking ``.item()`` shows as a copy and a
# synchronization, and counts once.
WAIT_CALLS = ("cudaMemcpy", "cudaMemcpy2D", "cudaMemcpyPeer")


def group_names(groups=GROUPS) -> list[str]:
    return [group for group, _ in groups] + [OTHER]


def kernel_group(name: str, groups=GROUPS) -> str:
    lower = name.lower()
    for group, marks in groups:
        if any(mark in lower for mark in marks):
            return group
    return OTHER


def host_wait(name: str) -> bool:
    """A CUDA runtime call that makes the host wait for the GPU: a ``cuda*Synchronize`` or one
    of ``WAIT_CALLS``."""
    return name.startswith("cuda") and (name.endswith("Synchronize") or name in WAIT_CALLS)


def busy_us(spans) -> float:
    """Length of the union of ``(start, end)`` intervals: the time at least one ran."""
    total, current = 0.0, None
    for start, end in sorted(spans):
        if current is None or start > current[1]:
            if current is not None:
                total += current[1] - current[0]
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    return total + (current[1] - current[0] if current is not None else 0.0)


def profiled(work) -> tuple[float, list, list]:
    """Run ``work()`` under torch's profiler (CPU and CUDA), the GPU idle before and after: its
    wall µs, ``(name, start µs, end µs)`` of every kernel and ``(name, own CPU µs)`` of every
    host op and CUDA runtime call (children excluded)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        started = time.perf_counter()
        work()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - started) * 1e6
    events = prof.events()
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in events
               if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    host = [(e.name, e.self_cpu_time_total) for e in events
            if e.device_type == DeviceType.CPU and not e.is_user_annotation]
    return wall_us, kernels, host


def per_step(entries: list, steps: int) -> list[tuple[str, float, float]]:
    """``(name, µs, count)`` per step of ``(name, µs)`` entries (kernel launches or host calls)
    seen over ``steps`` steps, largest first."""
    rows = [(name, us / steps, count / steps)
            for name, (us, count) in kernel_totals(entries).items()]
    rows.sort(key=lambda r: -r[1])
    return rows


def step_summary(steps: int, wall_us: float, busy_us: float, kernels: list, host: list,
                 groups=GROUPS) -> dict:
    """The per-step profile both benchmarks report, from its per-step figures: ``kernels`` and
    ``host`` as ``per_step`` gives them (largest first); adds µs by kernel group, the host's
    total and its waits for the GPU counted apart."""
    groups_us = dict.fromkeys(group_names(groups), 0.0)
    for name, us, _ in kernels:
        groups_us[kernel_group(name, groups)] += us
    waits = [h for h in host if host_wait(h[0])]
    return {"steps": steps, "wall_us": wall_us, "busy_us": busy_us, "groups_us": groups_us,
            "kernels": kernels, "host": host, "host_us": sum(us for _, us, _ in host),
            "waits_per_step": sum(count for _, _, count in waits),
            "waits_us": sum(us for _, us, _ in waits)}


def window_profile(measured: tuple[float, list, list], steps: int, groups=GROUPS) -> dict:
    """Per step of a profiled window of ``steps`` engine steps (``profiled``'s result), every
    one a decode step (``step_summary``)."""
    wall_us, kernels, host = measured
    return step_summary(steps, wall_us / steps, busy_us(k[1:] for k in kernels) / steps,
                        per_step([(name, end - start) for name, start, end in kernels], steps),
                        per_step(host, steps), groups)
