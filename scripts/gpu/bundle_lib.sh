# Sourced by the device scripts. unpack_bundle BUNDLE.tgz unpacks a bundle made with
# `tar -C DIR -czf BUNDLE.tgz NAME` (NAME/bin: stripped binaries; NAME/lib: the shared libraries
# that /work/shared/tools/bundle-libs.sh collected for them) into /tmp/sa, then sets D (the
# bundle's folder), B (its bin/) and LD_LIBRARY_PATH (its lib/). With SA_READY set (a script
# called by another that unpacked already) the unpacked copy is reused.
unpack_bundle() {
  if [ -z "${SA_READY:-}" ]; then
    rm -rf /tmp/sa && mkdir -p /tmp/sa && tar -C /tmp/sa -xzf "$1" || return 1
  fi
  D=$(ls -d /tmp/sa/*/ | head -1)
  B=${D}bin
  export LD_LIBRARY_PATH=${D}lib
}

# start_device_script BUNDLE.tgz: makes $OUT (default /tmp/out), unpacks the bundle as above and
# names the GPU.
start_device_script() {
  OUT=${OUT:-/tmp/out}
  mkdir -p "$OUT"
  unpack_bundle "$1" || return 1
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
}

# start_serving_script BUNDLE PORT: start_device_script, then serve_lib.sh's functions with PORT
# set and a silent `row` (a script that prints rows defines its own after this). Run from the
# repository root.
start_serving_script() {
  start_device_script "$1" || return 1
  # shellcheck source=scripts/gpu/serve_lib.sh
  source scripts/gpu/serve_lib.sh
  PORT=$2
  row() { :; }
}

# run_gtest NAME SECONDS [ARGS...]: runs the bundle's test binary NAME into $OUT/NAME.log and
# prints its exit code, gtest's summary lines and the first failures.
run_gtest() {
  local name=$1 seconds=$2
  shift 2
  timeout "$seconds" "$B/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$name.log" | tr '\n' ' ')"
  grep -E -A3 '^\[  FAILED |Failure' "$OUT/$name.log" | head -20
}

# round_order ROUND A B ...: the variants in this order on odd rounds and reversed on even ones,
# so no variant always runs first (warm caches, clocks, the host's drift across a round).
round_order() {
  local round=$1
  shift
  if ((round % 2)); then echo "$@"; else printf '%s\n' "$@" | tac | tr '\n' ' '; fi
}

# gpu_suites FILTER: the bundle's GPU test binaries (cuda_kernels_test, cuda_experts_test or a
# shard of it (EXPERTS_SHARDS), engine_cuda_test), then compute-sanitizer on cuda_kernels_test's
# FILTER with each tool of SANITIZERS (default racecheck), into $OUT/TOOL.log. SKIP_SUITES=1:
# none of it.
gpu_suites() {
  [ -n "${SKIP_SUITES:-}" ] && return 0  # e.g. a second pass of a script in the same call
  run_gtest cuda_kernels_test 200
  # EXPERTS_SHARDS=N: one Nth of cuda_experts_test (gtest's shard 0; the whole suite takes
  # about 3 minutes on an H100), for a call short of device time.
  GTEST_TOTAL_SHARDS=${EXPERTS_SHARDS:-1} GTEST_SHARD_INDEX=0 run_gtest cuda_experts_test 400
  run_gtest engine_cuda_test 300
  local cs tool
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  [ -n "$cs" ] || return 0
  for tool in ${SANITIZERS:-racecheck}; do
    timeout 240 "$cs" --tool "$tool" --error-exitcode 3 "$B/cuda_kernels_test" \
      --gtest_filter="$1" > "$OUT/$tool.log" 2>&1
    echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$OUT/$tool.log" | tr '\n' ' ')"
  done
}

# engine_bench_rows SETTING CSV TOKENS ITERS [PREFIX...]: engine_forward_bench (timed) on the
# trivial layer (BF16) and the seed layer (MXFP8) at TOKENS, run as PREFIX... (e.g. `env VAR=0`
# or a shell function that sets the variant's environment), its rows appended to CSV as
# "SETTING,model,<bench columns>".
engine_bench_rows() {
  local set=$1 csv=$2 tokens=$3 iters=$4 model fmt
  shift 4
  for model in trivial seed; do
    fmt=bf16
    [ $model = seed ] && fmt=mxfp8
    "$@" timeout 120 "$B/engine_forward_bench" --model $model --weight_format $fmt \
      --tokens "$tokens" --iters "$iters" | grep -v '^#\|^tokens' |
      awk -F, -v p="$set" -v m=$model '{print p","m","$0}' >> "$csv"
  done
}

# engine_summary CSV: engine_bench_rows' CSV as medians per (model, tokens, setting): wall p50
# and experts stage p50, us.
engine_summary() {
  python3 - "$1" <<'PY'
import sys, collections, statistics
t = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) < 8: continue
    t[(f[1], int(f[2]), f[0])].append((float(f[3]), float(f[6])))
for k in sorted(t):
    print(f"{k[0]:8s} tokens={k[1]:3d} {k[2]:>7s}: wall {statistics.median(x[0] for x in t[k]):7.1f}"
          f" experts {statistics.median(x[1] for x in t[k]):7.1f}")
PY
}

# decode_bench_env: moe_experts_bench on the decode path: FORMATS (default mxfp8), LAYERS
# (default seed,dsv3), TOKENS, balanced / hot / random routing.
decode_bench_env() {
  export MOESERVE_BENCH_PATHS=decode MOESERVE_BENCH_FORMATS=${FORMATS:-mxfp8} \
    MOESERVE_BENCH_LAYERS=${LAYERS:-seed,dsv3} MOESERVE_BENCH_ROUTING=balanced,hot,random \
    MOESERVE_BENCH_TOKENS=$TOKENS
}

# decode_summary CSV SETTING...: CSV holds moe_experts_bench rows with a setting in front. Prints,
# per (layer, tokens, routing), each setting's median us, its share of the floor (all experts'
# weight bytes over FLOOR_TBS; by default the copy bandwidth measured on this GPU's kind: 3.01
# TB/s on an H100, else 4.3, an H200's) and its ratio to the first setting.
decode_summary() {
  local floor=4.3
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H100 && floor=3.01
  FLOOR_TBS=${FLOOR_TBS:-$floor} python3 - "$@" <<'PY'
import os, sys, collections, statistics
tbs = float(os.environ["FLOOR_TBS"])
sets = sys.argv[2:]
t = collections.defaultdict(list)
floor = {}
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) < 7: continue
    layer = f[1] if f[2] == "mxfp8" else f[1] + "-" + f[2]
    t[(layer, int(f[3]), f[4], f[0])].append(float(f[5]))
    floor[(layer, int(f[3]), f[4])] = float(f[6]) / (tbs * 1e6)  # us
print(f"floor at {tbs} TB/s; layer tokens routing | "
      + " | ".join(f"{s}: us (% floor, /{sets[0]})" for s in sets))
for k in sorted({k[:3] for k in t}):
    base = statistics.median(t[k + (sets[0],)])
    cells = []
    for s in sets:
        b = statistics.median(t[k + (s,)])
        cells.append(f"{b:.0f} ({100 * floor[k] / b:.0f}%, {b / base:.3f})")
    print(*k, "| " + " | ".join(cells))
PY
}

# decode_ab VAR CSV SETTING...: the decode bench (decode_bench_env) once per SETTING with
# VAR=SETTING ("default": VAR unset), settings alternating, ROUNDS rounds (default 2); its rows go
# to CSV with the setting in front, then decode_summary.
decode_ab() {
  local var=$1 csv=$2
  shift 2
  decode_bench_env
  local round set
  for round in $(seq "${ROUNDS:-2}"); do for set in "$@"; do
    if [ "$set" = default ]; then unset "$var"; else export "$var=$set"; fi
    timeout 150 "$B/moe_experts_bench" 2>/dev/null | tail -n +2 |
      awk -F, -v s="$set" '{print s","$0}' >> "$csv"
  done; done
  unset "$var"
  decode_summary "$csv" "$@"
}

# ncu_last_kernels CSV N: the last N kernels of `ncu --csv --metrics gpu__time_duration.sum`'s
# output (us, name). The header is the row that starts with "ID": the profiled program's own CSV
# lines (e.g. engine_forward_bench's table) come before it in the same file.
ncu_last_kernels() {
  python3 - "$1" "$2" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
start = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
hdr, rows = rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]
ki, vi, ui = hdr.index("Kernel Name"), hdr.index("Metric Value"), hdr.index("Metric Unit")
vals = []
for r in rows:
    v = float(r[vi].replace(",", ""))
    # Nsight Compute names the unit "nsecond" or (2025 on) "ns".
    v = v / 1000 if r[ui] in ("nsecond", "ns") else v * 1000 if r[ui] in ("msecond", "ms") else v
    vals.append((r[ki].split("(")[0][:70], v))
for name, v in vals[-int(sys.argv[2]):]:
    print(f"{v:8.2f}  {name}")
PY
}
