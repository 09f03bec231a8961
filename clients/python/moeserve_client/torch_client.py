"""A PyTorch-native moeserve client: torch tensors in and out, several calls in flight.

    import torch
    from moeserve_client.torch_client import TorchMoeClient

    client = TorchMoeClient("127.0.0.1:50051")
    fut = client.submit(hidden, topk_ids, topk_weights, layer=3)   # returns at once
    ...                                                            # other work, other submits
    out = client.result(fut)                                       # [M, H], hidden's dtype/device
    client.result(fut2, out=buf)                                   # or into a tensor you own
    y = client.forward(hidden)                                     # server-side routing

Tensors: hidden [M, H] bfloat16, float16 or float32; topk_ids [M, K] int32 or int64;
topk_weights [M, K] float (sent as float32). CPU or CUDA; the answer has hidden's dtype and
comes back on hidden's device (or into `out`, any device, same dtype and shape).
topk_ids and topk_weights both None: the server routes with the layer's gate
(ModelInfo.server_routing); return_routing=True puts its choice in fut.topk_ids (int32) and
fut.topk_weights (float32), on hidden's device.

How bytes move:
  * CPU tensors, bytes: the request is built with one copy of each tensor's bytes (no numpy,
    no protobuf copies: moeserve_client.wire); the answer is a view of the reply's bytes
    (torch.frombuffer), copied only into `out` when one is given.
  * CUDA tensors, bytes: device -> pinned host staging -> request; reply -> `out` (or a new
    tensor on the device).
  * Regions (shared_memory="auto", "cuda" or "system"), when the server is on this host (a
    unix: or loopback target) and runs with --enable_shared_memory: hidden states are copied
    into a registered region (CUDA tensors device-to-device into a CUDA IPC region, which needs
    the cuda backend; CPU tensors by one memcpy into a POSIX shared-memory region) and the
    server writes the answer into the same region. topk_ids / topk_weights on the same device
    as hidden go into the region too (a CUDA region: the server copies them to its host; no
    device-to-host copy or sync in this process), and then only a few hundred header bytes,
    built once per shape, travel with the call; routing on another device travels as bytes.
    Host copies of 1 MB or more are split over a few threads (copy_threads). "auto" tries
    each kind once and falls back to bytes for good on a refusal; "cuda" / "system" use only
    that kind and raise instead; "off" never tries. CUDA hidden states without routing (the
    server routes, on its host) always go as bytes.
  * Zero copy (alloc_hidden / alloc_routing / empty): tensors that live in a region of this
    client from the start. Write the hidden states (and routing) into them, pass them (or
    their first rows) to submit/forward: the client finds them by address and sends only
    RegionRefs, nothing copied in (CUDA: one cudaStreamSynchronize of the current stream,
    by torch's raw stream handle). forward(..., out="region") returns the answer where the
    server wrote it (alloc_hidden's answer area; valid until the next call answered there,
    see forward()); out=<a tensor of empty()> has it written straight there. Tensors outside
    regions, strided views and released regions go by the copying paths above.
  * CUDA streams, by a CUDA region: submit() enqueues the copies of hidden (and the routing)
    into the region on the device's current stream and waits for that stream once (the
    server, another process, sees none of ours): so whatever produced hidden on that stream
    is done, and submit() blocks until then. result() enqueues the copy of the answer into
    `out` (or a new tensor) on the device's current stream at that time and returns without
    waiting: the server finished writing the region before it answered. Use the answer on
    that stream (or synchronize it) as with any torch op's output.
  * The call itself (channel="auto" or True): through a forward channel
    (moeserve_client.channel, a shared-memory object the server polls) instead of a gRPC call,
    when the server is on this host and allows it (--enable_shared_memory); a request larger
    than a slot (channel_slot_bytes), or one made while every slot is busy, goes by gRPC.
    "auto" falls back to gRPC for good if the server refuses the channel or detaches from it
    (a blocking forward() then repeats its call by gRPC); True raises instead; False: gRPC only.
    Errors come back as grpc.RpcError either way (ChannelError through the channel).
  * The gRPC call (native="auto" or True): made by the C++ client (moeserve_client.native,
    libmoeserve_client_c.so at $MOESERVE_CLIENT_LIB) instead of grpcio, when the library is
    found: one foreign call per Forward, CPU tensor bytes sent in place (no request copy) and
    the answer copied once, into `out` or a new tensor. "auto" uses grpcio when the library
    is missing (native_error says why); True raises instead; False: grpcio only.
    channel_options apply to grpcio's channel only. Errors: native.CallError, a
    grpc.RpcError with code() and details().

Thread-safety: submit/result may be called from several threads. A future is consumed by one
result() call; close() gives up the calls not taken (result() then raises RuntimeError).

A region call that fails without the server's answer (the client's deadline, a cancel, a broken
connection) may still run there and write its answer into the region later: the region is not
reused, and freed once the server lets it be unregistered (zero-copy bytes: once the server
reports no call in flight on their region). Device memory that the server refuses to
unregister is never freed (a RuntimeWarning).
"""

import collections
import ctypes
import ipaddress
import mmap
import os
import queue
import threading
import time
import warnings

import grpc
import numpy as np
import torch

from . import channel as _chan
from . import client as _client
from . import native as _native
from . import shared_memory as _shm
from . import wire
from .client import pb, pb_grpc

_TO_WIRE = {torch.bfloat16: wire.DTYPE_BF16, torch.float16: wire.DTYPE_FP16,
            torch.float32: wire.DTYPE_FP32, torch.int32: wire.DTYPE_INT32,
            torch.int64: wire.DTYPE_INT64}
_FROM_WIRE = {v: k for k, v in _TO_WIRE.items()}
_FORWARD = "/moeserve.v1.MoeService/Forward"


_FLOAT_WIRE = {torch.bfloat16: wire.DTYPE_BF16, torch.float16: wire.DTYPE_FP16,
               torch.float32: wire.DTYPE_FP32}
_ID_WIRE = {torch.int32: wire.DTYPE_INT32, torch.int64: wire.DTYPE_INT64}
# Integer ids of other types, sent widened (or, for the unsigned, wrapped) to int32.
_OTHER_INTS = frozenset(getattr(torch, n) for n in ("uint8", "int8", "int16", "uint16",
                                                    "uint32", "uint64") if hasattr(torch, n))


def _host_bytes(t, n):
    """A zero-copy memoryview of the n bytes of a contiguous CPU tensor (keep `t` alive)."""
    if n == 0:
        return b""
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


_frombuffer_warned = False


def _view(buffer, wt):
    """The tensor `wt` (a wire.WireTensor) of `buffer`, viewed in place (CPU)."""
    global _frombuffer_warned
    dtype = _FROM_WIRE.get(wt.dtype)
    if dtype is None:
        raise ValueError(f"reply tensor has unknown dtype {wt.dtype}")
    if wt.nbytes == 0:
        return torch.empty(wt.shape, dtype=dtype)
    if _frombuffer_warned:
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=wt.nbytes, offset=wt.offset)
    else:
        # torch warns (once per process) that the reply's bytes object is read-only; it is
        # private to this call, so the view may be used as any tensor.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(buffer, dtype=torch.uint8, count=wt.nbytes, offset=wt.offset)
        _frombuffer_warned = True
    return flat.view(dtype).view(wt.shape)


def _view_at(buffer, offset, nbytes, dtype, shape):
    """Bytes [offset, offset + nbytes) of `buffer` as a CPU tensor of dtype and shape, in place."""
    wt = wire.WireTensor()
    wt.dtype, wt.shape, wt.offset, wt.nbytes = _TO_WIRE[dtype], shape, offset, nbytes
    return _view(buffer, wt)


def _is_local_target(target):
    if target.startswith("unix:") or target.startswith("unix-abstract:"):
        return True
    host = target
    if host.startswith("ipv4:") or host.startswith("ipv6:") or host.startswith("dns:"):
        host = host.split(":", 1)[1].lstrip("/")
    if host.startswith("["):
        host = host[1:host.find("]")]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_RETRY = object()


