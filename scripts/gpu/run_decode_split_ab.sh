#!/usr/bin/env bash
# Not yet measured: MXFP8 decode launches that split the experts between the narrow (<= 16
# routes) and the adaptive 32-wide tile per expert (MOESERVE_DECODE_SPLIT=1; off by default)
# instead of one launch serving all experts by the largest count (the default). One device
# call: kernel tests, the experts sweep with the split on (its correctness) and off, then
# moe_experts_bench at 16-64 tokens, MXFP8, decode path, balanced / hot / random routing, both
# settings alternating, three rounds, medians. Usage: run_decode_split_ab.sh BUNDLE.tgz (bin/:
# moe_experts_bench, cuda_kernels_test, cuda_experts_test; lib/: bundle-libs.sh).
set -u
source "$(dirname "$0")/bundle_lib.sh"
OUT=/tmp/split_out
start_device_script "$1" || exit 1
# FULL=1: every kernel and experts test with the split on and off; otherwise (a shorter call)
# the MXFP8 cases of the experts sweep with the split on (off is the default, tested in CI runs
# of the GPU checks).
if [ "${FULL:-0}" = 1 ]; then
  run_gtest cuda_kernels_test 150
  MOESERVE_DECODE_SPLIT=1 run_gtest cuda_experts_test 300
  run_gtest cuda_experts_test 300
else
  MOESERVE_DECODE_SPLIT=1 run_gtest cuda_experts_test 150 --gtest_filter='*mxfp8*'
fi
export MOESERVE_BENCH_PATHS=decode MOESERVE_BENCH_FORMATS=mxfp8 MOESERVE_BENCH_LAYERS=seed,dsv3 \
  MOESERVE_BENCH_ROUTING=balanced,hot,random MOESERVE_BENCH_TOKENS=16,32,64
for round in 1 2 3; do for split in 0 1; do
  MOESERVE_DECODE_SPLIT=$split timeout 100 "$B/moe_experts_bench" 2>/dev/null | tail -n +2 |
    awk -F, -v s=$split '{print s","$0}' >> "$OUT/split.csv"
done; done
python3 - "$OUT/split.csv" <<'PY'
import sys, collections, statistics
t = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    t[(f[1], int(f[3]), f[4], f[0])].append(float(f[5]))
print("layer tokens routing | one launch us | split us | split/one")
for k in sorted({k[:3] for k in t}):
    a = statistics.median(t[k + ("0",)]); b = statistics.median(t[k + ("1",)])
    print(*k, f"| {a:.0f} | {b:.0f} | {b/a:.3f}")
PY
