#!/usr/bin/env bash
# Issue 12's "8 concurrent callers" two ways: one moeserve-cli process with 8 closed-loop workers
# (the serving benchmark's way) and 8 moeserve-cli processes of one caller each (8 frontends),
# against one caller; seed layer, M=16, for each weight format of WFS (default "mxfp8 bf16") and
# each server case of CASES ('|'-separated "NAME [SERVER FLAGS]", default "default"), ROUNDS
# (default 2) fresh servers each. Bundle BUNDLE.tgz as make_ab_bundle.sh's (moeserve_b; SIDES="a b"
# runs each case on both builds, named a-CASE and b-CASE).
# Prints one line per run: calls/s of 1, of 8 in one process, of 8 processes (summed), the
# ratios, the p50s (8 processes: the median of their p50s) and the one-process load's calls per
# engine step.
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_serving_script "$1" 50191 || exit 1
# Engine steps so far (moeserve_batch_calls_count: one observation per step).
steps() {
  python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$((PORT + 1))/metrics').read().decode())" |
    awk '/^moeserve_batch_calls_count / { print int($2) }'
}
SEED="--model seed-megamoe --num_experts 32 --num_layers 1"
IFS='|' read -r -a cases <<< "${CASES:-default}"
printf '%-3s %-6s %-22s %8s %8s %8s %6s %6s %7s %7s %7s %9s\n' r wf case c1 c8_1p c8_8p x_1p x_8p \
  p50_c1 p50_1p p50_8p calls/step
for r in $(seq "${ROUNDS:-2}"); do
  for wf in ${WFS:-mxfp8 bf16}; do
    for c in "${cases[@]}"; do
      for side in ${SIDES:-b}; do
        ln -sf "$B/moeserve_$side" "$B/moeserve"
        read -r name flags <<< "$c"
        [ "${SIDES:-b}" = b ] || name=$side-$name
        t=${wf}_${name}_$r
        # shellcheck disable=SC2086
        serve "$t" $SEED --weight_format "$wf" $flags
        load "${t}_c1" 16 1 400
        s0=$(steps)
        ph0=$(phases)
        load "${t}_c8" 16 8 6400
        s8=$(( $(steps) - s0 ))
        echo "  ${t} c8: $(phase_delta "$ph0" "$(phases)")" >> "$OUT/phases.txt"
        pids=()
        for i in $(seq 8); do
          timeout 120 "$B/moeserve-cli" load --target 127.0.0.1:$PORT --tokens 16 --concurrency 1 \
            --requests 1600 --routing balanced > "$OUT/load_${t}_p$i.log" 2>&1 &
          pids+=($!)
        done
        wait "${pids[@]}"
        stop
        sum=0; p50s=()
        for i in $(seq 8); do
          sum=$(awk -v a="$sum" -v b="$(val "${t}_p$i" requests_per_s)" 'BEGIN { print a + b }')
          p50s+=("$(val "${t}_p$i" p50)")
        done
        med=$(printf '%s\n' "${p50s[@]}" | sort -n | sed -n 4p)
        c1=$(val "${t}_c1" requests_per_s)
        printf '%-3s %-6s %-22s %8s %8s %8.1f %6s %6s %7s %7s %7s %9s\n' "$r" "$wf" "$name" "$c1" \
          "$(val "${t}_c8" requests_per_s)" "$sum" "$(ratio "$(val "${t}_c8" requests_per_s)" "$c1")" \
          "$(ratio "$sum" "$c1")" "$(val "${t}_c1" p50)" "$(val "${t}_c8" p50)" "$med" "$(ratio 6400 "$s8")"
      done
    done
  done
done
cat "$OUT/phases.txt" 2>/dev/null
# One archive: a call brings back a limited number of files.
(cd "$OUT" && tar -czf callers_logs.tgz ./*.log && rm -f ./*.log)
