#!/bin/bash
# One device call for the forward channel and the device-I/O graphs (issue 11): the GPU tests
# that cover them, then the transport benchmark with the channel's ways and the torch client.
#   .gpucarry/gt.tgz: gt/bin/{shared_memory_cuda_test,engine_cuda_test,cuda_experts_test} and
#     gt/lib (bundle-libs.sh); .bundle/transport.tar.xz (make_bundle.sh); .gpucarry/wheels.
# Output under $OUT (default /tmp/channel): test logs, the transport logs and table.
set -uo pipefail
OUT=${OUT:-/tmp/channel}
mkdir -p "$OUT"
tar -C /tmp -xzf .gpucarry/gt.tgz
tar -C /tmp -xJf .bundle/transport.tar.xz
G=/tmp/gt
NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
export NCCL_NVLS_ENABLE=0
run_test() {  # name binary args...
  local name=$1; shift
  LD_LIBRARY_PATH=$G/lib:/tmp/transport/lib${NCCL_DIR:+:$NCCL_DIR} MOESERVE_BINARY=/tmp/transport/bin/moeserve \
    timeout 150 "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? $(grep -E '^\[  (PASSED|FAILED)|tests ran' "$OUT/$name.log" | tr '\n' ' ')"
}
run_test shared_memory_cuda_test $G/bin/shared_memory_cuda_test
grep -E "^(cuda|system) region" "$OUT/shared_memory_cuda_test.log" | head -40
run_test engine_cuda_test $G/bin/engine_cuda_test
run_test cuda_kernels_test $G/bin/cuda_kernels_test
# The experts suite in 4 shards at once (the GPU is shared; correctness only).
for i in 0 1 2 3; do
  GTEST_TOTAL_SHARDS=4 GTEST_SHARD_INDEX=$i run_test cuda_experts_test_$i $G/bin/cuda_experts_test &
done
wait
OUT=$OUT/transport PY=${PY:-1} WAYS=${WAYS:-tcp shm cuda shm-ch cuda-ch} \
  LAYERS=${LAYERS:-seed trivial} BUDGET_S=${BUDGET_S:-300} \
  bash tests/benchmarks/transport/run_transport_device.sh /tmp/transport 2>&1 | tail -${TAIL:-70}
# Where the torch client's time goes (CUDA tensors, CUDA region, channel; M=1): cProfile.
if [ "${PROFILE:-1}" = 1 ] && [ -d "$OUT/transport/pydeps" ]; then
  LD_LIBRARY_PATH=/tmp/transport/lib${NCCL_DIR:+:$NCCL_DIR} PYTHONPATH=$OUT/transport/pydeps \
    timeout 120 python3 clients/python/examples/bench_client.py --server /tmp/transport/bin/moeserve \
    --cli /tmp/transport/bin/moeserve-cli --tokens 1 --calls 200 --rounds 1 --no-numpy \
    --device cuda --shared-memory cuda --channel --profile 1 --server-args --model tiny \
    --hidden 7168 --intermediate 64 --enable_shared_memory > "$OUT/profile.log" 2>&1
  echo "profile: exit $?"; grep -E "^ +[0-9]+ " "$OUT/profile.log"; head -60 "$OUT/profile.log" | grep -v "^#" | tail -45
fi
