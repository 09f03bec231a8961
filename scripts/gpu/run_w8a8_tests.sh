#!/bin/bash
# One device call: the GPU suites that cover the W8A8 path (cuda_kernels_test whole, cuda_experts_test
# whole in four shards side by side, the engine W8A8 / reference tests) and memcheck on the new
# kernels. Binaries and libraries unpacked in .b/ (bin/, lib/), e.g. from .bundle/w8a8.tar.xz.
# Prints the largest W8A8 errors against the CPU emulation and the FP32 reference.
B=.b/bin; export LD_LIBRARY_PATH=$PWD/.b/lib; O=$OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
timeout 120 $B/cuda_kernels_test --gtest_brief=1 > $O/kernels.log 2>&1; echo "kernels rc=$? $(grep -E '^\[  (PASSED|FAILED) ' $O/kernels.log | tr '\n' ' ')"
grep -E "Failure|FAILED" -A4 $O/kernels.log | head -20
for i in 0 1 2 3; do GTEST_TOTAL_SHARDS=4 GTEST_SHARD_INDEX=$i timeout 200 $B/cuda_experts_test --gtest_brief=1 > $O/experts_$i.log 2>&1 & done; wait
for i in 0 1 2 3; do echo "experts shard $i: $(grep -E '^\[  (PASSED|FAILED) ' $O/experts_$i.log | tr '\n' ' ')"; done
grep -h -E "^\[  FAILED|Failure" -A4 $O/experts_*.log | head -30
grep -h "^w8a8" $O/experts_*.log | awk '{print $8}' | sort -g | tail -3 | tr '\n' ' '; echo "(largest emulated err)"
grep -h "^w8a8" $O/experts_*.log | awk '{print $6}' | sort -g | awk '{a[NR]=$1} END{print "fp32-ref rel_l2 n="NR, "median="a[int(NR/2)], "max="a[NR]}'
timeout 150 $B/engine_cuda_test --gtest_brief=1 --gtest_filter='*W8A8*:*MatchesCpuReference*:*GroupedSm90*' > $O/engine.log 2>&1; echo "engine rc=$?"; grep -E "^w8a8|PASSED|FAILED|Failure" -A2 $O/engine.log | head -20
timeout 90 compute-sanitizer --tool memcheck $B/cuda_kernels_test --gtest_brief=1 --gtest_filter='*Fp8*:*GatherQuantize*' 2>&1 | tail -2
timeout 90 compute-sanitizer --tool memcheck $B/cuda_experts_test --gtest_brief=1 --gtest_filter='*M7_E16*hot_w8a8:*M400_E4*w8a8' 2>&1 | tail -2
