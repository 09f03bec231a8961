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
  * CPU tensors: the request is built with one copy of each tensor's bytes (no numpy, no
    protobuf copies: moeserve_client.wire); the answer is a view of the reply's bytes
    (torch.frombuffer), copied only into `out` when one is given.
  * CUDA tensors, bytes path: device -> pinned host staging -> request; reply -> `out` (or a
    new tensor on the device).
  * CUDA tensors, CUDA-region path (shared_memory="auto" or "cuda"): when the server is on this
    host (a unix: or loopback target) and runs with --enable_shared_memory on the cuda backend,
    hidden states are copied device-to-device into a registered CUDA IPC region and the answer
    is written by the server into the same region; only ids, weights and a few hundred header
    bytes cross gRPC. "auto" tries it once per device and falls back to bytes for good on any
    refusal; "cuda" raises instead; "off" never tries.

Thread-safety: submit/result may be called from several threads. A future is consumed by one
result() call.
"""

import ctypes
import ipaddress
import threading
import time
import warnings

import grpc
import torch

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


class MoeFuture:
    """A Forward call in flight (TorchMoeClient.submit). After result(): request_id, timings
    (dict, with return_timings), topk_ids / topk_weights (with return_routing)."""

    __slots__ = ("_call", "_dtype", "_shape", "_device", "_region", "_region_out",
                 "_start", "request_id", "timings", "topk_ids", "topk_weights",
                 "latency_s", "used_region")

    def __init__(self):
        self._region = None
        self._region_out = None
        self.request_id = ""
        self.timings = None
        self.topk_ids = None
        self.topk_weights = None
        self.latency_s = None
        self.used_region = False

    def done(self):
        return self._call.done()


class _CudaRegion:
    """A device buffer registered with the server as a CUDA IPC region."""

    def __init__(self, client, device, nbytes):
        self.device = device
        # A whole allocation of its own (the IPC handle names the allocator's block).
        self.buf = torch.empty(max(nbytes, 2 << 20), dtype=torch.uint8, device=device)
        shared = self.buf.untyped_storage()._share_cuda_()
        # (device, handle, storage bytes, offset of the storage in the IPC allocation, ...)
        handle, size, base = shared[1], shared[2], shared[3]
        self.base = int(base)
        self.capacity = int(size) - (self.buf.data_ptr() - self.buf.untyped_storage().data_ptr())
        self.name = f"moeserve-torch-{id(self):x}-{device.index}"
        client._stub.RegisterCudaSharedMemory(
            pb.RegisterCudaSharedMemoryRequest(name=self.name, raw_handle=bytes(handle),
                                               device_id=device.index,
                                               byte_size=self.base + int(size)),
            timeout=client.timeout)
        self.client = client

    def ref(self, offset, nbytes):
        return (self.name, self.base + offset, nbytes)

    def unregister(self):
        try:
            self.client._stub.UnregisterSharedMemory(
                pb.UnregisterSharedMemoryRequest(name=self.name), timeout=self.client.timeout)
        except grpc.RpcError:
            pass


class TorchMoeClient:
    """A channel to one moeserve server, speaking torch tensors. close() (or `with`) when done.

    timeout: per-call deadline in seconds. shared_memory: "auto" | "cuda" | "off" (see the
    module docstring). channel_options: extra grpc channel options.
    """

    def __init__(self, target, timeout=30.0, max_message_bytes=256 << 20, shared_memory="auto",
                 channel_options=()):
        if shared_memory not in ("auto", "cuda", "off"):
            raise ValueError(f"shared_memory={shared_memory!r}; expected auto, cuda or off")
        self.target = target
        self.timeout = timeout
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes)] + list(channel_options)
        self._channel = grpc.insecure_channel(target, options=options)
        self._stub = pb_grpc.MoeServiceStub(self._channel)
        # Raw bytes both ways: requests are built by moeserve_client.wire.
        self._forward = self._channel.unary_unary(_FORWARD)
        self._shared_memory = shared_memory
        self._local = _is_local_target(target)
        self._lock = threading.Lock()
        self._regions_free = {}    # device index -> [_CudaRegion]
        self._regions_all = []
        self._region_disabled = shared_memory == "off"
        self._region_error = None
        self._pinned = {}          # thread id -> pinned staging tensor
        self._info = None

    def close(self):
        with self._lock:
            regions, self._regions_all = self._regions_all, []
            self._regions_free = {}
        for r in regions:
            r.unregister()
        self._channel.close()

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

    # ---- the CUDA-region path ----

    def _use_region(self, hidden):
        if hidden.device.type != "cuda" or self._region_disabled:
            return False
        if not self._local:
            if self._shared_memory == "cuda":
                raise RuntimeError(f"shared_memory='cuda' needs a server on this host; "
                                   f"target {self.target} is not local")
            return False
        return True

    def _acquire_region(self, device, nbytes):
        with self._lock:
            free = self._regions_free.setdefault(device.index, [])
            for i, r in enumerate(free):
                if r.capacity >= nbytes:
                    return free.pop(i)
        try:
            r = _CudaRegion(self, device, nbytes)
        except (grpc.RpcError, RuntimeError, AttributeError, TypeError) as e:
            if self._shared_memory == "cuda":
                raise
            # Refused (shared memory off, not the cuda backend, another host) or unsupported by
            # this torch: the bytes path from now on.
            self._region_disabled = True
            self._region_error = e
            return None
        with self._lock:
            self._regions_all.append(r)
        return r

    def _release_region(self, r):
        with self._lock:
            self._regions_free.setdefault(r.device.index, []).append(r)

    @property
    def region_error(self):
        """Why the CUDA-region path was given up ("auto"), or None."""
        return self._region_error

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
               return_timings=False, return_routing=False, timeout=None):
        """Starts one MoE layer forward and returns a MoeFuture at once (see result())."""
        fut, request = self._prepare(hidden, topk_ids, topk_weights, layer, request_id,
                                     return_timings, return_routing)
        fut._start = time.perf_counter()
        try:
            fut._call = self._forward.future(request, timeout=timeout or self.timeout)
        except BaseException:
            self._drop(fut)
            raise
        return fut

    def _drop(self, fut):
        region, fut._region = fut._region, None
        if region is not None:
            self._release_region(region)

    def _prepare(self, hidden, topk_ids, topk_weights, layer, request_id, return_timings,
                 return_routing):
        """A MoeFuture (not started) and the request bytes."""
        # Few tensor attribute reads: each is a C call, and this runs on every layer call.
        shape = tuple(hidden.shape)
        dtype = hidden.dtype
        hid_wire = _FLOAT_WIRE.get(dtype)
        if len(shape) != 2:
            raise ValueError(f"hidden must be [M, H]; got shape {shape}")
        if hid_wire is None:
            raise TypeError(f"hidden has dtype {dtype}; expected bfloat16, float16 or float32")
        if (topk_ids is None) != (topk_weights is None):
            raise ValueError("pass both topk_ids and topk_weights, or neither (server routing)")
        fut = MoeFuture()
        device = hidden.device
        fut._dtype, fut._shape, fut._device = dtype, shape, device
        keep = []
        ids_t = weights_t = None
        if topk_ids is not None:
            ids_shape = tuple(topk_ids.shape)
            if len(ids_shape) != 2 or ids_shape[0] != shape[0] or \
                    tuple(topk_weights.shape) != ids_shape:
                raise ValueError(f"expected topk ids/weights [{shape[0]}, K]; got "
                                 f"{ids_shape}, {tuple(topk_weights.shape)}")
            ids_wire = _ID_WIRE.get(topk_ids.dtype)
            if ids_wire is None:
                topk_ids, ids_wire = topk_ids.to(torch.int32), wire.DTYPE_INT32
            if topk_weights.dtype is not torch.float32:
                topk_weights = topk_weights.float()
            # ids and weights are small and read on the server's host: always bytes.
            if topk_ids.is_cuda:
                topk_ids = topk_ids.cpu()
            if topk_weights.is_cuda:
                topk_weights = topk_weights.cpu()
            topk_ids = topk_ids.contiguous()
            topk_weights = topk_weights.contiguous()
            keep += [topk_ids, topk_weights]
            n = ids_shape[0] * ids_shape[1]
            ids_t = (ids_wire, ids_shape, _host_bytes(topk_ids, n * wire.ITEMSIZE[ids_wire]))
            weights_t = (wire.DTYPE_FP32, ids_shape, _host_bytes(topk_weights, n * 4))
        nbytes = shape[0] * shape[1] * wire.ITEMSIZE[hid_wire]
        output_region = None
        region = None
        if device.type == "cuda" and nbytes > 0 and self._use_region(hidden):
            region = self._acquire_region(device, 2 * nbytes + 256)
        if region is not None:
            out_off = (nbytes + 255) // 256 * 256
            region.buf[:nbytes].copy_(hidden.contiguous().view(-1).view(torch.uint8))
            # The server reads the region from another process: the copy must have landed.
            torch.cuda.current_stream(device).synchronize()
            hid_t = (hid_wire, shape, None, region.ref(0, nbytes))
            output_region = region.ref(out_off, nbytes)
            fut._region, fut._region_out = region, out_off
            fut.used_region = True
        else:
            host = self._staged(hidden, device, nbytes)
            keep.append(host)
            hid_t = (hid_wire, shape, _host_bytes(host, nbytes))
        parts = wire.forward_request(layer, hid_t, ids_t, weights_t, request_id=request_id,
                                     return_timings=return_timings,
                                     return_routing=return_routing,
                                     output_region=output_region)
        request = b"".join(parts)
        del keep  # the bytes are in `request` now
        return fut, request

    def result(self, fut, out=None):
        """Waits for `fut` and returns the output [M, H] (hidden's dtype): `out` when given
        (filled in place, any device), else a tensor on hidden's device. Raises grpc.RpcError
        with the server's status on failure."""
        try:
            raw = fut._call.result()
        except BaseException:
            self._drop(fut)
            raise
        finally:
            fut.latency_s = time.perf_counter() - fut._start
        return self._finish(fut, raw, out)

    def _finish(self, fut, raw, out):
        region, fut._region = fut._region, None
        try:
            reply = wire.forward_response(raw)
            o = reply.output
            if o is None or _FROM_WIRE.get(o.dtype) != fut._dtype or tuple(o.shape) != fut._shape:
                raise ValueError(f"server answered {o!r}; expected {fut._dtype} {fut._shape}")
            if out is not None and (out.dtype != fut._dtype or tuple(out.shape) != fut._shape):
                raise ValueError(f"out is {out.dtype} {tuple(out.shape)}; expected "
                                 f"{fut._dtype} {fut._shape}")
            if region is not None:
                n = fut._shape[0] * fut._shape[1] * wire.ITEMSIZE[_FLOAT_WIRE[fut._dtype]]
                src = region.buf[fut._region_out:fut._region_out + n].view(fut._dtype).view(
                    fut._shape)
                if out is None:
                    out = src.clone()
                else:
                    out.copy_(src)
            elif out is not None and out.device.type == "cpu" and out.is_contiguous():
                # A plain memcpy: torch's copy_ would run a parallel region whose spinning
                # threads take CPU from a server on the same cores.
                if o.nbytes:
                    ctypes.memmove(out.data_ptr(), ctypes.cast(raw, ctypes.c_void_p).value +
                                   o.offset, o.nbytes)
            else:
                src = _view(raw, o)
                if out is not None:
                    out.copy_(src)
                elif fut._device.type != "cpu":
                    out = src.to(fut._device)
                else:
                    out = src
            fut.request_id = reply.request_id
            fut.timings = reply.timings
            if reply.topk_ids is not None:
                fut.topk_ids = _view(raw, reply.topk_ids).to(fut._device)
                fut.topk_weights = _view(raw, reply.topk_weights).to(fut._device)
            return out
        finally:
            if region is not None:
                self._release_region(region)

    def forward(self, hidden, topk_ids=None, topk_weights=None, layer=0, out=None,
                request_id="", return_timings=False, timeout=None):
        """One blocking MoE layer forward: as submit() then result(), on the calling thread (a
        blocking gRPC call has no completion-thread hand-off, which a future pays)."""
        fut, request = self._prepare(hidden, topk_ids, topk_weights, layer, request_id,
                                     return_timings, False)
        fut._start = time.perf_counter()
        try:
            raw = self._forward(request, timeout=timeout or self.timeout)
        except BaseException:
            self._drop(fut)
            raise
        finally:
            fut.latency_s = time.perf_counter() - fut._start
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
