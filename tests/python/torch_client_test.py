#!/usr/bin/env python3
"""The torch client (moeserve_client.torch_client) against the real server (tiny model, CPU):

  * every hidden dtype (bfloat16, float16, float32) answers the same bytes as the numpy client
    for the same inputs, and matches the numpy reference of the served experts;
  * several calls in flight (submit, results taken out of order) each get their own answer;
  * result(out=...) fills a caller's tensor; int64 ids and float64 weights are accepted;
  * server-side routing (no ids / weights) returns the server's choice, equal to the numpy
    client's;
  * RemoteExperts (any leading shape, with or without routing) and the AFD-shaped connector
    (send_attn_output / recv_ffn_output per micro-batch);
  * CUDA tensors (bytes path and, where the server allows it, the CUDA-region path) when a GPU
    is present; skipped otherwise;
  * every way in (gRPC or the forward channel, tensors as bytes or in a system region): the
    same answer as the numpy client, within tolerance of the reference (fresh random inputs),
    calls in flight on several slots, a refusal through the channel as grpc.RpcError
    INVALID_ARGUMENT, and the fall back to gRPC when the server detaches from the channel;
  * by a system region, the routing goes into the region too (the request is only headers,
    built once per layer and shape and reused): int64 / int16 ids and float64 / bfloat16
    weights, non-contiguous inputs, alternating layers and sizes, server routing, a request id
    not reused; `out` reused across calls and fresh answers that alias nothing;
  * the threaded host copy (_Copier) against the source bytes, sizes around its chunking;
  * zero copy (alloc_hidden / alloc_routing / empty): requests of headers only, answers equal
    to the copying path's and the reference, the answer view in the region and its lifetime
    (rewritten by the next call, a racing call refused), out in a region, chained layers,
    and the copy path for tensors outside regions, strided views and released regions.
  * the gRPC calls by the C++ client (native=True, $MOESERVE_CLIENT_LIB) against grpcio's: the
    same answers bytes for bytes (dtypes, id dtypes, `out` contiguous or strided, calls in
    flight, server routing with return_routing, system regions, CUDA tensors), the same
    refusals (INVALID_ARGUMENT, DEADLINE_EXCEEDED, a wrong `out`), a bearer token sent by
    both paths (UNAUTHENTICATED without it); skipped without the library.
  * float or bool ids refused (TypeError), not truncated; result() after close() raises
    RuntimeError, on every way in (a subprocess: reading a closed region was a SIGSEGV);
  * a region whose call failed without the server's answer (the client's deadline: faked, and
    for real against a server that holds calls 0.5 s) is not reused and is freed only once
    the server unregisters it; a server error gives it back at once; zero-copy bytes of such a
    call stay busy while the server reports calls in flight; a CUDA region the server refuses
    to unregister is never freed (faked runtime: no GPU needed).
Exits 77 (CTest: skipped) when torch is not installed.

  torch_client_test.py --server BUILD/bin/moeserve --cli BUILD/bin/moeserve-cli --source-dir REPO
"""

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from unittest import mock

try:
    import torch
except ImportError:
    print("torch_client_test: SKIPPED (torch is not installed; pip install torch)")
    sys.exit(77)

import numpy as np

ARGS = None
SERVER = None


FP32_TOL = 1e-5  # set by setUpModule from the server's backend


def setUpModule():
    global tc, mc, grpc, SERVER, _tmp
    sys.path.insert(0, os.path.join(ARGS.source_dir, "tests", "integration"))
    sys.path.insert(0, os.path.join(ARGS.source_dir, "clients", "python"))
    import grpc as _grpc
    import moeserve_client as _mc
    from moeserve_client import torch_client as _tc
    from run_integration import Cli, Server
    tc, mc, grpc = _tc, _mc, _grpc
    _tmp = tempfile.TemporaryDirectory(prefix="moeserve_torch_")
    SERVER = Server(ARGS.server, _tmp.name,
                    extra_args=["--enable_get_expert_weights", "--enable_shared_memory"])
    SERVER.__enter__()
    SERVER.wait_ready(Cli(ARGS.cli))
    # FP32 answers are exact to FP32 on the CPU backend; a CUDA server computes in BF16 (the
    # experts' activations) whatever the wire dtype, so its FP32 answers get BF16's tolerance.
    global FP32_TOL
    with _mc.MoeClient(SERVER.target) as c:
        FP32_TOL = 1e-5 if c.info().backend == "cpu" else 1e-2


def tearDownModule():
    try:
        SERVER.terminate_and_check(30)
    finally:
        SERVER.__exit__(None, None, None)
        _tmp.cleanup()


