"""moeserve.v1 Forward messages encoded and decoded by hand, so that tensor bytes are copied once
into the request and viewed (not copied) in the answer.

protobuf's Python API copies a ``bytes`` field when it is set, again when the message is
serialized, and again when it is read back; for a 14 MB hidden-states tensor that is most of a
call. The wire format of the three messages involved is small, so this module writes it
directly: the request is a list of byte strings (the tensors' data given as buffers, e.g.
memoryviews of torch or numpy memory) joined once, and the response is walked field by field,
returning where each tensor's data sits in the reply's bytes. Any protobuf peer reads what this
writes (tests/python checks it against protobuf both ways).

Only what moeserve.proto defines is written; unknown response fields are skipped. No torch or
numpy here.
"""

import struct

# moeserve.v1.DType
DTYPE_BF16, DTYPE_FP16, DTYPE_FP32, DTYPE_INT32, DTYPE_INT64 = 1, 2, 3, 4, 5
ITEMSIZE = {DTYPE_BF16: 2, DTYPE_FP16: 2, DTYPE_FP32: 4, DTYPE_INT32: 4, DTYPE_INT64: 8}

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


_SMALL = [bytes((i,)) for i in range(128)]


def varint(n):
    """Unsigned LEB128; negative int32/int64 as their 64-bit two's complement (10 bytes)."""
    if 0 <= n < 128:
        return _SMALL[n]
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _tag(field, wire_type):
    return varint((field << 3) | wire_type)


def _len_field(field, payload_len):
    return _tag(field, _LEN) + varint(payload_len)


def region_ref(name, offset, byte_size):
    """Serialized RegionRef."""
    name_b = name.encode()
    return (_len_field(1, len(name_b)) + name_b + _tag(2, _VARINT) + varint(offset)
            + _tag(3, _VARINT) + varint(byte_size))


# Tensor headers by (field, dtype, shape, data_len, region): a frontend sends the same few
# shapes again and again, so the header bytes are built once.
_HEADERS = {}


def tensor_parts(field, dtype, shape, data_len=0, region=None):
    """The parts of Tensor field `field` of a message, up to (not including) its data bytes,
    which the caller appends (data_len of them). With `region` ((name, offset, byte_size)) the
    tensor names a region instead and data_len must be 0."""
    key = (field, dtype, shape, data_len, region)
    head = _HEADERS.get(key)
    if head is not None:
        return head
    packed = b"".join(varint(d) for d in shape)
    body = _tag(1, _VARINT) + varint(dtype)
    if shape:
        body += _len_field(2, len(packed)) + packed
    if region is not None:
        ref = region_ref(*region)
        body += _len_field(4, len(ref)) + ref
    if data_len:
        body += _len_field(3, data_len)
    head = _len_field(field, len(body) + data_len) + body
    if len(_HEADERS) > 4096:
        _HEADERS.clear()
    _HEADERS[key] = head
    return head


# Serialized output_region fields by (name, offset, byte_size): the same few again and again.
_OUTPUT_REGIONS = {}

_LAYER_TAG = _tag(1, _VARINT)
_RID_TAG = _tag(5, _LEN)
_TIMINGS = _tag(6, _VARINT) + b"\x01"
_ROUTING = _tag(8, _VARINT) + b"\x01"
_HOST_TIMINGS = _tag(9, _VARINT) + b"\x01"


def forward_request(layer, hidden, topk_ids=None, topk_weights=None, request_id="",
                    return_timings=False, return_routing=False, output_region=None):
    """A serialized ForwardRequest as a list of parts to join.

    hidden / topk_ids / topk_weights: (dtype, shape, data) with data a buffer (bytes,
    memoryview, ...) of exactly product(shape) * itemsize bytes, or (dtype, shape, None,
    (region name, offset, byte_size)) for a tensor in a registered region. shape a tuple.
    topk_* None: the server routes. output_region: (name, offset, byte_size) or None.
    return_timings: True (the stage timings, timing the step on the device), "host" (the host
    clock's stages and total only: return_host_timings, an untimed step) or False.
    """
    parts = [_LAYER_TAG + varint(layer)] if layer else []
    for field, t in ((2, hidden), (3, topk_ids), (4, topk_weights)):
        if t is None:
            continue
        data = t[2]
        if data is None:
            parts.append(tensor_parts(field, t[0], t[1], 0, t[3] if len(t) > 3 else None))
            continue
        n = len(data) if isinstance(data, bytes) else memoryview(data).nbytes
        parts.append(tensor_parts(field, t[0], t[1], n, t[3] if len(t) > 3 else None))
        if n:
            parts.append(data)
    if request_id:
        rid = request_id.encode()
        parts.append(_RID_TAG + varint(len(rid)) + rid)
    timed, host_timed = timing_flags(return_timings)
    if timed:
        parts.append(_TIMINGS)
    if output_region is not None:
        field = _OUTPUT_REGIONS.get(output_region)
        if field is None:
            ref = region_ref(*output_region)
            field = _len_field(7, len(ref)) + ref
            if len(_OUTPUT_REGIONS) > 4096:
                _OUTPUT_REGIONS.clear()
            _OUTPUT_REGIONS[output_region] = field
        parts.append(field)
    if return_routing:
        parts.append(_ROUTING)
    if host_timed:
        parts.append(_HOST_TIMINGS)
    return parts


class WireError(ValueError):
    """The bytes are not a well-formed message of the expected type."""


