#!/bin/bash
# Issue 11's transport benchmark in one device call (one H200): for M in {1, 16, 64, 256, 1024}
# and two layers,
#   trivial: --model tiny --hidden 7168 --intermediate 64 (16 experts, top-4), BF16: transport
#            dominates;
#   seed:    the seed per-rank layer (32 experts, top-8, H3072 I5120), MXFP8 weights,
# each way in, through the C++ client (moeserve-cli load --concurrency 1 --routing balanced):
#   tcp    gRPC bytes over TCP loopback        unix  gRPC bytes over a unix socket
#   shm    a POSIX shared-memory region        cuda  a CUDA region (cudaIpcGetMemHandle)
#   ch     gRPC-free: the forward channel (a shared-memory object the server polls), inline
#          tensors;  shm-ch / cuda-ch  the forward channel with tensors in a system / CUDA region
# and the Python torch client (clients/python/examples/bench_client.py, trivial layer, unix
# socket, against the C++ client on the same path): CPU tensors as gRPC bytes ("torch"), CUDA
# tensors by the CUDA-region path ("torch-cuda"). In the same run: the raw gRPC ByteBuffer echo of
# the same request bytes (grpc_echo_bench, TCP and unix) and the pinned-copy floor
# (copy_floor_bench: H2D of the request bytes + D2H of the answer bytes).
# A markdown table with one row per (layer, way, M) and the issue's target for it comes last.
#
# Usage: run_transport_device.sh [BUNDLE]   (default $BUNDLE, else ./.bundle/transport.tar.xz)
#   BUNDLE: make_bundle.sh's .tar.xz, or a folder with bin/ (moeserve moeserve-cli
#   grpc_echo_bench copy_floor_bench) and lib/ (their shared libraries).
#   WHEELS (default ./.gpucarry/wheels): moeserve_client-*.whl and, for a
#   Python without them, grpcio / protobuf / ml_dtypes / numpy wheels for that Python.
#   OUT (default /tmp/transport): logs. Knobs for a smaller run (the CPU backend): MS="1 16",
#   N=200 (calls per point; N_BIG=60 at M >= 1024), LAYERS="trivial seed", PY=1 (0: no Python),
#   BUDGET_S=480 (loads not started by then are skipped and the table printed); LOAD_FLAGS:
#   more flags for every moeserve-cli load (e.g. --client_spin_us=2000).
# Experts' time: the server's own experts stage (StageTimings.experts_us, p50 of the same calls;
# the grouped expert MLPs). "server - experts" = server total p50 - experts p50; "rt - experts" =
# client round trip p50 - experts p50 (medians of different quantities: an estimate).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
BUNDLE=${1:-${BUNDLE:-$PWD/.bundle/transport.tar.xz}}
WHEELS=${WHEELS:-$PWD/.gpucarry/wheels}
OUT=${OUT:-/tmp/transport}
mkdir -p "$OUT"
if [ -f "$BUNDLE" ]; then  # make_bundle.sh's file: unpack it next to the logs
  tar -C "$OUT" -xJf "$BUNDLE" || echo "could not unpack $BUNDLE"
  BUNDLE=$OUT/transport
fi
B=$BUNDLE/bin
# NCCL (the server links it) from this machine: PyTorch's nvidia-nccl wheel, as the other
# device scripts do; NVLink multicast off.
NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH=$BUNDLE/lib${NCCL_DIR:+:$NCCL_DIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# The torch client's gRPC calls by the C++ client (moeserve_client.native), when bundled.
[ -e "$BUNDLE/lib/libmoeserve_client_c.so" ] && export MOESERVE_CLIENT_LIB=$BUNDLE/lib/libmoeserve_client_c.so
MS=${MS:-1 16 64 256 1024}
N=${N:-200}
N_BIG=${N_BIG:-60}
LAYERS=${LAYERS:-trivial seed}
PY=${PY:-1}
PORT=${PORT:-50171}
ECHO_PORT=$((PORT + 2))
SOCK_DIR=$(mktemp -d /tmp/moeserve_transport.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
  rm -rf "$SOCK_DIR"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0))s] $*"; }
