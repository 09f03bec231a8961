#!/bin/bash
# One device call: the torch client's CUDA tests (tests/python/torch_client_test.py, including the
# CUDA-region and zero-copy paths) and bench_client.py --zero-copy --channel for CUDA and CPU
# tensors against `moeserve-cli load --cuda_region/--shm --channel` (trivial layer, H7168 BF16).
# Carries .bundle/transport.tar.xz and .gpucarry/wheels. Output: $OUT (default /tmp/zc).
set -uo pipefail
OUT=${OUT:-/tmp/zc}
mkdir -p "$OUT"
tar -C /tmp -xJf .bundle/transport.tar.xz
B=/tmp/transport/bin
NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH=/tmp/transport/lib${NCCL_DIR:+:$NCCL_DIR}
python3 tests/benchmarks/transport/py_deps.py .gpucarry/wheels "$OUT/pydeps" > "$OUT/py_deps.log" 2>&1 ||
  { echo "py_deps failed: $(tail -2 "$OUT/py_deps.log")"; exit 1; }
export PYTHONPATH=$OUT/pydeps
timeout 200 python3 tests/python/torch_client_test.py --server $B/moeserve --cli $B/moeserve-cli \
  --source-dir . > "$OUT/torch_client_test.log" 2>&1
echo "torch_client_test: exit $? $(grep -E '^(Ran|OK|FAILED)' "$OUT/torch_client_test.log" | tr '\n' ' ')"
grep -E "(FAIL|ERROR):|skipped" "$OUT/torch_client_test.log" | head -20
SRV=(--server-args --model tiny --hidden 7168 --intermediate 64 --enable_shared_memory)
for dev in ${DEVS:-cuda cpu}; do
  timeout 150 python3 clients/python/examples/bench_client.py --server $B/moeserve --cli $B/moeserve-cli \
    --tokens ${MS:-1,16,64,256,1024} --calls 200 --rounds 2 --no-numpy --device $dev \
    --shared-memory auto --channel --zero-copy "${SRV[@]}" > "$OUT/bench_$dev.log" 2>&1
  echo "bench $dev: exit $?"; grep -v "^# \[" "$OUT/bench_$dev.log" | head -20
done
