#!/bin/bash
# One device call: two server builds through issue 11's gRPC path (run_transport_device.sh), the
# builds alternating ROUNDS times, then one line per (build, layer, way, M) with the medians over
# the rounds of the round trip, the server total and the experts stage.
#   bash scripts/gpu/run_binary_ab.sh .bundle/transport_before.tar.xz .bundle/transport.tar.xz
# MS, WAYS, LAYERS, N: as for run_transport_device.sh (defaults "1 2 4 16", tcp, seed, 400).
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/binary_ab}
mkdir -p "$OUT"
names=(before after)
dirs=()
for i in 0 1; do
  mkdir -p "$OUT/${names[$i]}"
  tar -C "$OUT/${names[$i]}" -xJf "${@:$((i + 1)):1}" && dirs+=("$OUT/${names[$i]}/transport")
done
for round in $(seq "${ROUNDS:-2}"); do
  for i in 0 1; do
    OUT="$OUT/r${round}_${names[$i]}" MS=${MS:-1 2 4 16} WAYS=${WAYS:-tcp} LAYERS=${LAYERS:-seed} \
      N=${N:-400} PY=0 BUDGET_S=${BUDGET_S:-150} \
      bash "$repo/tests/benchmarks/transport/run_transport_device.sh" "${dirs[$i]}" \
      >"$OUT/r${round}_${names[$i]}.txt" 2>&1
    echo "round $round ${names[$i]}: $(grep -c ': rt ' "$OUT/r${round}_${names[$i]}.txt") points"
  done
done
python3 - "$OUT" "${ROUNDS:-2}" <<'PY'
import re, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
pat = re.compile(r"\] (\S+) (\S+) M=(\d+): rt ([\d.]+) ms, server ([\d.]+) us.*experts=([\d.]+)")
rows = {}
for r in range(1, rounds + 1):
    for name in ("before", "after"):
        try:
            text = open(f"{out}/r{r}_{name}.txt").read()
        except OSError:
            continue
        for m in pat.finditer(text):
            key = (m.group(1), m.group(2), int(m.group(3)), name)
            rows.setdefault(key, []).append(tuple(float(m.group(i)) for i in (4, 5, 6)))
print("| layer | way | M | build | round trip ms | server total us | experts us |")
print("|---|---|---|---|---|---|---|")
for key in sorted(rows, key=lambda k: (k[0], k[1], k[2], k[3] != "before")):
    v = rows[key]
    med = [statistics.median(x[i] for x in v) for i in range(3)]
    print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {med[0]:.3f} | {med[1]:.1f} | {med[2]:.1f} |")
PY
