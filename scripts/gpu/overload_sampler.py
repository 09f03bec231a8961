#!/usr/bin/env python3
"""Samples a moeserve process while a load runs: every PERIOD s, its RSS, thread count and CPU
seconds (/proc) and a few of its Prometheus series (in-flight requests, queued tokens, host
buffer pool bytes, refused and finished calls). Usage: overload_sampler.py PID METRICS_URL
SECONDS [PERIOD]; prints one line per sample: t_s rss_mb threads cpu_s inflight queued_tokens
pool_mb refused requests; then, for the server and for a running moeserve-cli, the CPU seconds
of each thread between 1 s and 9 s into the run (the busiest threads, and the sums by thread
name)."""
import os
import sys, time, urllib.request

pid, url, seconds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
period = float(sys.argv[4]) if len(sys.argv) > 4 else 0.1
tick = 100.0


def proc():
    rss = threads = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return rss, threads, (int(fields[11]) + int(fields[12])) / tick


def metrics():
    want = {"moeserve_inflight_requests": 0.0, "moeserve_queued_tokens": 0.0,
            "moeserve_host_buffer_pool_bytes": 0.0, "moeserve_forward_refused_total": 0.0,
            "moeserve_requests_total": 0.0}
    try:
        text = urllib.request.urlopen(url, timeout=0.5).read().decode()
    except Exception:
        return None
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in want:
            try:
                want[name] += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return want


def tasks_of(p, with_wchan=False):
    """(tid, name, the stat fields after the name, wchan or None) of each of process p's
    threads (those gone meanwhile are skipped)."""
    try:
        tids = os.listdir(f"/proc/{p}/task")
    except OSError:
        return
    for tid in tids:
        try:
            with open(f"/proc/{p}/task/{tid}/stat") as f:
                text = f.read()
            wchan = None
            if with_wchan:
                with open(f"/proc/{p}/task/{tid}/wchan") as f:
                    wchan = f.read().strip()
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        yield int(tid), name, text.rsplit(")", 1)[1].split(), wchan


def threads_of(p):
    """{tid: (name, cpu_s)} of process p."""
    return {tid: (name, (int(fields[11]) + int(fields[12])) / tick)
            for tid, name, fields, _ in tasks_of(p)}


def client_pid():
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/comm") as f:
                    if f.read().strip() == "moeserve-cli":
                        return int(d)
            except OSError:
                pass
    return None


def report(label, before, after, span):
    delta = []
    for tid, (name, cpu) in after.items():
        delta.append((cpu - before.get(tid, (name, 0.0))[1], tid, name))
    delta.sort(reverse=True)
    total = sum(d[0] for d in delta)
    print(f"# {label}: {total / span:.2f} cores over {span:.1f} s, {len(after)} threads; busiest:")
    for cpu, tid, name in delta[:12]:
        print(f"#   {tid:8d} {name:16s} {cpu / span:5.2f} cores")
    by = {}
    for cpu, tid, name in delta:
        n, c = by.get(name, (0, 0.0))
        by[name] = (n + 1, c + cpu)
    print("#   by name: " + ", ".join(f"{k} x{n} {c / span:.2f}" for k, (n, c) in
                                    sorted(by.items(), key=lambda kv: -kv[1][1])))


def states_of(p):
    """{name: [running, sleeping_on_futex, sleeping_other]} of process p's threads."""
    out = {}
    for _, name, fields, wchan in tasks_of(p, with_wchan=True):
        c = out.setdefault(name.rstrip("0123456789"), [0, 0, 0])
        if fields[0] == "R":
            c[0] += 1
        elif "futex" in wchan:
            c[1] += 1
        else:
            c[2] += 1
    return out


def cgroup_cpu():
    """The cgroup's CPU limit and throttling (cgroup v2), or None."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            limit = f.read().strip()
        stat = {}
        with open("/sys/fs/cgroup/cpu.stat") as f:
            for line in f:
                k, v = line.split()
                stat[k] = int(v)
        return limit, stat
    except OSError:
        return None


def host_cpu():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return v[0] + v[1] + v[2] + v[5] + v[6], v[3] + v[4], v[7]  # busy, idle, steal


STATE_S = float(os.environ.get("STATE_SECONDS", "3"))
state_sums, state_n = {}, 0
cg0 = cgroup_cpu()
host0 = host_cpu()
snap = {}
t0 = time.time()
print("t_s rss_mb threads cpu_s inflight queued_tokens pool_mb refused requests", flush=True)
while time.time() - t0 < seconds:
    try:
        rss, threads, cpu = proc()
    except OSError:
        break
    m = metrics()
    if m is None:
        print(f"{time.time() - t0:.2f} {rss:.0f} {threads} {cpu:.2f} - - - - -", flush=True)
    else:
        print(f"{time.time() - t0:.2f} {rss:.0f} {threads} {cpu:.2f} "
              f"{m['moeserve_inflight_requests']:.0f} {m['moeserve_queued_tokens']:.0f} "
              f"{m['moeserve_host_buffer_pool_bytes'] / 2**20:.0f} "
              f"{m['moeserve_forward_refused_total']:.0f} {m['moeserve_requests_total']:.0f}",
              flush=True)
    el = time.time() - t0
    if el < STATE_S:
        for name, c in states_of(pid).items():
            acc = state_sums.setdefault(name, [0, 0, 0])
            for i in range(3):
                acc[i] += c[i]
        state_n += 1
    if "a" not in snap and el >= 1.0:
        cp = client_pid()
        snap["a"] = (el, threads_of(pid), cp, threads_of(cp) if cp else {})
    if "b" not in snap and el >= 9.0 and "a" in snap:
        cp = snap["a"][2]
        snap["b"] = (el, threads_of(pid), threads_of(cp) if cp else {})
    time.sleep(period)
cg1 = cgroup_cpu()
h = [b - a for a, b in zip(host0, host_cpu())]
tot = max(sum(h), 1)
print(f"# host CPU over the run: busy {100 * h[0] / tot:.0f}%, idle {100 * h[1] / tot:.0f}%, "
      f"steal {100 * h[2] / tot:.1f}%")
if cg0 and cg1:
    d = {k: cg1[1].get(k, 0) - cg0[1].get(k, 0) for k in cg1[1]}
    print(f"# cgroup cpu.max {cg1[0]}; over the run: usage {d.get('usage_usec', 0) / 1e6:.1f} s, "
          f"periods {d.get('nr_periods', 0)}, throttled {d.get('nr_throttled', 0)} "
          f"({d.get('throttled_usec', 0) / 1e3:.0f} ms)")
if state_n:
    print(f"# thread states over the first {STATE_S:.0f} s ({state_n} samples), mean threads "
          "running / on a futex / sleeping otherwise:")
    for name, (r, f_, o) in sorted(state_sums.items(), key=lambda kv: -kv[1][0]):
        print(f"#   {name:16s} {r / state_n:5.2f} {f_ / state_n:5.2f} {o / state_n:5.2f}")
if "a" in snap and "b" in snap:
    span = snap["b"][0] - snap["a"][0]
    report("server", snap["a"][1], snap["b"][1], span)
    if snap["a"][2]:
        report("client", snap["a"][3], snap["b"][2], span)
