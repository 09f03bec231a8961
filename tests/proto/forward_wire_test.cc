// forward_wire against protobuf's own serializer and parser: round trips, every slicing of the
// bytes, packed/unpacked shapes, merged submessages, unknown fields, and a fuzz loop in which the
// decoder must agree with protobuf on accept/reject and on every field.
#include "moeserve/v1/forward_wire.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/stubs/common.h>
#include <google/protobuf/unknown_field_set.h>
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace moeserve::v1wire {
namespace {

using google::protobuf::util::MessageDifferencer;

std::string Varint(uint64_t v) {
  std::string s;
  while (v >= 0x80) {
    s.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  s.push_back(static_cast<char>(v));
  return s;
}
std::string Tag(uint32_t number, int wire_type) { return Varint((number << 3) | wire_type); }
std::string Len(uint32_t number, const std::string& body) {
  return Tag(number, 2) + Varint(body.size()) + body;
}

// `bytes` cut at the given sizes (the rest in a last slice).
std::vector<grpc::Slice> Split(const std::string& bytes, const std::vector<size_t>& cuts) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (size_t c : cuts) {
    c = std::min(c, bytes.size() - at);
    slices.emplace_back(bytes.data() + at, c);
    at += c;
  }
  slices.emplace_back(bytes.data() + at, bytes.size() - at);
  return slices;
}
std::vector<grpc::Slice> OneByteSlices(const std::string& bytes) {
  return Split(bytes, std::vector<size_t>(bytes.size(), 1));
}
std::vector<grpc::Slice> RandomSplit(const std::string& bytes, std::mt19937_64& rng) {
  std::vector<size_t> cuts;
  size_t total = 0;
  while (total < bytes.size()) {
    const size_t c = std::uniform_int_distribution<size_t>(0, 9)(rng);
    cuts.push_back(c);
    total += c;
  }
  return Split(bytes, cuts);
}

std::string Concat(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

void Fill(const WireTensor& t, v1::Tensor* out) {
  *out = t.header;
  std::string data(t.data_size, '\0');
  t.CopyTo(data.data());
  out->set_data(data);
}

// The decoded view as a protobuf message (unknown fields dropped).
v1::ForwardRequest ToProto(const ForwardRequestView& v) {
  v1::ForwardRequest r = v.header;
  if (v.hidden_states.present) Fill(v.hidden_states, r.mutable_hidden_states());
  if (v.topk_ids.present) Fill(v.topk_ids, r.mutable_topk_ids());
  if (v.topk_weights.present) Fill(v.topk_weights, r.mutable_topk_weights());
  r.DiscardUnknownFields();
  return r;
}
v1::ForwardResponse ToProto(const ForwardResponseView& v) {
  v1::ForwardResponse r = v.header;
  if (v.output.present) Fill(v.output, r.mutable_output());
  r.DiscardUnknownFields();
  return r;
}

std::string Deterministic(const google::protobuf::MessageLite& m) {
  std::string out;
  google::protobuf::io::StringOutputStream stream(&out);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.SetSerializationDeterministic(true);
  m.SerializeToCodedStream(&coded);
  return out;
}

// Equal known fields, bit for bit (so NaN doubles compare equal to themselves).
template <typename M>
bool SameKnownFields(M want, M got) {
  want.DiscardUnknownFields();
  got.DiscardUnknownFields();
  return MessageDifferencer::Equals(want, got) || Deterministic(want) == Deterministic(got);
}

v1::Tensor RandomTensor(std::mt19937_64& rng) {
  v1::Tensor t;
  t.set_dtype(static_cast<v1::DType>(std::uniform_int_distribution<int>(0, 7)(rng)));
  const int rank = std::uniform_int_distribution<int>(0, 3)(rng);
  for (int i = 0; i < rank; ++i) {
    t.add_shape(std::uniform_int_distribution<int64_t>(-3, 300)(rng));
  }
  std::string data(std::uniform_int_distribution<size_t>(0, 200)(rng), '\0');
  for (char& c : data) c = static_cast<char>(rng());
  t.set_data(data);
  return t;
}

v1::ForwardRequest RandomRequest(std::mt19937_64& rng) {
  v1::ForwardRequest r;
  r.set_layer(static_cast<int32_t>(rng()));
  if (rng() % 4) *r.mutable_hidden_states() = RandomTensor(rng);
  if (rng() % 4) *r.mutable_topk_ids() = RandomTensor(rng);
  if (rng() % 4) *r.mutable_topk_weights() = RandomTensor(rng);
  if (rng() % 2) r.set_request_id("req-" + std::to_string(rng() % 1000));
  r.set_return_timings(rng() % 2);
  r.set_return_host_timings(rng() % 2);
  return r;
}

v1::ForwardResponse RandomResponse(std::mt19937_64& rng) {
  v1::ForwardResponse r;
  if (rng() % 4) *r.mutable_output() = RandomTensor(rng);
  if (rng() % 2) r.set_request_id("id-" + std::to_string(rng() % 1000));
  if (rng() % 2) {
    r.mutable_timings()->set_queue_us(static_cast<double>(rng() % 1000) / 7);
    r.mutable_timings()->set_total_us(1.5);
  }
  return r;
}

grpc::Slice DataSlice(const v1::Tensor& t) { return SliceFromString(t.data()); }

grpc::ByteBuffer EncodeWithUs(const v1::ForwardRequest& r) {
  v1::ForwardRequest header = r;
  header.mutable_hidden_states()->clear_data();
  header.mutable_topk_ids()->clear_data();
  header.mutable_topk_weights()->clear_data();
  if (!r.has_hidden_states()) header.clear_hidden_states();
  if (!r.has_topk_ids()) header.clear_topk_ids();
  if (!r.has_topk_weights()) header.clear_topk_weights();
  absl::StatusOr<grpc::ByteBuffer> b = EncodeForwardRequest(
      header, DataSlice(r.hidden_states()), DataSlice(r.topk_ids()), DataSlice(r.topk_weights()));
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? *std::move(b) : grpc::ByteBuffer();
}

TEST(ForwardWireTest, EncodedRequestParsesWithProtobuf) {
  std::mt19937_64 rng(1);
  for (int i = 0; i < 300; ++i) {
    const v1::ForwardRequest r = RandomRequest(rng);
    v1::ForwardRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(Concat(EncodeWithUs(r))));
    ASSERT_TRUE(MessageDifferencer::Equals(r, parsed)) << r.DebugString();
  }
}

TEST(ForwardWireTest, EncodedResponseParsesWithProtobuf) {
  std::mt19937_64 rng(2);
  for (int i = 0; i < 300; ++i) {
    const v1::ForwardResponse r = RandomResponse(rng);
    v1::ForwardResponse header = r;
    header.mutable_output()->clear_data();
    if (!r.has_output()) header.clear_output();
    absl::StatusOr<grpc::ByteBuffer> b = EncodeForwardResponse(header, DataSlice(r.output()));
    ASSERT_TRUE(b.ok()) << b.status();
    v1::ForwardResponse parsed;
    ASSERT_TRUE(parsed.ParseFromString(Concat(*b)));
    ASSERT_TRUE(MessageDifferencer::Equals(r, parsed)) << r.DebugString();
  }
}

TEST(ForwardWireTest, DataIsReferencedNotCopied) {
  v1::ForwardResponse header;
  header.mutable_output()->set_dtype(v1::DTYPE_BF16);
  header.mutable_output()->add_shape(4096);
  std::string data(8192, 'x');
  grpc::Slice slice = SliceFromString(data);
  const uint8_t* where = slice.begin();
  absl::StatusOr<grpc::ByteBuffer> b = EncodeForwardResponse(header, slice);
  ASSERT_TRUE(b.ok());
  absl::StatusOr<ForwardResponseView> v = DecodeForwardResponse(*b);
  ASSERT_TRUE(v.ok()) << v.status();
  absl::Span<const uint8_t> piece;
  ASSERT_TRUE(v->output.SinglePiece(&piece));
  EXPECT_EQ(piece.data(), where);
  EXPECT_EQ(piece.size(), data.size());
}

TEST(ForwardWireTest, EncoderRefusesHeaderData) {
  v1::ForwardRequest header;
  header.mutable_topk_ids()->set_data("abc");
  EXPECT_FALSE(EncodeForwardRequest(header, grpc::Slice(), grpc::Slice(), grpc::Slice()).ok());
}

TEST(ForwardWireTest, ProtobufBytesDecodeAtEverySlicing) {
  std::mt19937_64 rng(3);
  for (int i = 0; i < 40; ++i) {
    const v1::ForwardRequest r = RandomRequest(rng);
    const std::string bytes = r.SerializeAsString();
    for (size_t k = 0; k <= bytes.size(); ++k) {
      absl::StatusOr<ForwardRequestView> v = DecodeForwardRequest(Split(bytes, {k}));
      ASSERT_TRUE(v.ok()) << v.status();
      ASSERT_TRUE(MessageDifferencer::Equals(r, ToProto(*v))) << "cut at " << k;
    }
    absl::StatusOr<ForwardRequestView> v = DecodeForwardRequest(OneByteSlices(bytes));
    ASSERT_TRUE(v.ok()) << v.status();
    ASSERT_TRUE(MessageDifferencer::Equals(r, ToProto(*v)));
    const v1::ForwardResponse resp = RandomResponse(rng);
    absl::StatusOr<ForwardResponseView> rv =
        DecodeForwardResponse(OneByteSlices(resp.SerializeAsString()));
    ASSERT_TRUE(rv.ok()) << rv.status();
    ASSERT_TRUE(MessageDifferencer::Equals(resp, ToProto(*rv)));
  }
}

TEST(ForwardWireTest, EmptyBufferIsEmptyMessage) {
  absl::StatusOr<ForwardRequestView> v = DecodeForwardRequest(grpc::ByteBuffer());
  ASSERT_TRUE(v.ok());
  EXPECT_FALSE(v->hidden_states.present);
  EXPECT_EQ(v->header.layer(), 0);
}

// Hand-written bytes covering what protobuf's serializer never emits.
TEST(ForwardWireTest, PackedUnpackedMergedAndUnknown) {
  const std::string unknown_group =
      Tag(20, 3) + Tag(1, 0) + Varint(5) + Tag(21, 3) + Tag(21, 4) + Tag(20, 4);
  const std::string t1 = Tag(1, 0) + Varint(1) + Tag(2, 0) + Varint(3) +
                         Len(2, Varint(4) + Varint(5)) + Len(3, "abcdef") + Tag(9, 5) + "wxyz" +
                         unknown_group;
  const std::string t2 = Tag(2, 0) + Varint(6) + Tag(9, 1) + "12345678";  // merges, keeps data
  const std::string t3 = Len(3, "Z") + Tag(1, 0) + Varint(3);             // replaces data, dtype
  const std::string bytes = Tag(1, 0) + Varint(7) + Len(2, t1) + Tag(99, 2) + Varint(3) + "???" +
                            Len(2, t2) + Len(5, "first") + Tag(1, 0) + Varint(9) + Len(2, t3) +
                            Len(5, "second") + unknown_group + Tag(6, 0) + Varint(1) + Len(3, "") +
                            Tag(4, 0) + Varint(1);  // topk_weights as a varint
  v1::ForwardRequest want;
  ASSERT_TRUE(want.ParseFromString(bytes));
  ASSERT_EQ(want.hidden_states().shape_size(), 4);  // the test means what it says
  ASSERT_EQ(want.hidden_states().data(), "Z");
  ASSERT_TRUE(want.has_topk_ids());
  ASSERT_FALSE(want.has_topk_weights());
  for (auto slices : {Split(bytes, {}), OneByteSlices(bytes)}) {
    absl::StatusOr<ForwardRequestView> v = DecodeForwardRequest(slices);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_TRUE(SameKnownFields(want, ToProto(*v))) << ToProto(*v).DebugString();
    EXPECT_EQ(v->header.layer(), 9);
    EXPECT_EQ(v->header.request_id(), "second");
    EXPECT_TRUE(v->topk_ids.present);
    EXPECT_FALSE(v->topk_weights.present);
  }
}

// The decoder reads the common header fields itself and leaves the rest to protobuf: both
// routes, and a switch between them within one message, give protobuf's answer.
TEST(ForwardWireTest, CommonHeadersAndTheRestAgreeWithProtobuf) {
  const std::string region = Len(1, "r0") + Tag(2, 0) + Varint(64) + Tag(3, 0) + Varint(16);
  const std::vector<std::string> cases = {
      // The common case: every field the decoder parses itself.
      Tag(1, 0) + Varint(3) + Len(2, Tag(1, 0) + Varint(1) + Len(2, Varint(1) + Varint(7168))) +
          Len(5, "id") + Tag(6, 0) + Varint(1) + Tag(8, 0) + Varint(2),
      // A DType this build does not know (protobuf keeps it: proto3 enums are open).
      Len(2, Tag(1, 0) + Varint(42) + Tag(2, 0) + Varint(5)),
      // Negative layer; a shape varint past int64's sign bit; bools as 10-byte varints.
      Tag(1, 0) + Varint(static_cast<uint64_t>(-5)) +
          Len(3, Tag(2, 0) + Varint(~0ull) + Tag(1, 0) + Varint(4)) + Tag(6, 0) +
          std::string(9, '\x80') + "\x01",
      // output_region and a tensor region: protobuf parses those headers.
      Len(7, region) + Len(4, Tag(1, 0) + Varint(3) + Len(4, region)) + Len(5, "x"),
      // A field of the wrong wire type (layer as fixed32): an unknown field to protobuf.
      Tag(1, 5) + "abcd" + Tag(6, 0) + Varint(1),
      // Empty packed shape, then unpacked dims, then packed again.
      Len(2, Len(2, "") + Tag(2, 0) + Varint(2) + Len(2, Varint(3) + Varint(4))),
  };
  for (const std::string& bytes : cases) {
    v1::ForwardRequest want;
    ASSERT_TRUE(want.ParseFromString(bytes)) << "case " << (&bytes - cases.data());
    absl::StatusOr<ForwardRequestView> v = DecodeForwardRequest(Split(bytes, {}));
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_TRUE(SameKnownFields(want, ToProto(*v)))
        << "case " << (&bytes - cases.data()) << ": " << ToProto(*v).DebugString();
  }
}

TEST(ForwardWireTest, MalformedInputIsRejected) {
  const std::string good = Len(2, Tag(1, 0) + Varint(1) + Len(3, "abcd"));
  const std::vector<std::string> bad = {
      good.substr(0, good.size() - 1),                     // truncated data
      Tag(1, 0) + std::string(10, '\x80') + "\x01",        // 11-byte varint
      Tag(1, 0) + "\x80",                                  // truncated varint
      Tag(2, 2) + Varint(100) + "abc",                     // length past the end
      Len(2, Tag(3, 2) + Varint(50) + "abc"),              // inner length past the submessage
      Tag(7, 4),                                           // end-group without a start
      Tag(7, 3) + Tag(8, 4),                               // mismatched end-group
      Tag(7, 3) + Tag(1, 0) + Varint(1),                   // unterminated group
      Tag(7, 6),                                           // wire type 6
      std::string("\x00", 1),                              // tag 0
      Tag(1, 1) + "1234",                                  // truncated fixed64
      Len(5, "\xff\xfe"),                                  // request_id not UTF-8
      Len(2, Tag(2, 2) + Varint(2) + Varint(1) + "\x80"),  // packed shape ends mid-varint
      Tag(2, 2) + "\xff\xff\xff\xff\x7f",                  // length over 2 GiB
  };
  for (const std::string& b : bad) {
    v1::ForwardRequest pb;
    ASSERT_FALSE(pb.ParseFromString(b)) << "protobuf accepts case " << (&b - bad.data());
    for (auto slices : {Split(b, {}), OneByteSlices(b)}) {
      absl::StatusOr<ForwardRequestView> v = DecodeForwardRequest(slices);
      ASSERT_FALSE(v.ok()) << "case " << (&b - bad.data());
      EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(v.status().message().find("malformed moeserve.v1.ForwardRequest"),
                std::string::npos)
          << v.status();
    }
  }
}

// Random valid messages (some with extra occurrences and unknown fields), then mutated:
// truncations, flipped and inserted bytes, bad varints, lengths past the end.
std::string Mutate(std::string b, std::mt19937_64& rng) {
  const int kind = std::uniform_int_distribution<int>(0, 6)(rng);
  auto pos = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n)(rng); };
  switch (kind) {
    case 0:
      return b;
    case 1:
      return b.substr(0, pos(b.size()));
    case 2:
      if (!b.empty()) b[pos(b.size() - 1)] ^= static_cast<char>(1 << (rng() % 8));
      return b;
    case 3:
      if (!b.empty()) b[pos(b.size() - 1)] = static_cast<char>(rng());
      return b;
    case 4:
      return b.insert(pos(b.size()), std::string(1 + rng() % 11, '\x80'));
    case 5:
      return b.insert(pos(b.size()), Varint(rng() % 300));
    default:
      for (int i = 0; i < 3 && !b.empty(); ++i) b[pos(b.size() - 1)] = static_cast<char>(rng());
      return b;
  }
}

