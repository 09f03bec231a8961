// A memory-mapped, fully validated reader of one .safetensors file.
//
// Format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N,
// N bytes of JSON (an object: tensor name -> {"dtype", "shape", "data_offsets": [begin, end)},
// plus an optional "__metadata__" object of strings), then the data section. Offsets are
// relative to the start of the data section; tensors are row-major, little-endian.
//
// Open() checks everything before any tensor is handed out: the header length lies within the
// file, the header is a JSON object, every dtype is known, every shape times the item size equals
// the byte span, spans are ordered (begin <= end), inside the data section and neither overlap
// nor leave holes (as the format requires). Every error names the file and, where one is
// involved, the tensor.
//
// Thread-safety: immutable after Open(); views may be read from any thread while the
// SafetensorsFile lives. Pointers into the mapping are only 1-byte aligned in general: read
// elements with memcpy.
#ifndef MOESERVE_CORE_CHECKPOINT_SAFETENSORS_H_
#define MOESERVE_CORE_CHECKPOINT_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"

namespace moeserve::checkpoint {

// Element types of the safetensors format (names as in the header).
enum class StDType {
  kBOOL,
  kU8,
  kI8,
  kF8_E4M3,
  kF8_E5M2,
  kF8_E8M0,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kI64,
  kU64,
  kF64,
};

// "BF16", "F8_E4M3", ... as written in headers.
absl::string_view StDTypeName(StDType dtype);
absl::StatusOr<StDType> ParseStDType(absl::string_view name);
size_t StDTypeSize(StDType dtype);
// Our DType for the safetensors dtypes moeserve computes with (BF16, F16, F32, I32, I64, U8,
// F8_E4M3); an error for the others.
absl::StatusOr<DType> ToDType(StDType dtype);

// A read-only view of one tensor inside the mapping.
struct SafetensorsTensor {
  std::string name;
  std::string file;  // path of the file holding it, for error messages
  StDType dtype = StDType::kU8;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // into the mapping; 1-byte aligned in general
  int64_t nbytes = 0;
  int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Headers larger than this are refused (a corrupted length would otherwise make us parse
  // gigabytes of tensor data as JSON). The reference implementation uses the same bound.
  static constexpr uint64_t kMaxHeaderBytes = 100u << 20;

  // Maps `path` read-only and validates it (see the file comment).
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Tensor names in data order (ascending offsets).
  std::vector<std::string> TensorNames() const;
  bool Contains(const std::string& name) const { return index_.count(name) > 0; }
  // NOT_FOUND naming the file and the tensor when absent.
  absl::StatusOr<SafetensorsTensor> Get(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  int64_t file_size() const { return static_cast<int64_t>(size_); }

 private:
  SafetensorsFile() = default;
  absl::Status Parse();

  std::string path_;
  void* mapping_ = nullptr;
  size_t size_ = 0;
  std::vector<SafetensorsTensor> tensors_;  // ascending offsets
  std::map<std::string, size_t> index_;     // name -> tensors_ index
  std::map<std::string, std::string> metadata_;
};

}  // namespace moeserve::checkpoint

#endif  // MOESERVE_CORE_CHECKPOINT_SAFETENSORS_H_
