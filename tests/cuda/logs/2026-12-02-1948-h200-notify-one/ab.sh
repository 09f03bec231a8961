#!/bin/bash
# A/B of two bundles: trivial M=1 one caller (unary, stream), then seed MXFP8 1 vs 8 callers.
set -uo pipefail
source scripts/gpu/serve_lib.sh
PORT=50191; OUT=${OUT:-/tmp/ab}; mkdir -p $OUT
row() { echo "$1 $2"; }
TRIVIAL="--model tiny --hidden 7168 --intermediate 64 --num_experts 16 --topk 4 --num_layers 1"
for r in 1 2; do for b in old transport; do
  use_bundle .gpucarry/$b.tar.xz
  serve t_$b $TRIVIAL
  load ${b}_r${r}_M1 1 1 3000 > /dev/null
  load ${b}_r${r}_M1s 1 1 3000 --stream > /dev/null
  stop
  echo "$b r$r trivial M=1 unary: p50 $(val ${b}_r${r}_M1 p50) ms, $(val ${b}_r${r}_M1 requests_per_s)/s, server $(grep -o 'server_total_us: p50=[0-9.]*' $OUT/load_${b}_r${r}_M1.log | cut -d= -f2) us queue $(grep -o 'queue=[0-9.]*' $OUT/load_${b}_r${r}_M1.log | cut -d= -f2); stream p50 $(val ${b}_r${r}_M1s p50)"
  CONFIGS=defaults REPS=1 WFS=mxfp8 OUT=$OUT/seed_${b}_$r tests/benchmarks/serving/run_company_wait.sh .gpucarry/$b.tar.xz 2>&1 | grep "^| mxfp8" | sed "s/^/$b r$r /"
done; done
