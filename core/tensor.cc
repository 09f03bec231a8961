#include "core/tensor.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/checked_math.h"
#include "core/status_macros.h"
#include "kernels/cpu/dtype_convert.h"

namespace moeserve {

std::string ShapeToString(absl::Span<const int64_t> shape) {
  // Error messages print shapes: a client's shape of thousands of dims must not make one
  // larger than a gRPC status carries.
  constexpr size_t kMaxPrinted = 8;
  if (shape.size() > kMaxPrinted) {
    return absl::StrCat("[", absl::StrJoin(shape.subspan(0, kMaxPrinted), ", "), ", ... (",
                        shape.size(), " dims)]");
  }
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int64_t NumElements(absl::Span<const int64_t> shape) {
  // A zero dim makes the product 0 whatever the others are (no overflow from [2^62, 2^62, 0]).
  for (int64_t d : shape) {
    if (d < 0) return -1;
  }
  for (int64_t d : shape) {
    if (d == 0) return 0;
  }
  int64_t n = 1;
  for (int64_t d : shape) {
    const std::optional<int64_t> next = CheckedMul(n, d);
    if (!next) return -1;
    n = *next;
  }
  return n;
}

namespace {

// a * b, saturating at INT64_MAX: the strides of a view with no elements (e.g. [0, 2^62, 2^62],
// which a request may carry) are never used to address memory but must not overflow either.
int64_t SaturatingMul(int64_t a, int64_t b) { return CheckedMul(a, b).value_or(INT64_MAX); }

Shape ContiguousStrides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    strides[i] = s;
    s = SaturatingMul(s, shape[i]);
  }
  return strides;
}

}  // namespace

std::string DeviceName(const Device& device) {
  switch (device.space) {
    case MemorySpace::kHost:
      return "host";
    case MemorySpace::kPinnedHost:
      return "pinned";
    case MemorySpace::kCuda:
      return absl::StrCat("cuda:", device.index);
  }
  return "unknown";
}

TensorView::TensorView(void* data, DType dtype, Shape shape, Device device)
    : data_(data), dtype_(dtype), shape_(std::move(shape)), device_(device) {
  strides_ = ContiguousStrides(shape_);
}

TensorView::TensorView(void* data, DType dtype, Shape shape, Shape strides, Device device)
    : data_(data),
      dtype_(dtype),
      shape_(std::move(shape)),
      strides_(std::move(strides)),
      device_(device) {}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int i = rank() - 1; i >= 0; --i) {
    if (shape_[i] != 1 && strides_[i] != expected) return false;
    expected = SaturatingMul(expected, shape_[i]);
  }
  return true;
}

TensorView TensorView::Slice(int64_t begin, int64_t end) const {
  Shape shape = shape_;
  shape[0] = end - begin;
  auto* base = static_cast<std::byte*>(data_);
  void* p = base == nullptr ? nullptr : base + begin * strides_[0] * DTypeSize(dtype_);
  return TensorView(p, dtype_, shape, strides_, device_);
}

absl::StatusOr<TensorView> TensorView::Reshape(Shape shape) const {
  if (!is_contiguous()) return absl::FailedPreconditionError("Reshape of a strided view");
  if (NumElements(shape) != numel()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot reshape ", ShapeToString(shape_), " to ", ShapeToString(shape)));
  }
  return TensorView(data_, dtype_, std::move(shape), device_);
}

std::string TensorView::DebugString() const {
  if (device_ == Device::Host()) return absl::StrCat(DTypeName(dtype_), ShapeToString(shape_));
  return absl::StrCat(DTypeName(dtype_), ShapeToString(shape_), "@", DeviceName(device_));
}

void Tensor::Free::operator()(std::byte* p) const { std::free(p); }

absl::StatusOr<Tensor> Tensor::Allocate(DType dtype, Shape shape) {
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  const int64_t numel = t.numel();
  const std::optional<int64_t> bytes =
      numel < 0 ? std::nullopt : CheckedMul(numel, static_cast<int64_t>(DTypeSize(dtype)));
  if (!bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", DTypeName(dtype), ShapeToString(t.shape_),
                     ": a negative dim, or its byte size overflows 64 bits"));
  }
  if (*bytes > kMaxAllocationBytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot allocate ", DTypeName(dtype), ShapeToString(t.shape_), ": its byte size ", *bytes,
        " exceeds the limit of ", kMaxAllocationBytes, " bytes for one allocation"));
  }
  // aligned_alloc wants a multiple of the alignment; rounding up cannot overflow below the limit.
  const size_t rounded = std::max<size_t>(64, (static_cast<size_t>(*bytes) + 63) / 64 * 64);
  t.buffer_.reset(static_cast<std::byte*>(std::aligned_alloc(64, rounded)));
  if (t.buffer_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "out of memory: cannot allocate %d bytes (%.2f GiB) for %s%s", rounded,
        static_cast<double>(rounded) / (1 << 30), DTypeName(dtype), ShapeToString(t.shape_)));
  }
  return t;
}

