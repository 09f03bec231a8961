#include "core/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/checked_math.h"
#include "core/tensor.h"
#include "nlohmann/json.hpp"

namespace moeserve::checkpoint {
namespace {

struct DTypeInfo {
  StDType dtype;
  absl::string_view name;
  size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {StDType::kBOOL, "BOOL", 1},       {StDType::kU8, "U8", 1},
    {StDType::kI8, "I8", 1},           {StDType::kF8_E4M3, "F8_E4M3", 1},
    {StDType::kF8_E5M2, "F8_E5M2", 1}, {StDType::kF8_E8M0, "F8_E8M0", 1},
    {StDType::kI16, "I16", 2},         {StDType::kU16, "U16", 2},
    {StDType::kF16, "F16", 2},         {StDType::kBF16, "BF16", 2},
    {StDType::kI32, "I32", 4},         {StDType::kU32, "U32", 4},
    {StDType::kF32, "F32", 4},         {StDType::kI64, "I64", 8},
    {StDType::kU64, "U64", 8},         {StDType::kF64, "F64", 8},
};

const DTypeInfo& Info(StDType dtype) {
  for (const DTypeInfo& i : kDTypes) {
    if (i.dtype == dtype) return i;
  }
  return kDTypes[1];
}

// A non-negative JSON integer that fits int64, or -1.
int64_t NonNegativeInt(const nlohmann::json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    return u > static_cast<uint64_t>(INT64_MAX) ? -1 : static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    return i < 0 ? -1 : i;
  }
  return -1;
}

std::string ShapeStr(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

absl::string_view StDTypeName(StDType dtype) { return Info(dtype).name; }

size_t StDTypeSize(StDType dtype) { return Info(dtype).size; }

absl::StatusOr<StDType> ParseStDType(absl::string_view name) {
  for (const DTypeInfo& i : kDTypes) {
    if (i.name == name) return i.dtype;
  }
  std::vector<std::string> known;
  for (const DTypeInfo& i : kDTypes) known.emplace_back(i.name);
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name, "'; known: ", absl::StrJoin(known, ", ")));
}

absl::StatusOr<DType> ToDType(StDType dtype) {
  switch (dtype) {
    case StDType::kBF16:
      return DType::kBF16;
    case StDType::kF16:
      return DType::kFP16;
    case StDType::kF32:
      return DType::kFP32;
    case StDType::kI32:
      return DType::kINT32;
    case StDType::kI64:
      return DType::kINT64;
    case StDType::kU8:
      return DType::kUINT8;
    case StDType::kF8_E4M3:
      return DType::kFP8E4M3;
    default:
      return absl::UnimplementedError(
          absl::StrCat("safetensors dtype ", StDTypeName(dtype), " is not supported"));
  }
}

int64_t SafetensorsTensor::numel() const {
  // Open() checked shape x itemsize == the byte span, so this fits; -1 for a hand-made shape.
  return NumElements(shape);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  auto file = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  file->path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    const std::string msg = absl::StrCat(path, ": cannot open: ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(msg) : absl::FailedPreconditionError(msg);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(path, ": not a regular file"));
  }
  file->size_ = static_cast<size_t>(st.st_size);
  if (file->size_ > 0) {
    void* p = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return absl::FailedPreconditionError(
          absl::StrCat(path, ": mmap of ", file->size_, " bytes failed: ", std::strerror(err)));
    }
    file->mapping_ = p;
  }
  ::close(fd);  // the mapping stays valid without the descriptor
  if (absl::Status s = file->Parse(); !s.ok()) return s;
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, size_);
}

