#include "moeserve/v1/forward_wire.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace moeserve::v1wire {

namespace {

constexpr int kVarint = 0, kFixed64 = 1, kLen = 2, kStartGroup = 3, kEndGroup = 4, kFixed32 = 5;
// protobuf's default recursion limit (nested messages and groups).
constexpr int kMaxDepth = 100;
constexpr absl::string_view kTooDeep = "groups nested too deeply";
// protobuf refuses lengths this close to 2 GiB (ParseContext::kSlopBytes of headroom).
constexpr uint32_t kMaxLen = INT32_MAX - 16;

// A position in a list of byte spans.
struct Cursor {
  size_t piece = 0;   // index into the spans
  size_t offset = 0;  // within that span
  size_t pos = 0;     // absolute
};

// Reads protobuf wire-format primitives across span boundaries. Every read is bounded by an
// absolute `end` the caller passes; a failed read returns false and leaves the cursor anywhere.
class Reader {
 public:
  explicit Reader(const std::vector<grpc::Slice>& slices) {
    for (const grpc::Slice& s : slices) {
      if (s.size() == 0) continue;
      spans_.emplace_back(s.begin(), s.size());
      size_ += s.size();
    }
  }
  size_t size() const { return size_; }

  bool ReadByte(Cursor* c, size_t end, uint8_t* b) const {
    if (c->pos >= end) return false;
    *b = spans_[c->piece][c->offset];
    Advance(c, 1);
    return true;
  }
  bool Skip(Cursor* c, size_t end, size_t n) const {
    if (n > end - c->pos) return false;
    Advance(c, n);
    return true;
  }
  // Varint of at most `max_bytes` bytes; bits past 64 are dropped, as protobuf does.
  bool ReadVarint(Cursor* c, size_t end, int max_bytes, uint64_t* v) const {
    *v = 0;
    for (int i = 0; i < max_bytes; ++i) {
      uint8_t b;
      if (!ReadByte(c, end, &b)) return false;
      if (i < 10) *v |= static_cast<uint64_t>(b & 0x7f) << (7 * i);
      if (b < 0x80) return true;
    }
    return false;
  }
  // A length prefix: at most 5 bytes, below 2 GiB less protobuf's headroom.
  bool ReadLength(Cursor* c, size_t end, size_t* len) const {
    uint64_t v;
    if (!ReadVarint(c, end, 5, &v)) return false;
    if (v > kMaxLen) return false;
    *len = static_cast<size_t>(v);
    return true;
  }
  // Spans covering [c, c + n); requires c + n <= size().
  void Pieces(Cursor c, size_t n, std::vector<absl::Span<const uint8_t>>* out) const {
    out->clear();
    while (n > 0) {
      const size_t take = std::min(n, spans_[c.piece].size() - c.offset);
      out->emplace_back(spans_[c.piece].data() + c.offset, take);
      Advance(&c, take);
      n -= take;
    }
  }
  void AppendTo(Cursor c, size_t n, std::string* out) const {
    std::vector<absl::Span<const uint8_t>> pieces;
    Pieces(c, n, &pieces);
    for (auto p : pieces) out->append(reinterpret_cast<const char*>(p.data()), p.size());
  }

 private:
  void Advance(Cursor* c, size_t n) const {
    c->pos += n;
    c->offset += n;
    while (c->piece < spans_.size() && c->offset >= spans_[c->piece].size()) {
      c->offset -= spans_[c->piece].size();
      ++c->piece;
    }
  }

