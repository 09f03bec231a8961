// The safetensors reader on hand-built byte buffers: valid files and every malformation it must
// refuse, each with an error naming the file and (where there is one) the tensor.
#include "core/checkpoint/safetensors.h"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moeserve::checkpoint {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// 8-byte little-endian header length, the header, the data.
std::string Bytes(const std::string& header, const std::string& data, int64_t length = -1) {
  const uint64_t n = length >= 0 ? static_cast<uint64_t>(length) : header.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

std::string WriteFile(const std::string& name, const std::string& bytes) {
  const std::string path = ::testing::TempDir() + "/safetensors_test_" + name + ".safetensors";
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

absl::Status OpenStatus(const std::string& name, const std::string& bytes) {
  return SafetensorsFile::Open(WriteFile(name, bytes)).status();
}

TEST(Safetensors, ReadsTensorsMetadataAndData) {
  // a: BF16 [2, 3] (12 bytes), b: I32 [2] (8 bytes), c: F32 scalar, d: zero-size U8 [0, 4].
  std::string data(24, '\0');
  for (int i = 0; i < 24; ++i) data[i] = static_cast<char>(i);
  const std::string header =
      R"({"__metadata__":{"format":"pt"},)"
      R"("b":{"dtype":"I32","shape":[2],"data_offsets":[12,20]},)"
      R"("a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},)"
      R"("d":{"dtype":"U8","shape":[0,4],"data_offsets":[20,20]},)"
      R"("c":{"dtype":"F32","shape":[],"data_offsets":[20,24]}}   )";  // padded, as writers do
  auto file = SafetensorsFile::Open(WriteFile("valid", Bytes(header, data)));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  // Data order, not header order.
  EXPECT_EQ((*file)->TensorNames(), (std::vector<std::string>{"a", "b", "d", "c"}));
  auto a = (*file)->Get("a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->dtype, StDType::kBF16);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a->nbytes, 12);
  EXPECT_EQ(a->numel(), 6);
  EXPECT_EQ(a->data[0], 0);
  EXPECT_EQ(a->data[11], 11);
  auto b = (*file)->Get("b");
  ASSERT_TRUE(b.ok());
  int32_t b0;
  std::memcpy(&b0, b->data, 4);
  EXPECT_EQ(b0, 12 | 13 << 8 | 14 << 16 | 15 << 24);
  auto c = (*file)->Get("c");
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->shape.empty());
  EXPECT_EQ(c->numel(), 1);
  EXPECT_EQ(c->data[0], 20);
  auto d = (*file)->Get("d");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->nbytes, 0);
  EXPECT_EQ(ToDType(a->dtype).value(), DType::kBF16);
  EXPECT_FALSE(ToDType(StDType::kF64).ok());

  auto missing = (*file)->Get("nope");
  EXPECT_TRUE(absl::IsNotFound(missing.status()));
  EXPECT_THAT(missing.status().message(), AllOf(HasSubstr("valid"), HasSubstr("'nope'")));
}

TEST(Safetensors, EveryKnownDtypeHasItsSize) {
  for (auto [name, size] : std::vector<std::pair<std::string, size_t>>{{"BOOL", 1},
                                                                       {"U8", 1},
                                                                       {"I8", 1},
                                                                       {"F8_E4M3", 1},
                                                                       {"F8_E5M2", 1},
                                                                       {"F8_E8M0", 1},
                                                                       {"I16", 2},
                                                                       {"U16", 2},
                                                                       {"F16", 2},
                                                                       {"BF16", 2},
                                                                       {"I32", 4},
                                                                       {"U32", 4},
                                                                       {"F32", 4},
                                                                       {"I64", 8},
                                                                       {"U64", 8},
                                                                       {"F64", 8}}) {
    auto d = ParseStDType(name);
    ASSERT_TRUE(d.ok()) << name;
    EXPECT_EQ(StDTypeSize(*d), size) << name;
    EXPECT_EQ(StDTypeName(*d), name);
  }
}

TEST(Safetensors, MissingFileIsNotFound) {
  auto f = SafetensorsFile::Open(::testing::TempDir() + "/no_such_file.safetensors");
  EXPECT_TRUE(absl::IsNotFound(f.status()));
  EXPECT_THAT(f.status().message(), HasSubstr("no_such_file.safetensors"));
}

TEST(Safetensors, EmptyAndShortFilesAreRefused) {
  for (const std::string& bytes : {std::string(), std::string(5, 'x')}) {
    const absl::Status s = OpenStatus("short", bytes);
    EXPECT_TRUE(absl::IsDataLoss(s)) << s;
    EXPECT_THAT(s.message(), AllOf(HasSubstr("safetensors_test_short"), HasSubstr("too short")));
  }
}

