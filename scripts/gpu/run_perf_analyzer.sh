#!/bin/bash
# perf_analyzer (Triton's load generator) against moeserve's KServe v2 endpoint, on a machine
# without network: the binary and its two libraries come from carried packages.
#
# Where perf_analyzer comes from: no current PyPI package ships it (perf-analyzer 0.1.0 is a
# placeholder; tritonclient >= 2.42 wheels are py3-none-any without binaries). tritonclient 2.41.0's
# manylinux1_x86_64 wheel carries bin/perf_analyzer (built against CUDA 12), which needs
# libb64.so.0d (Debian package libb64-0d) and libcudart.so.12 (PyPI nvidia-cuda-runtime-cu12).
# Fetch them on a machine with network, then carry $PA_WHEELS:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux1_x86_64 --platform manylinux2014_x86_64 -d $PA_WHEELS \
#     tritonclient==2.41.0 nvidia-cuda-runtime-cu12==12.9.79
#   (cd $PA_WHEELS && apt-get download libb64-0d)
# (The wheels are extracted, not installed: the Python environment keeps its own tritonclient.)
#
# What runs: moeserve ($MOESERVE_BINARY, default $BUNDLE/bin/moeserve, with $MOESERVE_ARGS,
# default "--model tiny"; e.g. "--backend cuda --model qwen3-30b-a3b --num_layers 2" on a GPU)
# with --enable_shared_memory; random inputs with valid expert ids (scripts/perf_analyzer_input.py,
# numpy) at each of $TOKENS tokens; perf_analyzer over gRPC at concurrency $CONCURRENCY, through
# raw_input_contents and through system shared memory (--shared-memory system: perf_analyzer
# registers its regions with the KServe shared-memory RPCs). Results: $OUT/*.csv and a table last.
set -uo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
BUNDLE=${BUNDLE:-$PWD/.bundle}
PA_WHEELS=${PA_WHEELS:-$BUNDLE/perf_analyzer}
MOESERVE_BINARY=${MOESERVE_BINARY:-$BUNDLE/bin/moeserve}
MOESERVE_CLI=${MOESERVE_CLI:-$(dirname "$MOESERVE_BINARY")/moeserve-cli}
MOESERVE_ARGS=${MOESERVE_ARGS:---model tiny}
TOKENS=${TOKENS:-1 16 128}
CONCURRENCY=${CONCURRENCY:-1:4:3}
INTERVAL_MS=${INTERVAL_MS:-3000}
OUT=${OUT:-/tmp/out}
PORT=${PORT:-50171}
MODEL=${MODEL:-moe_layer_0}
mkdir -p "$OUT"
PA=$OUT/pa
mkdir -p "$PA/bin" "$PA/lib"

# perf_analyzer and its libraries out of the carried packages.
python3 - "$PA_WHEELS" "$PA" <<'PY' || exit 1
import glob, os, shutil, sys, zipfile
src, dst = sys.argv[1:]
def take(pattern, member_suffix, out):
    for whl in sorted(glob.glob(os.path.join(src, pattern))):
        with zipfile.ZipFile(whl) as z:
            for n in z.namelist():
                if n.endswith(member_suffix):
                    with z.open(n) as f, open(out, "wb") as g:
                        shutil.copyfileobj(f, g)
                    os.chmod(out, 0o755)
                    return
    sys.exit(f"no {member_suffix} in {src}/{pattern}")
take("tritonclient-*manylinux*.whl", "/bin/perf_analyzer", os.path.join(dst, "bin/perf_analyzer"))
take("nvidia_cuda_runtime_cu12-*.whl", "/lib/libcudart.so.12", os.path.join(dst, "lib/libcudart.so.12"))
PY
# libb64: the .so itself if carried, else out of the .deb (needs ar and tar).
cp -a "$PA_WHEELS"/libb64.so.0d* "$PA/lib/" 2>/dev/null
DEB=$(ls "$PA_WHEELS"/libb64-0d_*.deb 2>/dev/null | head -1)
if [[ ! -e "$PA/lib/libb64.so.0d" && -n "$DEB" ]]; then
  (cd "$PA" && rm -rf deb && mkdir deb && cd deb && ar x "$DEB" && tar xf data.tar.* &&
     cp -a usr/lib/x86_64-linux-gnu/libb64.so.0d* ../lib/)
fi
export LD_LIBRARY_PATH=$PA/lib:${LD_LIBRARY_PATH:-}
if ldd "$PA/bin/perf_analyzer" | grep -q "not found"; then
  echo "perf_analyzer misses libraries:"; ldd "$PA/bin/perf_analyzer" | grep "not found"; exit 1
fi

# The server.
rm -f "$OUT/ready"
# shellcheck disable=SC2086
"$MOESERVE_BINARY" --listen 127.0.0.1:$PORT --metrics_address 127.0.0.1:$((PORT + 1)) \
  --ready_file "$OUT/ready" --enable_shared_memory $MOESERVE_ARGS > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 1 600); do
  [[ "$("$MOESERVE_CLI" health --target=127.0.0.1:$PORT 2>/dev/null)" == SERVING ]] && break
  kill -0 $SERVER 2>/dev/null || { echo "server exited"; tail -20 "$OUT/server.log"; exit 1; }
  sleep 1
done
INFO=$("$MOESERVE_CLI" info --target=127.0.0.1:$PORT)
field() { echo "$INFO" | sed -n "s/^$1:[[:space:]]*//p" | head -1; }
HIDDEN=$(field hidden); TOPK=$(field topk); EXPERTS=$(field num_experts)
echo "model: hidden=$HIDDEN topk=$TOPK experts=$EXPERTS ($MOESERVE_ARGS)"; date -u

declare -a ROWS
for m in $TOKENS; do
  python3 "$HERE/perf_analyzer_input.py" "$OUT/input_m$m.json" --hidden "$HIDDEN" \
    --topk "$TOPK" --experts "$EXPERTS" --tokens "$m" --steps 8 || exit 1
  out_bytes=$((m * HIDDEN * 2))
  for transport in grpc shm; do
    extra=()
    [[ $transport == shm ]] && extra=(--shared-memory system --output-shared-memory-size $out_bytes)
    csv=$OUT/pa_m${m}_$transport.csv
    timeout 300 "$PA/bin/perf_analyzer" -m "$MODEL" -u 127.0.0.1:$PORT -i grpc \
      --input-data "$OUT/input_m$m.json" --concurrency-range "$CONCURRENCY" \
      --measurement-interval "$INTERVAL_MS" --stability-percentage "${STABILITY:-20}" -f "$csv" "${extra[@]}" \
      > "$OUT/pa_m${m}_$transport.log" 2>&1
    rc=$?
    if [[ $rc -ne 0 ]]; then
      ROWS+=("M=$m $transport: perf_analyzer exited $rc: $(grep -m1 -iE 'error|fail' "$OUT/pa_m${m}_$transport.log")")
      continue
    fi
    while read -r line; do ROWS+=("$line"); done < <(python3 - "$csv" "$m" "$transport" <<'PY'
import csv, sys
path, m, transport = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for r in csv.DictReader(open(path)):
    ips = float(r["Inferences/Second"])
    print(f"M={m:<4} {transport:<4} conc={r['Concurrency']:<2} {ips:9.1f} infer/s "
          f"{ips * m:10.1f} tok/s  p50 {float(r['p50 latency']):8.0f} us  "
          f"p99 {float(r['p99 latency']):8.0f} us")
PY
)
  done
done
"$MOESERVE_CLI" health --target=127.0.0.1:$PORT
printf '%s\n' "${ROWS[@]}" | tee "$OUT/summary.txt"
