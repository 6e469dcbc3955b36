"""Builds the native extension ``vllm_snapmla._C`` from every source under ``csrc/``.

Environment:
  SNAPMLA_SKIP_BUILD=1   pure-Python install, no extension (CUDA tensors then get a clear error).
                         The same happens, with a message, when no CUDA toolkit (nvcc under
                         CUDA_HOME, /usr/local/cuda or on the PATH) is found: CPU-only machines
                         install and run the CPU paths; on a GPU, fp8_snapmla then refuses to
                         start until the package is reinstalled with a toolkit.
  SNAPMLA_ARCHS          GPU targets, e.g. "89+PTX;90a" (default) or "90a" for a quick H200 build;
                         "+PTX" also embeds that target's PTX for GPUs newer than the list.
  SNAPMLA_PTXAS_VERBOSE=1  print ptxas register / spill reports.
  MAX_JOBS               parallel compile jobs (default: all cores).

Install: ``pip install --no-build-isolation --no-deps -e .`` (built against the installed torch).
"""

import os
import re
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent.resolve()
DEFAULT_ARCHS = "89+PTX;90a"


def gencode_flags(spec: str) -> list[str]:
    flags = []
    for arch in filter(None, re.split(r"[;, ]+", spec)):
        name = arch.removesuffix("+PTX")
        if not re.fullmatch(r"\d+a?", name):
            raise ValueError(f"SNAPMLA_ARCHS entry {arch!r} is not like 89, 90a or 89+PTX")
        if name == "90":
            # A plain sm_90 cubin would hold only the trapping stub of the Hopper decode kernel,
            # which needs wgmma and setmaxnreg (sm_90a).
            raise ValueError("SNAPMLA_ARCHS: build Hopper as 90a, not 90")
        flags.append(f"-gencode=arch=compute_{name},code=sm_{name}")
        if arch.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{name},code=compute_{name}")
    if not flags:
        raise ValueError("SNAPMLA_ARCHS names no GPU target")
    return flags


def torch_library_dirs() -> list[str]:
    """Where the loader finds libc10 / libtorch / libcudart, so that ``import vllm_snapmla._C``
    works before ``import torch``: beside an installed package, and in this build's environment
    (for in-place and editable builds)."""
    import torch

    site = Path(torch.__file__).parent.parent
    dirs = ["$ORIGIN/../torch/lib", "$ORIGIN/../nvidia/cu13/lib", str(site / "torch" / "lib")]
    if (site / "nvidia" / "cu13" / "lib").is_dir():
        dirs.append(str(site / "nvidia" / "cu13" / "lib"))
    return dirs


def cuda_toolkit() -> str | None:
    """The CUDA toolkit the extension would be built with, or None if it has no nvcc."""
    # torch guesses CUDA_HOME from the nvcc on PATH; a /usr/local/bin/nvcc shim makes that guess
    # /usr/local, which has no CUDA headers.
    if not os.environ.get("CUDA_HOME") and Path("/usr/local/cuda/include/cuda_runtime.h").exists():
        os.environ["CUDA_HOME"] = "/usr/local/cuda"
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME if CUDA_HOME and (Path(CUDA_HOME) / "bin" / "nvcc").exists() else None


def native_extensions():
    from torch.utils.cpp_extension import CUDAExtension

    # Every .cu / .cpp under csrc/ (csrc/sm90/ included) is part of the one library.
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*")
                     if p.suffix in (".cu", ".cpp"))
    gencode = gencode_flags(os.environ.get("SNAPMLA_ARCHS", DEFAULT_ARCHS))
    nvcc = [
        "-O3", "-std=c++17",
        # Quantization must round exactly like the reference: IEEE division, no flush-to-zero.
        # (--use_fast_math would change both.)
        "-prec-div=true", "-prec-sqrt=true", "-ftz=false",
        f"--threads={min(len(gencode), os.cpu_count() or 1)}",
        *gencode,
    ]
    if os.environ.get("SNAPMLA_PTXAS_VERBOSE") == "1":
        nvcc.append("-Xptxas=-v")
    return [CUDAExtension(
        name="vllm_snapmla._C",
        sources=sources,
        include_dirs=[str(ROOT / "csrc")],
        extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": nvcc},
        extra_link_args=[f"-Wl,-rpath,{d}" for d in torch_library_dirs()],
        # Only the dispatcher is used, not torch's Python bindings: one abi3 library serves every
        # CPython >= 3.10 built against the same torch.
        py_limited_api=True,
    )]


if os.environ.get("SNAPMLA_SKIP_BUILD") == "1":
    setup()
elif cuda_toolkit() is None:
    where = os.environ.get("CUDA_HOME") or "CUDA_HOME, /usr/local/cuda or the PATH"
    print(f"vllm-snapmla: no CUDA toolkit found (no nvcc in {where}): installing without the "
          "native extension vllm_snapmla._C. The CPU paths work; on a GPU, fp8_snapmla refuses to "
          "start until the package is reinstalled with a CUDA 13 toolkit.", file=sys.stderr)
    setup()
else:
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    extensions = native_extensions()
    from torch.utils.cpp_extension import BuildExtension

    setup(
        ext_modules=extensions,
        cmdclass={"build_ext": BuildExtension},
        options={"bdist_wheel": {"py_limited_api": "cp310"}},
    )
