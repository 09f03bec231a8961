#!/usr/bin/env bash
# One device call: what the GPU host's own primitives cost (host_cost_probe.cu: clock, thread
# hand-offs, the CUDA calls of a graphed step), the server's warm per-call host work there
# (handler_bench), and which host-memory registrations wait for the device (alloc_wait_probe.cu,
# now with cudaHostRegister / cudaHostUnregister). For the one-token call's host stages
# (issues 11/12), where this host read input 10-15 us against 2 us on the development VM.
# Usage: run_s33_probes.sh BUNDLE.tgz (bin/: host_cost_probe, handler_bench, alloc_wait_probe;
# all three are build targets: build/bin/).
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_device_script "$1" || exit 1
nproc; uname -r
timeout 120 "$B/host_cost_probe" --iters 20000 > "$OUT/host_cost_probe.log" 2>&1
cat "$OUT/host_cost_probe.log"
timeout 60 "$B/handler_bench" --iters 5000 --tokens 1,16,64 > "$OUT/handler_bench.log" 2>&1
cat "$OUT/handler_bench.log"
timeout 120 "$B/alloc_wait_probe" > "$OUT/alloc_wait_probe.log" 2>&1
cat "$OUT/alloc_wait_probe.log"