TEST(Safetensors, HeaderLengthPastTheEndIsRefused) {
  const std::string header = R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})";
  const absl::Status s = OpenStatus("hlen", Bytes(header, "abcd", header.size() + 100));
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("safetensors_test_hlen"), HasSubstr("header length"),
                                 HasSubstr("past the end")));
  // A huge length (e.g. random bytes) too, without reading past the mapping.
  const absl::Status huge = OpenStatus("hlen_huge", Bytes(header, "abcd", int64_t{1} << 62));
  EXPECT_THAT(huge.message(), HasSubstr("past the end"));
}

TEST(Safetensors, MalformedJsonIsRefused) {
  const absl::Status s = OpenStatus("badjson", Bytes(R"({"a":{"dtype":"U8",)", ""));
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("safetensors_test_badjson"), HasSubstr("JSON")));
  const absl::Status arr = OpenStatus("array", Bytes("[1, 2, 3]", ""));
  EXPECT_THAT(arr.message(), HasSubstr("not an object"));
}

struct BadCase {
  std::string name;
  std::string header;
  std::string data;
  std::string expect;  // substring of the error, besides the file and the tensor
};

class SafetensorsMalformedTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(SafetensorsMalformedTest, RefusedNamingFileAndTensor) {
  const BadCase& c = GetParam();
  const absl::Status s = OpenStatus(c.name, Bytes(c.header, c.data));
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("safetensors_test_" + c.name + ".safetensors"),
                                 HasSubstr("tensor 'w'"), HasSubstr(c.expect)));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, SafetensorsMalformedTest,
    ::testing::Values(
        BadCase{"unknown_dtype", R"({"w":{"dtype":"Q7","shape":[4],"data_offsets":[0,4]}})", "abcd",
                "unknown dtype 'Q7'"},
        BadCase{"offsets_past_end", R"({"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}})",
                "abcd", "past the end of the data section"},
        BadCase{"begin_after_end", R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})",
                "abcd", "begin > end"},
        BadCase{"shape_vs_span", R"({"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,4]}})",
                "abcd", "needs 6 bytes"},
        BadCase{"overlap",
                R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                R"("w":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                "abcdef", "overlap tensor 'a'"},
        BadCase{"hole",
                R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                R"("w":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}})",
                "abcdef", "hole"},
        BadCase{"negative_dim", R"({"w":{"dtype":"U8","shape":[-4],"data_offsets":[0,4]}})", "abcd",
                "non-negative"},
        BadCase{"float_dim", R"({"w":{"dtype":"U8","shape":[4.0],"data_offsets":[0,4]}})", "abcd",
                "non-negative"},
        BadCase{"overflowing_shape",
                R"({"w":{"dtype":"U8","shape":[4294967296,4294967296,16],)"
                R"("data_offsets":[0,4]}})",
                "abcd", "overflows"},
        BadCase{"no_dtype", R"({"w":{"shape":[4],"data_offsets":[0,4]}})", "abcd", "dtype"},
        BadCase{"no_shape", R"({"w":{"dtype":"U8","data_offsets":[0,4]}})", "abcd", "shape"},
        BadCase{"no_offsets", R"({"w":{"dtype":"U8","shape":[4]}})", "abcd", "data_offsets"},
        BadCase{"three_offsets", R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4,8]}})",
                "abcd", "data_offsets"},
        BadCase{"string_offsets", R"({"w":{"dtype":"U8","shape":[4],"data_offsets":["0","4"]}})",
                "abcd", "data_offsets"},
        BadCase{"entry_not_object", R"({"w":[1,2]})", "", "not an object"}),
    [](const ::testing::TestParamInfo<BadCase>& info) { return info.param.name; });

TEST(Safetensors, TrailingBytesAfterTheLastTensorAreRefused) {
  const std::string header = R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
  const absl::Status s = OpenStatus("trailing", Bytes(header, "abcd"));
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("safetensors_test_trailing"), HasSubstr("cover 2")));
}

TEST(Safetensors, MetadataMustBeStrings) {
  const std::string header =
      R"({"__metadata__":{"n":3},"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
  const absl::Status s = OpenStatus("metadata", Bytes(header, "ab"));
  EXPECT_THAT(s.message(),
              AllOf(HasSubstr("safetensors_test_metadata"), HasSubstr("__metadata__['n']")));
}

TEST(Safetensors, EmptyHeaderObjectIsAnEmptyFile) {
  auto f = SafetensorsFile::Open(WriteFile("empty_object", Bytes("{}", "")));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE((*f)->TensorNames().empty());
}

}  // namespace
}  // namespace moeserve::checkpoint
