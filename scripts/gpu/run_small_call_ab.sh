#!/usr/bin/env bash
# A small call's cost, before and after a change to the graphed step (issues 11/12: server total
# at M=1). The bundle holds two builds: bin/{moeserve,engine_forward_bench}_a and _b, one
# moeserve-cli, and the last build's GPU test binaries (LAST, default b). A variant is a build
# letter, optionally followed by 0 (MOESERVE_GRAPH_SM_COPY_MAX_BYTES=0: staged copies on a copy
# engine) or 1m (the SMs copy up to 1 MiB), and by s (the server polls for calls:
# --step_spin_us=SPIN_US, default 2000) and/or q (the load asks for no timings, so the server
# skips the stage timers on all but --stage_timing_every's sampled steps; the round trip only)
# or h (it asks for the host clock's timings only, return_host_timings: an untimed step's server
# total); n: the calls go through a forward channel (shared memory polled by the server, no
# gRPC per call: --enable_shared_memory on the server, moeserve-cli load --channel);
# VARIANTS, default "a b0 b". A variant ending in g gathers a request's pieces on several threads
# from GATHER_MIN bytes (default 131072; MOESERVE_GATHER_PARALLEL_MIN_BYTES); c: the load's
# callers poll for their answers (--client_spin_us=CLIENT_SPIN_US, default 2000); i: every
# request is handled on gRPC's receiving thread (--inline_request_bytes=1 GiB); w: every request
# is decoded on a worker thread, which polls while the scheduling thread does
# (--inline_request_bytes=0: the decode on a warm thread instead of gRPC's, whose caches a
# one-token call finds cold, transport/RESULTS.md 2026-12-05 21:40); e: the decode
# GEMMs wait before they fetch weights (MOESERVE_EARLY_WEIGHTS=0); x: the align waits for the
# staged copy before it reads its ids (MOESERVE_ALIGN_EARLY_IDS=0). MS: the server
# pass's token counts (default "1 16 64"; 2000 calls each, 600 from 64, 300 from 256, 150 from
# 1024).
# 1. the GPU suites (memcheck on the copy kernel's test; SKIP_GPU_SUITES=1: not them), host_upload_test and
#    shared_memory_cuda_test against the last build's server;
# 2. engine_forward_bench (Engine::Forward in-process), trivial layer BF16 at 1/16/64 tokens,
#    timed and untimed, and the seed layer MXFP8 at 1/16, ROUNDS alternating rounds;
# 3. the server: moeserve-cli load at concurrency 1 on the trivial layer, M = 1, 16, 64.
# Ends with a table of medians. Usage: run_small_call_ab.sh BUNDLE.tgz (writes under $OUT).
set -u
source "$(dirname "$0")/bundle_lib.sh"
start_device_script "$1" || exit 1
[ -n "${SKIP_GPU_SUITES:-}" ] || SANITIZERS=memcheck gpu_suites '*CopyBytes*:*Fp32ToHalf*'
# gRPC bytes (page-locked request buffers) and shared-memory regions against the last build.
for t in host_upload_test shared_memory_cuda_test; do
  [ -z "${SKIP_SUITES:-}" ] && [ -x "$B/$t" ] && MOESERVE_BINARY=$B/moeserve_${LAST:-b} run_gtest $t 300
done
VARIANTS=${VARIANTS:-a b0 b}
PORT=50171
TRIVIAL="--model tiny --hidden 7168 --intermediate 64 --num_experts 16 --topk 4 --num_layers 1"
# SERVER_LAYER=seed: the server runs the seed per-rank layer (MXFP8) instead of the trivial one.
[ "${SERVER_LAYER:-trivial}" = seed ] &&
  TRIVIAL="--model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8"
