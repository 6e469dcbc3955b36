"""FULL CUDA graphs for decode and uniform multi-token decode (speculative decoding).

The builder's class attributes are what vLLM reads: ``_cudagraph_support`` (UNIFORM_BATCH) goes
through the runner's own ``GPUModelRunner._check_and_update_cudagraph_mode`` (run here on a stub
runner in the fake-CUDA process) into ``CompilationConfig.resolve_cudagraph_mode_and_sizes`` and
the dispatcher's graph keys; ``query_len_support`` (UNIFORM) makes
``_init_reorder_batch_threshold`` classify ``1 + num_speculative_tokens`` queries as decodes.
``forward_mqa`` is run on CPU tensors (the reference decode) in vLLM's token-major layout.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from vllm_snapmla.testing import build_cache
from tests.unit._vllm_cpu import SPEC_NGRAM
from vllm_snapmla import format as fmt
from vllm_snapmla import ops

KV = "fp8_snapmla"


def test_builder_declares_uniform_batch_graphs_and_uniform_queries():
    from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport
    from vllm.v1.attention.backend import AttentionCGSupport

    from vllm_snapmla.integration.backend import SnapMLABackend

    builder = SnapMLABackend.get_builder_cls()
    assert builder._cudagraph_support is AttentionCGSupport.UNIFORM_BATCH
    assert builder.get_cudagraph_support(None, None) is AttentionCGSupport.UNIFORM_BATCH
    assert builder.query_len_support is QueryLenSupport.UNIFORM
    assert builder.reorder_batch_threshold == 1


# --- vLLM's cudagraph-mode resolution, in the fake-CUDA process ------------------------------

def _in_vllm_resolve_cudagraphs(support=None, **engine_kwargs):
    """Resolve the cudagraph mode as the V1 runner does once the attention backends are known.

    ``support`` (an AttentionCGSupport name) swaps in a builder subclass with that level, to show
    the class attribute is what drives the result.  Returns the resolved mode, the capture sizes
    and the dispatcher's FULL graph keys ``(num_tokens, num_reqs, uniform)``.
    """
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from tests.unit._vllm_cpu import engine_config, tiny_model
    from vllm_snapmla.integration.backend import SnapMLABackend, SnapMLAMetadataBuilder

    backend = SnapMLABackend
    if support is not None:
        level = AttentionCGSupport[support]

        class Builder(SnapMLAMetadataBuilder):
            _cudagraph_support = level

        class Backend(SnapMLABackend):
            @staticmethod
            def get_builder_cls():
                return Builder

        backend = Backend
    engine_kwargs.setdefault("enforce_eager", False)
    config = engine_config(tiny_model(), kv_cache_dtype=KV, **engine_kwargs)
    spec = config.speculative_config
    runner = SimpleNamespace(
        vllm_config=config, compilation_config=config.compilation_config,
        parallel_config=config.parallel_config, speculative_config=spec,
        uniform_decode_query_len=1 + (spec.num_speculative_tokens if spec else 0),
        kv_cache_config=None, max_num_reqs=config.scheduler_config.max_num_seqs,
        cudagraph_dispatcher=CudagraphDispatcher(config))
    GPUModelRunner._check_and_update_cudagraph_mode(
        runner, [{backend}], [SimpleNamespace(kv_cache_spec=None)])
    keys = runner.cudagraph_dispatcher.cudagraph_keys
    full = sorted((d.num_tokens, d.num_reqs, d.uniform)
                  for mode, descs in keys.items() if mode.name == "FULL" for d in descs)
    return {"mode": config.compilation_config.cudagraph_mode.name,
            "capture_sizes": config.compilation_config.cudagraph_capture_sizes,
            "full_keys": full}


def test_default_config_captures_full_decode_graphs(vllm_cpu):
    r = vllm_cpu.call(_in_vllm_resolve_cudagraphs)
    assert r["mode"] == "FULL_AND_PIECEWISE"
    # One FULL graph per capture size up to max_num_seqs, for uniform single-token decodes.
    assert r["full_keys"][:4] == [[1, 1, True], [2, 2, True], [4, 4, True], [8, 8, True]]
    assert all(uniform and n == reqs for n, reqs, uniform in r["full_keys"])


def test_spec_decode_captures_full_graphs_for_uniform_multi_token_decodes(vllm_cpu):
    r = vllm_cpu.call(_in_vllm_resolve_cudagraphs, speculative_config=SPEC_NGRAM)
    assert r["mode"] == "FULL_AND_PIECEWISE"
    # Capture sizes rounded to multiples of 1 + k = 3; each FULL graph holds n / 3 requests.
    assert all(size % 3 == 0 for size in r["capture_sizes"])
    assert r["full_keys"][:3] == [[3, 1, True], [6, 2, True], [9, 3, True]]
    assert all(uniform and n == 3 * reqs for n, reqs, uniform in r["full_keys"])


@pytest.mark.parametrize("support, spec, mode", [
    ("NEVER", False, "PIECEWISE"),                           # what the backend declared before
    ("UNIFORM_SINGLE_TOKEN_DECODE", True, "PIECEWISE"),      # no FULL graphs with s_q > 1
    ("UNIFORM_SINGLE_TOKEN_DECODE", False, "FULL_AND_PIECEWISE"),
], ids=["never", "single_token_with_spec", "single_token"])
def test_support_level_drives_the_resolution(vllm_cpu, support, spec, mode):
    kwargs = {"speculative_config": SPEC_NGRAM} if spec else {}
    r = vllm_cpu.call(_in_vllm_resolve_cudagraphs, support=support, **kwargs)
    assert r["mode"] == mode
    assert (r["full_keys"] == []) == (mode == "PIECEWISE")


def test_enforce_eager_captures_nothing(vllm_cpu):
    r = vllm_cpu.call(_in_vllm_resolve_cudagraphs, enforce_eager=True)
    assert r["mode"] == "NONE" and r["full_keys"] == []


def _in_vllm_reorder_threshold(**engine_kwargs):
    """``reorder_batch_threshold`` as ``MLACommonMetadataBuilder.__init__`` sets it."""
    from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport

    from tests.unit._vllm_cpu import engine_config, tiny_model
    from vllm_snapmla.integration.backend import SnapMLAMetadataBuilder as B

    config = engine_config(tiny_model(), kv_cache_dtype=KV, **engine_kwargs)
    builder = SimpleNamespace(vllm_config=config)
    B._init_reorder_batch_threshold(builder, B.reorder_batch_threshold,
                                    B.query_len_support != QueryLenSupport.SINGLE_ONLY)
    return builder.reorder_batch_threshold


@pytest.mark.parametrize("k", [0, 2, 4])
def test_reorder_threshold_takes_speculative_queries_as_decodes(vllm_cpu, k):
    kwargs = {"speculative_config": {**SPEC_NGRAM, "num_speculative_tokens": k}} if k else {}
    assert vllm_cpu.call(_in_vllm_reorder_threshold, **kwargs) == 1 + k


# --- forward_mqa with s_q > 1, on CPU --------------------------------------------------------

H = 4
SCALE = 1 / math.sqrt(192)


def _impl(return_lse: bool):
    from vllm_snapmla.integration.backend import SnapMLAImpl

    impl = SnapMLAImpl.__new__(SnapMLAImpl)   # no vLLM config needed for forward_mqa
    impl.kv_lora_rank, impl.qk_rope_head_dim = fmt.KV_LORA_RANK, fmt.ROPE_DIM
    impl.scale = SCALE
    impl.need_to_return_lse_for_decode = return_lse
    return impl


def _vllm_decode_batch(seq_lens, s_q, gen):
    """A decode batch as forward_impl hands it over: token-major, q_nope a transposed bmm output.

    The last request is CUDA-graph padding: seq_len 0 and a block-table row of null blocks.
    """
    cache, block_table, _ = build_cache(seq_lens, gen=gen)
    block_table[-1] = 0
    B = len(seq_lens)
    T = B * s_q
    ql_nope = torch.randn(H, T, fmt.KV_LORA_RANK, generator=gen).bfloat16().transpose(0, 1)
    q_pe = torch.randn(T, H, fmt.ROPE_DIM, generator=gen).bfloat16()
    # forward_impl views the fp8_snapmla cache as the platform's FP8 dtype
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return cache.view(torch.float8_e4m3fn), block_table, lens, ql_nope, q_pe


@pytest.mark.parametrize("s_q", [1, 2, 3, 4])
@pytest.mark.parametrize("as_tuple", [True, False], ids=["tuple", "concat"])
def test_forward_mqa_uniform_queries_match_ops_decode(s_q, as_tuple):
    gen = torch.Generator().manual_seed(s_q)
    seq_lens = [70, 129, 5 + s_q, 0]
    cache, bt, sl, ql_nope, q_pe = _vllm_decode_batch(seq_lens, s_q, gen)
    B, T = len(seq_lens), len(seq_lens) * s_q
    metadata = SimpleNamespace(decode=SimpleNamespace(block_table=bt, seq_lens=sl), num_decodes=B)
    q = (ql_nope, q_pe) if as_tuple else torch.cat([ql_nope, q_pe], dim=-1)
    out, lse = _impl(return_lse=True).forward_mqa(q, cache, metadata, layer=None)

    ref_out, ref_lse = ops.decode(ql_nope.reshape(B, s_q, H, -1), q_pe.reshape(B, s_q, H, -1),
                                  cache.view(torch.uint8), bt, sl, SCALE)
    assert out.shape == (T, H, fmt.KV_LORA_RANK) and out.dtype == torch.bfloat16
    assert lse.shape == (T, H) and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out.reshape(T, H, -1), rtol=0, atol=0)
    # lse [B, H, s_q] -> token-major [T, H]: token b * s_q + i, head h
    for b in range(B):
        for i in range(s_q):
            torch.testing.assert_close(lse[b * s_q + i], ref_lse[b, :, i], rtol=0, atol=0)
    # the padded request: no token seen
    assert (out[-s_q:] == 0).all() and torch.isneginf(lse[-s_q:]).all()
    assert torch.isfinite(lse[:-s_q]).all()

    out_only, none = _impl(return_lse=False).forward_mqa(q, cache, metadata, layer=None)
    assert none is None
    torch.testing.assert_close(out_only, out, rtol=0, atol=0)


def test_forward_mqa_causal_within_the_new_tokens():
    # Query i of a request sees the cache up to its own position: s_q = 2 equals two s_q = 1
    # decodes at seq_len - 1 and seq_len.
    gen = torch.Generator().manual_seed(7)
    seq_lens = [100, 65]
    cache, bt, sl, ql_nope, q_pe = _vllm_decode_batch(seq_lens + [0], 2, gen)
    B = 3
    out, _ = _impl(False).forward_mqa((ql_nope, q_pe), cache, SimpleNamespace(
        decode=SimpleNamespace(block_table=bt, seq_lens=sl), num_decodes=B), None)
    for i in range(2):
        rows = torch.arange(B) * 2 + i
        single, _ = _impl(False).forward_mqa(
            (ql_nope[rows], q_pe[rows]), cache, SimpleNamespace(
                decode=SimpleNamespace(block_table=bt, seq_lens=(sl - 1 + i).clamp_min(0)),
                num_decodes=B), None)
        torch.testing.assert_close(out[rows], single, rtol=0, atol=0)


def test_forward_mqa_passes_the_steps_plan_to_decode(monkeypatch):
    """Every layer's decode reads the plan the builder made for the step (metadata.decode)."""
    from vllm_snapmla.integration import backend

    gen = torch.Generator().manual_seed(2)
    cache, bt, sl, ql_nope, q_pe = _vllm_decode_batch([70, 129, 0], 1, gen)
    plan = torch.tensor([5], dtype=torch.int32)
    seen, real_decode = [], ops.decode

    def decode(*args, **kwargs):
        seen.append(kwargs.get("plan"))
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(backend.snapmla_ops, "decode", decode)
    metadata = SimpleNamespace(decode=SimpleNamespace(split_plan=plan, block_table=bt,
                                                      seq_lens=sl), num_decodes=3)
    _impl(False).forward_mqa((ql_nope, q_pe), cache, metadata, None)
    assert seen == [plan]
    del metadata.decode.split_plan   # vLLM's own decode metadata: the call plans
    _impl(False).forward_mqa((ql_nope, q_pe), cache, metadata, None)
    assert seen == [plan, None]


