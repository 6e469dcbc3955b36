"""benchmarks.step_profile without a GPU: kernel groups and the per-step arithmetic of a profiled
window of decode steps."""

import pytest

from benchmarks import step_profile as sp

SNAPMLA = "void snapmla::sm90::decode_narrow_kernel<16>(CUtensorMap_st, snapmla::sm90::DecodeParams"


@pytest.mark.parametrize("name, group", [
    (SNAPMLA, "attention"),
    ("void flash::flash_fwd_splitkv_mla_kernel<Flash_fwd_kernel_traits_mla<576>>", "attention"),
    ("fused_moe_kernel", "MoE"),
    ("void vllm::moe::moe_align_block_size_kernel<int>(x)", "MoE"),
    ("void vllm::moe::grouped_topk_fused_kernel<float>(x)", "MoE"),
    ("void deep_gemm::sm90_m_grouped_fp8_gemm_contiguous_impl<128>(x)", "MoE"),
    ("void deep_gemm::sm90_fp8_gemm_1d2d_impl<128, 128>(x)", "GEMMs"),
    ("_w8a8_block_fp8_matmul", "GEMMs"),
    ("nvjet_sm90_tst_512x64_64x2_2x1_v_bz_coopB_TNN", "GEMMs"),
    ("void vllm::act_and_mul_kernel<c10::BFloat16>(x)", "other"),
    ("_per_token_group_quant_fp8", "other"),
])
def test_moe_kernels_have_their_own_group_before_the_gemms(name, group):
    assert sp.kernel_group(name, sp.MOE_GROUPS) == group


def test_without_moe_groups_grouped_gemms_count_as_gemms():
    assert sp.kernel_group("void deep_gemm::sm90_m_grouped_fp8_gemm_contiguous_impl<128>(x)") \
        == "GEMMs"
    assert sp.group_names() == ["attention", "GEMMs", "other"]
    assert sp.group_names(sp.MOE_GROUPS) == ["attention", "MoE", "GEMMs", "other"]


def test_window_profile_is_per_step_of_everything_the_window_ran():
    kernels = []
    for s in range(4):                       # 4 steps of 100 µs: attention, MoE, a norm
        t = 100 * s
        kernels += [(SNAPMLA, t, t + 30), ("fused_moe_kernel", t + 30, t + 50),
                    ("triton_red_fused_rms_norm_2", t + 45, t + 55)]
    host = [("cudaGraphLaunch", 20.0)] * 4 + [("cudaStreamSynchronize", 5.0)] * 2
    p = sp.window_profile((480.0, kernels, host), 4, sp.MOE_GROUPS)
    assert p["wall_us"] == 120.0
    assert p["busy_us"] == pytest.approx(55.0)          # the norm overlaps the MoE by 5 µs
    assert p["groups_us"] == {"attention": 30.0, "MoE": 20.0, "GEMMs": 0.0, "other": 10.0}
    assert p["kernels"][0] == (SNAPMLA, 30.0, 1.0)
    assert [name for name, _, _ in p["kernels"]] == [SNAPMLA, "fused_moe_kernel",
                                                     "triton_red_fused_rms_norm_2"]
    assert p["host_us"] == pytest.approx(22.5)
    assert p["waits_per_step"] == 0.5 and p["waits_us"] == pytest.approx(2.5)


def test_profiled_returns_the_ops_own_cpu_time(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def work():
        a = torch.randn(128, 128)
        for _ in range(3):
            a = a @ a

    wall_us, kernels, host = sp.profiled(work)
    assert wall_us > 0 and kernels == []                        # no GPU here
    mm = [us for name, us in host if name == "aten::mm"]
    assert len(mm) == 3 and all(us > 0 for us in mm)
    matmul = sum(us for name, us in host if name == "aten::matmul")
    assert matmul < sum(mm)   # own time: the mm inside each matmul is not counted twice