absl::Status SafetensorsFile::Parse() {
  auto corrupt = [&](auto&&... parts) {
    return absl::DataLossError(absl::StrCat(path_, ": ", parts...));
  };
  if (size_ < 8) {
    return corrupt("file is ", size_,
                   " bytes, too short for the 8-byte header length "
                   "(truncated?)");
  }
  const auto* base = static_cast<const uint8_t*>(mapping_);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = header_len << 8 | base[i];  // little-endian
  if (header_len > size_ - 8) {
    return corrupt("header length ", header_len, " runs past the end of the file (", size_,
                   " bytes; truncated or not a safetensors file?)");
  }
  if (header_len > kMaxHeaderBytes) {
    return corrupt("header length ", header_len, " exceeds the limit of ", kMaxHeaderBytes,
                   " bytes");
  }
  if (header_len < 2) return corrupt("header of ", header_len, " bytes is not a JSON object");
  const char* hbegin = reinterpret_cast<const char*>(base + 8);
  const nlohmann::json header = nlohmann::json::parse(hbegin, hbegin + header_len, /*cb=*/nullptr,
                                                      /*allow_exceptions=*/false);
  if (header.is_discarded()) return corrupt("header is not well-formed JSON");
  if (!header.is_object()) return corrupt("header is JSON but not an object");

  const uint64_t data_begin = 8 + header_len;
  const int64_t data_size = static_cast<int64_t>(size_ - data_begin);
  std::vector<std::pair<int64_t, int64_t>> spans;  // parallel to tensors_
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return corrupt("__metadata__ is not an object");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) return corrupt("__metadata__['", k, "'] is not a string");
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    // (A copy: clang 14 cannot capture a structured binding.)
    const std::string tensor_name = name;
    auto bad = [&](auto&&... parts) { return corrupt("tensor '", tensor_name, "': ", parts...); };
    if (!entry.is_object()) return bad("entry is not an object");
    const auto dt = entry.find("dtype");
    if (dt == entry.end() || !dt->is_string()) return bad("missing string field 'dtype'");
    absl::StatusOr<StDType> dtype = ParseStDType(dt->get<std::string>());
    if (!dtype.ok()) return bad(dtype.status().message());
    const auto sh = entry.find("shape");
    if (sh == entry.end() || !sh->is_array()) return bad("missing array field 'shape'");
    SafetensorsTensor t;
    t.name = name;
    t.dtype = *dtype;
    for (const auto& d : *sh) {
      const int64_t dim = NonNegativeInt(d);
      if (dim < 0) return bad("shape ", sh->dump(), " has a dim that is not a non-negative int");
      t.shape.push_back(dim);
    }
    const int64_t numel = NumElements(t.shape);
    if (numel < 0) return bad("shape ", sh->dump(), " overflows 64-bit sizes");
    const auto off = entry.find("data_offsets");
    if (off == entry.end() || !off->is_array() || off->size() != 2) {
      return bad("missing field 'data_offsets' ([begin, end])");
    }
    const int64_t begin = NonNegativeInt((*off)[0]), end = NonNegativeInt((*off)[1]);
    if (begin < 0 || end < 0)
      return bad("data_offsets ", off->dump(), " are not non-negative ints");
    if (begin > end) return bad("data_offsets ", off->dump(), " have begin > end");
    if (end > data_size) {
      return bad("data_offsets ", off->dump(), " run past the end of the data section (", data_size,
                 " bytes; truncated file?)");
    }
    const std::optional<int64_t> expected_bytes =
        CheckedMul(numel, static_cast<int64_t>(StDTypeSize(t.dtype)));
    if (!expected_bytes || *expected_bytes != end - begin) {
      return bad("shape ", ShapeStr(t.shape), " x ", StDTypeName(t.dtype), " (",
                 StDTypeSize(t.dtype), " bytes) needs ",
                 expected_bytes ? absl::StrCat(*expected_bytes) : std::string("more than 2^63"),
                 " bytes but data_offsets ", off->dump(), " span ", end - begin);
    }
    t.file = path_;
    t.data = base + data_begin + begin;
    t.nbytes = end - begin;
    tensors_.push_back(std::move(t));
    spans.emplace_back(begin, end);
  }
  // Data order; the format requires the spans to tile the data section exactly.
  std::vector<size_t> order(tensors_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return spans[a] < spans[b]; });
  int64_t covered = 0;
  const SafetensorsTensor* prev = nullptr;
  for (size_t i : order) {
    if (spans[i].first < covered) {
      return corrupt("tensor '", tensors_[i].name, "': data_offsets [", spans[i].first, ", ",
                     spans[i].second, "] overlap tensor '", prev->name, "' (ends at ", covered,
                     ")");
    }
    if (spans[i].first > covered) {
      return corrupt("tensor '", tensors_[i].name, "': data_offsets [", spans[i].first, ", ",
                     spans[i].second, "] leave a hole after byte ", covered,
                     " of the data section");
    }
    covered = spans[i].second;
    prev = &tensors_[i];
  }
  if (covered != data_size) {
    return corrupt("data section has ", data_size, " bytes but its tensors cover ", covered);
  }
  std::vector<SafetensorsTensor> sorted;
  sorted.reserve(tensors_.size());
  for (size_t i : order) sorted.push_back(std::move(tensors_[i]));
  tensors_ = std::move(sorted);
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
  return absl::OkStatus();
}

std::vector<std::string> SafetensorsFile::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const SafetensorsTensor& t : tensors_) names.push_back(t.name);
  return names;
}

absl::StatusOr<SafetensorsTensor> SafetensorsFile::Get(const std::string& name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor named '", name, "'"));
  }
  return tensors_[it->second];
}

}  // namespace moeserve::checkpoint
