#!/usr/bin/env python3
"""Per-call cost of the C++ client called from Python (moeserve_client.native, by ctypes), in
a process set up as VARIANT, to find what a Python process adds to the same C++ calls:

  bare    only ctypes + numpy (grpc not imported: a stand-in module for the exception base)
  grpc    grpcio imported, no channel
  chan    a grpcio channel to the server, used once
  torch   torch imported (and grpcio, as the torch client does)
  spin    bare, the C++ client polling 2000 us for its answer
  busy    chan, after 2000 Forward calls through grpcio (as bench_client.py makes before its
          native rounds)

  native_loop.py TARGET VARIANT [CALLS]   (MOESERVE_CLIENT_LIB names the library)
Prints: VARIANT p50_us mean_us cpu_us (per call; CPU of the whole process).
"""

import importlib
import os
import sys
import time
import types

target, variant = sys.argv[1], sys.argv[2]
calls = int(sys.argv[3]) if len(sys.argv) > 3 else 3000
here = os.path.dirname(os.path.abspath(__file__))
if variant in ("grpc", "chan", "torch", "busy"):
    import grpc
if variant == "torch":
    import torch  # noqa: F401
if variant in ("chan", "busy"):
    ch = grpc.insecure_channel(target)
    grpc.channel_ready_future(ch).result(timeout=30)
    ch.unary_unary("/moeserve.v1.MoeService/GetModelInfo")(b"")
if variant in ("bare", "spin"):
    fake = types.ModuleType("grpc")
    fake.RpcError = Exception
    fake.StatusCode = []
    sys.modules["grpc"] = fake
# The package without its __init__, which needs the generated stubs (not on the device).
pkg = types.ModuleType("moeserve_client")
pkg.__path__ = [os.path.join(here, "..", "..", "..", "clients", "python", "moeserve_client")]
sys.modules["moeserve_client"] = pkg
native = importlib.import_module("moeserve_client.native")

import numpy as np  # noqa: E402

h, m = 7168, int(os.environ.get("M", "1"))
x = np.random.default_rng(0).standard_normal((m, h)).astype(np.float16)
ids = np.array([[(t * 5 + j * 3) % 16 for j in range(4)] for t in range(m)], np.int32)
w = np.full((m, 4), 0.25, np.float32)
out = np.empty_like(x)
n = native.NativeClient(target, spin_us=2000 if variant == "spin" else 0)
args = (0, 2, m, h, x.ctypes.data, 4, 4, ids.ctypes.data, w.ctypes.data, out.ctypes.data,
        out.nbytes)
if variant == "busy":
    wire = importlib.import_module("moeserve_client.wire")
    req = b"".join(wire.forward_request(0, (2, (m, h), x.tobytes()), (4, (m, 4), ids.tobytes()),
                                        (3, (m, 4), w.tobytes())))
    call = ch.unary_unary("/moeserve.v1.MoeService/Forward")
    for _ in range(2000):
        call(req)
for _ in range(200):
    n.forward(*args)
samples = []
t0, c0 = time.perf_counter(), time.process_time()
for _ in range(calls):
    a = time.perf_counter()
    n.forward(*args)
    samples.append(time.perf_counter() - a)
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
samples.sort()
print(f"{variant} {samples[calls // 2] * 1e6:.0f} {wall / calls * 1e6:.0f} {cpu / calls * 1e6:.0f}")
