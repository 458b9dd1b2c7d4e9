#!/usr/bin/env bash
# Run THERE (a lent GPU machine), from the repository root, in one device call:
#
#   run(carry=[".whl"], timeout_s=540,
#       command="bash benchmarks/device/check.sh all")
#
# after benchmarks/device/wheels.sh has filled .whl/ here. A session's device time (15
# minutes, the machine's start included) holds one such call, so the stages run in the
# order of what #23 needs most: `all` = bench tests quant profile.
#   bench   python -m benchmarks.gpu --parts kernels,engine,grpc: the attention kernels,
#           the decode steps, the 256-request workload in process and over gRPC
#           (the acceptance figures), into $OUT/gpu.json, to copy to docs/perf/gpu.json
#   tests   the kernel tests on the GPU (tests/kernels: every kernel, bf16 too, the engine on
#           the Triton path with its staged inputs, CUDA graphs), sampling, FP8/INT8 and
#           overlapped steps on CUDA (the other folders import packages the image lacks);
#           $TESTS_SELECT: other pytest arguments instead (a file, -k ...)
#   quant   python -m benchmarks.gpu --parts quantized: FP8/INT8 against bf16, added to
#           $OUT/gpu.json
#   profile python -m benchmarks.profile on the bench stage's random model (written here if
#           missing), at 32 sequences and at 1: the step timeline over gRPC with the
#           device's idle gap between steps (CUDA events), into $OUT/profile_gpu*.json
#           (capped: $PROFILE_TIMEOUT, 150). Last: within one 540 s call it runs only if
#           the stages before finish early; `check.sh profile` is a call of its own.
#           PROFILE_AHEAD1=1 also runs each with --steps-ahead 1 (profile_gpu_*_ahead1.json,
#           no plot): the device's idle time two steps ahead (the default) and one.
#   variants not in `all`: python -m benchmarks.gpu_variants, the batch-1 step's kernels by
#           config and split count (the linears' matrix-vector configs and candidates,
#           decode attention's splits) into $OUT/gpu_variants.json (capped:
#           $VARIANTS_TIMEOUT, 150): what to change next for batch 1 <= 0.8 ms
#   host    not in `all`: python -m benchmarks.compute_host --grpc on CUDA, a tiny model
#           (its device step far shorter than the host's): the compute-plane server's
#           host time per decode step at 32 sequences with the engine's calls on a worker
#           thread and on the event loop (--engine-thread on/off, alternated), into
#           $OUT/compute_host_grpc_gpu.json (capped: $HOST_TIMEOUT, 240; 4 server starts,
#           the report written at the end)
#   mixed   not in `all`: python -m benchmarks.gpu --parts mixed, the piecewise CUDA graphs
#           (steps with prefill chunks, each way; the workload in process with and
#           without them) into $OUT/gpu_mixed.json (capped: $MIXED_TIMEOUT, 240)
#   cupy    not in `all`: the KV-cache kernels' CuPy (compute_plane/kernels/cache_ops.py):
#           where CuPy found NVRTC and the warm-up's check of the kernels
#           (benchmarks/device/cupy_check.py: every variant compiled, each run once against
#           torch's indexing), then their tests on the GPU, the fallback's too (a kernel
#           NVRTC refuses: one WARNING at warm-up, torch's path, the engine's tokens
#           unchanged) (capped: $CUPY_TIMEOUT, 180)
#   steps   not in `all`: the engine's start-up choice of the small-step linears
#           (fused_rows, fused_linear_timings) and the decode steps at batch 1/64/256
#           each way (benchmarks/device/steps.py), into $OUT/steps_head.json; with
#           $BASE_TREE (a copy of an older commit's tree) that tree's too, after it
#           (a short call after a kernel change)
# Logs land in $OUT/check.log and reports in $OUT (they come back, also from a call stopped
# at its limit; a call brings back at most 8 files, so the stages share one log).
# gpu.json is written after each part, and a part that fails is recorded in its `errors`
# while the next one runs; the bench stage stops after $BENCH_TIMEOUT seconds (420 unless
# set), the tests stage after $TESTS_TIMEOUT (180). $BENCH_PARTS: the bench stage's --parts
# (kernels,engine,grpc unless set), $BENCH_ARGS more arguments of it (--grpc-paths grpc).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/check.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/check.log"
stages=("$@")
[ "${stages[0]:-all}" = all ] && stages=(bench tests quant profile)
rc=0
for stage in "${stages[@]}"; do
  case "$stage" in
    tests)
      # capped, so that a stage of first compiles that runs long leaves quant its time
      # (8 workers, a module each: on 2026-11-26 one process reached 36 of the 216 tests in
      # 120 s, compiling each kernel variant in turn; pytest-xdist is in the image. -v: each
      # test's outcome is logged as it ends, since a pytest stopped at the cap printed no
      # summary that day)
      timeout -s INT -k 30 "${TESTS_TIMEOUT:-180}" python3 -m pytest -v -p no:cacheprovider \
        -n 8 --dist loadfile ${TESTS_SELECT:-tests/kernels \
        tests/compute/test_sampler.py tests/compute/test_scaled.py tests/compute/test_overlap.py} \
        2>&1 | tee -a "$OUT/check.log"
      rc=$((rc | PIPESTATUS[0]))
      ;;
    bench)
      # capped too (a hang in this process would hold the call to its end), and each
      # gRPC path within --path-timeout
      timeout -s INT -k 30 "${BENCH_TIMEOUT:-420}" python3 -m benchmarks.gpu \
        --parts "${BENCH_PARTS:-kernels,engine,grpc}" --path-timeout 150 ${BENCH_ARGS:-} \
        --out "$OUT/gpu.json" 2>&1 \
        | tee -a "$OUT/check.log"
      rc=$((rc | PIPESTATUS[0]))
      ;;
    mixed)
      # the piecewise graphs: the steps the decode graphs leave each way, the workload in
      # process with every size, none and the default sizes (`benchmarks.gpu --parts mixed`)
      timeout -s INT -k 30 "${MIXED_TIMEOUT:-240}" python3 -m benchmarks.gpu --parts mixed \
        --out "$OUT/gpu_mixed.json" 2>&1 | tee -a "$OUT/check.log"
      rc=$((rc | PIPESTATUS[0]))
      ;;
    quant)
      python3 -m benchmarks.gpu --parts quantized --out "$OUT/gpu.json" 2>&1 \
        | tee -a "$OUT/check.log"
      rc=$((rc | PIPESTATUS[0]))
      ;;
    profile)
      # (the model the bench stage wrote; async scheduling is on by default for a GPU)
      timeout -s INT -k 30 "${PROFILE_TIMEOUT:-150}" bash -c '
        python3 -c "from pathlib import Path; from benchmarks.gpu import write_random_model
