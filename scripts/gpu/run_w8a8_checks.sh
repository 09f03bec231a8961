#!/bin/bash
# One device call for the W8A8 grouped path (MXFP8 weights, E4M3 activations; issue 13): its
# cases of the experts sweep (relative L2 printed per case), the engine's W8A8 tests, the
# benchmark with the PyTorch peers (MXFP8: decode / grouped / w8a8 paths, three routings), then
# compute-sanitizer memcheck and racecheck on W8A8 cases. Binaries and libraries in $BUNDLE
# (bin/, lib/) as for run_gpu_checks.sh.
set -o pipefail
BUNDLE=${BUNDLE:-.bundle}
export LD_LIBRARY_PATH=$PWD/$BUNDLE/lib PYTHONUNBUFFERED=1
B=$BUNDLE/bin
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
timeout ${T_TESTS:-150} $B/cuda_experts_test --gtest_brief=1 \
  --gtest_filter="${FILTER:-*w8a8*:*mxfp8*_grouped}" > "$OUT/experts_w8a8.log" 2>&1
echo "experts rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/experts_w8a8.log" | tr '\n' ' ')"
grep -E "^\[  FAILED|Failure" -A4 "$OUT/experts_w8a8.log" | head -30
grep "^w8a8" "$OUT/experts_w8a8.log" | awk '{print $NF, $2}' | sort -g | tail -5
timeout 120 $B/engine_cuda_test --gtest_brief=1 --gtest_filter='*W8A8*' > "$OUT/engine_w8a8.log" 2>&1
echo "engine rc=$?"; grep -E "^w8a8|FAILED|Failure" -A2 "$OUT/engine_w8a8.log" | head -20
MOESERVE_BENCH_FORMATS=${FORMATS:-mxfp8} MOESERVE_BENCH_PATHS=decode,grouped,w8a8 \
  MOESERVE_BENCH_ROUTING=balanced,hot,random \
  MOESERVE_BENCH_TOKENS=${TOKENS:-16,32,64,128,256,512,1024,2048} \
  timeout ${T_BENCH:-300} python3 scripts/gpu/bench_moe.py $B/moe_experts_bench "$OUT" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -E "^\| (seed|dsv3)|^crossover" "$OUT/results.md" 2>/dev/null | grep -v "| grouped |"
tail -3 "$OUT/bench.log"
timeout ${T_SAN:-90} compute-sanitizer --tool memcheck $B/cuda_experts_test --gtest_brief=1 \
  --gtest_filter='*M300_E32_k8_H1024_I320_mxfp8_hot_w8a8:*M517_E40*w8a8:*M33_E5*w8a8' 2>&1 | tail -2
timeout ${T_SAN:-90} compute-sanitizer --tool racecheck $B/cuda_experts_test --gtest_brief=1 \
  --gtest_filter='*M64_E16_k4_H256_I128_mxfp8_balanced_w8a8:*M1000_E24*uniform_w8a8' 2>&1 | tail -2
