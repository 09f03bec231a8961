#!/usr/bin/env bash
# Quick device loop for the MXFP8 warpgroup-MMA tiles: the kernel tests, the raw kernel bench with
# the tiles from WGMMA_FROM routes per expert (0: the default) against the mma.sync tiles (-1),
# same binary; SMALL=16,64 forces the tiles at those token counts; Nsight Compute on the
# 256-token seed launches (NCU_ROUTING=hot for the hot routing). Usage: run_wgmma_quick.sh BUNDLE.tgz. Writes under $OUT.
set -u
source "$(dirname "$0")/bundle_lib.sh"
start_device_script "$1" || exit 1
run_gtest cuda_kernels_test 120
export MOESERVE_BENCH_FORMATS=${FORMATS:-mxfp8} MOESERVE_BENCH_PATHS=decode
for round in 1 2; do
  for from in -1 ${WGMMA_FROM:-0}; do
    MOESERVE_BENCH_WGMMA_FROM=$from MOESERVE_BENCH_TOKENS=${TOKENS:-256,512,1024} \
      timeout 200 "$B/moe_experts_bench" 2>/dev/null | tail -n +2 |
      awk -F, -v f=$from -v r=$round '{print f","r","$0}' >> "$OUT/bench.csv"
  done
done
if [ -n "${SMALL:-}" ]; then
  MOESERVE_BENCH_WGMMA_FROM=1 MOESERVE_BENCH_TOKENS=$SMALL timeout 200 \
    "$B/moe_experts_bench" 2>/dev/null | tail -n +2 | awk -F, '{print "1,1,"$0}' >> "$OUT/bench.csv"
fi
python3 "$(dirname "$0")/bench_table.py" --ratio -1 "${WGMMA_FROM:-0}" "$OUT/bench.csv"
if command -v ncu > /dev/null && [ "${NCU:-1}" = 1 ]; then
  MOESERVE_BENCH_WGMMA_FROM=${WGMMA_FROM:-0} MOESERVE_BENCH_TOKENS=256 \
    MOESERVE_BENCH_LAYERS=seed MOESERVE_BENCH_ROUTING=${NCU_ROUTING:-balanced} \
    timeout 200 ncu --clock-control none --kernel-name regex:MoeGemmWgmma --launch-skip 10 \
    --launch-count 2 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    "$B/moe_experts_bench" > "$OUT/ncu_256.txt" 2>&1
  grep -E "MoeGemmWgmma|Duration|DRAM Throughput|Compute \(SM\)|Issued Warp|No Eligible|Warp Cycles Per Issued" "$OUT/ncu_256.txt" | head -30
fi
