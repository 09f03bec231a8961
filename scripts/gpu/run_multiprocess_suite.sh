#!/bin/bash
# The combination suite in two-process form on nvidia-h200-x2: a leader and a follower process of
# one GPU each (NCCL between them); for both dispatch formats (all2all_contiguous ->
# CudaExperts, all2all_batched -> CudaBatchedExperts) and both weight formats, three routings x
# M in {1, 333, 4096} through the leader, each checked by moeserve-cli --check against the
# client's independent reference (relative L2 < 1e-2). A short table last. From the repo root:
#   BUNDLE=.bundle/final bash scripts/gpu/run_multiprocess_suite.sh   (bin/ and lib/ inside)
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUNDLE=${BUNDLE:-$PWD/.bundle/final}
B=$BUNDLE/bin
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
export LD_LIBRARY_PATH=$BUNDLE/lib:$NCCL_DIR
MODEL="--model tiny --num_experts 64 --topk 8 --hidden 512 --intermediate 256 --num_layers 2"
COMMON="--backend cuda --ranks 1 --world_size 2 --leader_address 127.0.0.1:50190 --metrics_address= --enable_get_expert_weights --collective_timeout_ms 20000 --bootstrap_timeout_s 60 $MODEL"
PASS=0; FAIL=0; ROWS=()
for pf in all2all_contiguous all2all_batched; do
  for fmt in bf16 mxfp8; do
    name=${pf}_$fmt
    ex=blas; [ $pf = all2all_batched ] && ex=batched_blas
    rm -f /tmp/rs_l /tmp/rs_f
    CUDA_VISIBLE_DEVICES=1 $B/moeserve $COMMON --node_rank 1 --listen 127.0.0.1:50182 --ready_file /tmp/rs_f --prepare_finalize $pf --experts $ex --weight_format $fmt > "$OUT/suite_f_$name.log" 2>&1 &
    fp=$!
    CUDA_VISIBLE_DEVICES=0 $B/moeserve $COMMON --node_rank 0 --listen 127.0.0.1:50181 --ready_file /tmp/rs_l --prepare_finalize $pf --experts $ex --weight_format $fmt > "$OUT/suite_l_$name.log" 2>&1 &
    lp=$!
    for i in $(seq 1 240); do [ -f /tmp/rs_l ] && break; kill -0 $lp 2>/dev/null || break; sleep 0.5; done
    experts=$(timeout 10 $B/moeserve-cli info --target 127.0.0.1:50181 2>/dev/null | grep -E "^(experts|prepare_finalize|num_ranks):" | awk '{print $2}' | tr '\n' ' ')
    line="$name [$experts]:"
    i=0
    for routing in uniform balanced hot; do
      for m in 1 333 4096; do
        dtypes=(bf16 fp16 fp32); dt=${dtypes[$((i % 3))]}; i=$((i + 1))
        r=$(timeout 120 $B/moeserve-cli forward --target 127.0.0.1:50181 --layer $((i % 2)) --tokens $m --dtype $dt --routing $routing --hot_expert 40 --seed $i --check 2>&1 | tee -a "$OUT/suite_cli.log" | grep -o "relative_l2_error=[0-9.e+-]*" | cut -d= -f2)
        if [ -n "$r" ] && awk "BEGIN{exit !($r < 0.01)}"; then PASS=$((PASS + 1)); line="$line $routing/$m/$dt=$r"; else FAIL=$((FAIL + 1)); line="$line $routing/$m/$dt=FAIL"; fi
      done
    done
    ROWS+=("$line")
    kill -TERM $lp; wait $lp; lrc=$?; timeout 20 tail --pid=$fp -f /dev/null; wait $fp; frc=$?
    ROWS+=("  shutdown rc leader=$lrc follower=$frc")
  done
done
echo "=================== two-process suite ==================="
printf '%s\n' "${ROWS[@]}"
echo "$PASS passed, $FAIL failed"
