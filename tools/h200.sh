#!/usr/bin/env bash
# One stage of a lease on the lent H200 (see docs/development.md).  Run from the repo root there:
#   bash tools/h200.sh STAGE [args]        logs go to $OUT/<stage>.log
# Stages: stash K (move .devcache/vllm-site.partK aside; carry that part with the call) |
#         setup (unpack vLLM, build the extension) | kernels | sm90 | e2e | serve | bench | train | parity
#         | ncu [SCHEDULES] | promotion | e2e-sm90 | bench-e2e ARGS | iter | narrow | narrow-bench
#         | verify | ab PATCH...
#         | lease6, quick (after stash 2)
# A whole lease in five calls (docs/development.md): `stash 0`, `stash 1` (each carrying its
# part), `stash 2 && lease4` (carrying part 2), `lease5` (carrying .whl).  Each lease call packs
# its logs and results into $OUT/<stage>.tgz (a call returns at most 8 files).
set -uo pipefail
stage=${1:?stage}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=16 SNAPMLA_ARCHS=${SNAPMLA_ARCHS:-90a}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
[ -d /root/site ] && export PYTHONPATH=/root/site:$PWD
log="$OUT/$stage.log"
run() { echo "+ $*" | tee -a "$log"; "$@" 2>&1 | tee -a "$log"; }
start=$(date +%s)
left() { echo $(( ${1:-570} - ($(date +%s) - start) )); }    # seconds left of a call's budget
pack() { mkdir -p /root/res; cp -r "$@" /root/res/ 2>/dev/null; tar czf "$OUT/$stage.tgz" -C /root res; }
unpack() {   # the vLLM bundle, stashed by the three `stash` calls
  [ -d /root/site/vllm ] ||
    { mkdir -p /root/site && cat /root/stash/vllm-site.part* | xz -d -T0 | tar x -C /root/site; }
  export PYTHONPATH=/root/site:$PWD
}
# fm: the FlashMLA backends' bench_decode.py prefix when the vLLM bundle is stashed (unpacked
# then), else empty.
flashmla_if_stashed() {
  fm=""
  if [ -f /root/stash/vllm-site.part2 ]; then unpack; fm=flashmla-bf16,flashmla-fp8,; fi
}
build() {
  run nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  # From scratch: build outputs outlive the calls of a lease, and the tree each call lays down
  # may be older than them, so ninja would keep an earlier call's objects (an A/B's last patch).
  rm -rf build vllm_snapmla/_C*.so
  run timeout 200 python3 -m pip install -q -v --no-build-isolation --no-deps -e . \
      | grep -E "registers|spill|error"
}
# The tiny model.  A fixed step count (what 6 minutes gave on 2026-12-01) makes the LR schedule
# and the data order independent of the wall clock and of what else runs on the GPU; 8 minutes
# is the cap.
TRAIN_TINY=(python3 eval/train_tiny_mla.py --out /root/tiny-mla --max-steps 1750 --minutes 8
            --seed 0)
