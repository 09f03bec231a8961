#!/bin/bash
# One call on nvidia-h200 (one GPU) validating a commit against a base build: the CUDA suites
# (kernels, experts, engine, the registry's combination pairs that fit one GPU), memcheck on a
# subset, the real server (auto -> cuda) checked by moeserve-cli in every answer dtype, the
# expert-MLP benchmark with its PyTorch peers and the base build as "before", then the same
# closed-loop client load against the base and the new server. A short table last.
# Binaries in $BUNDLE/bin (base ones suffixed _base), libraries in $BUNDLE/lib.
# Usage: run_single_gpu_validation.sh [checks|perf|all] (two device calls fit the 10-minute limit).
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
BUNDLE=${BUNDLE:-$PWD/.bundle}
B=$BUNDLE/bin
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
export LD_LIBRARY_PATH=$BUNDLE/lib:$NCCL_DIR
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; date -u
WHAT=${1:-all}
declare -a ROWS
row() { ROWS+=("$(printf '%-44s %s' "$1" "$2")"); echo "== $1: $2"; }
gtest() {  # name, timeout, binary args...
  local name=$1 t=$2; shift 2
  timeout "$t" "$@" --gtest_brief=1 > "$OUT/$name.log" 2>&1
  row "$name" "$(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/$name.log" | tr -s ' ' | tr '\n' ' ')"
  grep -E "Failure|FAILED" "$OUT/$name.log" | head -5
}
serve() {  # name bin port flags... ; leaves $SERVER_PID
  local name=$1 bin=$2 port=$3; shift 3
  rm -f /tmp/ready_$name
  $bin --listen 127.0.0.1:$port --metrics_address 127.0.0.1:$((port + 100)) \
    --ready_file /tmp/ready_$name "$@" > "$OUT/server_$name.log" 2>&1 &
  SERVER_PID=$!
  for i in $(seq 1 480); do [ -f /tmp/ready_$name ] && break; kill -0 $SERVER_PID 2>/dev/null || break; sleep 0.5; done
}
stop() { kill -TERM $SERVER_PID 2>/dev/null; wait $SERVER_PID; }
if [ "$WHAT" != perf ]; then
gtest cuda_kernels_test 120 $B/cuda_kernels_test
gtest cuda_experts_test 240 $B/cuda_experts_test
gtest engine_cuda_test 180 $B/engine_cuda_test
gtest engine_mk_combinations_cuda 240 $B/engine_mk_combinations_test --gtest_filter='*Cuda*:*Nccl*'
timeout 90 compute-sanitizer --tool memcheck $B/cuda_experts_test --gtest_brief=1 \
  --gtest_filter='*M64_E16*bf16_hot:*M300_E16_k8*batched:*M100_E8*mxfp8_uniform_ep:*Refuses*' \
  > "$OUT/memcheck.log" 2>&1
row "memcheck cuda_experts_test subset" "$(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/memcheck.log" | tr '\n' ' ')"

# Correctness through the real server, every answer dtype, both weight formats.
for wf in bf16 mxfp8; do
  serve check_$wf $B/moeserve 50081 --enable_get_expert_weights --weight_format $wf --model qwen3-30b-a3b --num_layers 1
  for dt in bf16 fp16 fp32; do
    res=$(timeout 60 $B/moeserve-cli forward --target 127.0.0.1:50081 --tokens 64 --dtype $dt \
      --routing hot --check 2>&1 | tee "$OUT/cli_${wf}_$dt.log" | grep -o "relative_l2_error=[0-9.e+-]*")
    row "server $wf weights, $dt answer" "${res:-FAILED} $(grep -o 'backend=[a-z]*' "$OUT/server_check_$wf.log" | head -1)"
  done
  stop
done

fi
if [ "$WHAT" != checks ]; then
BASE=; [ -x $B/moe_experts_bench_base ] && BASE=$B/moe_experts_bench_base
# BENCH_RUNS runs of the whole table (run-to-run spread of the same code), into bench<i>/.
for i in $(seq 1 ${BENCH_RUNS:-1}); do
  [ "${SKIP_BENCH:-0}" = 1 ] && break
  mkdir -p "$OUT/bench$i"
  timeout ${T_BENCH:-260} python3 scripts/gpu/bench_moe.py $B/moe_experts_bench "$OUT/bench$i" \
    $BASE > "$OUT/bench$i/bench.log" 2>&1
  tail -44 "$OUT/bench$i/bench.log"
done

# The engine alone (no gRPC), seed per-rank layer MXFP8, BF16 answers.
for which in base new; do
  bin=$B/engine_forward_bench; [ $which = base ] && bin=$B/engine_forward_bench_base
  [ -x $bin ] || continue
  for timed in 1 0; do
    [ $which = base ] && [ $timed = 0 ] && continue  # the base engine always times its stages
    timeout 240 $bin --tokens 1,16,64,1024 --iters 200 --timed $timed \
      > "$OUT/engine_${which}_timed$timed.csv" 2>&1
    cat "$OUT/engine_${which}_timed$timed.csv"
    row "engine $which timed=$timed" "$(grep -v '^#' "$OUT/engine_${which}_timed$timed.csv" | tail -4 | cut -d, -f1-3 | tr '\n' ' ')"
  done
done

# What a user sees: one client, seed per-rank layer (32 experts, top-8, H3072 I5120), MXFP8;
# then 8 concurrent clients at 16 tokens each (per-layer batching); then trivial experts at
# hidden 7168 (the transport alone).
SEED="--model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8"
TRIVIAL="--model tiny --hidden 7168 --intermediate 64 --num_experts 16 --topk 4 --num_layers 1"
load() {  # which tag tokens concurrency requests
  timeout 120 $B/moeserve-cli load --target 127.0.0.1:50091 --tokens $3 --concurrency $4 \
    --requests $5 --routing balanced > "$OUT/load_${1}_$2.log" 2>&1
  row "load $1 $2" "$(grep -E 'latency_ms|server_total|requests_per_s' "$OUT/load_${1}_$2.log" | sed 's/tokens_per_s=.*//' | tr '\n' ' ')"
}
for which in base new; do
  bin=$B/moeserve; [ $which = base ] && bin=$B/moeserve_base
  [ -x $bin ] || continue
  serve load_$which $bin 50091 $SEED
  for m in 1 16 64 1024; do
    n=200; [ $m = 1024 ] && n=60
    load $which "seed_M=${m}_c1" $m 1 $n
  done
  load $which "seed_M=16_c8" 16 8 800
  stop
  serve trivial_$which $bin 50091 $TRIVIAL
  for m in 1 64 1024; do
    n=200; [ $m = 1024 ] && n=60
    load $which "trivial_M=${m}_c1" $m 1 $n
  done
  stop
done
fi
echo "=================== summary ==================="
printf '%s\n' "${ROWS[@]}"
