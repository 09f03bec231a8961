"""The forward channel: moeserve.v1 Forward calls through a POSIX shared-memory object that the
server polls, instead of a gRPC call per layer (server run with ``--enable_shared_memory``, on
this host). The byte layout and protocol are proto/moeserve/v1/forward_channel.h's; this module
mirrors them (the constants below are that header's).

    from moeserve_client import MoeClient
    from moeserve_client.channel import ForwardChannel

    with MoeClient("unix:/run/moeserve.sock") as client, \\
            ForwardChannel.open(client, num_slots=4, slot_bytes=1 << 20) as ch:
        status, payload = ch.forward(request_bytes)   # a serialized ForwardRequest
        # status 0: payload is a serialized ForwardResponse; else a gRPC code and its message
        fut = ch.submit(other_request)                # several calls in flight, one per slot
        status, payload = ch.result(fut)

A request is bytes-like or a list of bytes-like parts (wire.forward_request's), written straight
into the slot. Tensors may be inline (small M) or RegionRefs into registered regions, so that
the channel carries a few hundred bytes per call.

Waiting: a call spins on its slot's state word for ``spin_us``, then sleeps on it (FUTEX_WAIT,
1 ms at a time, checking server_attached and the call's deadline). Python has no atomic
operations: the words are plain aligned 4/8-byte stores and loads (single instructions on
x86-64 and arm64, which never tear). On x86-64 the hardware keeps them in order (stores with
stores, loads with loads), which is all the protocol needs. arm64 (Grace) reorders both, so
there memory_fence() (a FUTEX_WAKE, which the kernel starts with a full barrier) goes between a
request's bytes and its state word, and between an answered state and the answer's bytes. The
futex syscall made on every call (FUTEX_WAKE of the doorbell) orders the state store before the
server_sleeping check. Every wait has a timeout, so a missed wake costs latency, never a hang.

Thread-safety: forward / submit / result may be called from several threads (a slot is one
call's; the doorbell's read-modify-write is under a lock: this process is its only writer).
A future is consumed by one result() call.
"""

import ctypes
import itertools
import mmap
import os
import platform
import sys
import threading
import time

import grpc
import numpy as np

from .status import StatusError

# proto/moeserve/v1/forward_channel.h
MAGIC = 0x4346534D
VERSION = 1
MAX_SLOTS = 256
MIN_SLOT_BYTES = 1024
MAX_SLOT_BYTES = 1 << 30
DOORBELL_OFFSET = 64
SERVER_SLEEPING_OFFSET = 128
SERVER_ATTACHED_OFFSET = 192
SLOTS_OFFSET = 256
SLOT_HEADER_BYTES = 64
# slot fields, from the slot's start
_STATE, _CLIENT_WAITING, _REQUEST_BYTES, _ANSWER_BYTES, _STATUS_CODE = 0, 4, 8, 12, 16
_TIMEOUT_US, _SEQUENCE, _ANSWER_SEQUENCE = 24, 32, 40
SLOT_FREE, SLOT_REQUEST, SLOT_TAKEN, SLOT_ANSWER = 0, 1, 2, 3

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]


def channel_bytes(num_slots, slot_bytes):
    """Bytes of a channel object with `num_slots` slots of `slot_bytes` each."""
    return SLOTS_OFFSET + num_slots * slot_bytes


class ChannelError(StatusError):
    """A call through the channel failed: the server's status (code() / details(), as a
    grpc.RpcError of a unary call has them), or the channel's own (UNAVAILABLE: the server
    detached; DEADLINE_EXCEEDED; RESOURCE_EXHAUSTED: the request does not fit a slot)."""


# ---- futex ----

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(
    platform.machine().lower())
FUTEX_WAIT, FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = None


def _futex_fn():
    """libc's syscall() set up for futex(2) (CDLL calls release the GIL), or None off Linux."""
    global _libc
    if _libc is None:
        if _SYS_FUTEX is None or not sys.platform.startswith("linux"):
            _libc = False
        else:
            lib = ctypes.CDLL(None, use_errno=True)
            fn = lib.syscall
            fn.restype = ctypes.c_long
            # syscall() is variadic; on x86-64 and arm64 Linux, fixed argument types pass the same
            # way, and they keep 64-bit addresses from being truncated to int.
            fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint,
                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
            _libc = fn
    return _libc or None


