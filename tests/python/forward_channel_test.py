#!/usr/bin/env python3
"""moeserve_client.channel.ForwardChannel (the forward channel's client side) against a fake
server written here: a child process that follows the server side of
proto/moeserve/v1/forward_channel.h with its own reading of the layout (struct offsets, not the
client's constants), so that it runs without the real server:

  * the header the client writes (magic "MSFC", version, slots, slot bytes, zeroed words);
  * calls one after another and from several threads each get their own answer (the fake
    server answers output = 2 * hidden + layer, FP32, request_id echoed), fresh random inputs;
  * several slots in flight, answered in reverse order; try_submit when all slots are busy;
  * an error status (INVALID_ARGUMENT and its message), a request larger than a slot (refused
    by the client, slot released), a call that outlives its deadline, the sleeping (futex) wait;
  * a server that detaches: the waiting call and every later one get UNAVAILABLE;
  * close() unregisters and unlinks the object.
With --server / --cli, also end to end through the real server (tiny model, CPU backend, run
with --enable_shared_memory): inline FP32 and BF16 tensors and tensors in a system region, each
against the numpy reference of the served experts (relative L2: FP32 1e-5, BF16 1e-2) with
fresh random inputs, and equal to the gRPC Forward's answer; several calls in flight; a refusal
(a hidden tensor of the wrong byte length: INVALID_ARGUMENT through the channel, which goes on
working); unregistering detaches the server.

  forward_channel_test.py --source-dir REPO [--server BIN/moeserve --cli BIN/moeserve-cli]
"""

import argparse
import ctypes
import mmap
import multiprocessing
import os
import struct
import sys
import threading
import time
import unittest

import numpy as np

ARGS = None
ch = pb = grpc = None

# The layout, as the fake server reads proto/moeserve/v1/forward_channel.h.
HDR_DOORBELL, HDR_SLEEPING, HDR_ATTACHED, HDR_SLOTS = 64, 128, 192, 256
S_STATE, S_WAITING, S_REQ, S_ANS, S_CODE, S_TIMEOUT, S_SEQ, S_ASEQ, S_PAYLOAD = (
    0, 4, 8, 12, 16, 24, 32, 40, 64)
FREE, REQUEST, TAKEN, ANSWER = 0, 1, 2, 3


def fake_server(conn, source_dir):
    """The server side, in a child process. Commands on `conn`: ("attach", key, byte_size) ->
    (num_slots, slot_bytes); ("detach",). Requests by layer: 99 INVALID_ARGUMENT; 77 held
    until 4 are held, then answered in reverse order; 66 detach without answering; 55 answer
    after 30 ms; 44 never answered; else output = 2 * hidden + layer."""
    sys.path.insert(0, os.path.join(source_dir, "clients", "python"))
    from moeserve_client import channel as c  # only for its futex helpers
    from moeserve_client.gen.moeserve.v1 import moeserve_pb2 as p

    _, key, size = conn.recv()
    fd = os.open("/dev/shm" + key, os.O_RDWR)
    mm = mmap.mmap(fd, size)
    os.close(fd)
    magic, version, num_slots, _, slot_bytes = struct.unpack_from("<IIIIQ", mm, 0)
    base = np.frombuffer(mm, np.uint8).ctypes.data

    def u32(off, value=None):
        if value is None:
            return struct.unpack_from("<I", mm, off)[0]
        struct.pack_into("<I", mm, off, value)

    if magic != 0x4346534D or version != 1:
        conn.send(("refused", magic, version))
        return
    u32(HDR_ATTACHED, 1)
    conn.send(("ok", num_slots, slot_bytes))
    held = []

    def answer(slot, code, payload):
        off = HDR_SLOTS + slot * slot_bytes
        mm[off + S_PAYLOAD:off + S_PAYLOAD + len(payload)] = payload
        struct.pack_into("<Ii", mm, off + S_ANS, len(payload), code)
        struct.pack_into("<Q", mm, off + S_ASEQ, struct.unpack_from("<Q", mm, off + S_SEQ)[0])
        u32(off + S_STATE, ANSWER)
        if u32(off + S_WAITING):
            c.futex_wake(base + off + S_STATE, 1)

    while True:
        if conn.poll():
            conn.recv()  # detach
            break
        work = False
        for slot in range(num_slots):
            off = HDR_SLOTS + slot * slot_bytes
            if u32(off + S_STATE) != REQUEST:
                continue
            work = True
            u32(off + S_STATE, TAKEN)
            n = u32(off + S_REQ)
            if n > slot_bytes - S_PAYLOAD:
                answer(slot, 3, b"request_bytes past the payload")
                continue
            try:
                req = p.ForwardRequest.FromString(bytes(mm[off + S_PAYLOAD:off + S_PAYLOAD + n]))
            except Exception:  # noqa: BLE001  (as the real server: answered, never dropped)
                answer(slot, 3, b"the request does not parse")
                continue
            if req.layer == 99:
                answer(slot, 3, b"layer 99: no such layer (the model has 4)")
            elif req.layer == 77:
                held.append((slot, req))
                if len(held) == 4:
                    for s, r in reversed(held):
                        answer(s, 0, reply(p, r))
                    held = []
            elif req.layer == 66:
                u32(HDR_ATTACHED, 0)
                conn.recv()
                return
            elif req.layer == 44:
                pass
            else:
                if req.layer == 55:
                    time.sleep(0.03)
                answer(slot, 0, reply(p, req))
        if not work:
            bell = u32(HDR_DOORBELL)
            u32(HDR_SLEEPING, 1)
            c.futex_wait(base + HDR_DOORBELL, bell, 0.001)
            u32(HDR_SLEEPING, 0)
    u32(HDR_ATTACHED, 0)


