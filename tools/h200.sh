#!/usr/bin/env bash
# One stage of a lease on the lent H200 (see docs/development.md).  Run from the repo root there:
#   bash tools/h200.sh STAGE [args]        logs go to $OUT/<stage>.log
# Stages: stash K (move .devcache/vllm-site.partK aside; carry that part with the call) |
#         setup (unpack vLLM, build the extension) | kernels | sm90 | e2e | serve | bench | train | parity
set -uo pipefail
stage=${1:?stage}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=16 SNAPMLA_ARCHS=${SNAPMLA_ARCHS:-90a}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
[ -d /root/site ] && export PYTHONPATH=/root/site:$PWD
log="$OUT/$stage.log"
run() { echo "+ $*" | tee -a "$log"; "$@" 2>&1 | tee -a "$log"; }
case "$stage" in
  stash)  mkdir -p /root/stash && mv ".devcache/vllm-site.part$2" /root/stash/ && ls /root/stash ;;
  setup)
    if [ ! -d /root/site/vllm ]; then
      mkdir -p /root/site && cat /root/stash/vllm-site.part* | xz -d -T0 | tar x -C /root/site
    fi
    export PYTHONPATH=/root/site:$PWD
    run nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
    run python3 -m pip install -q -v --no-build-isolation --no-deps -e . | grep -E "registers|spill|error" ;;
  kernels) run timeout 300 python3 -m pytest tests/gpu -q -rs ;;
  sm90)
    CUDA_LAUNCH_BLOCKING=1 run timeout 150 python3 -m pytest tests/gpu/test_decode_sm90.py -x -q \
        -k "few_pages or rejects or spare"
    run timeout 400 python3 -m pytest tests/gpu/test_decode_sm90.py tests/gpu/test_decode_kernels.py -q -k sm90 ;;
  e2e)    run timeout 500 python3 -m pytest tests/e2e/test_llm_generate.py -v -s ;;
  serve)  run timeout 500 python3 -m pytest tests/e2e/test_serve.py tests/e2e/test_serve_load.py -v -s ;;
  bench)
    run timeout 280 python3 benchmarks/bench_decode.py --out "$OUT/decode"
    run timeout 120 python3 benchmarks/bench_cache_ops.py --out "$OUT/cache_ops.csv" ;;
  train)  run timeout 590 python3 eval/train_tiny_mla.py --out build/tiny-mla --minutes 8 --seed 0 &&
          cp build/tiny-mla/train_log.json "$OUT/" ;;
  parity) run timeout 590 python3 eval/parity_tiny.py --model build/tiny-mla --out build/parity-tiny &&
          cp -r build/parity-tiny "$OUT/" ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