  std::vector<absl::Span<const uint8_t>> spans_;
  size_t size_ = 0;
};

absl::Status Malformed(absl::string_view message, absl::string_view what, size_t pos) {
  return absl::InvalidArgumentError(
      absl::StrCat("malformed ", message, ": ", what, " at byte ", pos));
}

// Reads a tag: at most 5 bytes, kept modulo 2^32 (protobuf's ReadTag).
bool ReadTag(const Reader& r, Cursor* c, size_t end, uint32_t* tag) {
  uint64_t v;
  if (!r.ReadVarint(c, end, 5, &v)) return false;
  *tag = static_cast<uint32_t>(v);
  return true;
}

// Skips the value of a field whose tag was just read (groups through their end tag).
absl::Status SkipValue(const Reader& r, Cursor* c, size_t end, uint32_t tag, int depth,
                       absl::string_view message) {
  const size_t at = c->pos;
  switch (tag & 7) {
    case kVarint: {
      uint64_t v;
      if (!r.ReadVarint(c, end, 10, &v)) return Malformed(message, "bad or truncated varint", at);
      return absl::OkStatus();
    }
    case kFixed64:
      if (!r.Skip(c, end, 8)) return Malformed(message, "truncated fixed64", at);
      return absl::OkStatus();
    case kFixed32:
      if (!r.Skip(c, end, 4)) return Malformed(message, "truncated fixed32", at);
      return absl::OkStatus();
    case kLen: {
      size_t len;
      if (!r.ReadLength(c, end, &len)) return Malformed(message, "bad length", at);
      if (!r.Skip(c, end, len)) return Malformed(message, "length past the end", at);
      return absl::OkStatus();
    }
    case kStartGroup: {
      if (depth - 1 < 0) return Malformed(message, kTooDeep, at);
      while (true) {
        const size_t tag_at = c->pos;
        uint32_t inner;
        if (!ReadTag(r, c, end, &inner)) return Malformed(message, "unterminated group", tag_at);
        if ((inner >> 3) == 0) return Malformed(message, "field number 0", tag_at);
        if ((inner & 7) == kEndGroup) {
          if (inner != tag + 1) return Malformed(message, "mismatched end-group", tag_at);
          return absl::OkStatus();
        }
        if (absl::Status s = SkipValue(r, c, end, inner, depth - 1, message); !s.ok()) return s;
      }
    }
    default:
      return Malformed(message, absl::StrCat("invalid wire type ", tag & 7), at);
  }
}

// RFC 3629 UTF-8 (no overlong forms, surrogates or code points past U+10FFFF), as protobuf
// checks proto3 strings; the index of the first bad byte, or -1.
int64_t FirstInvalidUtf8(absl::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const uint8_t b = p[i];
    if (b < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint8_t lo = 0x80, hi = 0xbf;  // the allowed range of the second byte
    if (b >= 0xc2 && b <= 0xdf) {
      len = 2;
    } else if (b >= 0xe0 && b <= 0xef) {
      len = 3;
      if (b == 0xe0) lo = 0xa0;  // overlong
      if (b == 0xed) hi = 0x9f;  // surrogates
    } else if (b >= 0xf0 && b <= 0xf4) {
      len = 4;
      if (b == 0xf0) lo = 0x90;  // overlong
      if (b == 0xf4) hi = 0x8f;  // past U+10FFFF
    } else {
      return static_cast<int64_t>(i);
    }
    if (n - i < len || p[i + 1] < lo || p[i + 1] > hi) return static_cast<int64_t>(i);
    for (size_t k = 2; k < len; ++k) {
      if (p[i + k] < 0x80 || p[i + k] > 0xbf) return static_cast<int64_t>(i);
    }
    i += len;
  }
  return -1;
}

// Checks the value of field `number` whose tag was just read (the cursor is at the value)
// beyond what protobuf's parser checks: an int32 field (`int32_fields`) given as a varint must
// fit int32 (protobuf would keep the low 32 bits: a layer of 2^40 would read as 0), and a
// string field (`string_fields`) must be UTF-8, checked here so that protobuf does not log an
// error line for every such call. A value that is malformed otherwise is left to SkipValue.
absl::Status CheckField(const Reader& r, Cursor c, size_t end, uint32_t tag,
                        absl::Span<const uint32_t> int32_fields,
                        absl::Span<const uint32_t> string_fields, absl::string_view field_prefix,
                        absl::string_view message) {
  const uint32_t number = tag >> 3;
  const auto has = [number](absl::Span<const uint32_t> list) {
    return std::find(list.begin(), list.end(), number) != list.end();
  };
  if ((tag & 7) == kVarint && has(int32_fields)) {
    const size_t at = c.pos;
    uint64_t v;
    if (!r.ReadVarint(&c, end, 10, &v)) return absl::OkStatus();
    const int64_t value = static_cast<int64_t>(v);  // negative int32s come sign-extended
    if (value < INT32_MIN || value > INT32_MAX) {
      return Malformed(message,
                       absl::StrCat(field_prefix, "field ", number, " is ", value,
                                    ", which does not fit its type int32"),
                       at);
    }
  } else if ((tag & 7) == kLen && has(string_fields)) {
    const size_t at = c.pos;
    size_t len;
    if (!r.ReadLength(&c, end, &len) || len > end - c.pos) return absl::OkStatus();
    std::string text;
    r.AppendTo(c, len, &text);
    if (const int64_t bad = FirstInvalidUtf8(text); bad >= 0) {
      return Malformed(message,
                       absl::StrCat(field_prefix, "string field ", number,
                                    " is not valid UTF-8 (byte ", bad, " of ", len, ")"),
                       at);
    }
  }
  return absl::OkStatus();
}

// Checks a RegionRef submessage (field `tag` just read, the cursor at its length; `name` says
// which, e.g. "output_region"): its name (1) must be UTF-8, as CheckField checks top-level
// strings, and its tags must read (refused naming the field: protobuf's parser would only say
// the message is malformed). Values that do not skip are left to SkipValue and protobuf.
absl::Status CheckRegionRef(const Reader& r, Cursor c, size_t end, uint32_t tag,
                            absl::string_view name, absl::string_view message) {
  if ((tag & 7) != kLen) return absl::OkStatus();
  size_t len;
  if (!r.ReadLength(&c, end, &len) || len > end - c.pos) return absl::OkStatus();
  const size_t sub_end = c.pos + len;
  const std::string prefix = absl::StrCat(name, ", a RegionRef: ");
  while (c.pos < sub_end) {
    const size_t tag_at = c.pos;
    uint32_t sub_tag;
    if (!ReadTag(r, &c, sub_end, &sub_tag)) {
      return Malformed(message, absl::StrCat(prefix, "bad tag"), tag_at);
    }
    if ((sub_tag >> 3) == 0 || (sub_tag & 7) == kEndGroup) {
      return Malformed(message, absl::StrCat(prefix, "field number 0 or unmatched end-group"),
                       tag_at);
    }
    if (absl::Status s = CheckField(r, c, sub_end, sub_tag, {}, {1}, prefix, message); !s.ok()) {
      return s;
    }
    const Cursor value = c;
    if (absl::Status skipped = SkipValue(r, &c, sub_end, sub_tag, kMaxDepth - 2, message);
        !skipped.ok()) {
      // Nesting alone is protobuf's to judge (its own depth count); anything else is named here.
      if (absl::StrContains(skipped.message(), kTooDeep)) return absl::OkStatus();
      return Malformed(message, absl::StrCat(prefix, "bad value of field ", sub_tag >> 3),
                       value.pos);
    }
  }
  return absl::OkStatus();
}

// Walks one Tensor submessage in [c, end): data pieces replace `out`'s (last one wins); dtype
// and shape fields are appended raw to `rest` for protobuf to parse; unknown fields are checked
// and skipped.
absl::Status WalkTensor(const Reader& r, Cursor* c, size_t end, int depth, WireTensor* out,
                        std::string* rest, absl::string_view message) {
  if (depth < 0) return Malformed(message, "messages nested too deeply", c->pos);
  while (c->pos < end) {
    const Cursor field = *c;
    uint32_t tag;
    if (!ReadTag(r, c, end, &tag)) return Malformed(message, "bad tag", field.pos);
    if ((tag >> 3) == 0 || (tag & 7) == kEndGroup) {
      return Malformed(message, "field number 0 or unmatched end-group", field.pos);
    }
    const uint32_t number = tag >> 3;
    // Tensor.dtype is an enum, an int32 on the wire.
    if (absl::Status s = CheckField(r, *c, end, tag, {1}, {}, "tensor ", message); !s.ok()) {
      return s;
    }
    if (number == 4) {  // region: a RegionRef
      if (absl::Status s = CheckRegionRef(r, *c, end, tag, "tensor region", message); !s.ok()) {
        return s;
      }
    }
    if (number == 3 && (tag & 7) == kLen) {
      const size_t len_at = c->pos;
      size_t len;
      if (!r.ReadLength(c, end, &len)) return Malformed(message, "bad length", len_at);
      if (len > end - c->pos) return Malformed(message, "length past the end", len_at);
      r.Pieces(*c, len, &out->data);
      out->data_size = len;
      r.Skip(c, end, len);
      continue;
    }
    if (absl::Status s = SkipValue(r, c, end, tag, depth, message); !s.ok()) return s;
    if (number >= 1 && number <= 4) r.AppendTo(field, c->pos - field.pos, rest);
  }
  return absl::OkStatus();
}

// Reads the varints of a contiguous field list (the `rest` strings below) for the parsers of
// the common headers, which give up (false) on anything but what protobuf's parser would read
// the same way.
struct FlatReader {
  const uint8_t* p;
  size_t n;
  size_t i = 0;
  explicit FlatReader(absl::string_view s)
      : p(reinterpret_cast<const uint8_t*>(s.data())), n(s.size()) {}
  bool done() const { return i >= n; }
  bool Varint(uint64_t* v) {
    *v = 0;
    for (int k = 0; k < 10 && i < n; ++k) {
      const uint8_t b = p[i++];
      *v |= static_cast<uint64_t>(b & 0x7f) << (7 * k);
      if (b < 0x80) return true;
    }
    return false;
  }
  bool Length(size_t* len) {
    uint64_t v;
    if (!Varint(&v) || v > n - i) return false;
    *len = static_cast<size_t>(v);
    return true;
  }
  // A reader of the next `len` bytes (a length just read), which this one skips.
  FlatReader Sub(size_t len) {
    FlatReader sub(absl::string_view(reinterpret_cast<const char*>(p + i), len));
    i += len;
    return sub;
  }
};

// protobuf's parse of a ForwardRequest's header fields when they are only layer, request_id,
// return_timings, return_routing and return_host_timings in their own wire types (every request
// without an output_region): no parser tables, no allocation beyond the id. WalkTop has checked
// that layer fits int32 and that request_id is UTF-8. False: parse with protobuf instead (it clears
// the message first, so the fields set here before giving up do not matter).
bool ParseCommonRequestHeader(absl::string_view rest, v1::ForwardRequest* out) {
  FlatReader r(rest);
  while (!r.done()) {
    uint64_t tag;
    if (!r.Varint(&tag)) return false;
    uint64_t v;
    size_t len;
    switch (tag) {
      case (1 << 3) | kVarint:
        if (!r.Varint(&v)) return false;
        out->set_layer(static_cast<int32_t>(v));
        break;
      case (5 << 3) | kLen:
        if (!r.Length(&len)) return false;
        out->set_request_id(reinterpret_cast<const char*>(r.p + r.i), len);
        r.i += len;
        break;
      case (6 << 3) | kVarint:
        if (!r.Varint(&v)) return false;
        out->set_return_timings(v != 0);
        break;
      case (8 << 3) | kVarint:
        if (!r.Varint(&v)) return false;
        out->set_return_routing(v != 0);
        break;
      case (9 << 3) | kVarint:
        if (!r.Varint(&v)) return false;
        out->set_return_host_timings(v != 0);
        break;
      default:
        return false;
    }
  }
  return true;
}

// The same for a Tensor header with only dtype (a known DType) and shape (packed or not).
bool ParseCommonTensorHeader(absl::string_view rest, v1::Tensor* out) {
  FlatReader r(rest);
  while (!r.done()) {
    uint64_t tag;
    if (!r.Varint(&tag)) return false;
    uint64_t v;
    size_t len;
    switch (tag) {
      case (1 << 3) | kVarint: {
        if (!r.Varint(&v)) return false;
        const int32_t dtype = static_cast<int32_t>(v);
        if (!v1::DType_IsValid(dtype)) return false;
        out->set_dtype(static_cast<v1::DType>(dtype));
        break;
      }
      case (2 << 3) | kVarint:
        if (!r.Varint(&v)) return false;
        out->add_shape(static_cast<int64_t>(v));
        break;
      case (2 << 3) | kLen: {
        if (!r.Length(&len)) return false;
        FlatReader packed = r.Sub(len);
        while (!packed.done()) {
          if (!packed.Varint(&v)) return false;
          out->add_shape(static_cast<int64_t>(v));
        }
        break;
      }
      default:
        return false;
    }
  }
  return true;
}

// The shape entries (field 2, packed or not) of a Tensor header, counted without storing them;
// -1 where the header does not walk as flat fields (the parsers then decide).
int64_t CountShapeDims(absl::string_view rest) {
  FlatReader r(rest);
  int64_t dims = 0;
  while (!r.done()) {
    uint64_t tag, v;
    size_t len;
    if (!r.Varint(&tag)) return -1;
    switch (tag & 7) {
      case kVarint:
        if (!r.Varint(&v)) return -1;
        if ((tag >> 3) == 2) ++dims;
        break;
      case kLen: {
        if (!r.Length(&len)) return -1;
        FlatReader sub = r.Sub(len);
        if ((tag >> 3) != 2) break;
        while (!sub.done()) {
          if (!sub.Varint(&v)) return -1;
          ++dims;
        }
        break;
      }
      case kFixed64:
      case kFixed32: {
        const size_t skip = (tag & 7) == kFixed64 ? 8 : 4;
        if (r.n - r.i < skip) return -1;
        r.i += skip;
        break;
      }
      default:
        return -1;
    }
  }
  return dims;
}

// Walks a top-level message: LEN fields numbered in `tensor_numbers` are tensors (walked into
// `tensors`), fields numbered up to `max_known` are appended raw to `rest`, others skipped.
// int32_fields / string_fields / region_fields (RegionRef submessages, by number and the name
// their errors give) are checked as
// CheckField and CheckRegionRef say.
absl::Status WalkTop(const Reader& r, absl::Span<const uint32_t> tensor_numbers,
                     absl::Span<WireTensor* const> tensors, uint32_t max_known,
                     absl::Span<const uint32_t> int32_fields,
                     absl::Span<const uint32_t> string_fields,
                     absl::Span<const std::pair<uint32_t, absl::string_view>> region_fields,
                     std::string* rest, std::vector<std::string>* tensor_rests,
                     absl::string_view message,
                     absl::Span<const uint32_t> checked_tensor_fields = {}) {
  Cursor c;
  const size_t end = r.size();
  tensor_rests->assign(tensors.size(), std::string());
  while (c.pos < end) {
    const Cursor field = c;
    uint32_t tag;
    if (!ReadTag(r, &c, end, &tag)) return Malformed(message, "bad tag", field.pos);
    if ((tag >> 3) == 0 || (tag & 7) == kEndGroup) {
      return Malformed(message, "field number 0 or unmatched end-group", field.pos);
    }
    const uint32_t number = tag >> 3;
    if (absl::Status s = CheckField(r, c, end, tag, int32_fields, string_fields, "", message);
        !s.ok()) {
      return s;
    }
    for (const auto& [region_number, name] : region_fields) {
      if (region_number != number) continue;
      if (absl::Status s = CheckRegionRef(r, c, end, tag, name, message); !s.ok()) return s;
    }
    if ((tag & 7) == kLen && std::find(checked_tensor_fields.begin(), checked_tensor_fields.end(),
                                       number) != checked_tensor_fields.end()) {
      // A Tensor left to protobuf whole (kept in `rest`): its dtype and region checked as a
      // walked tensor's are, the walk's outputs dropped.
      Cursor sub = c;
      size_t len;
      if (r.ReadLength(&sub, end, &len) && len <= end - sub.pos) {
        WireTensor scratch;
        std::string scratch_rest;
        if (absl::Status s =
                WalkTensor(r, &sub, sub.pos + len, kMaxDepth - 1, &scratch, &scratch_rest, message);
            !s.ok()) {
          return s;
        }
      }
    }
    if ((tag & 7) == kLen) {
      auto it = std::find(tensor_numbers.begin(), tensor_numbers.end(), number);
      if (it != tensor_numbers.end()) {
        const size_t i = static_cast<size_t>(it - tensor_numbers.begin());
        const size_t len_at = c.pos;
        size_t len;
        if (!r.ReadLength(&c, end, &len)) return Malformed(message, "bad length", len_at);
        if (len > end - c.pos) return Malformed(message, "length past the end", len_at);
        tensors[i]->present = true;
        if (absl::Status s = WalkTensor(r, &c, c.pos + len, kMaxDepth - 1, tensors[i],
                                        &(*tensor_rests)[i], message);
            !s.ok()) {
          return s;
        }
        continue;
      }
    }
    if (absl::Status s = SkipValue(r, &c, end, tag, kMaxDepth, message); !s.ok()) return s;
    if (number >= 1 && number <= max_known) r.AppendTo(field, c.pos - field.pos, rest);
  }
  return absl::OkStatus();
}

void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// Appends tensor field `number` (header plus data taken from `data`) to the buffer being built:
// framing goes to `head`, which is flushed into `slices` before the data slice.
absl::Status AppendTensor(uint32_t number, const v1::Tensor& header, const grpc::Slice& data,
                          absl::string_view field, std::string* head,
                          std::vector<grpc::Slice>* slices) {
  if (!header.data().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": the header's data must be empty (the bytes come as a slice)"));
  }
  const std::string fields = header.SerializeAsString();
  const size_t n = data.size();
  const uint64_t data_field = n > 0 ? 1 + VarintSize(n) + n : 0;
  const uint64_t inner = fields.size() + data_field;
  if (n > kMaxLen || inner > kMaxLen) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", n, " data bytes exceed protobuf's 2 GiB limit"));
  }
  AppendVarint((number << 3) | kLen, head);
  AppendVarint(inner, head);
  head->append(fields);
  if (n == 0) return absl::OkStatus();
  AppendVarint((3 << 3) | kLen, head);
  AppendVarint(n, head);
  slices->push_back(SliceFromString(std::move(*head)));
  head->clear();
  slices->push_back(data);
  return absl::OkStatus();
}

