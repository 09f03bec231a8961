#!/bin/bash
# One call on nvidia-h200-x2 validating a commit end to end on GPUs (no benchmarks): the CUDA
# kernel and experts suites and the engine on GPU 0, the real server with the default backend
# (auto -> cuda) checked by moeserve-cli and scraped for metrics, EP2 in one process over NCCL
# (server + nccl_ep_test), then the two-process checks. Binaries in $BUNDLE/bin, libraries in
# $BUNDLE/lib. A short table last.
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUNDLE=${BUNDLE:-$PWD/.bundle/final}
B=$BUNDLE/bin
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
export LD_LIBRARY_PATH=$BUNDLE/lib:$NCCL_DIR
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; date -u
declare -a ROWS
row() { ROWS+=("$(printf '%-40s %s' "$1" "$2")"); echo "== $1: $2"; }
gtest() {  # name, timeout, binary args...
  local name=$1 t=$2; shift 2
  timeout "$t" "$@" --gtest_brief=1 > "$OUT/$name.log" 2>&1
  row "$name" "$(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/$name.log" | tr -s ' ' | tr '\n' ' ')"
  grep -E "Failure|FAILED" "$OUT/$name.log" | head -5
}
gtest cuda_kernels_test 120 $B/cuda_kernels_test
gtest cuda_experts_test 240 $B/cuda_experts_test
gtest engine_cuda_test 180 $B/engine_cuda_test
serve_check() {  # name, flags...
  local name=$1; shift
  rm -f /tmp/ready_$name
  $B/moeserve --listen 127.0.0.1:50081 --metrics_address 127.0.0.1:9181 --enable_get_expert_weights --ready_file /tmp/ready_$name "$@" \
    > "$OUT/server_$name.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 240); do [ -f /tmp/ready_$name ] && break; kill -0 $pid 2>/dev/null || break; sleep 0.5; done
  local res
  res=$(timeout 60 $B/moeserve-cli forward --target 127.0.0.1:50081 --layer 0 --tokens 64 --dtype bf16 --routing hot --check 2>&1 | tee "$OUT/cli_$name.log" | grep -o "relative_l2_error=[0-9.e+-]*" | head -1)
  local metrics
  metrics=$(timeout 10 curl -s 127.0.0.1:9181/metrics | grep -c '^moeserve_requests_total')
  local backend
  backend=$(grep -o "backend=[a-z]* [a-zA-Z=]* ranks=[0-9]*" "$OUT/server_$name.log" | head -1)
  kill -TERM $pid 2>/dev/null; wait $pid; local rc=$?
  row "server $name" "${res:-FAILED} [$backend] metrics_series=$metrics exit=$rc"
}
serve_check default
serve_check ep2_mxfp8 --backend cuda --ranks 2 --weight_format mxfp8 --model qwen3-30b-a3b --num_layers 1
gtest nccl_ep_test 300 $B/nccl_ep_test
BUNDLE=$BUNDLE bash scripts/gpu/run_multiprocess_checks.sh > "$OUT/multiprocess.log" 2>&1
row "multiprocess (see multiprocess.log)" "exit=$? $(grep -c -i 'pass' "$OUT/multiprocess.log") pass lines, $(grep -c -i 'fail' "$OUT/multiprocess.log") fail lines"
echo "=================== summary ==================="
tail -22 "$OUT/multiprocess.log"
printf '%s\n' "${ROWS[@]}"