def np_of(t):
    """A torch CPU tensor's values as a numpy array the numpy client sends as the same bytes."""
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class TorchClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # gRPC bytes only: the other ways in are WaysInTest's.
        cls.client = tc.TorchMoeClient(SERVER.target, shared_memory="off", channel=False)
        cls.npc = mc.MoeClient(SERVER.target)
        cls.info = cls.npc.info()

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.npc.close()

    def inputs(self, m, seed, dtype=torch.bfloat16):
        g = torch.Generator().manual_seed(seed)
        h, e, k = self.info.hidden, self.info.num_experts, self.info.topk
        x = torch.randn(m, h, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).to(torch.int32)
        w = torch.softmax(torch.randn(m, k, generator=g), dim=1)
        return x, ids, w

    def test_every_dtype_matches_numpy_client_and_reference(self):
        layer = self.info.num_layers - 1
        for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float16, 1e-2),
                           (torch.float32, FP32_TOL)):
            x, ids, w = self.inputs(11, 1, dtype)
            y = self.client.forward(x, ids, w, layer=layer)
            self.assertEqual((y.dtype, tuple(y.shape), y.device.type), (dtype, (11, x.shape[1]),
                                                                        "cpu"))
            want = self.npc.forward(np_of(x), ids.numpy(), w.numpy(), layer=layer)
            self.assertEqual(np_of(y).tobytes(), want.tobytes(), dtype)
            experts = {int(e): self.npc.expert_weights(layer, int(e)) for e in ids.unique()}
            ref = mc.reference_forward(x.float().numpy(), ids.numpy(), w.numpy(), experts)
            self.assertLess(mc.relative_l2_error(y.float().numpy(), ref), tol, dtype)

    def test_calls_in_flight_answer_each_their_own(self):
        calls = []
        for i in range(8):
            x, ids, w = self.inputs(1 + 5 * i, 100 + i, (torch.bfloat16, torch.float32)[i % 2])
            fut = self.client.submit(x, ids, w, layer=i % self.info.num_layers,
                                     request_id=f"r{i}", return_timings=True)
            calls.append((fut, x, ids, w, i % self.info.num_layers))
        for fut, x, ids, w, layer in reversed(calls):
            y = self.client.result(fut)
            want = self.npc.forward(np_of(x), ids.numpy(), w.numpy(), layer=layer)
            self.assertEqual(np_of(y).tobytes(), want.tobytes())
            self.assertTrue(fut.request_id.startswith("r"))
            self.assertGreater(fut.timings["total_us"], 0)

    def test_out_tensor_and_input_conversions(self):
        x, ids, w = self.inputs(6, 7)
        out = torch.full_like(x, float("nan"))
        fut = self.client.submit(x, ids.long(), w.double())
        self.assertIs(self.client.result(fut, out=out), out)
        want = self.npc.forward(np_of(x), ids.numpy(), w.numpy())
        self.assertEqual(np_of(out).tobytes(), want.tobytes())
        with self.assertRaises(ValueError):
            self.client.result(self.client.submit(x, ids, w), out=torch.empty(5, x.shape[1],
                                                                               dtype=x.dtype))
        with self.assertRaises(ValueError):
            self.client.submit(x, ids, None)
        with self.assertRaises(grpc.RpcError) as cm:
            self.client.forward(x, ids, w, layer=99)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        empty = self.client.forward(x[:0], ids[:0], w[:0])
        self.assertEqual(tuple(empty.shape), (0, x.shape[1]))

    def test_non_integer_ids_refused(self):
        # Float or bool ids are refused (TypeError naming the dtype), not truncated to int32,
        # by every path: the C++ client's fast one, grpcio's bytes, a system region.
        x, ids, w = self.inputs(4, 21)
        with tc.TorchMoeClient(SERVER.target, shared_memory="system", channel=False,
                               native=False) as region_client:
            for c in (self.client, region_client):
                for bad in (ids.float() + 0.5, ids.double(), ids.half(), ids.bfloat16(),
                            ids.bool()):
                    with self.assertRaisesRegex(TypeError, str(bad.dtype)) as cm:
                        c.forward(x, bad, w)
                    self.assertIn("int32", str(cm.exception))
                    self.assertIn("int64", str(cm.exception))
                    with self.assertRaises(TypeError):
                        c.submit(x, bad, w)
                # Integer ids of other types are still sent (as int32).
                self.assertTrue(torch.equal(c.forward(x, ids.short(), w), c.forward(x, ids, w)))

    def test_server_routing(self):
        self.assertTrue(self.info.server_routing)
        x, _, _ = self.inputs(9, 3)
        fut = self.client.submit(x, layer=1, return_routing=True, return_timings=True)
        y = self.client.result(fut)
        want = self.npc.forward_full(np_of(x), layer=1, return_routing=True)
        self.assertEqual(np_of(y).tobytes(), want.output.tobytes())
        self.assertEqual(fut.topk_ids.dtype, torch.int32)
        self.assertTrue(np.array_equal(fut.topk_ids.numpy(), want.topk_ids))
        self.assertTrue(np.array_equal(fut.topk_weights.numpy(), want.topk_weights))
        self.assertGreater(fut.timings["route_us"], 0)

    def test_remote_experts_module(self):
        experts = tc.RemoteExperts(self.client, layer=0)
        self.assertEqual(len(list(experts.parameters())), 0)
        x, ids, w = self.inputs(6, 9)
        y = experts(x.view(2, 3, -1), ids.view(2, 3, -1), w.view(2, 3, -1))
        self.assertEqual(tuple(y.shape), (2, 3, x.shape[1]))
        want = self.client.forward(x, ids, w, layer=0)
        self.assertTrue(torch.equal(y.view(6, -1), want))
        routed = experts(x.view(2, 3, -1))
        self.assertTrue(torch.equal(routed.view(6, -1), self.client.forward(x, layer=0)))

    def test_afd_connector(self):
        conn = tc.MoeAFDConnector(self.client)
        (x0, i0, w0), (x1, i1, w1) = self.inputs(4, 11), self.inputs(7, 12)
        conn.send_attn_output(x0, i0, w0, layer=0, ubatch_idx=0)
        conn.send_attn_output(x1, i1, w1, layer=0, ubatch_idx=1)
        with self.assertRaises(RuntimeError):
            conn.send_attn_output(x1, i1, w1, layer=0, ubatch_idx=1)
        ref1 = torch.empty_like(x1)
        got1 = conn.recv_ffn_output(ref1, ubatch_idx=1)
        got0 = conn.recv_ffn_output(torch.empty_like(x0), ubatch_idx=0)
        self.assertIs(got1, ref1)
        self.assertTrue(torch.equal(got0, self.client.forward(x0, i0, w0, layer=0)))
        self.assertTrue(torch.equal(got1, self.client.forward(x1, i1, w1, layer=0)))
        with self.assertRaises(RuntimeError):
            conn.recv_ffn_output(ref1, ubatch_idx=1)

    def test_local_targets(self):
        for t, local in (("127.0.0.1:5", True), ("localhost:5", True), ("[::1]:7", True),
                         ("unix:/tmp/x.sock", True), ("10.0.0.2:5", False),
                         ("ipv4:127.0.0.2:9", True), ("moe.example:5", False)):
            self.assertEqual(tc._is_local_target(t), local, t)

    @unittest.skipUnless(torch.cuda.is_available(), "no CUDA device")
    def test_cuda_tensors(self):
        x, ids, w = self.inputs(33, 13)
        want = self.client.forward(x, ids, w, layer=0)
        for mode in ("off", "auto"):
            with tc.TorchMoeClient(SERVER.target, shared_memory=mode) as c:
                fut = c.submit(x.cuda(), ids.cuda(), w.cuda(), layer=0)
                y = c.result(fut)
                self.assertEqual(y.device.type, "cuda")
                self.assertTrue(torch.equal(y.cpu(), want), mode)
                out = torch.empty_like(x, device="cuda")
                c.forward(x.cuda(), ids.cuda(), w.cuda(), layer=0, out=out)
                self.assertTrue(torch.equal(out.cpu(), want), mode)
                # Routing on the device in other dtypes (into the region, converted there),
                # and on the CPU (as bytes); `out` reused.
                for ii, wi in ((ids.cuda().long(), w.cuda().double()), (ids, w),
                               (ids.cuda().t().contiguous().t(), w.cuda())):
                    out.fill_(float("nan"))
                    self.assertIs(c.forward(x.cuda(), ii, wi, layer=0, out=out), out)
                    self.assertTrue(torch.equal(out.cpu(), want), (mode, ii.dtype, ii.device))
                # An answer copied on a side stream, then calls on the default stream.
                side = torch.cuda.Stream()
                with torch.cuda.stream(side):
                    y_side = c.forward(x.cuda(), ids.cuda(), w.cuda(), layer=0)
                x2, ids2, w2 = self.inputs(33, 14)
                want2 = self.client.forward(x2, ids2, w2, layer=0)
                y2 = c.forward(x2.cuda(), ids2.cuda(), w2.cuda(), layer=0)
                side.synchronize()
                self.assertTrue(torch.equal(y_side.cpu(), want), mode)
                self.assertTrue(torch.equal(y2.cpu(), want2), mode)
                # The server routes: CUDA hidden states go as bytes (its router reads host
                # memory).
                routed = c.submit(x.cuda(), layer=0)
                self.assertTrue(torch.equal(c.result(routed).cpu(),
                                            self.client.forward(x, layer=0)), mode)
                self.assertFalse(routed.used_region)
                print(f"  cuda shared_memory={mode}: region used={fut.used_region} "
                      f"(fallback reason: {c.region_error})")