row() { :; }
source "$(dirname "$0")/serve_lib.sh"
# The copy setting follows the build letter (b0, b1m, with any suffixes: b0s, b1mq); g anywhere
# after it sets the gather threshold. One environment assignment (env takes it as one word).
env_of() {  # every setting the variant's suffix names (e.g. b0e: no SM copies, no early weights)
  local s=${1:1} out=""
  [[ $s == 0* ]] && out+=" MOESERVE_GRAPH_SM_COPY_MAX_BYTES=0"
  [[ $s == 1m* ]] && out+=" MOESERVE_GRAPH_SM_COPY_MAX_BYTES=1048576"
  [[ $s == *g* ]] && out+=" MOESERVE_GATHER_PARALLEL_MIN_BYTES=${GATHER_MIN:-131072}"
  [[ $s == *e* ]] && out+=" MOESERVE_EARLY_WEIGHTS=0"
  [[ $s == *x* ]] && out+=" MOESERVE_ALIGN_EARLY_IDS=0"
  echo "${out:-MOESERVE_UNUSED=1}"
}
bin_of() { echo "${1:0:1}"; }
flags_of() {
  local f=""
  [[ ${1:1} == *s* ]] && f+=" --step_spin_us=${SPIN_US:-2000}"
  [[ ${1:1} == *i* ]] && f+=" --inline_request_bytes=1073741824"
  [[ ${1:1} == *w* ]] && f+=" --inline_request_bytes=0"
  [[ ${1:1} == *n* ]] && f+=" --enable_shared_memory"
  echo "$f"
}
load_flags_of() {
  [[ ${1:1} == *q* ]] && echo "--return_timings=false"
  [[ ${1:1} == *h* ]] && echo "--host_timings_only"
  [[ ${1:1} == *n* ]] && echo "--channel"
  [[ ${1:1} == *c* ]] && echo "--client_spin_us=${CLIENT_SPIN_US:-2000}"
  true
}
CSV=$OUT/engine.csv
# shellcheck disable=SC2086
[ -n "${SKIP_ENGINE:-}" ] || for round in $(seq "${ROUNDS:-2}"); do for v in $(round_order $round $VARIANTS); do
  [[ ${v:1} == *[sqgciwhn]* ]] && continue  # server-only settings: the in-process bench is the same
  for timed in 1 0; do
    env $(env_of $v) timeout 120 "$B/engine_forward_bench_$(bin_of $v)" --model trivial \
      --weight_format bf16 --tokens 1,16,64 --iters 1000 --timed $timed | grep -v '^#\|^tokens' |
      awk -F, -v v=$v -v t=$timed '{print v",trivial,"t","$0}' >> "$CSV"
  done
  env $(env_of $v) timeout 120 "$B/engine_forward_bench_$(bin_of $v)" --model seed \
    --weight_format mxfp8 --tokens 1,16 --iters 400 --timed 1 | grep -v '^#\|^tokens' |
    awk -F, -v v=$v '{print v",seed,1,"$0}' >> "$CSV"
done; done
SCSV=$OUT/server.csv
# shellcheck disable=SC2086
for round in $(seq "${ROUNDS:-2}"); do for v in $(round_order $round $VARIANTS); do
  ln -sf "$B/moeserve_$(bin_of $v)" "$B/moeserve"
  export $(env_of $v)
  # shellcheck disable=SC2046
  serve "${v}_r$round" $TRIVIAL $(flags_of $v)
  for m in ${MS:-1 16 64}; do
    n=2000
    [ "$m" -ge 64 ] && n=600
    [ "$m" -ge 256 ] && n=300
    [ "$m" -ge 1024 ] && n=150
    # shellcheck disable=SC2046
    load "${v}_r${round}_M$m" $m 1 $n $(load_flags_of $v)
    echo "$v,$m,$(val ${v}_r${round}_M$m p50),$(grep -o 'server_total_us: p50=[0-9.]*' "$OUT/load_${v}_r${round}_M$m.log" | cut -d= -f2),$(grep -o 'server_stages_us_p50: .*' "$OUT/load_${v}_r${round}_M$m.log" | tr ' ' ';')" >> "$SCSV"
  done
  stop
  unset MOESERVE_GRAPH_SM_COPY_MAX_BYTES MOESERVE_GATHER_PARALLEL_MIN_BYTES MOESERVE_UNUSED \
    MOESERVE_EARLY_WEIGHTS MOESERVE_ALIGN_EARLY_IDS
done; done
echo "== engine_forward_bench p50 wall us (median over rounds): variant layer timed tokens -> wall, experts stage"
[ -s "$CSV" ] && python3 - "$CSV" <<'PY'
import sys, collections, statistics
t = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) < 9: continue
    v, layer, timed, tokens, wall, _, _, exp, _ = f[:9]
    t[(layer, timed, int(tokens), v)].append((float(wall), float(exp)))
for key in sorted(t):
    w = statistics.median(x[0] for x in t[key]); e = statistics.median(x[1] for x in t[key])
    print(f"{key[0]:8s} timed={key[1]} tokens={key[2]:3d} {key[3]:3s}: wall {w:7.1f} experts {e:6.1f}")
PY
echo "== server, trivial layer, concurrency 1 (median over rounds): variant M -> round trip ms, server total us"
python3 - "$SCSV" <<'PY'
import sys, collections, statistics
t = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) < 4 or not f[2]: continue  # q variants: no server total
    t[(int(f[1]), f[0])].append((float(f[2]), float(f[3] or "nan"), f[4] if len(f) > 4 else ""))
for key in sorted(t):
    rt = statistics.median(x[0] for x in t[key]); st = statistics.median(x[1] for x in t[key])
    print(f"M={key[0]:3d} {key[1]:4s}: rt {rt:.3f} ms, server {st:6.1f} us  [{t[key][-1][2]}]")
PY
