#!/usr/bin/env bash
# Nsight Compute on the two-CTA cluster decode tile against the narrow decode tile: the seed
# layer's W13 decode launch at 16 tokens balanced, MOESERVE_DECODE_PAIR=0 and 1 (2026-12-03 run:
# tests/cuda/logs/2026-12-03-1850-h200-decode-pair/call2-ncu). Usage: diag_pair.sh BUNDLE.tgz.
set -u
source "$(dirname "$0")/bundle_lib.sh"
start_device_script "$1" || exit 1
export MOESERVE_BENCH_LAYERS=seed MOESERVE_BENCH_TOKENS=16 MOESERVE_BENCH_FORMATS=mxfp8 \
  MOESERVE_BENCH_ROUTING=balanced MOESERVE_BENCH_PATHS=decode
for set in 0 1; do
  k=MoeGemmKernel; [ $set = 1 ] && k=MoeGemmPairKernel
  MOESERVE_DECODE_PAIR=$set timeout 150 ncu --clock-control none -k regex:$k --launch-skip 4 -c 2 \
    --section SpeedOfLight --section SchedulerStats --section Occupancy --section LaunchStats \
    --section WarpStateStats "$B/moe_experts_bench" > "$OUT/ncu_pair$set.txt" 2>&1
  echo "== pair=$set rc=$?"
  grep -E "Kernel<|Duration|DRAM Throughput|Issue Slots Busy|One or More Eligible|Achieved Occupancy|Theoretical Occupancy|Block Limit|Grid Size|Cluster|Registers Per|Waves Per SM|Warp Cycles Per Issued" "$OUT/ncu_pair$set.txt" | sed 's/(MoeGemmParams.*//' | cut -c1-110
done
