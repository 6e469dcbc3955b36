"""Benchmark parity of KV-cache settings with lm-eval (the paper's Table 1 and Table 2).

One command evaluates a model under each ``--kv`` setting (``auto`` = BF16 cache, ``fp8_snapmla``,
optionally vLLM's ``fp8``) and writes ``parity.md`` / ``parity.csv``: the score of every task per
setting, its delta against ``auto``, the mean number of generated tokens per setting, and the
share of generations cut off at the token limit.

Each setting runs in its own subprocess (a fresh vLLM engine and GPU memory) through lm-eval's
``vllm`` model with ``kv_cache_dtype`` passed as an engine argument; our plugin is loaded by vLLM
through its entry point, in the engine's workers too.  Generated lengths are counted from the
token ids vLLM returns (they include the reasoning trace); outputs that lack that record (e.g. a
plain ``lm_eval`` run) fall back to re-tokenizing the responses in lm-eval's samples files.  A
generation vLLM stopped for length (``finish_reason == "length"``: ``max_gen_toks`` or the model
length) is scored as it stands, usually wrong; the table gives their share per setting, since a
setting that thinks longer loses points to the limit, not to its accuracy.

    python -m eval.parity --model deepseek-ai/DeepSeek-V3.1 --tp 8 --out runs/parity
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from eval.common import parse_kv_pairs, script_command, script_env
from eval.tasks import NOT_IN_LM_EVAL, TASKS, ParityTask, write_overlays

DEFAULT_KV_SETTINGS = ("auto", "fp8_snapmla")
BASELINE = "auto"
# The paper does not state its sampling setup; these are DeepSeek-V3.1's recommended settings
# for reasoning, with room for long reasoning traces (paper Table 2 reaches tens of thousands).
REASONING_GEN_KWARGS = {"do_sample": True, "temperature": 0.6, "top_p": 0.95,
                        "max_gen_toks": 32768}
DEFAULT_MAX_MODEL_LEN = 40960
THINK_END_TOKEN = "</think>"   # DeepSeek-V3.1's end of the reasoning trace
LENGTHS_FILE = "gen_lengths.json"
CUT_FILE = "gen_cut.json"       # per task, per generation: stopped at the token limit
RESULTS_FILE = "results.json"


def model_args(model: str, kv_cache_dtype: str, tp: int = 1, dp: int = 1,
               max_model_len: int = DEFAULT_MAX_MODEL_LEN, extra: dict | None = None,
               chat_template_args: dict | None = None) -> dict:
    """lm-eval ``vllm`` model arguments for one KV setting; ``extra`` overrides anything."""
    args = {"pretrained": model, "kv_cache_dtype": kv_cache_dtype,
            "tensor_parallel_size": tp, "data_parallel_size": dp,
            "max_model_len": max_model_len, "dtype": "auto", "trust_remote_code": True}
    if chat_template_args:
        args["chat_template_args"] = dict(chat_template_args)
        if chat_template_args.get("thinking") or chat_template_args.get("enable_thinking"):
            # lm-eval scores the text after this marker; without it the answer extraction
            # would read the reasoning trace (the first "(A)" there, say).
            args["think_end_token"] = THINK_END_TOKEN
    args.update(extra or {})
    return args


def format_model_args(args: dict) -> str:
    """``key=value,...`` as lm-eval's ``--gen_kwargs`` (and this script's options) take it."""
    for key, value in args.items():
        if "," in str(value) or "=" in str(value):
            raise ValueError(f"model arg {key}={value!r} cannot be written as key=value pairs")
    return ",".join(f"{k}={v}" for k, v in args.items())


def lm_eval_command(args: dict, task_names: list[str], out_dir: Path, include_path: Path,
                    gen_kwargs: dict, limit: float | None) -> list[str]:
    """The equivalent plain ``lm_eval`` command line (written next to each run for reference)."""
    cmd = ["lm_eval", "--model", "vllm", "--model_args", json.dumps(args),
           "--tasks", ",".join(TASKS[t].lm_eval_task for t in task_names),
           "--include_path", str(include_path), "--apply_chat_template",
           "--gen_kwargs", format_model_args(gen_kwargs), "--batch_size", "auto",
           "--log_samples", "--output_path", str(out_dir)]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    return cmd


def child_command(setting: str, opts: argparse.Namespace) -> list[str]:
    """The subprocess that evaluates one KV setting."""
    cmd = script_command("eval.parity", "--run-one", setting,
                         "--model", opts.model,
                         "--tasks", ",".join(opts.tasks), "--tp", str(opts.tp),
                         "--dp", str(opts.dp), "--max-model-len", str(opts.max_model_len),
                         "--out", str(opts.out), "--gen-kwargs",
                         format_model_args(opts.gen_kwargs))
    if opts.limit is not None:
        cmd += ["--limit", str(opts.limit)]
    if opts.model_args:
        cmd += ["--model-args", opts.model_args]
    if opts.chat_template_args:
        cmd += ["--chat-template-args", json.dumps(opts.chat_template_args)]
    return cmd


# ----------------------------------------------------------------------------- one setting (GPU)

def _length_recording_model(lm_args: dict):
    """lm-eval's vLLM model, also recording how many tokens each generation produced and whether
    it was stopped at the token limit."""
    from lm_eval.models.vllm_causallms import VLLM

    class LengthRecordingVLLM(VLLM):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.lengths_by_task: dict[str, list[int]] = defaultdict(list)
            self.cut_by_task: dict[str, list[bool]] = defaultdict(list)
            self._pending: list[tuple[int, bool]] = []

        def _model_generate(self, requests, generate=False, sampling_params=None):
            outputs = super()._model_generate(requests, generate, sampling_params)
            if generate:
                self._pending.extend((len(o.outputs[0].token_ids),
                                      o.outputs[0].finish_reason == "length") for o in outputs)
            return outputs

        def generate_until(self, requests, disable_tqdm=False):
            # lm-eval reports each output to the cache hook right after generating it, in the
            # order vLLM returned it; pair the counts with contexts there, then with requests.
            by_context: dict[str, list[tuple[int, bool]]] = defaultdict(list)
            hook = self.cache_hook
            original = hook.add_partial

            def add_partial(kind, key, value):
                if kind == "generate_until":
                    by_context[key[0]].append(self._pending.pop(0))
                return original(kind, key, value)

            hook.add_partial = add_partial
            try:
                results = super().generate_until(requests, disable_tqdm)
            finally:
                hook.add_partial = original
            for req in requests:
                counts = by_context.get(req.args[0])
                if counts:
                    length, cut = counts.pop()
                    self.lengths_by_task[req.task_name].append(length)
                    self.cut_by_task[req.task_name].append(cut)
            return results

    return LengthRecordingVLLM(**lm_args)


def run_one(setting: str, opts: argparse.Namespace) -> None:
    import lm_eval
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = Path(opts.out) / setting
    out.mkdir(parents=True, exist_ok=True)
    overlays = Path(opts.out) / "task_overlays"
    write_overlays(overlays, Path(lm_eval.__file__).parent / "tasks")
    args = model_args(opts.model, setting, opts.tp, opts.dp, opts.max_model_len,
                      parse_kv_pairs(opts.model_args), opts.chat_template_args)
    (out / "lm_eval_command.txt").write_text(" ".join(lm_eval_command(
        args, opts.tasks, out, overlays, opts.gen_kwargs, opts.limit)) + "\n")
    lm = _length_recording_model(args)
    results = simple_evaluate(
        model=lm, tasks=[TASKS[t].lm_eval_task for t in opts.tasks],
        task_manager=TaskManager(include_path=str(overlays)), apply_chat_template=True,
        gen_kwargs=dict(opts.gen_kwargs), limit=opts.limit, log_samples=True,
        batch_size="auto")
    if results is None:        # non-zero data-parallel rank
        return
    samples = results.pop("samples", {})
    for task, entries in samples.items():
        with open(out / f"samples_{task}.jsonl", "w") as f:
            for entry in entries:
                f.write(json.dumps(entry, default=str) + "\n")
    (out / RESULTS_FILE).write_text(json.dumps(results, indent=2, default=str))
    (out / LENGTHS_FILE).write_text(json.dumps(lm.lengths_by_task, indent=1))
    (out / CUT_FILE).write_text(json.dumps(lm.cut_by_task))


# ----------------------------------------------------------------------------- the table

def _latest(paths):
    paths = sorted(paths, key=lambda p: p.stat().st_mtime)
    return paths[-1] if paths else None


def read_results(setting_dir: Path) -> dict:
    """``{lm-eval task: {"metric,filter": value}}`` from the newest results JSON under the dir."""
    path = _latest(list(setting_dir.rglob("results*.json")))
    if path is None:
        return {}
    data = json.loads(path.read_text())
    merged = dict(data.get("groups", {}))
    merged.update(data.get("results", {}))
    return merged


def _of_task(name: str, lm_eval_task: str) -> bool:
    """``name`` is the task or, for a group task (MMLU-Pro, MMLU-Redux), one of its subtasks
    (``ParityTask.covers``)."""
    task = next((t for t in TASKS.values() if t.lm_eval_task == lm_eval_task),
                ParityTask("", lm_eval_task, "", ""))
    return task.covers(name)


_TIMESTAMP = re.compile(r"_\d{4}-\d{2}-\d{2}T[\d.\-]+$")   # lm_eval's file-name suffix


def _sample_lengths(setting_dir: Path, lm_eval_task: str, count_tokens) -> list[int]:
    by_name: dict[str, list[Path]] = defaultdict(list)     # each (sub)task's samples files
    for path in setting_dir.rglob("samples_*.jsonl"):
        name = _TIMESTAMP.sub("", path.stem[len("samples_"):])
        if _of_task(name, lm_eval_task):
            by_name[name].append(path)
    lengths = []
    for path in map(_latest, by_name.values()):
        seen = set()
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry["doc_id"] in seen:        # one entry per (doc, filter); count each doc once
                continue
            seen.add(entry["doc_id"])
            for resp in entry["resps"]:
                for text in (resp if isinstance(resp, list) else [resp]):
                    lengths.append(count_tokens(text))
    return lengths


def mean_lengths(setting_dir: Path, lm_eval_task: str, count_tokens) -> float | None:
    """Mean generated tokens of one task, over all its subtasks for a group: recorded token
    counts, else re-tokenized samples."""
    recorded = setting_dir / LENGTHS_FILE
    lengths = []
    if recorded.exists():
        lengths = [n for name, counts in json.loads(recorded.read_text()).items()
                   if _of_task(name, lm_eval_task) for n in counts]
    if not lengths and count_tokens is not None:
        lengths = _sample_lengths(setting_dir, lm_eval_task, count_tokens)
    return sum(lengths) / len(lengths) if lengths else None


def cut_percent(setting_dir: Path, lm_eval_task: str) -> float | None:
    """Percent of one task's generations (every subtask of a group) that vLLM stopped at the
    token limit; ``None`` without a record (a plain ``lm_eval`` run)."""
    recorded = setting_dir / CUT_FILE
    if not recorded.exists():
        return None
    cut = [c for name, flags in json.loads(recorded.read_text()).items()
           if _of_task(name, lm_eval_task) for c in flags]
    return 100.0 * sum(cut) / len(cut) if cut else None


def build_table(out: Path, settings: list[str], task_names: list[str],
                count_tokens=None) -> list[dict]:
    """One row per task: score per setting (percent), delta vs ``auto``, mean length and percent
    of generations cut at the token limit per setting.

    Missing results are ``None`` (a setting that crashed, a task lm-eval could not load).
    """
    rows = []
    results = {s: read_results(out / s) for s in settings}
    for name in task_names:
        task = TASKS[name]
        row = {"task": task.paper_row, "lm_eval_task": task.lm_eval_task, "metric": task.metric}
        # lm-eval's standard error of a metric "m,filter" is "m_stderr,filter" (or "N/A").
        stderr_key = task.metric.replace(",", "_stderr,", 1)
        for s in settings:
            scores = results[s].get(task.lm_eval_task, {})
            value = scores.get(task.metric)
            row[f"score[{s}]"] = None if value is None else 100.0 * float(value)
            se = scores.get(stderr_key)
            row[f"se[{s}]"] = 100.0 * se if isinstance(se, (int, float)) else None
            row[f"len[{s}]"] = mean_lengths(out / s, task.lm_eval_task, count_tokens)
            row[f"cut%[{s}]"] = cut_percent(out / s, task.lm_eval_task)
        base, base_se = row.get(f"score[{BASELINE}]"), row.get(f"se[{BASELINE}]")
        for s in settings:
            if s != BASELINE:
                score, se = row[f"score[{s}]"], row[f"se[{s}]"]
                row[f"delta[{s}]"] = (None if base is None or score is None else score - base)
                # The two runs' errors combined as if independent (the documents are shared,
                # so this overstates the noise of the difference somewhat).
                row[f"delta_se[{s}]"] = (None if row[f"delta[{s}]"] is None or se is None
                                         or base_se is None else math.hypot(se, base_se))
        rows.append(row)
    return rows


def _columns(settings: list[str]) -> list[str]:
    cols = ["task", "lm_eval_task", "metric"]
    cols += [f"score[{s}]" for s in settings]
    cols += [f"delta[{s}]" for s in settings if s != BASELINE]
    cols += [f"delta_se[{s}]" for s in settings if s != BASELINE]
    cols += [f"len[{s}]" for s in settings]
    cols += [f"cut%[{s}]" for s in settings]
    cols += [f"se[{s}]" for s in settings]
    return cols


def _cell(value, signed=False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:+.2f}" if signed else f"{value:.2f}"
    return str(value)


def write_table(rows: list[dict], settings: list[str], out: Path,
                failed: list[str] = ()) -> tuple[Path, Path]:
    """Write ``parity.csv`` and ``parity.md`` into ``out``; ``failed``: settings whose run
    failed (their columns are n/a, and the table says why)."""
    cols = _columns(settings)
    csv_path, md_path = out / "parity.csv", out / "parity.md"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: "" if row.get(c) is None else row.get(c) for c in cols})
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c), c.startswith("delta[")) for c in cols)
                     + " |")
    if failed:
        lines += ["", f"**Failed in this run, no results:** {', '.join(failed)} (see the log)."]
    lines += ["", "Scores in percent; len = mean generated tokens per sample (paper Table 2); "
              "cut% = generations stopped at the token limit (max_gen_toks or the model "
              "length), scored as they stand; "
              "se = lm-eval's standard error of the score, delta_se = both settings' combined "
              "as if independent (a difference within about 2 delta_se is noise).",
              "Not in lm-eval 0.4.13, not run: " + ", ".join(NOT_IN_LM_EVAL) + "."]
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


def _tokenizer_counter(model: str):
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
    except Exception as exc:  # noqa: BLE001  (offline machine, gated model, ...)
        print(f"[parity] no tokenizer for {model} ({exc}); lengths only from recorded counts")
        return None
    return lambda text: len(tok.encode(text, add_special_tokens=False))


# ----------------------------------------------------------------------------- CLI

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.parity",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tasks", default=",".join(TASKS),
                   help=f"comma-separated subset of {', '.join(TASKS)}")
    p.add_argument("--kv", default=",".join(DEFAULT_KV_SETTINGS),
                   help="comma-separated kv_cache_dtype settings; 'auto' is the baseline")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--dp", type=int, default=1,
                   help="data parallel size (lm-eval runs one engine per rank through Ray)")
    p.add_argument("--limit", type=float, default=None,
                   help="documents per task (int) or fraction (<1), for smoke runs")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    p.add_argument("--gen-kwargs", default=format_model_args(REASONING_GEN_KWARGS),
                   help="generation settings applied to every task (lm-eval --gen_kwargs)")
    p.add_argument("--model-args", default="",
                   help="extra lm-eval/vLLM model args, key=value,... (override the defaults)")
    p.add_argument("--chat-template-args", type=json.loads, default=None,
                   help='JSON passed to the chat template, e.g. \'{"thinking": true}\' '
                        "(DeepSeek-V3.1's thinking mode)")
    p.add_argument("--out", default="runs/parity")
    p.add_argument("--write-overlays", action="store_true",
                   help="only write the lm-eval task overlays into OUT/task_overlays (for a "
                        "plain lm_eval run, e.g. against `vllm serve`)")
    p.add_argument("--table-only", action="store_true",
                   help="rebuild the table from existing outputs without running anything")
    p.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    opts.tasks = [t for t in opts.tasks.split(",") if t]
    unknown = [t for t in opts.tasks if t not in TASKS]
    if unknown:
        p.error(f"unknown tasks {unknown}; available: {list(TASKS)} "
                f"(not in lm-eval 0.4.13: {', '.join(NOT_IN_LM_EVAL)})")
    opts.kv = [s for s in opts.kv.split(",") if s]
    if BASELINE not in opts.kv:
        p.error(f"--kv must include the baseline '{BASELINE}'")
    opts.gen_kwargs = parse_kv_pairs(opts.gen_kwargs)
    max_gen = opts.gen_kwargs.get("max_gen_toks")
    if max_gen is not None and int(max_gen) >= opts.max_model_len:
        # lm-eval would cut every prompt to nothing to make room for the generation.
        p.error(f"max_gen_toks={max_gen} leaves no room for the prompt in --max-model-len "
                f"{opts.max_model_len}")
    if opts.limit is not None and opts.limit >= 1:
        opts.limit = int(opts.limit)
    opts.out = Path(opts.out)
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.run_one:
        run_one(opts.run_one, opts)
        return 0
    opts.out.mkdir(parents=True, exist_ok=True)
    if opts.write_overlays:
        import lm_eval
        write_overlays(opts.out / "task_overlays", Path(lm_eval.__file__).parent / "tasks")
        print(opts.out / "task_overlays")
        return 0
    failed = []
    if not opts.table_only:
        env = script_env()
        for setting in opts.kv:
            print(f"[parity] kv_cache_dtype={setting}", flush=True)
            # An earlier run's results must not stand in for a run that fails now.
            shutil.rmtree(opts.out / setting, ignore_errors=True)
            if subprocess.run(child_command(setting, opts), env=env).returncode != 0:
                failed.append(setting)
    rows = build_table(opts.out, opts.kv, opts.tasks, _tokenizer_counter(opts.model))
    csv_path, md_path = write_table(rows, opts.kv, opts.out, failed)
    print(md_path.read_text())
    print(f"[parity] wrote {md_path} and {csv_path}")
    if failed:
        print(f"[parity] settings that failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
