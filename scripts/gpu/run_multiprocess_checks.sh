#!/bin/bash
# Multi-process serving on the two-GPU machine (kind nvidia-h200-x2), one device call: two
# moeserve processes of one GPU each on localhost (leader node 0 on GPU 0, follower node 1 on
# GPU 1, NCCL between them), Forward through the leader checked by moeserve-cli --check for
# BF16 and MXFP8 weights and several routings, a clean shutdown (the follower leaves with 0),
# then the fault case: the follower is killed (SIGKILL) and the leader must answer an error
# within a bounded time and stop serving. A short table last. From the repo root:
#   BUNDLE=.bundle/mp bash scripts/gpu/run_multiprocess_checks.sh   (bin/ and lib/ inside)
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUNDLE=${BUNDLE:-$PWD/.bundle/mp}
B=$BUNDLE/bin
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
[ -f "$NCCL_DIR/libnccl.so.2" ] || NCCL_DIR=$(dirname "$(find / -name libnccl.so.2 -not -path '*/proc/*' 2>/dev/null | grep -v .bundle | head -1)" 2>/dev/null)
export LD_LIBRARY_PATH=$BUNDLE/lib:$NCCL_DIR
echo "NCCL from $NCCL_DIR"; nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; date -u
ROWS=()
row() { ROWS+=("$(printf '%-44s %s' "$1" "$2")"); echo "== $1: $2"; }
COMMON="--backend cuda --ranks 1 --world_size 2 --leader_address 127.0.0.1:50090 --metrics_address= --enable_get_expert_weights --collective_timeout_ms 5000 --heartbeat_ms 500 --bootstrap_timeout_s 60 --model tiny"
LP=; FP=
start_group() {  # name, extra flags...
  local name=$1; shift
  rm -f /tmp/ready_l /tmp/ready_f
  CUDA_VISIBLE_DEVICES=1 $B/moeserve $COMMON --node_rank 1 --listen 127.0.0.1:50082 --ready_file /tmp/ready_f "$@" > "$OUT/follower_$name.log" 2>&1 &
  FP=$!
  CUDA_VISIBLE_DEVICES=0 $B/moeserve $COMMON --node_rank 0 --listen 127.0.0.1:50081 --ready_file /tmp/ready_l "$@" > "$OUT/leader_$name.log" 2>&1 &
  LP=$!
  for i in $(seq 1 180); do [ -f /tmp/ready_l ] && [ -f /tmp/ready_f ] && break; kill -0 $LP 2>/dev/null || break; sleep 0.5; done
  if [ -f /tmp/ready_l ]; then row "$name: group formed" "yes"; else row "$name: group formed" "NO"; tail -5 "$OUT/leader_$name.log" "$OUT/follower_$name.log"; fi
}
check() {  # label, cli flags...
  local label=$1; shift
  local res
  res=$(timeout 60 $B/moeserve-cli forward --target 127.0.0.1:50081 --layer 0 --check "$@" 2>&1 | tee -a "$OUT/cli.log" | grep -E -o "relative_l2_error=[0-9.e+-]*|check (passed|FAILED)|error.*" | tr '\n' ' ')
  row "$label" "${res:-no answer}"
}
health() {  # label, target, service
  row "$1" "$(timeout 10 $B/moeserve-cli health --target $2 --service "$3" 2>&1 | tail -1)"
}

for fmt in bf16 mxfp8; do
  start_group $fmt --weight_format $fmt
  check "$fmt uniform M=64 bf16"      --tokens 64 --dtype bf16 --routing uniform --seed 3
  check "$fmt balanced M=333 fp32"    --tokens 333 --dtype fp32 --routing balanced --seed 4
  check "$fmt hot M=1 bf16"           --tokens 1 --dtype bf16 --routing hot --seed 5
  check "$fmt uniform M=1024 fp16"    --tokens 1024 --dtype fp16 --routing uniform --seed 6
  timeout 10 $B/moeserve-cli info --target 127.0.0.1:50081 > "$OUT/info_$fmt.log" 2>&1
  health "$fmt leader health ''" 127.0.0.1:50081 ""
  health "$fmt follower health ''" 127.0.0.1:50082 ""
  health "$fmt follower health MoeService" 127.0.0.1:50082 moeserve.v1.MoeService
  if [ $fmt = bf16 ]; then
    sleep 2  # idle: heartbeats keep the group alive
    check "$fmt after 2 s idle M=64" --tokens 64 --dtype bf16 --seed 7
    kill -TERM $LP; wait $LP; lrc=$?
    timeout 20 tail --pid=$FP -f /dev/null; wait $FP; frc=$?
    row "$fmt clean shutdown (leader rc, follower rc)" "$lrc $frc"
  else
    kill -KILL $FP; wait $FP 2>/dev/null
    t0=$(date +%s.%N)
    r=$(timeout 60 $B/moeserve-cli forward --target 127.0.0.1:50081 --layer 0 --tokens 64 --dtype bf16 2>&1 | tail -2 | tr '\n' ' ')
    t1=$(date +%s.%N)
    row "fault: forward after follower SIGKILL" "$(awk "BEGIN{print $t1 - $t0}") s: $r"
    sleep 1
    t0=$(date +%s.%N)
    r=$(timeout 60 $B/moeserve-cli forward --target 127.0.0.1:50081 --layer 0 --tokens 64 --dtype bf16 2>&1 | tail -1)
    t1=$(date +%s.%N)
    row "fault: next forward" "$(awk "BEGIN{print $t1 - $t0}") s: $r"
    health "fault: leader health ''" 127.0.0.1:50081 ""
    health "fault: leader health MoeService" 127.0.0.1:50081 moeserve.v1.MoeService
    kill -TERM $LP; timeout 30 tail --pid=$LP -f /dev/null; wait $LP; row "fault: leader exit rc" "$?"
  fi
done
# A follower whose leader never comes: bounded bootstrap.
t0=$(date +%s.%N)
CUDA_VISIBLE_DEVICES=1 timeout 60 $B/moeserve $COMMON --node_rank 1 --bootstrap_timeout_s 3 --leader_address 127.0.0.1:50099 --listen 127.0.0.1:50083 > "$OUT/lonely_follower.log" 2>&1; rc=$?
t1=$(date +%s.%N)
row "follower without leader (rc, seconds)" "$rc $(awk "BEGIN{print $t1 - $t0}")"
# A leader whose follower never joins: bounded NCCL init.
t0=$(date +%s.%N)
CUDA_VISIBLE_DEVICES=0 timeout 60 $B/moeserve $COMMON --node_rank 0 --leader_address 127.0.0.1:50091 --listen 127.0.0.1:50084 > "$OUT/lonely_leader.log" 2>&1; rc=$?
t1=$(date +%s.%N)
row "leader without follower (rc, seconds)" "$rc $(awk "BEGIN{print $t1 - $t0}")"
tail -2 "$OUT/lonely_leader.log"
echo "=================== summary ==================="
printf '%s\n' "${ROWS[@]}"
