#!/usr/bin/env python3
"""Runs moeserve's CUDA expert-MLP benchmark and PyTorch's grouped-GEMM MLPs on the same shapes,
measures the device's ceilings, and prints one combined table (last), a markdown copy and a plot.

Usage (on the GPU machine): bench_moe.py BENCH_BINARY OUT_DIR [BASELINE_BENCH_BINARY]
With a baseline binary (an earlier build of the same benchmark), its times are measured in the
same run and shown as a "before us" column (matched on layer, format, tokens, routing and path;
a baseline without a path column is the decode path). Rows: one per path the binary measured
(decode: the decode kernels; grouped: the sm_90a grouped GEMM, see moe_experts_bench.cu); the
PyTorch peer is measured once per shape and shown on each. MOESERVE_BENCH_TOKENS /
MOESERVE_BENCH_FORMATS / MOESERVE_BENCH_ROUTING (comma lists; routings balanced, hot and
random, default balanced,hot) restrict both. Last, the measured crossover: per layer,
format and routing, the fewest tokens from which the grouped path was faster at every measured
size.
PyTorch peers, same routing and shapes, weights resident, tokens already grouped by expert
(grouping padded to 16 rows per expert, as these kernels need):
  bf16:  torch._grouped_mm (W13) -> silu(gate)*up -> torch._grouped_mm (W2)
  mxfp8: FP8 rowwise: x and the intermediate quantized per row (in the timed region),
         torch._scaled_grouped_mm with per-output-row weight scales, both GEMMs.
"""
import csv, io, os, statistics, subprocess, sys

import torch

E, TOPK = 32, 8
# MOESERVE_PEER_PERMUTE=1: the BF16 peer also gathers each expert's rows from the tokens
# (index_select) and adds the weighted outputs back per token (index_add_ in FP32), as
# moeserve's grouped path does (its align, gather and unpermute are timed).
PEER_PERMUTE = os.environ.get("MOESERVE_PEER_PERMUTE") == "1"
SHAPES = {"seed": (3072, 5120), "dsv3": (7168, 2048)}
TOKENS = [16, 32, 64, 128, 256, 1024]
ROUTINGS = ("balanced", "hot", "random")  # moe_experts_bench.cu's order (it seeds by index)


