#!/usr/bin/env bash
# Periodic stalls: stall_probe.py (CPU and CUDA loops) alone, then the CPU loop beside one
# overload (run_overload_cpu_diag.sh, 17,333 calls/s, --senders 4) on .bundle/ms31.tgz with the
# moeserve-cli of .bundle/cli31. Writes under $OUT.
python3 scripts/gpu/stall_probe.py cpu 12 > $OUT/probe_cpu.txt 2>&1 &
python3 scripts/gpu/stall_probe.py gpu 12 > $OUT/probe_gpu.txt 2>&1
wait
cut -c1-700 $OUT/probe_cpu.txt $OUT/probe_gpu.txt
(sleep 3; python3 scripts/gpu/stall_probe.py cpu 12 > $OUT/probe_cpu_during.txt 2>&1) &
BUNDLE=.bundle/ms31.tgz CLI=$PWD/.bundle/cli31 OUT=$OUT CASES='17333 - - b :: --senders 4' bash scripts/gpu/run_overload_cpu_diag.sh 2>&1 | tail -c 2500
wait
echo "== cpu probe during the overload"; cut -c1-700 $OUT/probe_cpu_during.txt