class _BearerToken(grpc.UnaryUnaryClientInterceptor):
    """Adds "authorization: Bearer <token>" to every unary call on the channel."""

    class _Details(collections.namedtuple(
            "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                         "compression")), grpc.ClientCallDetails):
        pass

    def __init__(self, token):
        self._entry = ("authorization", f"Bearer {token}")

    def intercept_unary_unary(self, continuation, details, request):
        d = self._Details(details.method, details.timeout,
                          list(details.metadata or ()) + [self._entry], details.credentials,
                          getattr(details, "wait_for_ready", None),
                          getattr(details, "compression", None))
        return continuation(d, request)


class _NativeArgs(collections.namedtuple(
        "_NativeArgs", ("layer", "hidden_dtype", "num_tokens", "hidden", "hidden_ptr",
                        "ids_dtype", "topk", "ids_ptr", "weights_ptr", "request_id",
                        "return_timings", "return_routing"))):
    """A call for the C++ client (NativeClient.submit's arguments): wire dtypes, addresses."""

    @property
    def want_header(self):
        return bool(self.request_id or self.return_timings or self.return_routing)


class MoeFuture:
    """A Forward call in flight (TorchMoeClient.submit). After result(): request_id, timings
    (dict of wire.TIMING_NAMES, with return_timings), topk_ids / topk_weights (with
    return_routing). used_region / used_channel: whether the call went by a region / through the forward channel; zero_copy:
    whether hidden was sent in place from a region of the client (alloc_hidden / empty)."""

    __slots__ = ("_call", "_chan", "_keep", "_dtype", "_shape", "_device", "_region", "_region_out",
                 "_start", "_out", "_answer", "_busy", "_native", "request_id", "timings",
                 "topk_ids", "topk_weights", "latency_s", "used_region", "used_channel",
                 "zero_copy")

    def __init__(self):
        self._call = None
        self._chan = None
        self._keep = None
        self._region = None
        self._region_out = None
        self._out = None     # submit()'s `out`
        self._answer = None  # zero copy: the answer's tensor in a region
        self._busy = None    # zero copy: [(region, its busy entry)] while in flight
        self._native = None  # a call by the C++ client with tensor addresses: its arguments
        self.request_id = ""
        self.timings = None
        self.topk_ids = None
        self.topk_weights = None
        self.latency_s = None
        self.used_region = False
        self.used_channel = False
        self.zero_copy = False

    def done(self):
        if self._chan is not None:
            return self._chan[1].done()  # (channel, its ChannelFuture)
        if self._call is None:
            return True  # a channel call whose result was taken
        return self._call.done()


# ---- CUDA memory of our own, shared by a plain cudaIpcGetMemHandle ----
#
# A region's memory is cudaMalloc'ed here through the CUDA runtime that torch loaded (ctypes),
# not taken from torch's caching allocator: its IPC handle then names exactly this allocation
# (offset 0), and torch's own CUDA IPC bookkeeping (storage._share_cuda_(), whose reference
# counting fails with "Producer process has been terminated before all shared CUDA tensors
# released") is not involved. torch sees the memory through __cuda_array_interface__.

_cudart_lib = None


def _cudart():
    """The CUDA runtime library torch uses (found in this process's mappings), via ctypes."""
    global _cudart_lib
    if _cudart_lib is not None:
        return _cudart_lib
    torch.cuda.init()
    candidates = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ", 5)[-1].strip()
                if "libcudart" in os.path.basename(path) and path not in candidates:
                    candidates.append(path)
    except OSError:
        pass
    candidates += ["libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"]
    errors = []
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
            lib.cudaIpcGetMemHandle  # noqa: B018  (a runtime, not a stub)
        except (OSError, AttributeError) as e:
            errors.append(f"{name}: {e}")
            continue
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaIpcGetMemHandle.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        for fn in (lib.cudaMalloc, lib.cudaFree, lib.cudaIpcGetMemHandle, lib.cudaSetDevice,
                   lib.cudaGetDevice):
            fn.restype = ctypes.c_int
        _cudart_lib = lib
        return lib
    raise RuntimeError("no CUDA runtime library (libcudart) found: " + "; ".join(errors))


def _cuda_check(lib, err, what):
    if err != 0:
        raise RuntimeError(f"{what}: CUDA error {err} ({lib.cudaGetErrorString(err).decode()})")


def _cuda_malloc_ipc(index, nbytes):
    """cudaMalloc(nbytes) on device `index` and its CUDA IPC handle: (lib, ptr, handle bytes).
    Frees the memory if a step fails; leaves the current device as it was."""
    lib = _cudart()
    prev = ctypes.c_int()
    _cuda_check(lib, lib.cudaGetDevice(ctypes.byref(prev)), "cudaGetDevice")
    ptr = ctypes.c_void_p()
    handle = ctypes.create_string_buffer(64)
    try:
        _cuda_check(lib, lib.cudaSetDevice(index), "cudaSetDevice")
        _cuda_check(lib, lib.cudaMalloc(ctypes.byref(ptr), nbytes), "cudaMalloc")
        _cuda_check(lib, lib.cudaIpcGetMemHandle(handle, ptr), "cudaIpcGetMemHandle")
    except BaseException:
        if ptr.value:
            lib.cudaFree(ptr)
        raise
    finally:
        lib.cudaSetDevice(prev.value)
    return lib, ptr.value, handle.raw


def _round_up(nbytes, unit):
    """max(nbytes, unit) rounded up to a multiple of unit (region capacities)."""
    return -(-max(nbytes, unit) // unit) * unit


def _unregister_region(client, name, give_up=None):
    """UnregisterSharedMemory(name): True once the server will not touch the region again (OK;
    NOT_FOUND: it does not know it; UNAVAILABLE: the server is gone), False when it refused
    (FAILED_PRECONDITION: a call still uses it; retried until time.monotonic() passes give_up,
    since the server may count a call for a moment after answering it) or did not answer."""
    while True:
        try:
            client._stub.UnregisterSharedMemory(pb.UnregisterSharedMemoryRequest(name=name),
                                                timeout=client.timeout)
            return True
        except grpc.RpcError as e:
            code = _status_code(e)
            if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                return True
            if code != grpc.StatusCode.FAILED_PRECONDITION or give_up is None or \
                    time.monotonic() > give_up:
                return False
        except ValueError:  # grpcio's channel closed: the server was not asked
            return False
        time.sleep(0.002)


def _status_code(error):
    code = getattr(error, "code", None)
    try:
        return code() if callable(code) else None
    except Exception:  # pylint: disable=broad-except  (a status-less RpcError)
        return None


# Statuses that only the server's answer carries (or that refuse a call before it leaves this
# process): the server is done with the call's regions. Any other failure (the client's own
# deadline, a cancel, a broken connection, an interrupt) may leave the call running there; it
# writes its answer into the region later (the server's deadline runs later than ours).
_ANSWERED = frozenset((grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                       grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.PERMISSION_DENIED,
                       grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
                       grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED))


def _server_answered(error):
    """Whether a failed call's `error` says that the server no longer runs it."""
    return isinstance(error, grpc.RpcError) and _status_code(error) in _ANSWERED


# Device memory of regions the server refused to unregister: it may still write into them
# through its IPC mapping, so they are never freed (kept here for the process's lifetime).
_leaked = []


def _leak(what, name, keep):
    _leaked.append(keep)
    warnings.warn(f"moeserve: the server did not unregister region {name}: its {what} is kept "
                  "(not freed) for the life of this process, since the server may still write "
                  "into it", RuntimeWarning, stacklevel=3)


class _DeviceMemory:
    """Bytes [ptr, ptr + size) of device memory, for torch.as_tensor (no copy)."""

    def __init__(self, ptr, size):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None}


def _align(n):
    return (n + 255) // 256 * 256


class _CudaRegion:
    """A device buffer of its own (cudaMalloc) registered with the server as a CUDA IPC region.
    buf: a uint8 tensor over all of it.

    Streams: write() enqueues its copies on the device's current stream; publish() waits for
    that stream (one cudaStreamSynchronize per call: the server reads the region from another
    process, which sees none of our streams). read() enqueues the copy of the answer on the
    current stream and returns at once: the server finished writing before it answered."""

    kind = "cuda"

    def __init__(self, client, device, nbytes):
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.capacity = _round_up(nbytes, 2 << 20)
        self.name = f"moeserve-torch-{os.getpid()}-{id(self):x}-cuda{self.index}"
        self.client = client
        self.registered = False
        self.closed = False
        # read() / write() against close() from another thread: never a copy into freed memory.
        self._lock = threading.Lock()
        self._views = {}
        # The stream of the last read() (its copy may still be running) if it differs from the
        # stream of the next call, which must wait for it too before the server overwrites.
        self._read_stream = None
        lib, self.ptr, handle = _cuda_malloc_ipc(self.index, self.capacity)
        try:
            self.buf = torch.as_tensor(_DeviceMemory(self.ptr, self.capacity), device=device)
            if self.buf.data_ptr() != self.ptr or self.buf.numel() != self.capacity:
                raise RuntimeError("torch.as_tensor did not alias the region's memory")
            client._stub.RegisterCudaSharedMemory(
                pb.RegisterCudaSharedMemoryRequest(name=self.name, raw_handle=handle,
                                                   device_id=self.index,
                                                   byte_size=self.capacity),
                timeout=client.timeout)
            self.registered = True
        except BaseException:
            self.buf = None
            lib.cudaFree(ctypes.c_void_p(self.ptr))
            raise

    def ref(self, offset, nbytes):
        return (self.name, offset, nbytes)

    def _view(self, offset, dtype, shape, nbytes):
        """The region's bytes [offset, offset + nbytes) as a dtype tensor of `shape`; made once
        per (offset, dtype, shape): a frontend repeats a few shapes."""
        key = (offset, dtype, shape)
        v = self._views.get(key)
        if v is None:
            v = self.buf[offset:offset + nbytes].view(dtype).view(shape)
            if len(self._views) >= 256:
                self._views.clear()
            self._views[key] = v
        return v

    def _check_open(self):
        if self.closed:
            raise RuntimeError(f"region {self.name} is closed (the client was closed)")

    def write(self, offset, t, dtype, shape, nbytes):
        """Enqueues the copy of `t` (on this region's device; converted to `dtype` on the way,
        any strides) into bytes [offset, offset + nbytes), on the current stream."""
        with self._lock:
            self._check_open()
            self._view(offset, dtype, shape, nbytes).copy_(t)

    def publish(self):
        """Waits until what write() enqueued (and a read() on another stream) has landed."""
        stream = torch.cuda.current_stream(self.index)
        prev = self._read_stream
        if prev is not None:
            self._read_stream = None
            if prev != stream:
                prev.synchronize()
        stream.synchronize()

    def read(self, offset, nbytes, dtype, shape, out):
        with self._lock:
            self._check_open()
            src = self._view(offset, dtype, shape, nbytes)
            if out is None:
                out = src.clone()
            else:
                out.copy_(src)
            self._read_stream = torch.cuda.current_stream(self.index)
        return out

    def close(self, give_up=None):
        """Unregisters and frees the memory; if the server refuses to unregister it (a call
        still runs on it, past give_up), the memory is leaked instead: the server maps it."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        gone = True
        if self.registered:
            self.registered = False
            gone = _unregister_region(self.client, self.name, give_up)
        if self.buf is not None:
            self._views = {}
            self.buf = None
            if not gone:
                _leak(f"{self.capacity} bytes of device memory", self.name, self.ptr)
                return
            torch.cuda.synchronize(self.index)  # no copy of ours still reads or writes it
            lib = _cudart()
            lib.cudaFree(ctypes.c_void_p(self.ptr))


class _Copier:
    """memcpy of large host buffers split over a few threads of its own (ctypes.memmove releases
    the GIL), since one core copies at ~5-10 GB/s. The threads sleep on a queue between copies
    (no spinning: torch's copy_ would run an OpenMP parallel region whose spinning threads take
    CPU from a server on the same cores). threads=0: always one memmove on the caller."""

    MIN_BYTES = 1 << 20  # below this the hand-off costs more than it saves

    def __init__(self, threads):
        self.threads = threads
        self._queues = []
        self._done = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = False

    def _start(self):
        for i in range(self.threads):
            q = queue.SimpleQueue()
            t = threading.Thread(target=self._run, args=(q,), daemon=True,
                                 name=f"moeserve-copy-{i}")
            t.start()
            self._queues.append(q)
        self._started = True

    def _run(self, q):
        memmove = ctypes.memmove
        done = self._done
        while True:
            job = q.get()
            if job is None:
                return
            try:
                memmove(*job)
                done.put(None)
            except BaseException as e:  # pylint: disable=broad-except
                done.put(e)

    def __call__(self, dst, src, n):
        if n < self.MIN_BYTES or not self.threads or not self._lock.acquire(blocking=False):
            ctypes.memmove(dst, src, n)  # small, no threads, or another thread's copy running
            return
        try:
            if not self._started:
                self._start()
            ways = min(self.threads + 1, max(1, n // (self.MIN_BYTES // 2)))
            chunk = (n // ways + 4095) // 4096 * 4096
            starts = list(range(0, n, chunk))
            for q, s in zip(self._queues, starts[1:]):
                q.put((dst + s, src + s, min(chunk, n - s)))
            ctypes.memmove(dst, src, min(chunk, n))
            error = None
            for _ in starts[1:]:
                e = self._done.get()
                error = error or e
            if error is not None:
                raise error
        finally:
            self._lock.release()

    def close(self):
        with self._lock:
            for q in self._queues:
                q.put(None)
            self._queues = []
            self._started = False


class _HostRegion:
    """A POSIX shared-memory object registered with the server as a system region; bytes go in
    and out by memcpy (client.memcpy: large ones over a few threads)."""

    kind = "system"

    def __init__(self, client, nbytes):
        self.device = None
        self.capacity = _round_up(nbytes, 1 << 20)
        self.shm = _shm.SystemRegion.create(self.capacity)
        a = np.frombuffer(self.shm.buf, np.uint8)
        self.addr = a.ctypes.data
        del a
        self.name = f"moeserve-torch-{os.getpid()}-{id(self):x}-host"
        self.client = client
        self.memcpy = client._memcpy
        self.registered = False
        self.closed = False
        # read() / write() against close() from another thread: never a copy from unmapped
        # memory.
        self._lock = threading.Lock()
        try:
            client._stub.RegisterSystemSharedMemory(
                pb.RegisterSystemSharedMemoryRequest(name=self.name, key=self.shm.key, offset=0,
                                                     byte_size=self.capacity),
                timeout=client.timeout)
            self.registered = True
        except BaseException:
            self.shm.close(unlink=True)
            raise

    def ref(self, offset, nbytes):
        return (self.name, offset, nbytes)

    def write(self, offset, t, dtype, shape, nbytes):
        """Copies `t` (a CPU tensor; converted to `dtype` first if needed) into bytes
        [offset, offset + nbytes)."""
        if t.dtype is not dtype:
            t = t.to(dtype)
        if not t.is_contiguous():
            t = t.contiguous()
        with self._lock:
            if self.closed:
                raise RuntimeError(f"region {self.name} is closed (the client was closed)")
            if nbytes < _Copier.MIN_BYTES:
                ctypes.memmove(self.addr + offset, t.data_ptr(), nbytes)
            else:
                self.memcpy(self.addr + offset, t.data_ptr(), nbytes)

    def publish(self):
        pass  # memcpy has landed when it returns

    def read(self, offset, nbytes, dtype, shape, out):
        direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
        t = out if direct else torch.empty(shape, dtype=dtype)
        with self._lock:
            if self.closed:
                raise RuntimeError(f"region {self.name} is closed (the client was closed)")
            self.memcpy(t.data_ptr(), self.addr + offset, nbytes)
        if out is None or direct:
            return t
        out.copy_(t)
        return out

    def close(self, give_up=None):
        """Unregisters, unmaps and unlinks. Unmapping is safe even if the server refuses to
        unregister (a call still runs on it): it writes into its own mapping of the object."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        if self.registered:
            self.registered = False
            _unregister_region(self.client, self.name, give_up)
        self.shm.close(unlink=True)


# ---- zero-copy: tensors that live in a region (TorchMoeClient.alloc_hidden / empty) ----


class _OwnedDeviceMemory(_DeviceMemory):
    """Device memory cudaMalloc'ed for a zero-copy region, freed when the last tensor viewing it
    is gone (torch.as_tensor keeps this object alive for as long as its tensor and views)."""

    def __init__(self, lib, ptr, size):
        super().__init__(ptr, size)
        self._lib, self._ptr = lib, ptr

    def __del__(self):
        try:
            self._lib.cudaFree(ctypes.c_void_p(self._ptr))
        except Exception:  # pylint: disable=broad-except  (interpreter shutdown)
            pass


class _ZeroCopyRegion:
    """A region registered with the server whose memory the caller's tensors live in
    (TorchMoeClient.alloc_hidden / alloc_routing / empty), so that a call sends RegionRefs to
    them and copies nothing. kind "system": a POSIX shared-memory object mapped here (mmap),
    CPU tensors; "cuda": cudaMalloc'ed device memory shared by cudaIpcGetMemHandle.

    The memory outlives close() (unregister + unlink) for as long as a tensor views it: the
    tensors keep the mapping / allocation alive, so a stale tensor reads stale bytes, never
    freed memory. `base` is a uint8 tensor over all of it; [lo, hi) its addresses. `twin`:
    for alloc_hidden's regions, the offset of the answer area (the same size as the hidden
    area, right after it): a call on bytes [o, o + n) of one area is answered in the same
    bytes of the other."""

    def __init__(self, client, device, nbytes, twin=None):
        self.client = client
        self.device = device
        self.kind = "cuda" if device.type == "cuda" else "system"
        self.index = None
        self.twin = twin
        self.area = 0   # with twin: the bytes of each area
        self.busy = []  # (in_lo, in_hi, out_lo, out_hi) of calls in flight on this region
        # Entries of calls that failed without the server's answer: it may still run them, so
        # their bytes stay busy until it reports no call in flight here (_reclaim_zero_copy).
        self.abandoned = []
        self._views = {}  # (offset, shape, dtype) -> tensor(): a view costs three torch calls
        self.name = f"moeserve-zc-{os.getpid()}-{id(self):x}"
        self.registered = False
        self._mm = None
        if self.kind == "cuda":
            self.index = device.index if device.index is not None else \
                torch.cuda.current_device()
            self.device = torch.device("cuda", self.index)
            self.capacity = _round_up(nbytes, 2 << 20)
            lib, ptr, handle = _cuda_malloc_ipc(self.index, self.capacity)
            mem = _OwnedDeviceMemory(lib, ptr, self.capacity)  # frees from now on
            self.base = torch.as_tensor(mem, device=self.device)
            request = pb.RegisterCudaSharedMemoryRequest(
                name=self.name, raw_handle=handle, device_id=self.index,
                byte_size=self.capacity)
            register = client._stub.RegisterCudaSharedMemory
        else:
            self.capacity = _round_up(nbytes, 1 << 20)
            self.key = f"/{self.name}"
            fd = os.open("/dev/shm" + self.key, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, self.capacity)
                self._mm = mmap.mmap(fd, self.capacity, mmap.MAP_SHARED,
                                     mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                os.unlink("/dev/shm" + self.key)
                raise
            finally:
                os.close(fd)
            self.base = torch.frombuffer(self._mm, dtype=torch.uint8)
            request = pb.RegisterSystemSharedMemoryRequest(name=self.name, key=self.key,
                                                           offset=0, byte_size=self.capacity)
            register = client._stub.RegisterSystemSharedMemory
        self.lo = self.base.data_ptr()
        self.hi = self.lo + self.capacity
        try:
            register(request, timeout=client.timeout)
            self.registered = True
        except BaseException:
            self.close()
            raise

    def tensor(self, offset, shape, dtype):
        """A view of `shape` `dtype` at `offset` (the same object for the same arguments: it
        shows the region's bytes as they are, so it never goes stale)."""
        key = (offset, shape, dtype)
        t = self._views.get(key)
        if t is None:
            n = torch.empty(0, dtype=dtype).element_size()
            for d in shape:
                n *= d
            t = self.base[offset:offset + n].view(dtype).view(shape)
            if len(self._views) >= 256:
                self._views.clear()
            self._views[key] = t
        return t

    def conflicts(self, in_lo, in_hi, out_lo, out_hi, entries=None):
        """Whether a call reading [in_lo, in_hi) and writing [out_lo, out_hi) of this region
        would race one in flight (its answer written where another reads or writes).
        entries: those calls (default: busy)."""
        for a, b, c, d in (self.busy if entries is None else entries):
            if (out_lo < b and a < out_hi) or (out_lo < d and c < out_hi) or \
                    (in_lo < d and c < in_hi):
                return True
        return False

    def close(self, give_up=None):
        if self.registered:
            self.registered = False
            if not _unregister_region(self.client, self.name, give_up) and \
                    self.kind == "cuda" and self.base is not None:
                # The server may still write into it through its IPC mapping: never freed
                # (the base tensor holds the allocation).
                _leak(f"{self.capacity} bytes of device memory", self.name, self.base)
        self.base = None
        if self._mm is not None:
            try:
                os.unlink("/dev/shm" + self.key)
            except FileNotFoundError:
                pass
            # Not mm.close(): torch.frombuffer's tensors hold the mmap object, not an export of
            # it, so closing would unmap under them. It is unmapped with the last of them.
            self._mm = None


class TorchMoeClient:
    """A channel to one moeserve server, speaking torch tensors. close() (or `with`) when done.

    timeout: per-call deadline in seconds. shared_memory: "auto" | "cuda" | "system" | "off";
    channel: "auto" | True | False, or an open moeserve_client.channel.ForwardChannel (used,
    not closed, by this client); channel_slots / channel_slot_bytes / spin_us: the forward
    channel this client opens (see the module docstring). channel_options: extra grpc channel
    options (grpcio's). native: "auto" | True | False, the C++ client for the gRPC calls (see
    the module docstring); native_spin_us: how long its blocking call polls for the answer
    before it sleeps (costs a core while it polls). auth_token: sent as "authorization: Bearer
    <token>" on every call (servers run with --auth_token_file), by both paths. copy_threads:
    threads of its own that share each host copy of 1 MB or more (into and out of a system
    region, a reply into `out`); None: a quarter of the cores, at most 4; 0: one memcpy on the
    calling thread.
    """

    def __init__(self, target, timeout=30.0, max_message_bytes=256 << 20, shared_memory="auto",
                 channel_options=(), channel="auto", channel_slots=4,
                 channel_slot_bytes=1 << 20, spin_us=200, copy_threads=None, native="auto",
                 native_spin_us=0, auth_token=None):
        if shared_memory not in ("auto", "cuda", "system", "off"):
            raise ValueError(f"shared_memory={shared_memory!r}; expected auto, cuda, system or "
                             "off")
        self.target = target
        self.timeout = timeout
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes)] + list(channel_options)
        self._channel = grpc.insecure_channel(target, options=options)
        if auth_token:
            self._channel = grpc.intercept_channel(self._channel, _BearerToken(auth_token))
        self._stub = pb_grpc.MoeServiceStub(self._channel)
        # Raw bytes both ways: requests are built by moeserve_client.wire.
        self._forward = self._channel.unary_unary(_FORWARD)
        # The C++ client, when its library is here (native="auto"), makes the Forward calls.
        if native not in ("auto", True, False):
            raise ValueError(f"native={native!r}; expected 'auto', True or False")
        self._native = None
        self._native_error = None
        if native:
            try:
                self._native = _native.NativeClient(target, timeout=timeout,
                                                    max_message_bytes=max_message_bytes,
                                                    spin_us=native_spin_us,
                                                    auth_token=auth_token)
            except (OSError, ValueError) as e:
                if native is True:
                    raise
                self._native_error = e
        self._shared_memory = shared_memory
        self._local = _is_local_target(target)
        self._lock = threading.Lock()
        self._regions_free = {}    # "cpu" or a CUDA index -> [region]
        self._regions_all = []
        # Regions whose call failed without the server's answer (it may still write into them):
        # never reused; unregistered and freed once the server lets go (_sweep_quarantine).
        self._regions_quarantined = []
        self._quarantine_swept = 0.0
        self._closed = False
        self._region_disabled = {"cuda": shared_memory in ("off", "system"),
                                 "system": shared_memory in ("off", "cuda")}
        self._region_errors = {}
        self._pinned = {}          # thread id -> pinned staging tensor
        if copy_threads is None:
            copy_threads = min(4, (os.cpu_count() or 1) // 4)
        self._memcpy = _Copier(max(0, int(copy_threads)))
        # Serialized requests whose tensors are all in a region, by what determines their bytes.
        self._requests = {}
        self._info = None
        self._zc = []              # _ZeroCopyRegion: regions the caller's tensors live in
        self._stream_sync = None   # (torch's raw current-stream getter, the CUDA runtime)
        # The forward channel: opened at the first call ("auto", True) or given.
        self._ch = None
        self._ch_owned = False
        self._ch_error = None
        self._ch_args = (channel_slots, channel_slot_bytes, spin_us)
        if isinstance(channel, _chan.ForwardChannel):
            self._ch_mode = True
            self._ch = channel
        elif channel is False or channel is None or channel == "off":
            self._ch_mode = False
        elif channel is True or channel in ("auto", "on"):
            self._ch_mode = "auto" if channel == "auto" else True
            if not self._local:
                if self._ch_mode is True:
                    raise ValueError(f"channel=True needs a server on this host; target "
                                     f"{target} is not local")
                self._ch_mode = False
                self._ch_error = ValueError(f"target {target} is not on this host")
        else:
            raise ValueError(f"channel={channel!r}; expected 'auto', True, False or a "
                             "ForwardChannel")

    def close(self):
        """Closes the regions, the channel and the connections. Calls not yet result()ed are
        given up: result() then raises RuntimeError (their regions are gone)."""
        with self._lock:
            self._closed = True
            regions, self._regions_all = self._regions_all, []
            regions += self._regions_quarantined
            self._regions_quarantined = []
            self._regions_free = {}
            ch, self._ch = self._ch, None
            self._ch_mode = False
        if ch is not None and self._ch_owned:
            ch.close()
        # A region a call still runs on (given up, or not answered yet) is refused for a while.
        give_up = time.monotonic() + 2.0
        for r in regions:
            r.close(give_up)
        zc, self._zc = self._zc, []
        for r in zc:
            r.close(give_up)
        self._memcpy.close()
        self._channel.close()
        if self._native is not None:
            self._native.close()
            self._native = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def info(self, timeout=None):
        """The served model (moeserve.v1.ModelInfo), fetched once."""
        if self._info is None:
            self._info = self._stub.GetModelInfo(pb.GetModelInfoRequest(),
                                                 timeout=timeout or self.timeout)
        return self._info

    def register_forward_channel(self, name, key, byte_size, timeout=None):
        """RegisterForwardChannel (what ForwardChannel.open calls)."""
        return _client.register_forward_channel(self._stub, name, key, byte_size,
                                                timeout or self.timeout)

    def unregister_forward_channel(self, name="", timeout=None):
        _client.unregister_forward_channel(self._stub, name, timeout or self.timeout)

    # ---- the forward channel ----

    @property
    def channel(self):
        """The forward channel in use (a ForwardChannel), or None."""
        return self._ch

    @property
    def channel_error(self):
        """Why the forward channel is not used ("auto"), or None."""
        return self._ch_error

    def _get_channel(self):
        ch = self._ch
        if ch is not None or not self._ch_mode:
            return ch
        with self._lock:
            if self._ch is None and self._ch_mode:
                slots, slot_bytes, spin_us = self._ch_args
                try:
                    self._ch = _chan.ForwardChannel.open(self, num_slots=slots,
                                                         slot_bytes=slot_bytes, spin_us=spin_us,
                                                         timeout=self.timeout)
                    self._ch_owned = True
                except (grpc.RpcError, OSError) as e:
                    if self._ch_mode is True:
                        raise
                    # Refused (no --enable_shared_memory, an older server, another host):
                    # gRPC from now on.
                    self._ch_mode = False
                    self._ch_error = e
            return self._ch

    def _channel_failed(self, error):
        """The channel itself failed (the server detached): gRPC from now on ("auto")."""
        with self._lock:
            ch, self._ch = self._ch, None
            self._ch_error = error
            mode, self._ch_mode = self._ch_mode, False
        if ch is not None and self._ch_owned:
            ch.close()
        if mode is True:
            raise error

    def _try_channel(self, fut, parts, nbytes, timeout):
        """Starts the call through the channel if it can take it (sets fut._chan)."""
        ch = self._ch if self._ch is not None else self._get_channel()
        if ch is None or nbytes > ch.payload_capacity:
            return False
        try:
            cf = ch.try_submit(parts, timeout)
        except _chan.ChannelError as e:
            self._channel_failed(e)
            return False
        if cf is None:
            return False  # every slot busy: this one goes by gRPC
        fut._chan = (ch, cf)
        fut.used_channel = True
        return True

    def _channel_result(self, fut, out, retry=False):
        """The answer of a call made through the channel; raises ChannelError (a grpc.RpcError)
        for a server error, and for the channel's own failures. With `retry`, a detached server
        ("auto") returns _RETRY instead, fut's region kept: the caller repeats the call by
        gRPC."""
        ch, cf = fut._chan
        fut._chan = None
        try:
            code, got = ch.result(cf, lambda view, addr: self._finish(fut, view, out, addr))
        except _chan.ChannelError as e:
            if retry and e.code() == grpc.StatusCode.UNAVAILABLE and self._ch_mode == "auto":
                self._channel_failed(e)
                fut.used_channel = False
                return _RETRY
            # The channel's own failure (its deadline, a detached server): no answer.
            self._drop(fut, True)
            raise
        except BaseException:
            self._drop(fut, True)  # (after an answer _finish has given the region back)
            raise
        finally:
            fut.latency_s = time.perf_counter() - fut._start
        if code != 0:
            self._drop(fut)  # the server's answer: done with the call
            raise _chan.ChannelError(code, got.decode("utf-8", "replace"))
        return got

    # ---- regions ----

    def _region_kind(self, device, routed=True):
        kind = "cuda" if device.type == "cuda" else "system"
        if self._region_disabled[kind] or (kind == "cuda" and not routed):
            # (The server's router reads host memory: CUDA hidden states without routing go
            # as bytes.)
            return None
        if not self._local:
            if self._shared_memory == kind:
                raise RuntimeError(f"shared_memory={kind!r} needs a server on this host; "
                                   f"target {self.target} is not local")
            return None
        return kind

    def _acquire_region(self, kind, device, nbytes):
        if self._regions_quarantined and \
                time.monotonic() - self._quarantine_swept > self.QUARANTINE_SWEEP_S:
            self._sweep_quarantine()
        key = device.index if kind == "cuda" else "cpu"
        drop = []
        with self._lock:
            free = self._regions_free.setdefault(key, [])
            for i, r in enumerate(free):
                if r.capacity >= nbytes:
                    return free.pop(i)
            # Free ones too small for this size: replaced by a larger one.
            drop, free[:] = free[:], []
            for r in drop:
                self._regions_all.remove(r)
        for r in drop:
            r.close()
        try:
            r = _CudaRegion(self, device, nbytes) if kind == "cuda" else _HostRegion(self, nbytes)
        except (grpc.RpcError, RuntimeError, OSError, AttributeError, TypeError) as e:
            if self._shared_memory == kind:
                raise
            # Refused (shared memory off, not the cuda backend, another host) or unsupported
            # here: bytes from now on, for this kind.
            self._region_disabled[kind] = True
            self._region_errors[kind] = e
            return None
        with self._lock:
            self._regions_all.append(r)
        return r

    def _release_region(self, r):
        with self._lock:
            if r in self._regions_all:
                key = r.device.index if r.kind == "cuda" else "cpu"
                self._regions_free.setdefault(key, []).append(r)

    QUARANTINE_SWEEP_S = 0.05  # at most one round of Unregister calls per this many seconds

    def _quarantine(self, r):
        """A region whose call failed without the server's answer: out of the pool for good
        (the next call takes another region); the server may still run that call and write
        its answer into it."""
        with self._lock:
            if r in self._regions_all:  # (not after close(), which closed it)
                self._regions_all.remove(r)
                self._regions_quarantined.append(r)

    def _sweep_quarantine(self):
        """Unregisters quarantined regions; those the server let go (no call runs on them:
        nothing of it can write into them any more) are freed, the others kept for later."""
        with self._lock:
            regions, self._regions_quarantined = self._regions_quarantined, []
            self._quarantine_swept = time.monotonic()
        keep = []
        for r in regions:
            if _unregister_region(self, r.name):
                r.registered = False
                r.close()
            else:
                keep.append(r)
        with self._lock:
            closed = self._closed
            if not closed:
                self._regions_quarantined += keep
        if closed:  # close() ran meanwhile and did not see these
            for r in keep:
                r.close(time.monotonic() + 2.0)

    @property
    def native_error(self):
        """Why the C++ client is not used (native="auto" and its library missing), or None."""
        return self._native_error

    @property
    def uses_native(self):
        """Whether the gRPC calls go through the C++ client (moeserve_client.native)."""
        return self._native is not None

    @property
    def region_error(self):
        """Why a region path was given up ("auto"): the CUDA one's, else the system one's."""
        return self._region_errors.get("cuda") or self._region_errors.get("system")

    @property
    def region_errors(self):
        """{"cuda" / "system": why that region path was given up} ("auto")."""
        return dict(self._region_errors)

    # ---- zero copy: the caller's tensors in regions of this client ----

    def alloc_hidden(self, num_tokens, dtype=torch.bfloat16, device="cpu", hidden_size=None):
        """A [num_tokens, hidden_size] tensor (default: the model's hidden size) that lives in
        a region of this client registered with the server: a POSIX shared-memory region for
        a CPU device, a CUDA IPC region for a CUDA device (the server's cuda backend). Write
        the hidden states into it (or into its first m rows: hidden[:m]) and pass it to
        submit() / forward(): only RegionRefs travel, no bytes are copied in. Uninitialized.

        The region holds an answer area of the same size: the answer of a call on rows [a, b)
        is written into the same rows of it (answer_view(hidden)), and forward(out="region")
        returns that view itself, not a copy. An answer view passed back as hidden (the next
        layer) is answered in the hidden area: the two areas swap roles.

        Needs a server on this host run with --enable_shared_memory; raises grpc.RpcError if
        it refuses the region. The memory lives until release() / close() and the last tensor
        viewing it (see release())."""
        dtype = torch.bfloat16 if dtype is None else dtype
        if dtype not in _FLOAT_WIRE:
            raise TypeError(f"dtype {dtype}; expected bfloat16, float16 or float32")
        h = int(hidden_size or self.info().hidden)
        num_tokens = int(num_tokens)
        if num_tokens < 1 or h < 1:
            raise ValueError(f"alloc_hidden({num_tokens}, hidden_size={h}): both must be >= 1")
        n = num_tokens * h * wire.ITEMSIZE[_FLOAT_WIRE[dtype]]
        twin = _align(n)
        r = self._new_zero_copy_region(device, twin + n)
        r.twin, r.area = twin, n
        return r.tensor(0, (num_tokens, h), dtype)

    def alloc_routing(self, num_tokens, topk=None, device="cpu", ids_dtype=torch.int32):
        """(topk_ids [num_tokens, topk] ids_dtype, topk_weights [num_tokens, topk] float32),
        both in one region of this client (as alloc_hidden's), so that a call sends them in
        place too (a CUDA region: the server copies them to its host, nothing here syncs or
        copies). topk: default the model's. Uninitialized."""
        if ids_dtype not in _ID_WIRE:
            raise TypeError(f"ids_dtype {ids_dtype}; expected torch.int32 or torch.int64")
        k = int(topk or self.info().topk)
        num_tokens = int(num_tokens)
        if num_tokens < 1 or k < 1:
            raise ValueError(f"alloc_routing({num_tokens}, topk={k}): both must be >= 1")
        ids_bytes = num_tokens * k * wire.ITEMSIZE[_ID_WIRE[ids_dtype]]
        w_off = _align(ids_bytes)
        r = self._new_zero_copy_region(device, w_off + num_tokens * k * 4)
        return (r.tensor(0, (num_tokens, k), ids_dtype),
                r.tensor(w_off, (num_tokens, k), torch.float32))

    def empty(self, shape, dtype=torch.bfloat16, device="cpu"):
        """An uninitialized tensor of `shape` in a region of its own (as alloc_hidden's, with
        no answer area): e.g. an `out` that the server writes the answer straight into
        (forward(hidden, ..., out=t)), or routing tensors."""
        shape = (int(shape),) if isinstance(shape, int) else tuple(int(d) for d in shape)
        n = torch.empty(0, dtype=dtype).element_size()
        for d in shape:
            n *= d
        if n < 1:
            raise ValueError(f"empty({shape}): the tensor must have at least one byte")
        return self._new_zero_copy_region(device, n).tensor(0, shape, dtype)

    def answer_view(self, hidden):
        """The answer area's rows that a call on `hidden` (a tensor of alloc_hidden's, or rows
        of it) is answered in; what forward(hidden, out="region") returns. Valid as
        forward(out="region")'s answer is (see forward())."""
        r, off = self._zero_copy_of(hidden)
        if r is None or r.twin is None:
            raise ValueError("hidden is not in a region of alloc_hidden's")
        n = hidden.numel() * hidden.element_size()
        other = self._twin_offset(r, off, n)
        if other is None:
            raise ValueError("hidden lies across the hidden and answer areas of its region")
        return r.tensor(other, tuple(hidden.shape), hidden.dtype)

    def release(self, tensor):
        """Unregisters the region `tensor` lives in (one of alloc_hidden / alloc_routing /
        empty) from the server and gives up this client's hold on its memory. Tensors that
        still view it keep the memory alive (never freed memory), but the server no longer
        sees it: a call with them goes by the copying path. No call may be in flight on it."""
        r, _ = self._zero_copy_of(tensor)
        if r is None:
            raise ValueError("the tensor is not in a region of this client")
        with self._lock:
            if r.busy:
                raise RuntimeError(f"region {r.name} has a call in flight: result() it first")
            self._zc = [x for x in self._zc if x is not r]
        r.close(time.monotonic() + 2.0)  # (a given-up call may still run on it for a while)

    def _new_zero_copy_region(self, device, nbytes):
        device = torch.device(device)
        if not self._local:
            raise RuntimeError(f"zero-copy tensors need a server on this host; target "
                               f"{self.target} is not local")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {device}; expected cpu or cuda")
        r = _ZeroCopyRegion(self, device, nbytes)
        with self._lock:
            self._zc = self._zc + [r]  # copied: _prepare reads it without the lock
        return r

    def _find_zero_copy(self, ptr, n):
        for r in self._zc:
            if r.lo <= ptr and ptr + n <= r.hi:
                return r
        return None

    def _zero_copy_of(self, t):
        """(region, offset) of a contiguous tensor in a region of this client, or (None, 0)."""
        if not torch.is_tensor(t) or not t.is_contiguous():
            return None, 0
        ptr = t.data_ptr()
        r = self._find_zero_copy(ptr, t.numel() * t.element_size())
        return (r, ptr - r.lo) if r is not None else (None, 0)

    @staticmethod
    def _twin_offset(r, off, n):
        """Where bytes [off, off + n) of one area of `r` are answered in the other, or None."""
        if off + n <= r.area:
            return off + r.twin
        if off >= r.twin and off + n <= r.twin + r.area:
            return off - r.twin
        return None

    def _sync_stream(self, index):
        """Waits for the current stream of CUDA device `index` (what wrote the caller's tensors):
        the server, another process, sees none of our streams. One cudaStreamSynchronize on
        torch's raw current stream (no torch.cuda.Stream object, ~20 us each), else torch's."""
        if self._stream_sync is None:
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # pylint: disable=protected-access
            lib = _cudart()
            lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
            lib.cudaStreamSynchronize.restype = ctypes.c_int
            self._stream_sync = (raw, lib)
        raw, lib = self._stream_sync
        if raw is not None:
            stream = raw(index)
            # The legacy default stream (0) is the current device's: only there is it this one.
            if stream or torch.cuda.current_device() == index:
                _cuda_check(lib, lib.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
                return
        torch.cuda.current_stream(index).synchronize()

    def _zero_copy_done(self, fut, unanswered=False):
        """fut's bytes in regions of the caller's are free again; unanswered (the call failed
        without the server's answer): only once the server reports no call in flight there."""
        busy, fut._busy = fut._busy, None
        if busy:
            with self._lock:
                for r, entry in busy:
                    r.busy.remove(entry)
                    if unanswered:
                        r.abandoned.append(entry)

    def _region_calls_in_flight(self, name):
        """The server's count of calls using region `name` (SharedMemoryStatus)."""
        reply = self._stub.SharedMemoryStatus(pb.SharedMemoryStatusRequest(name=name),
                                              timeout=self.timeout)
        return sum(r.calls_in_flight for r in reply.regions if r.name == name)

    def _reclaim_zero_copy(self, r):
        """Frees the bytes of r's given-up calls if the server runs no call on r (any more)."""
        with self._lock:
            n = len(r.abandoned)  # given up before the question: the answer covers them
        try:
            running = self._region_calls_in_flight(r.name)
        except grpc.RpcError:
            return
        if running == 0:
            with self._lock:
                del r.abandoned[:n]

    def _prepare_zero_copy(self, fut, zc, hidden, shape, dtype, hid_wire, nbytes, routed,
                           topk_ids, topk_weights, ids_dtype, ids_shape, routes, layer,
                           request_id, return_timings, return_routing, out):
        """_prepare for hidden in region `zc`: RegionRefs, nothing copied in. The routing goes
        by reference when both tensors lie in regions of this client (int32/int64 ids, float32
        weights, contiguous), else as bytes. The answer: into `out` when it lies in a region of
        this client, else into zc's answer area (alloc_hidden's), else into a pooled region
        (or inline bytes) and copied out by result()."""
        h_off = hidden.data_ptr() - zc.lo
        syncs = {zc.index} if zc.kind == "cuda" else set()
        ids_t = weights_t = None
        key_routing = None
        keep = None
        if routed:
            ids_wire = _ID_WIRE.get(topk_ids.dtype)
            ri, i_off = self._zero_copy_of(topk_ids) if ids_wire is not None else (None, 0)
            rw, w_off = self._zero_copy_of(topk_weights) \
                if topk_weights.dtype is torch.float32 else (None, 0)
            if ri is not None and rw is not None:
                ids_ref = ri.name, i_off, routes * wire.ITEMSIZE[ids_wire]
                w_ref = rw.name, w_off, routes * 4
                ids_t = (ids_wire, ids_shape, None, ids_ref)
                weights_t = (wire.DTYPE_FP32, ids_shape, None, w_ref)
                key_routing = (ids_wire, ids_shape, ids_ref, w_ref)
                for r in (ri, rw):
                    if r.kind == "cuda":
                        syncs.add(r.index)
            else:
                keep = []
                ids_t, weights_t = self._inline_routing(topk_ids, topk_weights, ids_dtype,
                                                        ids_shape, routes, keep)
        # Where the answer goes.
        pool = None
        answer = None
        out_r, out_off = (None, 0)
        if torch.is_tensor(out):
            out_r, out_off = self._zero_copy_of(out)
            if out_r is not None:
                if out.dtype != dtype or tuple(out.shape) != shape:
                    raise ValueError(f"out is {out.dtype} {tuple(out.shape)}; expected {dtype} "
                                     f"{shape}")
                answer = out
        if out_r is None and zc.twin is not None:
            out_off = self._twin_offset(zc, h_off, nbytes)
            if out_off is not None:
                out_r = zc
                answer = zc.tensor(out_off, shape, dtype)
        if out_r is None:
            if isinstance(out, str):
                raise ValueError("out='region' needs hidden from alloc_hidden (or rows of it)")
            if not self._region_disabled[zc.kind]:
                pool = self._acquire_region(zc.kind, zc.device, nbytes)
        # The answer's bytes must not be written while another call in flight reads or
        # writes them.
        busy = []
        if out_r is zc:
            busy.append((zc, (h_off, h_off + nbytes, out_off, out_off + nbytes)))
        else:
            busy.append((zc, (h_off, h_off + nbytes, 0, 0)))
            if out_r is not None:
                busy.append((out_r, (0, 0, out_off, out_off + nbytes)))
        for attempt in range(2):
            with self._lock:
                clash = any(r.conflicts(*e) for r, e in busy)
                stale = [r for r, e in busy if r.abandoned and r.conflicts(*e, r.abandoned)]
                if not clash and not stale:
                    for r, e in busy:
                        r.busy.append(e)
                    break
                if clash or attempt:
                    if pool is not None:
                        self._regions_free.setdefault(
                            pool.device.index if pool.kind == "cuda" else "cpu", []).append(pool)
                    if clash:
                        raise RuntimeError(
                            "a call in flight reads or writes the bytes this call's answer "
                            "would overwrite (or this call reads its answer): result() it first")
                    raise RuntimeError(
                        f"a call on these bytes of region {stale[0].name} failed without the "
                        "server's answer and may still run there (it reports calls in flight "
                        "on the region): retry later")
            # Only given-up calls' bytes: free again if the server runs none of them now.
            for r in stale:
                self._reclaim_zero_copy(r)
        fut._busy = busy
        fut._answer = answer
        fut._out = out
        fut.used_region = fut.zero_copy = True
        if pool is not None:
            fut._region, fut._region_out = pool, 0
            out_ref = pool.ref(0, nbytes)
        elif out_r is not None:
            out_ref = (out_r.name, out_off, nbytes)
        else:
            out_ref = None
        try:
            for index in syncs:
                self._sync_stream(index)
        except BaseException:
            self._drop(fut)
            raise
        hid_t = (hid_wire, shape, None, (zc.name, h_off, nbytes))
        if keep is None:
            key = ("zc", layer, hid_t, key_routing, out_ref, request_id, return_timings,
                   return_routing)
            req = self._requests.get(key)
            if req is None:
                req = b"".join(wire.forward_request(
                    layer, hid_t, ids_t, weights_t, request_id=request_id,
                    return_timings=return_timings, return_routing=return_routing,
                    output_region=out_ref))
                if not request_id:
                    if len(self._requests) >= 1024:
                        self._requests.clear()
                    self._requests[key] = req
            return fut, [req], len(req)
        fut._keep = keep
        parts = wire.forward_request(layer, hid_t, ids_t, weights_t, request_id=request_id,
                                     return_timings=return_timings,
                                     return_routing=return_routing, output_region=out_ref)
        total = 0
        for p in parts:
            total += len(p) if p.__class__ is bytes else p.nbytes
        return fut, parts, total

    @staticmethod
    def _inline_routing(topk_ids, topk_weights, ids_dtype, ids_shape, routes, keep, views=True):
        """The routing as inline bytes (host copies of CUDA tensors), for wire.forward_request;
        the tensors the bytes view are appended to `keep` (hold it until the request is sent).
        views=False: only `keep` (contiguous host ids and FP32 weights), for the C++ client."""
        if ids_dtype is not topk_ids.dtype:
            topk_ids = topk_ids.to(ids_dtype)
        if topk_weights.dtype is not torch.float32:
            topk_weights = topk_weights.float()
        # Inline bytes: read on the server's host.
        if topk_ids.is_cuda:
            topk_ids = topk_ids.cpu()
        if topk_weights.is_cuda:
            topk_weights = topk_weights.cpu()
        topk_ids = topk_ids.contiguous()
        topk_weights = topk_weights.contiguous()
        keep += [topk_ids, topk_weights]
        if not views:
            return None, None
        ids_wire = _ID_WIRE[ids_dtype]
        return ((ids_wire, ids_shape, _host_bytes(topk_ids, routes * wire.ITEMSIZE[ids_wire])),
                (wire.DTYPE_FP32, ids_shape, _host_bytes(topk_weights, routes * 4)))

    # ---- calls ----

    def _staged(self, t, device, n):
        """CPU bytes of `t` (n of them): itself when on the CPU, else a pinned copy (per thread,
        reused)."""
        if device.type == "cpu":
            return t.contiguous()
        key = threading.get_ident()
        buf = self._pinned.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1 << 20), dtype=torch.uint8, pin_memory=True)
            self._pinned[key] = buf
        host = buf[:n]
        host.copy_(t.contiguous().view(-1).view(torch.uint8))  # synchronous D2H
        return host

    def submit(self, hidden, topk_ids=None, topk_weights=None, layer=0, request_id="",
               return_timings=False, return_routing=False, timeout=None, out=None):
        """Starts one MoE layer forward and returns a MoeFuture at once (see result()).
        out: as forward()'s; result(fut) then returns it (or the answer view for "region").
        return_timings: True (stage timings: the step is timed on the device), "host" (the host
        clock's stages and total only, an untimed step) or False."""
        fut, parts, nbytes = self._prepare(hidden, topk_ids, topk_weights, layer, request_id,
                                           return_timings, return_routing, out)
        timeout = timeout or self.timeout
        fut._start = time.perf_counter()
        try:
            if parts is None:  # by the C++ client, the tensors' bytes in place
                if fut._device.type != "cpu":
                    # Staged in this thread's pinned buffer, which the next call reuses.
                    fut._keep[-1] = fut._keep[-1].clone()
                    fut._native = fut._native._replace(hidden_ptr=fut._keep[-1].data_ptr())
                fut._call = self._native.submit(*fut._native, timeout=timeout, keep=fut._keep)
            elif not (self._ch_mode and self._try_channel(fut, parts, nbytes, timeout)):
                if self._native is not None:
                    fut._call = self._native.submit_request(
                        b"".join(parts), timeout=timeout,
                        header_cap=self._header_cap(fut, request_id, return_routing))
                else:
                    fut._call = self._forward.future(b"".join(parts), timeout=timeout)
        except BaseException:
            self._drop(fut)
            raise
        finally:
            fut._keep = None  # the bytes are in a slot or in the request (or held by the call)
        return fut

    @staticmethod
    def _header_cap(fut, request_id, return_routing):
        """Bytes for an answer without its output's bytes (routing: up to 256 per token)."""
        return 4096 + 2 * len(request_id) + (fut._shape[0] * 256 * 9 if return_routing else 0)

    @staticmethod
    def _answer_inline(fut):
        """Whether the answer's bytes come in the reply (not in a region)."""
        return fut._region is None and fut._answer is None

    def _native_target(self, fut, out):
        """(what to return, where the C++ client writes the answer): `out` itself when it is a
        contiguous CPU tensor, else a new CPU tensor (pinned when it goes to a GPU next)."""
        if out is None:
            out = fut._out
        dtype, shape = fut._dtype, fut._shape
        if out is not None:
            if out.dtype != dtype or tuple(out.shape) != shape:
                raise ValueError(f"out is {out.dtype} {tuple(out.shape)}; expected {dtype} "
                                 f"{shape}")
            if out.device.type == "cpu" and out.is_contiguous():
                return out, out
            return out, torch.empty(shape, dtype=dtype, pin_memory=out.device.type == "cuda")
        if fut._device.type == "cpu":
            t = torch.empty(shape, dtype=dtype)
            return t, t
        return None, torch.empty(shape, dtype=dtype, pin_memory=True)

    def _native_done(self, fut, ret, dst, header):
        """Moves the answer from `dst` to where it goes and reads the header (if asked)."""
        if ret is None:
            ret = dst.to(fut._device)
        elif ret is not dst:
            ret.copy_(dst)
        if header is not None:
            reply = wire.forward_response(header)
            fut.request_id = reply.request_id
            fut.timings = reply.timings
            if reply.topk_ids is not None:
                fut.topk_ids = _view(header, reply.topk_ids).to(fut._device)
                fut.topk_weights = _view(header, reply.topk_weights).to(fut._device)
        return ret

    def _fast_forward(self, nat, hidden, topk_ids, topk_weights, layer, out, timeout):
        """The common blocking call -- CPU tensors, contiguous, routed, float32 weights, `out`
        None or a contiguous CPU tensor of hidden's dtype and shape -- by the C++ client with
        as few tensor calls as it takes (each is a call into torch). None when the call is not
        that case: forward() then takes the general path, which checks and converts."""
        hid_wire = _FLOAT_WIRE.get(hidden.dtype)
        ids_wire = _ID_WIRE.get(topk_ids.dtype)
        if hid_wire is None or ids_wire is None or topk_weights.dtype is not torch.float32 or \
                not (hidden.is_cpu and topk_ids.is_cpu and topk_weights.is_cpu):
            return None
        shape = hidden.shape
        ids_shape = topk_ids.shape
        if len(shape) != 2 or len(ids_shape) != 2 or ids_shape[0] != shape[0] or \
                topk_weights.shape != ids_shape or not hidden.is_contiguous() or \
                not topk_ids.is_contiguous() or not topk_weights.is_contiguous():
            return None
        m, h = shape
        if out is None:
            out = torch.empty((m, h), dtype=hidden.dtype)
        elif out.dtype is not hidden.dtype or not out.is_cpu or out.shape != shape or \
                not out.is_contiguous():
            return None
        nat.forward(layer, hid_wire, m, h, hidden.data_ptr(), ids_wire, ids_shape[1],
                    topk_ids.data_ptr(), topk_weights.data_ptr(), out.data_ptr(),
                    m * h * wire.ITEMSIZE[hid_wire], timeout=timeout or self.timeout)
        return out

    def _native_forward(self, fut, out, timeout):
        """The blocking call of a future prepared for the C++ client (fut._native)."""
        ret, dst = self._native_target(fut, out)
        a = fut._native
        try:
            header = self._native.forward(*a[:9], dst.data_ptr(), dst.nbytes,
                                          request_id=a.request_id,
                                          return_timings=a.return_timings,
                                          return_routing=a.return_routing, timeout=timeout,
                                          want_header=a.want_header)
        finally:
            fut.latency_s = time.perf_counter() - fut._start
            fut._keep = None
        return self._native_done(fut, ret, dst, header)

    def _drop(self, fut, unanswered=False):
        """Gives back what fut holds. unanswered: its call failed without the server's answer
        (see _ANSWERED), so the server may still run it and write into its region later: the
        region is quarantined and the zero-copy bytes stay busy, not reused at once."""
        region, fut._region = fut._region, None
        if region is not None:
            if unanswered:
                self._quarantine(region)
            else:
                self._release_region(region)
        self._zero_copy_done(fut, unanswered)

    def _prepare(self, hidden, topk_ids, topk_weights, layer, request_id, return_timings,
                 return_routing, out=None):
        """A MoeFuture (not started), the request's parts (wire.forward_request) and their
        total bytes. The parts may view the caller's tensors and a per-thread staging buffer:
        send them before the next _prepare on this thread.

        By region, the routing goes into the region with the hidden states when it is on the
        same device (CUDA: no device-to-host copy and no sync here for it; the server copies
        it to its host itself), and then the whole request is a few hundred bytes that depend
        only on the region, layer, shapes and flags: built once and reused."""
        if self._closed:
            raise RuntimeError("the client is closed")
        # Few tensor attribute reads: each is a C call, and this runs on every layer call.
        shape = tuple(hidden.shape)
        dtype = hidden.dtype
        hid_wire = _FLOAT_WIRE.get(dtype)
        if len(shape) != 2:
            raise ValueError(f"hidden must be [M, H]; got shape {shape}")
        if hid_wire is None:
            raise TypeError(f"hidden has dtype {dtype}; expected bfloat16, float16 or float32")
        routed = topk_ids is not None
        if routed != (topk_weights is not None):
            raise ValueError("pass both topk_ids and topk_weights, or neither (server routing)")
        fut = MoeFuture()
        device = hidden.device
        fut._dtype, fut._shape, fut._device = dtype, shape, device
        ids_shape = ids_dtype = None
        routes = 0
        if routed:
            ids_shape = tuple(topk_ids.shape)
            if len(ids_shape) != 2 or ids_shape[0] != shape[0] or \
                    tuple(topk_weights.shape) != ids_shape:
                raise ValueError(f"expected topk ids/weights [{shape[0]}, K]; got "
                                 f"{ids_shape}, {tuple(topk_weights.shape)}")
            # int32 / int64 as they are (exact); other integer types widened to int32; no
            # float or bool ids (a cast would truncate them silently).
            ids_dtype = topk_ids.dtype
            if ids_dtype not in _ID_WIRE:
                if ids_dtype not in _OTHER_INTS:
                    raise TypeError(f"topk_ids has dtype {ids_dtype}; expected an integer "
                                    "type: int32 or int64 (sent as they are), or a narrower "
                                    "integer type (sent as int32)")
                ids_dtype = torch.int32
            routes = ids_shape[0] * ids_shape[1]
        nbytes = shape[0] * shape[1] * wire.ITEMSIZE[hid_wire]
        if self._zc and nbytes > 0:
            zc = self._find_zero_copy(hidden.data_ptr(), nbytes)
            # (CUDA hidden states without routing go as bytes: the server routes on its host.)
            if zc is not None and (routed or zc.kind != "cuda") and hidden.is_contiguous():
                return self._prepare_zero_copy(fut, zc, hidden, shape, dtype, hid_wire, nbytes,
                                               routed, topk_ids, topk_weights, ids_dtype,
                                               ids_shape, routes, layer, request_id,
                                               return_timings, return_routing, out)
        if out is not None:
            if isinstance(out, str):
                raise ValueError("out='region' needs hidden from alloc_hidden (or rows of it); "
                                 f"out={out!r}")
            fut._out = out
        region = None
        in_region = False
        if nbytes > 0 and self._shared_memory != "off":
            kind = self._region_kind(device, routed)
            if kind is not None:
                in_region = routed and topk_ids.device == device and \
                    topk_weights.device == device
                ids_off = _align(nbytes)
                if in_region:
                    ids_bytes = routes * wire.ITEMSIZE[_ID_WIRE[ids_dtype]]
                    w_off = ids_off + _align(ids_bytes)
                    out_off = w_off + _align(routes * 4)
                else:
                    out_off = ids_off
                region = self._acquire_region(kind, device, out_off + nbytes)
        if region is not None:
            try:
                region.write(0, hidden, dtype, shape, nbytes)
                if in_region:
                    region.write(ids_off, topk_ids, ids_dtype, ids_shape, ids_bytes)
                    region.write(w_off, topk_weights, torch.float32, ids_shape, routes * 4)
                region.publish()
            except BaseException:
                self._release_region(region)
                raise
            fut._region, fut._region_out = region, out_off
            fut.used_region = True
            if in_region or not routed:
                key = (region.name, layer, hid_wire, shape, ids_dtype, ids_shape, request_id,
                       return_timings, return_routing)
                req = self._requests.get(key)
                if req is None:
                    ids_t = weights_t = None
                    if routed:
                        ids_t = (_ID_WIRE[ids_dtype], ids_shape, None,
                                 region.ref(ids_off, ids_bytes))
                        weights_t = (wire.DTYPE_FP32, ids_shape, None,
                                     region.ref(w_off, routes * 4))
                    req = b"".join(wire.forward_request(
                        layer, (hid_wire, shape, None, region.ref(0, nbytes)), ids_t, weights_t,
                        request_id=request_id, return_timings=return_timings,
                        return_routing=return_routing,
                        output_region=region.ref(out_off, nbytes)))
                    if request_id:
                        return fut, [req], len(req)  # not worth keeping
                    if len(self._requests) >= 1024:
                        self._requests.clear()
                    self._requests[key] = req
                return fut, [req], len(req)
        # What the parts view (they do not keep it alive): held until the request is sent.
        fut._keep = keep = []
        ids_t = weights_t = None
        native = region is None and self._native is not None and not self._ch_mode
        if routed:
            ids_t, weights_t = self._inline_routing(topk_ids, topk_weights, ids_dtype, ids_shape,
                                                    routes, keep, views=not native)
        output_region = None
        if region is not None:
            hid_t = (hid_wire, shape, None, region.ref(0, nbytes))
            output_region = region.ref(out_off, nbytes)
        else:
            host = self._staged(hidden, device, nbytes)
            keep.append(host)
            if native:
                # The C++ client builds the request around the tensors' bytes (keep them).
                ids_ptr = keep[0].data_ptr() if routed else None
                w_ptr = keep[1].data_ptr() if routed else None
                fut._native = _NativeArgs(
                    layer, hid_wire, shape[0], shape[1], host.data_ptr(),
                    _ID_WIRE[ids_dtype] if routed else 0, ids_shape[1] if routed else 0, ids_ptr,
                    w_ptr, request_id.encode() if request_id else b"", return_timings,
                    return_routing)
                return fut, None, nbytes
            hid_t = (hid_wire, shape, _host_bytes(host, nbytes))
        parts = wire.forward_request(layer, hid_t, ids_t, weights_t, request_id=request_id,
                                     return_timings=return_timings,
                                     return_routing=return_routing,
                                     output_region=output_region)
        total = 0
        for p in parts:
            total += len(p) if p.__class__ is bytes else p.nbytes
        return fut, parts, total

    def result(self, fut, out=None):
        """Waits for `fut` and returns the output [M, H] (hidden's dtype): `out` when given
        here or to submit() (filled in place, any device; "region": the answer view, see
        forward()), else a tensor on hidden's device. Raises grpc.RpcError with the server's
        status on failure; RuntimeError once the client is closed (close() gave up the calls
        not taken and their regions)."""
        if self._closed:
            self._drop(fut, True)
            raise RuntimeError("the client is closed: the answers of calls not taken by then "
                               "are gone")
        if fut._chan is not None:
            return self._channel_result(fut, out)
        if fut._native is not None:
            try:
                ret, dst = self._native_target(fut, out)
            except BaseException:
                fut._call._free()  # waits for the answer: the call reads our tensors
                raise
            a = fut._native
            try:
                header = fut._call.wait(dst.data_ptr(), dst.nbytes, a.hidden_dtype, a.num_tokens,
                                        a.hidden, a.want_header)
            finally:
                fut.latency_s = time.perf_counter() - fut._start
            return self._native_done(fut, ret, dst, header)
        try:
            if isinstance(fut._call, _native.NativeCall):
                if self._answer_inline(fut):
                    ret, dst = self._native_target(fut, out)
                    raw = fut._call.wait(dst.data_ptr(), dst.nbytes, _FLOAT_WIRE[fut._dtype],
                                         fut._shape[0], fut._shape[1], True)
                    return self._native_done(fut, ret, dst, raw)
                raw = fut._call.wait(None, 0, _FLOAT_WIRE[fut._dtype], fut._shape[0],
                                     fut._shape[1], True)
            else:
                raw = fut._call.result()
        except BaseException as e:
            self._drop(fut, not _server_answered(e))
            raise
        finally:
            fut.latency_s = time.perf_counter() - fut._start
        return self._finish(fut, raw, out)

    def _finish(self, fut, raw, out, addr=None):
        """The answer `raw` (bytes, or with `addr` a memoryview of a channel slot at that
        address, valid only during this call) of `fut`, into `out` or a new tensor."""
        region, fut._region = fut._region, None
        answer = fut._answer
        if out is None:
            out = fut._out
        try:
            dtype, shape = fut._dtype, fut._shape
            hid_wire = _FLOAT_WIRE[dtype]
            n = shape[0] * shape[1] * wire.ITEMSIZE[hid_wire]
            inline = 0 if region is not None or answer is not None else n
            # The common answer is the output alone (no request_id, timings or routing): then
            # its bytes are exactly what protobuf writes for that tensor, known in advance.
            prefix = wire.tensor_parts(1, hid_wire, shape, inline)
            k = len(prefix)
            reply = None
            if len(raw) == k + inline and raw[:k] == prefix:
                offset = k
            else:
                reply = wire.forward_response(raw)
                o = reply.output
                if o is None or o.dtype != hid_wire or tuple(o.shape) != shape or \
                        o.nbytes != inline:
                    raise ValueError(f"server answered {o!r}; expected {dtype} {shape}"
                                     + (" in the output region" if not inline else ""))
                offset = o.offset
            if answer is not None and (out is None or out is answer or out.__class__ is str):
                # Zero copy: the answer is where the server wrote it.
                out = answer if out is not None else answer.clone()
            elif out is not None and (out.dtype != dtype or tuple(out.shape) != shape):
                raise ValueError(f"out is {out.dtype} {tuple(out.shape)}; expected "
                                 f"{dtype} {shape}")
            elif answer is not None:
                out.copy_(answer)
            elif region is not None:
                out = region.read(fut._region_out, n, dtype, shape, out)
            elif out is not None and out.device.type == "cpu" and out.is_contiguous():
                # A plain memcpy: torch's copy_ would run a parallel region whose spinning
                # threads take CPU from a server on the same cores.
                if n:
                    if addr is None:
                        addr = ctypes.cast(raw, ctypes.c_void_p).value
                    self._memcpy(out.data_ptr(), addr + offset, n)
            else:
                src = _view_at(raw, offset, n, dtype, shape)
                if out is not None:
                    out.copy_(src)
                elif fut._device.type != "cpu":
                    out = src.to(fut._device)
                else:
                    out = src.clone() if addr is not None else src
            if reply is not None:
                fut.request_id = reply.request_id
                fut.timings = reply.timings
                if reply.topk_ids is not None:
                    ids = _view(raw, reply.topk_ids)
                    weights = _view(raw, reply.topk_weights)
                    if addr is not None and fut._device.type == "cpu":
                        ids, weights = ids.clone(), weights.clone()
                    fut.topk_ids = ids.to(fut._device)
                    fut.topk_weights = weights.to(fut._device)
            return out
        finally:
            if region is not None:
                self._release_region(region)
            if fut._busy is not None:
                self._zero_copy_done(fut)

    def forward(self, hidden, topk_ids=None, topk_weights=None, layer=0, out=None,
                request_id="", return_timings=False, timeout=None):
        """One blocking MoE layer forward: as submit() then result(), on the calling thread (a
        blocking gRPC call has no completion-thread hand-off, which a future pays).

        out: None: a new tensor on hidden's device. A tensor: filled and returned; when it
        lies in a region of this client (alloc_hidden / empty) and hidden does too, the server
        writes the answer straight into it. "region" (hidden from alloc_hidden, or rows of
        it): the answer view itself (answer_view(hidden)), no copy; it stays valid until the
        next call on that region whose answer lands there (another call on the same rows of
        the hidden area), or release() / close(): read or copy it before then. A call whose
        answer would overwrite bytes that a call in flight reads or writes raises
        RuntimeError."""
        nat = self._native
        if nat is not None and topk_ids is not None and not request_id and \
                not return_timings and not self._ch_mode and not self._zc and \
                (self._region_disabled["system"] or not self._local):
            y = self._fast_forward(nat, hidden, topk_ids, topk_weights, layer, out, timeout)
            if y is not None:
                return y
        fut, parts, nbytes = self._prepare(hidden, topk_ids, topk_weights, layer, request_id,
                                           return_timings, False, out)
        timeout = timeout or self.timeout
        fut._start = time.perf_counter()
        if parts is None:
            return self._native_forward(fut, out, timeout)
        if self._ch_mode:
            try:
                started = self._try_channel(fut, parts, nbytes, timeout)
            except BaseException:
                self._drop(fut)
                raise
            if started:
                got = self._channel_result(fut, out, retry=True)
                if got is not _RETRY:
                    return got
                # The server detached from the channel (restarted, unregistered it): the call
                # may not have run; a Forward has no side effects, so it is repeated by gRPC
                # (the region, if any, is still registered; `parts` still valid: fut._keep).
        sent = False  # (a failure before the call leaves: nothing of it runs on the server)
        try:
            if self._native is not None:
                ret = dst = None
                if self._answer_inline(fut):
                    ret, dst = self._native_target(fut, out)
                sent = True
                raw = self._native.forward_request(
                    b"".join(parts), _FLOAT_WIRE[fut._dtype], fut._shape[0], fut._shape[1],
                    out=dst.data_ptr() if dst is not None else None,
                    out_bytes=dst.nbytes if dst is not None else 0, timeout=timeout,
                    header_cap=self._header_cap(fut, request_id, False))
                if dst is not None:
                    return self._native_done(fut, ret, dst, raw)
            else:
                sent = True
                raw = self._forward(b"".join(parts), timeout=timeout)
        except BaseException as e:
            self._drop(fut, sent and not _server_answered(e))
            raise
        finally:
            fut.latency_s = time.perf_counter() - fut._start
            fut._keep = None
        return self._finish(fut, raw, out)


class MoeAFDConnector:
    """The attention side of attention-FFN disaggregation, shaped like vLLM's AFD connector:
    send_attn_output() ships a layer's hidden states (and routing, unless the server routes)
    for micro-batch `ubatch_idx`; recv_ffn_output(ref_tensor, ubatch_idx) waits for that
    micro-batch's answer and writes it into ref_tensor (its preallocated output). One call per
    micro-batch may be in flight; several micro-batches overlap.
    """

    def __init__(self, client):
        self.client = client if isinstance(client, TorchMoeClient) else TorchMoeClient(client)
        self._pending = {}

    def send_attn_output(self, hidden_states, topk_ids=None, topk_weights=None, layer=0,
                         ubatch_idx=0, **kwargs):
        if ubatch_idx in self._pending:
            raise RuntimeError(f"micro-batch {ubatch_idx} already has a call in flight; "
                               "recv_ffn_output it first")
        self._pending[ubatch_idx] = self.client.submit(hidden_states, topk_ids, topk_weights,
                                                       layer=layer, **kwargs)

    def recv_ffn_output(self, ref_tensor=None, ubatch_idx=0):
        fut = self._pending.pop(ubatch_idx, None)
        if fut is None:
            raise RuntimeError(f"micro-batch {ubatch_idx} has no call in flight")
        return self.client.result(fut, out=ref_tensor)

    def close(self):
        self.client.close()


class RemoteExperts(torch.nn.Module):
    """A drop-in for a model's routed experts that runs them on a moeserve server.

    forward(hidden_states, topk_ids, topk_weights) -> [M, H], the top-k weighted sum of the
    experts' outputs (what a fused-MoE experts module returns); forward(hidden_states) lets
    the server route with the layer's gate (its checkpoint's router). Hidden states of any
    leading shape are flattened to [M, H] and restored. No parameters live here.
    """

    def __init__(self, client, layer):
        super().__init__()
        self.client = client if isinstance(client, TorchMoeClient) else TorchMoeClient(client)
        self.layer = layer

    def forward(self, hidden_states, topk_ids=None, topk_weights=None):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if topk_ids is not None:
            topk_ids = topk_ids.reshape(x.shape[0], -1)
            topk_weights = topk_weights.reshape(x.shape[0], -1)
        y = self.client.forward(x, topk_ids, topk_weights, layer=self.layer)
        return y.view(shape)

    def extra_repr(self):
        return f"layer={self.layer}, target={self.client.target}"