std::string Extras(std::mt19937_64& rng) {
  std::string e;
  switch (rng() % 5) {
    case 0:
      return Tag(50 + rng() % 10, 0) + Varint(rng());
    case 1:
      return Tag(7, 3) + Tag(1, 5) + "abcd" + Tag(7, 4);
    case 2:
      return Len(2, Tag(2, 0) + Varint(rng() % 9) + Len(3, "tail"));
    case 3:
      return Len(1, Len(3, "xy") + Tag(30, 1) + "87654321");
    default:
      return e;
  }
}

// Whether every int32 varint of a message protobuf accepts fits int32 (protobuf keeps the low
// 32 bits; the decoder refuses): ForwardRequest.layer and every Tensor.dtype.
bool Int32FieldsFit(const std::string& bytes, bool request) {
  google::protobuf::UnknownFieldSet top;
  if (!top.ParseFromString(bytes)) return true;
  auto fits = [](const google::protobuf::UnknownField& f) {
    const int64_t v = static_cast<int64_t>(f.varint());
    return v >= INT32_MIN && v <= INT32_MAX;
  };
  for (int i = 0; i < top.field_count(); ++i) {
    const google::protobuf::UnknownField& f = top.field(i);
    if (request && f.number() == 1 && f.type() == google::protobuf::UnknownField::TYPE_VARINT &&
        !fits(f)) {
      return false;
    }
    const bool tensor = request ? (f.number() >= 2 && f.number() <= 4)
                                : (f.number() == 1 || f.number() == 4 || f.number() == 5);
    if (tensor && f.type() == google::protobuf::UnknownField::TYPE_LENGTH_DELIMITED) {
      google::protobuf::UnknownFieldSet inner;
      if (!inner.ParseFromString(f.length_delimited())) continue;
      for (int j = 0; j < inner.field_count(); ++j) {
        const google::protobuf::UnknownField& g = inner.field(j);
        if (g.number() == 1 && g.type() == google::protobuf::UnknownField::TYPE_VARINT &&
            !fits(g)) {
          return false;
        }
      }
    }
  }
  return true;
}