grpc::ByteBuffer Finish(std::string head, std::vector<grpc::Slice> slices) {
  if (!head.empty()) slices.push_back(SliceFromString(std::move(head)));
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::vector<grpc::Slice> DumpSlices(const grpc::ByteBuffer& buffer, bool* ok) {
  std::vector<grpc::Slice> slices;
  // An empty (or never written) buffer is a valid, empty message.
  *ok = !buffer.Valid() || buffer.Dump(&slices).ok();
  return slices;
}

// Pieces of one field's data: as one span if there is at most one piece (else false, *out
// untouched), or copied in order to `dst`.
bool PiecesAsOne(const std::vector<absl::Span<const uint8_t>>& pieces,
                 absl::Span<const uint8_t>* out) {
  if (pieces.size() > 1) return false;
  *out = pieces.empty() ? absl::Span<const uint8_t>() : pieces[0];
  return true;
}

void CopyPieces(const std::vector<absl::Span<const uint8_t>>& pieces, void* dst) {
  auto* p = static_cast<uint8_t*>(dst);
  for (auto piece : pieces) {
    std::memcpy(p, piece.data(), piece.size());
    p += piece.size();
  }
}

}  // namespace

bool WireBytes::SinglePiece(absl::Span<const uint8_t>* out) const { return PiecesAsOne(data, out); }

