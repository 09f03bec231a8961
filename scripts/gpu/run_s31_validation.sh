#!/usr/bin/env bash
# One device call validating a build (main plus the early-weights commits) on one GPU: every CUDA
# suite of the bundle (kernels, the experts sweep, the graphed engine, host uploads, CUDA
# shared-memory regions, the registry's CUDA combinations), racecheck on the PDL chain tests,
# then the early-weights A/B's second round (run_early_weights_ab.sh, settings in reversed order).
# Usage: run_s31_validation.sh BUNDLE.tgz (bin/: the test binaries, engine_forward_bench,
# moe_experts_bench). Writes under $OUT.
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_device_script "$1" || exit 1
run_gtest cuda_kernels_test 120
run_gtest host_upload_test 60
run_gtest shared_memory_cuda_test 90
run_gtest engine_cuda_test 200
run_gtest engine_mk_combinations_test 200 --gtest_filter='*Cuda*:*cuda*'
run_gtest cuda_experts_test 300
cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
[ -n "$cs" ] && timeout 120 "$cs" --tool racecheck --error-exitcode 3 "$B/cuda_kernels_test" \
  --gtest_filter='*WeightsBeforeWait*:*DecodePair*' > "$OUT/racecheck.log" 2>&1
echo "racecheck rc=$? $(grep -E 'RACECHECK SUMMARY|PASSED|FAILED' "$OUT/racecheck.log" | tr '\n' ' ')"
SA_READY=1 SKIP_TESTS=1 FIRST_ROUND=2 ROUNDS=2 bash scripts/gpu/run_early_weights_ab.sh "$1"
