#!/usr/bin/env bash
# One device call, A/B of two builds' expert GEMMs: the kernel tests (EXPERTS=1: and the experts
# sweep and engine_cuda_test; SANITIZE=1: compute-sanitizer on the wgmma and split-K tests),
# then moe_experts_bench of this build ("after", bin/moe_experts_bench) against a "before" build
# (bin/moe_experts_bench_before), alternating, two rounds each, and (NCU=1) Nsight Compute on
# the 256-token seed MXFP8 wgmma launches, balanced and hot. Usage: run_bench_ab.sh BUNDLE.tgz.
# Env: FORMATS (mxfp8,bf16), TOKENS (128,256,512), LAYERS (seed,dsv3), PATHS (decode). Writes
# under $OUT.
set -u
source "$(dirname "$0")/bundle_lib.sh"
start_device_script "$1" || exit 1
run_gtest cuda_kernels_test 120
if [ "${EXPERTS:-0}" = 1 ]; then
  run_gtest cuda_experts_test 300
  run_gtest engine_cuda_test 200
fi
if command -v compute-sanitizer > /dev/null && [ "${SANITIZE:-0}" = 1 ]; then
  for tool in memcheck racecheck synccheck; do
    timeout 150 compute-sanitizer --tool $tool "$B/cuda_kernels_test" \
      --gtest_filter='*Wgmma*:*SplitK*' > "$OUT/sanitizer_$tool.txt" 2>&1
    echo "sanitizer $tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$OUT/sanitizer_$tool.txt" | tr '\n' ' ')"
  done
fi
export MOESERVE_BENCH_FORMATS=${FORMATS:-mxfp8,bf16} MOESERVE_BENCH_PATHS=${PATHS:-decode}
export MOESERVE_BENCH_LAYERS=${LAYERS:-seed,dsv3}
for round in 1 2; do
  for build in before after; do
    bin="$B/moe_experts_bench"
    [ $build = before ] && bin="$B/moe_experts_bench_before"
    MOESERVE_BENCH_TOKENS=${TOKENS:-128,256,512} timeout 300 "$bin" 2>/dev/null | tail -n +2 |
      awk -F, -v f=$build -v r=$round '{print f","r","$0}' >> "$OUT/bench.csv"
  done
done
python3 "$(dirname "$0")/bench_table.py" --ratio before after "$OUT/bench.csv"
if command -v ncu > /dev/null && [ "${NCU:-1}" = 1 ]; then
  for routing in balanced hot; do
    MOESERVE_BENCH_FORMATS=mxfp8 MOESERVE_BENCH_TOKENS=256 MOESERVE_BENCH_LAYERS=seed \
      MOESERVE_BENCH_ROUTING=$routing \
      timeout 200 ncu --clock-control none --kernel-name regex:MoeGemmWgmma --launch-skip 10 \
      --launch-count 2 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      "$B/moe_experts_bench" > "$OUT/ncu_256_$routing.txt" 2>&1
    echo "ncu $routing:"
    grep -E "Duration|DRAM Throughput|Issued Warp|No Eligible" "$OUT/ncu_256_$routing.txt" | head -12
  done
fi
# NCU_KERNELS=1: Nsight Compute durations of every kernel of one grouped MLP (seed, hot, 1024
# tokens) for both builds: align, gather, W13, SiLU-and-mul, W2, unpermute.
if command -v ncu > /dev/null && [ "${NCU_KERNELS:-0}" = 1 ]; then
  for build in before after; do
    bin="$B/moe_experts_bench"
    [ $build = before ] && bin="$B/moe_experts_bench_before"
    MOESERVE_BENCH_PATHS=grouped MOESERVE_BENCH_FORMATS=bf16 MOESERVE_BENCH_TOKENS=1024 \
      MOESERVE_BENCH_LAYERS=seed MOESERVE_BENCH_ROUTING=hot \
      timeout 200 ncu --clock-control none --launch-skip 64 --launch-count 16 \
      --metrics gpu__time_duration.sum "$bin" > "$OUT/ncu_kernels_$build.txt" 2>&1
    echo "ncu kernels, $build:"
    python3 - "$OUT/ncu_kernels_$build.txt" <<'PY'
import re, sys
name = None
for line in open(sys.argv[1]):
    m = re.match(r"  (?:void )?(\S+?)[(<]", line)
    if m and "Context" in line:
        name = m.group(1).split("::")[-1]
        name = "cutlass_gemm" if "cutlass" in line else name
    elif "gpu__time_duration.sum" in line and name:
        print(f"  {name:28s} {line.split()[-1]} us")
PY
  done
fi
