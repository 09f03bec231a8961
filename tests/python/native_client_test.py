#!/usr/bin/env python3
"""moeserve_client.native (the C++ client's C interface, libmoeserve_client_c, by ctypes)
against the real server (tiny model, CPU backend), with numpy arrays (no torch):

  * FP32, FP16 and BF16 hidden states, int32 and int64 ids: the answer has the same bytes as
    the grpcio numpy client's for the same inputs and is within tolerance of the numpy
    reference of the served experts (relative L2: FP32 1e-5, FP16 / BF16 1e-2), fresh random
    inputs each run;
  * routing on the server (no ids / weights) with return_routing: the ids and weights in the
    answer's header are the numpy client's; request_id echoed; timings with return_timings,
    the host clock's alone with return_timings="host" (no stage timers: experts_us 0);
  * a serialized request (wire.forward_request) sent as bytes: the same answer;
  * answers of 1-4 MB (copied out of their slices by the library's threads): equal to the
    numpy client's, blocking and several in flight at once;
  * several calls in flight (submit), waited for in reverse order, each its own answer; a call
    freed without a wait; a second wait refused; 400 clients closed right after (or during)
    their submitted calls;
  * errors, each with its code and what was wrong: an expert id out of range (the server's
    INVALID_ARGUMENT naming it), a bad dtype code, a NULL hidden pointer, ids without weights
    (INVALID_ARGUMENT before sending), an `out` of the wrong size (INTERNAL naming both
    sizes), a deadline too short (DEADLINE_EXCEEDED), no server (UNAVAILABLE), a bad target
    or timeout at creation (ValueError), a library of another ABI version (OSError);
  * a server that wants a bearer token: UNAUTHENTICATED without it or with a wrong one, the
    answer with it (blocking and in flight);
  * the numpy client (MoeClient) on the C++ client (native="auto", the default once the
    library is found) against itself on grpcio (native=False): the same answers bit for bit in
    every dtype (ml_dtypes' bfloat16 too) and ids type, from non-contiguous arrays, at M = 0,
    with server routing, request_id and timings, the same refusals; native="auto" without the
    library falls back to grpcio (a process without MOESERVE_CLIENT_LIB), native=True does not
    start, and a native value that is none of the three is refused;
  * MOESERVE_CLIENT_COPY_THREADS that does not parse (or is out of range) falls back to the
    default, 0 copies on the caller's thread: large answers equal to grpcio's either way.
Exits 77 (CTest: skipped) without --lib.

  native_client_test.py --server BIN/moeserve --cli BIN/moeserve-cli --lib BUILD/lib/libmoeserve_client_c.so --source-dir REPO
"""

import argparse
import ctypes
import os
import random
import socket
import sys
import tempfile
import unittest

import numpy as np

ARGS = None
SERVER = None
SEED = random.SystemRandom().randrange(1 << 30)


def setUpModule():
    global mc, native, wire, grpc, SERVER, _tmp
    sys.path.insert(0, os.path.join(ARGS.source_dir, "tests", "integration"))
    sys.path.insert(0, os.path.join(ARGS.source_dir, "clients", "python"))
    os.environ["MOESERVE_CLIENT_LIB"] = ARGS.lib
    # Answers of 1 MB or more are copied by the library's pool: 3 threads even on a small
    # machine, so that the split copy runs here.
    os.environ["MOESERVE_CLIENT_COPY_THREADS"] = "3"
    import grpc as _grpc
    import moeserve_client as _mc
    from moeserve_client import native as _native
    from moeserve_client import wire as _wire
    from run_integration import Cli, Server
    mc, native, wire, grpc = _mc, _native, _wire, _grpc
    _tmp = tempfile.TemporaryDirectory(prefix="moeserve_native_")
    SERVER = Server(ARGS.server, _tmp.name, extra_args=["--enable_get_expert_weights"])
    SERVER.__enter__()
    SERVER.wait_ready(Cli(ARGS.cli))
    print(f"native_client_test: seed {SEED}", file=sys.stderr)


