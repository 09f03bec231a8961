"""Forward through the C++ client (libmoeserve_client_c, clients/cpp/moeserve_client_c.h), by
ctypes: a call from Python then costs one foreign call instead of grpcio's Python layer (about
100 us per call over the C++ client on the H200 host; tests/benchmarks/transport/RESULTS.md).

The library is found at $MOESERVE_CLIENT_LIB, else next to this module
(moeserve_client/libmoeserve_client_c.so, where a packager may put it). It is built with the
server (`ninja -C build moeserve_client_c` -> build/lib/libmoeserve_client_c.so).

Tensor bytes are passed as addresses and sent in place: they must stay valid and unchanged
until the call is answered (forward: until it returns; submit: until wait() or free). The
answer's bytes are copied once, into the caller's buffer. Failures raise CallError, a
grpc.RpcError with the server's code() and details(), as grpcio's calls raise.

No torch or numpy here: the callers (torch_client) pass addresses and sizes.
"""

import ctypes
import os
import threading

from .status import StatusError
from .wire import timing_flags

ABI_VERSION = 3
LIB_ENV = "MOESERVE_CLIENT_LIB"
LIB_NAME = "libmoeserve_client_c.so"

class CallError(StatusError):
    """A call through the C++ client failed: the server's status (code() / details()) or the
    client's own (UNAVAILABLE: no server; DEADLINE_EXCEEDED; INVALID_ARGUMENT: a bad argument,
    found before sending)."""


class _Options(ctypes.Structure):
    _fields_ = [("max_message_bytes", ctypes.c_int64), ("timeout_s", ctypes.c_double),
                ("spin_us", ctypes.c_int64), ("auth_token", ctypes.c_char_p),
                ("use_tls", ctypes.c_int32), ("tls_ca_file", ctypes.c_char_p),
                ("tls_cert_file", ctypes.c_char_p), ("tls_key_file", ctypes.c_char_p),
                ("tls_server_name", ctypes.c_char_p), ("wait_for_ready", ctypes.c_int32)]


class _Args(ctypes.Structure):
    _fields_ = [("layer", ctypes.c_int32), ("hidden_dtype", ctypes.c_int32),
                ("num_tokens", ctypes.c_int64), ("hidden", ctypes.c_int64),
                ("hidden_states", ctypes.c_void_p), ("ids_dtype", ctypes.c_int32),
                ("topk", ctypes.c_int64), ("topk_ids", ctypes.c_void_p),
                ("topk_weights", ctypes.c_void_p), ("request_id", ctypes.c_char_p),
                ("return_timings", ctypes.c_int32), ("return_routing", ctypes.c_int32),
                ("timeout_s", ctypes.c_double)]


class _Result(ctypes.Structure):
    _fields_ = [("out", ctypes.c_void_p), ("out_bytes", ctypes.c_int64),
                ("expect_dtype", ctypes.c_int32), ("expect_num_tokens", ctypes.c_int64),
                ("expect_hidden", ctypes.c_int64), ("header", ctypes.c_void_p),
                ("header_cap", ctypes.c_size_t), ("header_len", ctypes.POINTER(ctypes.c_size_t))]


def find_library():
    """The library's path, or None."""
    path = os.environ.get(LIB_ENV)
    if path:
        return path
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), LIB_NAME)
    return here if os.path.exists(here) else None


_lib = None
_lib_lock = threading.Lock()