// A RegionRef whose tags do not read is refused naming it (protobuf's parser would only say
// that the header is malformed, and the message named the wrong fields).
TEST(ForwardWireTest, MalformedRegionRefsAreNamed) {
  const std::string tensor = Tag(1, 0) + Varint(4);
  for (const auto& [bytes, want] : std::vector<std::pair<std::string, std::string>>{
           {Len(2, tensor) + Len(7, "\x10"),
            "output_region (field 7), a RegionRef: bad value of field 2"},
           {Len(2, tensor) + Len(7, "\x80"), "output_region (field 7), a RegionRef: bad tag"},
           {Len(2, tensor) + Len(7, Tag(0, 0) + Varint(1)),
            "output_region (field 7), a RegionRef: field number 0 or unmatched end-group"},
           {Len(2, tensor + Len(4, Tag(2, 4))),
            "tensor region, a RegionRef: field number 0 or unmatched end-group"}}) {
    v1::ForwardRequest pb;
    ASSERT_FALSE(pb.ParseFromString(bytes));  // protobuf refuses it too
    for (auto slices : {Split(bytes, {}), OneByteSlices(bytes)}) {
      absl::StatusOr<ForwardRequestView> v = DecodeForwardRequest(slices);
      ASSERT_FALSE(v.ok());
      EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(v.status().message().find(want), absl::string_view::npos) << v.status();
    }
  }
}

