#!/bin/bash
set -uo pipefail
source scripts/gpu/serve_lib.sh
PORT=50191; OUT=${OUT:-/tmp/ab}; mkdir -p $OUT
row() { :; }
tar -C /tmp -xzf .gpucarry/gt.tgz
use_bundle .gpucarry/transport.tar.xz
timeout 200 /tmp/gt/bin/cuda_kernels_test --gtest_brief=1 > $OUT/kernels.log 2>&1; echo "cuda_kernels_test exit $?: $(grep -E '^\[  (PASSED|FAILED)' $OUT/kernels.log | tr '\n' ' ')"
grep -E "Failure" -A3 $OUT/kernels.log | head
TRIVIAL="--model tiny --hidden 7168 --intermediate 64 --num_experts 16 --topk 4 --num_layers 1"
for r in 1 2; do for b in old transport; do
  use_bundle .gpucarry/$b.tar.xz
  serve t_$b $TRIVIAL
  load ${b}_r${r}_M1 1 1 3000
  load ${b}_r${r}_M16 16 1 2000
  stop
  for m in M1 M16; do echo "$b r$r trivial $m: p50 $(val ${b}_r${r}_$m p50) ms, server $(grep -o 'server_total_us: p50=[0-9.]*' $OUT/load_${b}_r${r}_$m.log | cut -d= -f2) us, $(grep -o 'server_stages_us_p50.*' $OUT/load_${b}_r${r}_$m.log)"; done
done; done
