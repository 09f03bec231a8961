#!/usr/bin/env bash
# MoeAlign with its ids loaded 8 rows at a time: the kernel tests, then Nsight Compute durations
# of MoeAlignKernel (before / after) at 8192, 2048, 512 and 128 routes (seed layer, top-8).
set -u
source scripts/gpu/bundle_lib.sh
OUT=/tmp/al_out
start_device_script "$1" || exit 1
timeout 100 "$B/cuda_kernels_test" > "$OUT/kt.log" 2>&1
echo "cuda_kernels_test rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/kt.log" | tr '\n' ' ')"
if command -v compute-sanitizer > /dev/null; then
  timeout 100 compute-sanitizer --tool racecheck "$B/cuda_kernels_test" --gtest_filter='*Align*' > "$OUT/rc.txt" 2>&1
  echo "racecheck align: $(grep -E 'RACECHECK SUMMARY|PASSED|FAILED' "$OUT/rc.txt" | tr '\n' ' ')"
fi
for t in 1024 256 64 16; do for b in before after; do
  bin="$B/moe_experts_bench"; [ $b = before ] && bin="$B/moe_experts_bench_before"
  MOESERVE_BENCH_PATHS=decode MOESERVE_BENCH_FORMATS=bf16 MOESERVE_BENCH_TOKENS=$t MOESERVE_BENCH_LAYERS=seed \
    MOESERVE_BENCH_ROUTING=balanced timeout 100 ncu --clock-control none --kernel-name regex:MoeAlign \
    --launch-skip 5 --launch-count 5 --metrics gpu__time_duration.sum "$bin" > "$OUT/n.txt" 2>&1
  echo "align $t tokens $b: $(grep -E 'gpu__time' "$OUT/n.txt" | awk '{printf "%s ", $3}') ($(grep -m1 -E 'gpu__time' "$OUT/n.txt" | awk '{print $2}'))"
done; done