// A request tensor lists at most kMaxTensorDims dims, packed, unpacked or merged over repeated
// fields; more is refused (naming the field and the count) before any dim is stored: ten
// thousand dims once became a status message larger than gRPC carries.
TEST(ForwardWireTest, ShapesOfTooManyDimsAreRefused) {
  const auto request = [](const std::string& hidden) {
    return Tag(1, 0) + Varint(0) + Len(2, hidden) + Len(3, Tag(1, 0) + Varint(4));
  };
  std::string packed_max, unpacked_over, packed_huge;
  for (int i = 0; i < kMaxTensorDims; ++i) packed_max += Varint(1);
  for (int i = 0; i <= kMaxTensorDims; ++i) unpacked_over += Tag(2, 0) + Varint(1);
  for (int i = 0; i < 10000; ++i) packed_huge += Varint(1);
  const std::string at_max = request(Tag(1, 0) + Varint(1) + Len(2, packed_max));
  absl::StatusOr<ForwardRequestView> v = DecodeForwardRequest(Split(at_max, {}));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->hidden_states.header.shape_size(), kMaxTensorDims);
  // Two fields of 5 dims each merge into one tensor of 10.
  std::string five;
  for (int i = 0; i < 5; ++i) five += Varint(2);
  const std::string merged = Tag(1, 0) + Varint(0) + Len(2, Len(2, five)) + Len(2, Len(2, five));
  for (const auto& [bytes, dims] :
       std::vector<std::pair<std::string, int>>{{request(unpacked_over), kMaxTensorDims + 1},
                                                {request(Len(2, packed_huge)), 10000},
                                                {merged, 10}}) {
    v1::ForwardRequest pb;
    ASSERT_TRUE(pb.ParseFromString(bytes));  // protobuf alone would take it
    ASSERT_EQ(pb.hidden_states().shape_size(), dims);
    for (auto slices : {Split(bytes, {}), OneByteSlices(bytes)}) {
      v = DecodeForwardRequest(slices);
      ASSERT_FALSE(v.ok());
      EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(v.status().message(),
                absl::StrCat("moeserve.v1.ForwardRequest: tensor field 2 has a shape of ", dims,
                             " dims; at most ", kMaxTensorDims));
    }
  }
}

