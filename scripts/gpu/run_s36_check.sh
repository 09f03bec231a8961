#!/usr/bin/env bash
# Session 36's device call: the GPU suites of build b (cuda_kernels_test whole, a shard of
# cuda_experts_test, engine_cuda_test, racecheck and memcheck on the align's tests), then the
# one-token A/B (run_small_call_ab.sh, VARIANTS default "a b by ah bh byh", MS "1 16"), then Nsight
# Compute's kernel durations of one graphed trivial step at M=1 for a and b.
# Usage: run_s36_check.sh BUNDLE.tgz (make_ab_bundle.sh A B BUNDLE.tgz)
set -u
# (Variant y, MOESERVE_ALIGN_EARLY_IDS=1, was an experiment measured on 2026-12-06 and then
# removed: engine/RESULTS.md; with today's binaries it runs as b.)
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_device_script "$1" || exit 1
ROOT=$OUT
t0=$(date +%s)
EXPERTS_SHARDS=${EXPERTS_SHARDS:-8} SANITIZERS="racecheck memcheck" gpu_suites '*AlignReadsIds*'
echo "suites $(( $(date +%s) - t0 )) s"
SA_READY=1 SKIP_GPU_SUITES=1 ROUNDS=${ROUNDS:-2} MS=${MS:-"1 16"} VARIANTS=${VARIANTS:-"a b by ah bh byh"} \
  OUT=$ROOT/ab bash scripts/gpu/run_small_call_ab.sh "$1" 2>&1 | sed -n '/^== engine_forward_bench/,$p'
echo "a/b $(( $(date +%s) - t0 )) s"
# Issue 12's 8-caller and M=1024 rows (seed layer MXFP8) for each build, rounds a b b a.
for pass in ${SERVING_PASSES:-a1 b1 b2 a2}; do
  ln -sf "$B/moeserve_${pass:0:1}" "$B/moeserve"
  OUT=$ROOT/serving_$pass WFS=mxfp8 SKIP_OVERLOAD=1 SKIP_1LANE=1 timeout 200 \
    bash tests/benchmarks/serving/run_serving_bench.sh "$B" > "$ROOT/serving_$pass.txt" 2>&1
  echo "=== serving $pass: $(grep -E '^mxfp8 (8|2) callers' "$ROOT/serving_$pass.txt" | tr '\n' ' ')"
  grep -E '^mxfp8_M16_c(1|8) ' "$ROOT/serving_$pass.txt" | sed 's/server_stages_us_p50.*throughput/throughput/' | cut -c1-200
  grep -E '^trivial M=1 server total' "$ROOT/serving_$pass.txt"
done
echo "serving $(( $(date +%s) - t0 )) s"
for v in a b by; do
  timeout 120 env $([ $v = by ] && echo MOESERVE_ALIGN_EARLY_IDS=1) ncu --clock-control none --cache-control none --csv --metrics gpu__time_duration.sum \
    "$B/engine_forward_bench_${v:0:1}" --model trivial --weight_format bf16 --tokens 1 --iters 3 --timed 0 \
    > "$ROOT/ncu_$v.csv" 2>&1
  echo "== ncu $v trivial M=1 rc=$?: the last step's kernels (us)"
  ncu_last_kernels "$ROOT/ncu_$v.csv" 5
done
echo "total $(( $(date +%s) - t0 )) s"
