"""Shared-memory regions for a frontend on the server's host (server run with
``--enable_shared_memory``), after Triton's shared-memory extension.

A region is a byte range the server maps once (registered by name); a Forward then names byte
ranges of regions instead of carrying tensor bytes, and the answer is written into a region too.
Only a few hundred bytes travel over gRPC.

    import numpy as np
    from moeserve_client import MoeClient, shared_memory as shm

    with MoeClient("unix:/run/moeserve.sock") as client:
        region = shm.SystemRegion.create(16 << 20)         # POSIX shm object, mapped here
        shm.register_system(client, "frontend0", region)  # the whole object
        x = region.ndarray(0, (M, H), np.float32)          # views into the region
        ids = region.ndarray(x.nbytes, (M, K), np.int32)
        w = region.ndarray(x.nbytes + ids.nbytes, (M, K), np.float32)
        out = region.ndarray(1 << 20, (M, H), np.float32)
        x[:], ids[:], w[:] = hidden, topk_ids, topk_weights
        shm.forward(client, region, x, ids, w, out, layer=0)  # the answer is now in `out`
        shm.unregister(client, "frontend0")
        region.close(unlink=True)

BF16 tensors are uint16 views with ``dtype="bf16"`` (or ml_dtypes.bfloat16 views), as in
MoeClient.forward. CUDA regions: ``register_cuda`` takes the 64-byte cudaIpcMemHandle_t of an
allocation's base (e.g. from torch's storage ``_share_cuda_()``) and its device; the server
must run the cuda backend. ``forward_refs`` sends tensors by (region name, offset, byte size)
directly, for any region kind.

Unregistering a region that a call still uses is refused (FAILED_PRECONDITION); once
``unregister`` returns, the server no longer touches the memory. Server errors raise
grpc.RpcError, as everywhere in this package.

Thread-safety: the functions are as thread-safe as the MoeClient; a SystemRegion may be shared
by threads that write disjoint ranges.
"""

import collections
from multiprocessing import shared_memory as _mp_shm

import numpy as np

from . import dtypes as _dt
from . import wire as _wire
from .client import _FROM_WIRE, _WIRE, _hidden_dtype, pb

# A byte range of a registered region: what Tensor.region / output_region carry.
Ref = collections.namedtuple("Ref", ["name", "offset", "byte_size"])

ForwardByRegionResult = collections.namedtuple(
    "ForwardByRegionResult", ["dtype", "shape", "request_id", "timings"])


class SystemRegion:
    """A POSIX shared-memory object created (or attached) by this process and mapped here.

    ``key`` is the name the server opens ("/name"). The object is created with mode 0600 by
    Python's multiprocessing, so the server must run as the same user.
    """

    def __init__(self, shm, owner):
        self._shm = shm
        self._owner = owner
        self.name = None  # the registered region name, set by register_system

    @classmethod
    def create(cls, size, name=None):
        """A new object of `size` bytes (a fresh random name unless `name` is given)."""
        if size <= 0:
            raise ValueError(f"size must be > 0, got {size}")
        return cls(_mp_shm.SharedMemory(name=name, create=True, size=size), owner=True)

    @classmethod
    def attach(cls, key):
        """An existing object, by its key ("/name" or "name"); not unlinked by this process."""
        name = key.lstrip("/")
        try:
            shm = _mp_shm.SharedMemory(name=name, create=False, track=False)  # Python >= 3.13
        except TypeError:
            shm = _mp_shm.SharedMemory(name=name, create=False)
            # Older Pythons track attached objects too and would unlink them at exit.
            from multiprocessing import resource_tracker
            resource_tracker.unregister(shm._name, "shared_memory")  # pylint: disable=protected-access
        return cls(shm, owner=False)

    @property
    def key(self):
        return "/" + self._shm.name

    @property
    def size(self):
        return self._shm.size

    @property
    def buf(self):
        """The mapping as a memoryview."""
        return self._shm.buf

    def ndarray(self, offset, shape, dtype):
        """A numpy array of `shape` and `dtype` viewing bytes [offset, ...) of the object.
        dtype may be a wire name: "bf16" gives a uint16 array (BF16 bit patterns), "fp16" /
        "fp32" float16 / float32."""
        if isinstance(dtype, str):
            try:
                dtype = _dt.STORAGE[_dt.normalize_dtype(dtype)]
            except ValueError:
                pass  # a numpy name, e.g. "int32"
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) are outside the "
                             f"{self.size}-byte object")
        return np.ndarray(shape, dtype=dtype, buffer=self._shm.buf, offset=offset)

    def offset_of(self, array):
        """The byte offset of `array` (a C-contiguous view of this object) in the object."""
        a = np.asarray(array)
        if not a.flags["C_CONTIGUOUS"]:
            raise ValueError("the array must be C-contiguous")
        base = np.frombuffer(self._shm.buf, dtype=np.uint8).ctypes.data
        offset = a.ctypes.data - base
        if offset < 0 or offset + a.nbytes > self.size:
            raise ValueError("the array is not a view of this shared-memory object")
        return offset

    def ref(self, array, name=None):
        """Ref(name, offset, nbytes) of `array` (a view of this object) in region `name` (by
        default the name register_system gave this object, registered from offset 0)."""
        name = name or self.name
        if name is None:
            raise ValueError("the region is not registered; pass name=")
        return Ref(name, self.offset_of(array), int(np.asarray(array).nbytes))

    def close(self, unlink=None):
        """Unmaps; unlinks the object too if `unlink` (default: if this process created it).
        numpy views of the object must be gone first."""
        self._shm.close()
        if unlink if unlink is not None else self._owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _call(client, method, request, timeout):
    return client._call(getattr(client._stub, method), request, timeout)


