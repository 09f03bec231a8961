#!/usr/bin/env python3
"""Per-call cost of the Python clients against the C++ client, on the same server and path.

For each M it times, one call at a time (closed loop, concurrency 1), median of --calls calls:
  cli     moeserve-cli load (C++: requests prebuilt, answer not copied): the floor
  raw     grpcio's own blocking call with a prebuilt request, answer not decoded: the Python
          floor (what no Python client can go below)
  torch   TorchMoeClient.forward (moeserve_client.torch_client): tensors in, tensor out; its
          gRPC calls by the C++ client (moeserve_client.native) when the library is found
          ($MOESERVE_CLIENT_LIB; --native), else by grpcio
  grpcio  (when torch used the C++ client) the same torch client with native=False
  nraw    (when torch used the C++ client) moeserve_client.native's blocking call with the
          tensors' addresses prepared once: the C++ client from Python without the torch
          client's own work (nraw - cli: the process and the foreign call; torch - nraw: the
          torch client's Python)
  numpy   MoeClient.forward: numpy in, numpy out (by the C++ client when its library is found)
  np_grpcio (when numpy used the C++ client) the same numpy client with native=False
  routed  (--server-routing) TorchMoeClient.forward(hidden) without ids and weights: the server
          runs the layer's gate; routed - torch is what server-side routing costs per call
and prints the medians and torch - cli (the torch client's added cost per call; issue 11's
target: <= 30 us). Rounds alternate between the clients so that drift hits all of them alike.

  # a server of trivial experts at the issue's hidden size (the CPU backend works too):
  build/bin/moeserve --model tiny --hidden 7168 --intermediate 64 --listen 127.0.0.1:50051 &
  clients/python/examples/bench_client.py --target 127.0.0.1:50051 --cli build/bin/moeserve-cli
  # or let the script start one (--server BIN, extra flags after --server-args):
  clients/python/examples/bench_client.py --server build/bin/moeserve --cli build/bin/moeserve-cli

--device cuda sends CUDA tensors (bytes path, or the CUDA-region path with --shared-memory auto
and a server started with --enable_shared_memory on the same host).
--channel sends the torch client's calls through a forward channel (moeserve_client.channel;
the server needs --enable_shared_memory) and the C++ floor through `moeserve-cli load
--channel`; with --shared-memory auto too, tensors go by regions (CPU tensors: a system region,
and the C++ floor `load --shm`) and the channel carries a few hundred bytes per call. The
columns then compare the two clients on that path ("raw" stays a gRPC call).
--zero-copy makes the torch loop's inputs once in regions of the client (alloc_hidden /
alloc_routing, on --device) and reads each answer in place (forward(out="region")), as
`moeserve-cli load --shm/--cuda_region` writes its region once (added to the C++ floor's flags).
--profile M runs the torch client's loop for that M once more under cProfile and prints the
functions taking the most time (by cumulative, then by own time) to stderr; the time inside
torch and CUDA calls shows as the builtin methods that made them (synchronize, copy_, ...).
Progress goes to stderr (one line per client and M), so that a run cut short by a time limit
shows where it was.
"""

import argparse
import cProfile
import io
import os
import pstats
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time

try:
    import moeserve_client  # noqa: F401
except ImportError:  # not pip-installed: use the source tree next to this script
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np
import torch

import moeserve_client as mc
from moeserve_client.torch_client import TorchMoeClient


def start_server(binary, extra):
    tmp = tempfile.mkdtemp(prefix="moeserve_bench_")
    ready = os.path.join(tmp, "ready")
    cmd = [binary, "--listen", "127.0.0.1:0", "--metrics_address", "127.0.0.1:0",
           "--ready_file", ready] + extra
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            with open(ready) as f:
                lines = f.read().splitlines()
            if len(lines) >= 2:
                target = lines[0].strip()
                with mc.MoeClient(target) as c:
                    if c.health() == "SERVING":
                        return proc, target
        except (OSError, Exception):  # not ready yet
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server not ready after 120 s")


CLI_EXTRA = []  # load flags for the path being measured (--channel, --shm, --cuda_region)