def test_the_builder_overrides_vllms_decode_hook(monkeypatch):
    """H16 is an override: had vLLM renamed or reshaped ``_build_decode``, ours would never run
    and every layer would plan again, slower and silently.  And the builder keeps one plan
    buffer for its life, on its device."""
    import inspect

    from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder

    from vllm_snapmla.integration.backend import SnapMLAMetadataBuilder

    ours = inspect.signature(SnapMLAMetadataBuilder._build_decode).parameters
    theirs = inspect.signature(MLACommonMetadataBuilder._build_decode).parameters
    assert list(ours) == list(theirs)

    def base_init(self, *args, **kwargs):
        self.device = torch.device("cpu")

    monkeypatch.setattr(MLACommonMetadataBuilder, "__init__", base_init)
    builder = SnapMLAMetadataBuilder(None, [], None, torch.device("cpu"))
    assert builder.split_plan.dtype == torch.int32 and builder.split_plan.shape == (1,)


@pytest.mark.parametrize("num_decodes, tokens, s_q", [(3, 3, 1), (2, 6, 3), (3, 4, None)])
def test_the_builder_plans_once_per_step_into_its_buffer(num_decodes, tokens, s_q, monkeypatch):
    """``_build_decode`` makes the step's plan (``ops.plan_decode``, the builder's heads, the
    query length) in the builder's one buffer, the address a FULL graph reads; a batch of
    mixed query lengths (refused by the decode) gets no plan."""
    from vllm_snapmla.integration import backend

    calls = []

    def plan_decode(seq_lens, block_table, num_heads, s_q=1, *, out=None):
        calls.append((seq_lens, block_table, num_heads, s_q))
        return out

    monkeypatch.setattr(backend.snapmla_ops, "plan_decode", plan_decode)
    builder = SimpleNamespace(num_heads=16, split_plan=torch.zeros(1, dtype=torch.int32))
    sl = torch.tensor([100] * num_decodes, dtype=torch.int32)
    bt = torch.zeros(num_decodes, 8, dtype=torch.int32)
    decode = backend.SnapMLAMetadataBuilder._build_decode(
        builder, block_table_tensor=bt, seq_lens_device=sl, max_seq_len=100,
        query_start_loc_cpu=None, query_start_loc_device=None, num_decode_tokens=tokens,
        dcp_tot_seq_lens_device=None)
    assert isinstance(decode, backend.SnapMLADecodeMetadata)
    assert decode.block_table is bt and decode.seq_lens is sl
    if s_q is None:
        assert decode.split_plan is None and calls == []
    else:
        assert decode.split_plan is builder.split_plan
        assert calls == [(sl, bt, 16, s_q)]


