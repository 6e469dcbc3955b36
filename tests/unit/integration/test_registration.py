"""register(): vLLM 0.26.0 accepts, sizes, selects and serves ``fp8_snapmla`` (no GPU needed).

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


# --- registration itself ---------------------------------------------------------------------

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


# --- the string is accepted everywhere a user can pass it ------------------------------------

def _in_vllm_kv_cache_dtype_acceptance():
    import typing

    import vllm.v1.attention.selector as selector
    from vllm.config import CacheConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def parser_accepts(value):
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        try:
            return parser.parse_args(["--kv-cache-dtype", value]).kv_cache_dtype == value
        except SystemExit:
            return False

    def cache_config_accepts(value):
        try:
            return CacheConfig(cache_dtype=value).cache_dtype == value
        except ValueError:
            return False

    return {"parser": parser_accepts(KV), "CacheConfig": cache_config_accepts(KV),
            "selector": KV in typing.get_args(selector.CacheDType),
            "parser, bogus": parser_accepts("fp8_bogus"),
            "CacheConfig, bogus": cache_config_accepts("fp8_bogus")}


def _in_vllm_register():
    import vllm_snapmla

    vllm_snapmla.register()


def test_unpatched_vllm_rejects_and_register_accepts():
    # A fresh process: the parser's lru_cache and the selector's Literal are already built
    # from the unpatched CacheDType when register() runs (the H2/H3 refresh paths).
    process = VllmCpuProcess(register=False)
    try:
        before = process.call(_in_vllm_kv_cache_dtype_acceptance)
        process.call(_in_vllm_register)
        after = process.call(_in_vllm_kv_cache_dtype_acceptance)
    finally:
        process.close()
    assert not any(before.values()), before
    assert after == {"parser": True, "CacheConfig": True, "selector": True,
                     "parser, bogus": False, "CacheConfig, bogus": False}


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


def _in_vllm_engine_cache_dtype(kv_cache_dtype):
    from tests.unit._vllm_cpu import engine_config, tiny_model

    return engine_config(tiny_model(), kv_cache_dtype=kv_cache_dtype).cache_config.cache_dtype


def test_engine_args_accept_fp8_snapmla(vllm_cpu):
    assert vllm_cpu.call(_in_vllm_engine_cache_dtype, kv_cache_dtype=KV) == KV
    with pytest.raises(RemoteError) as err:
        vllm_cpu.call(_in_vllm_engine_cache_dtype, kv_cache_dtype="fp8_bogus")
    assert err.value.exc_type == "ValidationError" and "cache_dtype" in err.value.message


# --- sizes and shapes ------------------------------------------------------------------------

def _in_vllm_page_sizes():
    import torch
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode

    def page(block_size, dtype, cache_dtype):
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576,
                                dtype=dtype, cache_dtype_str=cache_dtype,
                                kv_quant_mode=get_kv_quant_mode(cache_dtype))
        merged = MLAAttentionSpec.merge([spec, spec])
        assert merged.page_size_bytes == spec.page_size_bytes
        return spec.page_size_bytes

    return {"snapmla": page(64, torch.uint8, KV), "snapmla, 128": page(128, torch.uint8, KV),
            "bf16": page(64, torch.bfloat16, "auto"), "fp8": page(64, torch.uint8, "fp8"),
            "fp8_ds_mla": page(64, torch.uint8, "fp8_ds_mla"),
            "storage dtype": str(kv_cache_dtype_str_to_dtype(KV, None))}


def test_page_size_is_656_bytes_per_token(vllm_cpu):
    assert vllm_cpu.call(_in_vllm_page_sizes) == {
        "snapmla": 64 * 656, "snapmla, 128": 128 * 656,
        # other dtypes keep vLLM's own sizes
        "bf16": 64 * 576 * 2, "fp8": 64 * 576, "fp8_ds_mla": 64 * 656,
        "storage dtype": "torch.uint8"}


def _in_vllm_backend_layout():
    from vllm_snapmla.integration.backend import SnapMLABackend

    shape = SnapMLABackend.get_kv_cache_shape(1000, 64, 1, 576, cache_dtype_str=KV)
    return {"name": SnapMLABackend.get_name(), "shape": list(shape),
            "block dim": SnapMLABackend.get_kv_cache_block_dim(64, 1, 576, cache_dtype_str=KV),
            "preferred block size": SnapMLABackend.get_preferred_block_size(16),
            "block sizes": [b for b in (None, 16, 32, 64, 128)
                            if SnapMLABackend.supports_block_size(b)],
            "is_mla": SnapMLABackend.is_mla(), "is_sparse": SnapMLABackend.is_sparse(),
            "cudagraph": SnapMLABackend.get_builder_cls()._cudagraph_support.name,
            "query len": SnapMLABackend.get_builder_cls().query_len_support.name,
            "pcp": SnapMLABackend.supports_pcp()}


def _in_vllm_v2_runner_shape_for_a_drafter_only(target_dtype):
    """The V2 model runner's reshape of a drafter layer on fp8_snapmla while the model's
    dtype is ``target_dtype`` (it passes the model's dtype to get_kv_cache_shape)."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode
    from vllm.v1.worker.gpu.attn_utils import _reshape_kv_cache
    from vllm.v1.worker.utils import AttentionGroup

    from vllm_snapmla.integration.backend import SnapMLABackend

    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.uint8,
                            cache_dtype_str=KV, kv_quant_mode=get_kv_quant_mode(KV))
    group = AttentionGroup(backend=SnapMLABackend, layer_names=["draft.attn"],
                           kv_cache_spec=spec, kv_cache_group_id=0)
    raw = {"draft.attn": torch.zeros(10 * spec.page_size_bytes, dtype=torch.int8)}
    out = _reshape_kv_cache([group], raw, cache_dtype=target_dtype, kernel_block_sizes=[64],
                            shared_kv_cache_layers={})
    return list(out["draft.attn"].shape)


