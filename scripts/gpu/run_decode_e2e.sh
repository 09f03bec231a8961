#!/bin/bash
# What one caller sees of the decode GEMMs (one device call): the seed per-rank layer (32 experts,
# top-8, H3072 I5120, MXFP8, CUDA backend) served by each given build, one caller through
# moeserve-cli at M = 16, 64 and 128 (MS="..." sets them; balanced routing, 300 calls each):
# client round trip and server total, to set next to the experts' kernel time of
# tests/benchmarks/cuda/RESULTS.md.
# Usage: run_decode_e2e.sh NAME=BUNDLE.tar.xz ...   (bundles from make_bundle.sh); writes $OUT.
set -u
OUT=${OUT:-/tmp/e2e}; mkdir -p "$OUT"
PORT=50161
NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
export NCCL_NVLS_ENABLE=0
row() { printf '%-22s %s\n' "$1" "$2" | tee -a "$OUT/rows.txt"; }
source "$(dirname "$0")/serve_lib.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null; date -u
for spec in "$@"; do
  name=${spec%%=*}
  mkdir -p "/tmp/e2e_bin/$name" && tar -C "/tmp/e2e_bin/$name" -xJf "${spec#*=}"
  B=/tmp/e2e_bin/$name/transport/bin
  export LD_LIBRARY_PATH=/tmp/e2e_bin/$name/transport/lib${NCCL_DIR:+:$NCCL_DIR}
  serve "$name" --model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8
  for m in ${MS:-16 64 128}; do load "${name}_M$m" "$m" 1 300; done
  stop
done