// Issue 14 item 7: a layer given as a 2^40 varint was read as 0 (protobuf's int32 truncation).
TEST(ForwardWireTest, Int32FieldsOutOfRangeAreRefusedNotTruncated) {
  const std::string tensor = Len(2, Tag(1, 0) + Varint(3) + Len(3, "abcd"));
  for (uint64_t layer : {uint64_t{1} << 40, uint64_t{1} << 31, uint64_t{INT32_MAX} + 1}) {
    const std::string b = Tag(1, 0) + Varint(layer) + tensor;
    v1::ForwardRequest pb;
    ASSERT_TRUE(pb.ParseFromString(b));  // protobuf accepts it, truncated
    absl::StatusOr<ForwardRequestView> v = DecodeForwardRequest(OneByteSlices(b));
    ASSERT_FALSE(v.ok()) << layer;
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(v.status().message().find("does not fit its type int32"), std::string::npos)
        << v.status();
    EXPECT_NE(v.status().message().find(absl::StrCat(static_cast<int64_t>(layer))),
              std::string::npos)
        << v.status();
  }
  // Negative int32s come sign-extended to 10 bytes and are fine (the engine refuses them).
  for (int32_t layer : {-1, INT32_MIN, INT32_MAX, 0, 7}) {
    const std::string b = Tag(1, 0) + Varint(static_cast<uint64_t>(int64_t{layer})) + tensor;
    absl::StatusOr<ForwardRequestView> v = DecodeForwardRequest(Split(b, {}));
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(v->header.layer(), layer);
  }
  // A dtype of 2^32 + 3 would read as 3 (DTYPE_FP32).
  const std::string b = Len(2, Tag(1, 0) + Varint((uint64_t{1} << 32) + 3) + Len(3, "abcd"));
  absl::StatusOr<ForwardRequestView> v = DecodeForwardRequest(Split(b, {}));
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("tensor field 1"), std::string::npos) << v.status();
  absl::StatusOr<ForwardResponseView> r = DecodeForwardResponse(Split(b, {}));
  ASSERT_FALSE(r.ok());
  // The same in the answer's routing echo (topk_ids 4, topk_weights 5), which protobuf parses:
  // 2^32 + 4 would read as 4 (INT32).
  for (uint32_t field : {4u, 5u}) {
    const std::string echo = Len(field, Tag(1, 0) + Varint((uint64_t{1} << 32) + 4));
    v1::ForwardResponse pb;
    ASSERT_TRUE(pb.ParseFromString(echo));  // protobuf accepts it, truncated
    r = DecodeForwardResponse(Split(echo, {}));
    ASSERT_FALSE(r.ok()) << field;
    EXPECT_NE(r.status().message().find("does not fit its type int32"), std::string::npos)
        << r.status();
    // In range, it decodes as protobuf does.
    const std::string fine = Len(field, Tag(1, 0) + Varint(4) + Len(3, "abcd"));
    r = DecodeForwardResponse(OneByteSlices(fine));
    ASSERT_TRUE(r.ok()) << r.status();
    const v1::Tensor& t = field == 4 ? r->header.topk_ids() : r->header.topk_weights();
    EXPECT_EQ(t.dtype(), v1::DTYPE_INT32);
    EXPECT_EQ(t.data(), "abcd");
  }
}