def timed(fn, sets, warm=5, iters=40):
    ts = []
    for it in range(warm + iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(sets[it % len(sets)])
        e.record()
        e.synchronize()
        if it >= warm:
            ts.append(s.elapsed_time(e) * 1000.0)
    return statistics.median(ts)


def floor_bandwidth(dev, copy_bw):
    """Bytes/s the HBM floor assumes: 4.3 TB/s on an H200 (its copies measure 4.13-4.21, so
    every earlier H200 table stays comparable), elsewhere (H100: 3.35 TB/s peak) the copy
    bandwidth measured in this run. MOESERVE_FLOOR_TBS overrides both."""
    if os.environ.get("MOESERVE_FLOOR_TBS"):
        return float(os.environ["MOESERVE_FLOOR_TBS"]) * 1e12
    return max(4.3e12, copy_bw) if "H200" in dev else copy_bw


def ceilings():
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = timed(lambda _: b.copy_(a), [0], warm=3, iters=10)
    copy_bw = 2 * a.numel() / (t * 1e-6)
    del a, b
    n = 8192
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = timed(lambda _: x @ y, [0], warm=3, iters=10)
    return copy_bw, 2 * n**3 / (t * 1e-6)


def routing(tokens, mode, k, gen):
    """mode: balanced (every expert the same count), hot (expert 0 in every token) or random
    (top-k drawn uniformly without repeats), as moe_experts_bench.cu routes."""
    ids = torch.empty(tokens, TOPK, dtype=torch.int64)
    for t in range(tokens):
        if mode == "balanced":
            for j in range(TOPK):
                ids[t, j] = ((t * 8 + j) * 73 + 19 + k) % E
        elif mode == "random":
            ids[t] = torch.randperm(E, generator=gen)[:TOPK]
        else:
            ids[t, 0] = 0
            ids[t, 1:] = 1 + torch.randperm(E - 1, generator=gen)[: TOPK - 1]
    counts = torch.bincount(ids.flatten(), minlength=E)
    padded = ((counts + 15) // 16) * 16
    # The permutation a frontend would run around the peer (PEER_PERMUTE): each grouped row's
    # token (padding rows: token 0, weight 0) and its top-k weight (1/TOPK here).
    src, wts = [], []
    for e in range(E):
        toks = (ids == e).any(dim=1).nonzero().flatten().tolist()
        pad = int(padded[e]) - len(toks)
        src += toks + [0] * pad
        wts += [1.0 / TOPK] * len(toks) + [0.0] * pad
    routing.last = (torch.tensor(src, dtype=torch.int64), torch.tensor(wts))
    return int(padded.sum()), torch.cumsum(padded, 0).to(torch.int32)


def torch_mlp(h, i, fmt, tokens, mode):
    w13 = (torch.randn(E, 2 * i, h, device="cuda") / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, h, i, device="cuda") / i**0.5).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(tokens * 7 + ROUTINGS.index(mode))
    sets = []
    for k in range(4):
        rows, offs = routing(tokens, mode, k, gen)
        src, wts = routing.last
        sets.append((torch.randn(rows, h, device="cuda", dtype=torch.bfloat16), offs.cuda(),
                     torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16), src.cuda(),
                     wts.cuda()))
    if fmt == "bf16" and PEER_PERMUTE:
        w13t, w2t = w13.transpose(-2, -1), w2.transpose(-2, -1)

        def fn(s):  # the same work as moeserve's grouped path: gather, MLP, weighted scatter-add
            _, offs, xt, src, wts = s
            x = xt.index_select(0, src)
            g = torch._grouped_mm(x, w13t, offs=offs)
            a = torch.nn.functional.silu(g[:, :i]) * g[:, i:]
            y = torch._grouped_mm(a, w2t, offs=offs)
            out = torch.zeros(xt.shape, device="cuda", dtype=torch.float32)
            return out.index_add_(0, src, y.float() * wts[:, None])
    elif fmt == "bf16":
        w13t, w2t = w13.transpose(-2, -1), w2.transpose(-2, -1)

        def fn(s):
            x, offs = s[0], s[1]
            g = torch._grouped_mm(x, w13t, offs=offs)
            a = torch.nn.functional.silu(g[:, :i]) * g[:, i:]
            return torch._grouped_mm(a, w2t, offs=offs)
    else:
        f8 = torch.float8_e4m3fn

        def q_rows(t):  # per-row scale, t [..., K]
            s = t.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
            return (t.float() / s).to(f8), s.squeeze(-1)

        w13q, w13s = q_rows(w13)
        w2q, w2s = q_rows(w2)
        w13qt, w2qt = w13q.transpose(-2, -1), w2q.transpose(-2, -1)
        del w13, w2

        def fn(s):
            x, offs = s[0], s[1]
            xq, xs = q_rows(x)
            g = torch._scaled_grouped_mm(xq, w13qt, xs, w13s, offs=offs, out_dtype=torch.bfloat16,
                                         use_fast_accum=True)
            a = torch.nn.functional.silu(g[:, :i]) * g[:, i:]
            aq, as_ = q_rows(a)
            return torch._scaled_grouped_mm(aq, w2qt, as_, w2s, offs=offs,
                                            out_dtype=torch.bfloat16, use_fast_accum=True)
    t = timed(fn, sets)
    torch.cuda.empty_cache()
    return t


