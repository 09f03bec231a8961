#!/usr/bin/env bash
# Where a small step's device time goes (issues 11/12: server total at M=1): for each build in
# the bundle (bin/engine_forward_bench[_TAG]), the engine's p50 with graphs for the trivial and
# seed layers at small M, then Nsight Compute's duration of every kernel of one graphed step
# (trivial layer, M=1, and the seed layer, M=1), summed by kernel name.
# Usage: run_step_anatomy.sh BUNDLE.tgz   (a tarball of DIR/{bin,lib}); writes under $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source "$(dirname "$0")/bundle_lib.sh"
unpack_bundle "$1" || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
for bin in "$D"bin/engine_forward_bench*; do
  tag=${bin##*/engine_forward_bench}; tag=${tag#_}; tag=${tag:-new}
  for model in trivial seed; do
    fmt=bf16; [ $model = seed ] && fmt=mxfp8
    echo "== $tag $model ($fmt): tokens,wall_p50,wall_p90,prepare,experts,finalize"
    timeout 120 "$bin" --model $model --weight_format $fmt --tokens 1,4,16,64 --iters 300 | grep -v '^#\|^tokens'
    echo "== $tag $model untimed"
    timeout 120 "$bin" --model $model --weight_format $fmt --tokens 1,16 --iters 300 --timed 0 | grep -v '^#\|^tokens'
  done
  for model in trivial seed; do
    fmt=bf16; [ $model = seed ] && fmt=mxfp8
    # 10 warm-ups + 3 timed forwards; the last step's kernels are the last lines.
    timeout 200 ncu --clock-control none --cache-control none --csv --metrics gpu__time_duration.sum \
      "$bin" --model $model --weight_format $fmt --tokens 1 --iters 3 --timed 0 > "$OUT/ncu_${tag}_$model.csv" 2>&1
    echo "== ncu $tag $model M=1 rc=$?: last 16 kernels (name, us)"
    ncu_last_kernels "$OUT/ncu_${tag}_$model.csv" 16
  done
done
