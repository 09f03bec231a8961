#!/usr/bin/env bash
# One device call for split-K in the decode GEMMs: the kernel and experts tests, the kernel bench
# with and without the split workspace (same binary, same run), then the step anatomy
# (run_step_anatomy.sh: engine p50s of this build and of the one before, Nsight Compute per
# kernel). Usage: run_split_k_check.sh BUNDLE.tgz (DIR/{bin,lib}: cuda_kernels_test,
# cuda_experts_test, engine_cuda_test, moe_experts_bench, engine_forward_bench[_old]).
# TOKENS / LAYERS / ROUNDS choose the bench rows. Writes under $OUT.
set -u
source "$(dirname "$0")/bundle_lib.sh"
start_device_script "$1" || exit 1
for t in cuda_kernels_test engine_cuda_test cuda_experts_test; do run_gtest $t 400; done
for round in $(seq 1 "${ROUNDS:-2}"); do
  for split in 0 1; do
    MOESERVE_BENCH_SPLIT_K=$split MOESERVE_BENCH_PATHS=decode \
      MOESERVE_BENCH_TOKENS=${TOKENS:-1,4,16,64,128} MOESERVE_BENCH_LAYERS=${LAYERS:-seed,dsv3,qwen3} \
      timeout 200 "$B/moe_experts_bench" 2>/dev/null | tail -n +2 |
      awk -F, -v s=$split -v r=$round '{print s","r","$0}' >> "$OUT/split_bench.csv"
  done
done
echo "== kernel bench (decode path): layer format tokens routing | no split us (rounds) | split us (rounds)"
python3 - "$OUT/split_bench.csv" <<'PY'
import csv, sys, collections
t = collections.defaultdict(lambda: {"0": [], "1": []})
order = []
for row in csv.reader(open(sys.argv[1])):
    split, rnd, layer, fmt, tokens, routing, us = row[:7]
    key = (layer, fmt, int(tokens), routing)
    if key not in t: order.append(key)
    t[key][split].append(float(us))
for key in order:
    a, b = t[key]["0"], t[key]["1"]
    ratio = min(a) / min(b) if a and b else 0
    print(f"{key[0]:6} {key[1]:6} {key[2]:5} {key[3]:9} | {' '.join(f'{v:7.1f}' for v in a)} | {' '.join(f'{v:7.1f}' for v in b)} | {ratio:4.2f}x")
PY
SA_READY=1 bash "$(dirname "$0")/run_step_anatomy.sh" "$1"