void WireBytes::CopyTo(void* dst) const { CopyPieces(data, dst); }

absl::StatusOr<SplitMessage> SplitBytesField(const grpc::ByteBuffer& buffer, uint32_t number,
                                             absl::string_view message) {
  SplitMessage split;
  bool ok;
  split.slices = DumpSlices(buffer, &ok);
  if (!ok) return absl::InternalError("could not read the message's byte buffer");
  const Reader r(split.slices);
  Cursor c;
  const size_t end = r.size();
  while (c.pos < end) {
    const Cursor field = c;
    uint32_t tag;
    if (!ReadTag(r, &c, end, &tag)) return Malformed(message, "bad tag", field.pos);
    if ((tag >> 3) == 0 || (tag & 7) == kEndGroup) {
      return Malformed(message, "field number 0 or unmatched end-group", field.pos);
    }
    if ((tag >> 3) == number && (tag & 7) == kLen) {
      const size_t len_at = c.pos;
      size_t len;
      if (!r.ReadLength(&c, end, &len)) return Malformed(message, "bad length", len_at);
      if (len > end - c.pos) return Malformed(message, "length past the end", len_at);
      WireBytes bytes;
      r.Pieces(c, len, &bytes.data);
      bytes.size = len;
      r.Skip(&c, end, len);
      split.occurrences.push_back(std::move(bytes));
      continue;
    }
    if (absl::Status s = SkipValue(r, &c, end, tag, kMaxDepth, message); !s.ok()) return s;
    r.AppendTo(field, c.pos - field.pos, &split.rest);
  }
  return split;
}

