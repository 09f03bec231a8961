#!/usr/bin/env python3
"""Looks for periodic host or driver stalls on a GPU machine, with nothing else running.

Two loops for SECONDS (default 12), run as two processes at once (no GIL between them): a CPU loop that only reads the clock (gaps over
1 ms are the host descheduling it), and a CUDA loop of one tiny kernel + synchronize (latencies
over 1 ms are the driver or the GPU holding it). Prints, per loop, the count and the times
(seconds from the start) of the slow iterations, and the slowest per second.
Usage: stall_probe.py cpu|gpu [SECONDS]   (run both: `stall_probe.py cpu & stall_probe.py gpu`)
"""
import sys, time


MODE = sys.argv[1] if len(sys.argv) > 1 else "gpu"
SECONDS = float(sys.argv[2]) if len(sys.argv) > 2 else 12.0


def report(name, events, start):
    by_second = {}
    for t, gap in events:
        s = int(t - start)
        by_second[s] = max(by_second.get(s, 0.0), gap)
    slow = [(round(t - start, 3), round(gap * 1e3, 2)) for t, gap in events if gap > 1e-3]
    print(f"{name}: iterations={len(events)} over 1 ms={len(slow)}; worst per second (ms): "
          + " ".join(f"s{s}={by_second[s] * 1e3:.2f}" for s in sorted(by_second)))
    print(f"{name}: slow at (s, ms): {slow[:60]}")


def cpu_loop(start, out):
    prev = time.perf_counter()
    while prev - start < SECONDS:
        now = time.perf_counter()
        out.append((now, now - prev))
        prev = now


def main():
    if MODE == "cpu":
        start = time.perf_counter()
        cpu = []
        cpu_loop(start, cpu)
        # The list is long: keep only the gaps that matter for the per-second worst.
        report("cpu", [(t, g) for t, g in cpu if g > 2e-4] or cpu[:1], start)
        return
    import torch
    x = torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    gpu = []
    while time.perf_counter() - start < SECONDS:
        t0 = time.perf_counter()
        x.add_(1)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        gpu.append((t1, t1 - t0))
        time.sleep(0.0002)
    report("gpu", gpu, start)


if __name__ == "__main__":
    main()
