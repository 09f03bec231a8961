#!/bin/bash
# A 1-token call's server cost against the scheduling thread's polling (--step_spin_us), in
# one device call: trivial experts (H7168, I64, 16 experts, top-4), one closed-loop caller at
# M=1 (unary, then ForwardStream), per server configuration; then issue 12's 8-caller check of
# run_company_wait.sh with the same configurations (SEED=0 skips it).
# Usage: run_step_spin.sh TRANSPORT_BUNDLE.tar.xz (make_bundle.sh) or BIN_DIR; writes under
#   $OUT. CONFIGS: server flag sets separated by '|' (default: the defaults,
#   --step_spin_us=2000, --inline_max_tokens=0); REPS (default 2).
set -uo pipefail
OUT=${OUT:-/tmp/serving}; mkdir -p "$OUT"
here=$(dirname "$0")
source "$here/../../../scripts/gpu/serve_lib.sh"
B=${1:-build/bin}
if [[ "$B" == *.tar.xz ]]; then use_bundle "$B" || exit 1; fi
PORT=50161
TRIVIAL="--model tiny --hidden 7168 --intermediate 64 --num_experts 16 --topk 4 --num_layers 1"
CONFIGS=${CONFIGS:-"defaults|--step_spin_us=2000|--inline_max_tokens=0"}
declare -a ROWS SUMMARY
row() { ROWS+=("$(printf '%-28s %s' "$1" "$2")"); echo "== $1: $2"; }
stage() { grep -o "$2=[0-9.]*" "$OUT/load_$1.log" | tail -1 | cut -d= -f2; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null; date -u
IFS='|' read -r -a configs <<< "$CONFIGS"
for ci in "${!configs[@]}"; do
  flags=${configs[$ci]}
  [ "$flags" = defaults ] && flags=""
  # shellcheck disable=SC2086
  serve trivial_c$ci $TRIVIAL $flags
  for rep in $(seq 1 "${REPS:-2}"); do
    for mode in unary stream; do
      t=trivial_c${ci}_${mode}_r$rep
      extra=""; [ $mode = stream ] && extra=--stream
      # shellcheck disable=SC2086
      load "$t" 1 1 3000 $extra
      total=$(grep -o 'server_total_us: p50=[0-9.]*' "$OUT/load_$t.log" | cut -d= -f2)
      SUMMARY+=("| ${configs[$ci]} | $mode | $rep | $(val "$t" p50) | $(val "$t" p99) | $total | $(stage "$t" queue) / $(stage "$t" prepare) / $(stage "$t" experts) / $(stage "$t" finalize) | $(stage "$t" engine) | $(val "$t" requests_per_s) |")
    done
  done
  stop
done
if [ "${SEED:-1}" = 1 ]; then
  CONFIGS="$CONFIGS" REPS=${SEED_REPS:-1} OUT=$OUT/seed "$here/run_company_wait.sh" "$B" | tail -12
fi
echo "=================== trivial M=1, one caller ==================="
echo "| server flags | rpc | rep | p50 ms | p99 ms | server total p50 us | queue / prepare / experts / finalize us | engine us | calls/s |"
echo "|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${SUMMARY[@]}"
