#!/usr/bin/env bash
# One device call for the warpgroup-MMA tiles (64/128/256 tokens wide, software-pipelined):
# the kernel tests (GroupedGemmWgmmaTilesMatchReference forces them at every width), the experts
# sweep, compute-sanitizer on the new test and on the experts cases that take the new tiles, then
# bench_moe.py (default dispatch: wgmma from kMxfp8WgmmaMinRoutes) against the same binary with
# MOESERVE_BENCH_WGMMA_FROM=-1 (the mma.sync decode tiles up to 128 routes: the "before us"
# column) and PyTorch, and Nsight Compute on the 256-token seed
# launches. Usage: run_wgmma_check.sh BUNDLE.tgz (DIR/{bin,lib}:
# cuda_kernels_test, cuda_experts_test, engine_cuda_test, moe_experts_bench). Writes under $OUT.
set -u
source "$(dirname "$0")/bundle_lib.sh"
start_device_script "$1" || exit 1
for t in cuda_kernels_test engine_cuda_test cuda_experts_test; do run_gtest $t 300; done
if command -v compute-sanitizer > /dev/null; then
  for tool in memcheck racecheck synccheck; do
    timeout 150 compute-sanitizer --tool $tool "$B/cuda_kernels_test" \
      --gtest_filter='*Wgmma*' > "$OUT/sanitizer_$tool.txt" 2>&1
    echo "sanitizer $tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$OUT/sanitizer_$tool.txt" | tr '\n' ' ')"
  done
  # The experts cases that take the 64- and 128-token tiles (40-75 routes per expert).
  timeout 200 compute-sanitizer --tool memcheck "$B/cuda_experts_test" \
    --gtest_filter='*M160_E16_k4_H256_I128_*:*M100_E8_k4_H264_I96_*:*M300_E32_k8_H1024_I320_*' \
    > "$OUT/sanitizer_experts.txt" 2>&1
  echo "sanitizer memcheck experts: $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/sanitizer_experts.txt" | tr '\n' ' ')"
fi
cat > /tmp/bench_default.sh <<EOS
#!/bin/sh
MOESERVE_BENCH_WGMMA_FROM=-1 exec "$B/moe_experts_bench"
EOS
chmod +x /tmp/bench_default.sh
export MOESERVE_BENCH_FORMATS=${FORMATS:-bf16,mxfp8} MOESERVE_BENCH_TOKENS=${TOKENS:-128,256,512,1024}
timeout 400 python3 "$(dirname "$0")/bench_moe.py" \
  "$B/moe_experts_bench" "$OUT" /tmp/bench_default.sh > "$OUT/bench.log" 2>&1
echo "bench_moe rc=$?"
if command -v ncu > /dev/null; then
  MOESERVE_BENCH_PATHS=decode MOESERVE_BENCH_TOKENS=256 \
    MOESERVE_BENCH_LAYERS=seed MOESERVE_BENCH_ROUTING=balanced \
    timeout 200 ncu --clock-control none --kernel-name regex:MoeGemmWgmma --launch-skip 10 \
    --launch-count 2 --section SpeedOfLight --section LaunchStats --section Occupancy \
    --section WarpStateStats "$B/moe_experts_bench" > "$OUT/ncu_256.txt" 2>&1
  echo "ncu rc=$?"
  grep -E "MoeGemmWgmma|Duration|DRAM Throughput|Compute \(SM\)|Registers|Stall" "$OUT/ncu_256.txt" | head -30
fi
cat "$OUT/results.md" 2>/dev/null | grep -E "^\||crossover|device"
