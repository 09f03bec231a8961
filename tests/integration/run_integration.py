#!/usr/bin/env python3
"""End-to-end tests: start the real moeserve binary, talk to it with moeserve-cli and the Python
client, check answers against the clients' independent references, then SIGTERM it.

  run_integration.py --server BUILD/bin/moeserve --cli BUILD/bin/moeserve-cli \
      --source-dir REPO --case cli|python|load|ep16|unix|closed|stream|secure|checkpoint|all

closed: the default flags (no expert weights; --check names the flag). stream: experts larger
than the server's message limit, streamed by both clients. secure: mutual TLS and a bearer
token (certificates made with the openssl CLI), on the API and HTTPS metrics.

Each case starts its own server (--model tiny, ports chosen by the kernel), waits (bounded) for
the ready file and health SERVING, runs its checks, and finishes by sending SIGTERM and requiring
exit code 0 within --shutdown-timeout. The server is always killed in a `finally`.

Tolerances (relative L2 error against the references, which compute in FP32/FP64 from the BF16
weights the server reports): BF16 and FP16 inputs 1e-2 (the output is rounded to the 16-bit
dtype: about 2e-3 / 3e-4 seen); FP32 input 1e-5 (the server computes in FP32 from the same BF16
weights, so only summation order differs: about 4e-7 seen).
"""

import argparse
import os
import re
import signal
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

TOL = {"bf16": 1e-2, "fp16": 1e-2, "fp32": 1e-5}
CMD_TIMEOUT_S = 120