def test_forward_mqa_refuses_non_uniform_token_counts():
    gen = torch.Generator().manual_seed(1)
    cache, bt, sl, ql_nope, q_pe = _vllm_decode_batch([70, 10], 2, gen)
    metadata = SimpleNamespace(decode=SimpleNamespace(block_table=bt, seq_lens=sl), num_decodes=3)
    with pytest.raises(ValueError, match="uniform query lengths"):
        _impl(False).forward_mqa((ql_nope, q_pe), cache, metadata, None)


@pytest.mark.parametrize("kernel, capability, note", [("sm90", (9, 0), False),
                                                      ("triton", (9, 0), True),
                                                      ("triton", (8, 9), False)])
def test_the_log_names_the_decode_kernel(monkeypatch, kernel, capability, note):
    """Once per process and GPU the backend logs which decode kernel serves it, with a note where
    a Hopper GPU gets the slower Triton kernel (a build without sm_90a code), and a warning
    wherever the Triton kernel serves: it is slower than BF16 attention."""
    import vllm.logger

    from vllm_snapmla.integration import backend

    lines, warnings = [], []

    class Logger:
        def info(self, message, *args):
            lines.append(message % args)

        def warning(self, message, *args):
            warnings.append(message % args)

    monkeypatch.setattr(vllm.logger, "init_logger", lambda name: Logger())
    monkeypatch.setattr(backend.snapmla_ops, "decode_kernel", lambda device: kernel)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    backend.log_decode_kernel.cache_clear()
    try:
        backend.log_decode_kernel(0)
        backend.log_decode_kernel(0)
    finally:
        backend.log_decode_kernel.cache_clear()
    assert len(lines) == 1 and lines[0].startswith("fp8_snapmla decode kernel on cuda:0: ")
    named = lines[0].removeprefix("fp8_snapmla decode kernel on cuda:0: ")
    assert named.startswith("the Hopper kernels" if kernel == "sm90" else "the portable Triton")
    assert ("SNAPMLA_ARCHS containing 90a" in lines[0]) == note
    if kernel == "sm90":
        assert warnings == []
    else:
        assert len(warnings) == 1 and "slower than BF16 attention" in warnings[0]
        assert "cuda:0" in warnings[0] and "KV capacity" in warnings[0]
