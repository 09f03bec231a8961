#!/bin/bash
# One device call on the two-GPU machine (kind nvidia-h200-x2): the engine's --backend cuda
# checks (GPU 0), the NCCL EP2 tests, the real server with moeserve-cli --check on one and two
# GPUs, and the NCCL benchmark with its PyTorch peer; a short table last. Run from the repo root
# with binaries in .bundle/bin and their libraries in .bundle/lib (see docs/gpu.md):
#   scripts/gpu/run_multi_gpu_checks.sh [quick]
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
BUNDLE=${BUNDLE:-$PWD/.bundle/nccl-ep}
B=$BUNDLE/bin
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# NCCL from this machine (PyTorch's wheel or the CUDA install); ours only as a fallback.
NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
[ -f "$NCCL_DIR/libnccl.so.2" ] || NCCL_DIR=$(dirname "$(find / -name libnccl.so.2 -not -path '*/proc/*' 2>/dev/null | grep -v .bundle | head -1)" 2>/dev/null)
[ -f "$NCCL_DIR/libnccl.so.2" ] || NCCL_DIR=$BUNDLE/nccl
export LD_LIBRARY_PATH=$BUNDLE/lib:$NCCL_DIR
echo "NCCL from $NCCL_DIR"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; date -u
nvidia-smi topo -m 2>/dev/null | head -4
QUICK=${1:-}
declare -A R

# (A) engine --backend cuda vs the CPU reference.
timeout 120 $B/engine_cuda_test --gtest_brief=1 2>&1 | tee "$OUT/engine_cuda.log" | grep -E "FAILED|PASSED|SKIPPED|tests from" | tail -4
R[engine_cuda_test]=$(grep -E "^\[  (PASSED|FAILED)" "$OUT/engine_cuda.log" | tr '\n' ' ')
# (A) the registry's combination suite, every CUDA PrepareAndFinalize x Experts pair at R = 1, 2
# (R > 2 skips on two GPUs), against the CPU reference.
if [ -x $B/engine_mk_combinations_test ]; then
  timeout 300 $B/engine_mk_combinations_test --gtest_brief=1 --gtest_filter='*Cuda*:*Nccl*' \
    > "$OUT/combinations_cuda.log" 2>&1
  R[combinations_cuda]=$(grep -E "^\[  (PASSED|FAILED|SKIPPED)" "$OUT/combinations_cuda.log" | tr '\n' ' ')
fi

# (A) the real server, one GPU (BF16) and two GPUs (EP2 over NCCL, MXFP8), checked by the CLI.
serve_check() {  # name, server flags...
  local name=$1; shift
  rm -f /tmp/ready_$name
  $B/moeserve --listen 127.0.0.1:50071 --metrics_address 127.0.0.1:9171 --enable_get_expert_weights --ready_file /tmp/ready_$name "$@" \
    > "$OUT/server_$name.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 120); do [ -f /tmp/ready_$name ] && break; kill -0 $pid 2>/dev/null || break; sleep 0.5; done
  local res
  res=$(timeout 60 $B/moeserve-cli forward --target 127.0.0.1:50071 --layer 0 --tokens 64 --dtype bf16 --check 2>&1 | tee "$OUT/cli_$name.log" | grep -o "relative_l2_error=[0-9.e+-]*" | head -1)
  timeout 30 $B/moeserve-cli info --target 127.0.0.1:50071 > "$OUT/info_$name.log" 2>&1
  kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null
  echo "server $name ($*): ${res:-FAILED (see server_$name.log)}"
  grep -m1 "backend=" "$OUT/server_$name.log"
  R[server_$name]=${res:-FAILED}
}
serve_check cuda1 --backend cuda --weight_format bf16
serve_check cuda2 --backend cuda --ranks 2 --weight_format mxfp8 --model qwen3-30b-a3b --num_layers 1

# (D) NCCL EP2 tests.
timeout 240 $B/nccl_ep_test --gtest_brief=1 2>&1 | tee "$OUT/nccl_ep.log" | grep -E "FAILED|PASSED|late rank|tests from|Failure|rel|Expected|Which|error" | head -40
R[nccl_ep_test]=$(grep -E "^\[  (PASSED|FAILED)" "$OUT/nccl_ep.log" | tr '\n' ' ')

# (E) benchmark, then the PyTorch peer.
timeout 200 $B/nccl_ep_bench "$OUT/nccl_ep_bench.csv" $QUICK 2>&1 | tee "$OUT/bench.log" | tail -30
timeout 150 python3 tests/benchmarks/nccl/torch_all_to_all.py "$OUT/torch_a2a.csv" $QUICK 2>&1 | tee "$OUT/torch.log" | grep -v Warning | tail -22

echo "=================== summary ==================="
for k in "${!R[@]}"; do printf "%-18s %s\n" "$k" "${R[$k]}"; done
python3 - "$OUT" <<'PY'
import csv, sys, os
out = sys.argv[1]
ours = {}
p = os.path.join(out, "nccl_ep_bench.csv")
t = os.path.join(out, "torch_a2a.csv")
if os.path.exists(p):
    for r in csv.DictReader(open(p)):
        ours[(r["what"], r["hidden"], r["tokens_per_rank"])] = r
torch = {}
if os.path.exists(t):
    for r in csv.DictReader(open(t)):
        torch[(r["hidden"], r["tokens_per_rank"])] = float(r["us"])
floor = [float(r["us"]) for k, r in ours.items() if k[0] == "nccl_sendrecv_16B_floor"]
tf = torch.get(("0", "0"))
print(f"floor: NCCL send/recv 16B+sync {floor[0] if floor else float('nan'):.1f} us; torch a2a 16B+sync {tf or float('nan'):.1f} us")
print("hidden tokens/rank   ours_us  torch_us  ours/torch  ours/(2*floor)")
for k, r in sorted(ours.items(), key=lambda kv: (kv[0][0], int(kv[0][1]), int(kv[0][2]))):
    if k[0] != "dispatch_combine": continue
    us = float(r["us"]); tu = torch.get((k[1], k[2]))
    print(f"{k[1]:>6} {k[2]:>11} {us:9.1f} {tu if tu else float('nan'):9.1f} {us / tu if tu else float('nan'):10.2f} {us / (2 * floor[0]) if floor else float('nan'):14.2f}")
for k, r in sorted(ours.items()):
    if k[0] == "ep2_forward_seed_mxfp8":
        print(f"EP2 forward seed MXFP8 {k[2]} tok/rank: {float(r['us']):.1f} us; 1-GPU 32 experts same routes: {float(r['peer_us']):.1f} us")
PY