absl::StatusOr<grpc::ByteBuffer> EncodeWithBytesField(std::string head, uint32_t number,
                                                      const std::vector<grpc::Slice>& data) {
  std::vector<grpc::Slice> slices;
  for (const grpc::Slice& d : data) {
    if (d.size() > kMaxLen) {
      return absl::InvalidArgumentError(
          absl::StrCat("field ", number, ": ", d.size(), " bytes exceed protobuf's 2 GiB limit"));
    }
    AppendVarint((number << 3) | kLen, &head);
    AppendVarint(d.size(), &head);
    if (d.size() == 0) continue;
    slices.push_back(SliceFromString(std::move(head)));
    head.clear();
    slices.push_back(d);
  }
  return Finish(std::move(head), std::move(slices));
}

bool WireTensor::SinglePiece(absl::Span<const uint8_t>* out) const {
  return PiecesAsOne(data, out);
}

void WireTensor::CopyTo(void* dst) const { CopyPieces(data, dst); }

absl::StatusOr<ForwardRequestView> DecodeForwardRequest(std::vector<grpc::Slice> slices) {
  constexpr absl::string_view kMessage = "moeserve.v1.ForwardRequest";
  ForwardRequestView view;
  view.slices = std::move(slices);
  const Reader reader(view.slices);
  std::string rest;
  std::vector<std::string> tensor_rests;
  const uint32_t numbers[] = {2, 3, 4};
  WireTensor* const tensors[] = {&view.hidden_states, &view.topk_ids, &view.topk_weights};
  // layer (1) is an int32; request_id (5) a string; output_region (7) a RegionRef; fields up to
  // 9 (return_host_timings, the last) are the header's, kept for the parse below.
  const std::pair<uint32_t, absl::string_view> regions[] = {{7, "output_region (field 7)"}};
  if (absl::Status s =
          WalkTop(reader, numbers, tensors, 9, {1}, {5}, regions, &rest, &tensor_rests, kMessage);
      !s.ok()) {
    return s;
  }
  if (!ParseCommonRequestHeader(rest, &view.header) && !view.header.ParseFromString(rest)) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed ", kMessage, ": bad layer, request_id (UTF-8) or return_timings"));
  }
  for (size_t i = 0; i < 3; ++i) {
    // Before anything stores the dims: a header of a few bytes per dim must not become an
    // int64 per dim (and a message listing them) for a rank the service never takes.
    if (const int64_t dims = CountShapeDims(tensor_rests[i]); dims > kMaxTensorDims) {
      return absl::InvalidArgumentError(absl::StrCat(kMessage, ": tensor field ", i + 2,
                                                     " has a shape of ", dims, " dims; at most ",
                                                     kMaxTensorDims));
    }
    if (!ParseCommonTensorHeader(tensor_rests[i], &tensors[i]->header) &&
        !tensors[i]->header.ParseFromString(tensor_rests[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("malformed ", kMessage, ": bad dtype or shape in tensor field ", i + 2));
    }
  }
  return view;
}