@pytest.mark.parametrize("target_dtype", ["auto", "fp8", KV])
def test_v2_runner_gives_a_drafter_only_layer_656_byte_rows(vllm_cpu, target_dtype):
    assert vllm_cpu.call(_in_vllm_v2_runner_shape_for_a_drafter_only,
                         target_dtype=target_dtype) == \
        [10, 64, 656]


def test_backend_kv_cache_layout(vllm_cpu):
    layout = vllm_cpu.call(_in_vllm_backend_layout)
    assert layout == {"name": "SNAPMLA", "shape": [1000, 64, 656], "block dim": 0,
                      "preferred block size": 64, "block sizes": [None, 64],
                      "is_mla": True, "is_sparse": False, "cudagraph": "UNIFORM_BATCH",
                      "query len": "UNIFORM", "pcp": False}
    # The runner views page_size_bytes * num_blocks bytes as this shape: they must agree.
    assert layout["shape"][1] * layout["shape"][2] == 64 * 656


# --- selection -------------------------------------------------------------------------------

def _in_vllm_select(kv_cache_dtype, attention_backend=None):
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention import selector

    from tests.unit._vllm_cpu import device_capability, engine_config, tiny_model

    config = engine_config(tiny_model(), kv_cache_dtype=kv_cache_dtype,
                           attention_backend=attention_backend)
    selector._cached_get_attn_backend.cache_clear()
    with set_current_vllm_config(config), device_capability(9, 0):
        backend = selector.get_attn_backend(576, torch.bfloat16, config.cache_config.cache_dtype,
                                            use_mla=True, num_heads=16)
    return f"{backend.__module__}.{backend.__qualname__}"


def _in_vllm_selection_log():
    """What vLLM's own log handler prints while a layer selects SnapMLA."""
    import io
    import logging

    printed = io.StringIO()
    handler = logging.getLogger("vllm").handlers[0]     # the handler vLLM configured
    saved_stream = handler.setStream(printed)
    try:
        _in_vllm_select(KV)
    finally:
        handler.setStream(saved_stream)
    return printed.getvalue()