def reply(p, req):
    x = np.frombuffer(req.hidden_states.data, "<f4")
    y = (2 * x + req.layer).astype("<f4")
    out = p.Tensor(dtype=p.DTYPE_FP32, shape=list(req.hidden_states.shape), data=y.tobytes())
    return p.ForwardResponse(output=out, request_id=req.request_id).SerializeToString()


class FakeClient:
    """What ForwardChannel.register needs of a MoeClient, backed by the fake server."""

    def __init__(self, source_dir):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=fake_server, args=(child, source_dir), daemon=True)
        self.proc.start()
        self.registered = []

    def register_forward_channel(self, name, key, byte_size, timeout=None):
        self.conn.send(("attach", key, byte_size))
        got = self.conn.recv()
        if got[0] != "ok":
            raise RuntimeError(f"fake server refused the header: {got}")
        self.registered.append(name)

        class Reply:
            num_slots, slot_bytes, spin_us = got[1], got[2], 50
        return Reply

    def unregister_forward_channel(self, name="", timeout=None):
        self.registered.remove(name)
        if self.proc.is_alive():
            self.conn.send(("detach",))

    def stop(self):
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def request(x, layer, request_id=""):
    t = pb.Tensor(dtype=pb.DTYPE_FP32, shape=list(x.shape), data=x.astype("<f4").tobytes())
    return pb.ForwardRequest(layer=layer, hidden_states=t,
                             request_id=request_id).SerializeToString()


