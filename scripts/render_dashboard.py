#!/usr/bin/env python3
"""Renders the Grafana dashboard (deploy/kubernetes/base/grafana/moeserve-dashboard.json) to a
PNG with matplotlib, from real metrics of a local CPU run - no Grafana or Prometheus needed.

  scripts/render_dashboard.py [--build build] [--out docs/grafana-dashboard.png] [--seconds 60]

It starts build/bin/moeserve (CPU, the tiny model on 4 ranks), drives it with moeserve-cli load
in phases (one caller, then several per layer, then a hot expert), scrapes /metrics every second,
and evaluates each panel's PromQL queries over the scrapes with a small evaluator for the subset
the dashboard uses: selectors with =, !=, =~, !~; rate(v[d]) (increase over the window divided
by its duration, without Prometheus's extrapolation); sum [by (labels)]; scalar; histogram_quantile
(Prometheus's linear interpolation within buckets); and / or * between vectors with equal label
sets or a number. $__rate_interval is --rate-window, $pod matches every pod.
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict

# ---------------------------------------------------------------------------------------------
# Prometheus text format and a PromQL subset.

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text):
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        if not m:
            continue
        labels = dict(LABEL.findall(m.group(3) or ""))
        labels["__name__"] = m.group(1)
        labels.setdefault("pod", "moeserve-local")
        try:
            out.append((labels, float(m.group(4))))
        except ValueError:
            pass
    return out


TOKEN = re.compile(r'\s*(?:(?P<num>\d+(?:\.\d+)?(?:e[-+]?\d+)?)|(?P<str>"(?:[^"\\]|\\.)*")|'
                   r'(?P<op>=~|!~|!=|[-+*/(){}\[\],=])|(?P<id>[a-zA-Z_:][a-zA-Z0-9_:]*))')


def tokenize(s):
    pos, toks = 0, []
    s = s.strip()
    while pos < len(s):
        m = TOKEN.match(s, pos)
        if not m or m.end() == pos:
            raise ValueError(f"cannot parse {s[pos:]!r}")
        pos = m.end()
        kind = m.lastgroup
        toks.append((kind, m.group(kind)))
    return toks


def duration_seconds(d):
    return float(d[:-1]) * {"s": 1, "m": 60, "h": 3600}[d[-1]]


class Parser:
    def __init__(self, text):
        self.t = tokenize(text)
        self.i = 0

    def peek(self, v=None):
        if self.i >= len(self.t):
            return None
        return self.t[self.i] if v is None or self.t[self.i][1] == v else None

    def take(self, v=None):
        tok = self.t[self.i]
        if v is not None and tok[1] != v:
            raise ValueError(f"expected {v}, got {tok[1]}")
        self.i += 1
        return tok

    def parse(self):
        e = self.expr()
        if self.i != len(self.t):
            raise ValueError(f"trailing {self.t[self.i:]}")
        return e

    def expr(self):
        e = self.term()
        while self.peek("/") or self.peek("*"):
            op = self.take()[1]
            e = ("binop", op, e, self.term())
        return e

    def labels_list(self):
        self.take("(")
        names = []
        while not self.peek(")"):
            names.append(self.take()[1])
            if self.peek(","):
                self.take(",")
        self.take(")")
        return names

    def term(self):
        kind, v = self.t[self.i]
        if kind == "num":
            self.take()
            return ("num", float(v))
        if v == "(":
            self.take("(")
            e = self.expr()
            self.take(")")
            return e
        if v == "sum":
            self.take()
            by = None
            if self.peek("by"):
                self.take()
                by = self.labels_list()
            self.take("(")
            e = self.expr()
            self.take(")")
            if self.peek("by"):
                self.take()
                by = self.labels_list()
            return ("sum", by, e)
        if v == "rate":
            self.take()
            self.take("(")
            sel = self.selector()
            self.take(")")
            return ("rate", sel)
        if v == "scalar":
            self.take()
            self.take("(")
            e = self.expr()
            self.take(")")
            return ("scalar", e)
        if v == "histogram_quantile":
            self.take()
            self.take("(")
            q = float(self.take()[1])
            self.take(",")
            e = self.expr()
            self.take(")")
            return ("hq", q, e)
        return self.selector()

    def selector(self):
        name = self.take()[1]
        matchers = [("__name__", "=", name)]
        if self.peek("{"):
            self.take("{")
            while not self.peek("}"):
                label = self.take()[1]
                op = self.take()[1]
                value = json.loads(self.take()[1])
                matchers.append((label, op, value))
                if self.peek(","):
                    self.take(",")
            self.take("}")
        window = None
        if self.peek("["):
            self.take("[")
            num = self.take()[1]
            unit = self.take()[1]
            window = duration_seconds(num + unit)
            self.take("]")
        return ("sel", matchers, window)


def matches(labels, matchers):
    for label, op, value in matchers:
        v = labels.get(label, "")
        if op == "=" and v != value or op == "!=" and v == value:
            return False
        if op == "=~" and not re.fullmatch(value, v) or op == "!~" and re.fullmatch(value, v):
            return False
    return True


def key(labels, drop_name=True):
    return tuple(sorted((k, v) for k, v in labels.items() if not (drop_name and k == "__name__")))


def evaluate(node, scrapes, i):
    """Instant vector at scrape i: {label tuple: value}, or a float."""
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind == "sel":
        _, matchers, _ = node
        # The metric name is dropped, as Prometheus does for a binary operation's operands.
        return {key(l): v for l, v in scrapes[i][1] if matches(l, matchers)}
    if kind == "rate":
        _, matchers, window = node[1]
        t_now = scrapes[i][0]
        j = i
        while j > 0 and t_now - scrapes[j - 1][0] <= window + 1e-6:
            j -= 1
        if j == i:
            return {}
        first = {key(l): v for l, v in scrapes[j][1] if matches(l, matchers)}
        out = {}
        for l, v in scrapes[i][1]:
            if matches(l, matchers) and key(l) in first:
                inc = v - first[key(l)]
                if inc < 0:  # counter reset
                    inc = v
                out[key(l)] = inc / (t_now - scrapes[j][0])
        return out
    if kind == "sum":
        _, by, e = node
        v = evaluate(e, scrapes, i)
        out = defaultdict(float)
        for k, val in v.items():
            d = dict(k)
            out[tuple(sorted((n, d.get(n, "")) for n in by)) if by else ()] += val
        return dict(out)
    if kind == "scalar":
        # A one-series vector's value; NaN for none or several (as Prometheus).
        v = evaluate(node[1], scrapes, i)
        if isinstance(v, float):
            return v
        return next(iter(v.values())) if len(v) == 1 else float("nan")
    if kind == "hq":
        _, q, e = node
        v = evaluate(e, scrapes, i)
        groups = defaultdict(list)
        for k, val in v.items():
            d = dict(k)
            le = float("inf") if d["le"] in ("+Inf", "inf") else float(d["le"])
            groups[tuple((n, x) for n, x in k if n != "le")].append((le, val))
        out = {}
        for g, buckets in groups.items():
            buckets.sort()
            total = buckets[-1][1]
            if total <= 0:
                continue
            rank = q * total
            prev_le, prev_c = 0.0, 0.0
            for le, c in buckets:
                if c >= rank:
                    if math.isinf(le):
                        out[g] = prev_le
                    else:
                        out[g] = prev_le + (le - prev_le) * (rank - prev_c) / max(c - prev_c, 1e-12)
                    break
                prev_le, prev_c = le, c
        return out
    if kind == "binop":
        _, op, a, b = node
        va, vb = evaluate(a, scrapes, i), evaluate(b, scrapes, i)
        f = (lambda x, y: x / y if y else float("nan")) if op == "/" else (lambda x, y: x * y)
        if isinstance(va, float) and isinstance(vb, float):
            return f(va, vb)
        if isinstance(vb, float):
            return {k: f(x, vb) for k, x in va.items()}
        if isinstance(va, float):
            return {k: f(va, y) for k, y in vb.items()}
        return {k: f(x, vb[k]) for k, x in va.items() if k in vb}
    raise ValueError(kind)


def legend(fmt, k):
    d = dict(k)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: d.get(m.group(1), ""), fmt) or str(d)


# ---------------------------------------------------------------------------------------------
# A local run.

def run_load(build, seconds, rate_window):
    server = os.path.join(build, "bin", "moeserve")
    cli = os.path.join(build, "bin", "moeserve-cli")
    work = tempfile.mkdtemp(prefix="moeserve-dashboard-")
    ready = os.path.join(work, "ready")
    log = open(os.path.join(work, "server.log"), "wb")
    proc = subprocess.Popen([server, "--listen", "127.0.0.1:0", "--metrics_address", "127.0.0.1:0",
                             "--ready_file", ready, "--model", "tiny", "--ranks", "4",
                             "--threads", "2", "--num_layers", "6",
                             "--debug_load_delay_ms", "300"],
                            stdout=log, stderr=subprocess.STDOUT)
    scrapes = []
    try:
        lines = []
        t0 = time.time()
        metrics_url = None
        # Scrape from the start (the load is visible), the metrics address comes from the log.
        while time.time() - t0 < 120:
            text = open(os.path.join(work, "server.log")).read()
            m = re.search(r"metrics=(\S+:\d+)", text)
            if m and metrics_url is None:
                metrics_url = f"http://{m.group(1)}/metrics"
            if metrics_url:
                scrapes.append((time.time() - t0, parse_metrics(
                    urllib.request.urlopen(metrics_url, timeout=5).read().decode())))
            if os.path.exists(ready):
                lines = open(ready).read().split()
                break
            time.sleep(1)
        if not lines:
            raise RuntimeError("moeserve did not become ready")
        target = lines[0]
        phases = [  # (seconds share, [cli load args per concurrent process])
            (0.25, [["--concurrency=1", "--tokens=16", "--layer=0"]]),
            (0.25, [["--concurrency=4", "--tokens=8", "--layer=0"],
                    ["--concurrency=4", "--tokens=32", "--layer=1"]]),
            (0.25, [["--concurrency=4", "--tokens=64", "--layer=0", "--routing=hot",
                     "--hot_expert=3"], ["--concurrency=2", "--tokens=8", "--layer=1"]]),
            (0.25, [["--concurrency=8", "--tokens=4", "--layer=1"]]),
        ]
        for share, loads in phases:
            d = seconds * share
            procs = [subprocess.Popen([cli, "load", f"--target={target}", "--requests=100000000",
                                       f"--max_seconds={d}"] + a, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL) for a in loads]
            end = time.time() + d
            while time.time() < end:
                scrapes.append((time.time() - t0, parse_metrics(
                    urllib.request.urlopen(metrics_url, timeout=5).read().decode())))
                time.sleep(1)
            for p in procs:
                p.wait(timeout=60)
        for _ in range(int(rate_window) + 2):  # idle tail
            scrapes.append((time.time() - t0, parse_metrics(
                urllib.request.urlopen(metrics_url, timeout=5).read().decode())))
            time.sleep(1)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return scrapes


def render(dashboard, scrapes, out, rate_window):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(20, rows * 0.42 + 1.2), facecolor="#111217")
    fig.suptitle(f"{dashboard['title']} - rendered by scripts/render_dashboard.py from /metrics of "
                 f"a local CPU run (tiny model, 4 ranks); not a Grafana screenshot",
                 color="#d8d9da", fontsize=13, y=0.995)
    units = {"s": "seconds", "reqps": "requests/s", "Bps": "bytes/s", "short": "",
             "percentunit": "fraction"}
    for p in panels:
        g = p["gridPos"]
        ax = fig.add_axes([g["x"] / 24 + 0.035, 1 - (g["y"] + g["h"]) / rows * 0.96 - 0.005,
                           g["w"] / 24 - 0.05, g["h"] / rows * 0.96 - 0.045])
        ax.set_facecolor("#181b1f")
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        ax.tick_params(colors="#9fa7b3", labelsize=8)
        ax.set_title(p["title"], color="#d8d9da", fontsize=10, loc="left")
        ax.grid(color="#2c3235", linewidth=0.5)
        for t in p["targets"]:
            expr = t["expr"].replace("$__rate_interval", f"{int(rate_window)}s").replace(
                "$pod", ".*")
            node = Parser(expr).parse()
            series = defaultdict(lambda: ([], []))
            for i in range(len(scrapes)):
                v = evaluate(node, scrapes, i)
                if isinstance(v, float):
                    v = {(): v}
                for k, val in v.items():
                    if val is not None and not math.isnan(val):
                        series[k][0].append(scrapes[i][0])
                        series[k][1].append(val)
            for k, (xs, ys) in sorted(series.items()):
                ax.plot(xs, ys, linewidth=1.2, label=legend(t.get("legendFormat", ""), k))
        ax.set_ylabel(units.get(p["fieldConfig"]["defaults"].get("unit"), ""), color="#9fa7b3",
                      fontsize=8)
        ax.set_xlabel("seconds since start", color="#9fa7b3", fontsize=8)
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize=7, facecolor="#181b1f", edgecolor="#2c3235", labelcolor="#d8d9da",
                      ncol=3, loc="upper left")
    fig.savefig(out, dpi=80, facecolor=fig.get_facecolor())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(here)
    ap.add_argument("--build", default=os.path.join(repo, "build"))
    ap.add_argument("--dashboard",
                    default=os.path.join(repo, "deploy/kubernetes/base/grafana/moeserve-dashboard.json"))
    ap.add_argument("--out", default=os.path.join(repo, "docs", "grafana-dashboard.png"))
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--rate-window", type=float, default=10)
    args = ap.parse_args()
    dashboard = json.load(open(args.dashboard))
    scrapes = run_load(args.build, args.seconds, args.rate_window)
    render(dashboard, scrapes, args.out, args.rate_window)
    print(f"render_dashboard: {len(scrapes)} scrapes -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
