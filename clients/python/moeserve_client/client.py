"""Blocking Python client for moeserve (moeserve.v1.MoeService + grpc.health.v1.Health).

Tensors are numpy arrays. Hidden-state dtypes:
  * float32 arrays         -> sent as FP32, answer float32
  * float16 arrays         -> sent as FP16, answer float16
  * uint16 arrays + dtype="bf16" -> BF16 bit patterns (numpy has no bfloat16), answer uint16
    bit patterns. Use moeserve_client.bf16_encode / bf16_decode to convert. A uint16 array
    without dtype="bf16" is refused rather than guessed.
  * ml_dtypes.bfloat16 arrays (if you use ml_dtypes) -> BF16, answer bfloat16.
topk_ids: int32 or int64 [M, K] (sent as given); topk_weights: [M, K], sent as float32.
Both None: the server routes with the layer's own gate (ModelInfo.server_routing); with
return_routing=True the answer carries the ids (int32) and weights (float32) it chose.

For torch tensors, CUDA memory and asynchronous calls see moeserve_client.torch_client.

Forward calls go through the C++ client (moeserve_client.native) when its library is found
(native="auto", the default): the arrays' bytes are sent in place and the answer is written
once into the returned array, without grpcio's protobuf copies. native=False keeps every call
on grpcio; native=True refuses to start without the library.
"""

import collections
import time

import grpc
import numpy as np

from . import dtypes as _dt
from . import native as _native
from . import wire as _wire

try:
    from .gen.moeserve.v1 import moeserve_pb2 as pb
    from .gen.moeserve.v1 import moeserve_pb2_grpc as pb_grpc
    from .gen.grpc.health.v1 import health_pb2, health_pb2_grpc
except ImportError as e:  # pragma: no cover - only without generated stubs
    raise ImportError(
        "moeserve_client's gRPC stubs are missing or stale; run "
        "clients/python/generate_stubs.sh (needs grpcio-tools)") from e

_WIRE = {"bf16": pb.DTYPE_BF16, "fp16": pb.DTYPE_FP16, "fp32": pb.DTYPE_FP32}
_FROM_WIRE = {v: k for k, v in _WIRE.items()}
_TIMINGS = _wire.TIMING_NAMES

ForwardResult = collections.namedtuple(
    "ForwardResult", ["output", "request_id", "timings", "latency_s", "topk_ids", "topk_weights"],
    defaults=(None, None))


def _hidden_dtype(hidden, dtype):
    """Wire dtype name for `hidden`, checking it against an explicit `dtype`."""
    name = hidden.dtype.name
    if name == "bfloat16":  # ml_dtypes
        inferred = "bf16"
    elif hidden.dtype == np.float32:
        inferred = "fp32"
    elif hidden.dtype == np.float16:
        inferred = "fp16"
    elif hidden.dtype == np.uint16:
        inferred = None
    else:
        raise TypeError(f"hidden has dtype {hidden.dtype}; expected float32, float16 or "
                        "uint16 BF16 bit patterns with dtype='bf16'")
    if dtype is None:
        if inferred is None:
            raise TypeError("hidden is uint16: pass dtype='bf16' to send BF16 bit patterns")
        return inferred
    want = _dt.normalize_dtype(dtype)
    if want == "bf16" and inferred in (None, "bf16"):
        return "bf16"
    if want != inferred:
        raise TypeError(f"dtype={dtype!r} does not match hidden's numpy dtype {hidden.dtype}")
    return want


def _tensor(array, wire_dtype, storage):
    a = np.ascontiguousarray(array).astype(storage, copy=False)
    return pb.Tensor(dtype=wire_dtype, shape=list(a.shape), data=a.tobytes())


def _array(tensor, storage):
    a = np.frombuffer(tensor.data, dtype=storage)
    return a.reshape(tuple(tensor.shape)).copy()


_FRAMING = 1024  # bytes of a message beyond its tensors


def _result(reply, output, hidden, latency, return_routing):
    """ForwardResult of an answer: `output` (storage dtype; viewed as hidden's bfloat16 where
    hidden is one) and the reply's request_id, timings and (return_routing) routing."""
    if hidden.dtype.name == "bfloat16":
        output = output.view(hidden.dtype)
    timings = {k: getattr(reply.timings, k) for k in _TIMINGS}
    routed_ids = routed_weights = None
    if return_routing:
        routed_ids = _array(reply.topk_ids, np.dtype("<i4"))
        routed_weights = _array(reply.topk_weights, np.dtype("<f4"))
    return ForwardResult(output, reply.request_id, timings, latency, routed_ids, routed_weights)


