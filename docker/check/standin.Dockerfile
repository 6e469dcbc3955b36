# STAND-IN for vllm/vllm-openai:v0.26.0, for hosts that cannot reach Docker Hub.
# Built FROM a debootstrapped Debian 12 (bookworm, minbase) rootfs imported as
# snapmla-standin-rootfs:bookworm.  What it reproduces of the real image:
#   - python3 is the system interpreter, with its dev headers (real: deadsnakes python3.12 +
#     python3.12-dev + -venv on Ubuntu 22.04; here: Debian python3.11 + python3.11-dev + -venv),
#     no PEP 668 EXTERNALLY-MANAGED marker, pip from PyPI in /usr/local (real: get-pip.py),
#   - vllm==0.26.0 installed system-wide from PyPI with its pinned torch 2.11.0 (CUDA 13.0 wheels),
#   - a CUDA 13.0 toolkit at /usr/local/cuda with nvcc, cudart headers/libs and CCCL (here: a copy
#     of this host's pip-wheel-assembled toolkit; real: NVIDIA apt packages cuda-nvcc-13-0 & co.
#     on top of nvidia/cuda:13.0.x-base-ubuntu22.04).  The host copy's extra top-level
#     include/nv/ (a duplicate of include/cccl/nv/) is removed, as CUDA 13 packages keep CCCL
#     only under include/cccl/ (which nvcc.profile adds with -isystem),
#   - the nvidia/cuda image ENV (PATH, LD_LIBRARY_PATH, NVIDIA_*), TORCH_CUDA_ARCH_LIST,
#     WORKDIR /vllm-workspace,
#     ENTRYPOINT ["vllm", "serve"].
# Not reproduced: gcc/g++ (the project Dockerfile installs build-essential itself), uv,
# FlashInfer JIT cache, DeepEP/gdrcopy/NCCL dev packages, cuBLAS/cuRAND dev headers, the NVIDIA
# apt repository (unreachable here: the project's apt fallback branch cannot be exercised).
FROM snapmla-standin-rootfs:bookworm
# build_check.sh tries the real image again whenever the tag holds this stand-in.
LABEL org.vllm-snapmla.standin="true"

ENV DEBIAN_FRONTEND=noninteractive \
    NVARCH=x86_64 \
    CUDA_VERSION=13.0.2 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# ENVIRONMENT ADAPTATION, not part of the real image: the host's extra CA certificates (a host
# that reaches PyPI through a TLS-intercepting egress proxy needs them) are trusted
# system-wide (pip >= 24.2 uses the system store through truststore).  Needed by every later pip download, including the
# project Dockerfile's `pip install setuptools wheel ninja`.
COPY host-ca/ /usr/local/share/ca-certificates/

RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl git sudo \
       python3 python3-dev python3-venv \
    && update-ca-certificates \
    && rm -f /usr/lib/python3.*/EXTERNALLY-MANAGED \
    && rm -rf /var/lib/apt/lists/*

# pip bootstrap (the real image pipes get-pip.py into python; bootstrap.pypa.io is unreachable
# here, so the newest pip wheel is fetched through the PyPI simple index and installs itself).
RUN url="$(curl -fsS https://pypi.org/simple/pip/ \
          | grep -o 'https://files.pythonhosted.org/[^"#]*/pip-[0-9.]*-py3-none-any.whl' \
          | sort -t- -k2,2V | tail -1)" \
    && curl -fsSL -o "/tmp/${url##*/}" "$url" \
    && python3 "/tmp/${url##*/}/pip" install --no-cache-dir "/tmp/${url##*/}" \
    && rm "/tmp/${url##*/}" \
    && python3 -m pip --version

WORKDIR /vllm-workspace

RUN python3 -m pip install --no-cache-dir vllm==0.26.0 \
    && python3 -c "import torch, vllm; print(vllm.__version__, torch.__version__, torch.version.cuda)"

COPY cuda-13.0 /usr/local/cuda-13.0
RUN ln -s /usr/local/cuda-13.0 /usr/local/cuda && nvcc --version

ENV LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib:/usr/local/nvidia/lib64

# The real image's vllm-openai-base stage sets TORCH_CUDA_ARCH_LIST (value for v0.26.0 not known
# here; a representative list).  The project's setup.py passes explicit -gencode flags, so torch
# must ignore it: kept here to check exactly that.
ENV TORCH_CUDA_ARCH_LIST="7.5 8.0 8.9 9.0 10.0 12.0"

ENTRYPOINT ["vllm", "serve"]
