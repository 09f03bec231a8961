OUT=/tmp/tile_out
ls $OUT; mkdir -p ${FINAL:-/tmp/x}
python3 - "$OUT/tile.csv" "$OUT/py.log" <<'PY'
import sys, collections, statistics
t = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    t[(f[1], int(f[3]), f[4], f[0])].append(float(f[5]))
torch = {}
for line in open(sys.argv[2]):
    if line.startswith("{'layer'"):
        r = eval(line, {"nan": float("nan")})
        torch[(r["layer"], r["tokens"], r["routing"])] = r["torch"]
print("layer tokens routing | tile128 us | tile64 us | 64/128 | torch us | torch/best")
for k in sorted({k[:3] for k in t}):
    a = statistics.median(t[k + ("128",)]); b = statistics.median(t[k + ("64",)])
    tt = torch.get(k, float("nan"))
    print(*k, "|", f"{a:.0f} | {b:.0f} | {b/a:.3f} | {tt:.0f} | {tt/min(a,b):.2f}")
PY
