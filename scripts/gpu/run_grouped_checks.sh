#!/bin/bash
# One call on nvidia-h200 for the grouped GEMM path (issue 13 item 1): the SASS check (HGMMA in
# the CUTLASS kernel), the CUDA experts sweep (4 gtest shards side by side), the engine and
# kernel suites, compute-sanitizer memcheck and racecheck on grouped cases, then the expert-MLP
# benchmark with its PyTorch peers alone on the GPU.
# Binaries in $BUNDLE/bin, libraries in $BUNDLE/lib, bench_moe.py in $BUNDLE (or scripts/gpu).
# Environment: WHAT=all|checks|bench, BENCH_TOKENS, BENCH_FORMATS (passed to the benchmark as
# MOESERVE_BENCH_TOKENS / MOESERVE_BENCH_FORMATS), T_TESTS, T_SAN, T_BENCH (seconds).
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
BUNDLE=${BUNDLE:-$PWD/.bundle}
B=$BUNDLE/bin
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=$BUNDLE/lib:$LD_LIBRARY_PATH
BENCH_PY=$BUNDLE/bench_moe.py; [ -f "$BENCH_PY" ] || BENCH_PY=scripts/gpu/bench_moe.py
WHAT=${WHAT:-all}
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; date -u
summary=()
if [ "$WHAT" != bench ]; then
  n=$(cuobjdump --dump-sass "$B/cuda_experts_test" 2>/dev/null | grep -c HGMMA)
  summary+=("HGMMA instructions in cuda_experts_test: $n")
  T=${T_TESTS:-200}
  for i in 0 1 2 3; do
    GTEST_TOTAL_SHARDS=4 GTEST_SHARD_INDEX=$i timeout "$T" "$B/cuda_experts_test" \
      --gtest_brief=1 > "$OUT/experts_$i.log" 2>&1 &
  done
  timeout "$T" "$B/engine_cuda_test" --gtest_brief=1 > "$OUT/engine.log" 2>&1 &
  timeout "$T" "$B/cuda_kernels_test" --gtest_brief=1 > "$OUT/kernels.log" 2>&1 &
  if [ -x "$B/engine_mk_combinations_test" ]; then
    timeout "$T" "$B/engine_mk_combinations_test" --gtest_brief=1 --gtest_filter='*Cuda*' \
      > "$OUT/combinations.log" 2>&1 &
  fi
  SAN_FILTER='*M300_E16_k4_H256_I128_bf16_hot_grouped:*M160_E16_k4_H256_I128_bf16_hot_grouped:*M33_E5*mxfp8_uniform_grouped:*M517*uniform_ep_grouped:*M1500*bf16_uniform_auto:*M0_E16*bf16_uniform_grouped'
  timeout "${T_SAN:-200}" compute-sanitizer --tool memcheck "$B/cuda_experts_test" \
    --gtest_brief=1 --gtest_filter="$SAN_FILTER" > "$OUT/memcheck.log" 2>&1 &
  timeout "${T_SAN:-200}" compute-sanitizer --tool racecheck "$B/cuda_experts_test" \
    --gtest_brief=1 --gtest_filter='*M300_E16_k4_H256_I128_bf16_hot_grouped:*M160_E16_k4_H256_I128_bf16_hot_grouped' \
    > "$OUT/racecheck.log" 2>&1 &
  wait
  for f in experts_0 experts_1 experts_2 experts_3 engine kernels combinations; do
    [ -f "$OUT/$f.log" ] || continue
    summary+=("$f: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/$f.log" | tr -s ' ' | tr '\n' ' ')")
    grep -E "Failure|FAILED|rror" "$OUT/$f.log" | head -8
  done
  summary+=("memcheck: $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/memcheck.log" | tr '\n' ' ')")
  summary+=("racecheck: $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|PASSED|FAILED' "$OUT/racecheck.log" | tr '\n' ' ')")
  # The device tool returns at most 8 files: one log of the checks.
  for f in experts_0 experts_1 experts_2 experts_3 engine kernels combinations memcheck racecheck; do
    [ -f "$OUT/$f.log" ] || continue
    echo "=== $f"; cat "$OUT/$f.log"; rm -f "$OUT/$f.log"
  done > "$OUT/checks.log"
fi
if [ "$WHAT" != checks ]; then
  mkdir -p "$OUT/bench"
  MOESERVE_BENCH_TOKENS=${BENCH_TOKENS:-} MOESERVE_BENCH_FORMATS=${BENCH_FORMATS:-} \
    timeout "${T_BENCH:-300}" python3 "$BENCH_PY" "$B/moe_experts_bench" "$OUT/bench" \
    > "$OUT/bench/bench.log" 2>&1
  rm -f "$OUT/bench/moe_experts_h200.png"
  tail -70 "$OUT/bench/bench.log"
fi
echo "=================== summary ==================="
printf '%s\n' "${summary[@]}"
