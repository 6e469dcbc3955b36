"""Code shared by the evaluation scripts.

- ``script_command`` / ``script_env``: start another of these scripts in a child process;
- ``parse_kv_pairs``: the ``key=value,...`` options (``--model-args``, ``--gen-kwargs``);
- ``tiny_engine_settings``: the vLLM engine settings of both tiny-model parity harnesses for a
  setting name (a KV-cache dtype or ``fp8-calibrated``)
  (``eval.parity_tiny`` calls vLLM directly, ``eval.lm_eval_tiny`` through lm-eval), so that
  their numbers describe the same engine;
- ``paired_delta`` / ``paired_text``: per-token differences of two runs with a paired standard
  error;
- ``mean_se_cell`` / ``markdown_cell``: Markdown table cells of the reports.
"""

from __future__ import annotations

import hashlib
import math
import os
import pathlib
import sys

import numpy as np

# The directory holding the ``eval`` package (the repository root).
_PACKAGE_PARENT = pathlib.Path(__file__).resolve().parent.parent


# --- child processes ------------------------------------------------------------------------

def script_command(module: str, *args: str) -> list[str]:
    """``python -m <module> ARGS`` with this interpreter, e.g. ``script_command("eval.parity")``."""
    return [sys.executable, "-m", module, *args]


def script_env(base: dict | None = None) -> dict:
    """``base`` (default: this environment) with the repository root first on ``PYTHONPATH``.

    A child started with ``script_command`` then imports this tree's ``eval`` package whatever
    its working directory (the child keeps the parent's, so relative paths in its arguments
    still mean what they meant to the parent).
    """
    env = dict(os.environ if base is None else base)
    paths = [str(_PACKAGE_PARENT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                      if p and p != str(_PACKAGE_PARENT)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


# --- options --------------------------------------------------------------------------------

def parse_kv_pairs(text: str | None) -> dict:
    """``"a=1,b=x"`` -> ``{"a": 1, "b": "x"}`` (ints, floats and booleans converted)."""
    out = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"expected key=value, got {item!r}")
        out[key.strip()] = _convert(value.strip())
    return out


def _convert(value: str):
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


# --- the tiny model's engine ----------------------------------------------------------------

# Setting names beyond the plain KV-cache dtypes: vLLM's fp8 cache with scales computed from the
# first batch (``calculate_kv_scales``; for MLA vLLM derives k_scale from the content latent
# alone, so the RoPE key does not enter it).
EXTRA_SETTINGS = {"fp8-calibrated": {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}}


def tiny_engine_settings(setting: str, chunk: int, max_model_len: int,
                         gpu_memory_utilization: float = 0.5) -> dict:
    """vLLM engine arguments of a tiny-model parity run (everything but the model) for a setting
    name: a KV-cache dtype or an ``EXTRA_SETTINGS`` key.

    Prefill runs in chunks of at most ``chunk`` tokens (``max_num_batched_tokens``) and prefix
    caching is off, so every token past the first chunk attends to earlier context through
    the KV cache under test rather than through fresh BF16 latents.  The tiny model needs
    little memory: a smaller ``gpu_memory_utilization`` lets several runs share one GPU.
    """
    return dict(dtype="bfloat16", enforce_eager=True, seed=0,
                max_model_len=max_model_len, enable_chunked_prefill=True,
                max_num_batched_tokens=chunk, max_num_seqs=min(64, chunk),
                enable_prefix_caching=False, gpu_memory_utilization=gpu_memory_utilization,
                **EXTRA_SETTINGS.get(setting, {"kv_cache_dtype": setting}))


# --- paired statistics ----------------------------------------------------------------------

def paired_delta(diffs, tokens) -> tuple[float, float]:
    """Per-token mean of a paired difference summed per document, and its standard error.

    ``diffs[i]`` is document ``i``'s difference between two runs summed over its ``tokens[i]``
    tokens (e.g. one run's negative log-likelihood minus another's).  The mean is
    Σ diffs / Σ tokens, every token weighing the same.  Neighbouring tokens' differences are
    correlated, so the documents, not the tokens, are the independent units: the standard
    error is the ratio estimator's (delta method),
    ``sqrt(m / (m - 1) * Σ_i (diffs_i - mean * tokens_i)²) / Σ tokens`` over ``m`` documents,
    i.e. the standard error of the mean over documents when they are all of one length.  NaN
    for fewer than two documents.
    """
    d, n = np.asarray(diffs, dtype=float), np.asarray(tokens, dtype=float)
    mean = float(d.sum() / n.sum())
    m = len(d)
    if m < 2:
        return mean, math.nan
    return mean, math.sqrt(m / (m - 1) * float(((d - mean * n) ** 2).sum())) / float(n.sum())


def paired_text(mean: float, se: float, units: int, unit_name: str) -> str:
    """``mean ± se nats, z paired SE over N units`` for a verdict line."""
    z = f"{abs(mean) / se:.1f}" if se > 0 else "n/a"
    return f"{mean:+.2e} ± {se:.1e} nats, {z} paired SE over {units} {unit_name}"


# --- report tables --------------------------------------------------------------------------

def mean_se_cell(key: str):
    """A Markdown cell ``mean ± standard error`` of ``key`` and ``key + '_se'``."""
    return lambda row: f"{row[key]:+.2e} ± {row[key + '_se']:.1e}"


def markdown_cell(row: dict, key: str, fmt) -> str:
    """``row[key]`` formatted by ``fmt`` (a format string, or a function of the row); "–" when
    the value is missing."""
    value = row.get(key)
    if value in (None, ""):
        return "–"
    return fmt(row) if callable(fmt) else fmt.format(value)


def checkpoint_fingerprint(model_dir) -> str:
    """A short digest of a checkpoint folder's files (names, sizes, modification times): a
    saved result is reused only for the checkpoint it was computed on (a retrained model in the
    same folder gets new numbers)."""
    digest = hashlib.sha256()
    for f in sorted(p for p in pathlib.Path(model_dir).iterdir() if p.is_file()):
        stat = f.stat()
        digest.update(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]
