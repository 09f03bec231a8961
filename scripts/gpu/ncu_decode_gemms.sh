#!/bin/bash
# ncu on one MLP of the given build: the four GEMM launches (W13 narrow+adaptive, W2 narrow+adaptive).
# Usage: ncu_decode_gemms.sh BENCH_BINARY TAG; TOKENS (default 16), ROUTING (balanced or hot,
# default balanced), FORMAT (default mxfp8); writes $OUT/ncu_TAG.txt.
bin=$1; tag=$2
MOESERVE_BENCH_TOKENS=${TOKENS:-16} MOESERVE_BENCH_FORMATS=${FORMAT:-mxfp8} \
  MOESERVE_BENCH_ROUTING=${ROUTING:-balanced} MOESERVE_BENCH_PATHS=decode \
  timeout 150 ncu --clock-control none -k regex:MoeGemmKernel --launch-skip 8 -c 4 \
  --section SpeedOfLight --metrics 'regex:smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active\.ratio' \
  "$bin" > "$OUT/ncu_$tag.txt" 2>&1
echo "ncu $tag rc=$?"
grep -E "MoeGemmKernel<|Duration|DRAM Throughput|Compute \(SM\)" "$OUT/ncu_$tag.txt" | sed 's/(MoeGemmParams.*//' | cut -c1-90
grep -E "stalled" "$OUT/ncu_$tag.txt" | awk '$NF+0 > 0.3' | sed 's/smsp__average_warps_issue_stalled_//;s/_per_issue_active.ratio//' | head -40
