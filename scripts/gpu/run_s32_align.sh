#!/usr/bin/env bash
# One device call for the multi-block MoeAlign (LaunchMoeAlign with scratch): the kernel tests
# (the align against its reference, with and without scratch), memcheck on them, the experts
# sweep and the engine tests, Nsight Compute durations of the align kernels at 8192 routes, and
# bench_moe.py at 256 and 1024 tokens with the one-block align as the "before" column (the same
# binary with MOESERVE_BENCH_ALIGN_SCRATCH=0).
# Usage: run_s32_align.sh BUNDLE.tgz (bin/: cuda_kernels_test, cuda_experts_test,
# engine_cuda_test, moe_experts_bench). Writes under $OUT.
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_device_script "$1" || exit 1
run_gtest cuda_kernels_test 300
if [ -z "${QUICK:-}" ]; then  # QUICK=1: the kernel tests and the benchmark only
cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
timeout 300 "$cs" --tool memcheck --error-exitcode 3 "$B/cuda_kernels_test" --gtest_filter='*Align*' \
  > "$OUT/memcheck_align.log" 2>&1
echo "memcheck align rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/memcheck_align.log" | tr '\n' ' ')"
run_gtest cuda_experts_test 400
run_gtest engine_cuda_test 300
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for sc in 0 1; do
  MOESERVE_BENCH_ALIGN_SCRATCH=$sc MOESERVE_BENCH_LAYERS=dsv3 MOESERVE_BENCH_TOKENS=256,1024 \
    MOESERVE_BENCH_FORMATS=bf16 MOESERVE_BENCH_ROUTING=balanced MOESERVE_BENCH_PATHS=grouped \
    timeout 150 "$NCU" --clock-control none -k regex:MoeAlign --launch-skip 8 -c 4 \
    --metrics gpu__time_duration.sum "$B/moe_experts_bench" > "$OUT/ncu_align_$sc.txt" 2>&1
  echo "== align, scratch=$sc (256 then 1024 tokens; 2048 / 8192 routes): rc=$?"
  grep -E "MoeAlign\w*Kernel|gpu__time_duration" "$OUT/ncu_align_$sc.txt" |
    sed -E 's/\(const int.*//; s/^ +//' | paste - - | awk '{print "  " $1, $(NF)}'
done
fi
printf '#!/bin/sh\nMOESERVE_BENCH_ALIGN_SCRATCH=0 exec %s "$@"\n' "$B/moe_experts_bench" \
  > "$B/bench_one_block_align"
chmod +x "$B/bench_one_block_align"
mkdir -p "$OUT/moe"
MOESERVE_BENCH_TOKENS=${TOKENS:-256,1024} MOESERVE_BENCH_FORMATS=${FORMATS:-bf16,mxfp8} timeout 420 \
  python3 scripts/gpu/bench_moe.py "$B/moe_experts_bench" "$OUT/moe" "$B/bench_one_block_align" \
  > "$OUT/bench_moe.log" 2>&1
echo "bench_moe rc=$?"
grep -E '^device:' "$OUT/moe/results.md"
head -3 "$OUT/moe/results.md" | tail -2 | cut -c1-300
grep -E '^\| (seed|dsv3) ' "$OUT/moe/results.md" | tr -s ' ' | cut -c1-220
