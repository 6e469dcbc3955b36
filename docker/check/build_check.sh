#!/usr/bin/env bash
# Builds docker/Dockerfile and checks the image without a GPU (docker/README.md, "What has been checked").
# Written for a Debian 12 host as root where Docker Hub is unreachable: it then builds a stand-in
# for vllm/vllm-openai:v0.26.0 (docker/check/standin.Dockerfile: Debian rootfs, pip's vLLM 0.26.0,
# the host's CUDA 13.0 toolkit, the host's extra CA certificates for a TLS-intercepting proxy).
#   usage: bash docker/check/build_check.sh [REPO=.] [MAX_JOBS=2]   (work folder /tmp/dockertest)
set -euo pipefail
REPO="$(cd "${1:-.}" && pwd)"
MAX_JOBS="${2:-2}"
T=/tmp/dockertest
mkdir -p "$T"
cd "$T"
ts() { date +%s; }

# ---- 1. Docker engine (Debian's docker.io 20.10 daemon; the host CLI is 28.2, no buildx,
#         so `docker build` uses the legacy builder).
if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y docker.io debootstrap
    nohup dockerd >"$T/dockerd.log" 2>&1 &
    echo $! >"$T/dockerd.pid"
    for _ in $(seq 30); do docker info >/dev/null 2>&1 && break; sleep 1; done
    # fallbacks if the default (overlay2 + bridge) does not come up:
    #   dockerd --storage-driver=vfs --iptables=false --bridge=none   (then build with --network host)
fi
docker info --format 'server {{.ServerVersion}}, storage {{.Driver}}'

# ---- 2. The real base image, if the registry is reachable (also where the tag holds a stand-in
#         from an earlier run: a pull replaces it).
standin_label() { docker image inspect -f '{{index .Config.Labels "org.vllm-snapmla.standin"}}' \
    vllm/vllm-openai:v0.26.0 2>/dev/null; }
if ! docker image inspect vllm/vllm-openai:v0.26.0 >/dev/null 2>&1 || [ "$(standin_label)" = true ]; then
    if timeout 60 docker pull vllm/vllm-openai:v0.26.0; then
        echo "using the REAL base image"
    else
        # ---- 3. Stand-in base image (see $T/standin/Dockerfile for what it reproduces).
        echo "registry unreachable: building the STAND-IN base image"
        if ! docker image inspect snapmla-standin-rootfs:bookworm >/dev/null 2>&1; then
            command -v debootstrap >/dev/null || apt-get install -y debootstrap
            rm -rf "$T/rootfs"; mkdir -p "$T/rootfs"
            debootstrap --variant=minbase --include=ca-certificates bookworm "$T/rootfs" \
                http://deb.debian.org/debian
            tar -C "$T/rootfs" -c . | docker import - snapmla-standin-rootfs:bookworm
        fi
        mkdir -p "$T/standin"
        if [ ! -d "$T/standin/cuda-13.0" ]; then
            cp -a /usr/local/cuda-13.0 "$T/standin/cuda-13.0"
            # CUDA 13 packages keep CCCL only under include/cccl/; the host copy has an extra include/nv/
            rm -rf "$T/standin/cuda-13.0/targets/x86_64-linux/include/nv"
        fi
        mkdir -p "$T/standin/host-ca"
        cp "$REPO/docker/check/standin.Dockerfile" "$T/standin/Dockerfile"
        cp /usr/local/share/ca-certificates/*.crt "$T/standin/host-ca/" 2>/dev/null || true
        s=$(ts)
        docker build -t vllm/vllm-openai:v0.26.0 "$T/standin" 2>&1 | tee "$T/standin_build.log"
        echo "stand-in build: $(( $(ts) - s )) s"
    fi
fi

# ---- 4. The project image, from a clean copy of the committed tree (HEAD), as docker/README.md says.
rm -rf "$T/src"; mkdir -p "$T/src"
git -C "$REPO" archive HEAD | tar x -C "$T/src"
# To check uncommitted docker/ edits as well, copy them over the archive:
cp "$REPO/docker/Dockerfile" "$REPO/docker/README.md" "$T/src/docker/"
cd "$T/src"
s=$(ts)
docker build -f docker/Dockerfile --build-arg MAX_JOBS="$MAX_JOBS" -t vllm-snapmla . 2>&1 \
    | tee "$T/project_build.log"
echo "project build: $(( $(ts) - s )) s"

# ---- 5. What the image holds (no GPU here).
docker image inspect vllm-snapmla --format 'size={{.Size}} entrypoint={{json .Config.Entrypoint}} cmd={{json .Config.Cmd}} workdir={{.Config.WorkingDir}}'
docker image ls vllm-snapmla
set +e
docker run --rm --entrypoint python3 vllm-snapmla -c \
    "import vllm_snapmla, vllm_snapmla._C; import vllm; print(vllm.__version__)"
echo "rc=$?"
docker run --rm --entrypoint python3 vllm-snapmla -c \
    "from vllm_snapmla import register; register(); print('ok')"
echo "rc=$?"
