import pytest
import torch


def _has_fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def pytest_collection_modifyitems(config, items):
    if _has_fp8_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with FP8 support (sm_89+)")
    for item in items:
        if any(m in item.keywords for m in ("gpu", "hopper", "e2e")):
            item.add_marker(skip)
