"""register(): the entry point vLLM loads in every process, its version pin, the patches it
applies once and the start-up self-check (no GPU needed).

Functions named ``_in_vllm_*`` run inside a vLLM process on a fake CUDA platform
(``tests/unit/_vllm_cpu.py``); the tests call them through ``VllmCpuProcess.call``.
"""

import multiprocessing
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

from tests.unit._vllm_cpu import REPO_ROOT, RemoteError, VllmCpuProcess

KV = "fp8_snapmla"


def _in_vllm_patch_state():
    import typing

    import vllm._custom_ops as custom_ops
    import vllm.config.cache as cache_mod
    import vllm.v1.attention.selector as selector
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    def wrappers(fn):
        depth = 0
        while hasattr(fn, "__snapmla_wrapped__"):
            fn, depth = fn.__snapmla_wrapped__, depth + 1
        return depth

    return {
        "CacheDType": typing.get_args(cache_mod.CacheDType).count(KV),
        "selector CacheDType": typing.get_args(selector.CacheDType).count(KV),
        "page size": wrappers(MLAAttentionSpec.__dict__["real_page_size_bytes"].fget),
        "selection": wrappers(CudaPlatformBase.__dict__["get_attn_backend_cls"].__func__),
        "config check": wrappers(CudaPlatformBase.__dict__["check_and_update_config"].__func__),
        "gather": wrappers(custom_ops.gather_and_maybe_dequant_cache),
        "CUSTOM": AttentionBackendEnum.CUSTOM.get_path(),
        "torch dtype": str(STR_DTYPE_TO_TORCH_DTYPE[KV]),
    }


def _in_vllm_register_again():
    import vllm_snapmla
    from vllm_snapmla.integration.patches import prefill_gather

    prefill_gather.apply()
    before = _in_vllm_patch_state()
    vllm_snapmla.register()
    # Forget the package-level flag so every patch runs again and must notice it is in place
    # (what happens if the module is reloaded or a second copy is imported).
    vllm_snapmla._registered = False
    vllm_snapmla.register()
    vllm_snapmla.register()
    prefill_gather.apply()
    return before, _in_vllm_patch_state()


def test_register_is_idempotent(vllm_cpu):
    before, after = vllm_cpu.call(_in_vllm_register_again)
    assert before == after
    assert after == {
        "CacheDType": 1, "selector CacheDType": 1, "page size": 1, "selection": 1,
        "config check": 1, "gather": 1, "CUSTOM": "vllm_snapmla.integration.backend.SnapMLABackend",
        "torch dtype": "torch.uint8"}


def _in_vllm_self_check_without(entry):
    """Undo one patch's effect, run the start-up self-check, restore it."""
    import torch
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from vllm_snapmla.integration import patches

    page_size = MLAAttentionSpec.__dict__["real_page_size_bytes"]
    try:
        if entry == "torch dtype":
            STR_DTYPE_TO_TORCH_DTYPE[KV] = torch.float8_e4m3fn
        else:
            MLAAttentionSpec.real_page_size_bytes = property(page_size.fget.__snapmla_wrapped__)
        patches.self_check()
    finally:
        STR_DTYPE_TO_TORCH_DTYPE[KV] = torch.uint8
        MLAAttentionSpec.real_page_size_bytes = page_size
    patches.self_check()   # restored: passes


@pytest.mark.parametrize("entry", ["torch dtype", "page size"])
def test_self_check_fails_when_a_patch_did_not_take(vllm_cpu, entry):
    with pytest.raises(RemoteError) as err:
        vllm_cpu.call(_in_vllm_self_check_without, entry=entry)
    assert err.value.exc_type == "RuntimeError"
    assert "could not patch this vLLM build" in err.value.message
    assert "vllm==0.26.0" in err.value.message


def _in_vllm_register_under_version(version):
    import vllm

    import vllm_snapmla

    saved = vllm.__version__, vllm_snapmla._registered
    vllm.__version__, vllm_snapmla._registered = version, False
    try:
        vllm_snapmla.register()
    finally:
        vllm.__version__, vllm_snapmla._registered = saved


def test_register_refuses_other_vllm_versions(vllm_cpu):
    with pytest.raises(RemoteError) as err:
        vllm_cpu.call(_in_vllm_register_under_version, version="0.27.0")
    assert err.value.exc_type == "RuntimeError"
    assert "vLLM 0.27.0 is installed" in err.value.message
    assert "vllm==0.26.0" in err.value.message
    for version in ("0.26.1", "0.26.0rc1", "0.26.0.dev3"):
        with pytest.raises(RemoteError):
            vllm_cpu.call(_in_vllm_register_under_version, version=version)


