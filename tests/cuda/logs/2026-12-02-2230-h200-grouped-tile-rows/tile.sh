#!/usr/bin/env bash
# The grouped GEMMs' tile rows (128-row cooperative vs 64-row ping-pong) at token counts that are
# and are not multiples of 128 rows per expert, with PyTorch's grouped_mm MLP beside them.
set -u
source scripts/gpu/bundle_lib.sh
OUT=/tmp/tile_out
start_device_script "$1" || exit 1
timeout 100 "$B/cuda_kernels_test" --gtest_filter='*GroupedSm90*' > "$OUT/kt.log" 2>&1
echo "kernel test rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/kt.log" | tr '\n' ' ')"
export MOESERVE_BENCH_PATHS=grouped MOESERVE_BENCH_FORMATS=bf16 MOESERVE_BENCH_LAYERS=seed,dsv3
T=512,520,600,960,1000,1024,1040,1100,1280,2048
for round in 1 2; do for tile in 128 64; do
  MOESERVE_BENCH_GROUPED_TILE=$tile MOESERVE_BENCH_TOKENS=$T timeout 200 "$B/moe_experts_bench" 2>/dev/null |
    tail -n +2 | awk -F, -v t=$tile '{print t","$0}' >> "$OUT/tile.csv"
done; done
MOESERVE_BENCH_TOKENS=$T timeout 300 python3 scripts/gpu/bench_moe.py "$B/moe_experts_bench" "$OUT/py" > "$OUT/py.log" 2>&1
echo "bench_moe rc=$?"
python3 - "$OUT/tile.csv" "$OUT/py.log" <<'PY'
import sys, ast, collections, statistics
t = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    t[(f[1], int(f[3]), f[4], f[0])].append(float(f[5]))
torch = {}
for line in open(sys.argv[2]):
    if line.startswith("{'layer'"):
        r = ast.literal_eval(line)
        torch[(r["layer"], r["tokens"], r["routing"])] = r["torch"]
print("layer tokens routing | tile128 us | tile64 us | 64/128 | torch us | torch/best")
for k in sorted({k[:3] for k in t}):
    a = statistics.median(t[k + ("128",)]); b = statistics.median(t[k + ("64",)])
    tt = torch.get(k, float("nan"))
    print(*k, "|", f"{a:.0f} | {b:.0f} | {b/a:.3f} | {tt:.0f} | {tt/min(a,b):.2f}")
PY
