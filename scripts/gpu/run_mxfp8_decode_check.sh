#!/usr/bin/env bash
# One device call for the MXFP8 decode GEMM (issue 13 item 2): the exactness tests, the MXFP8
# sweep of the experts suite, the benchmark against PyTorch with an earlier build as "before",
# and Nsight Compute on the 16-token W13 kernel of both builds (NCU_BUILDS="new", or "" for none).
# Bundle: $BUNDLE/bin/{cuda_kernels_test,cuda_experts_test,moe_experts_bench,moe_experts_bench_old}
# and $BUNDLE/lib. Writes under $OUT. FORMATS (default mxfp8) and TOKENS choose the bench rows;
# every other $BUNDLE/bin/moe_experts_bench_<variant> is run raw after it (ROUNDS times, with
# the new build) into $OUT/variants.csv; EXPERTS_FILTER narrows the experts suite.
set -u
BUNDLE=${BUNDLE:-.bundle}
B=$BUNDLE/bin
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/bench"
export LD_LIBRARY_PATH=$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv
timeout 120 "$B/cuda_kernels_test" 2>&1 | tail -4
[ -x "$B/engine_cuda_test" ] && timeout 300 "$B/engine_cuda_test" 2>&1 | tail -3
timeout 300 "$B/cuda_experts_test" --gtest_filter="${EXPERTS_FILTER:-*mxfp8*}" > "$OUT/experts.log" 2>&1
echo "cuda_experts_test ${EXPERTS_FILTER:-*mxfp8*}: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$OUT/experts.log" | tr '\n' ' ')"
grep -E "^\[  FAILED" "$OUT/experts.log" | head
MOESERVE_BENCH_TOKENS=${TOKENS:-16,64,128} MOESERVE_BENCH_FORMATS=${FORMATS:-mxfp8} \
  MOESERVE_BENCH_PATHS=${PATHS:-decode} timeout 420 python3 scripts/gpu/bench_moe.py "$B/moe_experts_bench" "$OUT/bench" \
  "$B/moe_experts_bench_old" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
for round in $(seq 1 "${ROUNDS:-1}"); do
  for bin in "$B"/moe_experts_bench "$B"/moe_experts_bench_*; do
    v=${bin##*/moe_experts_bench}; v=${v#_}; v=${v:-new}
    [ "$v" = old ] && continue
    [ "$v" = new ] && [ "$(ls "$B" | grep -c '^moe_experts_bench_')" -le 1 ] && continue
    MOESERVE_BENCH_TOKENS=${TOKENS:-16,64,128} MOESERVE_BENCH_FORMATS=${FORMATS:-mxfp8} \
      MOESERVE_BENCH_PATHS=decode timeout 120 "$bin" 2>/dev/null | tail -n +2 | \
      awk -F, -v v="$v" '{print v","$1","$2","$3","$4","$5}' >> "$OUT/variants.csv"
  done
done
[ -f "$OUT/variants.csv" ] && sort -t, -k2,2 -k3,3 -k4,4n -k5,5 -s "$OUT/variants.csv" | tr , " "
for v in ${NCU_BUILDS-old new}; do
  bin=$B/moe_experts_bench; [ $v = old ] && bin=$B/moe_experts_bench_old
  MOESERVE_BENCH_TOKENS=16 MOESERVE_BENCH_FORMATS=mxfp8 MOESERVE_BENCH_PATHS=decode \
    timeout 120 ncu --clock-control none -k regex:MoeGemmKernel --launch-skip 4 -c 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
    "$bin" > "$OUT/ncu_$v.txt" 2>&1
  echo "ncu $v rc=$?"
  grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Executed Ipc Active|Stall|Achieved Occupancy|Registers Per" "$OUT/ncu_$v.txt" | head -30
done
tail -25 "$OUT/bench.log"