absl::StatusOr<ForwardResponseView> DecodeForwardResponse(std::vector<grpc::Slice> slices) {
  constexpr absl::string_view kMessage = "moeserve.v1.ForwardResponse";
  ForwardResponseView view;
  view.slices = std::move(slices);
  const Reader reader(view.slices);
  std::string rest;
  std::vector<std::string> tensor_rests;
  const uint32_t numbers[] = {1};
  WireTensor* const tensors[] = {&view.output};
  // error_code (6) is an int32; request_id (2) and error_message (7) are strings; topk_ids (4)
  // and topk_weights (5) are tensors that protobuf parses (their dtype checked here).
  if (absl::Status s = WalkTop(reader, numbers, tensors, 7, {6}, {2, 7}, {}, &rest, &tensor_rests,
                               kMessage, {4, 5});
      !s.ok()) {
    return s;
  }
  if (!view.header.ParseFromString(rest)) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed ", kMessage, ": bad request_id (UTF-8) or timings"));
  }
  if (!view.output.header.ParseFromString(tensor_rests[0])) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed ", kMessage, ": bad dtype or shape in output"));
  }
  return view;
}

absl::StatusOr<ForwardRequestView> DecodeForwardRequest(const grpc::ByteBuffer& buffer) {
  bool ok;
  std::vector<grpc::Slice> slices = DumpSlices(buffer, &ok);
  if (!ok) return absl::InternalError("could not read the request's byte buffer");
  return DecodeForwardRequest(std::move(slices));
}