class ForwardChannelTest(unittest.TestCase):
    def setUp(self):
        self.rng = np.random.default_rng()
        self.client = FakeClient(ARGS.source_dir)
        self.ch = ch.ForwardChannel.open(self.client, num_slots=4, slot_bytes=64 << 10,
                                         spin_us=100)
        forward = self.ch.forward
        # A bound on every call: a broken client or fake server fails the test, never hangs it.
        self.ch.forward = lambda req, timeout=10, reader=None: forward(req, timeout, reader)

    def tearDown(self):
        key = self.ch.key
        self.ch.close()
        self.assertFalse(os.path.exists("/dev/shm" + key), "close() must unlink the object")
        self.assertEqual(self.client.registered, [])
        self.client.stop()

    def check_answer(self, status, payload, x, layer, request_id=""):
        self.assertEqual(status, 0, payload)
        r = pb.ForwardResponse.FromString(payload)
        self.assertEqual(r.request_id, request_id)
        self.assertEqual(list(r.output.shape), list(x.shape))
        y = np.frombuffer(r.output.data, "<f4").reshape(x.shape)
        np.testing.assert_array_equal(y, (2 * x.astype(np.float32) + layer).astype(np.float32))

    def test_header_layout(self):
        mm = self.ch._mm
        self.assertEqual(bytes(mm[0:4]), b"MSFC")
        self.assertEqual(struct.unpack_from("<IIIIQ", mm, 0), (0x4346534D, 1, 4, 0, 64 << 10))
        self.assertEqual(bytes(mm[24:64]), bytes(40))
        self.assertEqual(self.ch.byte_size, 256 + 4 * (64 << 10))
        self.assertEqual(os.fstat(os.open("/dev/shm" + self.ch.key, os.O_RDONLY)).st_size,
                         self.ch.byte_size)
        self.assertTrue(self.ch.key.startswith(f"/moeserve-ch-{os.getpid()}-"))
        self.assertTrue(self.ch.server_attached)

    def test_calls_in_order(self):
        for i in range(40):
            x = self.rng.standard_normal((1 + i % 7, 16)).astype(np.float32)
            status, payload = self.ch.forward(request(x, i % 4, f"r{i}"), timeout=5)
            self.check_answer(status, payload, x, i % 4, f"r{i}")

    def test_memory_fences_where_the_hardware_reorders(self):
        # arm64 reorders plain stores and loads: a fence before each request's state word and
        # after each answered one; x86-64 needs none.
        import platform
        self.assertEqual(ch.WEAK_MEMORY_ORDER,
                         platform.machine().lower() in ("aarch64", "arm64"))
        fence = ctypes.addressof(ch._fence_word)
        fences = []
        wake = ch.futex_wake

        def counting_wake(addr, count=1):
            if addr == fence:
                fences.append(addr)
            return wake(addr, count)
        saved = ch.WEAK_MEMORY_ORDER
        ch.futex_wake, ch.WEAK_MEMORY_ORDER = counting_wake, True
        try:
            for i in range(3):
                x = self.rng.standard_normal((2, 16)).astype(np.float32)
                self.check_answer(*self.ch.forward(request(x, 1, f"f{i}")), x, 1, f"f{i}")
        finally:
            ch.futex_wake, ch.WEAK_MEMORY_ORDER = wake, saved
        self.assertEqual(len(fences), 6)
        fences.clear()
        ch.futex_wake, ch.WEAK_MEMORY_ORDER = counting_wake, False
        try:
            x = self.rng.standard_normal((2, 16)).astype(np.float32)
            self.check_answer(*self.ch.forward(request(x, 1, "n")), x, 1, "n")
        finally:
            ch.futex_wake, ch.WEAK_MEMORY_ORDER = wake, saved
        self.assertEqual(fences, [])

    def test_request_in_parts(self):
        x = self.rng.standard_normal((3, 8)).astype(np.float32)
        raw = request(x, 2, "parts")
        parts = [raw[:5], memoryview(raw)[5:17], bytearray(raw[17:])]
        self.check_answer(*self.ch.forward(parts), x, 2, "parts")

    def test_slots_in_flight_answered_out_of_order(self):
        xs = [self.rng.standard_normal((2 + i, 32)).astype(np.float32) for i in range(4)]
        futs = [self.ch.submit(request(x, 77, f"h{i}")) for i, x in enumerate(xs)]
        self.assertEqual(len({f.slot.index for f in futs}), 4)
        # every slot is in use until one is answered
        x5 = self.rng.standard_normal((1, 32)).astype(np.float32)
        # (the 4th request released all four answers; wait for them before probing)
        for f in futs:
            while not f.done():
                time.sleep(0.001)
        for i in (2, 0, 3, 1):
            self.check_answer(*self.ch.result(futs[i]), xs[i], 77, f"h{i}")
        with self.assertRaises(RuntimeError):
            self.ch.result(futs[0])
        self.check_answer(*self.ch.forward(request(x5, 1)), x5, 1)

    def test_try_submit_when_all_slots_busy(self):
        xs = [self.rng.standard_normal((1, 4)).astype(np.float32) for _ in range(4)]
        futs = [self.ch.try_submit(request(x, 77)) for x in xs[:3]]
        self.assertTrue(all(f is not None for f in futs))
        stalled = self.ch.submit(request(xs[3], 44))  # the fourth slot: never answered
        self.assertIsNone(self.ch.try_submit(request(xs[0], 1)))
        with self.assertRaises(ch.ChannelError) as cm:
            self.ch.submit(request(xs[0], 1), timeout=0.05)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertFalse(any(f.done() for f in futs))
        del stalled

    def test_error_status(self):
        x = self.rng.standard_normal((2, 4)).astype(np.float32)
        status, payload = self.ch.forward(request(x, 99))
        self.assertEqual(status, grpc.StatusCode.INVALID_ARGUMENT.value[0])
        self.assertIn(b"layer 99", payload)
        self.check_answer(*self.ch.forward(request(x, 3)), x, 3)  # the slot is free again

    def test_request_larger_than_a_slot(self):
        x = self.rng.standard_normal((64, 256)).astype(np.float32)  # 64 KiB of data
        with self.assertRaises(ch.ChannelError) as cm:
            self.ch.forward(request(x, 0))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertIn("slot_bytes", cm.exception.details())
        for _ in range(5):  # no slot was lost
            small = x[:2]
            self.check_answer(*self.ch.forward(request(small, 1)), small, 1)

    def test_sleeping_wait(self):
        self.ch.spin_s = 0
        x = self.rng.standard_normal((5, 8)).astype(np.float32)
        t0 = time.monotonic()
        self.check_answer(*self.ch.forward(request(x, 55)), x, 55)
        self.assertGreaterEqual(time.monotonic() - t0, 0.025)
        self.check_answer(*self.ch.forward(request(x, 2)), x, 2)

    def test_deadline(self):
        x = self.rng.standard_normal((1, 8)).astype(np.float32)
        t0 = time.monotonic()
        with self.assertRaises(ch.ChannelError) as cm:
            self.ch.forward(request(x, 44), timeout=0.02)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertLess(time.monotonic() - t0, 3)
        for _ in range(6):  # the abandoned slot is not handed out; the others still work
            self.check_answer(*self.ch.forward(request(x, 1)), x, 1)

    def test_bad_timeouts_keep_the_slots(self):
        # Refused before a slot is taken (a NaN or inf once raised after taking one, which then
        # never came back; 0 and negatives were sent with a 1 us deadline). inf: no deadline.
        x = self.rng.standard_normal((1, 8)).astype(np.float32)
        for _ in range(2):  # more refusals than the 4 slots
            for bad in (float("nan"), 0.0, -1.0):
                with self.assertRaises(ValueError):
                    self.ch.submit(request(x, 1), timeout=bad)
                with self.assertRaises(ValueError):
                    self.ch.try_submit(request(x, 1), timeout=bad)
        futures = [self.ch.submit(request(x, k), timeout=float("inf")) for k in range(4)]
        for k, f in enumerate(futures):  # every slot still usable
            self.check_answer(*self.ch.result(f), x, k)

    def test_threads(self):
        errors = []

        def worker(t):
            try:
                rng = np.random.default_rng(t)
                for i in range(25):
                    x = rng.standard_normal((1 + i % 3, 8)).astype(np.float32)
                    self.check_answer(*self.ch.forward(request(x, t, f"t{t}-{i}")), x, t,
                                      f"t{t}-{i}")
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self.assertEqual(errors, [])

    def test_server_detaches(self):
        x = self.rng.standard_normal((1, 8)).astype(np.float32)
        self.check_answer(*self.ch.forward(request(x, 1)), x, 1)
        with self.assertRaises(ch.ChannelError) as cm:
            self.ch.forward(request(x, 66), timeout=10)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertFalse(self.ch.server_attached)
        with self.assertRaises(ch.ChannelError) as cm:
            self.ch.submit(request(x, 1))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertIsNotNone(self.ch.error)


