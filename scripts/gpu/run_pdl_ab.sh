#!/usr/bin/env bash
# Programmatic dependent launch on and off (MOESERVE_PDL=0) in one build, one device call:
# the GPU suites (every GEMM tile, the graphs), then engine_forward_bench (trivial layer BF16 and
# seed MXFP8 at 1 and 16 tokens, timed) and moe_experts_bench's decode path (LAYERS, default
# seed; TOKENS, default 1,16,64), settings alternating, ROUNDS rounds (default 2), medians.
# Usage: run_pdl_ab.sh BUNDLE.tgz (bin/: engine_forward_bench, moe_experts_bench, the tests).
set -u
source "$(dirname "$0")/bundle_lib.sh"
start_device_script "$1" || exit 1
SANITIZERS=${SANITIZERS:-} gpu_suites '*DecodePair*'
CSV=$OUT/engine_pdl.csv
for round in $(seq "${ROUNDS:-2}"); do for pdl in 0 1; do
  for model in trivial seed; do
    fmt=bf16; [ $model = seed ] && fmt=mxfp8
    MOESERVE_PDL=$pdl timeout 120 "$B/engine_forward_bench" --model $model --weight_format $fmt \
      --tokens 1,16 --iters 600 | grep -v '^#\|^tokens' |
      awk -F, -v p=$pdl -v m=$model '{print p","m","$0}' >> "$CSV"
  done
done; done
echo "== engine_forward_bench, medians: pdl model tokens -> wall p50 us, experts stage us"
python3 - "$CSV" <<'PY'
import sys, collections, statistics
t = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) < 8: continue
    t[(f[1], int(f[2]), f[0])].append((float(f[3]), float(f[6])))
for k in sorted(t):
    print(f"{k[0]:8s} tokens={k[1]:3d} pdl={k[2]}: wall {statistics.median(x[0] for x in t[k]):7.1f}"
          f" experts {statistics.median(x[1] for x in t[k]):7.1f}")
PY
echo "== moe_experts_bench decode path, MOESERVE_PDL=0 against the default (on)"
LAYERS=${LAYERS:-seed} TOKENS=${TOKENS:-1,16,64} decode_ab MOESERVE_PDL "$OUT/decode_pdl.csv" 0 default