absl::StatusOr<ForwardResponseView> DecodeForwardResponse(const grpc::ByteBuffer& buffer) {
  bool ok;
  std::vector<grpc::Slice> slices = DumpSlices(buffer, &ok);
  if (!ok) return absl::InternalError("could not read the response's byte buffer");
  return DecodeForwardResponse(std::move(slices));
}

absl::StatusOr<grpc::ByteBuffer> EncodeForwardRequest(const v1::ForwardRequest& header,
                                                      const grpc::Slice& hidden_states_data,
                                                      const grpc::Slice& topk_ids_data,
                                                      const grpc::Slice& topk_weights_data) {
  v1::ForwardRequest top = header;
  top.clear_hidden_states();
  top.clear_topk_ids();
  top.clear_topk_weights();
  std::string head = top.SerializeAsString();
  std::vector<grpc::Slice> slices;
  const struct {
    uint32_t number;
    bool has;
    const v1::Tensor& tensor;
    const grpc::Slice& data;
    absl::string_view name;
  } fields[] = {
      {2, header.has_hidden_states(), header.hidden_states(), hidden_states_data, "hidden_states"},
      {3, header.has_topk_ids(), header.topk_ids(), topk_ids_data, "topk_ids"},
      {4, header.has_topk_weights(), header.topk_weights(), topk_weights_data, "topk_weights"},
  };
  for (const auto& f : fields) {
    if (!f.has && f.data.size() == 0) continue;
    if (absl::Status s = AppendTensor(f.number, f.tensor, f.data, f.name, &head, &slices);
        !s.ok()) {
      return s;
    }
  }
  return Finish(std::move(head), std::move(slices));
}

absl::StatusOr<grpc::ByteBuffer> EncodeForwardResponse(const v1::ForwardResponse& header,
                                                       const grpc::Slice& output_data) {
  v1::ForwardResponse top = header;
  top.clear_output();
  std::string head = top.SerializeAsString();
  std::vector<grpc::Slice> slices;
  if (header.has_output() || output_data.size() > 0) {
    if (absl::Status s = AppendTensor(1, header.output(), output_data, "output", &head, &slices);
        !s.ok()) {
      return s;
    }
  }
  return Finish(std::move(head), std::move(slices));
}

grpc::Slice SliceFromString(std::string bytes) {
  if (bytes.empty()) return grpc::Slice();
  auto owner = std::make_unique<std::string>(std::move(bytes));
  void* data = owner->data();
  const size_t size = owner->size();
  return SliceOwning(data, size, std::move(owner));
}

}  // namespace moeserve::v1wire
