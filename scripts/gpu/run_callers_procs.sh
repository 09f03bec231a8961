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
start_device_script "$1" || exit 1
source scripts/gpu/serve_lib.sh
PORT=50191
row() { :; }
# Engine steps so far (moeserve_batch_calls_count: one observation per step).
steps() {
  python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$((PORT + 1))/metrics').read().decode())" |
    awk '/^moeserve_batch_calls_count / { print int($2) }'
}
# Cumulative merged-step phases (us) and turnarounds: "steps arrivals take merge engine
# answers turnaround_count turnaround_us" (moeserve_batch_merged_step_seconds_total etc.).
phases() {
  python3 - "$((PORT + 1))" <<'PY'
import re, sys, urllib.request as u
text = u.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics").read().decode()
def v(name, label=""):
    for line in text.splitlines():
        if line.startswith(name) and label in line and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
out = [v("moeserve_batch_merged_steps_total")]
for p in ("arrivals", "take", "merge", "engine", "answers"):
    out.append(1e6 * v("moeserve_batch_merged_step_seconds_total", f'phase="{p}"'))
out += [v("moeserve_caller_turnaround_seconds_count"),
        1e6 * v("moeserve_caller_turnaround_seconds_sum")]
print(" ".join(f"{x:.0f}" for x in out))
PY
}
# Per merged step between two phases() readings: "steps=N arrivals= take= merge= engine=
# answers= (us per step) turnaround= (us per call)".
phase_delta() {
  awk -v a="$1" -v b="$2" 'BEGIN {
    split(a, x, " "); split(b, y, " "); n = y[1] - x[1]
    printf "merged_steps=%d", n
    split("arrivals take merge engine answers", name, " ")
    for (i = 2; i <= 6; ++i) printf " %s=%.0f", name[i - 1], (n > 0 ? (y[i] - x[i]) / n : 0)
    c = y[7] - x[7]
    printf " turnaround=%.0f (us; %d samples)\n", (c > 0 ? (y[8] - x[8]) / c : 0), c }'
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