def tearDownModule():
    try:
        SERVER.terminate_and_check(30)
    finally:
        SERVER.__exit__(None, None, None)
        _tmp.cleanup()


def ptr(a):
    return a.ctypes.data if a is not None else None


class NativeClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.n = native.NativeClient(SERVER.target)
        cls.npc = mc.MoeClient(SERVER.target, native=False)  # grpcio: the reference bytes
        cls.info = cls.npc.info()
        cls.rng = np.random.default_rng(SEED)

    @classmethod
    def tearDownClass(cls):
        cls.n.close()
        cls.npc.close()

    def inputs(self, m, ids_dtype=np.int32):
        h, e, k = self.info.hidden, self.info.num_experts, self.info.topk
        x, ids, w = mc.random_inputs(m, h, e, k, seed=int(self.rng.integers(1 << 30)))
        return x, ids.astype(ids_dtype), w

    def call(self, x, wire_dtype, ids, w, layer=0, out=None, **kw):
        m, h = x.shape
        if out is None:
            out = np.empty_like(x)
        ids_wire = 0 if ids is None else \
            (wire.DTYPE_INT64 if ids.dtype == np.int64 else wire.DTYPE_INT32)
        header = self.n.forward(layer, wire_dtype, m, h, ptr(x), ids_wire,
                                0 if ids is None else ids.shape[1], ptr(ids), ptr(w), ptr(out),
                                out.nbytes, **kw)
        return out, header

    def test_every_dtype_matches_numpy_client_and_reference(self):
        layer = self.info.num_layers - 1
        cases = ((np.float32, wire.DTYPE_FP32, "fp32", 1e-5, np.int32),
                 (np.float16, wire.DTYPE_FP16, "fp16", 1e-2, np.int64),
                 (np.uint16, wire.DTYPE_BF16, "bf16", 1e-2, np.int32))
        for np_dtype, wire_dtype, name, tol, ids_dtype in cases:
            x32, ids, w = self.inputs(13, ids_dtype)
            x = mc.from_float32(x32, name) if name == "bf16" else x32.astype(np_dtype)
            y, header = self.call(x, wire_dtype, ids, w, layer=layer)
            self.assertIsNone(header)
            want = self.npc.forward(x, ids, w, layer=layer, dtype=name)
            self.assertEqual(y.tobytes(), want.tobytes(), name)
            experts = {int(e): self.npc.expert_weights(layer, int(e)) for e in np.unique(ids)}
            ref = mc.reference_forward(mc.to_float32(x, name), ids, w, experts)
            self.assertLess(mc.relative_l2_error(mc.to_float32(y, name), ref), tol, name)

    def test_header_routing_request_id_and_timings(self):
        x, _, _ = self.inputs(7)
        y, header = self.call(x, wire.DTYPE_FP32, None, None, request_id=b"abc-7",
                              return_timings=True, return_routing=True, want_header=True)
        reply = wire.forward_response(header)
        self.assertEqual(reply.request_id, "abc-7")
        self.assertGreater(reply.timings["total_us"], 0)
        self.assertEqual((reply.output.dtype, tuple(reply.output.shape), reply.output.nbytes),
                         (wire.DTYPE_FP32, x.shape, 0))
        want = self.npc.forward_full(x, return_routing=True)
        self.assertEqual(y.tobytes(), want.output.tobytes())
        ids = np.frombuffer(header, np.int32, reply.topk_ids.nbytes // 4,
                            reply.topk_ids.offset).reshape(reply.topk_ids.shape)
        w = np.frombuffer(header, np.float32, reply.topk_weights.nbytes // 4,
                          reply.topk_weights.offset).reshape(reply.topk_weights.shape)
        np.testing.assert_array_equal(ids, want.topk_ids)
        np.testing.assert_array_equal(w, want.topk_weights)

    def test_host_timings_only(self):
        """return_timings="host" (ForwardRequest.return_host_timings): the host clock's total and
        engine time with no stage timers (experts_us 0), by the C interface (value 2) and by
        the numpy client on the C++ client and on grpcio; True times the stages."""
        x, ids, w = self.inputs(4)
        for timings, staged in (("host", False), (True, True)):
            _, header = self.call(x, wire.DTYPE_FP32, ids, w, return_timings=timings,
                                  want_header=True)
            t = wire.forward_response(header).timings  # (fields that are 0 are not sent)
            self.assertGreater(t["total_us"], 0, timings)
            self.assertGreater(t["engine_us"], 0, timings)
            self.assertEqual(t.get("experts_us", 0) > 0, staged, (timings, t))
        with self.assertRaisesRegex(ValueError, "return_timings='hosts'"):
            self.call(x, wire.DTYPE_FP32, ids, w, return_timings="hosts")
        fast = mc.MoeClient(SERVER.target)
        try:
            self.assertTrue(fast.uses_native, fast.native_error)
            for client in (fast, self.npc):
                for timings, staged in (("host", False), (True, True)):
                    t = client.forward_full(x, ids, w, return_timings=timings).timings
                    what = (client.uses_native, timings, t)
                    self.assertGreater(t["total_us"], 0, what)
                    self.assertGreater(t["engine_us"], 0, what)
                    self.assertEqual(t["experts_us"] > 0, staged, what)
        finally:
            fast.close()

    def test_serialized_request_gives_the_same_answer(self):
        x, ids, w = self.inputs(5)
        want, _ = self.call(x, wire.DTYPE_FP32, ids, w, layer=1)
        parts = wire.forward_request(
            1, (wire.DTYPE_FP32, x.shape, x.tobytes()), (wire.DTYPE_INT32, ids.shape,
                                                         ids.tobytes()),
            (wire.DTYPE_FP32, w.shape, w.tobytes()))
        out = np.empty_like(x)
        header = self.n.forward_request(b"".join(parts), wire.DTYPE_FP32, 5, x.shape[1],
                                        out=ptr(out), out_bytes=out.nbytes)
        self.assertEqual(out.tobytes(), want.tobytes())
        self.assertEqual(wire.forward_response(header).output.nbytes, 0)
        call = self.n.submit_request(b"".join(parts))
        out2 = np.empty_like(x)
        call.wait(ptr(out2), out2.nbytes, wire.DTYPE_FP32, 5, x.shape[1], False)
        self.assertEqual(out2.tobytes(), want.tobytes())

    def test_large_answers_copied_by_the_pool(self):
        h = self.info.hidden
        for m in (1 + (1 << 20) // (4 * h), 3 * (1 << 20) // (4 * h) + 7):
            x, ids, w = self.inputs(m)
            self.assertGreaterEqual(x.nbytes, 1 << 20)
            y, _ = self.call(x, wire.DTYPE_FP32, ids, w)
            self.assertEqual(y.tobytes(), self.npc.forward(x, ids, w).tobytes(), m)
        # Several large answers waited for from threads at once: one uses the pool, the others
        # copy on their own thread; each gets its own bytes.
        import threading
        calls = []
        for i in range(4):
            x, ids, w = self.inputs(2 * (1 << 20) // (4 * h) + i)
            c = self.n.submit(0, wire.DTYPE_FP32, x.shape[0], h, ptr(x), wire.DTYPE_INT32,
                              ids.shape[1], ptr(ids), ptr(w), keep=(x, ids, w))
            calls.append((c, x, ids, w, np.empty_like(x)))
        errors = []

        def wait(c, x, out):
            try:
                c.wait(ptr(out), out.nbytes, wire.DTYPE_FP32, x.shape[0], h, False)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        threads = [threading.Thread(target=wait, args=(c, x, out)) for c, x, _, _, out in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        for c, x, ids, w, out in calls:
            self.assertEqual(out.tobytes(), self.npc.forward(x, ids, w).tobytes())

    def test_copy_threads_setting_that_does_not_parse(self):
        """MOESERVE_CLIENT_COPY_THREADS that is not a count in [0, 64] falls back to the
        default; 0 copies on the caller's thread. Each in a process of its own (the pool is
        made once per process): a 3 MB answer equal to grpcio's."""
        import subprocess
        code = "\n".join([
            "import sys",
            "sys.path.insert(0, sys.argv[1])",
            "import numpy as np",
            "import moeserve_client as mc",
            "fast = mc.MoeClient(sys.argv[2])",
            "slow = mc.MoeClient(sys.argv[2], native=False)",
            "assert fast.uses_native, fast.native_error",
            "i = fast.info()",
            "m = 3 * (1 << 20) // (4 * i.hidden) + 5",
            "x, ids, w = mc.random_inputs(m, i.hidden, i.num_experts, i.topk, seed=m)",
            "a = fast.forward(x, ids, w)",
            "b = slow.forward(x, ids, w)",
            "print('same' if a.tobytes() == b.tobytes() and a.nbytes >= 3 << 20 else 'differ')",
        ])
        for value in ("abc", "-3", "65", "2x", "0", "2"):
            env = dict(os.environ, MOESERVE_CLIENT_COPY_THREADS=value)
            out = subprocess.run([sys.executable, "-c", code,
                                  os.path.join(ARGS.source_dir, "clients", "python"),
                                  SERVER.target], env=env, capture_output=True, text=True,
                                 timeout=120)
            self.assertEqual(out.returncode, 0, f"{value!r}: {out.stderr}")
            self.assertEqual(out.stdout.strip(), "same", value)

    def test_clients_closed_right_after_their_calls(self):
        # A client destroyed as soon as its last submitted call was answered: with gRPC's
        # callback API that raced the shared callback queue's own thread (an abort in
        # grpc_cq_internal_unref, about one process in ten); the library's own queue does not.
        x, ids, w = self.inputs(2)
        args = (0, wire.DTYPE_FP32, 2, x.shape[1], ptr(x), wire.DTYPE_INT32, ids.shape[1],
                ptr(ids), ptr(w))
        want = self.npc.forward(x, ids, w).tobytes()
        for i in range(400):
            with native.NativeClient(SERVER.target) as n:
                c = n.submit(*args, keep=(x, ids, w))
                out = np.empty_like(x)
                c.wait(ptr(out), out.nbytes, wire.DTYPE_FP32, 2, x.shape[1], False)
                self.assertEqual(out.tobytes(), want, i)
                if i % 2:
                    n.submit(*args, keep=(x, ids, w))  # in flight when the client closes

    def test_calls_in_flight_answer_each_their_own(self):
        calls = []
        for i in range(8):
            x, ids, w = self.inputs(1 + 3 * i)
            layer = i % self.info.num_layers
            c = self.n.submit(layer, wire.DTYPE_FP32, x.shape[0], x.shape[1], ptr(x),
                              wire.DTYPE_INT32, ids.shape[1], ptr(ids), ptr(w),
                              request_id=f"r{i}".encode(), keep=(x, ids, w))
            calls.append((c, x, ids, w, layer, i))
        freed = self.n.submit(0, wire.DTYPE_FP32, calls[0][1].shape[0], calls[0][1].shape[1],
                              ptr(calls[0][1]), wire.DTYPE_INT32, calls[0][2].shape[1],
                              ptr(calls[0][2]), ptr(calls[0][3]), keep=calls[0][1:4])
        del freed  # freed unwaited: waits for its answer, since it borrows our arrays
        for c, x, ids, w, layer, i in reversed(calls):
            out = np.empty_like(x)
            header = c.wait(ptr(out), out.nbytes, wire.DTYPE_FP32, x.shape[0], x.shape[1], True)
            self.assertTrue(c.done())
            self.assertEqual(wire.forward_response(header).request_id, f"r{i}")
            want = self.npc.forward(x, ids, w, layer=layer)
            self.assertEqual(out.tobytes(), want.tobytes())
            with self.assertRaisesRegex(RuntimeError, "waited for already"):
                c.wait(ptr(out), out.nbytes, wire.DTYPE_FP32, x.shape[0], x.shape[1], False)

    def assertCallError(self, code, pattern, fn):
        with self.assertRaises(native.CallError) as cm:
            fn()
        self.assertIsInstance(cm.exception, grpc.RpcError)
        self.assertEqual(cm.exception.code(), code, cm.exception.details())
        self.assertRegex(cm.exception.details(), pattern)

    def test_bad_input_is_refused_with_what_was_wrong(self):
        x, ids, w = self.inputs(4)
        bad = ids.copy()
        bad[2, 1] = self.info.num_experts + 3
        IA = grpc.StatusCode.INVALID_ARGUMENT
        self.assertCallError(IA, r"topk_ids.*outside", lambda: self.call(x, wire.DTYPE_FP32,
                                                                          bad, w))
        m, h = x.shape
        out = np.empty_like(x)
        self.assertCallError(IA, "hidden_dtype is 9", lambda: self.n.forward(
            0, 9, m, h, ptr(x), wire.DTYPE_INT32, 4, ptr(ids), ptr(w), ptr(out), out.nbytes))
        self.assertCallError(IA, "hidden_states is NULL", lambda: self.n.forward(
            0, wire.DTYPE_FP32, m, h, None, wire.DTYPE_INT32, 4, ptr(ids), ptr(w), ptr(out),
            out.nbytes))
        self.assertCallError(IA, "both topk_ids and topk_weights", lambda: self.n.forward(
            0, wire.DTYPE_FP32, m, h, ptr(x), wire.DTYPE_INT32, 4, ptr(ids), None, ptr(out),
            out.nbytes))
        self.assertCallError(IA, "ids_dtype is 3", lambda: self.n.forward(
            0, wire.DTYPE_FP32, m, h, ptr(x), wire.DTYPE_FP32, 4, ptr(ids), ptr(w), ptr(out),
            out.nbytes))
        short = np.empty((m - 1, h), np.float32)
        self.assertCallError(grpc.StatusCode.INTERNAL, rf"answer has {x.nbytes} bytes; out has "
                             rf"{short.nbytes}", lambda: self.n.forward(
                                 0, wire.DTYPE_FP32, m, h, ptr(x), wire.DTYPE_INT32, 4, ptr(ids),
                                 ptr(w), ptr(short), short.nbytes))
        # A wrong expected shape is the server answering something else: INTERNAL.
        self.assertCallError(grpc.StatusCode.INTERNAL, "expected dtype", lambda: self.n
                             .forward_request(b"".join(wire.forward_request(
                                 0, (wire.DTYPE_FP32, x.shape, x.tobytes()),
                                 (wire.DTYPE_INT32, ids.shape, ids.tobytes()),
                                 (wire.DTYPE_FP32, w.shape, w.tobytes()))), wire.DTYPE_BF16, m,
                                 h, out=ptr(out), out_bytes=out.nbytes))
        # A server that accepts the connection and never answers: the deadline ends the call.
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen(8)
            with native.NativeClient(f"127.0.0.1:{silent.getsockname()[1]}") as n:
                self.assertCallError(grpc.StatusCode.DEADLINE_EXCEEDED, ".", lambda: n.forward(
                    0, wire.DTYPE_FP32, m, h, ptr(x), wire.DTYPE_INT32, 4, ptr(ids), ptr(w),
                    ptr(out), out.nbytes, timeout=0.3))
        # The client still works after every refusal.
        y, _ = self.call(x, wire.DTYPE_FP32, ids, w)
        self.assertEqual(y.tobytes(), self.npc.forward(x, ids, w).tobytes())

    def test_no_server_and_bad_creation(self):
        with native.NativeClient("127.0.0.1:1", timeout=5) as n:
            x, ids, w = self.inputs(1)
            out = np.empty_like(x)
            with self.assertRaises(native.CallError) as cm:
                n.forward(0, wire.DTYPE_FP32, 1, x.shape[1], ptr(x), wire.DTYPE_INT32, 4,
                          ptr(ids), ptr(w), ptr(out), out.nbytes)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE)
        with self.assertRaisesRegex(ValueError, "target is empty"):
            native.NativeClient("")
        with self.assertRaisesRegex(ValueError, "timeout_s"):
            native.NativeClient(SERVER.target, timeout=0)
        with self.assertRaisesRegex(ValueError, "max_message_bytes"):
            native.NativeClient(SERVER.target, max_message_bytes=0)

    def test_bearer_token(self):
        token = "a-native-client-token-" + str(SEED)
        with tempfile.TemporaryDirectory(prefix="moeserve_native_auth_") as d:
            tokens = os.path.join(d, "tokens")
            with open(tokens, "w") as f:
                f.write(f"# tokens\n{token}\n")
            from run_integration import Cli, Server
            with Server(ARGS.server, d, extra_args=["--auth_token_file", tokens]) as server:
                server.wait_ready(Cli(ARGS.cli))
                x, ids, w = self.inputs(3)
                out = np.empty_like(x)
                args = (0, wire.DTYPE_FP32, 3, x.shape[1], ptr(x), wire.DTYPE_INT32,
                        ids.shape[1], ptr(ids), ptr(w), ptr(out), out.nbytes)
                for bad in (None, token + "x"):
                    with native.NativeClient(server.target, auth_token=bad) as n:
                        with self.assertRaises(native.CallError) as cm:
                            n.forward(*args)
                        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAUTHENTICATED,
                                         cm.exception.details())
                with native.NativeClient(server.target, auth_token=token) as n:
                    n.forward(*args)
                    self.assertEqual(out.tobytes(), self.npc.forward(x, ids, w).tobytes())
                    c = n.submit(*args[:9], keep=(x, ids, w))
                    out2 = np.empty_like(x)
                    c.wait(ptr(out2), out2.nbytes, wire.DTYPE_FP32, 3, x.shape[1], False)
                    self.assertEqual(out2.tobytes(), out.tobytes())
                server.terminate_and_check(30)

    def test_numpy_client_on_the_cpp_client(self):
        fast = mc.MoeClient(SERVER.target)
        self.assertTrue(fast.uses_native, fast.native_error)
        self.assertIsNone(fast.native_error)
        try:
            layer = self.info.num_layers - 1
            cases = [(np.float32, None, np.int32), (np.float16, None, np.int64),
                     (np.uint16, "bf16", np.int16)]
            try:
                import ml_dtypes
                cases.append((ml_dtypes.bfloat16, None, np.int32))
            except ImportError:
                pass
            for np_dtype, dtype, ids_dtype in cases:
                for m in (1, 9, 0):
                    x32, ids, w = self.inputs(max(m, 1), ids_dtype)
                    x32, ids, w = x32[:m], ids[:m], w[:m]
                    if dtype == "bf16":
                        x = mc.from_float32(x32, "bf16")
                    else:
                        x = x32.astype(np_dtype)
                    x = np.asfortranarray(x)  # not C-contiguous: converted before sending
                    got = fast.forward_full(x, ids, w, layer=layer, dtype=dtype,
                                            request_id=f"r{m}")
                    want = self.npc.forward_full(x, ids, w, layer=layer, dtype=dtype,
                                                 request_id=f"r{m}")
                    what = f"{np_dtype.__name__} ids {ids_dtype.__name__} M={m}"
                    self.assertEqual(got.output.dtype, want.output.dtype, what)
                    self.assertEqual(got.output.shape, (m, self.info.hidden), what)
                    self.assertEqual(got.output.tobytes(), want.output.tobytes(), what)
                    self.assertEqual(got.request_id, f"r{m}", what)
                    if m > 0:
                        self.assertGreater(got.timings["total_us"], 0, what)
            # Routing on the server, returned; forward() without timings. Also a batch whose
            # echoed routing passes the 4 KiB default header buffer (it was sized for no
            # routes, the call's own topk being 0: RESOURCE_EXHAUSTED after the work).
            for m in (5, max(64, 4096 // (8 * self.info.topk) + 8)):
                x, _, _ = self.inputs(m)
                got = fast.forward_full(x, return_routing=True, return_timings=False)
                want = self.npc.forward_full(x, return_routing=True, return_timings=False)
                self.assertEqual(got.output.tobytes(), want.output.tobytes(), m)
                np.testing.assert_array_equal(got.topk_ids, want.topk_ids)
                np.testing.assert_array_equal(got.topk_weights, want.topk_weights)
                self.assertEqual(got.timings["total_us"], 0)
            self.assertEqual(fast.forward(x).tobytes(), self.npc.forward(x).tobytes())
            # The same refusals, as grpc.RpcError with the server's code.
            x, ids, w = self.inputs(3)
            ids[1, 0] = self.info.num_experts
            for client in (fast, self.npc):
                with self.assertRaises(grpc.RpcError) as cm:
                    client.forward(x, ids, w)
                self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
                self.assertIn(str(self.info.num_experts), cm.exception.details())
            with self.assertRaises(TypeError):
                fast.forward(x.astype(np.float64), ids, w)
        finally:
            fast.close()
        with self.assertRaises(ValueError):
            mc.MoeClient(SERVER.target, native="yes")

    def test_numpy_client_without_the_library(self):
        import subprocess
        code = "\n".join([
            "import sys",
            "sys.path.insert(0, sys.argv[1])",
            "import moeserve_client as mc",
            "c = mc.MoeClient(sys.argv[2])",
            "print(c.uses_native, type(c.native_error).__name__)",
            "i = c.info()",
            "x, ids, w = mc.random_inputs(2, i.hidden, i.num_experts, i.topk, seed=1)",
            "print(c.forward(x, ids, w).shape)",
            "try:",
            "    mc.MoeClient(sys.argv[2], native=True)",
            "except OSError:",
            "    print('OSError')",
        ])
        env = dict(os.environ)
        env.pop("MOESERVE_CLIENT_LIB", None)
        out = subprocess.run([sys.executable, "-c", code,
                              os.path.join(ARGS.source_dir, "clients", "python"), SERVER.target],
                             env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        lines = out.stdout.split("\n")
        self.assertEqual(lines[0], "False OSError", out.stdout)
        self.assertEqual(lines[1], f"(2, {self.info.hidden})", out.stdout)
        self.assertEqual(lines[2], "OSError", out.stdout)

    def test_library_abi_and_exports(self):
        lib = ctypes.CDLL(ARGS.lib)
        self.assertEqual(lib.moeserve_client_abi_version(), native.ABI_VERSION)
        # The C++ client and the stubs stay inside the library (-Wl,--exclude-libs,ALL).
        with self.assertRaises(AttributeError):
            lib._ZN8moeserve6client9MoeClient6CreateERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEERKNS0_16MoeClientOptionsE  # noqa: B018,E501
        fake = os.path.join(_tmp.name, "not_a_library.so")
        with open(fake, "wb") as f:
            f.write(b"not an ELF file")
        with self.assertRaises(OSError):
            native.load(fake)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--cli", required=True)
    ap.add_argument("--lib", default="")
    ap.add_argument("--source-dir", required=True)
    ARGS, rest = ap.parse_known_args()
    if not ARGS.lib or not os.path.exists(ARGS.lib):
        print(f"native_client_test: SKIPPED (no library at {ARGS.lib!r})")
        sys.exit(77)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