def test_register_accepts_a_local_build_of_the_pinned_version(vllm_cpu):
    vllm_cpu.call(_in_vllm_register_under_version, version="0.26.0+cu130")


def test_package_import_does_not_import_vllm():
    code = ("import sys, vllm_snapmla, vllm_snapmla.ops, vllm_snapmla.demo; "
            "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if 'vllm' in m); "
            "print(vllm_snapmla.__version__)")
    from vllm_snapmla.testing import with_pythonpath

    env = with_pythonpath(os.environ, str(REPO_ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert out.stdout.strip() == project["version"]


def _in_vllm_serve_parser(kv_cache_dtype):
    import vllm.entrypoints.cli.serve as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import vllm_snapmla

    parser = FlexibleArgumentParser()
    subparsers = parser.add_subparsers(dest="subparser")
    for command in serve.cmd_init():
        command.subparser_init(subparsers)
    try:
        args = parser.parse_args(["serve", "some/model", "--kv-cache-dtype", kv_cache_dtype])
    except SystemExit:
        return {"accepted": False, "registered": vllm_snapmla._registered}
    return {"accepted": args.kv_cache_dtype == kv_cache_dtype,
            "registered": vllm_snapmla._registered}


def test_vllm_serve_parser_loads_plugin_from_entry_point(tmp_path):
    # Declare the entry point exactly as pyproject.toml does, without pip-installing.
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    assert plugins == {"snapmla": "vllm_snapmla:register"}
    info = tmp_path / f"vllm_snapmla-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm-snapmla\nVersion: {project['version']}\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\n" + "".join(f"{k} = {v}\n" for k, v in plugins.items()))
    process = VllmCpuProcess(register=False, extra_env={"VLLM_PLUGINS": "snapmla",
                                                        "PYTHONPATH": str(tmp_path)})
    try:
        accepted = process.call(_in_vllm_serve_parser, kv_cache_dtype=KV)
        bogus = process.call(_in_vllm_serve_parser, kv_cache_dtype="fp8_bogus")
    finally:
        process.close()
    assert accepted == {"accepted": True, "registered": True}
    assert bogus == {"accepted": False, "registered": True}


def _spawned_load_general_plugins(queue) -> None:
    """In a process started as vLLM starts its workers (multiprocessing spawn): load the
    ``vllm.general_plugins`` entry points the way every vLLM process does, and report whether
    ``fp8_snapmla`` is an accepted cache dtype before and after."""
    try:
        from importlib.metadata import entry_points

        import vllm.plugins
        from vllm.config import CacheConfig

        def accepted():
            try:
                return CacheConfig(cache_dtype=KV).cache_dtype == KV
            except ValueError:
                return False

        report = {"imported before": "vllm_snapmla" in sys.modules,
                  "accepted before": accepted(),
                  "entry points": sorted(f"{ep.name} = {ep.value}" for ep in
                                         entry_points(group=vllm.plugins.DEFAULT_PLUGINS_GROUP))}
        vllm.plugins.load_general_plugins()
        import vllm_snapmla

        report.update({"registered": vllm_snapmla._registered, "accepted after": accepted(),
                       "package": vllm_snapmla.__file__})
    except BaseException as e:  # noqa: BLE001 - everything goes back to the test
        import traceback

        report = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    queue.put(report)


def test_installed_entry_point_registers_in_a_spawned_process(monkeypatch):
    # What `pip install -e .` declared, not a stand-in dist-info (the test above): the
    # distribution's entry point, loaded by vLLM's own loader in a spawned process, the way
    # each vLLM worker starts.
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution("vllm-snapmla")
    except PackageNotFoundError:
        pytest.skip("vllm-snapmla is not pip-installed (pip install -e .), so no "
                    "vllm.general_plugins entry point exists to load")
    declared = [(ep.group, ep.name, ep.value) for ep in dist.entry_points]
    assert ("vllm.general_plugins", "snapmla", "vllm_snapmla:register") in declared, declared

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)    # vLLM then loads every plugin
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_spawned_load_general_plugins, args=(queue,))
    child.start()
    try:
        report = queue.get(timeout=300)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert "error" not in report, report["error"]
    assert "snapmla = vllm_snapmla:register" in report["entry points"]
    assert report["imported before"] is False and report["accepted before"] is False
    assert report["registered"] is True and report["accepted after"] is True
    # The entry point imported the tree under test, not another copy.
    assert pathlib.Path(report["package"]).resolve().is_relative_to(REPO_ROOT.resolve())
    assert child.exitcode == 0