# Past BUDGET_S seconds the remaining loads are skipped, so the table still comes out within a
# 10-minute device call.
BUDGET_S=${BUDGET_S:-480}
over_budget() { [ $(($(date +%s) - T0)) -gt "$BUDGET_S" ]; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"; } |
  tee "$OUT/device.txt"
date -u | tee -a "$OUT/device.txt"
"$B/moeserve" --version 2>/dev/null | head -1 | tee -a "$OUT/device.txt"

# SERVER_FLAGS: appended to both servers' flags (e.g. --cuda_graph_max_tokens 1024).
TRIVIAL="--model tiny --hidden 7168 --intermediate 64 --num_experts 16 --topk 4 --num_layers 1 ${SERVER_FLAGS:-}"
SEED="--model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8 ${SERVER_FLAGS:-}"
declare -A HID=([trivial]=7168 [seed]=3072) TOPK=([trivial]=4 [seed]=8)
req_bytes() { echo $(($2 * (HID[$1] * 2 + TOPK[$1] * 8))); }  # layer M: hidden + ids + weights
ans_bytes() { echo $(($2 * HID[$1] * 2)); }
calls_for() { if [ "$1" -ge 1024 ]; then echo "$N_BIG"; else echo "$N"; fi; }
# kv FILE KEY [PREFIX]: the number after "KEY=" on the first line containing PREFIX.
kv() { grep -s -- "${3:-}" "$1" | grep -o -- "$2=[0-9.]*" | head -1 | cut -d= -f2; }

# ---- floors: pinned copies, raw echo -------------------------------------------------------
declare -A FLOOR ECHO
sizes_copy="" sizes_echo=""
for layer in $LAYERS; do
  for m in $MS; do
    sizes_copy+=" $(req_bytes $layer $m):$(ans_bytes $layer $m)"
    sizes_echo+=",$(req_bytes $layer $m)"
  done
done
sizes_echo=${sizes_echo#,}
log "pinned-copy floor"
if [ -x "$B/copy_floor_bench" ]; then
  timeout 120 "$B/copy_floor_bench" --iters 100 $sizes_copy > "$OUT/copy_floor.log" 2>&1 ||
    echo "copy_floor_bench failed (exit $?): $(tail -2 "$OUT/copy_floor.log")"
else
  echo "copy skipped: no copy_floor_bench in $B (a build without CUDA)" > "$OUT/copy_floor.log"
fi
cat "$OUT/copy_floor.log"
while read -r _ h d _ _ both; do
  [[ $h == h2d_bytes=* ]] && FLOOR["${h#*=}:${d#*=}"]=${both#*=}
done < <(grep '^copy h2d' "$OUT/copy_floor.log" | awk '{print $1, $2, $3, $4, $5, $6}')

log "raw ByteBuffer echo"
"$B/grpc_echo_bench" server --listen "127.0.0.1:$ECHO_PORT,unix:$SOCK_DIR/echo.sock" \
  --ready_file "$SOCK_DIR/echo.ready" > "$OUT/echo_server.log" 2>&1 &
ECHO_PID=$!
PIDS+=($ECHO_PID)
for _ in $(seq 100); do [ -s "$SOCK_DIR/echo.ready" ] && break; sleep 0.1; done
if [ -s "$SOCK_DIR/echo.ready" ]; then
  for t in tcp unix; do
    target=127.0.0.1:$ECHO_PORT
    [ $t = unix ] && target=unix:$SOCK_DIR/echo.sock
    # The same number of calls as the Forwards of that size.
    small=$(for s in ${sizes_echo//,/ }; do [ "$s" -lt 10000000 ] && echo -n "$s,"; done)
    big=$(for s in ${sizes_echo//,/ }; do [ "$s" -ge 10000000 ] && echo -n "$s,"; done)
    : > "$OUT/echo_$t.log"
    [ -n "$small" ] && timeout 150 "$B/grpc_echo_bench" client --target "$target" \
      --bytes "${small%,}" --calls "$N" --warmup 5 >> "$OUT/echo_$t.log" 2>&1
    [ -n "$big" ] && timeout 150 "$B/grpc_echo_bench" client --target "$target" \
      --bytes "${big%,}" --calls "$N_BIG" --warmup 3 >> "$OUT/echo_$t.log" 2>&1
    cat "$OUT/echo_$t.log"
    while read -r line; do
      b=$(echo "$line" | grep -o 'bytes=[0-9]*' | cut -d= -f2)
      p=$(echo "$line" | grep -o 'p50_us=[0-9.]*' | cut -d= -f2)
      [ -n "$b" ] && ECHO["$t:$b"]=$p
    done < <(grep '^echo bytes' "$OUT/echo_$t.log")
  done
else
  echo "echo server did not start: $(tail -3 "$OUT/echo_server.log")"
fi
kill -TERM $ECHO_PID 2>/dev/null; wait $ECHO_PID 2>/dev/null

# ---- moeserve, every way in -------------------------------------------------------------------
SERVER_PID=""
serve() {  # name flags...: one server on TCP and a unix socket, shared memory on
  local name=$1; shift
  rm -f "$SOCK_DIR/ready_$name"
  "$B/moeserve" --listen "127.0.0.1:$PORT,unix:$SOCK_DIR/moe.sock" --metrics_address "" \
    --enable_shared_memory --ready_file "$SOCK_DIR/ready_$name" "$@" \
    > "$OUT/server_$name.log" 2>&1 &
  SERVER_PID=$!
  PIDS+=($SERVER_PID)
  for _ in $(seq 1 720); do  # up to 3 minutes (the seed layer's weights are made at start)
    [ -s "$SOCK_DIR/ready_$name" ] && return 0
    kill -0 $SERVER_PID 2>/dev/null || break
    sleep 0.25
  done
  echo "server $name did not start: $(tail -3 "$OUT/server_$name.log")"
  return 1
}
stop() {
  [ -n "$SERVER_PID" ] && { kill -TERM $SERVER_PID 2>/dev/null; wait $SERVER_PID 2>/dev/null; }
  SERVER_PID=""
}
declare -A RT SRV EXP WHY
load() {  # layer way M
  # gRPC bytes: every answer is also checked against the unloaded answer to its request.
  local layer=$1 way=$2 m=$3 target=127.0.0.1:$PORT flags=(--check_answers)
  case $way in
    unix) target=unix:$SOCK_DIR/moe.sock ;;
    shm) target=unix:$SOCK_DIR/moe.sock; flags=(--shm) ;;
    cuda) target=unix:$SOCK_DIR/moe.sock; flags=(--cuda_region) ;;
    ch) target=unix:$SOCK_DIR/moe.sock; flags=(--channel) ;;
    shm-ch) target=unix:$SOCK_DIR/moe.sock; flags=(--shm --channel) ;;
    cuda-ch) target=unix:$SOCK_DIR/moe.sock; flags=(--cuda_region --channel) ;;
    # Untimed steps (the host clock's timings only): issue 12's one-token server total.
    tcp-h) flags=(--check_answers --host_timings_only) ;;
    ch-h) target=unix:$SOCK_DIR/moe.sock; flags=(--channel --host_timings_only) ;;
  esac
  local f="$OUT/load_${layer}_${way}_M$m.log"
  if over_budget; then
    RT["$layer:$way:$m"]="failed"
    WHY["$layer:$way:$m"]="skipped: past the ${BUDGET_S}s budget"
    return
  fi
  timeout 120 "$B/moeserve-cli" load --target "$target" --tokens "$m" --dtype bf16 \
    --concurrency 1 --requests "$(calls_for "$m")" --routing balanced --max_seconds 50 \
    --distinct_inputs 4 "${flags[@]}" ${LOAD_FLAGS:-} > "$f" 2>&1
  local rc=$?
  if [ $rc -ne 0 ] || ! grep -q '^latency_ms' "$f"; then
    local why
    why=$(grep -m1 -E 'error|first error|wrong=[1-9]' "$f" | cut -c1-110)
    log "$layer $way M=$m FAILED (exit $rc): ${why:-see $f}"
    RT["$layer:$way:$m"]="failed"
    WHY["$layer:$way:$m"]=$(echo "${why:-exit $rc}" | sed 's/^error: //; s/|/ /g' | cut -c1-80)
    return
  fi
  RT["$layer:$way:$m"]=$(kv "$f" p50 '^latency_ms')
  SRV["$layer:$way:$m"]=$(kv "$f" p50 '^server_total_us')
  EXP["$layer:$way:$m"]=$(kv "$f" experts '^server_stages_us_p50')
  log "$layer $way M=$m: rt ${RT[$layer:$way:$m]} ms, server ${SRV[$layer:$way:$m]} us," \
    "$(grep '^server_stages' "$f")"
}
WAYS=${WAYS:-tcp unix shm cuda ch shm-ch cuda-ch}
PY_SKIP=""
declare -A PY_FAIL
for layer in $LAYERS; do
  flags=$TRIVIAL
  [ $layer = seed ] && flags=$SEED
  log "server: $layer"
  if ! serve "$layer" $flags; then
    for m in $MS; do for way in $WAYS; do RT["$layer:$way:$m"]="no server"; done; done
    stop
    continue
  fi
  for m in $MS; do
    for way in $WAYS; do load $layer $way $m; done
  done
  if [ $layer = trivial ] && [[ " $MS " == *" 1 "* ]]; then
    for way in tcp-h ch-h; do load trivial $way 1; done
  fi
  # Python torch client on the trivial layer: bytes path (CPU tensors), then CUDA tensors.
  if [ $layer = trivial ] && [ "$PY" = 1 ] && over_budget; then
    PY_SKIP="skipped: past the ${BUDGET_S}s budget"
  elif [ $layer = trivial ] && [ "$PY" = 1 ]; then
    log "python torch client"
    pyenv=$OUT/pydeps
    # cpu: CPU tensors as gRPC bytes; cuda: CUDA tensors by a CUDA region (gRPC call);
    # cpu-ch / cuda-ch: the same tensors by a system / CUDA region, calls through the channel.
    py_devs=${PY_DEVS:-cpu cuda cpu-ch cuda-ch}
    if ! python3 "$here/py_deps.py" "$WHEELS" "$pyenv" > "$OUT/py_deps.log" 2>&1; then
      PY_SKIP="skipped: $(tail -1 "$OUT/py_deps.log" | cut -c1-70)"
      log "python torch client $PY_SKIP"
      py_devs=""
    fi
    cat "$OUT/py_deps.log"
    for dev in $py_devs; do
      shm_mode=off ch_flag="" tdev=${dev%-ch} way=torch
      case $dev in
        cuda) shm_mode=cuda way=torch-cuda ;;
        cpu-ch) shm_mode=system ch_flag=--channel way=torch-ch ;;
        cuda-ch) shm_mode=cuda ch_flag=--channel way=torch-cuda-ch ;;
      esac
      f=$OUT/python_$dev.log
      : > "$f"
      rc=0
      # One process per M, each with its own time limit, so that a slow size (the whole run at
      # once hit its 150 s limit at M=256 on 17:21's call) does not lose the others.
      for m in $MS; do
        PYTHONPATH=$pyenv${PYTHONPATH:+:$PYTHONPATH} timeout 90 python3 \
          "$repo/clients/python/examples/bench_client.py" --target "unix:$SOCK_DIR/moe.sock" \
          --cli "$B/moeserve-cli" --tokens "$m" --calls "$N" --rounds 2 --no-numpy \
          --device $tdev --shared-memory $shm_mode $ch_flag >> "$f" 2>&1
        r=$?
        [ $r -ne 0 ] && rc=$r && echo "# M=$m: exit $r" >> "$f"
      done
      tail -12 "$f"
      if [ $rc -ne 0 ]; then
        log "python $dev: exit $rc: $(grep -v '^ ' "$f" | tail -1 | cut -c1-150)"
        PY_FAIL[$way]="exit $rc: $(grep -v '^ ' "$f" | tail -1 | sed 's/|/ /g' | cut -c1-70)"
      fi
      # columns: M cli_ms raw_ms torch_ms ...
      while read -r m cli raw tms _; do
        [[ $m =~ ^[0-9]+$ ]] || continue
        RT["trivial:$way:$m"]=$tms
        RT["trivial:$way-cli:$m"]=$cli
      done < "$f"
    done
  fi
  stop
