#!/usr/bin/env bash
# One device call after split-K and the earlier timer stop: GPU tests of the engine and the
# regions, engine_forward_bench (trivial layer, timed and untimed, this build and 2b28cdf's),
# then issue 11's transport benchmark without Python (PY=0). Carry .gpucarry/e2e.tgz
# (sa/{bin,lib}) and .bundle/transport.tar.xz.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
rm -rf /tmp/sa && mkdir -p /tmp/sa && tar -C /tmp/sa -xzf .gpucarry/e2e.tgz
export LD_LIBRARY_PATH=/tmp/sa/sa/lib
for t in engine_cuda_test shared_memory_cuda_test; do timeout 200 /tmp/sa/sa/bin/$t > $OUT/$t.log 2>&1; echo "$t rc=$? $(grep -E '^\[  (PASSED|FAILED) ' $OUT/$t.log | tr '\n' ' ')"; done
for b in engine_forward_bench engine_forward_bench_old; do for timed in 1 0; do echo "== $b trivial timed=$timed"; timeout 60 /tmp/sa/sa/bin/$b --model trivial --weight_format bf16 --tokens 1,16,64 --iters 300 --timed $timed | grep -v '^#'; done; done
unset LD_LIBRARY_PATH
rm -rf /tmp/transport
OUT=/tmp/transport PY=0 bash tests/benchmarks/transport/run_transport_device.sh .bundle/transport.tar.xz > $OUT/transport.log 2>&1; echo "transport rc=$?"
(cd /tmp/transport && tar -czf $OUT/transport-logs.tgz --exclude=transport *.log *.txt 2>/dev/null)
tail -42 $OUT/transport.log