class WaysInTest(unittest.TestCase):
    WAYS = (("grpc+bytes", "off", False), ("grpc+region", "system", False),
            ("channel+bytes", "off", True), ("channel+region", "system", True))

    @classmethod
    def setUpClass(cls):
        cls.npc = mc.MoeClient(SERVER.target)
        cls.info = cls.npc.info()
        cls.seed = int.from_bytes(os.urandom(4), "little")
        print(f"WaysInTest: seed {cls.seed}")

    @classmethod
    def tearDownClass(cls):
        cls.npc.close()

    def inputs(self, m, k, dtype=torch.bfloat16):
        g = torch.Generator().manual_seed(self.seed + k)
        h, e, topk = self.info.hidden, self.info.num_experts, self.info.topk
        x = torch.randn(m, h, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(m)]).int()
        w = torch.softmax(torch.randn(m, topk, generator=g), dim=1)
        return x, ids, w

    def test_every_way_in(self):
        layer = self.info.num_layers - 1
        experts = {}
        for name, shm_mode, channel in self.WAYS:
            with tc.TorchMoeClient(SERVER.target, shared_memory=shm_mode,
                                   channel=channel) as c:
                for i, (dtype, tol) in enumerate(((torch.bfloat16, 1e-2),
                                                  (torch.float32, FP32_TOL))):
                    x, ids, w = self.inputs(5 + 20 * i, i, dtype)
                    fut = c.submit(x, ids, w, layer=layer)
                    y = c.result(fut)
                    self.assertEqual((fut.used_channel, fut.used_region),
                                     (channel, shm_mode != "off"), (name, c.channel_error,
                                                                    c.region_errors))
                    want = self.npc.forward(np_of(x), ids.numpy(), w.numpy(), layer=layer)
                    self.assertEqual(np_of(y).tobytes(), want.tobytes(), (name, dtype))
                    for e in ids.unique().tolist():
                        if e not in experts:
                            experts[e] = self.npc.expert_weights(layer, e)
                    ref = mc.reference_forward(x.float().numpy(), ids.numpy(), w.numpy(),
                                               experts)
                    self.assertLess(mc.relative_l2_error(y.float().numpy(), ref), tol, name)
                    out = torch.full_like(x, float("nan"))
                    self.assertIs(c.forward(x, ids, w, layer=layer, out=out), out)
                    self.assertTrue(torch.equal(out, y), name)

    def test_channel_calls_in_flight_and_refusal(self):
        with tc.TorchMoeClient(SERVER.target, shared_memory="auto", channel=True,
                               channel_slots=3) as c:
            calls = []
            for i in range(8):  # more than the slots: the rest go by gRPC
                x, ids, w = self.inputs(1 + 3 * i, 100 + i, (torch.bfloat16, torch.float32)[i % 2])
                calls.append((c.submit(x, ids, w, layer=i % self.info.num_layers,
                                       request_id=f"r{i}", return_timings=True),
                              x, ids, w, i % self.info.num_layers))
            self.assertEqual(sum(f.used_channel for f, *_ in calls), 3)
            for fut, x, ids, w, layer in reversed(calls):
                y = c.result(fut)
                want = self.npc.forward(np_of(x), ids.numpy(), w.numpy(), layer=layer)
                self.assertEqual(np_of(y).tobytes(), want.tobytes())
                self.assertTrue(fut.request_id.startswith("r"))
                self.assertGreater(fut.timings["total_us"], 0)
            x, ids, w = self.inputs(4, 200)
            with self.assertRaises(grpc.RpcError) as cm:
                c.forward(x, ids, w, layer=99)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIsInstance(cm.exception, mc.channel.ChannelError)
            routed = c.submit(x, layer=1, return_routing=True)
            y = c.result(routed)
            self.assertTrue(routed.used_channel)
            want = self.npc.forward_full(np_of(x), layer=1, return_routing=True)
            self.assertEqual(np_of(y).tobytes(), want.output.tobytes())
            self.assertTrue(np.array_equal(routed.topk_ids.numpy(), want.topk_ids))

    def test_channel_falls_back_when_the_server_detaches(self):
        with tc.TorchMoeClient(SERVER.target, shared_memory="off", channel="auto") as c:
            x, ids, w = self.inputs(3, 300)
            first = c.forward(x, ids, w)
            self.assertIsNotNone(c.channel)
            c.unregister_forward_channel(c.channel.name)  # the server detaches
            again = c.forward(x, ids, w)  # repeated by gRPC
            self.assertTrue(torch.equal(first, again))
            self.assertIsNone(c.channel)
            self.assertIsInstance(c.channel_error, grpc.RpcError)
            fut = c.submit(x, ids, w)
            self.assertFalse(fut.used_channel)
            self.assertTrue(torch.equal(c.result(fut), first))