done

# ---- the table ----------------------------------------------------------------------------
calc() { awk "BEGIN { $1 }" 2>/dev/null; }
num() { [[ ${1:-} =~ ^[0-9.]+$ ]]; }
echo
echo "=================== issue 11 transport table ==================="
echo "device: $(head -1 "$OUT/device.txt"); $(sed -n 3p "$OUT/device.txt");" \
  "calls per point: $N ($N_BIG at M >= 1024); p50s"
echo "echo = raw gRPC ByteBuffer echo of the request bytes (same transport);" \
  "floor = pinned H2D (request) + D2H (answer), cudaEvent median"
echo "experts = server's experts stage p50 (exp); rt = client round trip p50;" \
  "'check' is what the target constrains (gRPC ways: (rt - exp) / echo, and server total - exp)"
echo
echo "| layer | way | M | MB req/ans | round trip ms | server total us | experts us | echo ms | floor us | check | target | met |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
for layer in $LAYERS; do
  ways=$WAYS
  [ $layer = trivial ] && [ "$PY" = 1 ] && ways="$WAYS torch torch-cuda torch-ch torch-cuda-ch"
  for way in $ways; do
    for m in $MS; do
      rb=$(req_bytes $layer $m) ab=$(ans_bytes $layer $m)
      mb=$(calc "printf \"%.3f/%.3f\", $rb/1e6, $ab/1e6")
      rt=${RT[$layer:$way:$m]:-n/a} srv=${SRV[$layer:$way:$m]:-} ex=${EXP[$layer:$way:$m]:-}
      fl=${FLOOR[$rb:$ab]:-}
      et=tcp
      [ $way = unix ] || [ $way = torch ] && et=unix  # the Python runs use the unix socket
      ec=${ECHO[$et:$rb]:-}
      ecms=""
      case $way in tcp|unix|torch) num "$ec" && ecms=$(calc "printf \"%.3f\", $ec/1000") ;; esac
      check="" target="" met=""
      case $way in
        tcp|unix)
          if num "$rt" && num "$ec" && num "$ex"; then
            r=$(calc "printf \"%.2f\", ($rt*1000-$ex)/$ec")
            check="(rt-exp)/echo $r"
            target="<= 1.25"
            met=$(calc "print ($r <= 1.25) ? \"yes\" : \"no\"")
          fi
          if num "$srv" && num "$ex"; then
            sme=$(calc "printf \"%.0f\", $srv-$ex")
            check+="; srv-exp $sme us"
            if [ "$m" = 1 ]; then
              target+="; srv-exp <= 40"
              met+="/$(calc "print ($sme <= 40) ? \"yes\" : \"no\"")"
            elif [ "$m" = 1024 ] && num "$fl"; then
              target+="; srv-exp <= 2x floor ($(calc "printf \"%.0f\", 2*$fl"))"
              met+="/$(calc "print ($sme <= 2*$fl) ? \"yes\" : \"no\"")"
            fi
          fi ;;
        shm|ch|shm-ch)
          if num "$rt" && num "$ex"; then
            rme=$(calc "printf \"%.0f\", $rt*1000-$ex")
            check="rt-exp $rme us"
            if num "$fl"; then
              lim=$(calc "printf \"%.0f\", 2*$fl+60")
              target="<= 2x floor + 60 ($lim)"
              met=$(calc "print ($rme <= $lim) ? \"yes\" : \"no\"")
            else
              target="floor skipped: no GPU"
            fi
          fi ;;
        cuda|cuda-ch)
          if num "$rt" && num "$ex"; then
            rme=$(calc "printf \"%.0f\", $rt*1000-$ex")
            lim=""
            [ "$m" -le 64 ] && lim=60
            [ "$m" -ge 1024 ] && lim=120
            check="rt-exp $rme us"
            if [ -n "$lim" ]; then
              target="<= $lim"
              met=$(calc "print ($rme <= $lim) ? \"yes\" : \"no\"")
            fi
          fi ;;
        torch|torch-cuda|torch-ch|torch-cuda-ch)
          # The C++ client on the same path, measured by bench_client.py in the same run.
          base=${RT[$layer:$way-cli:$m]:-}
          if num "$rt" && num "$base"; then
            d=$(calc "printf \"%.0f\", ($rt-$base)*1000")
            check="torch - C++ $d us (same path)"
            target="<= 30"
            met=$(calc "print ($d <= 30) ? \"yes\" : \"no\"")
          fi ;;
      esac
      [ -z "$fl" ] && fl="skipped: no GPU"
      if [ "$rt" = failed ]; then
        check="${WHY[$layer:$way:$m]:-}"
      elif [ "$rt" = n/a ] && [[ $way == torch* ]]; then
        rt="${PY_SKIP:-${PY_FAIL[$way]:-n/a}}"
      fi
      echo "| $layer | $way | $m | $mb | $rt | ${srv:--} | ${ex:--} | ${ecms:--} | $fl | ${check:--} | ${target:--} | ${met:--} |"
    done
  done
done
if [[ " $LAYERS " == *" trivial "* ]] && [[ " $MS " == *" 1 "* ]]; then
  echo
  echo "issue 12, server total of an untimed one-token call (trivial layer, return_host_timings;" \
    "target <= 40 us): tcp ${SRV[trivial:tcp-h:1]:-${RT[trivial:tcp-h:1]:-n/a}} us," \
    "channel ${SRV[trivial:ch-h:1]:-${RT[trivial:ch-h:1]:-n/a}} us"
fi
# The device tool brings back only a few files of a folder: one archive of the logs instead.
if [ "${TAR_LOGS:-1}" = 1 ]; then
  (cd "$OUT" && tar -czf logs.tgz --exclude logs.tgz --exclude transport -- * && find . -maxdepth 1 -name '*.log' -delete)
fi
log "done; logs in $OUT"
