#!/usr/bin/env python3
"""Writes a perf_analyzer --input-data JSON file for a moeserve KServe model: `steps` requests of
`tokens` tokens with random hidden_states (BF16, FP16 or FP32), valid random topk_ids (INT32,
distinct experts per token) and topk_weights (FP32, normalized), as base64 raw bytes ("b64"), so
the datatype perf_analyzer sends is the one ModelMetadata/ModelConfig declares (BF16 by default).
numpy only.

Usage: perf_analyzer_input.py OUT.json --hidden H --topk K --experts E [--tokens 16] [--steps 8]
       [--dtype BF16] [--seed N]
"""
import argparse
import base64
import json
import os

import numpy as np


def bf16_bytes(x):
    """float32 -> bfloat16 bits, round to nearest even."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16).tobytes()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--topk", type=int, required=True)
    p.add_argument("--experts", type=int, required=True)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--dtype", choices=["BF16", "FP16", "FP32"], default="BF16")
    p.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little"))
    a = p.parse_args()
    rng = np.random.default_rng(a.seed)
    b64 = lambda raw: base64.b64encode(raw).decode()  # noqa: E731
    data = []
    for _ in range(a.steps):
        x = rng.standard_normal((a.tokens, a.hidden), dtype=np.float32)
        raw_x = (bf16_bytes(x) if a.dtype == "BF16" else
                 x.astype(np.float16 if a.dtype == "FP16" else np.float32).tobytes())
        ids = np.stack([rng.choice(a.experts, a.topk, replace=False)
                        for _ in range(a.tokens)]).astype(np.int32)
        w = rng.random((a.tokens, a.topk), dtype=np.float32) + 0.05
        w = (w / w.sum(axis=1, keepdims=True)).astype(np.float32)
        data.append({
            "hidden_states": {"b64": b64(raw_x), "shape": [a.tokens, a.hidden]},
            "topk_ids": {"b64": b64(ids.tobytes()), "shape": [a.tokens, a.topk]},
            "topk_weights": {"b64": b64(w.tobytes()), "shape": [a.tokens, a.topk]},
        })
    with open(a.out, "w") as f:
        json.dump({"data": data}, f)


if __name__ == "__main__":
    main()