class RegionRoutingTest(unittest.TestCase):
    """The region path with the routing in the region (CPU tensors, a system region)."""

    @classmethod
    def setUpClass(cls):
        cls.npc = mc.MoeClient(SERVER.target)
        cls.info = cls.npc.info()
        cls.seed = int.from_bytes(os.urandom(4), "little")
        print(f"RegionRoutingTest: seed {cls.seed}")

    @classmethod
    def tearDownClass(cls):
        cls.npc.close()

    def inputs(self, m, k, dtype=torch.bfloat16):
        g = torch.Generator().manual_seed(self.seed + k)
        h, e, topk = self.info.hidden, self.info.num_experts, self.info.topk
        x = torch.randn(m, h, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(m)]).int()
        w = torch.softmax(torch.randn(m, topk, generator=g), dim=1)
        return x, ids, w

    def want(self, x, ids, w, layer=0):
        return self.npc.forward(np_of(x), ids.numpy(), w.float().numpy(), layer=layer)

    def test_routing_in_the_region_every_input_form(self):
        layers = self.info.num_layers
        for channel in (False, True):
            with tc.TorchMoeClient(SERVER.target, shared_memory="system", channel=channel) as c:
                for i in range(6):
                    m, layer = (3, 17, 1)[i % 3], i % layers
                    x, ids, w = self.inputs(m, 10 * i)
                    want = self.want(x, ids, w, layer).tobytes()
                    forms = {
                        "int32/float32": (x, ids, w, want),
                        "int64/float64": (x, ids.long(), w.double(), want),
                        # the weights rounded to bfloat16 before they are sent as float32
                        "int16/bfloat16": (x, ids.short(), w.bfloat16(),
                                           self.want(x, ids, w.bfloat16(), layer).tobytes()),
                        "non-contiguous": (x.t().contiguous().t(), ids.t().contiguous().t(),
                                           w.t().contiguous().t(), want),
                    }
                    for form, (xi, ii, wi, wanted) in forms.items():
                        fut, parts, nbytes = c._prepare(xi, ii, wi, layer, "", False, False)
                        c._drop(fut)
                        # Only headers: nothing of the tensors travels with the call.
                        self.assertEqual(len(parts), 1, form)
                        self.assertLess(nbytes, 400, form)
                        fut = c.submit(xi, ii, wi, layer=layer)
                        y = c.result(fut)
                        self.assertEqual((fut.used_region, fut.used_channel), (True, channel),
                                         form)
                        self.assertEqual(np_of(y).tobytes(), wanted, (form, i, channel))
                # The server routes (no ids in the region) and returns its choice.
                x, _, _ = self.inputs(5, 99)
                fut = c.submit(x, layer=1, return_routing=True)
                y = c.result(fut)
                self.assertTrue(fut.used_region)
                full = self.npc.forward_full(np_of(x), layer=1, return_routing=True)
                self.assertEqual(np_of(y).tobytes(), full.output.tobytes())
                self.assertTrue(np.array_equal(fut.topk_ids.numpy(), full.topk_ids))
                # A request id is not cached into later calls.
                x, ids, w = self.inputs(4, 98)
                fut = c.submit(x, ids, w, request_id="once", return_timings=True)
                c.result(fut)
                self.assertEqual(fut.request_id, "once")
                fut = c.submit(x, ids, w, return_timings=True)
                c.result(fut)
                self.assertNotEqual(fut.request_id, "once")

    def test_out_reused_and_fresh_answers_alias_nothing(self):
        with tc.TorchMoeClient(SERVER.target, shared_memory="system", channel=True) as c:
            x0, i0, w0 = self.inputs(9, 1)
            x1, i1, w1 = self.inputs(9, 2)
            out = torch.full_like(x0, float("nan"))
            for x, ids, w in ((x0, i0, w0), (x1, i1, w1), (x0, i0, w0)):
                self.assertIs(c.forward(x, ids, w, out=out), out)
                self.assertEqual(np_of(out).tobytes(), self.want(x, ids, w).tobytes())
            y0 = c.forward(x0, i0, w0)
            y1 = c.forward(x1, i1, w1)
            self.assertNotEqual(y0.data_ptr(), y1.data_ptr())
            self.assertEqual(np_of(y0).tobytes(), self.want(x0, i0, w0).tobytes())
            self.assertEqual(np_of(y1).tobytes(), self.want(x1, i1, w1).tobytes())
            # A wrong `out` is refused and the region is given back (the next call works).
            with self.assertRaises(ValueError):
                c.forward(x0, i0, w0, out=torch.empty(8, x0.shape[1], dtype=x0.dtype))
            self.assertTrue(torch.equal(c.forward(x0, i0, w0), y0))
            self.assertEqual(len(c._regions_all), 1)

    def test_threaded_copy(self):
        copier = tc._Copier(3)
        try:
            rng = np.random.default_rng(self.seed)
            big = tc._Copier.MIN_BYTES
            for n in (1, 4095, big - 1, big, big + 1, 3 * big + 12345, 9 * big + 7):
                src = rng.integers(0, 256, n, dtype=np.uint8)
                dst = np.zeros(n + 64, dtype=np.uint8)
                copier(dst.ctypes.data + 32, src.ctypes.data, n)
                self.assertTrue(np.array_equal(dst[32:32 + n], src), n)
                self.assertFalse(dst[:32].any() or dst[32 + n:].any(), n)
        finally:
            copier.close()
        with tc.TorchMoeClient(SERVER.target, shared_memory="system", channel=False,
                               copy_threads=2) as c:
            self.assertEqual(c._memcpy.threads, 2)
            x, ids, w = self.inputs(6, 3)
            self.assertEqual(np_of(c.forward(x, ids, w)).tobytes(),
                             self.want(x, ids, w).tobytes())


