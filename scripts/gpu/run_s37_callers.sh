#!/usr/bin/env bash
# Issue 12's 8-caller ratio (seed MXFP8, M=16: 8 closed-loop callers' calls/s over one caller's)
# for server flag variants of build b, ROUNDS alternating rounds: each variant on a fresh server,
# one caller (400 calls) then 8 callers (6400 calls, twice as long as the serving benchmark's).
# VARIANTS: '|'-separated server flags ("-": none; NAME=VALUE words go to the server's
# environment). Usage: run_s37_callers.sh BUNDLE.tgz
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_serving_script "$1" 50171 || exit 1
ln -sf "$B/moeserve_b" "$B/moeserve"
IFS='|' read -r -a variants <<< "${VARIANTS:--|--company_wait_us 300|--company_wait_us 700}"
for r in $(seq "${ROUNDS:-2}"); do
  idx=$(seq 0 $((${#variants[@]} - 1)))
  ((r % 2)) || idx=$(echo "$idx" | tac)
  for i in $idx; do
    v=${variants[$i]}
    flags=""; envs=()
    for w in $v; do
      [ "$w" = - ] && continue
      if [[ "$w" =~ ^[A-Z_]+= ]]; then envs+=("$w"); else flags="$flags $w"; fi
    done
    t=v${i}_$r
    for e in "${envs[@]}"; do export "${e?}"; done
    # shellcheck disable=SC2086
    serve $t --model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8 $flags
    for e in "${envs[@]}"; do unset "${e%%=*}"; done
    load ${t}_c1 16 1 400
    load ${t}_c8 16 8 6400
    stop
    echo "[$v] r$r: 1 caller $(val ${t}_c1 requests_per_s)/s p50 $(val ${t}_c1 p50);" \
      "8 callers $(val ${t}_c8 requests_per_s)/s p50 $(val ${t}_c8 p50):" \
      "x$(ratio "$(val ${t}_c8 requests_per_s)" "$(val ${t}_c1 requests_per_s)")," \
      "p50 x$(ratio "$(val ${t}_c8 p50)" "$(val ${t}_c1 p50)");" \
      "c8 stages $(grep -E '^server_stages_us_p50' "$OUT/load_${t}_c8.log" | grep -o 'queue=[0-9.]*\|engine=[0-9.]*\|experts=[0-9.]*' | tr '\n' ' ')"
  done
done