int g_protobuf_log_lines = 0;
void CountProtobufLog(google::protobuf::LogLevel, const char*, int, const std::string&) {
  ++g_protobuf_log_lines;
}

// Invalid UTF-8 in request_id is refused by the decoder itself, agreeing with protobuf's
// verdict, so that protobuf's parser (which logs an error line per occurrence) never sees it
// (issue 14 item 5: a log line per such call).
TEST(ForwardWireTest, Utf8VerdictAgreesWithProtobuf) {
  std::vector<std::string> cases = {"",
                                    "plain",
                                    "\xc3\xa9",
                                    "\xc0\x80",
                                    "\xc1\xbf",
                                    "\xe0\x80\x80",
                                    "\xe0\xa0\x80",
                                    "\xed\x9f\xbf",
                                    "\xed\xa0\x80",
                                    "\xef\xbf\xbf",
                                    "\xf0\x8f\xbf\xbf",
                                    "\xf0\x90\x80\x80",
                                    "\xf4\x8f\xbf\xbf",
                                    "\xf4\x90\x80\x80",
                                    "\xf5\x80\x80\x80",
                                    "\xff",
                                    "\x80",
                                    "a\xe2\x82",
                                    "\xe2\x82\xac",
                                    std::string("\0", 1)};
  std::mt19937_64 rng(7);
  for (int i = 0; i < 20000; ++i) {
    std::string t(std::uniform_int_distribution<size_t>(1, 6)(rng), '\0');
    // Mostly bytes near the interesting boundaries.
    for (char& c : t) {
      const uint8_t picks[] = {0x41, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0,
                               0xc2, 0xdf, 0xe0, 0xed, 0xef, 0xf0, 0xf4, 0xf5, 0xff};
      c = static_cast<char>(rng() % 3 ? picks[rng() % sizeof(picks)] : rng());
    }
    cases.push_back(t);
  }
  int valid = 0, invalid = 0;
  for (const std::string& id : cases) {
    const bool pb_valid = google::protobuf::internal::IsStructurallyValidUTF8(id);
    const std::string b = Len(5, id);
    g_protobuf_log_lines = 0;
    google::protobuf::LogHandler* old = google::protobuf::SetLogHandler(&CountProtobufLog);
    absl::StatusOr<ForwardRequestView> v = DecodeForwardRequest(RandomSplit(b, rng));
    google::protobuf::SetLogHandler(old);
    ASSERT_EQ(g_protobuf_log_lines, 0) << absl::BytesToHexString(id);
    ASSERT_EQ(v.ok(), pb_valid) << absl::BytesToHexString(id) << ": " << v.status();
    if (pb_valid) {
      EXPECT_EQ(v->header.request_id(), id);
    } else {
      EXPECT_NE(v.status().message().find("not valid UTF-8"), std::string::npos) << v.status();
    }
    ++(pb_valid ? valid : invalid);
  }
  EXPECT_GT(valid, 1000);
  EXPECT_GT(invalid, 1000);
}

