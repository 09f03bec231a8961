#!/usr/bin/env bash
set -u
source scripts/gpu/bundle_lib.sh
FINAL_OUT=${OUT:-/tmp/out}
OUT=/tmp/sh_out
start_device_script "$1" || exit 1
for round in 1 2 3; do for b in before v1 v3; do
  bin="$B/moe_experts_bench_$b"; [ $b = before ] && bin="$B/moe_experts_bench_before"
  echo "$b $(MOESERVE_BENCH_PATHS=grouped MOESERVE_BENCH_FORMATS=bf16 MOESERVE_BENCH_TOKENS=1024 MOESERVE_BENCH_LAYERS=seed,dsv3 $bin 2>/dev/null | tail -n +2 | cut -d, -f1,4,5 | tr '\n' ' ')"
done; done
for routing in hot; do
for b in before v1 v3; do
  bin="$B/moe_experts_bench_$b"; [ $b = before ] && bin="$B/moe_experts_bench_before"
  MOESERVE_BENCH_PATHS=grouped MOESERVE_BENCH_FORMATS=bf16 MOESERVE_BENCH_TOKENS=1024 MOESERVE_BENCH_LAYERS=seed \
    MOESERVE_BENCH_ROUTING=$routing timeout 150 ncu --clock-control none --launch-skip 40 \
    --launch-count 8 --section SpeedOfLight --section MemoryWorkloadAnalysis "$bin" > "$OUT/ncu_${b}_$routing.txt" 2>&1
  echo "== $b $routing"
  grep -E '^  [a-z].*Context|Duration|DRAM Throughput|L2 Hit Rate|Compute \(SM\) Throughput|^    Memory Throughput' "$OUT/ncu_${b}_$routing.txt" | sed -E 's/^  (void )?([^(<]*).*Context.*/\2/' | awk '{printf "%s ", $0} /Compute/ {print ""}'
done
done
mkdir -p "$FINAL_OUT" && tar -C "$OUT" -czf "$FINAL_OUT/logs.tgz" .
