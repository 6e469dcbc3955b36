"""Loading the compiled extension ``vllm_snapmla._C`` (``csrc/``), whose ops live in
``torch.ops._snapmla_C``."""

from __future__ import annotations

import functools

import torch


@functools.cache
def native():
    """The extension's op namespace, or None if it was not built (``SNAPMLA_SKIP_BUILD=1``)."""
    try:
        import vllm_snapmla._C  # noqa: F401  (registers torch.ops._snapmla_C)
    except ImportError:
        return None
    return torch.ops._snapmla_C


def require_native(what: str):
    """The op namespace, or a RuntimeError saying how to build it."""
    ops = native()
    if ops is None:
        raise RuntimeError(
            f"{what} on a CUDA tensor needs the native extension vllm_snapmla._C, which this "
            "install does not have (installed with SNAPMLA_SKIP_BUILD=1, or the build failed). "
            "Rebuild from the source tree with a CUDA 13 toolkit (nvcc) on the PATH: "
            "`pip install --no-build-isolation --force-reinstall --no-deps -e .`")
    return ops