def main():
    binary, out_dir = sys.argv[1], sys.argv[2]
    dev = torch.cuda.get_device_name()
    copy_bw, bf16_rate = ceilings()
    hbm = floor_bandwidth(dev, copy_bw)
    print(f"device {dev}; copy {copy_bw/1e12:.2f} TB/s; bf16 matmul {bf16_rate/1e12:.0f} TFLOP/s;"
          f" floor at {hbm/1e12:.2f} TB/s", flush=True)
    before = {}
    if len(sys.argv) > 3:
        for r in csv.DictReader(io.StringIO(subprocess.check_output([sys.argv[3]], text=True))):
            before[(r["layer"], r["format"], r["tokens"], r["routing"],
                    r.get("path") or "decode")] = float(r["median_us"])
    ours = list(csv.DictReader(io.StringIO(subprocess.check_output([binary], text=True))))
    rows = []
    torch_us = {}
    for r in ours:
        h, i = SHAPES[r["layer"]]
        tokens, mode = int(r["tokens"]), r["routing"]
        path = r.get("path") or "decode"
        key = (r["layer"], r["format"], tokens, mode)
        if key not in torch_us:
            try:
                torch_us[key] = torch_mlp(h, i, r["format"], tokens, mode)
            except Exception as ex:  # report, keep going
                print("torch failed:", r, repr(ex)[:300], flush=True)
                torch_us[key] = float("nan")
        tt = torch_us[key]
        us = float(r["median_us"])
        wbytes, routes = int(r["weight_bytes"]), int(r["routes"])
        mem_floor = wbytes / hbm * 1e6
        # W8A8 runs on FP8 tensor cores: twice the BF16 rate (H200 dense: 1979 / 989 TFLOP/s).
        flop_floor = 6 * routes * h * i / (bf16_rate * (2 if path == "w8a8" else 1)) * 1e6
        floor = max(mem_floor, flop_floor)
        rows.append(dict(layer=r["layer"], fmt=r["format"], tokens=tokens, routing=r["routing"],
                         path=path,
                         before=before.get((r["layer"], r["format"], r["tokens"], r["routing"],
                                            path), float("nan")),
                         us=us, tbs=wbytes / (us * 1e-6) / 1e12, floor=floor,
                         pct=100 * floor / us, bound="hbm" if mem_floor >= flop_floor else "mma",
                         torch=tt, ratio=tt / us))
        print(rows[-1], flush=True)
    hdr = ("| layer | weights | tokens/rank | routing | path | before us | moeserve us | "
           "weight TB/s | floor us | % of floor | bound | PyTorch us | PyTorch/moeserve |")
    lines = [hdr, "|" + "---|" * 13]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['fmt']} | {r['tokens']} | {r['routing']} | "
                     f"{r['path']} | {r['before']:.1f} | {r['us']:.1f} | "
                     f"{r['tbs']:.2f} | {r['floor']:.1f} | {r['pct']:.0f}% | {r['bound']} | "
                     f"{r['torch']:.1f} | {r['ratio']:.2f}x |")
    head = (f"device: {dev}; measured copy {copy_bw/1e12:.2f} TB/s, BF16 matmul 8192^3 "
            f"{bf16_rate/1e12:.0f} TFLOP/s; floor = max(weight bytes / {hbm/1e12:.2f} TB/s, "
            f"FLOPs / measured "
            f"BF16 rate). PyTorch peer: bf16 -> torch._grouped_mm MLP"
            f"{' with the gather and the weighted scatter-add' if PEER_PERMUTE else ''}, mxfp8 -> "
            f"torch._scaled_grouped_mm FP8-rowwise MLP.")
    # Crossover: the fewest tokens from which grouped beat decode at every measured size.
    cross = []
    for layer in SHAPES:
        for fmt in ("bf16", "mxfp8"):
            for routing in ROUTINGS:
                t = {}
                for r in rows:
                    if (r["layer"], r["fmt"], r["routing"]) == (layer, fmt, routing):
                        t.setdefault(r["tokens"], {})[r["path"]] = r["us"]
                for other in ("grouped", "w8a8"):
                    both = sorted(k for k, v in t.items() if "decode" in v and other in v)
                    if not both:
                        continue
                    win = None
                    for k in reversed(both):
                        if t[k][other] < t[k]["decode"]:
                            win = k
                        else:
                            break
                    cross.append(f"crossover {layer} {fmt} {routing}: {other} faster from "
                                 f"{win if win is not None else 'no measured size'} tokens/rank "
                                 f"(measured {both})")
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(head + "\n\n" + "\n".join(lines) + "\n\n" + "\n".join(cross) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        for ax, layer in zip(axes, ["seed", "dsv3"]):
            for fmt, c in [("bf16", "tab:blue"), ("mxfp8", "tab:red")]:
                sel = [r for r in rows if r["layer"] == layer and r["fmt"] == fmt
                       and r["routing"] == "balanced" and r["path"] == "decode"]
                x = [r["tokens"] for r in sel]
                ax.plot(x, [r["us"] for r in sel], "o-", color=c, label=f"moeserve {fmt}")
                ax.plot(x, [r["torch"] for r in sel], "s--", color=c, alpha=0.6,
                        label=f"PyTorch {'grouped_mm bf16' if fmt == 'bf16' else 'fp8 rowwise'}")
                ax.plot(x, [r["floor"] for r in sel], ":", color=c, label=f"floor {fmt}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens per rank (top-8, 32 local experts, balanced)")
            ax.set_ylabel("expert MLP time (us)")
            ax.set_title(f"{layer} layer, {dev}")
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "moe_experts_h200.png"), dpi=110)
    except Exception as ex:
        print("plot failed:", ex)
    print(head)
    print("\n".join(lines))
    print("\n".join(cross))


if __name__ == "__main__":
    main()
