#!/usr/bin/env bash
# What limits the MXFP8 decode at 64 tokens/rank (issue 13: 80% of the HBM floor): Nsight Compute
# on the seed layer's decode GEMM launches, balanced routing (the narrow 16-token tile does the
# work) against random and hot routing (experts above 16 routes: the adaptive 32-wide tile does
# it). Then the GPU tests with the build's defaults and racecheck on the bit-exact and cluster-tile
# kernel tests. Usage: diag_decode64.sh BUNDLE.tgz (bin/: moe_experts_bench, cuda_kernels_test,
# cuda_experts_test, engine_cuda_test).
set -u
source "$(dirname "$0")/bundle_lib.sh"
start_device_script "$1" || exit 1
export MOESERVE_BENCH_LAYERS=seed MOESERVE_BENCH_TOKENS=64 MOESERVE_BENCH_FORMATS=mxfp8 \
  MOESERVE_BENCH_PATHS=decode
for routing in balanced random hot; do
  # Each timed iteration launches four GEMM kernels (narrow and adaptive, W13 and W2); the one
  # whose class the counts are not returns at once. Skip the warm-up, keep two iterations.
  MOESERVE_BENCH_ROUTING=$routing timeout 200 ncu --clock-control none -k regex:MoeGemmKernel \
    --launch-skip 16 -c 8 --section SpeedOfLight --section SchedulerStats --section Occupancy \
    --section LaunchStats --section WarpStateStats --section InstructionStats \
    --section MemoryWorkloadAnalysis "$B/moe_experts_bench" > "$OUT/ncu_$routing.txt" 2>&1
  echo "== $routing rc=$?"
  python3 - "$OUT/ncu_$routing.txt" <<'PY'
import re, sys
keys = ["Duration", "DRAM Throughput", "Memory Throughput", "No Eligible",
        "Warp Cycles Per Issued Instruction", "Achieved Occupancy", "Registers Per Thread",
        "Dynamic Shared Memory Per Block", "Grid Size", "Executed Instructions", "L2 Hit Rate"]
for line in open(sys.argv[1]):
    m = re.search(r"MoeGemmKernel<([^>]*)>", line)
    if m and "(" in line:
        args = m.group(1).split(",")
        print("-- BN=%s stages=%s adaptive=%s" % (args[2].strip(), args[5].strip(), args[7].strip()))
        continue
    for k in keys:
        if line.strip().startswith(k):
            print("   ", " ".join(line.split()))
PY
done
gpu_suites '*DecodePair*:*BitForBit*'
