#!/bin/bash
# Issue 12's "8 callers >= 5x one caller" against the batcher's settings (--company_wait_us,
# --parallel_answers), in one device call: seed per-rank layer (32 experts, top-8, H3072 I5120),
# for each weight format and server configuration,
# one closed-loop caller then 8 (M=16 each, TCP loopback, one connection each), twice, on one
# server per wait. Per row: calls/s, p50, and the mean calls per engine step (from /metrics:
# moeserve_batch_calls sum / count over that load alone).
# Usage: run_company_wait.sh TRANSPORT_BUNDLE.tar.xz (make_bundle.sh) or BIN_DIR (moeserve,
#   moeserve-cli; LD_LIBRARY_PATH set); writes under $OUT.
#   WFS (default "mxfp8 bf16"); CONFIGS, server flag sets separated by '|' (default: the
#   defaults, then --company_wait_us=0, then --parallel_answers=false); REPS (default 2);
#   MODEL_FLAGS (default the seed layer).
set -uo pipefail
OUT=${OUT:-/tmp/serving}; mkdir -p "$OUT"
source "$(dirname "$0")/../../../scripts/gpu/serve_lib.sh"
B=${1:-build/bin}
if [[ "$B" == *.tar.xz ]]; then use_bundle "$B" || exit 1; fi
PORT=50151
SEED=${MODEL_FLAGS:-"--model seed-megamoe --num_experts 32 --num_layers 1"}
declare -a ROWS
row() { ROWS+=("$(printf '%-28s %s' "$1" "$2")"); echo "== $1: $2"; }
# sum and count of moeserve_batch_calls now
batch_calls() {
  python3 - "$PORT" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{int(sys.argv[1]) + 1}/metrics", timeout=10).read().decode()
s = c = 0.0
for line in text.splitlines():
    if line.startswith("moeserve_batch_calls_sum"): s += float(line.split()[-1])
    if line.startswith("moeserve_batch_calls_count"): c += float(line.split()[-1])
print(s, c)
PY
}
mean_calls() {  # before after
  awk -v a="$1" -v b="$2" 'BEGIN { split(a, x, " "); split(b, y, " ");
    if (y[2] > x[2]) printf "%.2f", (y[1] - x[1]) / (y[2] - x[2]); else print "n/a" }'
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null; date -u
declare -a SUMMARY
for wf in ${WFS:-mxfp8 bf16}; do
  IFS='|' read -r -a configs <<< "${CONFIGS:-defaults|--company_wait_us=0|--parallel_answers=false}"
  for ci in "${!configs[@]}"; do
    flags=${configs[$ci]}; w=c$ci
    [ "$flags" = defaults ] && flags=""
    # shellcheck disable=SC2086
    serve ${wf}_$w $SEED --weight_format $wf $flags
    for rep in $(seq 1 "${REPS:-2}"); do
      t="${wf}_${w}_r$rep"
      load "${t}_c1" 16 1 800
      b0=$(batch_calls)
      load "${t}_c8" 16 8 6400
      b1=$(batch_calls)
      t1=$(val "${t}_c1" requests_per_s); t8=$(val "${t}_c8" requests_per_s)
      p1=$(val "${t}_c1" p50); p8=$(val "${t}_c8" p50)
      SUMMARY+=("| $wf | ${configs[$ci]} | $rep | $t1 | $t8 ($(ratio "$t8" "$t1")x) | $p1 / $p8 | $(ratio "$p8" "$p1")x | $(mean_calls "$b0" "$b1") |")
    done
    stop
  done
done
echo "=================== summary ==================="
printf '%s\n' "${ROWS[@]}"
echo "| weights | server flags | rep | 1 caller calls/s | 8 callers calls/s (ratio) | p50 ms 1 / 8 | p50 ratio | calls per step (8) |"
echo "|---|---|---|---|---|---|---|---|"
printf '%s\n' "${SUMMARY[@]}"
