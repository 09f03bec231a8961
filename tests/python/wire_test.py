#!/usr/bin/env python3
"""moeserve_client.wire against protobuf: requests it writes parse to what protobuf builds, and
responses protobuf writes (in any field order, with packed or unpacked shapes, unknown fields)
decode to the same values. Random cases, fixed seed; no server, no torch. Also
moeserve_client.dtypes: BF16 decoded from uint16 bit patterns and from ml_dtypes.bfloat16
arrays (what MoeClient.forward returns for bfloat16 input) alike.

  wire_test.py --source-dir REPO
"""

import argparse
import os
import random
import sys
import unittest

SOURCE_DIR = None


def setUpModule():
    global wire, pb, dtypes
    sys.path.insert(0, os.path.join(SOURCE_DIR, "clients", "python"))
    from moeserve_client import dtypes as _dtypes
    from moeserve_client import wire as _wire
    from moeserve_client.gen.moeserve.v1 import moeserve_pb2 as _pb
    wire, pb, dtypes = _wire, _pb, _dtypes


def rand_tensor(rng, dtype, shape):
    n = 1
    for d in shape:
        n *= d
    return rng.randbytes(n * wire.ITEMSIZE[dtype])


class WireTest(unittest.TestCase):
    def test_requests_parse_as_protobuf_builds_them(self):
        rng = random.Random(5)
        for case in range(200):
            m = rng.choice([0, 1, 2, 7, 130])
            h = rng.choice([1, 8, 200])
            k = rng.choice([1, 2, 8])
            hd = rng.choice([wire.DTYPE_BF16, wire.DTYPE_FP16, wire.DTYPE_FP32])
            hidden = rand_tensor(rng, hd, (m, h))
            routed = rng.random() < 0.7
            ids_dtype = rng.choice([wire.DTYPE_INT32, wire.DTYPE_INT64])
            ids = rand_tensor(rng, ids_dtype, (m, k)) if routed else None
            w = rand_tensor(rng, wire.DTYPE_FP32, (m, k)) if routed else None
            layer = rng.choice([0, 1, 57, 2**31 - 1, -3])
            rid = rng.choice(["", "r", "req-\u00e9" * 3])
            timings = rng.choice([False, True, "host"])
            flags = dict(return_timings=timings, return_routing=rng.random() < 0.5)
            region = rng.random() < 0.2
            out_region = ("out", 4096, m * h * wire.ITEMSIZE[hd]) if rng.random() < 0.2 else None
            hid = ((hd, (m, h), None, ("in", 128, len(hidden))) if region
                   else (hd, (m, h), memoryview(hidden)))
            parts = wire.forward_request(
                layer, hid, (ids_dtype, (m, k), ids) if routed else None,
                (wire.DTYPE_FP32, (m, k), w) if routed else None, request_id=rid,
                output_region=out_region, **flags)
            got = pb.ForwardRequest.FromString(b"".join(parts))
            with self.assertRaisesRegex(ValueError, "expected True, False or \"host\""):
                wire.forward_request(layer, hid, request_id=rid, return_timings="hosts")
            want = pb.ForwardRequest(layer=layer, request_id=rid,
                                     return_timings=timings is True,
                                     return_host_timings=timings == "host",
                                     return_routing=flags["return_routing"])
            want.hidden_states.dtype = hd
            want.hidden_states.shape.extend([m, h])
            if region:
                want.hidden_states.region.name = "in"
                want.hidden_states.region.offset = 128
                want.hidden_states.region.byte_size = len(hidden)
            else:
                want.hidden_states.data = hidden
            if routed:
                want.topk_ids.dtype = ids_dtype
                want.topk_ids.shape.extend([m, k])
                want.topk_ids.data = ids
                want.topk_weights.dtype = wire.DTYPE_FP32
                want.topk_weights.shape.extend([m, k])
                want.topk_weights.data = w
            if out_region:
                want.output_region.name, want.output_region.offset, \
                    want.output_region.byte_size = out_region
            self.assertEqual(got, want, f"case {case}")
            self.assertEqual(got.HasField("topk_ids"), routed)

    def test_responses_decode_as_protobuf_wrote_them(self):
        rng = random.Random(9)
        for case in range(200):
            m, h, k = rng.choice([0, 1, 5]), rng.choice([1, 16]), rng.choice([1, 4])
            dt = rng.choice([wire.DTYPE_BF16, wire.DTYPE_FP32])
            r = pb.ForwardResponse(request_id=rng.choice(["", "abc"]))
            r.output.dtype = dt
            r.output.shape.extend([m, h])
            r.output.data = rand_tensor(rng, dt, (m, h))
            if rng.random() < 0.5:
                r.timings.queue_us, r.timings.total_us, r.timings.route_us = 1.5, 2.25, 0.125
                r.timings.engine_us, r.timings.host_timer_us = 0.75, 4.5  # fields 7 and 12
            if rng.random() < 0.5:
                r.topk_ids.dtype = wire.DTYPE_INT32
                r.topk_ids.shape.extend([m, k])
                r.topk_ids.data = rand_tensor(rng, wire.DTYPE_INT32, (m, k))
                r.topk_weights.dtype = wire.DTYPE_FP32
                r.topk_weights.shape.extend([m, k])
                r.topk_weights.data = rand_tensor(rng, wire.DTYPE_FP32, (m, k))
            if rng.random() < 0.3:
                r.error_code = rng.choice([3, -1])
                r.error_message = "bad"
            raw = r.SerializeToString()
            # Field order is free in protobuf: move the output to the end, as the server does.
            if rng.random() < 0.5:
                head = pb.ForwardResponse()
                head.CopyFrom(r)
                head.ClearField("output")
                only = pb.ForwardResponse()
                only.output.CopyFrom(r.output)
                raw = head.SerializeToString() + only.SerializeToString()
            if rng.random() < 0.3:  # an unknown field (number 99, length-delimited)
                raw = raw + wire.varint(99 << 3 | 2) + wire.varint(3) + b"xyz"
            d = wire.forward_response(raw)
            self.assertEqual(d.output.dtype, dt)
            self.assertEqual(d.output.shape, (m, h))
            self.assertEqual(bytes(raw[d.output.offset:d.output.offset + d.output.nbytes]),
                             r.output.data)
            self.assertEqual(d.request_id, r.request_id)
            if r.HasField("timings"):
                self.assertEqual(d.timings["route_us"], 0.125)
                self.assertEqual(d.timings["total_us"], 2.25)
                self.assertEqual(d.timings["engine_us"], 0.75)
                self.assertEqual(d.timings["host_timer_us"], 4.5)
            else:
                self.assertIsNone(d.timings)
            if r.HasField("topk_ids"):
                t = d.topk_ids
                self.assertEqual(bytes(raw[t.offset:t.offset + t.nbytes]), r.topk_ids.data)
                self.assertEqual(d.topk_weights.shape, (m, k))
            else:
                self.assertIsNone(d.topk_ids)
            self.assertEqual(d.error_code, r.error_code)

    def test_unpacked_shapes_and_malformed_bytes(self):
        t = pb.Tensor(dtype=wire.DTYPE_FP32, shape=[3, 2], data=b"\0" * 24)
        # An unpacked repeated field: each dim as its own varint field 2.
        unpacked = (wire.varint(1 << 3) + wire.varint(3) + wire.varint(2 << 3) + wire.varint(3)
                    + wire.varint(2 << 3) + wire.varint(2) + wire.varint(3 << 3 | 2)
                    + wire.varint(24) + b"\0" * 24)
        self.assertEqual(pb.Tensor.FromString(unpacked), t)
        raw = wire.varint(1 << 3 | 2) + wire.varint(len(unpacked)) + unpacked
        self.assertEqual(wire.forward_response(raw).output.shape, (3, 2))
        for bad in (b"\x0a\x05abc", b"\x0a", b"\x08\xff\xff", b"\x0f"):
            with self.assertRaises(wire.WireError):
                wire.forward_response(bad)


class DtypesTest(unittest.TestCase):
    def test_bf16_decode_of_bfloat16_arrays_keeps_the_values(self):
        import ml_dtypes
        import numpy as np
        want = np.array([1.5, 3, -2], np.float32)
        a = want.astype(ml_dtypes.bfloat16)
        for got in (dtypes.to_float32(a, "bf16"), dtypes.bf16_decode(a),
                    dtypes.to_float32(a.reshape(3, 1).T, "bfloat16")[0]):
            self.assertEqual(got.dtype, np.float32)
            self.assertEqual(got.tolist(), want.tolist())
        # Strided, and the same values as uint16 bit patterns.
        self.assertEqual(dtypes.bf16_decode(a[::2]).tolist(), [1.5, -2])
        bits = dtypes.bf16_encode(want)
        self.assertEqual(bits.dtype, np.uint16)
        self.assertEqual(bits.tolist(), a.view(np.uint16).tolist())
        self.assertEqual(dtypes.to_float32(bits, "bf16").tolist(), want.tolist())
        self.assertEqual(dtypes.bf16_decode(bits.tolist()).tolist(), want.tolist())


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--source-dir", required=True)
    args, rest = p.parse_known_args()
    SOURCE_DIR = args.source_dir
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
