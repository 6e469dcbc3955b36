"""H1-H3, H14 (``patches/cache_dtype.py``): vLLM accepts ``fp8_snapmla`` wherever a user can pass
it (the CLI, ``CacheConfig``, the selector, engine arguments) once ``register()`` ran, and not
before.

Functions named ``_in_vllm_*`` run inside a vLLM process on a fake CUDA platform
(``tests/unit/_vllm_cpu.py``); the tests call them through ``VllmCpuProcess.call``.
"""

import pytest

from tests.unit._vllm_cpu import RemoteError, VllmCpuProcess

KV = "fp8_snapmla"


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


def _in_vllm_engine_cache_dtype(kv_cache_dtype):
    from tests.unit._vllm_cpu import engine_config, tiny_model

    return engine_config(tiny_model(), kv_cache_dtype=kv_cache_dtype).cache_config.cache_dtype


def test_engine_args_accept_fp8_snapmla(vllm_cpu):
    assert vllm_cpu.call(_in_vllm_engine_cache_dtype, kv_cache_dtype=KV) == KV
    with pytest.raises(RemoteError) as err:
        vllm_cpu.call(_in_vllm_engine_cache_dtype, kv_cache_dtype="fp8_bogus")
    assert err.value.exc_type == "ValidationError" and "cache_dtype" in err.value.message
