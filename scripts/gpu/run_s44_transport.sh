#!/usr/bin/env bash
# Session 44's transport call: issue 11's whole table (run_transport_device.sh, every way, the
# torch client) on main's binaries, its logs kept off $OUT (the bundle unpacks next to them) and
# only the console and the table brought back.
# Usage: run_s44_transport.sh   (carry .bundle/transport.tar.xz and .gpucarry)
set -u
cd "$(dirname "$0")/../.."
R=${OUT:-/tmp/out}
mkdir -p "$R"
OUT=/tmp/transport BUDGET_S=${BUDGET_S:-420} bash tests/benchmarks/transport/run_transport_device.sh \
  .bundle/transport.tar.xz > "$R/transport_console.log" 2>&1
echo "transport rc=$?"
cp /tmp/transport/*.txt "$R/" 2>/dev/null
grep -E '^\| (layer|---|trivial|seed) ' "$R/transport_console.log" | cut -c1-200 | tail -80