def load(path=None):
    """The library, loaded once (OSError if it cannot be found or is of another ABI)."""
    global _lib
    with _lib_lock:
        if _lib is not None and path is None:
            return _lib
        path = path or find_library()
        if not path:
            raise OSError(f"{LIB_NAME} not found: set {LIB_ENV} to its path (built by "
                          "`ninja -C build moeserve_client_c` into build/lib)")
        lib = ctypes.CDLL(path)
        lib.moeserve_client_abi_version.restype = ctypes.c_int
        if lib.moeserve_client_abi_version() != ABI_VERSION:
            raise OSError(f"{path}: ABI {lib.moeserve_client_abi_version()}, expected "
                          f"{ABI_VERSION}")
        P, I64, ERR = ctypes.c_void_p, ctypes.c_int64, ctypes.c_char_p
        SZ = ctypes.c_size_t
        lib.moeserve_client_create.restype = P
        lib.moeserve_client_create.argtypes = [ctypes.c_char_p, ctypes.POINTER(_Options), ERR,
                                               SZ]
        lib.moeserve_client_destroy.restype = None
        lib.moeserve_client_destroy.argtypes = [P]
        lib.moeserve_forward.restype = ctypes.c_int
        lib.moeserve_forward.argtypes = [P, ctypes.POINTER(_Args), ctypes.POINTER(_Result), ERR,
                                         SZ]
        lib.moeserve_forward_parts.restype = ctypes.c_int
        lib.moeserve_forward_parts.argtypes = [P, ctypes.c_int, ctypes.POINTER(P),
                                               ctypes.POINTER(I64), ctypes.c_double,
                                               ctypes.POINTER(_Result), ERR, SZ]
        lib.moeserve_submit.restype = ctypes.c_int
        lib.moeserve_submit.argtypes = [P, ctypes.POINTER(_Args), ctypes.POINTER(P), ERR, SZ]
        lib.moeserve_submit_parts.restype = ctypes.c_int
        lib.moeserve_submit_parts.argtypes = [P, ctypes.c_int, ctypes.POINTER(P),
                                              ctypes.POINTER(I64), ctypes.c_double,
                                              ctypes.POINTER(P), ERR, SZ]
        lib.moeserve_call_done.restype = ctypes.c_int
        lib.moeserve_call_done.argtypes = [P]
        lib.moeserve_call_wait.restype = ctypes.c_int
        lib.moeserve_call_wait.argtypes = [P, ctypes.POINTER(_Result), ERR, SZ]
        lib.moeserve_call_free.restype = None
        lib.moeserve_call_free.argtypes = [P]
        if path == find_library():
            _lib = lib
        return lib


_ERR_BYTES = 1024
_HEADER_BYTES = 4096


class _Scratch(threading.local):
    """Per-thread argument structs and buffers: a call fills them instead of allocating."""

    def __init__(self):
        self.args = _Args()
        self.result = _Result()
        self.err = ctypes.create_string_buffer(_ERR_BYTES)
        self.header = ctypes.create_string_buffer(_HEADER_BYTES)
        self.header_len = ctypes.c_size_t(0)
        self.result.header_len = ctypes.pointer(self.header_len)


def _header_cap(request_id, routes, return_routing):
    return 1024 + 2 * len(request_id or b"") + (20 * routes if return_routing else 0)


class NativeCall:
    """A submitted call (NativeClient.submit): done(), wait(...) once; freed when collected
    (an unanswered call is waited for first, since it borrows the caller's bytes)."""

    __slots__ = ("_lib", "_ptr", "_keep", "_cap")

    def __init__(self, lib, ptr, keep, cap):
        self._lib, self._ptr, self._keep, self._cap = lib, ptr, keep, cap

    def done(self):
        return self._ptr is None or bool(self._lib.moeserve_call_done(self._ptr))

    def wait(self, out, out_bytes, dtype, num_tokens, hidden, want_header):
        """As NativeClient.forward's result half: fills `out` (an address) and returns the
        answer's header bytes (want_header) or None."""
        if self._ptr is None:
            raise RuntimeError("the call was waited for already")
        s = _scratch
        r, err = s.result, s.err
        header = s.header if self._cap <= _HEADER_BYTES else \
            ctypes.create_string_buffer(self._cap)
        r.out, r.out_bytes = out, out_bytes
        r.expect_dtype, r.expect_num_tokens, r.expect_hidden = dtype, num_tokens, hidden
        r.header = ctypes.addressof(header) if want_header else None
        r.header_cap = len(header)
        try:
            code = self._lib.moeserve_call_wait(self._ptr, r, err, _ERR_BYTES)
        finally:
            self._free()
        if code != 0:
            raise CallError(code, err.value.decode("utf-8", "replace"))
        return header.raw[:s.header_len.value] if want_header else None

    def _free(self):
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            self._lib.moeserve_call_free(ptr)
        self._keep = None

    def __del__(self):
        try:
            self._free()
        except Exception:  # interpreter shutdown: the library may be gone
            pass