class RealServerTest(unittest.TestCase):
    """Through the real server (skipped without --server)."""

    @classmethod
    def setUpClass(cls):
        if not ARGS.server:
            raise unittest.SkipTest("no --server")
        import tempfile
        sys.path.insert(0, os.path.join(ARGS.source_dir, "tests", "integration"))
        from run_integration import Cli, Server
        import moeserve_client as mc
        from moeserve_client import shared_memory as shm
        cls.mc, cls.shm = mc, shm
        cls.tmp = tempfile.TemporaryDirectory(prefix="moeserve_channel_")
        cls.server = Server(ARGS.server, cls.tmp.name,
                            extra_args=["--enable_shared_memory", "--enable_get_expert_weights"])
        cls.server.__enter__()
        cls.server.wait_ready(Cli(ARGS.cli))
        cls.client = mc.MoeClient(cls.server.target)
        cls.info = cls.client.info()
        cls.ch = ch.ForwardChannel.open(cls.client, num_slots=4, slot_bytes=1 << 20)
        cls.experts = {}
        cls.seed = int.from_bytes(os.urandom(4), "little")
        print(f"RealServerTest: seed {cls.seed}")

    @classmethod
    def tearDownClass(cls):
        try:
            cls.ch.close()
            cls.client.close()
            cls.server.terminate_and_check(30)
        finally:
            cls.server.__exit__(None, None, None)
            cls.tmp.cleanup()

    def inputs(self, m, k):
        return self.mc.random_inputs(m, self.info.hidden, self.info.num_experts, self.info.topk,
                                     seed=self.seed + k)

    def reference(self, x, ids, w, layer):
        for e in np.unique(ids):
            if (layer, int(e)) not in self.experts:
                self.experts[(layer, int(e))] = self.client.expert_weights(layer, int(e))
        experts = {int(e): self.experts[(layer, int(e))] for e in np.unique(ids)}
        return self.mc.reference_forward(x, ids, w, experts)

    @staticmethod
    def tensor(dtype, a):
        return pb.Tensor(dtype=dtype, shape=list(a.shape), data=np.ascontiguousarray(a).tobytes())

    def inline_request(self, x, ids, w, layer, wire_dtype, request_id=""):
        return pb.ForwardRequest(layer=layer, hidden_states=self.tensor(wire_dtype, x),
                                 topk_ids=self.tensor(pb.DTYPE_INT32, ids),
                                 topk_weights=self.tensor(pb.DTYPE_FP32, w),
                                 request_id=request_id)

    def grpc_answer(self, request):
        return self.client._stub.Forward(request, timeout=30)

    def test_inline_tensors_match_reference_and_grpc(self):
        layer = self.info.num_layers - 1
        for i, (name, wire_dtype, tol) in enumerate((("fp32", pb.DTYPE_FP32, 1e-5),
                                                     ("bf16", pb.DTYPE_BF16, 1e-2))):
            x, ids, w = self.inputs(9, i)
            xs = self.mc.from_float32(x, name)
            req = self.inline_request(xs, ids, w, layer, wire_dtype, f"in-{name}")
            status, payload = self.ch.forward(req.SerializeToString(), timeout=30)
            self.assertEqual(status, 0, payload)
            r = pb.ForwardResponse.FromString(payload)
            self.assertEqual((r.request_id, list(r.output.shape), r.output.dtype),
                             (f"in-{name}", [9, self.info.hidden], wire_dtype))
            self.assertEqual(r.output.data, self.grpc_answer(req).output.data, name)
            y = self.mc.to_float32(np.frombuffer(r.output.data, self.mc.dtypes.STORAGE[name]),
                                   name).reshape(9, -1)
            ref = self.reference(self.mc.to_float32(xs, name), ids, w, layer)
            self.assertLess(self.mc.relative_l2_error(y, ref), tol, name)

    def test_region_tensors_match_reference(self):
        m, h, k = 33, self.info.hidden, self.info.topk
        x, ids, w = self.inputs(m, 10)
        xs = self.mc.from_float32(x, "bf16")
        region = self.shm.SystemRegion.create(1 << 20)
        try:
            self.shm.register_system(self.client, "chan-test", region)
            rx = region.ndarray(0, (m, h), "bf16")
            rids = region.ndarray(rx.nbytes, (m, k), np.int32)
            rw = region.ndarray(rx.nbytes + rids.nbytes, (m, k), np.float32)
            rout = region.ndarray(512 << 10, (m, h), "bf16")
            rx[:], rids[:], rw[:] = xs, ids, w
            rout[:] = 0

            def ref_tensor(dtype, a):
                r = region.ref(a)
                return pb.Tensor(dtype=dtype, shape=list(a.shape),
                                 region=pb.RegionRef(name=r.name, offset=r.offset,
                                                     byte_size=r.byte_size))

            o = region.ref(rout)
            req = pb.ForwardRequest(layer=0, hidden_states=ref_tensor(pb.DTYPE_BF16, rx),
                                    topk_ids=ref_tensor(pb.DTYPE_INT32, rids),
                                    topk_weights=ref_tensor(pb.DTYPE_FP32, rw),
                                    output_region=pb.RegionRef(name=o.name, offset=o.offset,
                                                               byte_size=o.byte_size))
            raw = req.SerializeToString()
            self.assertLess(len(raw), 200)  # the channel carries no tensor bytes
            status, payload = self.ch.forward(raw, timeout=30)
            self.assertEqual(status, 0, payload)
            r = pb.ForwardResponse.FromString(payload)
            self.assertEqual((list(r.output.shape), r.output.data), ([m, h], b""))
            y = self.mc.bf16_decode(np.array(rout))
            ref = self.reference(self.mc.bf16_decode(xs), ids, w, 0)
            self.assertLess(self.mc.relative_l2_error(y, ref), 1e-2)
            want = self.grpc_answer(self.inline_request(xs, ids, w, 0, pb.DTYPE_BF16))
            self.assertEqual(np.array(rout).tobytes(), want.output.data)
            del rx, rids, rw, rout
        finally:
            try:
                self.shm.unregister(self.client, "chan-test")
            finally:
                region.close()

    def test_calls_in_flight(self):
        calls = []
        for i in range(4):
            x, ids, w = self.inputs(1 + 7 * i, 20 + i)
            req = self.inline_request(x, ids, w, i % self.info.num_layers, pb.DTYPE_FP32,
                                      f"f{i}")
            calls.append((self.ch.submit(req.SerializeToString(), timeout=30), req))
        for fut, req in reversed(calls):
            status, payload = self.ch.result(fut)
            self.assertEqual(status, 0, payload)
            r = pb.ForwardResponse.FromString(payload)
            self.assertEqual(r.request_id, req.request_id)
            self.assertEqual(r.output.data, self.grpc_answer(req).output.data)

    def test_refusal_through_the_channel(self):
        x, ids, w = self.inputs(4, 30)
        req = self.inline_request(x, ids, w, 0, pb.DTYPE_FP32)
        req.hidden_states.data = req.hidden_states.data[:-4]  # one float short
        status, payload = self.ch.forward(req.SerializeToString(), timeout=30)
        self.assertEqual(status, grpc.StatusCode.INVALID_ARGUMENT.value[0], payload)
        self.assertTrue(payload, "the refusal names what was wrong")
        with self.assertRaises(grpc.RpcError) as cm:  # the same refusal as by gRPC
            self.grpc_answer(req)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        status, payload = self.ch.forward(req.SerializeToString()[:-3], timeout=30)  # truncated
        self.assertNotEqual(status, 0)
        good = self.inline_request(x, ids, w, 0, pb.DTYPE_FP32)
        status, payload = self.ch.forward(good.SerializeToString(), timeout=30)
        self.assertEqual(status, 0, payload)

    def test_unregister_detaches(self):
        c2 = ch.ForwardChannel.open(self.client, num_slots=1, slot_bytes=64 << 10)
        try:
            self.assertTrue(c2.server_attached)
            self.client.unregister_forward_channel(c2.name)
            self.assertFalse(c2.server_attached)
            x, ids, w = self.inputs(1, 40)
            with self.assertRaises(ch.ChannelError) as cm:
                c2.forward(self.inline_request(x, ids, w, 0, pb.DTYPE_FP32).SerializeToString(),
                           timeout=5)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE)
        finally:
            c2.close()


class ValidationTest(unittest.TestCase):
    def test_bad_geometry(self):
        for slots, size in ((0, 4096), (257, 4096), (1, 1000), (1, 4096 + 32)):
            with self.assertRaises(ValueError):
                ch.ForwardChannel(num_slots=slots, slot_bytes=size)

    def test_refused_registration_unlinks(self):
        class Refusing:
            def register_forward_channel(self, *a, **k):
                raise grpc.RpcError("refused")

        before = set(os.listdir("/dev/shm"))
        with self.assertRaises(grpc.RpcError):
            ch.ForwardChannel.open(Refusing())
        self.assertEqual(set(os.listdir("/dev/shm")), before)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--source-dir", required=True)
    p.add_argument("--server")
    p.add_argument("--cli")
    ARGS, rest = p.parse_known_args()
    sys.path.insert(0, os.path.join(ARGS.source_dir, "clients", "python"))
    import grpc  # noqa: F811
    from moeserve_client import channel as ch  # noqa: F811
    from moeserve_client.gen.moeserve.v1 import moeserve_pb2 as pb  # noqa: F811
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
