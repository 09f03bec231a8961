#!/usr/bin/env bash
set -u
source scripts/gpu/bundle_lib.sh
OUT=/tmp/sg_out
start_device_script "$1" || exit 1
ncu --query-metrics 2>/dev/null | grep -i -E 'gmma|tensor_op' | head -20
M=$(ncu --query-metrics 2>/dev/null | grep -o -E '^(sm|smsp)__inst_executed_pipe_tensor_op_gmma[a-z_]*' | head -1)
[ -z "$M" ] && M=smsp__inst_executed_pipe_tensor_op_gmma
echo "metric: $M"
for routing in hot balanced; do
for b in before v1; do
  bin="$B/moe_experts_bench_$b"; [ $b = before ] && bin="$B/moe_experts_bench_before"
  MOESERVE_BENCH_PATHS=grouped MOESERVE_BENCH_FORMATS=bf16 MOESERVE_BENCH_TOKENS=1024 MOESERVE_BENCH_LAYERS=seed \
    MOESERVE_BENCH_ROUTING=$routing timeout 150 ncu --clock-control none --kernel-name regex:device_kernel --launch-skip 10 \
    --launch-count 1 --metrics gpu__time_duration.sum,$M.sum,lts__t_sectors_srcunit_tex_op_read.sum,sm__cycles_active.avg "$bin" > "$OUT/ncu_${b}_$routing.txt" 2>&1
  echo "== $b $routing $(grep -E 'gpu__time|gmma|lts__|sm__cycles' "$OUT/ncu_${b}_$routing.txt" | awk '{printf "%s=%s%s ", $1, $3, $2}')"
  grep -i error "$OUT/ncu_${b}_$routing.txt" | head -3
done
done