_scratch = _Scratch()


class NativeClient:
    """One C++ client (one HTTP/2 channel) for `target`. Thread-safe. close() when done.

    auth_token: sent as "authorization: Bearer <token>" on every call. TLS (tls=True, or any
    tls_* file): tls_ca_file verifies the server (None: the system's roots), tls_cert_file +
    tls_key_file present this client's certificate (mutual TLS), tls_server_name is the name
    the server's certificate carries when it is not the target's host. wait_for_ready: calls
    wait for the channel to connect instead of failing at once with UNAVAILABLE."""

    def __init__(self, target, timeout=30.0, max_message_bytes=256 << 20, spin_us=0, lib=None,
                 auth_token=None, tls=False, tls_ca_file=None, tls_cert_file=None,
                 tls_key_file=None, tls_server_name=None, wait_for_ready=False):
        self._lib = lib or load()
        err = ctypes.create_string_buffer(_ERR_BYTES)
        enc = lambda v: v.encode() if v else None  # noqa: E731
        if timeout is None or timeout <= 0:
            raise ValueError(f"native client for {target!r}: timeout_s {timeout}; expected > 0")
        opts = _Options(int(max_message_bytes), float(timeout), int(spin_us), enc(auth_token),
                        1 if tls else 0, enc(tls_ca_file), enc(tls_cert_file),
                        enc(tls_key_file), enc(tls_server_name), 1 if wait_for_ready else 0)
        if max_message_bytes <= 0:
            raise ValueError(f"native client for {target!r}: max_message_bytes is "
                             f"{max_message_bytes}; expected > 0")
        self._ptr = self._lib.moeserve_client_create(target.encode(), ctypes.byref(opts), err,
                                                     _ERR_BYTES)
        if not self._ptr:
            raise ValueError(f"native client for {target!r}: "
                             f"{err.value.decode('utf-8', 'replace')}")
        self.target = target
        # Routes per token of the server's routing echo (return_routing with routing on the
        # server, where the call itself has topk 0): sizes the answer header's buffer. A
        # caller that knows the model's topk sets it; the default covers topk <= 16.
        self.echo_topk = 16

    def close(self):
        ptr, self._ptr = self._ptr, None
        if ptr:
            self._lib.moeserve_client_destroy(ptr)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @staticmethod
    def _fill_args(a, layer, hidden_dtype, num_tokens, hidden, hidden_ptr, ids_dtype, topk,
                   ids_ptr, weights_ptr, request_id, return_timings, return_routing, timeout):
        a.layer, a.hidden_dtype, a.num_tokens, a.hidden = layer, hidden_dtype, num_tokens, hidden
        a.hidden_states, a.ids_dtype, a.topk = hidden_ptr, ids_dtype, topk
        a.topk_ids, a.topk_weights = ids_ptr, weights_ptr
        a.request_id = request_id or None
        timed, host_timed = timing_flags(return_timings)
        a.return_timings = 2 if host_timed else int(timed)
        a.return_routing = int(bool(return_routing))
        a.timeout_s = timeout or 0.0

    def forward(self, layer, hidden_dtype, num_tokens, hidden, hidden_ptr, ids_dtype, topk,
                ids_ptr, weights_ptr, out, out_bytes, request_id=b"", return_timings=False,
                return_routing=False, timeout=None, want_header=False):
        """One blocking Forward. Dtypes are wire.DTYPE_* codes; *_ptr and out are addresses
        (ids_ptr / weights_ptr None: routing on the server); request_id bytes. The answer
        ([num_tokens, hidden] of hidden_dtype, out_bytes bytes) goes to out. Returns the
        answer's header (serialized ForwardResponse without the output's bytes: request_id,
        timings, routing) when want_header, else None."""
        s = _scratch
        a, r, err = s.args, s.result, s.err
        self._fill_args(a, layer, hidden_dtype, num_tokens, hidden, hidden_ptr, ids_dtype, topk,
                        ids_ptr, weights_ptr, request_id, return_timings, return_routing,
                        timeout)
        cap = _header_cap(request_id, num_tokens * (topk or self.echo_topk), return_routing)
        header = s.header if cap <= _HEADER_BYTES else ctypes.create_string_buffer(cap)
        r.out, r.out_bytes = out, out_bytes
        r.expect_dtype, r.expect_num_tokens, r.expect_hidden = hidden_dtype, num_tokens, hidden
        r.header = ctypes.addressof(header) if want_header else None
        r.header_cap = len(header)
        code = self._lib.moeserve_forward(self._ptr, a, r, err, _ERR_BYTES)
        if code != 0:
            raise CallError(code, err.value.decode("utf-8", "replace"))
        return header.raw[:s.header_len.value] if want_header else None

    def submit(self, layer, hidden_dtype, num_tokens, hidden, hidden_ptr, ids_dtype, topk,
               ids_ptr, weights_ptr, request_id=b"", return_timings=False, return_routing=False,
               timeout=None, keep=None):
        """Starts a Forward (arguments as forward's) and returns a NativeCall; `keep` (the
        objects owning the bytes) is held by the call until it is answered."""
        s = _scratch
        a, err = s.args, s.err
        self._fill_args(a, layer, hidden_dtype, num_tokens, hidden, hidden_ptr, ids_dtype, topk,
                        ids_ptr, weights_ptr, request_id, return_timings, return_routing,
                        timeout)
        call = ctypes.c_void_p()
        code = self._lib.moeserve_submit(self._ptr, a, ctypes.byref(call), err, _ERR_BYTES)
        if code != 0:
            raise CallError(code, err.value.decode("utf-8", "replace"))
        return NativeCall(self._lib, call.value, keep,
                          _header_cap(request_id, num_tokens * (topk or self.echo_topk),
                                      return_routing))

    @staticmethod
    def _parts(request):
        """(count, addresses, sizes) of a serialized request (bytes), kept alive by the caller."""
        n = len(request)
        addrs = (ctypes.c_void_p * 1)(ctypes.cast(request, ctypes.c_void_p).value if n else None)
        sizes = (ctypes.c_int64 * 1)(n)
        return addrs, sizes

    def forward_request(self, request, dtype, num_tokens, hidden, out=None, out_bytes=0,
                        timeout=None, header_cap=_HEADER_BYTES):
        """A blocking Forward of a serialized ForwardRequest (bytes, e.g. from
        wire.forward_request joined). The answer's bytes, if any, go to `out`; returns the
        answer without them (serialized ForwardResponse)."""
        s = _scratch
        r, err = s.result, s.err
        addrs, sizes = self._parts(request)
        header = s.header if header_cap <= _HEADER_BYTES else \
            ctypes.create_string_buffer(header_cap)
        r.out, r.out_bytes = out, out_bytes
        r.expect_dtype, r.expect_num_tokens, r.expect_hidden = dtype, num_tokens, hidden
        r.header, r.header_cap = ctypes.addressof(header), len(header)
        code = self._lib.moeserve_forward_parts(self._ptr, 1, addrs, sizes, timeout or 0.0, r,
                                                err, _ERR_BYTES)
        if code != 0:
            raise CallError(code, err.value.decode("utf-8", "replace"))
        return header.raw[:s.header_len.value]

    def submit_request(self, request, timeout=None, header_cap=_HEADER_BYTES):
        """Starts a Forward of a serialized request (bytes, held by the call) -> NativeCall."""
        err = _scratch.err
        addrs, sizes = self._parts(request)
        call = ctypes.c_void_p()
        code = self._lib.moeserve_submit_parts(self._ptr, 1, addrs, sizes, timeout or 0.0,
                                               ctypes.byref(call), err, _ERR_BYTES)
        if code != 0:
            raise CallError(code, err.value.decode("utf-8", "replace"))
        return NativeCall(self._lib, call.value, request, header_cap)


def available():
    """Whether the library can be loaded here (and why not: (False, reason))."""
    try:
        load()
        return True, ""
    except OSError as e:
        return False, str(e)


__all__ = ["CallError", "NativeClient", "NativeCall", "available", "find_library", "load",
           "LIB_ENV"]
