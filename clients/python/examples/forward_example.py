#!/usr/bin/env python3
"""Calls a running moeserve, then checks its answer with a numpy reference built from the
experts' weights (GetExpertWeights: the server needs --enable_get_expert_weights). Prints
relative_l2_error=<value>; exits 1 above tolerance.

  python3 clients/python/examples/forward_example.py --target 127.0.0.1:50051 --dtype bf16
"""

import argparse
import os
import sys

import numpy as np

try:
    import moeserve_client as mc
except ImportError:  # not pip-installed: use the source tree next to this script
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import moeserve_client as mc

DEFAULT_TOLERANCE = {"bf16": 1e-2, "fp16": 1e-2, "fp32": 1e-5}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=None,
                   help="max relative L2 error (default: 1e-2 bf16/fp16, 1e-5 fp32)")
    p.add_argument("--tls_ca", default=None, help="PEM roots: connect over TLS")
    p.add_argument("--tls_cert", default=None, help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls_key", default=None, help="PEM key of --tls_cert")
    p.add_argument("--auth_token_file", default=None,
                   help="file whose first line is the server's bearer token")
    args = p.parse_args()
    tolerance = args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE[args.dtype]

    token = None
    if args.auth_token_file:
        with open(args.auth_token_file) as f:
            token = next(l.strip() for l in f if l.strip() and not l.startswith("#"))
    with mc.MoeClient(args.target, tls_ca_file=args.tls_ca, tls_cert_file=args.tls_cert,
                      tls_key_file=args.tls_key, auth_token=token) as client:
        print("health:", client.health())
        info = client.info()
        print(f"model {info.model_name}: experts={info.num_experts} topk={info.topk} "
              f"hidden={info.hidden} intermediate={info.intermediate} backend={info.backend}")
        x, ids, weights = mc.random_inputs(args.tokens, info.hidden, info.num_experts, info.topk,
                                           seed=args.seed)
        # Encode the input in the requested dtype; BF16 travels as uint16 bit patterns.
        hidden = mc.from_float32(x, args.dtype)
        result = client.forward_full(hidden, ids, weights, layer=args.layer,
                                     dtype=args.dtype, request_id="forward_example")
        out = mc.to_float32(result.output, args.dtype)
        print(f"output {result.output.dtype} {result.output.shape}, "
              f"latency {result.latency_s * 1e3:.2f} ms, server timings {result.timings}")

        experts = {int(e): client.expert_weights(args.layer, int(e)) for e in np.unique(ids)}
        # The reference sees exactly what the server saw: the input after rounding to dtype.
        expected = mc.reference_forward(mc.to_float32(hidden, args.dtype), ids, weights, experts)
    err = mc.relative_l2_error(out, expected)
    print(f"relative_l2_error={err:.6g}")
    if not err <= tolerance:
        print(f"FAILED: relative_l2_error {err:.6g} > tolerance {tolerance:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