class ZeroCopyTest(unittest.TestCase):
    """Tensors that live in regions of the client (alloc_hidden / alloc_routing / empty): sent
    as RegionRefs with nothing copied in, answered in place (CPU tensors, system regions)."""

    @classmethod
    def setUpClass(cls):
        cls.npc = mc.MoeClient(SERVER.target)
        cls.info = cls.npc.info()
        cls.seed = int.from_bytes(os.urandom(4), "little")
        print(f"ZeroCopyTest: seed {cls.seed}")
        cls.experts = {}

    @classmethod
    def tearDownClass(cls):
        cls.npc.close()

    def inputs(self, m, salt, dtype=torch.bfloat16):
        g = torch.Generator().manual_seed(self.seed + salt)
        h, e, k = self.info.hidden, self.info.num_experts, self.info.topk
        x = torch.randn(m, h, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).int()
        w = torch.softmax(torch.randn(m, k, generator=g), dim=1)
        return x, ids, w

    def check(self, y, x, ids, w, layer, tol, what):
        want = self.npc.forward(np_of(x), ids.numpy(), w.numpy(), layer=layer)
        self.assertEqual(np_of(y).tobytes(), want.tobytes(), what)
        for e in ids.unique().tolist():
            if (layer, e) not in self.experts:
                self.experts[layer, e] = self.npc.expert_weights(layer, e)
        experts = {e: self.experts[layer, e] for e in ids.unique().tolist()}
        ref = mc.reference_forward(x.float().numpy(), ids.numpy(), w.numpy(), experts)
        self.assertLess(mc.relative_l2_error(y.float().numpy(), ref), tol, what)

    def test_zero_copy_equals_copying_path_and_reference(self):
        layer = self.info.num_layers - 1
        for channel in (False, True):
            with tc.TorchMoeClient(SERVER.target, shared_memory="off", channel=channel) as c, \
                    tc.TorchMoeClient(SERVER.target, shared_memory="system",
                                      channel=channel) as copying:
                for i, (dtype, tol) in enumerate(((torch.bfloat16, 1e-2),
                                                  (torch.float32, FP32_TOL))):
                    big = 24
                    hid = c.alloc_hidden(big, dtype=dtype)
                    ids_r, w_r = c.alloc_routing(big)
                    self.assertEqual((tuple(hid.shape), hid.dtype, hid.device.type),
                                     ((big, self.info.hidden), dtype, "cpu"))
                    for j, m in enumerate((big, 7, 1)):  # the whole buffer and rows of it
                        x, ids, w = self.inputs(m, 100 * i + j, dtype)
                        hid[:m].copy_(x)
                        ids_r[:m].copy_(ids)
                        w_r[:m].copy_(w)
                        args = (hid[:m], ids_r[:m], w_r[:m])
                        # Only headers travel: no tensor bytes in the request.
                        fut, parts, nbytes = c._prepare(*args, layer, "", False, False, "region")
                        c._drop(fut)
                        self.assertLess(nbytes, 400)
                        self.assertTrue(fut.zero_copy)
                        fut = c.submit(*args, layer=layer, out="region")
                        y = c.result(fut)
                        what = (channel, dtype, m)
                        self.assertTrue(fut.zero_copy and fut.used_region, what)
                        self.assertEqual(fut.used_channel, channel, what)
                        # The answer is the view in the region's answer area, not a copy.
                        self.assertEqual(y.data_ptr(), c.answer_view(hid[:m]).data_ptr())
                        self.assertNotEqual(y.data_ptr(), hid.data_ptr())
                        self.check(y, x, ids, w, layer, tol, what)
                        y_copy = copying.forward(x, ids, w, layer=layer)
                        self.assertTrue(torch.equal(y, y_copy), what)
                        # out=None: a fresh tensor (the answer copied out of the region).
                        y2 = c.forward(*args, layer=layer)
                        self.assertNotEqual(y2.data_ptr(), y.data_ptr())
                        self.assertTrue(torch.equal(y2, y_copy), what)
                        # out=<a tensor of ours elsewhere>: filled with the answer.
                        o = torch.full_like(x, float("nan"))
                        self.assertIs(c.forward(*args, layer=layer, out=o), o)
                        self.assertTrue(torch.equal(o, y_copy), what)
                        # Routing as plain tensors (bytes) with hidden in place.
                        self.assertTrue(torch.equal(
                            c.forward(hid[:m], ids, w, layer=layer, out="region"), y_copy))

    def test_out_in_a_region_and_chained_layers(self):
        with tc.TorchMoeClient(SERVER.target, shared_memory="off", channel=True) as c:
            m = 9
            x, ids, w = self.inputs(m, 7)
            hid = c.alloc_hidden(m)
            hid.copy_(x)
            out = c.empty((m, self.info.hidden))
            fut, _, nbytes = c._prepare(hid, ids, w, 0, "", False, False, out)
            c._drop(fut)
            self.assertTrue(fut.zero_copy)
            self.assertIs(c.forward(hid, ids, w, out=out), out)
            self.check(out, x, ids, w, 0, 1e-2, "out in a region")
            # An answer view passed back as hidden (the next layer) is answered in the hidden
            # area: the areas swap.
            y0 = c.forward(hid, ids, w, layer=0, out="region")
            y0_value = y0.clone()
            y1 = c.forward(y0, ids, w, layer=1, out="region")
            self.assertEqual(y1.data_ptr(), hid.data_ptr())
            self.check(y1, y0_value, ids, w, 1, 1e-2, "chained")
            # Routing in a region made by empty().
            ids_r = c.empty(tuple(ids.shape), dtype=torch.int32)
            w_r = c.empty(tuple(w.shape), dtype=torch.float32)
            ids_r.copy_(ids)
            w_r.copy_(w)
            hid.copy_(x)
            fut, parts, nbytes = c._prepare(hid, ids_r, w_r, 0, "", False, False, "region")
            c._drop(fut)
            self.assertLess(nbytes, 400)
            self.check(c.forward(hid, ids_r, w_r, out="region"), x, ids, w, 0, 1e-2, "empty")

    def test_lifetime_rules_and_fallbacks(self):
        with tc.TorchMoeClient(SERVER.target, shared_memory="system", channel=False) as c:
            m = 5
            x, ids, w = self.inputs(m, 11)
            x2, _, _ = self.inputs(m, 12)
            hid = c.alloc_hidden(m)
            hid.copy_(x)
            # A second call whose answer lands where one in flight writes is refused.
            fut = c.submit(hid, ids, w, out="region")
            with self.assertRaises(RuntimeError):
                c.submit(hid, ids, w, out="region")
            y = c.result(fut)
            self.check(y, x, ids, w, 0, 1e-2, "first")
            # The view is the answer area: the next call on the same rows rewrites it.
            kept = y.clone()
            hid.copy_(x2)
            y_again = c.forward(hid, ids, w, out="region")
            self.assertEqual(y_again.data_ptr(), y.data_ptr())
            self.assertFalse(torch.equal(y, kept))
            self.check(y, x2, ids, w, 0, 1e-2, "rewritten")
            # A tensor outside any region still works (copy path), and out="region" needs one.
            self.check(c.forward(x, ids, w), x, ids, w, 0, 1e-2, "copy path")
            with self.assertRaises(ValueError):
                c.forward(x, ids, w, out="region")
            # Non-contiguous rows of a region tensor go by the copy path too.
            big = c.alloc_hidden(2 * m)
            big.copy_(torch.cat([x, x2]))
            strided = big[::2]
            fut, _, nbytes = c._prepare(strided, ids, w, 0, "", False, False)
            c._drop(fut)
            self.assertFalse(fut.zero_copy)
            self.check(c.forward(strided, ids, w), strided.clone(), ids, w, 0, 1e-2, "strided")
            # After release() the server no longer sees the region: the copy path, same answer;
            # the tensor's memory stays valid while it is referenced.
            c.release(hid)
            hid.copy_(x)
            fut = c.submit(hid, ids, w)
            y = c.result(fut)
            self.assertFalse(fut.zero_copy)
            self.check(y, x, ids, w, 0, 1e-2, "released")
            with self.assertRaises(ValueError):
                c.release(hid)
            # Server routing with hidden in place.
            big[:m].copy_(x)
            fut = c.submit(big[:m], layer=1, return_routing=True, out="region")
            y = c.result(fut)
            self.assertTrue(fut.zero_copy)
            full = self.npc.forward_full(np_of(x), layer=1, return_routing=True)
            self.assertEqual(np_of(y).tobytes(), full.output.tobytes())


class _Failing:
    """In place of a client's grpcio Forward (c._forward): every call fails with `error`, as
    a client-side deadline does (the server may still run the call)."""

    class _Future:
        def __init__(self, error):
            self._error = error

        def done(self):
            return True

        def result(self):
            raise self._error

    def __init__(self, error):
        self.error = error

    def __call__(self, request, timeout=None):
        raise self.error

    def future(self, request, timeout=None):
        return self._Future(self.error)


def _call_error(code, message="a client-side failure (fake)"):
    return tc._native.CallError(code.value[0], message)


_RESULT_AFTER_CLOSE = r"""
import sys, time
sys.path.insert(0, sys.argv[2])
import torch
from moeserve_client import torch_client as tc
for native in (False, True):
    for channel in (False, True):
        for shm in ("system", "off"):
            what = f"native={native} channel={channel} shared_memory={shm}"
            try:
                c = tc.TorchMoeClient(sys.argv[1], shared_memory=shm, channel=channel,
                                      native=native)
            except OSError:
                print("no native library", flush=True)
                continue
            info = c.info()
            x = torch.randn(3, info.hidden).bfloat16()
            ids = torch.arange(info.topk, dtype=torch.int32).repeat(3, 1)
            w = torch.full((3, info.topk), 0.5)
            done = c.submit(x, ids, w)
            while not done.done():
                time.sleep(0.001)
            pending = c.submit(x, ids, w)
            c.close()
            for name, fut in (("done", done), ("pending", pending)):
                try:
                    c.result(fut)
                    print("ANSWERED", name, what, flush=True)
                except RuntimeError as e:
                    print("refused", name, what, e, flush=True)
            try:
                c.submit(x, ids, w)
                print("SUBMITTED", what, flush=True)
            except RuntimeError:
                print("refused submit", what, flush=True)
print("survived", flush=True)
"""


