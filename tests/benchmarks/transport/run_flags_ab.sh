#!/bin/bash
# A/B of server flag sets, or of server builds, on issue 11's gRPC path, in one device call:
# run_transport_device.sh once per set and round (ways tcp and unix, M=256 and 1024 by default,
# no Python), the sets alternating, then one line per (set, layer, way, M) with the medians over
# the rounds of the round trip, the server total and the experts stage.
#
#   CONFIGS="--malloc_trim_threshold_mb=0|defaults|--gather_streaming_stores" ROUNDS=2 \
#     bash tests/benchmarks/transport/run_flags_ab.sh .bundle/transport.tar.xz
#   BUNDLES=".bundle/transport_before.tar.xz|.bundle/transport.tar.xz" MS="1 2 4 16" \
#     LAYERS=seed WAYS=tcp bash tests/benchmarks/transport/run_flags_ab.sh
#
# CONFIGS: flag sets separated by '|' ("defaults": none), all on one bundle (the argument).
# BUNDLES: instead, bundles (make_bundle.sh) separated by '|', each run with the defaults.
# MS, WAYS, LAYERS, N, N_BIG: as for run_transport_device.sh (defaults "256 1024", "tcp unix",
# "trivial seed", 200, 100).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/flags_ab}
mkdir -p "$OUT"
# Each set: a bundle folder and flags. A bundle file is unpacked once; every run uses the folder.
unpack() {  # unpack BUNDLE_FILE_OR_DIR INDEX -> folder
  if [ -f "$1" ]; then
    mkdir -p "$OUT/bundle$2"
    tar -C "$OUT/bundle$2" -xJf "$1" || echo "could not unpack $1" >&2
    echo "$OUT/bundle$2/transport"
  else
    echo "$1"
  fi
}
bundles=()
flag_sets=()
if [ -n "${BUNDLES:-}" ]; then
  IFS='|' read -r -a sets <<<"$BUNDLES"
  for i in "${!sets[@]}"; do
    bundles+=("$(unpack "${sets[$i]}" "$i")")
    flag_sets+=("")
  done
else
  CONFIGS=${CONFIGS:-"--malloc_trim_threshold_mb=0|defaults|--gather_streaming_stores"}
  IFS='|' read -r -a sets <<<"$CONFIGS"
  one=$(unpack "${1:-${BUNDLE:-$PWD/.bundle/transport.tar.xz}}" 0)
  for i in "${!sets[@]}"; do
    bundles+=("$one")
    flags=${sets[$i]}
    [ "$flags" = defaults ] && flags=""
    flag_sets+=("$flags")
  done
fi
ROUNDS=${ROUNDS:-2}
for round in $(seq "$ROUNDS"); do
  for i in "${!sets[@]}"; do
    SERVER_FLAGS="${flag_sets[$i]}" OUT="$OUT/r${round}_c$i" MS=${MS:-256 1024} \
      WAYS=${WAYS:-tcp unix} LAYERS=${LAYERS:-trivial seed} N=${N:-200} N_BIG=${N_BIG:-100} PY=0 \
      BUDGET_S=${BUDGET_S:-200} \
      bash "$here/run_transport_device.sh" "${bundles[$i]}" >"$OUT/r${round}_c$i.txt" 2>&1
    echo "round $round set $i (${sets[$i]}): $(grep -c ': rt ' "$OUT/r${round}_c$i.txt") points"
  done
done
# Lines like "[93s] trivial tcp M=1024: rt 15.711 ms, server 1920.8 us, server_stages_us_p50:
# queue=.. prepare=.. experts=202.0 ...".
python3 - "$OUT" "$(IFS='|'; echo "${sets[*]}")" "$ROUNDS" <<'PY'
import re, statistics, sys
out, configs, rounds = sys.argv[1], sys.argv[2].split("|"), int(sys.argv[3])
pat = re.compile(r"\] (\S+) (\S+) M=(\d+): rt ([\d.]+) ms, server ([\d.]+) us.*experts=([\d.]+)")
rows = {}
for r in range(1, rounds + 1):
    for i in range(len(configs)):
        try:
            text = open(f"{out}/r{r}_c{i}.txt").read()
        except OSError:
            continue
        for layer, way, m, rt, srv, exp in pat.findall(text):
            rows.setdefault((i, layer, way, int(m)), []).append((float(rt), float(srv), float(exp)))
print("| set | layer | way | M | rt ms | server us | experts us | server - experts us |")
print("|---|---|---|---|---|---|---|---|")
for (i, layer, way, m), v in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][3], kv[0][0])):
    rt, srv, exp = (statistics.median(x) for x in zip(*v))
    print(f"| {configs[i]} | {layer} | {way} | {m} | {rt:.3f} | {srv:.0f} | {exp:.0f} | {srv - exp:.0f} |")
PY
