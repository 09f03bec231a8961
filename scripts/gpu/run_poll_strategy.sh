#!/usr/bin/env bash
# Whether gRPC's poller is what spreads 8 closed-loop callers' turnarounds (serving/RESULTS.md
# 17:17: 8 callers in one client process come back over 380-550 us): the seed layer at M=16,
# one caller and 8 callers in one moeserve-cli process, for each format of WFS (default "bf16
# mxfp8") and each CASE of CASES ('|'-separated "NAME CLIENT_POLL SERVER_POLL [SERVER FLAGS]",
# a poll strategy being GRPC_POLL_STRATEGY's value or "-" for gRPC's default), ROUNDS fresh
# servers each. Bundle as make_ab_bundle.sh's (moeserve_b, or moeserve_$LAST).
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_serving_script "$1" 50193 || exit 1
ln -sf "$B/moeserve_${LAST:-b}" "$B/moeserve"
SEED="--model seed-megamoe --num_experts 32 --num_layers 1"
IFS='|' read -r -a cases <<< "${CASES:-default - -|client_poll poll -|both_poll poll poll}"
printf '%-3s %-6s %-12s %8s %8s %6s %7s %7s  %s\n' r wf case c1 c8 x p50_c1 p50_c8 phases
for r in $(seq "${ROUNDS:-2}"); do
  for wf in ${WFS:-bf16 mxfp8}; do
    for c in "${cases[@]}"; do
      read -r name cpoll spoll flags <<< "$c"
      t=${wf}_${name}_$r
      senv=""; cenv=()
      [ "$spoll" = - ] || senv="GRPC_POLL_STRATEGY=$spoll"
      [ "$cpoll" = - ] || cenv=(env GRPC_POLL_STRATEGY="$cpoll")
      # shellcheck disable=SC2086
      SERVE_ENV=$senv serve "$t" $SEED --weight_format "$wf" $flags
      for conc in 1 8; do
        n=$((conc == 1 ? 400 : 6400))
        [ $conc = 8 ] && ph0=$(phases)
        "${cenv[@]}" timeout 120 "$B/moeserve-cli" load --target 127.0.0.1:$PORT --tokens 16 \
          --concurrency $conc --requests $n --routing balanced > "$OUT/load_${t}_c$conc.log" 2>&1
      done
      ph=$(phase_delta "$ph0" "$(phases)")
      stop
      c1=$(val "${t}_c1" requests_per_s)
      c8=$(val "${t}_c8" requests_per_s)
      printf '%-3s %-6s %-12s %8s %8s %6s %7s %7s  %s\n' "$r" "$wf" "$name" "$c1" "$c8" \
        "$(ratio "$c8" "$c1")" "$(val "${t}_c1" p50)" "$(val "${t}_c8" p50)" "$ph"
    done
  done
done
(cd "$OUT" && tar -czf poll_logs.tgz ./*.log && rm -f ./*.log)
