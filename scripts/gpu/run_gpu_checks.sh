#!/bin/bash
# One device call: GPU tests, the benchmark with the PyTorch peers, then compute-sanitizer
# memcheck + racecheck on a subset (mma.sync and wgmma paths). Run from the
# repo root on the GPU machine with the binaries and their libraries carried in .bundle/ (see
# docs/gpu.md):
#   /work/shared/tools/bundle-libs.sh .bundle/lib build-cuda/tests/cuda/* ...; cp binaries .bundle/bin
# An optional .bundle/bin/moe_experts_bench_base (an earlier build) adds a "before" column.
set -o pipefail
BUNDLE=${BUNDLE:-.bundle}  # folder carried with the call: bin/ and lib/
export LD_LIBRARY_PATH=$PWD/$BUNDLE/lib PYTHONUNBUFFERED=1
B=$BUNDLE/bin
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
$B/cuda_kernels_test --gtest_brief=1 2>&1 | tee "$OUT/kernels.log" | tail -2
timeout ${T_TESTS:-150} $B/cuda_experts_test --gtest_brief=1 2>&1 | tee "$OUT/experts.log" | grep -E "FAILED|PASSED|tests from"
BASE=; [ -x $B/moe_experts_bench_base ] && BASE=$B/moe_experts_bench_base
timeout ${T_BENCH:-240} python3 scripts/gpu/bench_moe.py $B/moe_experts_bench "$OUT" $BASE 2>&1 | tee "$OUT/bench.log" | tail -44
timeout ${T_SAN:-75} compute-sanitizer --tool memcheck $B/cuda_experts_test --gtest_brief=1 \
  --gtest_filter='*M64_E16*:*H200_I72*:*batched_ep:*M160_E16*:*M300_E32*bf16_hot' 2>&1 | tail -2
timeout ${T_SAN:-75} compute-sanitizer --tool racecheck $B/cuda_experts_test --gtest_brief=1 \
  --gtest_filter='*M64_E16_k4_H256_I128_bf16_uniform:*M64_E16_k4_H256_I128_mxfp8_balanced:*M160_E16_k4_H256_I128_mxfp8_hot:*M400_E4_k2_H200_I72_mxfp8_uniform' 2>&1 | tail -2
