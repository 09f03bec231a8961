#!/bin/bash
# One device call for device routing (issue 11, CUDA regions): the GPU tests that cover it, then
# the transport benchmark for the region ways, with the default graph limit (256) and with
# graphs up to 1024 tokens. Carry .gpucarry/gt.tgz (gt/bin/{cuda_kernels_test,engine_cuda_test,
# shared_memory_cuda_test} and gt/lib from bundle-libs.sh) and .bundle/transport.tar.xz.
# Output under $OUT: test logs and both transport runs' logs.
set -uo pipefail
OUT=${OUT:-/tmp/devroute}
mkdir -p "$OUT"
tar -C /tmp -xzf .gpucarry/gt.tgz
tar -C /tmp -xJf .bundle/transport.tar.xz
G=/tmp/gt
NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
run_test() {  # name binary args...
  local name=$1; shift
  LD_LIBRARY_PATH=$G/lib:/tmp/transport/lib${NCCL_DIR:+:$NCCL_DIR} MOESERVE_BINARY=/tmp/transport/bin/moeserve \
    timeout 200 "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? $(grep -E '^\[  (PASSED|FAILED)|tests ran' "$OUT/$name.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED' "$OUT/$name.log" | head -5
}
run_test cuda_kernels_test $G/bin/cuda_kernels_test
run_test engine_cuda_test $G/bin/engine_cuda_test --gtest_filter="${ENGINE_FILTER:-*}"
run_test shared_memory_cuda_test $G/bin/shared_memory_cuda_test
grep -E "^cuda region BF16" "$OUT/shared_memory_cuda_test.log" | head -8
if [ "${BENCH:-1}" = 1 ]; then
  echo "== transport, default graph limit (1024 since 814c2d4)"
  OUT=$OUT/t256 PY=0 WAYS=${WAYS:-tcp shm-ch cuda-ch} LAYERS=${LAYERS:-trivial seed} BUDGET_S=200 \
    bash tests/benchmarks/transport/run_transport_device.sh /tmp/transport > "$OUT/t256.txt" 2>&1
  grep -E "^\| (trivial|seed) \| (cuda-ch|shm-ch|tcp) " "$OUT/t256.txt" | cut -d'|' -f2-8,11-13
  if [ "${SECOND:-1}" = 1 ]; then
  echo "== transport, --cuda_graph_max_tokens ${SECOND_LIMIT:-1024}"
  OUT=$OUT/t1024 PY=0 WAYS="shm-ch cuda-ch" MS="256 1024" LAYERS=${LAYERS:-trivial seed} BUDGET_S=120 \
    SERVER_FLAGS="--cuda_graph_max_tokens ${SECOND_LIMIT:-1024}" \
    bash tests/benchmarks/transport/run_transport_device.sh /tmp/transport > "$OUT/t1024.txt" 2>&1
  grep -E "^\| (trivial|seed) \| (cuda-ch|shm-ch) " "$OUT/t1024.txt" | cut -d'|' -f2-8,11-13
  fi
fi
# The torch client (its CUDA tests and the zero-copy bench) where the wheels came along.
if [ "${PY:-0}" = 1 ] && [ -d .gpucarry/wheels ]; then
  echo "== torch client"
  OUT=$OUT/zc DEVS=${DEVS:-cuda} bash scripts/gpu/run_torch_zero_copy.sh 2>&1 | tail -30
fi
tar -C "$OUT" -czf "$OUT/logs.tgz" --exclude=logs.tgz --exclude=pydeps . 2>/dev/null