Tensor Tensor::Empty(DType dtype, Shape shape) {
  absl::StatusOr<Tensor> t = Allocate(dtype, std::move(shape));
  if (!t.ok()) {
    // Callers of Empty allocate sizes that were bounded already; failing here is not a request
    // to serve but a machine out of memory.
    std::fprintf(stderr, "moeserve: %s\n", std::string(t.status().message()).c_str());
    std::abort();
  }
  return *std::move(t);
}

Tensor Tensor::Zeros(DType dtype, Shape shape) {
  Tensor t = Empty(dtype, std::move(shape));
  std::memset(t.buffer_.get(), 0, t.nbytes());
  return t;
}

absl::StatusOr<int64_t> BufferBytes(DType dtype, const Shape& shape) {
  const int64_t numel = NumElements(shape);
  const std::optional<int64_t> bytes =
      numel < 0 ? std::nullopt : CheckedMul(numel, static_cast<int64_t>(DTypeSize(dtype)));
  if (!bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", DTypeName(dtype),
                                                     ShapeToString(shape),
                                                     ": a negative dim, or its byte size "
                                                     "overflows 64 bits"));
  }
  return *bytes;
}

absl::StatusOr<TensorView> HostBuffer::TryGet(DType dtype, const Shape& shape) {
  MOESERVE_ASSIGN_OR_RETURN(const int64_t bytes, BufferBytes(dtype, shape));
  if (static_cast<size_t>(bytes) > capacity_) {
    storage_ = Tensor();  // the old block goes back first: the peak is the new size, not both
    capacity_ = 0;
    absl::StatusOr<Tensor> t = Tensor::Allocate(DType::kUINT8, {bytes});
    if (!t.ok()) return t.status();
    storage_ = *std::move(t);
    capacity_ = static_cast<size_t>(bytes);
  }
  return TensorView(storage_.data<void>(), dtype, shape);
}

TensorView HostBuffer::Get(DType dtype, const Shape& shape) {
  absl::StatusOr<TensorView> view = TryGet(dtype, shape);
  if (!view.ok()) {
    std::fprintf(stderr, "moeserve: %s\n", std::string(view.status().message()).c_str());
    std::abort();
  }
  return *view;
}

absl::Status ConvertTensor(const TensorView& src, const TensorView& dst) {
  if (src.shape() != dst.shape()) {
    return absl::InvalidArgumentError(absl::StrCat("ConvertTensor: shape mismatch ",
                                                   src.DebugString(), " vs ", dst.DebugString()));
  }
  if (!src.is_contiguous() || !dst.is_contiguous()) {
    return absl::InvalidArgumentError("ConvertTensor: views must be contiguous");
  }
  if (!src.device().is_host() || !dst.device().is_host()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ConvertTensor runs on the host, got ", src.DebugString(), " -> ", dst.DebugString()));
  }
  const int64_t n = src.numel();
  if (n == 0) return absl::OkStatus();
  if (src.dtype() == dst.dtype()) {
    if (src.raw_data() != dst.raw_data())
      std::memmove(dst.raw_data(), src.raw_data(), src.nbytes());
    return absl::OkStatus();
  }
  namespace k = kernels;
  const DType s = src.dtype(), d = dst.dtype();
  if (s == DType::kFP32 && d == DType::kBF16) {
    k::ConvertFp32ToBf16Ref(src.data<float>(), dst.data<uint16_t>(), n);
  } else if (s == DType::kFP32 && d == DType::kFP16) {
    k::ConvertFp32ToFp16Ref(src.data<float>(), dst.data<uint16_t>(), n);
  } else if (s == DType::kBF16 && d == DType::kFP32) {
    k::ConvertBf16ToFp32Ref(src.data<uint16_t>(), dst.data<float>(), n);
  } else if (s == DType::kFP16 && d == DType::kFP32) {
    k::ConvertFp16ToFp32Ref(src.data<uint16_t>(), dst.data<float>(), n);
  } else if ((s == DType::kBF16 || s == DType::kFP16) && (d == DType::kBF16 || d == DType::kFP16)) {
    const uint16_t* in = src.data<uint16_t>();
    uint16_t* out = dst.data<uint16_t>();
    for (int64_t i = 0; i < n; ++i) {
      const float f = s == DType::kBF16 ? k::Bf16ToFloat(in[i]) : k::Fp16ToFloat(in[i]);
      out[i] = d == DType::kBF16 ? k::FloatToBf16(f) : k::FloatToFp16(f);
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("ConvertTensor: unsupported ", DTypeName(s), " -> ", DTypeName(d)));
  }
  return absl::OkStatus();
}

}  // namespace moeserve
