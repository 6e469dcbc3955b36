"""Run test functions inside a vLLM process that believes it is on CUDA, on a GPU-less machine.

vLLM's CUDA platform module (needed for backend selection, ``vllm serve``'s parser and the
config checks) cannot be imported without the driver library: ``vllm._C_stable_libtorch``
links ``libcuda.so.1``.  An empty library of that name, found through ``LD_LIBRARY_PATH``
(which only works if set before the process starts, hence the subprocess) and loaded with
lazy binding, lets it import; nothing that launches a kernel can run.

``VllmCpuProcess.call(fn, **kwargs)`` runs the module-level function ``fn`` (from a test
module) in that process and returns its JSON-serialisable result, or raises
``RemoteError`` carrying the remote exception's type and message.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import traceback

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


class RemoteError(Exception):
    def __init__(self, exc_type: str, message: str, remote_traceback: str):
        super().__init__(f"{exc_type}: {message}\n--- remote traceback ---\n{remote_traceback}")
        self.exc_type = exc_type
        self.message = message


def _build_libcuda_stub(directory: pathlib.Path) -> None:
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("needs a C compiler to build an empty libcuda.so.1 stub")
    source = directory / "empty.c"
    source.write_text("/* intentionally empty: stands in for the CUDA driver library */\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                    str(directory / "libcuda.so.1"), str(source)], check=True)


class VllmCpuProcess:
    """One long-lived child process with vLLM imported on a fake CUDA platform."""

    def __init__(self, register: bool = True, extra_env: dict | None = None):
        self._tmp = pathlib.Path(tempfile.mkdtemp(prefix="snapmla-vllm-cpu-"))
        _build_libcuda_stub(self._tmp)
        env = {**os.environ, "HF_HUB_OFFLINE": "1",
               # no entry-point plugins unless asked: tests call register() themselves
               "VLLM_PLUGINS": "", **(extra_env or {})}
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(self._tmp)] + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
        env["TMPDIR"] = str(self._tmp)    # model dirs the tests write go away with the process
        self._log = self._tmp / "vllm.log"
        with open(self._log, "w") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tests.unit._vllm_cpu", "--serve"] +
                (["--register"] if register else []),
                cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=log, text=True)
        if not self._proc.stdout.readline().startswith("ready"):
            raise RuntimeError(f"vLLM CPU helper failed to start:\n{self._close_with_log()}")

    def call(self, fn, **kwargs):
        request = {"file": fn.__code__.co_filename, "name": fn.__name__, "kwargs": kwargs}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM CPU helper died:\n{self._close_with_log()}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise RemoteError(reply["type"], reply["message"], reply["traceback"])
        return reply["value"]

    def _close_with_log(self) -> str:
        self._proc.wait(timeout=30)
        tail = self._log.read_text()[-4000:]
        self.close()
        return f"exit {self._proc.returncode}; its log ends:\n{tail}"

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._tmp, ignore_errors=True)


_shared: VllmCpuProcess | None = None


def shared_process() -> VllmCpuProcess:
    """The process all tests share (plugin registered); closed at interpreter exit."""
    global _shared
    if _shared is None:
        _shared = VllmCpuProcess()
        atexit.register(_shared.close)
    return _shared


# --- helpers for the functions that run in the child ------------------------------------------

_capability = (9, 0)   # what the fake GPU reports (an H200) unless a test says otherwise


def _fake_device_capability(cls, device_id=0):
    from vllm.platforms.interface import DeviceCapability

    return DeviceCapability(*_capability)


@contextlib.contextmanager
def device_capability(major: int, minor: int):
    """Make the fake CUDA platform report this GPU compute capability."""
    global _capability
    saved, _capability = _capability, (major, minor)
    try:
        yield
    finally:
        _capability = saved


def tiny_model(**overrides) -> str:
    """A fresh directory holding the tiny DeepSeek-V3 config (config only, no weights)."""
    from vllm_snapmla.testing import write_tiny_deepseek_v3

    return str(write_tiny_deepseek_v3(tempfile.mkdtemp(prefix="snapmla-tiny-"), **overrides))


def engine_config(model: str, capability=(9, 0), **engine_kwargs):
    """``EngineArgs(...).create_engine_config()`` as ``LLM``/``vllm serve`` run it at start-up."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs = dict(load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
                  max_model_len=1024)
    kwargs.update(engine_kwargs)
    with device_capability(*capability):
        return EngineArgs(model=model, **kwargs).create_engine_config()


# --- the child side --------------------------------------------------------------------------

def _load_function(file: str, name: str, cache: dict):
    if file not in cache:
        spec = importlib.util.spec_from_file_location(f"_remote_{len(cache)}", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cache[file] = module
    return getattr(cache[file], name)


def _serve(register: bool) -> None:
    # Replies go to the original stdout; everything vLLM prints goes to stderr.
    reply_stream = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    sys.setdlopenflags(os.RTLD_LAZY | os.RTLD_GLOBAL)
    import vllm.platforms
    from vllm.platforms.cuda import CudaPlatform

    vllm.platforms._current_platform = CudaPlatform()
    # vLLM asks for the capability at import time in places; torch cannot answer without a GPU.
    CudaPlatform.get_device_capability = classmethod(_fake_device_capability)
    if register:
        import vllm_snapmla

        vllm_snapmla.register()
    reply_stream.write("ready\n")
    reply_stream.flush()

    modules: dict = {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            value = _load_function(request["file"], request["name"], modules)(
                **request["kwargs"])
            reply = {"ok": True, "value": value}
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the test
            reply = {"ok": False, "type": type(e).__name__, "message": str(e),
                     "traceback": traceback.format_exc()}
        reply_stream.write(json.dumps(reply) + "\n")
        reply_stream.flush()


if __name__ == "__main__":
    # Serve from the importable module, so the helpers the test functions import share its state.
    from tests.unit import _vllm_cpu

    _vllm_cpu._serve(register="--register" in sys.argv)


# An n-gram speculative config (no drafter model), as the spec-decode configuration tests use it.
SPEC_NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4,
              "prompt_lookup_min": 2}
