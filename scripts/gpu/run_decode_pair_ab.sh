#!/usr/bin/env bash
# The two-CTA cluster decode tile (kernels/cuda/moe_gemm.cu, MoeDecodePair) in one device call:
# the kernel tests, the experts sweep and the engine's CUDA tests with the default dispatch (the
# tile serves MXFP8 up to kMxfp8DecodePairMaxRoutes routes per expert), memcheck and racecheck on
# its kernel test (multicast units included), then moe_experts_bench, decode path, MXFP8, TOKENS
# tokens, balanced / hot / random routing, MOESERVE_DECODE_PAIR=0 (off) and 1 (on up to 32 routes
# per expert) alternating, ROUNDS rounds, medians. Usage: run_decode_pair_ab.sh BUNDLE.tgz (bin/:
# moe_experts_bench, cuda_kernels_test, cuda_experts_test, engine_cuda_test).
set -u
source "$(dirname "$0")/bundle_lib.sh"
OUT=${OUT:-/tmp/pair_out}
start_device_script "$1" || exit 1
run_gtest cuda_kernels_test 200
run_gtest cuda_experts_test 400
run_gtest engine_cuda_test 300
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$CS" ]; then
  for tool in memcheck racecheck; do
    timeout 200 "$CS" --tool $tool --error-exitcode 3 \
      "$B/cuda_kernels_test" --gtest_filter='*DecodePair*' > "$OUT/$tool.log" 2>&1
    echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$OUT/$tool.log" | tr '\n' ' ')"
  done
fi
export MOESERVE_BENCH_PATHS=decode MOESERVE_BENCH_FORMATS=mxfp8 \
  MOESERVE_BENCH_LAYERS=${LAYERS:-seed,dsv3} MOESERVE_BENCH_ROUTING=balanced,hot,random \
  MOESERVE_BENCH_TOKENS=${TOKENS:-1,4,8,16,24,32,48,64}
for round in $(seq "${ROUNDS:-2}"); do for set in 0 1; do
  MOESERVE_DECODE_PAIR=$set timeout 150 "$B/moe_experts_bench" 2>/dev/null | tail -n +2 |
    awk -F, -v s=$set '{print s","$0}' >> "$OUT/pair.csv"
done; done
python3 - "$OUT/pair.csv" <<'PY'
import sys, collections, statistics
t = collections.defaultdict(list)
floor = {}
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) < 7: continue
    t[(f[1], int(f[3]), f[4], f[0])].append(float(f[5]))
    floor[(f[1], int(f[3]), f[4])] = float(f[6]) / 4.3e6  # all experts' bytes / 4.3 TB/s, us
print("layer tokens routing | pair off us (% floor) | pair on us (% floor) | on/off")
for k in sorted({k[:3] for k in t}):
    a = statistics.median(t[k + ("0",)]); b = statistics.median(t[k + ("1",)])
    print(*k, f"| {a:.0f} ({100*floor[k]/a:.0f}%) | {b:.0f} ({100*floor[k]/b:.0f}%) | {b/a:.3f}")
PY