class FailuresAndCloseTest(unittest.TestCase):
    """What a failed or given-up call leaves behind: result() after close() raises (no read
    of an unmapped region: run in a subprocess, a crash is a signal); a region whose call
    failed without the server's answer (the server may still write into it) is not reused
    until the server lets go of it, nor are a zero-copy call's bytes; a server error gives the
    region back at once; a CUDA region the server refuses to unregister is never freed."""

    @classmethod
    def setUpClass(cls):
        cls.npc = mc.MoeClient(SERVER.target)
        cls.info = cls.npc.info()

    @classmethod
    def tearDownClass(cls):
        cls.npc.close()

    def inputs(self, m, seed):
        g = torch.Generator().manual_seed(seed)
        h, e, k = self.info.hidden, self.info.num_experts, self.info.topk
        x = torch.randn(m, h, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).int()
        w = torch.softmax(torch.randn(m, k, generator=g), dim=1)
        return x, ids, w

    def want(self, x, ids, w):
        return self.npc.forward(np_of(x), ids.numpy(), w.numpy()).tobytes()

    def registered(self, name):
        return any(r["name"] == name for r in mc.shared_memory.status(self.npc))

    def test_result_after_close_raises(self):
        r = subprocess.run([sys.executable, "-c", _RESULT_AFTER_CLOSE, SERVER.target,
                            os.path.join(ARGS.source_dir, "clients", "python")],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)  # < 0: killed by a signal
        lines = r.stdout.splitlines()
        self.assertEqual(lines[-1], "survived")
        self.assertEqual([ln for ln in lines if ln.startswith(("ANSWERED", "SUBMITTED"))], [])
        self.assertGreaterEqual(sum(ln.startswith("refused done") for ln in lines), 4, lines)
        self.assertTrue(any("client is closed" in ln for ln in lines), lines)

    def test_region_of_an_unanswered_call_is_not_reused(self):
        x, ids, w = self.inputs(5, 1)
        want = self.want(x, ids, w)
        with tc.TorchMoeClient(SERVER.target, shared_memory="system", channel=False,
                               native=False) as c:
            self.assertEqual(np_of(c.forward(x, ids, w)).tobytes(), want)
            (first,) = c._regions_all
            grpc_forward = c._forward
            # A server error is the server's answer: the region is reused at once.
            with self.assertRaises(grpc.RpcError):
                c.forward(x, ids, w, layer=99)
            self.assertEqual((c._regions_all, c._regions_free["cpu"]), ([first], [first]))
            # Failures without an answer (the client's deadline, a broken connection), blocking
            # and in flight: quarantined, never given to the next call, not freed while the
            # server holds it.
            for code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                for blocking in (True, False):
                    region = c._regions_free["cpu"][0]
                    c._forward = _Failing(_call_error(code))
                    with self.assertRaises(grpc.RpcError):
                        if blocking:
                            c.forward(x, ids, w)
                        else:
                            c.result(c.submit(x, ids, w))
                    c._forward = grpc_forward
                    self.assertEqual(c._regions_free["cpu"], [], (code, blocking))
                    self.assertIn(region, c._regions_quarantined)
                    self.assertNotIn(region, c._regions_all)
                    with mock.patch.object(tc, "_unregister_region", return_value=False):
                        c._quarantine_swept = 0.0
                        self.assertEqual(np_of(c.forward(x, ids, w)).tobytes(), want)
                    self.assertIn(region, c._regions_quarantined)  # the server refused
                    self.assertFalse(region.closed)
                    self.assertTrue(self.registered(region.name))
                    self.assertEqual(len(c._regions_free["cpu"]), 1)
                    self.assertIsNot(c._regions_free["cpu"][0], region)
                    # Once the server lets go of it (Unregister OK), it is freed.
                    c._quarantine_swept = 0.0
                    self.assertEqual(np_of(c.forward(x, ids, w)).tobytes(), want)
                    self.assertNotIn(region, c._regions_quarantined)
                    self.assertTrue(region.closed)
                    self.assertFalse(self.registered(region.name))
            self.assertEqual(c._regions_quarantined, [])
            # Through the forward channel: its own failure (no answer) quarantines too.
        with tc.TorchMoeClient(SERVER.target, shared_memory="system", channel=True) as c:
            self.assertEqual(np_of(c.forward(x, ids, w)).tobytes(), want)
            region = c._regions_free["cpu"][0]
            fail = mc.channel.ChannelError(mc.channel.DEADLINE_EXCEEDED, "no answer (fake)")
            with mock.patch.object(c.channel, "result", side_effect=fail):
                fut = c.submit(x, ids, w)
                self.assertTrue(fut.used_channel)
                with self.assertRaises(grpc.RpcError):
                    c.result(fut)
            self.assertNotIn(region, c._regions_free["cpu"])
            self.assertIn(region, c._regions_quarantined)
            self.assertEqual(np_of(c.forward(x, ids, w)).tobytes(), want)

    def test_real_client_deadline_quarantines_the_region(self):
        # A server whose calls wait 0.5 s for others to join their step: a 0.05 s deadline
        # ends each call at the client while the server still holds its region.
        from run_integration import Cli, Server
        x, ids, w = self.inputs(4, 2)
        want = self.want(x, ids, w)
        with tempfile.TemporaryDirectory(prefix="moeserve_torch_slow_") as d:
            with Server(ARGS.server, d, extra_args=["--enable_shared_memory",
                                                    "--max_batch_delay_us", "500000"]) as server:
                server.wait_ready(Cli(ARGS.cli))
                with mc.MoeClient(server.target, native=False) as npc:
                    def in_flight(name):
                        return [r["calls_in_flight"] for r in mc.shared_memory.status(npc)
                                if r["name"] == name]

                    for native in (False, True):
                        try:
                            c = tc.TorchMoeClient(server.target, shared_memory="system",
                                                  channel=False, native=native)
                        except OSError:
                            continue  # no C++ client library
                        with c:
                            self.assertEqual(np_of(c.forward(x, ids, w)).tobytes(), want)
                            region = c._regions_free["cpu"][0]
                            with self.assertRaises(grpc.RpcError) as cm:
                                c.forward(x, ids, w, timeout=0.05)
                            self.assertEqual(cm.exception.code(),
                                             grpc.StatusCode.DEADLINE_EXCEEDED)
                            self.assertNotIn(region, c._regions_free["cpu"], native)
                            self.assertIn(region, c._regions_quarantined)
                            self.assertEqual(in_flight(region.name), [1])  # still running
                            # The next call takes another region; the old one is freed only
                            # once the server lets go of it (Unregister refused until then).
                            self.assertEqual(np_of(c.forward(x, ids, w)).tobytes(), want)
                            self.assertNotIn(region, c._regions_free["cpu"])
                            give_up = time.monotonic() + 10
                            while not region.closed and time.monotonic() < give_up:
                                self.assertTrue(in_flight(region.name), native)  # registered
                                c._quarantine_swept = 0.0
                                c._sweep_quarantine()
                                time.sleep(0.02)
                            self.assertTrue(region.closed, native)
                            self.assertEqual(in_flight(region.name), [])  # unregistered
                server.terminate_and_check(30)

    def test_zero_copy_bytes_of_an_unanswered_call_stay_busy(self):
        x, ids, w = self.inputs(4, 3)
        want = self.want(x, ids, w)
        with tc.TorchMoeClient(SERVER.target, shared_memory="system", channel=False,
                               native=False) as c:
            hid = c.alloc_hidden(8)
            hid[:4].copy_(x)
            hid[4:].copy_(x)
            zc = c._zc[0]
            grpc_forward = c._forward
            c._forward = _Failing(_call_error(grpc.StatusCode.DEADLINE_EXCEEDED))
            with self.assertRaises(grpc.RpcError):
                c.forward(hid[:4], ids, w, out="region")
            c._forward = grpc_forward
            self.assertEqual(zc.busy, [])
            # The server says a call still runs on the region: those rows are refused; other
            # rows are free.
            with mock.patch.object(c, "_region_calls_in_flight", return_value=1, create=True):
                with self.assertRaisesRegex(RuntimeError, "failed without the server's answer"):
                    c.forward(hid[:4], ids, w, out="region")
                self.assertEqual(np_of(c.forward(hid[4:], ids, w, out="region")).tobytes(),
                                 want)
            self.assertEqual(len(zc.abandoned), 1)
            # It runs none now: the rows are free again.
            self.assertEqual(np_of(c.forward(hid[:4], ids, w, out="region")).tobytes(), want)
            self.assertEqual((zc.busy, zc.abandoned), ([], []))
            # A server error is an answer: nothing stays busy.
            with self.assertRaises(grpc.RpcError):
                c.forward(hid[:4], ids, w, layer=99, out="region")
            self.assertEqual((zc.busy, zc.abandoned), ([], []))

    def test_refused_unregister_never_frees_cuda_memory(self):
        # Fakes of the server and the CUDA runtime: this runs without a GPU.
        class Stub:
            def __init__(self, codes):
                self.codes = list(codes)

            def UnregisterSharedMemory(self, request, timeout=None):
                code = self.codes.pop(0)
                if code is not None:
                    raise _call_error(code, "fake")

        class Client:
            timeout = 1.0

            def __init__(self, *codes):
                self._stub = Stub(codes)

        class Lib:
            freed = []

            def cudaFree(self, ptr):
                self.freed.append(ptr.value)

        busy = grpc.StatusCode.FAILED_PRECONDITION

        def cuda_region(client, ptr):
            r = object.__new__(tc._CudaRegion)
            r.__dict__.update(client=client, name=f"fake-{ptr}", registered=True, closed=False,
                              _lock=tc.threading.Lock(), _views={}, buf=torch.empty(1),
                              ptr=ptr, index=0, capacity=2 << 20)
            return r

        with mock.patch.object(tc, "_cudart", return_value=Lib()), \
                mock.patch.object(torch.cuda, "synchronize"):
            # Refused (a call still runs on it): not freed, kept, with a warning.
            r = cuda_region(Client(busy), 0x1000)
            with self.assertWarnsRegex(RuntimeWarning, "fake-4096"):
                r.close()
            self.assertEqual(Lib.freed, [])
            self.assertIn(0x1000, tc._leaked)
            # Refused for a moment, then unregistered before give_up: freed.
            r = cuda_region(Client(busy, busy, None), 0x2000)
            r.close(time.monotonic() + 5)
            self.assertEqual(Lib.freed, [0x2000])
            # The server gone (UNAVAILABLE) or not knowing it (NOT_FOUND): freed.
            for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND):
                cuda_region(Client(code), 0x3000).close()
            self.assertEqual(Lib.freed, [0x2000, 0x3000, 0x3000])
        # A zero-copy CUDA region: its memory (held by the base tensor) is kept for good.
        z = object.__new__(tc._ZeroCopyRegion)
        base = torch.empty(8, dtype=torch.uint8)
        z.__dict__.update(client=Client(grpc.StatusCode.DEADLINE_EXCEEDED), name="fake-zc",
                          registered=True, kind="cuda", base=base, capacity=8, _mm=None)
        with self.assertWarnsRegex(RuntimeWarning, "fake-zc"):
            z.close()
        self.assertTrue(any(t is base for t in tc._leaked))


