#!/bin/bash
# One device call: GPU tests, compute-sanitizer memcheck + racecheck on a subset, then the
# benchmark with the PyTorch peers (table printed last). Run from the repo root on the GPU
# machine with the binaries and their libraries carried in .bundle/ (see docs/gpu.md):
#   /work/shared/tools/bundle-libs.sh .bundle/lib build-cuda/tests/cuda/* ...; cp binaries .bundle/bin
set -o pipefail
export LD_LIBRARY_PATH=$PWD/.bundle/lib PYTHONUNBUFFERED=1
B=.bundle/bin
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
$B/cuda_kernels_test --gtest_brief=1 2>&1 | tee "$OUT/kernels.log" | tail -2
timeout 200 $B/cuda_experts_test --gtest_brief=1 2>&1 | tee "$OUT/experts.log" | grep -E "FAILED|PASSED|tests from"
timeout 90 compute-sanitizer --tool memcheck $B/cuda_experts_test --gtest_brief=1 \
  --gtest_filter='*M64_E16*:*H200_I72*:*batched_ep' 2>&1 | tail -2
timeout 120 compute-sanitizer --tool racecheck $B/cuda_experts_test --gtest_brief=1 \
  --gtest_filter='*M64_E16_k4_H256_I128_bf16_uniform:*M64_E16_k4_H256_I128_mxfp8_balanced' 2>&1 | tail -2
timeout 330 python3 scripts/gpu/bench_moe.py $B/moe_experts_bench "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -44
