#!/bin/bash
# One device call: Nsight Compute on the seed layer's MXFP8 decode GEMMs at 1 and 16 tokens
# (balanced): duration, DRAM and SM throughput, issue slots, occupancy, grid. Binaries in .b/bin.
export LD_LIBRARY_PATH=$PWD/.b/lib
for t in 1 16; do
  MOESERVE_BENCH_LAYERS=seed MOESERVE_BENCH_TOKENS=$t MOESERVE_BENCH_FORMATS=mxfp8 \
  MOESERVE_BENCH_ROUTING=balanced MOESERVE_BENCH_PATHS=decode \
  timeout 120 ncu --clock-control none -k regex:MoeGemmKernel --launch-skip 8 -c 4 \
    --section SpeedOfLight --section SchedulerStats --section Occupancy --section LaunchStats \
    .b/bin/moe_experts_bench > $OUT/ncu_t$t.txt 2>&1
  echo "== tokens $t rc=$?"
  grep -E "MoeGemmKernel<|Duration|DRAM Throughput|Compute \(SM\) Throughput|Issue Slots Busy|One or More Eligible|Achieved Occupancy|Grid Size|Registers Per|Waves Per SM" $OUT/ncu_t$t.txt | sed 's/(MoeGemmParams.*//' | cut -c1-100
done
