#!/bin/bash
# One device call: the decode GEMMs' split-K count (MoeGemmSplitCount, which now also splits
# when the units would leave the last round of CTAs mostly idle) checked and measured.
#   1. the GPU suites (scripts/gpu/run_w8a8_tests.sh: cuda_kernels_test whole, the experts sweep
#      in four shards, the engine's W8A8 / reference tests, memcheck on the W8A8 kernels);
#   2. moe_experts_bench, decode path, 1-16 tokens, before (.b/before) and after (.b/bin)
#      alternating ROUNDS times; a table of the medians;
#   3. (WGMMA_AB=1) the after build's decode path at 192-512 tokens with the warpgroup-MMA tiles
#      as chosen, at least 128 wide (MOESERVE_WGMMA_MIN_BN=128), and 64 wide unless a count
#      exceeds 64 (=1: both launches gated on the device), alternating; tables last.
# Binaries in .b/bin (this build) and .b/before (the build before the change), libraries in .b/lib.
B=.b/bin; BB=.b/before; export LD_LIBRARY_PATH=$PWD/.b/lib; O=${OUT:-/tmp/out}; mkdir -p "$O"
ROUNDS=${ROUNDS:-2}
bash scripts/gpu/run_w8a8_tests.sh 2>&1 | tee "$O/tests.txt"
export MOESERVE_BENCH_TOKENS=${TOKENS:-1,2,4,8,16} MOESERVE_BENCH_PATHS=decode \
  MOESERVE_BENCH_ROUTING=${ROUTING:-balanced,random} MOESERVE_BENCH_FORMATS=${FORMATS:-mxfp8,bf16}
for r in $(seq 1 "$ROUNDS"); do
  for v in before after; do
    bin=$B/moe_experts_bench; [ $v = before ] && bin=$BB/moe_experts_bench
    s=$(date +%s); timeout 200 "$bin" > "$O/bench_${v}_$r.csv" 2> "$O/bench_${v}_$r.err"
    echo "bench $v round $r rc=$? $(( $(date +%s) - s )) s"
  done
done
# layer,format,tokens,routing,median_us,weight_bytes,routes,path -> medians over the rounds.
cat > "$O/table.py" <<'PY'
import csv, glob, os, statistics, sys
o, va, vb = sys.argv[1], sys.argv[2], sys.argv[3]
t = {}
for v in (va, vb):
    for f in sorted(glob.glob(os.path.join(o, f"bench_{v}_*.csv"))):
        for row in csv.reader(open(f)):
            if len(row) < 8 or not row[2].isdigit():
                continue
            key = (row[0], row[1], int(row[2]), row[3])
            t.setdefault(key, {}).setdefault(v, []).append(float(row[4]))
            # Weights a step streams: the experts its routes touch (32 experts, top-8; random:
            # the expected number of distinct ones).
            m = int(row[2])
            touched = min(32, 8 * m) if row[3] == "balanced" else 32 * (1 - (24 / 32) ** m)
            t[key]["bytes"] = float(row[5]) * touched / 32
print(f"| layer | format | tokens | routing | {va} us | {vb} us | {vb} / {va} | {vb} % of floor (touched experts / 4.3 TB/s) |")
print("|---|---|---|---|---|---|---|---|")
for key in sorted(t):
    d = t[key]
    if va not in d or vb not in d:
        continue
    b, a = statistics.median(d[va]), statistics.median(d[vb])
    floor = d["bytes"] / 4.3e12 * 1e6
    print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {b:.1f} | {a:.1f} | {a / b:.3f} | {100 * floor / a:.0f}% |")
PY
python3 "$O/table.py" "$O" before after | tee "$O/split_table.md"
if [ "${WGMMA_AB:-0}" = 1 ]; then
  export MOESERVE_BENCH_TOKENS=${WG_TOKENS:-192,256,384,512} MOESERVE_BENCH_ROUTING=balanced,hot,random
  for r in $(seq 1 "${WG_ROUNDS:-1}"); do
    for v in bn_auto bn_128 bn_gate; do
      s=$(date +%s)
      min_bn=0; [ $v = bn_128 ] && min_bn=128; [ $v = bn_gate ] && min_bn=1
      MOESERVE_WGMMA_MIN_BN=$min_bn timeout 200 $B/moe_experts_bench > "$O/bench_${v}_$r.csv" 2>&1
      echo "bench $v round $r rc=$? $(( $(date +%s) - s )) s"
    done
  done
  python3 "$O/table.py" "$O" bn_auto bn_128 | tee "$O/wgmma_bn_table.md"
  python3 "$O/table.py" "$O" bn_auto bn_gate | tee "$O/wgmma_gate_table.md"
fi
