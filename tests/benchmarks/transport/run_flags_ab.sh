#!/bin/bash
# A/B of server flag sets on issue 11's gRPC path, in one device call: run_transport_device.sh
# once per flag set and round (ways tcp and unix, M=256 and 1024 by default, no Python), the
# sets alternating, then one line per (set, layer, way, M) with the medians over the rounds of
# the round trip, the server total and the experts stage.
#
#   CONFIGS="--malloc_trim_threshold_mb=0|defaults|--gather_streaming_stores" ROUNDS=2 \
#     bash tests/benchmarks/transport/run_flags_ab.sh .bundle/transport.tar.xz
#
# CONFIGS: flag sets separated by '|' ("defaults": none). MS, WAYS, LAYERS, N_BIG: as for
# run_transport_device.sh (defaults "256 1024", "tcp unix", "trivial seed", 100).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
BUNDLE=${1:-${BUNDLE:-$PWD/.bundle/transport.tar.xz}}
OUT=${OUT:-/tmp/flags_ab}
mkdir -p "$OUT"
if [ -f "$BUNDLE" ]; then  # unpack once; every run then uses the folder
  tar -C "$OUT" -xJf "$BUNDLE" || echo "could not unpack $BUNDLE"
  BUNDLE=$OUT/transport
fi
CONFIGS=${CONFIGS:-"--malloc_trim_threshold_mb=0|defaults|--gather_streaming_stores"}
ROUNDS=${ROUNDS:-2}
IFS='|' read -r -a sets <<<"$CONFIGS"
for round in $(seq "$ROUNDS"); do
  for i in "${!sets[@]}"; do
    flags=${sets[$i]}
    [ "$flags" = defaults ] && flags=""
    SERVER_FLAGS="$flags" OUT="$OUT/r${round}_c$i" MS=${MS:-256 1024} WAYS=${WAYS:-tcp unix} \
      LAYERS=${LAYERS:-trivial seed} N_BIG=${N_BIG:-100} PY=0 BUDGET_S=${BUDGET_S:-200} \
      bash "$here/run_transport_device.sh" "$BUNDLE" >"$OUT/r${round}_c$i.txt" 2>&1
    echo "round $round set $i (${sets[$i]}): $(grep -c ': rt ' "$OUT/r${round}_c$i.txt") points"
  done
done
# Lines like "[93s] trivial tcp M=1024: rt 15.711 ms, server 1920.8 us, server_stages_us_p50:
# queue=.. prepare=.. experts=202.0 ...".
python3 - "$OUT" "$CONFIGS" "$ROUNDS" <<'PY'
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
print("| flags | layer | way | M | rt ms | server us | experts us | server - experts us |")
print("|---|---|---|---|---|---|---|---|")
for (i, layer, way, m), v in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][3], kv[0][0])):
    rt, srv, exp = (statistics.median(x) for x in zip(*v))
    print(f"| {configs[i]} | {layer} | {way} | {m} | {rt:.3f} | {srv:.0f} | {exp:.0f} | {srv - exp:.0f} |")
PY
