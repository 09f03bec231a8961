#!/usr/bin/env bash
set -u
source scripts/gpu/bundle_lib.sh
OUT=/tmp/sd_out
start_device_script "$1" || exit 1
for routing in hot balanced; do
for b in before v1; do
  bin="$B/moe_experts_bench_$b"; [ $b = before ] && bin="$B/moe_experts_bench_before"
  MOESERVE_BENCH_PATHS=grouped MOESERVE_BENCH_FORMATS=bf16 MOESERVE_BENCH_TOKENS=1024 MOESERVE_BENCH_LAYERS=seed \
    MOESERVE_BENCH_ROUTING=$routing timeout 150 ncu --clock-control none --kernel-name regex:device_kernel --launch-skip 10 \
    --launch-count 2 --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__t_sector_op_read_hit_rate.pct "$bin" > "$OUT/ncu_${b}_$routing.txt" 2>&1
  echo "== $b $routing"
  grep -E 'gpu__time|dram__|lts__' "$OUT/ncu_${b}_$routing.txt" | awk '{printf "%s=%s%s ", $1, $3, $2} /gpu__time/ {print ""}'
  echo
done
done
