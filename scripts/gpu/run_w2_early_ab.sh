#!/usr/bin/env bash
# W2's weights requested before it waits for W13 (MoeGemmParams::weights_before_wait) on and off
# (MOESERVE_W2_EARLY=0) in one build, one device call: the GPU suites with racecheck on the new
# chain test and the cluster tile, then engine_forward_bench (trivial layer BF16 and seed MXFP8
# at 1, 16 and 64 tokens, timed) and moe_experts_bench's decode path (FORMATS,
# default bf16,mxfp8; LAYERS, default seed,dsv3; TOKENS, default 1,16,32,64,128), settings
# alternating, ROUNDS rounds (default 2), medians.
# Usage: run_w2_early_ab.sh BUNDLE.tgz (bin/: engine_forward_bench, moe_experts_bench, the tests).
set -u
source "$(dirname "$0")/bundle_lib.sh"
start_device_script "$1" || exit 1
gpu_suites '*WeightsBeforeWait*:*DecodePair*'
CSV=$OUT/engine_w2_early.csv
for round in $(seq "${ROUNDS:-2}"); do for early in 0 1; do
  for model in trivial seed; do
    fmt=bf16; [ $model = seed ] && fmt=mxfp8
    MOESERVE_W2_EARLY=$early timeout 120 "$B/engine_forward_bench" --model $model \
      --weight_format $fmt --tokens 1,16,64 --iters 400 | grep -v '^#\|^tokens' |
      awk -F, -v p=$early -v m=$model '{print p","m","$0}' >> "$CSV"
  done
done; done
echo "== engine_forward_bench, medians: early model tokens -> wall p50 us, experts stage us"
python3 - "$CSV" <<'PY'
import sys, collections, statistics
t = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) < 8: continue
    t[(f[1], int(f[2]), f[0])].append((float(f[3]), float(f[6])))
for k in sorted(t):
    print(f"{k[0]:8s} tokens={k[1]:3d} early={k[2]}: wall {statistics.median(x[0] for x in t[k]):7.1f}"
          f" experts {statistics.median(x[1] for x in t[k]):7.1f}")
PY
echo "== moe_experts_bench decode path, MOESERVE_W2_EARLY=0 against the default (on)"
FORMATS=${FORMATS:-bf16,mxfp8} LAYERS=${LAYERS:-seed,dsv3} TOKENS=${TOKENS:-1,16,32,64,128} \
  decode_ab MOESERVE_W2_EARLY "$OUT/decode_w2_early.csv" 0 default
