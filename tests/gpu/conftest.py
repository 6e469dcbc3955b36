"""What the CUDA tests share."""

import pytest

from vllm_snapmla.kernels import sm90


@pytest.fixture(params=["sm90", "triton"])
def kernel(request, monkeypatch):
    """Each decode kernel in turn, chosen through ``SNAPMLA_DECODE_KERNEL``."""
    if request.param == "sm90" and not sm90.available():
        pytest.skip("needs an sm_90 GPU and the decode_sm90 op")
    monkeypatch.setenv("SNAPMLA_DECODE_KERNEL", request.param)
    return request.param
