#!/bin/bash
# Final measurement call (not committed as is; see tests/benchmarks/serving/RESULTS.md).
set -u
mkdir -p /tmp/tb && tar -C /tmp/tb -xJf .bundle/transport.tar.xz
B=/tmp/tb/transport/bin
NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/tmp/tb/transport/lib${NCCL_DIR:+:$NCCL_DIR}
$B/moeserve --version | head -2
mkdir -p $OUT/serving $OUT/pa
WFS=mxfp8 OUT=/tmp/serving timeout 360 bash tests/benchmarks/serving/run_serving_bench.sh $B > /tmp/serving.txt 2>&1
echo "serving rc=$?"; sed -n '/=== summary ===/,$p' /tmp/serving.txt
(cd /tmp/serving && tar -czf $OUT/serving/logs.tgz . ) 2>/dev/null; cp /tmp/serving.txt $OUT/serving/
PA_WHEELS=$PWD/.gpucarry/pa MOESERVE_BINARY=$B/moeserve MOESERVE_CLI=$B/moeserve-cli \
  MOESERVE_ARGS="--backend cuda --model seed-megamoe --num_experts 32 --num_layers 1" TOKENS="16" \
  CONCURRENCY=1:8:7 OUT=/tmp/pa timeout 150 bash scripts/gpu/run_perf_analyzer.sh > /tmp/pa.txt 2>&1
echo "perf_analyzer rc=$?"; tail -12 /tmp/pa.txt
(cd /tmp/pa && tar -czf $OUT/pa/logs.tgz --exclude pa . ) 2>/dev/null; cp /tmp/pa.txt $OUT/pa/