// The other strings a client sends -- a RegionRef's name (output_region, a tensor's region) --
// and the answer's error_message are checked the same way: no protobuf log line.
TEST(ForwardWireTest, NestedAndErrorStringsCheckedWithoutProtobufLog) {
  for (const bool valid : {true, false}) {
    const std::string name = valid ? "region-\xc3\xa9" : "region-\xff";
    const std::string region = Len(1, name) + Tag(2, 0) + Varint(0);
    const std::vector<std::pair<std::string, std::string>> requests = {
        {"output_region", Len(7, region)},
        {"hidden_states.region", Len(2, Tag(1, 0) + Varint(1) + Len(4, region))}};
    for (const auto& [what, bytes] : requests) {
      g_protobuf_log_lines = 0;
      google::protobuf::LogHandler* old = google::protobuf::SetLogHandler(&CountProtobufLog);
      absl::StatusOr<ForwardRequestView> v = DecodeForwardRequest(Split(bytes, {}));
      google::protobuf::SetLogHandler(old);
      EXPECT_EQ(g_protobuf_log_lines, 0) << what;
      ASSERT_EQ(v.ok(), valid) << what << ": " << v.status();
      if (valid) {
        const std::string got = what == "output_region" ? v->header.output_region().name()
                                                        : v->hidden_states.header.region().name();
        EXPECT_EQ(got, name) << what;
      } else {
        EXPECT_NE(v.status().message().find("not valid UTF-8"), std::string::npos) << v.status();
      }
    }
    const std::string response = Tag(6, 0) + Varint(8) + Len(7, valid ? "fine" : "bad \xc0\x80");
    g_protobuf_log_lines = 0;
    google::protobuf::LogHandler* old = google::protobuf::SetLogHandler(&CountProtobufLog);
    absl::StatusOr<ForwardResponseView> r = DecodeForwardResponse(Split(response, {}));
    google::protobuf::SetLogHandler(old);
    EXPECT_EQ(g_protobuf_log_lines, 0);
    ASSERT_EQ(r.ok(), valid) << r.status();
    if (valid) {
      EXPECT_EQ(r->header.error_code(), 8);
    }
  }
}

