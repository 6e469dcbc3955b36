"""Loading the compiled extension ``vllm_snapmla._C`` (``csrc/``), whose ops live in
``torch.ops._snapmla_C``."""

from __future__ import annotations

import functools

import torch

_load_error: list[str] = []   # why an extension that is there did not load

# What to do about a missing extension, for every error that reports one.
REBUILD = ("Rebuild from the source tree with a CUDA 13 toolkit (nvcc) on the PATH: "
           "`pip install --no-build-isolation --force-reinstall --no-deps -e .`")


@functools.cache
def native():
    """The extension's op namespace, or None if it was not built (``SNAPMLA_SKIP_BUILD=1``) or
    does not load (``missing_reason`` says which)."""
    try:
        import vllm_snapmla._C  # noqa: F401  (registers torch.ops._snapmla_C)
    except ModuleNotFoundError as error:
        if error.name != "vllm_snapmla._C":
            raise
        return None
    except ImportError as error:       # built, but not loadable here
        _load_error.append(str(error))
        return None
    return torch.ops._snapmla_C


def missing_reason() -> str:
    """Why ``native()`` is None, in a few words (for errors and test skip reasons)."""
    native()
    if _load_error:
        return (f"the native extension vllm_snapmla._C is there but does not load "
                f"({_load_error[0]}); it must be built against the installed torch")
    return ("the native extension vllm_snapmla._C was not built (SNAPMLA_SKIP_BUILD=1, or no CUDA "
            "toolkit was found when the package was installed)")


def require_native(what: str):
    """The op namespace, or a RuntimeError saying how to build it."""
    ops = native()
    if ops is None:
        raise RuntimeError(
            f"{what} on a CUDA tensor needs the native extension: {missing_reason()}. "
            + REBUILD)
    return ops