case "$stage" in
  stash)  mkdir -p /root/stash && mv ".devcache/vllm-site.part$2" /root/stash/ && ls /root/stash ;;
  setup)  unpack; build ;;
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
  train)  run timeout 590 "${TRAIN_TINY[@]}" && cp /root/tiny-mla/train_log.json "$OUT/" ;;
  parity) run timeout 590 python3 eval/parity_tiny.py --model /root/tiny-mla --out /root/parity-tiny &&
          cp -r /root/parity-tiny "$OUT/" ;;
  ncu)      # Nsight Compute on one launch of sm90 schedules (args: schedules, then B,H,N,s_q;
            # no vLLM needed); the narrow kernel's launches match too
    build
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
    run timeout 300 "$NCU" --clock-control none --kernel-name "regex:decode_(narrow_)?kernel" \
        --set full --import-source no -f -o /root/sm90 python3 tools/profile_sm90.py \
        --schedules "${2:-free,split-roles}" --shape "${3:-32,128,16384,1}"
    "$NCU" -i /root/sm90.ncu-rep --page details --print-details all > /root/ncu_details.txt 2>&1 ||
      "$NCU" -i /root/sm90.ncu-rep --page details > /root/ncu_details.txt 2>&1
    "$NCU" -i /root/sm90.ncu-rep --page source --csv --print-source sass > /root/ncu_sass.csv 2>&1
    python3 tools/ncu_sass_summary.py /root/ncu_sass.csv > /root/ncu_summary.txt 2>&1
    pack /root/ncu_details.txt /root/ncu_sass.csv /root/ncu_summary.txt "$log" ;;
  e2e-sm90)    # FULL CUDA graphs and n-gram speculation in vLLM with the sm90 kernel forced (the
               # tiny model's 16 heads used to pick Triton); needs the unpacked vLLM bundle
    unpack
    SNAPMLA_DECODE_KERNEL=sm90 run timeout 400 python3 -m pytest \
        tests/e2e/test_cuda_graphs_spec_decode.py -v -s -rs -p no:cacheprovider ;;
  bench-e2e)   # vLLM decode throughput, auto vs fp8_snapmla vs fp8 (args: bench_e2e.py's)
    unpack
    python3 -c "import vllm_snapmla._C" 2>/dev/null || build   # built once per warm machine
    run timeout $(left 590) python3 benchmarks/bench_e2e.py --out /root/bench_e2e "${@:2}"
    pack /root/bench_e2e "$log" ;;
  promotion)   # the sm90 kernel with and without per-page PV promotion, up to 131072 tokens
    build
    run timeout 300 python3 benchmarks/pv_promotion_error.py --out /root/pv_promotion
    pack /root/pv_promotion "$log" ;;
  narrow)   # the narrow kernel (<= 32 rows): build, its tests and accuracy table
    build
    CUDA_LAUNCH_BLOCKING=1 run timeout 120 python3 -m pytest tests/gpu/test_decode_sm90.py -x -q \
        -p no:cacheprovider -k "narrow_few_pages" || exit 1
    run timeout $(left 480) python3 -m pytest tests/gpu/test_decode_sm90.py -q -p no:cacheprovider -k narrow
    run timeout $(left 580) python3 benchmarks/narrow_accuracy.py --seeds 4 ;;
  narrow-bench)   # after `narrow` on the same machine: timing at NARROW_HEADS (default 16 32)
                  # against split-roles, and FlashMLA when the vLLM bundle is stashed
    flashmla_if_stashed; backends=${fm}snapmla-sm90,snapmla-sm90-split-roles
    python3 -c "import vllm_snapmla._C" 2>/dev/null || build
    run timeout $(left 580) python3 benchmarks/bench_decode.py --out /root/bench_decode \
        --heads ${NARROW_HEADS:-16 32} --backends "$backends"
    pack /root/bench_decode "$log" ;;
  verify)   # build, all of tests/gpu, timing at VERIFY_HEADS (default 16 32 64: ours, narrow-16,
            # split-roles), then page times with the pages in HBM and in L2; with the vLLM
            # bundle stashed also FlashMLA in the timing and the 1-draft n-gram e2e (the narrow
            # 32-row form under vLLM's FULL graphs)
    flashmla_if_stashed
    build
    run timeout $(left 300) python3 -m pytest tests/gpu -q -p no:cacheprovider
    run timeout $(left 360) python3 benchmarks/bench_decode.py --out /root/bench_decode \
        --heads ${VERIFY_HEADS:-16 32 64} \
        --backends ${fm}snapmla-sm90,snapmla-sm90-narrow-16,snapmla-sm90-split-roles
    pack /root/bench_decode "$log"
    [ -n "$fm" ] && SNAPMLA_DECODE_KERNEL=sm90 run timeout $(left 540) python3 -m pytest \
        tests/e2e/test_cuda_graphs_spec_decode.py -q -rs -p no:cacheprovider -k 1-drafts
    for shape in 64,16,32768,1 64,16,32768,2; do
      for d in 0 64; do
        [ "$(left 585)" -gt 15 ] && run timeout $(left 585) python3 tools/profile_sm90.py --time \
            --shape $shape --schedules narrow,narrow-16 --distinct-blocks $d
      done
    done
    pack /root/bench_decode "$log" ;;
  ab)   # same-lease A/B: main's tree, then each PATCH (git apply) in turn, built and timed by
        # bench_decode.py (snapmla-sm90, plus the bench names a patch adds, plus FlashMLA when
        # the vLLM bundle is stashed; a patch only after its tests pass: AB_TESTS, a pytest -k
        # expression on tests/gpu/test_decode_sm90.py, default its few_pages/bit-identity
        # tests), BENCH_ARGS default --heads 128; AB_ACCURACY=1 adds
        # benchmarks/narrow_accuracy.py per patch; each patch is reverted after its run
    mkdir -p /root/ab
    flashmla_if_stashed
    for v in main "${@:2}"; do
      name=$(basename "$v" .patch)
      if [ "$v" != main ] && ! git apply "$v"; then echo "== $name does not apply" | tee -a "$log"; continue; fi
      build > /dev/null
      backends=${fm}snapmla-sm90
      [ "$v" != main ] && for b in $(grep -oE '^\+ +"snapmla-sm90-[a-z0-9-]+"' "$v" | grep -oE 'snapmla-sm90-[a-z0-9-]+'); do
        backends=$backends,$b
      done
      echo "== $name ($(( $(date +%s) - start )) s)" | tee -a "$log"
      # the smallest cases and the bit-identity tests first, with a short timeout: a variant's
      # missed barrier arrival hangs
      if [ "$v" != main ] && ! run timeout 150 python3 -m pytest tests/gpu/test_decode_sm90.py -q -x \
          -p no:cacheprovider -k "${AB_TESTS:-few_pages or bit_identical}"; then
        echo "== $name failed its tests: not timed" | tee -a "$log"; git apply -R "$v"; continue
      fi
      run timeout $(left 560) python3 benchmarks/bench_decode.py --out "/root/ab/$name" \
          --backends "$backends" ${BENCH_ARGS:---heads 128}
      [ "${AB_ACCURACY:-0}" = 1 ] && [ "$v" != main ] && run timeout $(left 560) \
          python3 benchmarks/narrow_accuracy.py --seeds 4
      [ "$v" != main ] && git apply -R "$v"
      [ "$(left 560)" -lt 60 ] && { echo "stopping: out of time" | tee -a "$log"; break; }
    done
    pack /root/ab "$log" ;;
  lease6|quick|iter)
    # lease6 (after `stash 2`): the sm90 kernel's schedules, tested (bit-identity first, with a
    # short timeout: a missed barrier arrival hangs), timed against FlashMLA, then all of tests/gpu.
    # quick: lease6 without tests/gpu.  iter: quick without vLLM (no FlashMLA columns).
    backends=${BACKENDS:-snapmla-sm90,snapmla-sm90-split-roles}
    if [ "$stage" = iter ]; then build; else unpack; build; backends=flashmla-bf16,flashmla-fp8,$backends; fi
    run timeout 150 python3 -m pytest tests/gpu/test_decode_sm90.py -q -x -p no:cacheprovider \
        -k "few_pages or bit_identical" || exit 1
    run timeout $(left 400) python3 benchmarks/bench_decode.py --out /root/bench_decode \
        --backends "$backends" ${BENCH_ARGS:-}
    [ "$stage" = lease6 ] && run timeout $(left 570) python3 -m pytest tests/gpu -q -p no:cacheprovider
    [ "$stage" = iter ] || pack /root/bench_decode "$log" ;;
  lease4)   # after `stash 2`: training in the background, kernel tests, CUDA-graph and serve e2e
    unpack
    setsid nohup "${TRAIN_TINY[@]}" > /root/train.log 2>&1 < /dev/null &
    build
    setsid bash -c "timeout $(left 400) python3 -m pytest tests/gpu -q -rs -p no:cacheprovider \
        > /root/gpu.log 2>&1; echo rc=\$? >> /root/gpu.log" < /dev/null &
    timeout $(left 330) python3 -m pytest tests/e2e/test_cuda_graphs_spec_decode.py -v -s -rs \
        -p no:cacheprovider > /root/cg.log 2>&1; echo "cuda-graph e2e rc=$?" | tee -a "$log"
    grep -vE "DEBUG|Running batch" /root/cg.log | tail -60 | tee -a "$log"; xz -k -T0 /root/cg.log
    run timeout $(left 500) python3 -m pytest tests/e2e/test_serve.py tests/e2e/test_serve_load.py \
        -v -s -p no:cacheprovider
    while ! grep -q "^rc=" /root/gpu.log && [ $(left 560) -gt 0 ]; do sleep 2; done
    tail -30 /root/gpu.log
    for _ in $(seq 200); do pgrep -f train_tiny_mla >/dev/null || break; sleep 2; done
    run tail -4 /root/train.log; pack /root/gpu.log /root/train.log /root/cg.log.xz "$log" ;;
  lease5)   # benchmarks first (nothing else on the GPU), then the trained model's evidence
    run timeout 120 python3 benchmarks/bench_decode.py --out /root/bench_decode
    run timeout $(left 300) python3 eval/parity_tiny.py --model /root/tiny-mla \
        --out /root/parity-tiny --timeout 150
    if [ -d .whl ]; then   # lm-eval and its missing dependencies (eval/README.md), carried
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
          --target /root/lmeval .whl/*.whl
      PYTHONPATH=/root/lmeval:$PYTHONPATH run timeout $(left 450) python3 eval/lm_eval_tiny.py \
          --model /root/tiny-mla --out /root/lm-eval-tiny --kv auto,fp8_snapmla,fp8 \
          --bootstrap-iters 100
    fi
    python3 - <<'PY'
import numpy as np
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained("/root/tiny-mla")
ids = np.load("/root/tiny-mla/heldout_tokens.npy")[:8000].tolist()
open("/root/prompt.txt", "w").write(tok.decode(ids))
PY
    run timeout $(left 540) python3 eval/capture_vllm.py --model /root/tiny-mla \
        --out /root/capture.pt --prompt-file /root/prompt.txt --prompt-len 3000 \
        --gpu-memory-utilization 0.5
    run timeout $(left 575) python3 eval/fidelity.py --input /root/capture.pt --out /root/fidelity
    pack /root/tiny-mla/train_log.json /root/bench_decode /root/parity-tiny /root/lm-eval-tiny \
        /root/fidelity "$log" ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
