#!/usr/bin/env bash
set -u
source scripts/gpu/bundle_lib.sh
OUT=/tmp/sp_out
start_device_script "$1" || exit 1
for round in 1 2; do for b in before v1; do
  bin="$B/moe_experts_bench_$b"; [ $b = before ] && bin="$B/moe_experts_bench_before"
  echo "$b $(MOESERVE_BENCH_PATHS=grouped MOESERVE_BENCH_FORMATS=bf16 MOESERVE_BENCH_TOKENS=960,1000,1024,1040 MOESERVE_BENCH_ROUTING=balanced MOESERVE_BENCH_LAYERS=seed $bin 2>/dev/null | tail -n +2 | cut -d, -f3,5 | tr '\n' ' ')"
done; done
for t in 1000; do for b in before v1; do
  bin="$B/moe_experts_bench_$b"; [ $b = before ] && bin="$B/moe_experts_bench_before"
  MOESERVE_BENCH_PATHS=grouped MOESERVE_BENCH_FORMATS=bf16 MOESERVE_BENCH_TOKENS=$t MOESERVE_BENCH_LAYERS=seed \
    MOESERVE_BENCH_ROUTING=balanced timeout 150 ncu --clock-control none --kernel-name regex:device_kernel --launch-skip 10 \
    --launch-count 1 --metrics gpu__time_duration.sum,lts__t_sectors_srcunit_tex_op_read.sum,dram__bytes_read.sum "$bin" > "$OUT/n.txt" 2>&1
  echo "ncu $b $t $(grep -E 'gpu__time|lts__|dram' "$OUT/n.txt" | awk '{printf "%s=%s%s ", $1, $3, $2}')"
done; done
