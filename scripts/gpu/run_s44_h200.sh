#!/usr/bin/env bash
# Session 44's first device call: cuda_kernels_test whole (the gather and unpermute tests landed
# in session 43 had not run in their final form) with memcheck on those two, then issue 12's
# full serving benchmark (run_serving_bench.sh) on main's defaults.
# Usage: run_s44_h200.sh BUNDLE.tgz   (make_ab_bundle.sh main main BUNDLE.tgz ab)
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_device_script "$1" || exit 1
date -u
t0=$(date +%s)
run_gtest cuda_kernels_test 120
cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
[ -n "$cs" ] && timeout 90 "$cs" --tool memcheck --error-exitcode 3 "$B/cuda_kernels_test" \
  --gtest_filter='*GatherRows*:*UnpermuteReduce*' > "$OUT/memcheck.log" 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/memcheck.log" | tr '\n' ' ')"
echo "tests $(( $(date +%s) - t0 )) s"
# The whole serving benchmark, as run_s36_serving.sh runs it (the bundle is unpacked already).
OUT=$OUT SA_READY=1 SERVING_S=${SERVING_S:-470} bash scripts/gpu/run_s36_serving.sh "$1"
echo "serving $(( $(date +%s) - t0 )) s"