class Failure(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Failure(msg)


def log(msg):
    print(f"[integration] {msg}", flush=True)


class Server:
    """The moeserve process; a context manager that always kills it on the way out."""

    def __init__(self, binary, workdir, extra_args=(), startup_timeout=60.0,
                 listen="127.0.0.1:0", metrics_scheme="http"):
        self.binary = binary
        self.listen = listen
        self.workdir = workdir
        self.ready_file = os.path.join(workdir, "ready")
        self.log_path = os.path.join(workdir, "server.log")
        self.extra_args = list(extra_args)
        self.startup_timeout = startup_timeout
        self.proc = None
        self.target = None
        self.metrics = None
        self.metrics_scheme = metrics_scheme

    def __enter__(self):
        cmd = [self.binary, "--listen", self.listen, "--metrics_address", "127.0.0.1:0",
               "--ready_file", self.ready_file, "--model", "tiny"] + self.extra_args
        log("starting " + " ".join(cmd))
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()
        if exc[0] is not None:
            self.dump_log()
        return False

    def dump_log(self):
        try:
            with open(self.log_path, "r", errors="replace") as f:
                lines = f.readlines()
        except OSError:
            return
        print("----- server log (last 60 lines) -----")
        print("".join(lines[-60:]), end="")
        print("----- end of server log -----", flush=True)

    def _read_ready(self):
        try:
            with open(self.ready_file) as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        if len(lines) < 2:
            return None
        m = re.fullmatch(r"metrics (\S+:\d+)", lines[1].strip())
        if not re.fullmatch(r"unix:\S+|\S+:\d+", lines[0].strip()) or not m:
            return None
        return lines[0].strip(), m.group(1)

    def wait_ready(self, cli):
        deadline = time.monotonic() + self.startup_timeout
        ready = None
        while ready is None:
            check(self.proc.poll() is None,
                  f"server exited with {self.proc.returncode} before writing {self.ready_file}")
            check(time.monotonic() < deadline,
                  f"no ready file after {self.startup_timeout:.0f} s")
            time.sleep(0.1)
            ready = self._read_ready()
        self.target = cli.target = ready[0]
        while True:
            check(self.proc.poll() is None, f"server exited with {self.proc.returncode}")
            r = cli.run("health", allow_fail=True, timeout=10)
            if r.returncode == 0 and r.stdout.strip() == "SERVING":
                break
            check(time.monotonic() < deadline,
                  f"not SERVING after {self.startup_timeout:.0f} s: {r.stdout!r} {r.stderr!r}")
            time.sleep(0.2)
        self.target, self.metrics = self._read_ready()  # re-read: certainly complete by now
        cli.target = self.target
        log(f"server SERVING at {self.target}, metrics at {self.metrics}")

    def terminate_and_check(self, timeout):
        log("sending SIGTERM")
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise Failure(f"server still running {timeout:.0f} s after SIGTERM")
        check(rc == 0, f"server exited with {rc} after SIGTERM; expected 0")
        log(f"server exited 0 {time.monotonic() - start:.2f} s after SIGTERM")


class Cli:
    def __init__(self, binary, common_args=()):
        self.binary = binary
        self.target = None
        self.common_args = list(common_args)  # e.g. TLS and token flags for every command

    def run(self, command, *args, allow_fail=False, timeout=CMD_TIMEOUT_S, common=True):
        cmd = ([self.binary, command, f"--target={self.target}"] +
               (self.common_args if common else []) + list(args))
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if not allow_fail and r.returncode != 0:
            raise Failure(f"{' '.join(cmd)} exited {r.returncode}\nstdout:\n{r.stdout}\n"
                          f"stderr:\n{r.stderr}")
        return r


def parse_error(stdout):
    m = re.search(r"^relative_l2_error=(\S+)$", stdout, re.M)
    check(m is not None, f"no relative_l2_error line in:\n{stdout}")
    return float(m.group(1))


def parse_info(stdout):
    info = {}
    for line in stdout.splitlines():
        m = re.match(r"^(\w+):\s+(.*)$", line)
        if m:
            info[m.group(1)] = m.group(2).strip()
    for key in ("hidden", "topk", "num_experts", "num_layers"):
        check(key in info, f"info output lacks {key}:\n{stdout}")
    return info


def case_cli(server, cli, workdir):
    r = cli.run("health")
    check(r.stdout.strip() == "SERVING", f"health printed {r.stdout!r}")
    info = parse_info(cli.run("info").stdout)
    check(info["model_name"] == "tiny", f"model_name {info['model_name']!r}")
    hidden, topk = int(info["hidden"]), int(info["topk"])
    num_experts, num_layers = int(info["num_experts"]), int(info["num_layers"])
    log(f"info: hidden={hidden} topk={topk} experts={num_experts} layers={num_layers}")

    for dtype in ("bf16", "fp16", "fp32"):
        for layer in sorted({0, num_layers - 1}):
            r = cli.run("forward", f"--layer={layer}", "--tokens=16", f"--dtype={dtype}",
                        "--seed=7", "--check", f"--tolerance={TOL[dtype]}")
            err = parse_error(r.stdout)
            check(err < TOL[dtype], f"{dtype} layer {layer}: relative_l2_error {err}")
            check(f"shape=[16, {hidden}]" in r.stdout, f"unexpected output shape:\n{r.stdout}")
            check("server_timings_us:" in r.stdout and "latency_ms=" in r.stdout,
                  f"no timings:\n{r.stdout}")
            log(f"cli forward {dtype} layer {layer}: relative_l2_error={err:.3g}")

    # Raw input file (format documented in moeserve_cli.cc): hidden [M, H] fp32, ids [M, K]
    # int32, weights [M, K] fp32; M from the file size.
    m = 3
    hidden_vals = [((i * 37) % 101 - 50) / 25.0 for i in range(m * hidden)]
    ids = [(t * 5 + k * 3) % num_experts for t in range(m) for k in range(topk)]
    weights = [1.0 / topk] * (m * topk)
    check(all(len(set(ids[t * topk:(t + 1) * topk])) == topk for t in range(m)),
          "test bug: repeated expert in a token")
    path = os.path.join(workdir, "input.bin")
    out_path = os.path.join(workdir, "output.bin")
    with open(path, "wb") as f:
        f.write(struct.pack(f"<{m * hidden}f", *hidden_vals))
        f.write(struct.pack(f"<{m * topk}i", *ids))
        f.write(struct.pack(f"<{m * topk}f", *weights))
    r = cli.run("forward", "--dtype=fp32", f"--input_file={path}", f"--output_file={out_path}",
                "--check", "--tolerance=1e-5")
    err = parse_error(r.stdout)
    check(err < 1e-5, f"input_file fp32: relative_l2_error {err}")
    check(f"shape=[{m}, {hidden}]" in r.stdout, f"unexpected shape:\n{r.stdout}")
    check(os.path.getsize(out_path) == m * hidden * 4, "output_file has the wrong size")
    log(f"cli forward --input_file fp32: relative_l2_error={err:.3g}")

    # A client error is reported, not crashed on: INVALID_ARGUMENT, exit code 2.
    r = cli.run("forward", f"--layer={num_layers + 5}", "--tokens=2", allow_fail=True)
    check(r.returncode == 2 and "INVALID_ARGUMENT" in r.stderr,
          f"bad layer: exit {r.returncode}, stderr {r.stderr!r}")
    # The server is still fine afterwards.
    check(cli.run("health").stdout.strip() == "SERVING", "not SERVING after a bad request")

    # The metrics endpoint named in the ready file answers.
    with urllib.request.urlopen(f"{server.metrics_scheme}://{server.metrics}/metrics",
                                timeout=10) as resp:
        check(resp.status == 200, f"metrics answered HTTP {resp.status}")
        body = resp.read().decode(errors="replace")
    check(len(body) > 0, "empty metrics page")
    log(f"metrics: HTTP 200, {len(body)} bytes")


def case_load(server, cli, workdir):
    n = 64
    r = cli.run("load", f"--requests={n}", "--concurrency=4", "--tokens=8", "--max_seconds=60")
    log("load output:\n" + r.stdout.rstrip())
    check(re.search(rf"^ok={n} errors=0 not_sent=0 ", r.stdout, re.M) is not None,
          f"load did not complete {n} requests cleanly:\n{r.stdout}")
    m = re.search(r"^latency_ms: p50=(\S+) p90=(\S+) p99=(\S+) max=(\S+)$", r.stdout, re.M)
    check(m is not None, f"no latency percentiles:\n{r.stdout}")
    p50, p90, p99 = (float(m.group(i)) for i in (1, 2, 3))
    check(0 < p50 <= p90 <= p99, f"percentiles out of order: {p50} {p90} {p99}")
    m = re.search(r"tokens_per_s=(\S+)", r.stdout)
    check(m is not None and float(m.group(1)) > 0, f"no tokens/s:\n{r.stdout}")
    # --check_answers: every answer against the unloaded answer to the same request (unary and
    # stream); a tolerance no answer can meet shows that each one is counted and fails the run.
    for extra in ([], ["--stream"]):
        r = cli.run("load", "--requests=48", "--concurrency=4", "--tokens=8", "--distinct_inputs=3",
                    "--check_answers", *extra)
        check(re.search(r"^answers: checked=48 wrong=0 ", r.stdout, re.M) is not None,
              f"load --check_answers {extra}:\n{r.stdout}")
    r = cli.run("load", "--requests=12", "--concurrency=2", "--tokens=4", "--check_answers",
                "--tolerance=-1", allow_fail=True)
    check(r.returncode == 1 and re.search(r"^answers: checked=12 wrong=12 ", r.stdout, re.M),
          f"load --check_answers --tolerance=-1: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    r = cli.run("load", "--shm", "--check_answers", "--requests=4", allow_fail=True)
    check(r.returncode == 2 and "--check_answers checks closed-loop answers" in r.stderr,
          f"load --shm --check_answers: exit {r.returncode}\n{r.stderr}")
    # Bounded by time: a tiny --max_seconds stops early and says so, without errors.
    r = cli.run("load", "--requests=1000000", "--concurrency=2", "--tokens=4",
                "--max_seconds=0.5", allow_fail=True)
    check(r.returncode == 0 and "stopped by --max_seconds" in r.stdout,
          f"time-bounded load: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    # --think_us: each worker waits between an answer and its next call (2 workers x 3 calls:
    # at least 2 waits of 0.2 s each), and a negative wait is refused.
    r = cli.run("load", "--requests=6", "--concurrency=2", "--tokens=4", "--think_us=200000")
    wall = float(re.search(r"wall_s=([0-9.]+)", r.stdout).group(1))
    check("ok=6 errors=0" in r.stdout and wall >= 0.4,
          f"load --think_us=200000: {wall} s, expected >= 0.4\n{r.stdout}")
    r = cli.run("load", "--think_us=-1", allow_fail=True)
    check(r.returncode == 2 and "--think_us" in r.stderr,
          f"load --think_us=-1: exit {r.returncode}\n{r.stderr}")
    # The open loop: every call answered correctly or refused, the answered calls' server
    # stages at p50 and p99.
    # Several sending threads keep one schedule (--senders), completions on each client's
    # thread or on shared queues (--completion_threads, 3 for 4 connections: one queue takes
    # two); the latency by second sent.
    for flags in (("--senders=1",), ("--senders=3",), ("--completion_threads=3",)):
        r = cli.run("load", "--rate=100", "--max_seconds=1", "--concurrency=4", "--tokens=4",
                    "--distinct_inputs=2", *flags)
        sent, ok = (int(g) for g in re.search(r"^sent=(\d+) ok=(\d+) ", r.stdout, re.M).groups())
        check(ok > 0 and 95 <= sent <= 105 and "wrong_answers=0" in r.stdout
              and "other_errors=0" in r.stdout
              and re.search(r"^server_stages_us_p99: queue=[0-9.]+ ", r.stdout, re.M)
              and re.search(r"^latency_ms_by_second_sent: s0:n=\d+,p50=", r.stdout, re.M),
              f"load --rate=100 {flags}:\n{r.stdout}")
        # Timed from the schedule, an answer is never sooner than from its actual send, and
        # the rate the senders kept is about the one asked for.
        lat = re.search(r"^latency_ms: p50=([0-9.]+) p90=[0-9.]+ p99=([0-9.]+) ", r.stdout, re.M)
        sch = re.search(r"^latency_from_schedule_ms: p50=([0-9.]+) p90=[0-9.]+ p99=([0-9.]+) "
                        r"max=[0-9.]+ offered_per_s=([0-9.]+)$", r.stdout, re.M)
        check(lat is not None and sch is not None
              and float(sch.group(1)) >= float(lat.group(1))
              and float(sch.group(2)) >= float(lat.group(2))
              and 80 <= float(sch.group(3)) <= 120,
              f"load --rate=100 {flags}: latency from the schedule\n{r.stdout}")
        # Every connection made its warm-up calls before the run, none failed.
        check(re.search(r"^warmup: calls_per_connection=16 refused=\d+ failed=0 ", r.stdout, re.M),
              f"load --rate=100 {flags}: warm-up\n{r.stdout}")
        # Every call's send lag is counted; at 100 calls/s the senders keep the schedule.
        lag = re.search(r"^send_lag_ms: p50=([0-9.]+) p90=[0-9.]+ p99=[0-9.]+ max=[0-9.]+ "
                        r"n=(\d+)$", r.stdout, re.M)
        check(lag is not None and int(lag.group(2)) == sent and float(lag.group(1)) < 5.0,
              f"load --rate=100 {flags}: send lag\n{r.stdout}")
    # Transport tuning on the client's channel; a malformed argument is refused.
    r = cli.run("load", "--requests=8", "--concurrency=2", "--tokens=4", "--check_answers",
                "--grpc_channel_args=grpc.http2.max_frame_size=1048576")
    check(re.search(r"^answers: checked=8 wrong=0 ", r.stdout, re.M) is not None,
          f"load --grpc_channel_args:\n{r.stdout}")
    r = cli.run("load", "--requests=1", "--grpc_channel_args=grpc.x=y", allow_fail=True)
    check(r.returncode != 0 and "--grpc_channel_args" in r.stderr,
          f"load --grpc_channel_args=grpc.x=y: exit {r.returncode}\n{r.stderr}")
    r = cli.run("load", "--rate=100", "--warmup_calls=-1", allow_fail=True)
    check(r.returncode == 2 and "--warmup_calls" in r.stderr,
          f"load --warmup_calls=-1: exit {r.returncode}\n{r.stderr}")
    r = cli.run("load", "--rate=100", "--senders=0", allow_fail=True)
    check(r.returncode == 2 and "--senders" in r.stderr,
          f"load --senders=0: exit {r.returncode}\n{r.stderr}")
    r = cli.run("load", "--rate=100", "--completion_threads=-1", allow_fail=True)
    check(r.returncode == 2 and "--completion_threads" in r.stderr,
          f"load --completion_threads=-1: exit {r.returncode}\n{r.stderr}")


def case_unix(server, cli, workdir):
    """--listen unix:/path: a same-host frontend without the TCP stack; answers as over TCP."""
    check(server.target == "unix:" + os.path.join(workdir, "moeserve.sock"),
          f"ready file names {server.target!r}, expected the socket path")
    check(os.path.exists(os.path.join(workdir, "moeserve.sock")), "no socket file while serving")
    for dtype in ("bf16", "fp32"):
        r = cli.run("forward", "--tokens=24", f"--dtype={dtype}", "--check", "--seed=5")
        check("check passed" in r.stdout, f"unix-socket forward ({dtype}) failed:\n{r.stdout}")
        log(f"unix socket, {dtype}: " + r.stdout.strip().splitlines()[-1])
    r = cli.run("load", "--requests=32", "--concurrency=4", "--tokens=8")
    check(re.search(r"^ok=32 errors=0 not_sent=0 ", r.stdout, re.M) is not None,
          f"unix-socket load:\n{r.stdout}")


def case_ep16(server, cli, workdir):
    """--ranks 16 on a seed-megamoe-shaped model (512 experts, top-8, small sizes): every routing
    matches the client's independent single-process reference."""
    out = cli.run("info").stdout
    info = parse_info(out)
    check(info.get("num_ranks") == "16", f"num_ranks: {info.get('num_ranks')}")
    check(info.get("num_experts") == "512", f"num_experts: {info.get('num_experts')}")
    check(len(re.findall(r"^\s*rank \d+:", out, re.M)) == 16, "placement lists 16 ranks")
    # Bad routing flags are refused before anything is sent.
    for bad in (["--routing=sideways"], ["--routing=hot", "--hot_expert=512"]):
        r = cli.run("forward", "--tokens=2", *bad, allow_fail=True)
        check(r.returncode == 2 and "INVALID_ARGUMENT" in (r.stdout + r.stderr),
              f"forward {bad}: exit {r.returncode}, {r.stdout} {r.stderr}")
    for routing in ("uniform", "balanced", "hot"):
        for dtype, tol in (("bf16", 1e-2), ("fp32", 1e-5)):
            out = cli.run("forward", "--layer=0", "--tokens=300", f"--dtype={dtype}",
                          f"--routing={routing}", "--hot_expert=37", "--seed=11", "--check",
                          f"--tolerance={tol}").stdout
            err = parse_error(out)
            check(err < tol, f"ep16 {routing} {dtype}: relative_l2_error {err} >= {tol}")
            log(f"ep16 {routing} {dtype}: relative_l2_error={err:.3g}")


def case_checkpoint(server, cli, workdir):
    """A Hugging Face checkpoint written by the `safetensors` package, served over gRPC: every
    MoE layer answers within tolerance of the client's reference on the served weights, and a
    dense layer is refused."""
    info = parse_info(cli.run("info").stdout)
    moe_layers = [int(x) for x in re.findall(r"\d+", info.get("moe_layers", ""))]
    check(moe_layers, f"no moe_layers in info: {info}")
    for layer in moe_layers:
        err = parse_error(cli.run("forward", f"--layer={layer}", "--tokens=37", "--dtype=bf16",
                                  "--seed=5", "--check").stdout)
        check(err < 1e-2, f"checkpoint layer {layer}: relative_l2_error {err}")
        log(f"checkpoint layer {layer} ({info.get('weight_format')}): relative_l2_error={err:.3g}")
    dense = [l for l in range(int(info["num_layers"])) if l not in moe_layers]
    if dense:
        r = cli.run("forward", f"--layer={dense[0]}", "--tokens=2", allow_fail=True)
        check(r.returncode == 2 and "INVALID_ARGUMENT" in (r.stdout + r.stderr),
              f"dense layer {dense[0]}: exit {r.returncode}, {r.stdout} {r.stderr}")
        log(f"dense layer {dense[0]} refused with INVALID_ARGUMENT")


def case_closed(server, cli, workdir, source_dir):
    """Default flags (issue 14): the expert weights are not handed out; --check says which flag
    the server needs, and plain forwards still work."""
    r = cli.run("forward", "--tokens=4", "--check", allow_fail=True)
    check(r.returncode == 2 and "FAILED_PRECONDITION" in r.stderr and
          "--enable_get_expert_weights" in r.stderr,
          f"--check against a closed server: exit {r.returncode}, stderr {r.stderr!r}")
    log("closed server: forward --check refused, naming --enable_get_expert_weights")
    r = cli.run("forward", "--tokens=4")
    check("output: dtype=bf16" in r.stdout, f"plain forward:\n{r.stdout}")
    import grpc
    mc, _ = import_python_client(source_dir)
    with mc.MoeClient(server.target) as client:
        try:
            client.expert_weights(0, 1)
            raise Failure("expert_weights answered on a closed server")
        except grpc.RpcError as e:
            check(e.code() == grpc.StatusCode.FAILED_PRECONDITION and
                  "--enable_get_expert_weights" in e.details(), f"python: {e.code()} {e.details()}")


def case_stream(server, cli, workdir, source_dir):
    """An expert larger than the server's message limit (--max_message_bytes=65536; a tiny
    expert is 192 KiB): the C++ and Python clients stream it, and --check passes."""
    for dtype in ("bf16", "fp32"):
        r = cli.run("forward", "--tokens=8", f"--dtype={dtype}", "--check", "--seed=3",
                    f"--tolerance={TOL[dtype]}")
        err = parse_error(r.stdout)
        check(err < TOL[dtype], f"streamed experts, {dtype}: relative_l2_error {err}")
        log(f"cli forward --check with streamed experts, {dtype}: relative_l2_error={err:.3g}")
    import grpc
    import numpy as np
    mc, _ = import_python_client(source_dir)
    with mc.MoeClient(server.target) as client:
        w13, w2 = client.expert_weights(1, 3)  # chooses the stream by itself
        s13, s2 = client.stream_expert_weights(1, 3, chunk_bytes=1000)
        check(w13.shape == s13.shape and np.array_equal(w13, s13) and np.array_equal(w2, s2),
              "python: streamed weights differ between chunk sizes")
        check(float(np.abs(w13).sum()) > 0, "python: all-zero weights")
        try:
            client._call(client._stub.GetExpertWeights,
                         mc.client.pb.GetExpertWeightsRequest(layer=1, expert=3), None)
            raise Failure("the unary RPC answered an expert larger than the limit")
        except grpc.RpcError as e:
            check(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and
                  "StreamExpertWeights" in e.details(), f"unary: {e.code()} {e.details()}")
    log("python client: expert streamed, unary refused with RESOURCE_EXHAUSTED")


TOKEN = "integration-token-0123456789abcdef"


def make_certs(workdir):
    """A CA, a server certificate (localhost, 127.0.0.1) and a client certificate, with the
    openssl CLI; returns their paths."""
    d = os.path.join(workdir, "certs")
    os.makedirs(d)
    p = {n: os.path.join(d, n) for n in ("ca.key", "ca.pem", "server.key", "server.pem",
                                         "client.key", "client.pem", "ext.cnf", "tokens")}
    with open(p["ext.cnf"], "w") as f:
        f.write("basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth,clientAuth\n"
                "subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    with open(p["tokens"], "w") as f:
        f.write(f"# moeserve API tokens\n{TOKEN}\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]

    def openssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)
    openssl("req", "-x509", *ec, "-keyout", p["ca.key"], "-out", p["ca.pem"], "-days", "2",
            "-subj", "/CN=moeserve integration CA")
    for name, serial in (("server", "2"), ("client", "3")):
        csr = os.path.join(d, name + ".csr")
        openssl("req", *ec, "-keyout", p[name + ".key"], "-out", csr, "-subj", f"/CN={name}")
        openssl("x509", "-req", "-in", csr, "-CA", p["ca.pem"], "-CAkey", p["ca.key"],
                "-set_serial", serial, "-days", "2", "-extfile", p["ext.cnf"],
                "-out", p[name + ".pem"])
    return p


def secure_server_args(certs):
    return ["--tls_cert", certs["server.pem"], "--tls_key", certs["server.key"],
            "--tls_client_ca", certs["ca.pem"], "--auth_token_file", certs["tokens"],
            "--metrics_tls_cert", certs["server.pem"], "--metrics_tls_key", certs["server.key"],
            "--enable_get_expert_weights"]


def secure_cli_args(certs):
    return ["--tls_ca", certs["ca.pem"], "--tls_cert", certs["client.pem"],
            "--tls_key", certs["client.key"], "--auth_token_file", certs["tokens"],
            "--tls_server_name", "localhost"]


def case_secure(server, cli, workdir, source_dir, certs):
    """TLS with client certificates and a bearer token: the CLI and the Python client with the
    right credentials get checked answers; without the token or the certificate, refusals."""
    r = cli.run("forward", "--tokens=16", "--check", "--seed=9")
    err = parse_error(r.stdout)
    check(err < TOL["bf16"], f"secure forward: relative_l2_error {err}")
    log(f"secure cli forward --check: relative_l2_error={err:.3g}")
    no_token = [a for a in secure_cli_args(certs) if a not in ("--auth_token_file",
                                                                certs["tokens"])]
    r = cli.run("info", *no_token, allow_fail=True, common=False)
    check(r.returncode == 2 and "UNAUTHENTICATED" in r.stderr and "--auth_token_file" in r.stderr,
          f"no token: exit {r.returncode}, stderr {r.stderr!r}")
    r = cli.run("health", *no_token, allow_fail=True, common=False)
    check(r.returncode == 0 and r.stdout.strip() == "SERVING", "health needs no token")
    no_cert = ["--tls_ca", certs["ca.pem"], "--auth_token_file", certs["tokens"],
               "--tls_server_name", "localhost"]
    r = cli.run("info", *no_cert, allow_fail=True, common=False)
    check(r.returncode == 2 and "UNAVAILABLE" in r.stderr,
          f"no client certificate: exit {r.returncode}, stderr {r.stderr!r}")
    r = cli.run("info", allow_fail=True, common=False)
    check(r.returncode == 2, "plaintext call to a TLS server answered")
    log("secure: no token -> UNAUTHENTICATED, no client certificate / plaintext -> refused")

    example = os.path.join(source_dir, "clients", "python", "examples", "forward_example.py")
    import_python_client(source_dir)  # generates the stubs if needed
    r = subprocess.run([sys.executable, example, f"--target={server.target}", "--dtype=fp32",
                        "--tokens=5", f"--tls_ca={certs['ca.pem']}",
                        f"--tls_cert={certs['client.pem']}", f"--tls_key={certs['client.key']}",
                        f"--auth_token_file={certs['tokens']}"],
                       capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    check(r.returncode == 0, f"python over mutual TLS exited {r.returncode}:\n{r.stdout}\n"
                             f"{r.stderr}")
    err = parse_error(r.stdout)
    check(err < TOL["fp32"], f"python secure fp32: relative_l2_error {err}")
    log(f"secure python forward fp32: relative_l2_error={err:.3g}")

    import ssl
    ctx = ssl.create_default_context(cafile=certs["ca.pem"])
    url = f"https://localhost:{server.metrics.rsplit(':', 1)[1]}/metrics"
    with urllib.request.urlopen(url, timeout=10, context=ctx) as resp:
        check(resp.status == 200, f"HTTPS metrics answered {resp.status}")
    log("secure: metrics over HTTPS answered 200")


# (checkpoint folder under --checkpoints, served weight format)
CHECKPOINT_CASES = [("deepseek_bf16_sharded", "mxfp8"), ("deepseek_bf16_sharded", "bf16"),
                    ("qwen3_mxfp8", "mxfp8"), ("mixtral_bf16", "bf16")]

EP16_ARGS = ["--model", "seed-megamoe", "--ranks", "16", "--hidden", "128",
             "--intermediate", "64", "--threads", "2"]


def import_python_client(source_dir):
    pkg_root = os.path.join(source_dir, "clients", "python")
    gen = os.path.join(pkg_root, "moeserve_client", "gen", "moeserve", "v1", "moeserve_pb2.py")
    if not os.path.exists(gen):
        log("generating Python stubs")
        subprocess.run([os.path.join(pkg_root, "generate_stubs.sh")], check=True,
                       env=dict(os.environ, PYTHON=sys.executable))
    sys.path.insert(0, pkg_root)
    import moeserve_client  # noqa: E402
    return moeserve_client, pkg_root


def case_python(server, cli, workdir, source_dir):
    import grpc
    import numpy as np
    mc, pkg_root = import_python_client(source_dir)

    with mc.MoeClient(server.target) as client:
        check(client.health() == "SERVING", "python health not SERVING")
        info = client.info()
        check(info.model_name == "tiny" and info.hidden > 0, f"info: {info}")
        x, ids, w = mc.random_inputs(12, info.hidden, info.num_experts, info.topk, seed=3)
        layer = info.num_layers - 1
        experts = {int(e): client.expert_weights(layer, int(e)) for e in np.unique(ids)}
        w13, w2 = next(iter(experts.values()))
        check(w13.shape == (2 * info.intermediate, info.hidden) and
              w2.shape == (info.hidden, info.intermediate) and w13.dtype == np.float32,
              f"expert weight shapes {w13.shape} {w2.shape}")

        # BF16: uint16 bit patterns in, uint16 bit patterns out.
        bits = mc.bf16_encode(x)
        out = client.forward(bits, ids, w, layer=layer, dtype="bf16")
        check(out.dtype == np.uint16 and out.shape == x.shape, f"bf16 out {out.dtype} {out.shape}")
        expected = mc.reference_forward(mc.bf16_decode(bits), ids, w, experts)
        err = mc.relative_l2_error(mc.bf16_decode(out), expected)
        log(f"python forward bf16: relative_l2_error={err:.3g}")
        check(err < TOL["bf16"], f"python bf16 relative_l2_error {err}")

        # FP16 and FP32 (int64 ids for the latter).
        x16 = x.astype(np.float16)
        out = client.forward(x16, ids, w, layer=layer)
        check(out.dtype == np.float16, f"fp16 out dtype {out.dtype}")
        err = mc.relative_l2_error(out.astype(np.float32),
                                   mc.reference_forward(x16.astype(np.float32), ids, w, experts))
        log(f"python forward fp16: relative_l2_error={err:.3g}")
        check(err < TOL["fp16"], f"python fp16 relative_l2_error {err}")

        res = client.forward_full(x, ids.astype(np.int64), w, layer=layer, request_id="py-fp32")
        check(res.output.dtype == np.float32, f"fp32 out dtype {res.output.dtype}")
        check(res.request_id == "py-fp32", f"request_id echoed as {res.request_id!r}")
        check(res.timings["total_us"] > 0, f"timings {res.timings}")
        err = mc.relative_l2_error(res.output, mc.reference_forward(x, ids, w, experts))
        log(f"python forward fp32: relative_l2_error={err:.3g}")
        check(err < TOL["fp32"], f"python fp32 relative_l2_error {err}")

        # A bare uint16 array is refused client-side; a bad expert id is INVALID_ARGUMENT.
        try:
            client.forward(bits, ids, w, layer=layer)
            raise Failure("uint16 hidden without dtype='bf16' was accepted")
        except TypeError:
            pass
        bad = ids.copy()
        bad[0, 0] = info.num_experts
        try:
            client.forward(x, bad, w, layer=layer)
            raise Failure("out-of-range expert id was accepted")
        except grpc.RpcError as e:
            check(e.code() == grpc.StatusCode.INVALID_ARGUMENT, f"bad id gave {e.code()}")

    example = os.path.join(pkg_root, "examples", "forward_example.py")
    for dtype in ("bf16", "fp32"):
        r = subprocess.run([sys.executable, example, f"--target={server.target}",
                            f"--dtype={dtype}", "--tokens=6"],
                           capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
        check(r.returncode == 0, f"forward_example {dtype} exited {r.returncode}:\n"
                                 f"{r.stdout}\n{r.stderr}")
        err = parse_error(r.stdout)
        check(err < TOL[dtype], f"forward_example {dtype}: relative_l2_error {err}")
        log(f"forward_example.py {dtype}: relative_l2_error={err:.3g}")


def case_triton(server, cli, workdir, source_dir):
    """The KServe v2 endpoint driven by tritonclient[grpc] (the client perf_analyzer and KServe
    users have), answers checked against clients/python's numpy reference on the weights the
    server reports (GetExpertWeights through the moeserve Python client)."""
    import numpy as np
    import ml_dtypes
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException
    mc, _ = import_python_client(source_dir)
    triton = tg.InferenceServerClient(url=server.target)
    check(triton.is_server_live(), "tritonclient: server not live")
    check(triton.is_server_ready(), "tritonclient: server not ready")
    meta = triton.get_server_metadata()
    check(meta.name == "moeserve", f"server metadata {meta}")
    with mc.MoeClient(server.target) as client:
        info = client.info()
        layers = sorted({0, info.num_layers - 1})
        for layer in layers:
            name = f"moe_layer_{layer}"
            check(triton.is_model_ready(name), f"{name} not ready")
            md = triton.get_model_metadata(name)
            check([i.name for i in md.inputs] == ["hidden_states", "topk_ids", "topk_weights"],
                  f"{name} metadata inputs {md.inputs}")
            check(list(md.inputs[0].shape) == [-1, info.hidden], f"{name} shape {md.inputs[0]}")
        check(not triton.is_model_ready("moe_layer_999"), "moe_layer_999 ready")
        m = 11
        x, ids, w = mc.random_inputs(m, info.hidden, info.num_experts, info.topk, seed=21)
        for layer in layers:
            experts = {int(e): client.expert_weights(layer, int(e)) for e in np.unique(ids)}
            for dtype, np_dtype, ids_dtype in (("FP32", np.float32, np.int64),
                                               ("FP16", np.float16, np.int32),
                                               ("BF16", ml_dtypes.bfloat16, np.int32)):
                xs = x.astype(np_dtype)
                inputs = [tg.InferInput("hidden_states", list(xs.shape), dtype),
                          tg.InferInput("topk_ids", list(ids.shape),
                                        "INT64" if ids_dtype == np.int64 else "INT32"),
                          tg.InferInput("topk_weights", list(w.shape), "FP32")]
                inputs[0].set_data_from_numpy(xs)
                inputs[1].set_data_from_numpy(ids.astype(ids_dtype))
                inputs[2].set_data_from_numpy(w.astype(np.float32))
                # Half the calls name the layer's model, half use "moeserve" + parameter.
                if dtype == "FP16":
                    result = triton.infer("moeserve", inputs, parameters={"layer": layer},
                                          outputs=[tg.InferRequestedOutput("output")],
                                          request_id=f"tc-{layer}")
                else:
                    result = triton.infer(f"moe_layer_{layer}", inputs, request_id=f"tc-{layer}")
                out = result.as_numpy("output")
                check(out is not None and out.shape == (m, info.hidden),
                      f"{dtype} output shape {None if out is None else out.shape}")
                check(result.get_response().id == f"tc-{layer}", "request id not echoed")
                expected = mc.reference_forward(xs.astype(np.float32), ids, w, experts)
                err = mc.relative_l2_error(np.asarray(out).astype(np.float32), expected)
                tol = TOL[dtype.lower()]
                log(f"tritonclient {dtype} layer {layer}: relative_l2_error={err:.3g}")
                check(err < tol, f"tritonclient {dtype} layer {layer}: relative_l2_error {err}")
        # Refusals arrive as tritonclient exceptions naming the problem.
        bad = [tg.InferInput("hidden_states", [2, info.hidden], "FP32"),
               tg.InferInput("topk_ids", [2, info.topk], "INT32")]
        bad[0].set_data_from_numpy(x[:2])
        bad[1].set_data_from_numpy(ids[:2].astype(np.int32))
        try:
            triton.infer("moe_layer_0", bad)
            raise Failure("a request without topk_weights was accepted")
        except InferenceServerException as e:
            check("topk_weights" in str(e), f"missing-input refusal: {e}")
            log(f"refused as expected: {e}")
    triton.close()


def _triton_inputs(tg, mc, info, m, seed, np_dtype, datatype):
    """Random hidden_states (in the dtype tritonclient will send) / topk_ids / topk_weights and
    their InferInputs."""
    x, ids, w = mc.random_inputs(m, info.hidden, info.num_experts, info.topk, seed=seed)
    inputs = [tg.InferInput("hidden_states", [m, info.hidden], datatype),
              tg.InferInput("topk_ids", [m, info.topk], "INT32"),
              tg.InferInput("topk_weights", [m, info.topk], "FP32")]
    return (x.astype(np_dtype), ids, w), inputs


def case_triton_shm(server, cli, workdir, source_dir, cuda=False):
    """tritonclient's own shared-memory helpers against the KServe shared-memory RPCs
    (--enable_shared_memory): inputs and the answer in system shm (tritonclient.utils.
    shared_memory) or, with cuda, in CUDA IPC regions (tritonclient.utils.cuda_shared_memory, a
    GPU server); answers checked against clients/python's numpy reference (relative L2: FP32
    1e-5, FP16 / BF16 1e-2)."""
    import numpy as np
    import ml_dtypes
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException
    if cuda:
        import tritonclient.utils.cuda_shared_memory as shmlib
    else:
        import tritonclient.utils.shared_memory as shmlib
    mc, _ = import_python_client(source_dir)
    triton = tg.InferenceServerClient(url=server.target)
    kind = "cuda" if cuda else "system"
    register = triton.register_cuda_shared_memory if cuda else triton.register_system_shared_memory
    unregister = (triton.unregister_cuda_shared_memory if cuda else
                  triton.unregister_system_shared_memory)
    status = (triton.get_cuda_shared_memory_status if cuda else
              triton.get_system_shared_memory_status)
    unregister()  # as tritonclient's examples start: nothing left from before
    size = 1 << 20
    handles = []

    def region(name):
        if cuda:
            h = shmlib.create_shared_memory_region(name, size, 0)
            register(name, shmlib.get_raw_handle(h), 0, size)
        else:
            key = f"/moeserve_it_{os.getpid()}_{name}"
            h = shmlib.create_shared_memory_region(name, key, size)
            register(name, key, size)
        handles.append(h)
        return h

    try:
        h_in, h_out = region("tc_in"), region("tc_out")
        regions = status()
        names = sorted(r.name for r in regions.regions.values())
        check(names == ["tc_in", "tc_out"], f"{kind} shared-memory status lists {names}")
        with mc.MoeClient(server.target) as client:
            info = client.info()
            layer = info.num_layers - 1
            m = 9
            for datatype, np_dtype in (("FP32", np.float32), ("FP16", np.float16),
                                       ("BF16", ml_dtypes.bfloat16)):
                seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run
                (x, ids, w), inputs = _triton_inputs(tg, mc, info, m, seed, np_dtype, datatype)
                arrays = [x.view(np.uint16) if datatype == "BF16" else x, ids, w]
                if cuda:  # one array per call: cuda_shared_memory writes from offset 0
                    shmlib.set_shared_memory_region(h_in, [np.concatenate(
                        [a.reshape(-1).view(np.uint8) for a in arrays])])
                else:
                    shmlib.set_shared_memory_region(h_in, arrays)
                offset = 0
                for inp, a in zip(inputs, arrays):
                    inp.set_shared_memory("tc_in", a.nbytes, offset=offset)
                    offset += a.nbytes
                out_bytes = m * info.hidden * np.dtype(np_dtype).itemsize
                out = tg.InferRequestedOutput("output")
                out.set_shared_memory("tc_out", out_bytes)
                result = triton.infer(f"moe_layer_{layer}", inputs, outputs=[out])
                meta = result.get_output("output")
                check(meta is not None and list(meta.shape) == [m, info.hidden] and
                      meta.datatype == datatype, f"{datatype} output metadata {meta}")
                read_dtype = np.uint16 if datatype == "BF16" else np_dtype
                got = shmlib.get_contents_as_numpy(h_out, read_dtype, [m, info.hidden])
                if datatype == "BF16":
                    got = np.asarray(got).view(ml_dtypes.bfloat16)
                experts = {int(e): client.expert_weights(layer, int(e)) for e in np.unique(ids)}
                expected = mc.reference_forward(x.astype(np.float32), ids, w, experts)
                err = mc.relative_l2_error(np.asarray(got).astype(np.float32), expected)
                log(f"tritonclient {kind} shm {datatype} (seed {seed}): relative_l2_error={err:.3g}")
                # A CUDA server computes in BF16 whatever the wire dtype (its tensor cores take
                # BF16), so its tolerance is BF16's for every dtype.
                tol = TOL["bf16"] if cuda else TOL[datatype.lower()]
                check(err < tol, f"{kind} shm {datatype}: error {err} (tolerance {tol})")
            # A wrong byte size is refused naming what was expected.
            (x, ids, w), inputs = _triton_inputs(tg, mc, info, m, 32, np.float32, "FP32")
            inputs[0].set_shared_memory("tc_in", x.nbytes - 4)
            for inp, a in zip(inputs[1:], (ids, w)):
                inp.set_data_from_numpy(a)
            try:
                triton.infer(f"moe_layer_{layer}", inputs)
                raise Failure("a wrong shared_memory_byte_size was accepted")
            except InferenceServerException as e:
                check("does not match the tensor" in str(e), f"byte-size refusal: {e}")
                log(f"refused as expected: {e}")
        unregister("tc_in")
        names = sorted(r.name for r in status().regions.values())
        check(names == ["tc_out"], f"after unregistering tc_in: {names}")
        unregister()
        check(len(status().regions) == 0, "regions left after unregister()")
    finally:
        for h in handles:
            shmlib.destroy_shared_memory_region(h)
        triton.close()


def case_shm(server, cli, workdir, source_dir):
    """--enable_shared_memory: tensors and answers through POSIX shared memory, from the CLI
    (forward --shm --check, load --shm) and from the Python client's shared_memory module."""
    for dtype in ("bf16", "fp32"):
        r = cli.run("forward", "--shm", "--tokens=20", f"--dtype={dtype}", "--check", "--seed=9")
        check("check passed" in r.stdout, f"cli forward --shm ({dtype}) failed:\n{r.stdout}")
        log(f"cli forward --shm, {dtype}: " + r.stdout.strip().splitlines()[-2])
    r = cli.run("load", "--shm", "--requests=48", "--concurrency=4", "--tokens=8")
    check(re.search(r"^ok=48 errors=0 not_sent=0 ", r.stdout, re.M) is not None,
          f"load --shm:\n{r.stdout}")
    check("transport=shm" in r.stdout, f"load --shm did not say so:\n{r.stdout}")
    # The forward channel (no gRPC call per Forward), with tensors inline and in a region; a
    # flag it cannot honour is refused before anything is sent.
    for extra in ([], ["--shm"]):
        r = cli.run("load", "--channel", *extra, "--requests=24", "--concurrency=2",
                    "--tokens=8")
        check(re.search(r"^ok=24 errors=0 not_sent=0 ", r.stdout, re.M) is not None and
              "channel: slots=2 " in r.stdout, f"load --channel {extra}:\n{r.stdout}")
    log("cli load --channel (inline, --shm): " + r.stdout.strip().splitlines()[-1])
    for bad in ("--stream", "--rate=100"):
        r = cli.run("load", "--channel", bad, "--requests=4", allow_fail=True)
        check(r.returncode != 0 and "--channel runs closed-loop unary calls" in r.stderr,
              f"load --channel {bad}: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    # A CUDA region needs a GPU here and a cuda-backend server; a CPU server (or a machine
    # without a GPU, or a build without CUDA) refuses it cleanly, before any Forward.
    r = cli.run("load", "--cuda_region", "--requests=4", "--concurrency=1", "--tokens=8",
                allow_fail=True)
    if (parse_info(cli.run("info").stdout).get("backend") == "cuda" and
            "built without CUDA" not in r.stderr):
        check(re.search(r"^ok=4 errors=0 ", r.stdout, re.M) is not None and
              "transport=cuda_region" in r.stdout, f"load --cuda_region:\n{r.stdout}")
    else:
        check(r.returncode == 2 and "error: CUDA region:" in r.stderr,
              f"load --cuda_region: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
        log("cli load --cuda_region refused: " + r.stderr.strip().splitlines()[0])

    import grpc
    import numpy as np
    mc, _ = import_python_client(source_dir)
    from moeserve_client import shared_memory as shm
    with mc.MoeClient(server.target) as client:
        info = client.info()
        layer = info.num_layers - 1
        m, h, k = 10, info.hidden, info.topk
        x, ids, w = mc.random_inputs(m, h, info.num_experts, k, seed=17)
        experts = {int(e): client.expert_weights(layer, int(e)) for e in np.unique(ids)}
        region = shm.SystemRegion.create(1 << 20)
        try:
            shm.register_system(client, "py0", region)
            for name, hidden_in, ids_dtype in (("bf16", mc.bf16_encode(x), np.int32),
                                               ("fp32", x, np.int64)):
                hx = region.ndarray(0, (m, h), name)
                hx[:] = hidden_in
                ti = region.ndarray(64 << 10, (m, k), ids_dtype)
                ti[:] = ids
                tw = region.ndarray(128 << 10, (m, k), np.float32)
                tw[:] = w
                out = region.ndarray(256 << 10, (m, h), name)
                out[:] = 0
                res = shm.forward(client, region, hx, ti, tw, out, layer=layer, dtype=name,
                                  return_timings=True)
                check(res.shape == (m, h) and res.dtype == name, f"python shm answer {res}")
                got = mc.bf16_decode(out) if name == "bf16" else np.array(out)
                x_sent = mc.bf16_decode(hidden_in) if name == "bf16" else x
                err = mc.relative_l2_error(got, mc.reference_forward(x_sent, ids, w, experts))
                log(f"python shm forward {name}: relative_l2_error={err:.3g}")
                check(err < TOL[name], f"python shm {name} relative_l2_error {err}")
                del hx, ti, tw, out
            regions = shm.status(client)
            check(len(regions) == 1 and regions[0]["name"] == "py0" and
                  regions[0]["kind"] == "system" and regions[0]["key"] == region.key and
                  regions[0]["byte_size"] == region.size and
                  regions[0]["calls_in_flight"] == 0, f"status {regions}")
            try:
                shm.register_system(client, "py0", region)
                raise Failure("a duplicate region name was accepted")
            except grpc.RpcError as e:
                check(e.code() == grpc.StatusCode.ALREADY_EXISTS, f"duplicate gave {e.code()}")
            shm.unregister(client, "py0")
            check(shm.status(client) == [], "region still listed after unregister")
            try:
                shm.forward_refs(client, layer, ("py0", 0, m * h * 4), "fp32", m, h,
                                 ("py0", 64 << 10, m * k * 4), k, ("py0", 128 << 10, m * k * 4),
                                 ("py0", 256 << 10, m * h * 4))
                raise Failure("a call naming an unregistered region was accepted")
            except grpc.RpcError as e:
                check(e.code() == grpc.StatusCode.INVALID_ARGUMENT and "py0" in e.details(),
                      f"unregistered region gave {e.code()}: {e.details()}")
        finally:
            region.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", required=True)
    p.add_argument("--cli", required=True)
    p.add_argument("--source-dir", required=True)
    p.add_argument("--case", choices=["cli", "python", "load", "ep16", "unix", "shm", "checkpoint",
                                      "closed", "stream", "secure", "triton", "triton_shm",
                                      "triton_cuda_shm", "all"],
                   default="all")
    p.add_argument("--checkpoints", default="",
                   help="folder of scripts/make_test_checkpoint.py --suite (checkpoint case)")
    p.add_argument("--startup-timeout", type=float, default=60.0)
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    args = p.parse_args()

    # Binaries bundled for a GPU machine: $MOESERVE_BINARY / $MOESERVE_CLI override the build's.
    args.server = os.environ.get("MOESERVE_BINARY") or args.server
    args.cli = os.environ.get("MOESERVE_CLI") or args.cli
    for path in (args.server, args.cli):
        if not os.access(path, os.X_OK):
            print(f"[integration] FAIL: {path} is missing or not executable (build it first)",
                  file=sys.stderr)
            return 1
    if args.case in ("triton", "triton_shm", "triton_cuda_shm"):
        try:
            import tritonclient.grpc  # noqa: F401
            import ml_dtypes  # noqa: F401
        except ImportError as e:
            print(f"[integration] SKIP: {e} (scripts/setup.sh installs tritonclient[grpc])")
            return 77
    if args.case == "triton_cuda_shm":
        # tritonclient.utils.cuda_shared_memory imports cuda.bindings (PyPI: cuda-python) and
        # raises RuntimeError without it; then a GPU is needed.
        try:
            import tritonclient.utils.cuda_shared_memory  # noqa: F401
            import cuda.bindings.runtime as cudart
        except (ImportError, RuntimeError) as e:
            print(f"[integration] SKIP: {e} (pip install cuda-python, or tritonclient[cuda])")
            return 77
        err, count = cudart.cudaGetDeviceCount()
        if err != cudart.cudaError_t.cudaSuccess or count < 1:
            print(f"[integration] SKIP: no CUDA device ({err})")
            return 77
    # triton runs as its own ctest (it needs tritonclient, which may be absent: a skip).
    cases = (["cli", "python", "load", "ep16", "unix", "shm", "closed", "stream", "secure"]
             if args.case == "all" else [args.case])
    runs = []  # (case, extra server args)
    for case in cases:
        if case == "checkpoint":
            check_dir = os.path.isdir(args.checkpoints)
            if not check_dir:
                print(f"[integration] FAIL: --checkpoints {args.checkpoints!r} is not a folder",
                      file=sys.stderr)
                return 1
            for name, fmt in CHECKPOINT_CASES:
                runs.append((case, ["--checkpoint", os.path.join(args.checkpoints, name),
                                    "--weight_format", fmt]))
        elif case == "closed":
            runs.append((case, []))  # the defaults: no expert weights
        elif case == "stream":
            runs.append((case, ["--enable_get_expert_weights", "--max_message_bytes=65536"]))
        else:
            # triton: two ranks, so the per-rank path is behind the KServe endpoint too.
            runs.append((case, EP16_ARGS if case == "ep16" else
                         ["--enable_shared_memory"] if case in ("shm", "triton_shm") else
                         ["--enable_shared_memory", "--backend", "cuda", "--ranks", "1"]
                         if case == "triton_cuda_shm" else
                         ["--ranks", "2"] if case == "triton" else []))
    for case, extra in runs:
        with tempfile.TemporaryDirectory(prefix=f"moeserve-it-{case}-") as workdir:
            cli = Cli(args.cli)
            certs = None
            try:
                listen = ("unix:" + os.path.join(workdir, "moeserve.sock")
                          if case in ("unix", "shm") else "127.0.0.1:0")
                server_args = list(extra)
                if case not in ("closed", "stream", "secure"):
                    server_args.append("--enable_get_expert_weights")  # --check needs it
                if case == "secure":
                    certs = make_certs(workdir)
                    server_args += secure_server_args(certs)
                    cli = Cli(args.cli, secure_cli_args(certs))
                with Server(args.server, workdir, extra_args=server_args,
                            startup_timeout=args.startup_timeout, listen=listen,
                            metrics_scheme="https" if certs else "http") as server:
                    server.wait_ready(cli)
                    if case == "cli":
                        case_cli(server, cli, workdir)
                    elif case == "load":
                        case_load(server, cli, workdir)
                    elif case == "ep16":
                        case_ep16(server, cli, workdir)
                    elif case == "unix":
                        case_unix(server, cli, workdir)
                    elif case == "checkpoint":
                        case_checkpoint(server, cli, workdir)
                    elif case == "closed":
                        case_closed(server, cli, workdir, args.source_dir)
                    elif case == "stream":
                        case_stream(server, cli, workdir, args.source_dir)
                    elif case == "secure":
                        case_secure(server, cli, workdir, args.source_dir, certs)
                    elif case == "triton":
                        case_triton(server, cli, workdir, args.source_dir)
                    elif case == "shm":
                        case_shm(server, cli, workdir, args.source_dir)
                    elif case in ("triton_shm", "triton_cuda_shm"):
                        case_triton_shm(server, cli, workdir, args.source_dir,
                                        cuda=case == "triton_cuda_shm")
                    else:
                        case_python(server, cli, workdir, args.source_dir)
                    server.terminate_and_check(args.shutdown_timeout)
            except Failure as e:
                print(f"[integration] FAIL ({case} {' '.join(extra)}): {e}", file=sys.stderr,
                      flush=True)
                return 1
        log(f"case {case} {' '.join(extra)}: PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