class NativeTest(unittest.TestCase):
    """The gRPC calls by the C++ client (native=True, libmoeserve_client_c at
    $MOESERVE_CLIENT_LIB) against grpcio's (native=False): the same answers, bytes for bytes,
    for every dtype, id dtype, blocking and in-flight calls, `out` given or not, header fields,
    routing on the server, tensors in a system region, CUDA tensors; the same refusals."""

    @classmethod
    def setUpClass(cls):
        try:
            cls.nat = tc.TorchMoeClient(SERVER.target, shared_memory="off", channel=False,
                                        native=True)
        except OSError as e:
            raise unittest.SkipTest(f"no native client library: {e}")
        cls.grp = tc.TorchMoeClient(SERVER.target, shared_memory="off", channel=False,
                                    native=False)
        cls.info = cls.grp.info()
        cls.seed = int.from_bytes(os.urandom(4), "little")
        print(f"NativeTest: seed {cls.seed}", file=sys.stderr)

    @classmethod
    def tearDownClass(cls):
        cls.nat.close()
        cls.grp.close()

    def inputs(self, m, seed, dtype=torch.bfloat16, ids_dtype=torch.int32):
        g = torch.Generator().manual_seed(self.seed + seed)
        h, e, k = self.info.hidden, self.info.num_experts, self.info.topk
        x = torch.randn(m, h, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).to(ids_dtype)
        w = torch.softmax(torch.randn(m, k, generator=g), dim=1)
        return x, ids, w

    def test_same_answers_as_grpcio(self):
        self.assertTrue(self.nat.uses_native)
        self.assertFalse(self.grp.uses_native)
        layer = self.info.num_layers - 1
        for i, (dtype, ids_dtype) in enumerate(((torch.bfloat16, torch.int32),
                                                (torch.float16, torch.int64),
                                                (torch.float32, torch.int16))):
            x, ids, w = self.inputs(3 + 7 * i, i, dtype, ids_dtype)
            want = self.grp.forward(x, ids, w, layer=layer)
            y = self.nat.forward(x, ids, w, layer=layer)
            self.assertEqual((y.dtype, y.shape), (dtype, x.shape))
            self.assertEqual(np_of(y).tobytes(), np_of(want).tobytes(), dtype)
            out = torch.empty_like(x)
            self.assertIs(self.nat.forward(x, ids, w.double(), layer=layer, out=out), out)
            self.assertEqual(np_of(out).tobytes(), np_of(want).tobytes())
            # A strided `out` is filled through a copy.
            wide = torch.zeros(x.shape[0], 2 * x.shape[1], dtype=dtype)
            view = wide[:, ::2]
            self.nat.forward(x, ids, w, layer=layer, out=view)
            self.assertEqual(np_of(view.contiguous()).tobytes(), np_of(want).tobytes())
            self.assertEqual(int(wide[:, 1::2].abs().sum()), 0)

    def test_common_call_takes_the_fast_path(self):
        x, ids, w = self.inputs(5, 60)
        want = self.grp.forward(x, ids, w)

        class Taken(Exception):
            pass

        def general(*args, **kwargs):
            raise Taken()

        self.nat._prepare = general  # the general path would raise
        try:
            y = self.nat.forward(x, ids, w)
            self.assertEqual(np_of(y).tobytes(), np_of(want).tobytes())
            out = torch.empty_like(x)
            self.assertIs(self.nat.forward(x, ids.long(), w, out=out), out)
            self.assertEqual(np_of(out).tobytes(), np_of(want).tobytes())
            # Anything else takes the general path: float64 weights, a strided out, timings.
            for kwargs in ({"topk_weights": w.double()}, {"out": torch.empty(
                    x.shape[1], x.shape[0], dtype=x.dtype).t()}, {"return_timings": True}):
                args = {"topk_ids": ids, "topk_weights": w, **kwargs}
                with self.assertRaises(Taken, msg=str(kwargs.keys())):
                    self.nat.forward(x, **args)
        finally:
            del self.nat._prepare

    def test_in_flight_header_and_server_routing(self):
        futs = []
        for i in range(6):
            x, ids, w = self.inputs(2 + i, 10 + i)
            futs.append((self.nat.submit(x, ids, w, layer=i % self.info.num_layers,
                                         request_id=f"n{i}", return_timings=True), x, ids, w,
                         i % self.info.num_layers))
        for fut, x, ids, w, layer in reversed(futs):
            self.assertIsInstance(fut._call, tc._native.NativeCall)
            y = self.nat.result(fut)
            self.assertTrue(fut.done())
            self.assertEqual(np_of(y).tobytes(), np_of(self.grp.forward(x, ids, w, layer=layer))
                             .tobytes())
            self.assertEqual(fut.request_id[0], "n")
            self.assertGreater(fut.timings["total_us"], 0)
        x, _, _ = self.inputs(9, 20)
        a = self.nat.submit(x, return_routing=True)
        b = self.grp.submit(x, return_routing=True)
        ya, yb = self.nat.result(a), self.grp.result(b)
        self.assertEqual(np_of(ya).tobytes(), np_of(yb).tobytes())
        self.assertTrue(torch.equal(a.topk_ids, b.topk_ids))
        self.assertTrue(torch.equal(a.topk_weights, b.topk_weights))
        # A future dropped before its result: freed once answered (it borrows x).
        self.nat.submit(x)

    def test_same_refusals(self):
        x, ids, w = self.inputs(4, 30)
        bad = ids.clone()
        bad[1, 0] = self.info.num_experts + 1
        for c in (self.nat, self.grp):
            with self.assertRaises(grpc.RpcError) as cm:
                c.forward(x, bad, w)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("topk_ids", cm.exception.details())
            with self.assertRaisesRegex(ValueError, "out is"):
                c.forward(x, ids, w, out=torch.empty(3, x.shape[1], dtype=x.dtype))
        # A server that accepts the connection and never answers: the deadline ends the call.
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen(8)
            with tc.TorchMoeClient(f"127.0.0.1:{silent.getsockname()[1]}", shared_memory="off",
                                   channel=False, native=True) as c:
                with self.assertRaises(grpc.RpcError) as cm:
                    c.forward(x, ids, w, timeout=0.3)
                self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        y = self.nat.forward(x, ids, w)  # still works
        self.assertEqual(np_of(y).tobytes(), np_of(self.grp.forward(x, ids, w)).tobytes())

    def test_system_region_requests_go_native(self):
        with tc.TorchMoeClient(SERVER.target, shared_memory="system", channel=False,
                               native=True) as c:
            for m, routed in ((5, True), (3, False)):
                x, ids, w = self.inputs(m, 40 + m)
                if routed:
                    fut = c.submit(x, ids, w, return_timings=True)
                    y = c.result(fut)
                    want = self.grp.forward(x, ids, w)
                else:
                    fut = c.submit(x, return_timings=True)
                    y = c.result(fut)
                    want = self.grp.forward(x)
                self.assertTrue(fut.used_region, c.region_errors)
                self.assertIsInstance(fut._call, tc._native.NativeCall)
                self.assertEqual(np_of(y).tobytes(), np_of(want).tobytes())
                self.assertEqual(np_of(c.forward(x, ids, w) if routed else c.forward(x))
                                 .tobytes(), np_of(want).tobytes())

    def test_bearer_token_by_both_paths(self):
        from run_integration import Cli, Server
        token = "a-torch-client-token-" + str(self.seed)
        with tempfile.TemporaryDirectory(prefix="moeserve_torch_auth_") as d:
            tokens = os.path.join(d, "tokens")
            with open(tokens, "w") as f:
                f.write(token + "\n")
            with Server(ARGS.server, d, extra_args=["--auth_token_file", tokens]) as server:
                server.wait_ready(Cli(ARGS.cli))
                x, ids, w = self.inputs(3, 70)
                want = self.grp.forward(x, ids, w)
                for native in (True, False):
                    with tc.TorchMoeClient(server.target, shared_memory="off", channel=False,
                                           native=native, auth_token=token) as c:
                        self.assertEqual(c.info().hidden, self.info.hidden)  # grpcio stub
                        y = c.forward(x, ids, w)
                        self.assertEqual(np_of(y).tobytes(), np_of(want).tobytes(), native)
                        self.assertEqual(np_of(c.result(c.submit(x, ids, w))).tobytes(),
                                         np_of(want).tobytes(), native)
                    with tc.TorchMoeClient(server.target, shared_memory="off", channel=False,
                                           native=native) as c:
                        with self.assertRaises(grpc.RpcError) as cm:
                            c.forward(x, ids, w)
                        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAUTHENTICATED,
                                         native)
                server.terminate_and_check(30)

    @unittest.skipUnless(torch.cuda.is_available(), "no CUDA device")
    def test_cuda_tensors_by_bytes(self):
        x, ids, w = self.inputs(6, 50)
        want = self.grp.forward(x, ids, w)
        xd, idsd, wd = x.cuda(), ids.cuda(), w.cuda()
        y = self.nat.forward(xd, idsd, wd)
        self.assertEqual(y.device.type, "cuda")
        self.assertEqual(np_of(y.cpu()).tobytes(), np_of(want).tobytes())
        futs = [self.nat.submit(xd, idsd, wd) for _ in range(3)]
        for f in futs:
            self.assertEqual(np_of(self.nat.result(f).cpu()).tobytes(), np_of(want).tobytes())
        out = torch.empty_like(xd)
        self.nat.forward(xd, idsd, wd, out=out)
        self.assertEqual(np_of(out.cpu()).tobytes(), np_of(want).tobytes())


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--cli", required=True)
    p.add_argument("--source-dir", required=True)
    ARGS, rest = p.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