TEST(ForwardWireTest, FuzzAgreesWithProtobuf) {
  std::mt19937_64 rng(20240611);
  int accepted = 0, rejected = 0;
  for (int i = 0; i < 4000; ++i) {
    const bool request = i % 2 == 0;
    std::string bytes =
        request ? RandomRequest(rng).SerializeAsString() : RandomResponse(rng).SerializeAsString();
    if (rng() % 2) bytes += Extras(rng);
    if (rng() % 3) bytes = Mutate(bytes, rng);
    const std::vector<grpc::Slice> slices = RandomSplit(bytes, rng);
    if (request) {
      v1::ForwardRequest pb;
      // Protobuf's verdict, less the int32 truncation it allows and the decoder refuses, and
      // less ranks above kMaxTensorDims (merged tensor fields add their dims up).
      const bool pb_ok = pb.ParseFromString(bytes) && Int32FieldsFit(bytes, true) &&
                         pb.hidden_states().shape_size() <= kMaxTensorDims &&
                         pb.topk_ids().shape_size() <= kMaxTensorDims &&
                         pb.topk_weights().shape_size() <= kMaxTensorDims;
      absl::StatusOr<ForwardRequestView> v = DecodeForwardRequest(slices);
      ASSERT_EQ(pb_ok, v.ok()) << "iteration " << i << ": " << v.status() << " bytes "
                               << absl::BytesToHexString(bytes);
      if (pb_ok) {
        ASSERT_TRUE(SameKnownFields(pb, ToProto(*v))) << "iteration " << i << "\n"
                                                      << pb.DebugString() << "\nvs\n"
                                                      << ToProto(*v).DebugString();
      }
      (pb_ok ? accepted : rejected)++;
    } else {
      v1::ForwardResponse pb;
      const bool pb_ok = pb.ParseFromString(bytes) && Int32FieldsFit(bytes, false);
      absl::StatusOr<ForwardResponseView> v = DecodeForwardResponse(slices);
      ASSERT_EQ(pb_ok, v.ok()) << "iteration " << i << ": " << v.status() << " bytes "
                               << absl::BytesToHexString(bytes);
      if (pb_ok) {
        ASSERT_TRUE(SameKnownFields(pb, ToProto(*v))) << "iteration " << i << "\n"
                                                      << pb.DebugString() << "\nvs\n"
                                                      << ToProto(*v).DebugString();
      }
      (pb_ok ? accepted : rejected)++;
    }
  }
  // Both outcomes must be exercised, or the loop proves nothing.
  EXPECT_GT(accepted, 1000);
  EXPECT_GT(rejected, 300);
}

}  // namespace
}  // namespace moeserve::v1wire