def futex_wake(addr, count=1):
    """FUTEX_WAKE (shared) of the u32 at address `addr`: wakes up to `count` waiters."""
    return _futex_fn()(_SYS_FUTEX, addr, FUTEX_WAKE, count, None, None, 0)


def futex_wait(addr, expected, timeout_s):
    """FUTEX_WAIT (shared) while the u32 at `addr` is `expected`, at most `timeout_s`; returns
    when woken, on a timeout, a signal, or at once if the word is no longer `expected`."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    return _futex_fn()(_SYS_FUTEX, addr, FUTEX_WAIT, expected, ctypes.addressof(ts), None, 0)


# The hardware's memory order: x86-64 (TSO) keeps stores in order and loads in order; arm64
# does neither.
WEAK_MEMORY_ORDER = platform.machine().lower() in ("aarch64", "arm64")
_fence_word = ctypes.c_uint32(0)  # nobody waits on it


def memory_fence():
    """A full memory barrier where the hardware needs one between the channel's plain stores and
    loads (arm64); nothing on x86-64. Python has none: futex(2)'s FUTEX_WAKE runs one in the
    kernel (smp_mb) before it looks for waiters, so a wake of a word nobody waits on is a fence
    (about a microsecond)."""
    if WEAK_MEMORY_ORDER:
        futex_wake(ctypes.addressof(_fence_word), 1)


# ---- the channel ----


class ChannelFuture:
    """A call in flight (ForwardChannel.submit); ForwardChannel.result() consumes it."""

    __slots__ = ("slot", "sequence", "deadline", "consumed")

    def __init__(self, slot, sequence, deadline):
        self.slot = slot
        self.sequence = sequence
        self.deadline = deadline  # time.monotonic() seconds, or None
        self.consumed = False

    def done(self):
        """True once the answer is there (result() will not wait)."""
        return self.slot.state.value == SLOT_ANSWER


class _Slot:
    __slots__ = ("index", "offset", "payload_offset", "state", "client_waiting",
                 "request_bytes", "answer_bytes", "status_code", "timeout_us", "sequence",
                 "answer_sequence", "state_addr", "abandoned")

    def __init__(self, mm, index, slot_bytes):
        off = SLOTS_OFFSET + index * slot_bytes
        self.index = index
        self.offset = off
        self.payload_offset = off + SLOT_HEADER_BYTES
        # ctypes views: one C call per load or store, fewer than numpy's scalar indexing.
        self.state = ctypes.c_uint32.from_buffer(mm, off + _STATE)
        self.client_waiting = ctypes.c_uint32.from_buffer(mm, off + _CLIENT_WAITING)
        self.request_bytes = ctypes.c_uint32.from_buffer(mm, off + _REQUEST_BYTES)
        self.answer_bytes = ctypes.c_uint32.from_buffer(mm, off + _ANSWER_BYTES)
        self.status_code = ctypes.c_int32.from_buffer(mm, off + _STATUS_CODE)
        self.timeout_us = ctypes.c_uint64.from_buffer(mm, off + _TIMEOUT_US)
        self.sequence = ctypes.c_uint64.from_buffer(mm, off + _SEQUENCE)
        self.answer_sequence = ctypes.c_uint64.from_buffer(mm, off + _ANSWER_SEQUENCE)
        self.state_addr = ctypes.addressof(self.state)
        self.abandoned = False  # given up on: not reused until the server answers it


_counter = itertools.count()


class ForwardChannel:
    """A forward channel: a POSIX shared-memory object of `num_slots` slots of `slot_bytes`
    (64 header bytes + the payload each), created by this process and registered with the
    server. Use open() (create + register) and close() (unregister + unlink), or `with`.

    spin_us: how long a call polls its slot before it sleeps on it; 0 sleeps at once.
    """

    def __init__(self, num_slots=4, slot_bytes=1 << 20, key=None, spin_us=200):
        if not 1 <= num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots={num_slots}; expected 1..{MAX_SLOTS}")
        if slot_bytes % 64 or not MIN_SLOT_BYTES <= slot_bytes <= MAX_SLOT_BYTES:
            raise ValueError(f"slot_bytes={slot_bytes}; expected a multiple of 64 in "
                             f"[{MIN_SLOT_BYTES}, {MAX_SLOT_BYTES}]")
        if _futex_fn() is None:
            raise OSError("the forward channel needs Linux futexes (x86-64 or arm64)")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.payload_capacity = slot_bytes - SLOT_HEADER_BYTES
        self.spin_s = spin_us / 1e6
        self.key = key or f"/moeserve-ch-{os.getpid()}-{next(_counter)}"
        self.byte_size = channel_bytes(num_slots, slot_bytes)
        self.name = None         # the registered name
        self.server_spin_us = None
        self.sleeps = 0          # calls whose answer came after the spin (they slept on it)
        self._client = None
        self._closed = False
        self._error = None       # a ChannelError once the channel is unusable (server detached)
        fd = os.open("/dev/shm" + self.key, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.byte_size)
            self._mm = mmap.mmap(fd, self.byte_size, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink("/dev/shm" + self.key)
            raise
        os.close(fd)
        self._buf = memoryview(self._mm)
        self._base = np.frombuffer(self._mm, np.uint8).ctypes.data  # the mapping's address
        words = np.ndarray((self.byte_size // 4,), dtype="<u4", buffer=self._mm)
        words[:SLOTS_OFFSET // 4] = 0
        words[0], words[1], words[2] = MAGIC, VERSION, num_slots
        words[4], words[5] = slot_bytes & 0xFFFFFFFF, slot_bytes >> 32
        del words
        self._doorbell = ctypes.c_uint32.from_buffer(self._mm, DOORBELL_OFFSET)
        self._doorbell_addr = ctypes.addressof(self._doorbell)
        self._attached = ctypes.c_uint32.from_buffer(self._mm, SERVER_ATTACHED_OFFSET)
        self._slots = [_Slot(self._mm, i, slot_bytes) for i in range(num_slots)]
        self._free = list(reversed(self._slots))
        self._abandoned = []
        self._lock = threading.Lock()
        self._slot_freed = threading.Condition(self._lock)
        self._seq = itertools.count(1)

    @classmethod
    def open(cls, client, name=None, num_slots=4, slot_bytes=1 << 20, spin_us=200,
             attach_timeout=5.0, timeout=None):
        """Creates a channel and registers it with the server through `client` (a MoeClient or
        TorchMoeClient: anything with register_forward_channel). Waits up to attach_timeout
        for the server to attach. Raises grpc.RpcError if refused (e.g. FAILED_PRECONDITION
        without --enable_shared_memory)."""
        ch = cls(num_slots=num_slots, slot_bytes=slot_bytes, spin_us=spin_us)
        try:
            ch.register(client, name, attach_timeout=attach_timeout, timeout=timeout)
        except BaseException:
            ch.close()
            raise
        return ch

    def register(self, client, name=None, attach_timeout=5.0, timeout=None):
        name = name or self.key.lstrip("/")
        reply = client.register_forward_channel(name, self.key, self.byte_size, timeout=timeout)
        self.name = name
        self._client = client
        self.server_spin_us = reply.spin_us
        if reply.num_slots != self.num_slots or reply.slot_bytes != self.slot_bytes:
            raise ChannelError(INTERNAL, f"server read {reply.num_slots} slots of "
                               f"{reply.slot_bytes} bytes; wrote {self.num_slots} of "
                               f"{self.slot_bytes}")
        # The server may start serving just after the RPC answers.
        deadline = time.monotonic() + attach_timeout
        while self._attached.value != 1:
            if time.monotonic() > deadline:
                raise ChannelError(UNAVAILABLE, f"the server did not attach to channel {name} "
                                   f"within {attach_timeout} s")
            time.sleep(0.0005)

    @property
    def server_attached(self):
        return self._attached.value == 1

    @property
    def error(self):
        """Why the channel is unusable (a ChannelError), or None."""
        return self._error

    def close(self, unregister=True, timeout=None):
        """Unregisters (if registered and `unregister`), unmaps and unlinks the object."""
        if self._closed:
            return
        self._closed = True
        try:
            if unregister and self._client is not None and self.name:
                # The server may count a call in flight for a moment after answering it
                # (FAILED_PRECONDITION): retry briefly.
                give_up = time.monotonic() + 2.0
                while True:
                    try:
                        self._client.unregister_forward_channel(self.name, timeout=timeout)
                        break
                    except grpc.RpcError as e:
                        code = e.code() if callable(getattr(e, "code", None)) else None
                        if code != grpc.StatusCode.FAILED_PRECONDITION or \
                                time.monotonic() > give_up:
                            break  # gone, forgot it, or busy for good: nothing more to do
                        time.sleep(0.002)
        finally:
            self._client = None
            # ctypes views export the mapping's buffer; drop them before unmapping.
            self._slots = self._free = self._abandoned = []
            self._doorbell = self._attached = None
            self._buf.release()
            try:
                self._mm.close()
            except BufferError:
                pass  # a view is still alive somewhere; the mapping goes with the last one
            try:
                os.unlink("/dev/shm" + self.key)
            except FileNotFoundError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if not self._closed:
                self.close(unregister=False)
        except Exception:  # pylint: disable=broad-except
            pass

    # ---- slots ----

    def _reclaim(self):
        """Abandoned slots the server has answered since: free again (lock held)."""
        keep = []
        for s in self._abandoned:
            if s.state.value in (SLOT_ANSWER, SLOT_FREE):
                s.abandoned = False
                s.state.value = SLOT_FREE
                self._free.append(s)
            else:
                keep.append(s)
        self._abandoned = keep

    def _acquire(self, block_until):
        """A free slot, or None: at once if block_until is None, else waiting for one until
        time.monotonic() reaches block_until (a float)."""
        with self._lock:
            while True:
                if self._free:
                    return self._free.pop()
                if self._abandoned:
                    self._reclaim()
                    if self._free:
                        return self._free.pop()
                if block_until is None:
                    return None
                left = block_until - time.monotonic()
                if left <= 0:
                    return None
                if self._abandoned:
                    left = min(left, 0.001)  # poll: the server answers without notifying
                self._slot_freed.wait(None if left == float("inf") else left)

    def _release(self, slot):
        with self._lock:
            self._free.append(slot)
            self._slot_freed.notify()

    def _check_usable(self):
        if self._closed:
            raise ChannelError(UNAVAILABLE, "the channel is closed")
        if self._error is not None:
            raise self._error
        if self._attached.value != 1:
            self._fail(ChannelError(UNAVAILABLE, f"the server is not attached to forward "
                                    f"channel {self.name}"))
            raise self._error

    # ---- calls ----

    @staticmethod
    def _timeout(timeout):
        """`timeout` checked before a slot is taken: None or +inf is no deadline; NaN and
        values <= 0 are refused (a slot taken and then refused would never come back)."""
        if timeout is None or timeout == float("inf"):
            return None
        if not timeout > 0:
            raise ValueError(f"timeout: got {timeout!r}, expected > 0 seconds or None")
        return float(timeout)

    def try_submit(self, request, timeout=None):
        """submit() if a slot is free now, else None (the caller may send by gRPC instead)."""
        self._check_usable()
        timeout = self._timeout(timeout)
        slot = self._acquire(None)
        if slot is None:
            return None
        return self._start(slot, request, timeout)

    def submit(self, request, timeout=None):
        """Starts a call and returns a ChannelFuture; waits for a free slot (up to `timeout`
        seconds, None: for ever) when all are in use. `request`: a serialized ForwardRequest
        (bytes-like) or a list of bytes-like parts."""
        self._check_usable()
        timeout = self._timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        slot = self._acquire(float("inf") if deadline is None else deadline)
        if slot is None:
            raise ChannelError(DEADLINE_EXCEEDED, f"no free slot of {self.num_slots} within "
                               f"{timeout} s")
        return self._start(slot, request, timeout, deadline)

    def _start(self, slot, request, timeout, deadline=None):
        try:
            n = self._write(slot, request)
        except BaseException:
            self._release(slot)
            raise
        seq = next(self._seq)
        if timeout is not None:
            if deadline is None:
                deadline = time.monotonic() + timeout
            slot.timeout_us.value = max(1, int(timeout * 1e6))
        else:
            slot.timeout_us.value = 0
        slot.request_bytes.value = n
        slot.sequence.value = seq
        slot.client_waiting.value = 0
        slot.status_code.value = 0
        memory_fence()  # the request's bytes and header before its state (release)
        slot.state.value = SLOT_REQUEST
        with self._lock:
            self._doorbell.value = (self._doorbell.value + 1) & 0xFFFFFFFF
        # Always: a system call is a full barrier (the server's server_sleeping check would
        # otherwise race with our stores), and waking nobody costs about a microsecond.
        futex_wake(self._doorbell_addr, 1)
        return ChannelFuture(slot, seq, deadline)

    def _write(self, slot, request):
        pos = slot.payload_offset
        end = pos + self.payload_capacity
        buf = self._buf
        parts = request if isinstance(request, (list, tuple)) else (request,)
        for part in parts:
            if isinstance(part, bytes):
                k = len(part)
            else:
                part = memoryview(part)
                if part.format != "B" or part.ndim != 1:
                    part = part.cast("B")
                k = part.nbytes
            if pos + k > end:
                total = sum(len(p) if isinstance(p, bytes) else memoryview(p).nbytes
                            for p in parts)
                raise ChannelError(RESOURCE_EXHAUSTED, f"the request has {total} bytes; a slot "
                                   f"holds {self.payload_capacity} (send tensors by region, or "
                                   "open the channel with a larger slot_bytes)")
            buf[pos:pos + k] = part
            pos += k
        return pos - slot.payload_offset

    def _wait(self, fut):
        slot = fut.slot
        state = slot.state
        if state.value == SLOT_ANSWER:
            return
        spin_end = time.perf_counter() + self.spin_s
        while time.perf_counter() < spin_end:
            if state.value == SLOT_ANSWER:
                return
        slot.client_waiting.value = 1
        self.sleeps += 1  # (a statistic: not locked)
        try:
            while True:
                s = state.value
                if s == SLOT_ANSWER:
                    return
                if self._attached.value != 1:
                    if state.value == SLOT_ANSWER:
                        return
                    self._fail(ChannelError(UNAVAILABLE, f"the server detached from forward "
                                            f"channel {self.name}"))
                    self._abandon(fut)
                    raise self._error
                wait = 0.001
                if fut.deadline is not None:
                    # A grace period past the deadline: the server answers DEADLINE_EXCEEDED.
                    left = fut.deadline + 0.5 - time.monotonic()
                    if left <= 0:
                        self._abandon(fut)
                        raise ChannelError(DEADLINE_EXCEEDED, "no answer through the forward "
                                           "channel by the call's deadline")
                    wait = min(wait, left)
                futex_wait(slot.state_addr, s, wait)
        finally:
            slot.client_waiting.value = 0

    def _fail(self, error):
        if self._error is None:
            self._error = error

    def _abandon(self, fut):
        fut.consumed = True
        with self._lock:
            fut.slot.abandoned = True
            self._abandoned.append(fut.slot)

    def result(self, fut, reader=None):
        """Waits for `fut`'s answer: (status_code, payload). status_code 0: payload is the
        serialized ForwardResponse; else a gRPC code and payload its message (str).

        reader: a function called as reader(view, address) with a memoryview of the answer's
        bytes in the slot and their address (valid only during the call: copy what you keep);
        for status 0 its return value is the payload then, and the answer is not copied."""
        if fut.consumed:
            raise RuntimeError("this future's result was already taken")
        self._wait(fut)
        fut.consumed = True
        slot = fut.slot
        memory_fence()  # the answered state before the answer's header and bytes (acquire)
        try:
            n = slot.answer_bytes.value
            code = slot.status_code.value
            if slot.answer_sequence.value != fut.sequence:
                raise ChannelError(INTERNAL, f"slot {slot.index} answered sequence "
                                   f"{slot.answer_sequence.value}; sent {fut.sequence}")
            if n > self.payload_capacity:
                raise ChannelError(INTERNAL, f"slot {slot.index} answered {n} bytes; it holds "
                                   f"{self.payload_capacity}")
            p = slot.payload_offset
            if code != 0:
                return code, bytes(self._buf[p:p + n])
            if reader is not None:
                view = self._buf[p:p + n]
                try:
                    return 0, reader(view, self._base + p)
                finally:
                    try:
                        view.release()
                    except BufferError:
                        pass  # the reader kept a view; it goes with its last reference
            return 0, bytes(self._buf[p:p + n])
        finally:
            slot.state.value = SLOT_FREE
            self._release(slot)

    def forward(self, request, timeout=None, reader=None):
        """One call: submit() then result()."""
        return self.result(self.submit(request, timeout), reader)