def register_system(client, name, region, offset=0, byte_size=None, timeout=None):
    """Registers bytes [offset, offset + byte_size) of a POSIX shm object as region `name`.

    `region` is a SystemRegion (then byte_size defaults to the rest of the object and, with
    offset 0, region.name is set) or a key string ("/name", byte_size required)."""
    if isinstance(region, SystemRegion):
        key = region.key
        if byte_size is None:
            byte_size = region.size - offset
    else:
        key = region
        if byte_size is None:
            raise ValueError("byte_size is required with a key")
    _call(client, "RegisterSystemSharedMemory",
          pb.RegisterSystemSharedMemoryRequest(name=name, key=key, offset=offset,
                                               byte_size=byte_size), timeout)
    if isinstance(region, SystemRegion) and offset == 0:
        region.name = name


def register_cuda(client, name, raw_handle, device_id, byte_size, timeout=None):
    """Registers a CUDA allocation of another process as region `name`: `raw_handle` is its
    64-byte cudaIpcMemHandle_t (of the allocation's base), `device_id` the server's ordinal of
    its GPU. The server must run the cuda backend."""
    raw_handle = bytes(raw_handle)
    if len(raw_handle) != 64:
        raise ValueError(f"raw_handle has {len(raw_handle)} bytes; a cudaIpcMemHandle_t has 64")
    _call(client, "RegisterCudaSharedMemory",
          pb.RegisterCudaSharedMemoryRequest(name=name, raw_handle=raw_handle,
                                             device_id=device_id, byte_size=byte_size), timeout)


def unregister(client, name="", timeout=None):
    """Unregisters region `name` ("" = every region). FAILED_PRECONDITION while a call uses it."""
    _call(client, "UnregisterSharedMemory", pb.UnregisterSharedMemoryRequest(name=name), timeout)


def status(client, name="", timeout=None):
    """The registered regions ("" = all) as dicts: name, kind ("system" / "cuda"), key, offset,
    byte_size, device_id, calls_in_flight."""
    reply = _call(client, "SharedMemoryStatus", pb.SharedMemoryStatusRequest(name=name), timeout)
    return [{"name": r.name, "kind": r.kind, "key": r.key, "offset": r.offset,
             "byte_size": r.byte_size, "device_id": r.device_id,
             "calls_in_flight": r.calls_in_flight} for r in reply.regions]


def _tensor(wire_dtype, shape, ref):
    return pb.Tensor(dtype=wire_dtype, shape=list(shape),
                     region=pb.RegionRef(name=ref.name, offset=ref.offset,
                                         byte_size=ref.byte_size))