write_random_model(Path(\"/tmp/qwen3-0.6b-random\"))" || exit 1  # (written once)
        for n in 32 1; do
          python3 -m benchmarks.profile --model /tmp/qwen3-0.6b-random --concurrency "$n" \
            --out "$OUT/profile_gpu_$n.json" --plot "$OUT/profile_gpu_$n.png" || exit 1
          # PROFILE_AHEAD1=1: also one step ahead (the default before 2026-11-26), no plot
          if [ -n "${PROFILE_AHEAD1:-}" ]; then
            python3 -m benchmarks.profile --model /tmp/qwen3-0.6b-random --concurrency "$n" \
              --steps-ahead 1 --out "$OUT/profile_gpu_${n}_ahead1.json" \
              --plot "/tmp/profile_gpu_${n}_ahead1.png" || exit 1
          fi
        done' 2>&1 | tee -a "$OUT/check.log"
      rc=$((rc | PIPESTATUS[0]))
      ;;
    variants)
      timeout -s INT -k 30 "${VARIANTS_TIMEOUT:-150}" python3 -m benchmarks.gpu_variants \
        --out "$OUT/gpu_variants.json" 2>&1 | tee -a "$OUT/check.log"
      rc=$((rc | PIPESTATUS[0]))
      ;;
    host)
      timeout -s INT -k 30 "${HOST_TIMEOUT:-240}" python3 -m benchmarks.compute_host --grpc \
        --seqs 32 --steps 300 --runs 2 --compute-arg=--device=cuda \
        --compute-arg=--engine-thread=on --compare-arg=--engine-thread=off \
        --out "$OUT/compute_host_grpc_gpu.json" 2>&1 | tee -a "$OUT/check.log"
      rc=$((rc | PIPESTATUS[0]))
      ;;
    steps)
      # the engine's start-up choice of the small-step linears and the decode steps alone
      # (benchmarks/device/steps.py: each way of launching): a short call after a kernel
      # change; $BASE_TREE: an older commit's tree copied into this one (`git archive REV |
      # tar -x -C .base`, carried), timed after this tree in the same call, in its own process
      for tree in . ${BASE_TREE:-}; do
        label=$([ "$tree" = . ] && echo head || basename "$tree")
        TRITON_PRINT_AUTOTUNING=1 PYTHONPATH="/tmp/site:$(cd "$tree" && pwd)" \
          timeout -s INT -k 30 "${STEPS_TIMEOUT:-180}" python3 benchmarks/device/steps.py \
          --label "$label" --out "$OUT/steps_${label#.}.json" 2>&1 | tee -a "$OUT/check.log"
        rc=$((rc | PIPESTATUS[0]))
      done
      ;;
    cupy)
      { timeout -s INT -k 30 60 python3 benchmarks/device/cupy_check.py \
        && timeout -s INT -k 30 "${CUPY_TIMEOUT:-180}" python3 -m pytest -v -p no:cacheprovider \
          tests/kernels/test_cache_ops.py \
          tests/kernels/test_engine_triton.py::test_warm_up_checks_the_cupy_kernels_and_a_failure_only_warns
      } 2>&1 | tee -a "$OUT/check.log"
      rc=$((rc | PIPESTATUS[0]))
      ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
exit "$rc"
