#!/bin/bash
# compute-sanitizer on the decode and wgmma kernels (one device call). Writes $OUT/sanitizer.txt.
B=${BUNDLE:-.bundle}/bin
export LD_LIBRARY_PATH=${BUNDLE:-.bundle}/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
S=$OUT/sanitizer.txt
{
echo "== memcheck cuda_kernels_test"
timeout 240 compute-sanitizer --tool memcheck "$B/cuda_kernels_test" 2>&1 | grep -E "ERROR SUMMARY|PASSED|FAILED"
echo "== racecheck GroupedGemmDequantizesMxfp8BitForBit"
timeout 200 compute-sanitizer --tool racecheck --racecheck-report hazard "$B/cuda_kernels_test" --gtest_filter='*BitForBit*' 2>&1 | grep -E "RACECHECK SUMMARY|hazard|PASSED|FAILED" | head -8
echo "== memcheck cuda_experts_test MXFP8 33-128 routes per expert and odd K blocks"
timeout 240 compute-sanitizer --tool memcheck "$B/cuda_experts_test" --gtest_filter="${SAN_FILTER:-*M160_E16_k4*mxfp8*:*M300_E16_k4*mxfp8*:*M100_E8_k4_H264*mxfp8*:*M64_E8_k2_H392*mxfp8*}" 2>&1 | grep -E "ERROR SUMMARY|PASSED|FAILED"
} > "$S" 2>&1
cat "$S"