def _read_varint(buf, pos, end):
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise WireError("truncated or overlong varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def _fields(buf, pos, end):
    """Yields (field, wire_type, value, start, stop): value is the integer for varints, None
    otherwise; [start, stop) the payload of length-delimited and fixed fields."""
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        field, wt = key >> 3, key & 7
        if wt == _VARINT:
            v, pos = _read_varint(buf, pos, end)
            yield field, wt, v, pos, pos
        elif wt == _LEN:
            n, pos = _read_varint(buf, pos, end)
            if pos + n > end:
                raise WireError(f"field {field}: length {n} past the end")
            yield field, wt, None, pos, pos + n
            pos += n
        elif wt == _I64:
            if pos + 8 > end:
                raise WireError(f"field {field}: truncated fixed64")
            yield field, wt, None, pos, pos + 8
            pos += 8
        elif wt == _I32:
            if pos + 4 > end:
                raise WireError(f"field {field}: truncated fixed32")
            yield field, wt, None, pos, pos + 4
            pos += 4
        else:
            raise WireError(f"field {field}: unsupported wire type {wt}")


class WireTensor:
    """A decoded Tensor: dtype, shape, and where its data is in the decoded buffer."""

    __slots__ = ("dtype", "shape", "offset", "nbytes", "region")

    def __init__(self):
        self.dtype = 0
        self.shape = ()
        self.offset = 0
        self.nbytes = 0
        self.region = None

    def __repr__(self):
        return (f"WireTensor(dtype={self.dtype}, shape={self.shape}, offset={self.offset}, "
                f"nbytes={self.nbytes})")


def _tensor(buf, start, end):
    t = WireTensor()
    shape = []
    pos = start
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        field, wt = key >> 3, key & 7
        if wt == _VARINT:
            v, pos = _read_varint(buf, pos, end)
            if field == 1:
                t.dtype = v
            elif field == 2:  # an unpacked shape
                shape.append(v)
        elif wt == _LEN:
            n, pos = _read_varint(buf, pos, end)
            s, e = pos, pos + n
            if e > end:
                raise WireError(f"tensor field {field}: length {n} past the end")
            pos = e
            if field == 3:
                t.offset, t.nbytes = s, n
            elif field == 2:  # packed
                shape = []
                p = s
                while p < e:
                    d, p = _read_varint(buf, p, e)
                    shape.append(d)
            elif field == 4:
                t.region = bytes(buf[s:e])
        elif wt == _I64:
            pos += 8
        elif wt == _I32:
            pos += 4
        else:
            raise WireError(f"tensor field {field}: unsupported wire type {wt}")
    if pos > end:
        raise WireError("tensor: truncated")
    t.shape = tuple(d - (1 << 64) if d >= 1 << 63 else d for d in shape)
    return t


# StageTimings' fields by number (moeserve.v1): the names of a reply's timings dict.
TIMING_NAMES = ("queue_us", "prepare_us", "experts_us", "finalize_us", "total_us", "route_us",
                "engine_us", "input_us", "host_stage_us", "host_launch_us", "host_collect_us",
                "host_timer_us")
_TIMING_NAMES = {i + 1: name for i, name in enumerate(TIMING_NAMES)}


def timing_flags(return_timings):
    """(return_timings, return_host_timings) of ForwardRequest for a client's return_timings
    argument: True, "host" or False (see forward_request); ValueError for any other string."""
    if isinstance(return_timings, str) and return_timings != "host":
        raise ValueError(f'return_timings={return_timings!r}; expected True, False or "host"')
    host = return_timings == "host"
    return bool(return_timings) and not host, host


class ForwardReply:
    """A decoded ForwardResponse; tensors refer to offsets in `buffer`."""

    __slots__ = ("buffer", "output", "request_id", "timings", "topk_ids", "topk_weights",
                 "error_code", "error_message")

    def __init__(self, buffer):
        self.buffer = buffer
        self.output = None
        self.request_id = ""
        self.timings = None
        self.topk_ids = None
        self.topk_weights = None
        self.error_code = 0
        self.error_message = ""


def forward_response(buf):
    """Decodes a serialized ForwardResponse (bytes-like). Raises WireError if malformed."""
    reply = ForwardReply(buf)
    mv = buf if isinstance(buf, bytes) else memoryview(buf)
    end = len(mv)
    pos = 0
    # A plain loop (no generator): this runs once per call, on the critical path.
    while pos < end:
        key = mv[pos]
        if key < 0x80:
            pos += 1
        else:
            key, pos = _read_varint(mv, pos, end)
        field, wt = key >> 3, key & 7
        if wt == _LEN:
            n = mv[pos] if pos < end else 0x80
            if n < 0x80:
                pos += 1
            else:
                n, pos = _read_varint(mv, pos, end)
            s, e = pos, pos + n
            if e > end:
                raise WireError(f"field {field}: length {n} past the end")
            pos = e
            if field == 1:
                reply.output = _tensor(mv, s, e)
            elif field == 2:
                reply.request_id = bytes(mv[s:e]).decode()
            elif field == 3:
                timings = {}
                for f, w, _, ts, _ in _fields(mv, s, e):
                    if w == _I64 and f in _TIMING_NAMES:
                        timings[_TIMING_NAMES[f]] = struct.unpack_from("<d", mv, ts)[0]
                reply.timings = timings
            elif field == 4:
                reply.topk_ids = _tensor(mv, s, e)
            elif field == 5:
                reply.topk_weights = _tensor(mv, s, e)
            elif field == 7:
                reply.error_message = bytes(mv[s:e]).decode()
        elif wt == _VARINT:
            v, pos = _read_varint(mv, pos, end)
            if field == 6:
                reply.error_code = v - (1 << 64) if v >= 1 << 63 else v
        elif wt == _I64:
            pos += 8
        elif wt == _I32:
            pos += 4
        else:
            raise WireError(f"field {field}: unsupported wire type {wt}")
        if pos > end:
            raise WireError(f"field {field}: truncated")
    return reply