def _read(path):
    with open(path, "rb") as f:
        return f.read()


class MoeClient:
    """A channel to one moeserve server. Thread-safe; close() (or `with`) when done.

    timeout: per-call deadline in seconds. max_message_bytes: largest message either way.
    wait_for_ready: calls wait for the channel to connect (up to the timeout) instead of failing
    fast with UNAVAILABLE.

    Secured servers (docs/security.md): tls=True (implied by any of the file arguments) connects
    over TLS; tls_ca_file verifies the server (default: the system's roots); tls_cert_file and
    tls_key_file present a client certificate (mutual TLS); tls_server_name is the name the
    server's certificate carries when it is not the target's host. auth_token is sent as
    "authorization: Bearer <token>" on every call.

    native: "auto" (Forward calls by the C++ client when its library is found, else grpcio),
    True (the C++ client or an error) or False (grpcio). native_spin_us: the C++ client polls
    this long for an answer before it sleeps (a core busy per waiting call; 0: sleep at once).
    """

    def __init__(self, target, timeout=30.0, max_message_bytes=256 << 20, wait_for_ready=False,
                 tls=False, tls_ca_file=None, tls_cert_file=None, tls_key_file=None,
                 tls_server_name=None, auth_token=None, native="auto", native_spin_us=0):
        if native not in ("auto", True, False):
            raise ValueError(f"native={native!r}; expected 'auto', True or False")
        self.target = target
        self.timeout = timeout
        self.wait_for_ready = wait_for_ready
        self.max_message_bytes = max_message_bytes
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else None
        self._info = None
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes)]
        if tls or tls_ca_file or tls_cert_file or tls_key_file:
            if bool(tls_cert_file) != bool(tls_key_file):
                raise ValueError("tls_cert_file and tls_key_file go together")
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(tls_ca_file) if tls_ca_file else None,
                private_key=_read(tls_key_file) if tls_key_file else None,
                certificate_chain=_read(tls_cert_file) if tls_cert_file else None)
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            self._channel = grpc.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = pb_grpc.MoeServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._native = None
        self._native_error = None
        if native:
            try:
                self._native = _native.NativeClient(
                    target, timeout=timeout, max_message_bytes=max_message_bytes,
                    spin_us=native_spin_us, auth_token=auth_token,
                    tls=bool(tls or tls_ca_file or tls_cert_file or tls_key_file),
                    tls_ca_file=tls_ca_file, tls_cert_file=tls_cert_file,
                    tls_key_file=tls_key_file, tls_server_name=tls_server_name,
                    wait_for_ready=wait_for_ready)
            except (OSError, ValueError, TypeError) as e:
                if native is True:
                    self._channel.close()
                    raise
                self._native_error = e

    @property
    def uses_native(self):
        """Whether Forward calls go through the C++ client."""
        return self._native is not None

    @property
    def native_error(self):
        """Why the C++ client is not used (native="auto" and no library, or it refused the
        options), or None."""
        return self._native_error

    def close(self):
        if self._native is not None:
            self._native.close()
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request, timeout):
        return method(request, timeout=self.timeout if timeout is None else timeout,
                      wait_for_ready=self.wait_for_ready, metadata=self._metadata)

    def health(self, service="", timeout=None):
        """Serving status name: 'SERVING', 'NOT_SERVING', 'SERVICE_UNKNOWN' or 'UNKNOWN'."""
        reply = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service),
                           timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def info(self, timeout=None):
        """The served model (a moeserve.v1.ModelInfo message)."""
        return self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    def register_forward_channel(self, name, key, byte_size, timeout=None):
        """Registers a forward channel (moeserve_client.channel.ForwardChannel.open does this):
        the POSIX shm object `key` ("/name", header written) of byte_size bytes, as `name`.
        Returns the RegisterForwardChannelResponse (num_slots, slot_bytes, spin_us)."""
        return register_forward_channel(self._stub, name, key, byte_size,
                                        self.timeout if timeout is None else timeout,
                                        self._metadata)

    def unregister_forward_channel(self, name="", timeout=None):
        """Unregisters forward channel `name` ("" = every channel)."""
        unregister_forward_channel(self._stub, name, self.timeout if timeout is None else timeout,
                                   self._metadata)

    def expert_weights(self, layer, expert, timeout=None):
        """(w13 [2I, H], w2 [H, I]) of one expert as float32, decoded exactly from the served
        BF16. w13's rows [0, I) are the gate projection, [I, 2I) the up projection.

        Uses GetExpertWeights when the expert fits in one message, else StreamExpertWeights.
        The server must run with --enable_get_expert_weights (FAILED_PRECONDITION otherwise)."""
        if self._info is None:
            self._info = self.info(timeout=timeout)
        limit = self.max_message_bytes
        if self._info.max_message_bytes > 0:
            limit = min(limit, self._info.max_message_bytes)
        if 6 * self._info.hidden * self._info.intermediate + _FRAMING > limit:
            return self.stream_expert_weights(layer, expert, min(limit - _FRAMING, 1 << 20),
                                              timeout=timeout)
        reply = self._call(self._stub.GetExpertWeights,
                           pb.GetExpertWeightsRequest(layer=layer, expert=expert), timeout)
        return tuple(self._decode_weights(t) for t in (reply.w13, reply.w2))

    def stream_expert_weights(self, layer, expert, chunk_bytes=0, timeout=None):
        """expert_weights() through StreamExpertWeights (chunks of at most chunk_bytes; 0: the
        server's default), checked for order, offsets and completeness."""
        request = pb.StreamExpertWeightsRequest(layer=layer, expert=expert,
                                                chunk_bytes=chunk_bytes)
        parts = {}  # name -> (dtype, shape, bytearray)
        for chunk in self._call(self._stub.StreamExpertWeights, request, timeout):
            if chunk.tensor not in ("w13", "w2") or (chunk.tensor == "w13" and "w2" in parts):
                raise ValueError(f"StreamExpertWeights: unexpected chunk of {chunk.tensor!r}")
            if chunk.tensor not in parts:
                parts[chunk.tensor] = (chunk.dtype, tuple(chunk.shape), bytearray())
            _, _, data = parts[chunk.tensor]
            if chunk.offset != len(data):
                raise ValueError(f"StreamExpertWeights: {chunk.tensor} chunk at byte "
                                 f"{chunk.offset}, expected {len(data)}")
            data += chunk.data
        out = []
        for name in ("w13", "w2"):
            if name not in parts:
                raise ValueError(f"StreamExpertWeights: no {name} in the stream")
            dtype, shape, data = parts[name]
            t = pb.Tensor(dtype=dtype, shape=list(shape), data=bytes(data))
            if len(t.data) != int(np.prod(shape)) * 2:
                raise ValueError(f"StreamExpertWeights: {name} has {len(t.data)} bytes for "
                                 f"shape {list(shape)}")
            out.append(self._decode_weights(t))
        return tuple(out)

    @staticmethod
    def _decode_weights(t):
        name = _FROM_WIRE.get(t.dtype)
        if name is None:
            raise ValueError(f"expert weights came as dtype {t.dtype}; expected a float")
        return _dt.to_float32(_array(t, _dt.STORAGE[name]), name)

    def forward_full(self, hidden, topk_ids=None, topk_weights=None, layer=0, dtype=None,
                     request_id="", return_timings=True, timeout=None, return_routing=False):
        """Like forward(), returning ForwardResult(output, request_id, timings dict, latency_s,
        topk_ids, topk_weights); the last two only with return_routing (else None).
        return_timings: True (stage timings: the step is timed on the device), "host" (the host
        clock's stages and total only, an untimed step) or False (zeros)."""
        hidden = np.asarray(hidden)
        if (topk_ids is None) != (topk_weights is None):
            raise ValueError("pass both topk_ids and topk_weights, or neither (server routing)")
        if hidden.ndim != 2:
            raise ValueError(f"expected hidden [M, H]; got {hidden.shape}")
        ids = weights = None
        if topk_ids is not None:
            topk_ids = np.asarray(topk_ids)
            topk_weights = np.asarray(topk_weights)
            if topk_ids.ndim != 2 or topk_weights.shape != topk_ids.shape:
                raise ValueError(f"expected topk ids/weights [M, K]; got {topk_ids.shape}, "
                                 f"{topk_weights.shape}")
            if topk_ids.shape[0] != hidden.shape[0]:
                raise ValueError(
                    f"hidden has {hidden.shape[0]} tokens, topk_ids {topk_ids.shape[0]}")
            if topk_ids.dtype == np.int64:
                ids = _tensor(topk_ids, pb.DTYPE_INT64, np.dtype("<i8"))
            elif np.issubdtype(topk_ids.dtype, np.integer):
                ids = _tensor(topk_ids, pb.DTYPE_INT32, np.dtype("<i4"))
            else:
                raise TypeError(f"topk_ids has dtype {topk_ids.dtype}; expected an integer type")
            weights = _tensor(topk_weights, pb.DTYPE_FP32, np.dtype("<f4"))
        name = _hidden_dtype(hidden, dtype)
        if hidden.dtype.name == "bfloat16":
            hidden_bits = hidden.view(np.uint16)
        else:
            hidden_bits = hidden
        if self._native is not None:
            return self._forward_native(hidden, hidden_bits, name, topk_ids, topk_weights, layer,
                                        request_id, return_timings, return_routing, timeout)
        timed, host_timed = _wire.timing_flags(return_timings)
        request = pb.ForwardRequest(
            layer=layer,
            hidden_states=_tensor(hidden_bits, _WIRE[name], _dt.STORAGE[name]),
            topk_ids=ids,
            topk_weights=weights,
            request_id=request_id,
            return_timings=timed,
            return_host_timings=host_timed,
            return_routing=return_routing)
        start = time.perf_counter()
        reply = self._call(self._stub.Forward, request, timeout)
        latency = time.perf_counter() - start
        out_name = _FROM_WIRE.get(reply.output.dtype)
        if out_name != name:
            raise ValueError(f"server answered dtype {reply.output.dtype}; sent {name}")
        return _result(reply, _array(reply.output, _dt.STORAGE[name]), hidden, latency,
                       return_routing)

    def _forward_native(self, hidden, hidden_bits, name, topk_ids, topk_weights, layer,
                        request_id, return_timings, return_routing, timeout):
        """forward_full by the C++ client: the arrays' bytes go out in place, the answer is
        written into the array returned (forward_full has checked the shapes)."""
        storage = _dt.STORAGE[name]
        x = np.ascontiguousarray(hidden_bits).astype(storage, copy=False)
        m, h = x.shape
        ids = weights = None
        ids_wire, topk = _wire.DTYPE_INT32, 0
        if topk_ids is not None:
            if topk_ids.dtype == np.int64:
                ids, ids_wire = np.ascontiguousarray(topk_ids).astype("<i8", copy=False), \
                    _wire.DTYPE_INT64
            else:
                ids = np.ascontiguousarray(topk_ids).astype("<i4", copy=False)
            weights = np.ascontiguousarray(topk_weights).astype("<f4", copy=False)
            topk = ids.shape[1]
        if topk_ids is None and return_routing:
            # The server's routing comes back in the header: sized by the model's topk.
            if self._info is None:
                self._info = self.info(timeout=timeout)
            self._native.echo_topk = max(1, self._info.topk)
        out = np.empty((m, h), dtype=storage)
        want_header = bool(request_id) or return_timings or return_routing
        start = time.perf_counter()
        header = self._native.forward(
            layer, _WIRE[name], m, h, x.ctypes.data, ids_wire, topk,
            None if ids is None else ids.ctypes.data,
            None if weights is None else weights.ctypes.data, out.ctypes.data, out.nbytes,
            request_id=request_id.encode(), return_timings=return_timings,
            return_routing=return_routing, timeout=timeout or self.timeout,
            want_header=want_header)
        latency = time.perf_counter() - start
        reply = pb.ForwardResponse.FromString(header) if want_header else pb.ForwardResponse()
        return _result(reply, out, hidden, latency, return_routing)

    def forward(self, hidden, topk_ids=None, topk_weights=None, layer=0, dtype=None,
                request_id="", timeout=None):
        """One MoE layer: [M, H] hidden states -> [M, H] output in the same dtype.

        See the module docstring for the accepted dtypes; BF16 needs dtype='bf16' with uint16
        bit patterns. topk_ids/topk_weights None: the server routes. Raises grpc.RpcError on
        server errors (e.g. INVALID_ARGUMENT)."""
        return self.forward_full(hidden, topk_ids, topk_weights, layer=layer, dtype=dtype,
                                 request_id=request_id, return_timings=False,
                                 timeout=timeout).output


def register_forward_channel(stub, name, key, byte_size, timeout, metadata=None):
    """RegisterForwardChannel on a MoeService stub (shared by MoeClient and TorchMoeClient)."""
    return stub.RegisterForwardChannel(
        pb.RegisterForwardChannelRequest(name=name, key=key, byte_size=byte_size),
        timeout=timeout, metadata=metadata)


def unregister_forward_channel(stub, name, timeout, metadata=None):
    """UnregisterForwardChannel on a MoeService stub ("" = every channel)."""
    stub.UnregisterForwardChannel(pb.UnregisterForwardChannelRequest(name=name), timeout=timeout,
                                  metadata=metadata)
