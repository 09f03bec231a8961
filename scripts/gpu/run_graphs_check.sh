#!/bin/bash
# One device call (nvidia-h200) for CUDA graphs (issue 12 item 3): the engine's CUDA suite (graph
# replay against the CPU reference), then graphs off vs on, in the same call:
#   - Engine::Forward alone (engine_forward_bench): trivial experts (H7168, I64) and the seed
#     per-rank layer (MXFP8), 1/16/64 tokens;
#   - the server through the C++ client: trivial M=1 (server total and its stages), seed MXFP8
#     M=16 with 1 and 8 callers.
# Binaries in $BUNDLE/bin, libraries in $BUNDLE/lib. A short table last.
set -uo pipefail
BUNDLE=${BUNDLE:-$PWD/.bundle}
B=$BUNDLE/bin
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=$BUNDLE/lib:${LD_LIBRARY_PATH:-}
PORT=50161
declare -a ROWS
row() { ROWS+=("$(printf '%-40s %s' "$1" "$2")"); echo "== $1: $2"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u

timeout 240 "$B/engine_cuda_test" --gtest_brief=1 > "$OUT/engine_cuda_test.log" 2>&1
row engine_cuda_test "$(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/engine_cuda_test.log" | tr -s ' ' | tr '\n' ' ')"
grep -E "Failure|FAILED|error" "$OUT/engine_cuda_test.log" | head -8

for g in 0 -1; do
  timeout 120 "$B/engine_forward_bench" --model trivial --weight_format bf16 --tokens 1,16,64 \
    --iters 1000 --graph_max_tokens $g > "$OUT/engine_trivial_g$g.csv" 2>&1
  timeout 120 "$B/engine_forward_bench" --model seed --weight_format mxfp8 --tokens 1,16,64 \
    --iters 300 --graph_max_tokens $g > "$OUT/engine_seed_g$g.csv" 2>&1
  for f in trivial seed; do
    while IFS=, read -r n p50 p90 pr ex fi; do
      [[ $n =~ ^[0-9]+$ ]] || continue
      row "engine $f M=$n graphs=$g" "wall p50 $p50 p90 $p90 | prepare $pr experts $ex finalize $fi us"
    done < "$OUT/engine_${f}_g$g.csv"
  done
done

LOAD_MAX_SECONDS=40
source "$(dirname "$0")/serve_lib.sh"
TRIVIAL="--model tiny --hidden 7168 --intermediate 64 --num_experts 16 --topk 4 --num_layers 1"
SEED="--model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8"
for g in 0 -1; do
  serve trivial_g$g $TRIVIAL --cuda_graph_max_tokens $g
  grep -o "cuda_graphs=[^ ]*" "$OUT/server_trivial_g$g.log"
  load trivial_M1_c1_g$g 1 1 3000
  load trivial_M1_c1_stream_g$g 1 1 3000 --stream
  stop
  serve seed_g$g $SEED --cuda_graph_max_tokens $g
  load seed_M16_c1_g$g 16 1 600
  load seed_M16_c8_g$g 16 8 4000
  load seed_M64_c1_g$g 64 1 400
  stop
done
# Check answers through the server with graphs on (every answer dtype, hot routing).
serve check $TRIVIAL --enable_get_expert_weights
for dt in bf16 fp16 fp32; do
  res=$(timeout 60 "$B/moeserve-cli" forward --target 127.0.0.1:$PORT --tokens 5 --dtype $dt \
    --routing hot --check 2>&1 | tee "$OUT/cli_check_$dt.log" | grep -o "relative_l2_error=[0-9.e+-]*")
  row "server check $dt (graphs on)" "${res:-FAILED}"
done
stop

echo "=================== summary ==================="
printf '%s\n' "${ROWS[@]}"
