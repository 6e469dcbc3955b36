"""What the end-to-end tests share."""

import pytest

from vllm_snapmla.testing import write_tiny_deepseek_v3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny DeepSeek-V3 with random weights of trained-model scale, written once per module."""
    return str(write_tiny_deepseek_v3(tmp_path_factory.mktemp("tiny-deepseek-v3"),
                                      random_weights=True))