def forward_refs(client, layer, hidden, hidden_dtype, num_tokens, hidden_size, topk_ids,
                 topk, weights, output, ids_dtype="int32", request_id="", return_timings=False,
                 timeout=None):
    """Forward with every tensor named by a Ref: hidden [num_tokens, hidden_size] of
    hidden_dtype ("bf16" / "fp16" / "fp32"), topk_ids [num_tokens, topk] int32 or int64,
    weights [num_tokens, topk] float32, the answer into `output` [num_tokens, hidden_size] of
    hidden_dtype. Returns ForwardByRegionResult(dtype, shape, request_id, timings dict).
    return_timings: True, "host" (the host clock's only) or False, as MoeClient.forward_full."""
    name = _dt.normalize_dtype(hidden_dtype)
    timed, host_timed = _wire.timing_flags(return_timings)
    ids_wire = {"int32": pb.DTYPE_INT32, "int64": pb.DTYPE_INT64}[np.dtype(ids_dtype).name]
    request = pb.ForwardRequest(
        layer=layer,
        hidden_states=_tensor(_WIRE[name], (num_tokens, hidden_size), Ref(*hidden)),
        topk_ids=_tensor(ids_wire, (num_tokens, topk), Ref(*topk_ids)),
        topk_weights=_tensor(pb.DTYPE_FP32, (num_tokens, topk), Ref(*weights)),
        request_id=request_id,
        return_timings=timed,
        return_host_timings=host_timed,
        output_region=pb.RegionRef(name=output[0], offset=output[1], byte_size=output[2]))
    reply = _call(client, "Forward", request, timeout)
    if _FROM_WIRE.get(reply.output.dtype) != name or reply.output.data:
        raise ValueError(f"unexpected answer: dtype {reply.output.dtype}, "
                         f"{len(reply.output.data)} bytes inline")
    t = reply.timings
    timings = {k: getattr(t, k) for k in _wire.TIMING_NAMES}
    return ForwardByRegionResult(name, tuple(reply.output.shape), reply.request_id, timings)


def forward(client, region, hidden, topk_ids, topk_weights, out, layer=0, dtype=None,
            request_id="", return_timings=False, timeout=None):
    """One MoE layer whose tensors are numpy views of registered SystemRegions: hidden [M, H]
    (float32, float16, or uint16 BF16 bits with dtype="bf16"), topk_ids [M, K] int32/int64,
    topk_weights [M, K] float32, and `out` [M, H] of hidden's dtype, which receives the answer.

    `region`: the SystemRegion the arrays view (registered from offset 0 by register_system),
    or a list of them. Returns ForwardByRegionResult."""
    regions = list(region) if isinstance(region, (list, tuple)) else [region]

    def ref(array, what):
        for r in regions:
            try:
                return r.ref(array)
            except ValueError:
                continue
        raise ValueError(f"{what} is not a contiguous view of a registered region")

    hidden = np.asarray(hidden)
    topk_ids = np.asarray(topk_ids)
    topk_weights = np.asarray(topk_weights)
    out = np.asarray(out)
    if hidden.ndim != 2 or topk_ids.ndim != 2 or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"expected hidden [M, H] and topk ids/weights [M, K]; got "
                         f"{hidden.shape}, {topk_ids.shape}, {topk_weights.shape}")
    if out.shape != hidden.shape or out.dtype != hidden.dtype:
        raise ValueError(f"out must be {hidden.dtype} {hidden.shape}, got {out.dtype} {out.shape}")
    if topk_weights.dtype != np.float32 or topk_ids.dtype not in (np.int32, np.int64):
        raise TypeError("topk_weights must be float32 and topk_ids int32 or int64 views")
    name = _hidden_dtype(hidden, dtype)
    m, h = hidden.shape
    return forward_refs(client, layer, ref(hidden, "hidden"), name, m, h,
                        ref(topk_ids, "topk_ids"), topk_ids.shape[1],
                        ref(topk_weights, "topk_weights"), ref(out, "out"),
                        ids_dtype=topk_ids.dtype, request_id=request_id,
                        return_timings=return_timings, timeout=timeout)