def progress(msg):
    print(f"# [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cli_run(cli, target, m, calls, dtype, layer):
    """(p50 latency ms, CPU seconds the process used) of one moeserve-cli load run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([cli, "load", f"--target={target}", f"--requests={calls}",
                          "--concurrency=1", f"--tokens={m}", f"--dtype={dtype}",
                          f"--layer={layer}", "--return_timings=false", "--distinct_inputs=1"]
                         + CLI_EXTRA, capture_output=True, text=True, check=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return float(re.search(r"latency_ms: p50=([0-9.]+)", out).group(1)), cpu


def cli_cpu_us_per_call(cli, target, m, calls, dtype, layer):
    """The C++ client's CPU per call: two runs of different lengths, so that process start,
    GetModelInfo and building the request cancel out."""
    short = max(5, calls // 5)
    _, cpu_short = cli_run(cli, target, m, short, dtype, layer)
    _, cpu_long = cli_run(cli, target, m, calls, dtype, layer)
    return (cpu_long - cpu_short) / (calls - short) * 1e6


def time_calls(fn, calls):
    """Wall ms per call, and the process's CPU us per call (all its threads: gRPC's too)."""
    samples = []
    cpu0 = time.process_time()
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples, (time.process_time() - cpu0) / calls * 1e6


def profile_torch(fn, calls, m):
    """`calls` calls of fn under cProfile; the top functions to stderr."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    for key, top in (("cumulative", 25), ("tottime", 15)):
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats(key).print_stats(top)
        print(f"# profile: torch client, M={m}, {calls} calls, by {key} (times for all calls)",
              file=sys.stderr)
        print(text.getvalue(), file=sys.stderr, flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--server", help="start this moeserve binary (trivial experts, H=7168)")
    p.add_argument("--server-args", nargs=argparse.REMAINDER,
                   default=["--model", "tiny", "--hidden", "7168", "--intermediate", "64"])
    p.add_argument("--cli", help="moeserve-cli, for the C++ floor (omit to skip it)")
    p.add_argument("--tokens", default="1,16,64,256,1024")
    p.add_argument("--calls", type=int, default=200, help="calls per client and M (fewer at "
                   "M >= 256: calls * 64 / M, at least 30)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shared-memory", default="off",
                   choices=["off", "auto", "cuda", "system"])
    p.add_argument("--channel", action="store_true",
                   help="calls through a forward channel (torch client and C++ floor)")
    p.add_argument("--spin-us", type=int, default=5000,
                   help="the torch client's channel spin before it sleeps on the slot (default: "
                   "the C++ client's 5 ms, so that both wait alike; the torch client's own "
                   "default is 200 us)")
    p.add_argument("--no-numpy", action="store_true", help="skip the numpy client")
    p.add_argument("--server-routing", action="store_true",
                   help="also time calls that leave the routing to the server")
    p.add_argument("--copy-threads", type=int, default=None,
                   help="the torch client's copy_threads (default: its own choice)")
    p.add_argument("--zero-copy", action="store_true",
                   help="torch loop: inputs made once in regions of the client, answers read "
                   "in place (no copies per call)")
    p.add_argument("--native", default="auto", choices=["auto", "on", "off"],
                   help="the torch client's gRPC calls by the C++ client (libmoeserve_client_c, "
                   "$MOESERVE_CLIENT_LIB): auto = when found")
    p.add_argument("--native-spin-us", type=int, default=0,
                   help="the torch client's native_spin_us (its C++ client polls that long)")
    p.add_argument("--profile", type=int, metavar="M",
                   help="profile the torch client's loop at this M (cProfile, to stderr)")
    a = p.parse_args()
    proc = None
    if a.server:
        proc, a.target = start_server(a.server, a.server_args)
    if not a.target:
        p.error("give --target or --server")
    if a.channel:
        CLI_EXTRA.append("--channel")
    if a.native_spin_us > 0:  # the C++ floor polls alike
        CLI_EXTRA.append(f"--client_spin_us={a.native_spin_us}")
    if a.shared_memory != "off" or a.zero_copy:
        CLI_EXTRA.append("--cuda_region" if a.device == "cuda" else "--shm")
    try:
        native = {"auto": "auto", "on": True, "off": False}[a.native]
        client = TorchMoeClient(a.target, shared_memory=a.shared_memory,
                                channel=True if a.channel else False, spin_us=a.spin_us,
                                copy_threads=a.copy_threads, native=native,
                                native_spin_us=a.native_spin_us)
        # grpcio's own call ("raw") and the torch client over grpcio, beside the native one.
        gclient = client
        if client.uses_native:
            gclient = TorchMoeClient(a.target, shared_memory=a.shared_memory,
                                     channel=True if a.channel else False, spin_us=a.spin_us,
                                     copy_threads=a.copy_threads, native=False)
        # (Zero copy: the inputs live in the native client's regions, which grpcio's twin does
        # not know: no grpcio column then.)
        grpcio_col = gclient is not client and not a.zero_copy
        way = "C++ client (native)" if client.uses_native else "grpcio"
        print(f"# torch client gRPC calls: {way}"
              f"{'' if client.native_error is None else f' ({client.native_error})'}")
        npc = mc.MoeClient(a.target)
        # The numpy client on the C++ client, and on grpcio beside it (np_grpcio_ms).
        npg = mc.MoeClient(a.target, native=False) if npc.uses_native else None
        print(f"# numpy client Forward calls: "
              f"{'C++ client (native)' if npc.uses_native else 'grpcio'}")
        info = client.info()
        h, e, k = info.hidden, info.num_experts, info.topk
        print(f"# server {a.target}: {info.model_name} hidden={h} experts={e} topk={k} "
              f"intermediate={info.intermediate} backend={info.backend}; device={a.device} "
              f"shared_memory={a.shared_memory} channel={a.channel} zero_copy={a.zero_copy}; torch {torch.__version__}; "
              f"cli flags {' '.join(CLI_EXTRA) or '-'}")
        print("# wall: per-call medians (ms); cpu: the client process's CPU per call (us), "
              "which a busy machine disturbs far less")
        print(f"{'M':>6} {'cli_ms':>8} {'raw_ms':>8} {'torch_ms':>8} {'numpy_ms':>8} "
              f"{'torch-cli_us':>12} {'torch-raw_us':>12} {'cli_cpu':>8} {'raw_cpu':>8} "
              f"{'torch_cpu':>9} {'numpy_cpu':>9} {'MB_each_way':>11}"
              + (f" {'routed_ms':>9}" if a.server_routing else "")
              + (f" {'grpcio_ms':>9} {'nraw_ms':>8}" if grpcio_col else "")
              + (f" {'np_grpcio_ms':>12}" if npg is not None and not a.no_numpy else ""))
        for m in (int(t) for t in a.tokens.split(",")):
            calls = a.calls if m < 256 else max(30, a.calls * 64 // m)
            g = torch.Generator().manual_seed(m)
            x = torch.randn(m, h, generator=g).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).int()
            w = torch.softmax(torch.randn(m, k, generator=g), dim=1)
            xd, idsd, wd = x.to(a.device), ids.to(a.device), w.to(a.device)
            out = torch.empty_like(xd)
            if a.zero_copy:
                xd = client.alloc_hidden(m, dtype=torch.bfloat16, device=a.device)
                idsd, wd = client.alloc_routing(m, topk=k, device=a.device)
                xd.copy_(x)
                idsd.copy_(ids)
                wd.copy_(w)
                out = "region"
            xn = mc.from_float32(x.float().numpy(), "bf16")
            idn, wn = ids.numpy(), w.numpy()
            progress(f"M={m}: warm-up")
            for _ in range(5):  # warm up the Python paths
                client.forward(xd, idsd, wd, layer=a.layer, out=out)
                if grpcio_col:
                    gclient.forward(xd, idsd, wd, layer=a.layer, out=out)
                if not a.no_numpy:
                    npc.forward(xn, idn, wn, layer=a.layer, dtype="bf16")
                    if npg is not None:
                        npg.forward(xn, idn, wn, layer=a.layer, dtype="bf16")
            probe = client.submit(xd, idsd, wd, layer=a.layer, out=out)
            client.result(probe)
            print(f"# M={m}: torch call used_channel={probe.used_channel} "
                  f"used_region={probe.used_region} zero_copy={probe.zero_copy} (channel error: {client.channel_error}; "
                  f"region errors: {client.region_errors or '-'})")
            per = max(1, calls // a.rounds)
            t_cli, t_raw, t_torch, t_np, t_routed, t_grpcio, t_nraw = [], [], [], [], [], [], []
            t_npg = []
            xc = x.contiguous()
            nraw_out = torch.empty_like(xc)
            nraw_args = (a.layer, 1, m, h, xc.data_ptr(), 4, k, ids.data_ptr(), w.data_ptr(),
                         nraw_out.data_ptr(), nraw_out.nbytes)  # BF16, INT32 ids
            c_cli, c_raw, c_torch, c_np = [], [], [], []
            slept = 0
            prebuilt = b"".join(gclient._prepare(x, ids, w, a.layer, "", False, False)[1])
            nan = float("nan")
            for rnd in range(a.rounds):
                progress(f"M={m} round {rnd}: cli")
                if a.cli:
                    t_cli.append(cli_run(a.cli, a.target, m, per, "bf16", a.layer)[0])
                    c_cli.append(cli_cpu_us_per_call(a.cli, a.target, m, per, "bf16", a.layer))
                progress(f"M={m} round {rnd}: raw")
                t, c = time_calls(lambda: gclient._forward(prebuilt), per)
                t_raw += t
                c_raw.append(c)
                progress(f"M={m} round {rnd}: torch")
                sleeps0 = client.channel.sleeps if client.channel is not None else 0
                t, c = time_calls(lambda: client.forward(xd, idsd, wd, layer=a.layer, out=out),
                                  per)
                t_torch += t
                c_torch.append(c)
                if client.channel is not None:
                    slept += client.channel.sleeps - sleeps0
                if grpcio_col:
                    progress(f"M={m} round {rnd}: torch over grpcio")
                    t_grpcio += time_calls(
                        lambda: gclient.forward(xd, idsd, wd, layer=a.layer, out=out), per)[0]
                    progress(f"M={m} round {rnd}: native raw")
                    t_nraw += time_calls(lambda: client._native.forward(*nraw_args), per)[0]
                if a.server_routing:
                    t_routed += time_calls(lambda: client.forward(xd, layer=a.layer, out=out),
                                           per)[0]
                if not a.no_numpy:
                    progress(f"M={m} round {rnd}: numpy")
                    t, c = time_calls(lambda: npc.forward(xn, idn, wn, layer=a.layer,
                                                          dtype="bf16"), per)
                    t_np += t
                    c_np.append(c)
                    if npg is not None:
                        progress(f"M={m} round {rnd}: numpy over grpcio")
                        t_npg += time_calls(lambda: npg.forward(xn, idn, wn, layer=a.layer,
                                                                dtype="bf16"), per)[0]
            med = lambda v: statistics.median(v) if v else nan  # noqa: E731
            cli_ms, raw_ms, torch_ms, np_ms = med(t_cli), med(t_raw), med(t_torch), med(t_np)
            print(f"{m:>6} {cli_ms:>8.3f} {raw_ms:>8.3f} {torch_ms:>8.3f} {np_ms:>8.3f} "
                  f"{(torch_ms - cli_ms) * 1e3:>12.1f} {(torch_ms - raw_ms) * 1e3:>12.1f} "
                  f"{med(c_cli):>8.0f} {med(c_raw):>8.0f} {med(c_torch):>9.0f} "
                  f"{med(c_np):>9.0f} {m * h * 2 / 1e6:>11.2f}"
                  + (f" {med(t_routed):>9.3f}" if a.server_routing else "")
                  + (f" {med(t_grpcio):>9.3f} {med(t_nraw):>8.3f}" if grpcio_col
                     else "")
                  + (f" {med(t_npg):>12.3f}" if npg is not None and not a.no_numpy else ""),
                  flush=True)
            if a.channel:
                print(f"# M={m}: torch calls that slept on the channel (answer after the "
                      f"{a.spin_us} us spin): {slept} of {per * a.rounds}", flush=True)
            if a.profile == m:
                profile_torch(lambda: client.forward(xd, idsd, wd, layer=a.layer, out=out),
                              per, m)
            if a.zero_copy:
                client.release(xd)
                client.release(idsd)
        client.close()
        if gclient is not client:
            gclient.close()
        npc.close()
        if npg is not None:
            npg.close()
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