def _in_vllm_custom_slot_owned_by_another_plugin():
    """Another plugin registered vLLM's one CUSTOM backend slot before ours."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from tests.unit.integration.test_startup_checks import _in_vllm_startup_error
    from vllm_snapmla.integration.patches import backend_selection
    from vllm_snapmla.integration.startup_checks import SNAPMLA_BACKEND_PATH

    custom = AttentionBackendEnum.CUSTOM
    register_backend(custom, "other_plugin.OtherBackend")
    try:
        backend_selection._register_custom_backend()
        return {"CUSTOM": custom.get_path(), "selected": _in_vllm_select(KV),
                "with CUSTOM": _in_vllm_startup_error(attention_backend="CUSTOM")}
    finally:
        register_backend(custom, SNAPMLA_BACKEND_PATH)


def test_custom_slot_owned_by_another_plugin(vllm_cpu):
    """Ours stays out of the slot, fp8_snapmla still selects SnapMLA, and asking for CUSTOM
    says whose it is instead of advising CUSTOM."""
    seen = vllm_cpu.call(_in_vllm_custom_slot_owned_by_another_plugin)
    assert seen["CUSTOM"] == "other_plugin.OtherBackend"
    assert seen["selected"] == "vllm_snapmla.integration.backend.SnapMLABackend"
    message = seen["with CUSTOM"]
    assert "requested CUSTOM (registered to other_plugin.OtherBackend by another plugin)" \
        in message
    assert "pass --attention-backend CUSTOM" not in message


def test_dense_mla_with_fp8_snapmla_selects_snapmla(vllm_cpu):
    snapmla = "vllm_snapmla.integration.backend.SnapMLABackend"
    assert vllm_cpu.call(_in_vllm_select, kv_cache_dtype=KV) == snapmla
    assert vllm_cpu.call(_in_vllm_select, kv_cache_dtype=KV, attention_backend="CUSTOM") == snapmla
    # The e2e tests look for this line in vLLM's output.
    assert "Using SNAPMLA attention backend" in vllm_cpu.call(_in_vllm_selection_log)
    # Other dtypes keep vLLM's own choice for an H200 (the fake GPU reports sm_90).
    mla = "vllm.v1.attention.backends.mla"
    assert vllm_cpu.call(_in_vllm_select, kv_cache_dtype="auto") == \
        f"{mla}.flashattn_mla.FlashAttnMLABackend"
    assert vllm_cpu.call(_in_vllm_select, kv_cache_dtype="fp8") == f"{mla}.flashmla.FlashMLABackend"


# --- the backend's glue, run on CPU tensors (ops' reference path) ----------------------------

def _in_vllm_impl_write_then_decode():
    import types

    import torch
    import vllm._custom_ops as custom_ops
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import MLACommonDecodeMetadata

    from vllm_snapmla.testing import NAN_F32
    from tests.unit._vllm_cpu import device_capability, engine_config, tiny_model
    from vllm_snapmla import format as fmt
    from vllm_snapmla import reference as ref
    from vllm_snapmla.integration.backend import SnapMLABackend

    config = engine_config(tiny_model(), kv_cache_dtype=KV)
    with set_current_vllm_config(config), device_capability(9, 0):
        impl = SnapMLABackend.get_impl_cls()(
            num_heads=16, head_size=576, scale=0.0721, num_kv_heads=1, alibi_slopes=None,
            sliding_window=None, kv_cache_dtype=KV, logits_soft_cap=None, attn_type="decoder",
            kv_sharing_target_layer_name=None, q_lora_rank=256, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, qk_head_dim=192, v_head_dim=128,
            kv_b_proj=None)
    gen = torch.Generator().manual_seed(1)
    seq_lens = [70, 5, 130]
    num_blocks = 9
    cache = torch.randint(0, 256, (num_blocks, 64, 656), dtype=torch.uint8, generator=gen)
    cache[..., fmt.SCALE_OFFSET:fmt.PAD_OFFSET] = NAN_F32
    block_table = torch.randperm(num_blocks, generator=gen)[:3 * 3].view(3, 3).int()
    slots = torch.cat([(block_table[b].long()[:, None] * 64 + torch.arange(64)).flatten()[:n]
                       for b, n in enumerate(seq_lens)])
    slots[7] = -1                                     # a padding slot vLLM skips
    T = slots.numel()
    kv_c = torch.randn(T + 3, 512, generator=gen).to(torch.bfloat16)   # +3 rows of CG padding
    k_pe = (3 * torch.randn(T + 3, 1, 64, generator=gen)).to(torch.bfloat16)
    expected_cache = cache.clone()
    ref.append_kv(kv_c, k_pe.squeeze(1), expected_cache, slots)

    impl.do_kv_cache_update(kv_c, k_pe, cache, slots, KV, torch.ones(1))
    impl.do_kv_cache_update(kv_c, k_pe, torch.empty(0, dtype=torch.uint8), slots, KV,
                            torch.ones(1))                          # profile run: no cache
    writes_match = torch.equal(cache, expected_cache)

    # Decode, with the query as forward_impl builds it: ql_nope from a transposed bmm, and the
    # cache viewed as FP8.  Position 7's slot was skipped: decode only to lengths that avoid it.
    decode_lens = torch.tensor([5, 5, 130], dtype=torch.int32)
    B, N = 3, 16
    ql_nope = torch.randn(N, B, 512, generator=gen).to(torch.bfloat16).transpose(0, 1)
    q_pe = (3 * torch.randn(B, N, 64, generator=gen)).to(torch.bfloat16)
    metadata = types.SimpleNamespace(num_decodes=B, decode=MLACommonDecodeMetadata(
        block_table=block_table, seq_lens=decode_lens, dcp_tot_seq_lens=None))
    out, lse = impl.forward_mqa((ql_nope, q_pe), cache.view(torch.float8_e4m3fn), metadata,
                                layer=None)
    want, want_lse = ref.decode(ql_nope.unsqueeze(1), q_pe.unsqueeze(1), cache, block_table,
                                decode_lens, 0.0721)
    impl.need_to_return_lse_for_decode = True           # what DCP would ask for
    _, lse_dcp = impl.forward_mqa((ql_nope, q_pe), cache.view(torch.float8_e4m3fn), metadata,
                                  layer=None)
    return {"writes match": writes_match, "out shape": list(out.shape), "out dtype": str(out.dtype),
            "out equals reference": torch.equal(out, want.squeeze(1).to(torch.bfloat16)),
            "lse": lse, "lse shape": list(lse_dcp.shape),
            "lse equals reference": torch.equal(lse_dcp, want_lse.squeeze(-1).float()),
            "quantized query input": impl.supports_quant_query_input,
            "gather installed": hasattr(custom_ops.gather_and_maybe_dequant_cache,
                                        "__snapmla_wrapped__")}


def test_impl_writes_cache_and_decodes_through_ops(vllm_cpu):
    assert vllm_cpu.call(_in_vllm_impl_write_then_decode) == {
        "writes match": True, "out shape": [3, 16, 512], "out dtype": "torch.bfloat16",
        "out equals reference": True, "lse": None, "lse shape": [3, 16],
        "lse equals reference": True, "quantized query input": False, "gather installed": True}


def _in_vllm_prefill_gather():
    import torch
    import vllm._custom_ops as custom_ops

    from vllm_snapmla.testing import build_cache
    from vllm_snapmla.integration.patches import prefill_gather
    from vllm_snapmla import reference as ref

    prefill_gather.apply()
    gen = torch.Generator().manual_seed(2)
    seq_lens = [100, 40, 200]
    cache, block_table, _ = build_cache(seq_lens, gen=gen)
    # One chunk of the chunked-prefill context: request b contributes positions
    # [starts[b], starts[b] + chunk_lens[b]).
    starts = torch.tensor([64, 0, 128], dtype=torch.int32)
    chunk_lens = torch.tensor([36, 40, 72])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), chunk_lens.cumsum(0)]).int()
    token_to_seq = torch.repeat_interleave(torch.arange(3), chunk_lens).int()
    total = int(chunk_lens.sum())
    workspace = torch.full((total + 16, 576), float("nan"), dtype=torch.bfloat16)
    custom_ops.gather_and_maybe_dequant_cache(
        src_cache=cache.view(torch.float8_e4m3fn), dst=workspace, block_table=block_table,
        cu_seq_lens=cu, token_to_seq=token_to_seq, num_tokens=torch.tensor(total),
        kv_cache_dtype=KV, scale=torch.ones(1), seq_starts=starts)
    expected = []
    for b in range(3):
        for pos in range(int(starts[b]), int(starts[b] + chunk_lens[b])):
            c, r = ref.dequantize_kv(cache[block_table[b, pos // 64], pos % 64])
            expected.append(torch.cat([c, r]).to(torch.bfloat16))
    return {"rows match": torch.equal(workspace[:total], torch.stack(expected)),
            "tail untouched": bool(workspace[total:].isnan().all())}


def test_prefill_gather_wrapper_dequantizes_context(vllm_cpu):
    assert vllm_cpu.call(_in_vllm_prefill_gather) == {"rows match": True,
                                                      "tail untouched": True}


# --- the tiny model and the demo ---------------------------------------------------------

def test_tiny_deepseek_v3_checkpoint_loads_in_transformers(tmp_path):
    # The e2e tests load this checkpoint in vLLM; transformers reads the same DeepSeek-V3
    # layout (per-expert MoE tensors), so a missing or misnamed tensor shows up here.
    import torch
    from transformers import DeepseekV3ForCausalLM

    from vllm_snapmla.testing import write_tiny_deepseek_v3

    path = write_tiny_deepseek_v3(tmp_path, random_weights=True, seed=3)
    model, info = DeepseekV3ForCausalLM.from_pretrained(str(path), output_loading_info=True,
                                                        dtype=torch.bfloat16)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    config = model.config
    assert (config.kv_lora_rank, config.qk_rope_head_dim) == (512, 64)
    assert not hasattr(config, "index_topk")
    with torch.no_grad():
        logits = model(torch.randint(2, 4096, (1, 9))).logits.float()
    assert torch.isfinite(logits).all() and logits.std() > 0.1   # not dummy-weight flat


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="the GPU branch runs instead (tests/e2e/test_demo.py)")
def test_demo_without_gpu_reports_reference_accuracy():
    from vllm_snapmla.testing import with_pythonpath

    env = with_pythonpath(os.environ, str(REPO_ROOT))
    out = subprocess.run([sys.executable, "-m", "vllm_snapmla.demo"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "need one" in out.stdout and "sm_89+" in out.stdout
    rows = [line.split("|") for line in out.stdout.splitlines() if line.count("|") == 1]
    errors = [float(x) for _, numbers in rows[1:] for x in numbers.split()[:2]]
    assert len(errors) == 8 and all(0 < e < 0.1 for e in errors)
