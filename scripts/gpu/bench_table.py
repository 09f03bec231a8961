#!/usr/bin/env python3
"""Prints one line per bench point from a CSV of moe_experts_bench rows prefixed by a label
and a round (LABEL,ROUND,layer,format,tokens,routing,median_us,...,path): every label's
medians side by side, and with --ratio A B the ratio of B's best to A's best.
Used by run_bench_ab.sh (labels before / after) and run_wgmma_quick.sh (labels = thresholds)."""
import collections
import csv
import sys


def main():
    args = sys.argv[1:]
    ratio = None
    if args[:1] == ["--ratio"]:
        ratio, args = (args[1], args[2]), args[3:]
    t = collections.defaultdict(lambda: collections.defaultdict(list))
    order, labels = [], []
    for row in csv.reader(open(args[0])):
        label, _, layer, fmt, tokens, routing, us = row[:7]
        key = (layer, fmt, int(tokens), routing, row[-1])
        if key not in t:
            order.append(key)
        if label not in labels:
            labels.append(label)
        t[key][label].append(float(us))
    head = "layer fmt   tokens routing   path    | " + " | ".join(f"{x} us" for x in labels)
    print(head + (f" | {ratio[1]}/{ratio[0]}" if ratio else ""))
    for key in order:
        line = f"{key[0]:5} {key[1]:5} {key[2]:5} {key[3]:9} {key[4]:7} | " + " | ".join(
            " ".join(f"{v:7.1f}" for v in t[key].get(x, [])) for x in labels)
        if ratio:
            a, b = t[key].get(ratio[0]), t[key].get(ratio[1])
            line += f" | {min(b) / min(a):.3f}" if a and b else " | n/a"
        print(line)


if __name__ == "__main__":
    main()
