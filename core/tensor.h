// Tensor views (non-owning) and a small owning host tensor.
//
// A TensorView is a pointer plus dtype, shape, strides (in elements) and the Device its memory
// lives on. It never owns memory; whoever creates it keeps the storage alive. Views are cheap to
// copy and are not thread-safe with respect to the data they point at. Nothing here dereferences
// the pointer except the host-only helpers documented as such.
#ifndef MOESERVE_CORE_TENSOR_H_
#define MOESERVE_CORE_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/dtype.h"

namespace moeserve {

using Shape = absl::InlinedVector<int64_t, 4>;

// Where a tensor's bytes live. Pinned host memory is host memory that a device can copy
// without staging (cudaMallocHost / cudaHostRegister).
enum class MemorySpace : uint8_t { kHost, kPinnedHost, kCuda };

struct Device {
  MemorySpace space = MemorySpace::kHost;
  int index = 0;  // the CUDA device ordinal (kCuda); 0 otherwise

  static constexpr Device Host() { return {MemorySpace::kHost, 0}; }
  static constexpr Device PinnedHost() { return {MemorySpace::kPinnedHost, 0}; }
  static constexpr Device Cuda(int index) { return {MemorySpace::kCuda, index}; }
  // Host code may dereference the pointer.
  bool is_host() const { return space != MemorySpace::kCuda; }
  friend bool operator==(const Device& a, const Device& b) {
    return a.space == b.space && a.index == b.index;
  }
  friend bool operator!=(const Device& a, const Device& b) { return !(a == b); }
};
// "host", "pinned" or "cuda:N".
std::string DeviceName(const Device& device);

std::string ShapeToString(absl::Span<const int64_t> shape);
// Product of the dims; 1 for a scalar (empty shape), 0 if any dim is 0, and -1 if a dim is
// negative or the product overflows int64 (so a hostile shape can never wrap around).
int64_t NumElements(absl::Span<const int64_t> shape);

class TensorView {
 public:
  TensorView() = default;
  // Contiguous row-major view.
  TensorView(void* data, DType dtype, Shape shape, Device device = Device::Host());
  // Strided view; strides are in elements.
  TensorView(void* data, DType dtype, Shape shape, Shape strides, Device device = Device::Host());
  // Read-only data is viewed through the same type; callers must not write through it.
  TensorView(const void* data, DType dtype, Shape shape, Device device = Device::Host())
      : TensorView(const_cast<void*>(data), dtype, std::move(shape), device) {}

  bool empty() const { return data_ == nullptr && shape_.empty(); }
  void* raw_data() const { return data_; }
  template <typename T>
  T* data() const {
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const { return shape_[i]; }
  int64_t stride(int i) const { return strides_[i]; }
  int64_t numel() const { return NumElements(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype_); }
  bool is_contiguous() const;

  // View of rows [begin, end) along dim 0. Requires rank >= 1.
  TensorView Slice(int64_t begin, int64_t end) const;
  // Same storage with a new contiguous shape of equal element count. Requires contiguity.
  absl::StatusOr<TensorView> Reshape(Shape shape) const;

  // "bf16[4, 8]", with "@cuda:0" / "@pinned" appended off the plain host.
  std::string DebugString() const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kFP32;
  Shape shape_;
  Shape strides_;
  Device device_;
};

// Owning, 64-byte aligned, contiguous host tensor. Movable, not copyable.
class Tensor {
 public:
  Tensor() = default;
  // Largest single allocation (4 TiB): far above any real buffer, far below where byte counts
  // and pointer arithmetic could wrap.
  static constexpr int64_t kMaxAllocationBytes = int64_t{1} << 42;
  // Uninitialized storage, or RESOURCE_EXHAUSTED naming the dtype, shape and byte size when
  // the size overflows, exceeds kMaxAllocationBytes or the memory cannot be had. For sizes that
  // come from outside (configs, checkpoints, requests).
  static absl::StatusOr<Tensor> Allocate(DType dtype, Shape shape);
  // Allocate for sizes already bounded (tests, small fixed buffers): a failure prints the same
  // message and aborts.
  static Tensor Empty(DType dtype, Shape shape);
  static Tensor Zeros(DType dtype, Shape shape);

  TensorView view() const { return TensorView(buffer_.get(), dtype_, shape_); }
  template <typename T>
  T* data() const {
    return reinterpret_cast<T*>(buffer_.get());
  }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t numel() const { return NumElements(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype_); }

 private:
  struct Free {
    void operator()(std::byte* p) const;
  };
  std::unique_ptr<std::byte[], Free> buffer_;
  DType dtype_ = DType::kFP32;
  Shape shape_;
};

// The bytes of a contiguous `dtype` tensor of `shape`: RESOURCE_EXHAUSTED naming it for a
// negative dim or a size that overflows 64 bits (what a buffer asked for it refuses).
absl::StatusOr<int64_t> BufferBytes(DType dtype, const Shape& shape);

// A reusable host buffer that grows to the largest size asked of it; for workspaces.
class HostBuffer {
 public:
  // Returns a contiguous view of `shape` backed by this buffer (contents unspecified), or
  // RESOURCE_EXHAUSTED naming the size when it cannot grow (the buffer is then empty).
  absl::StatusOr<TensorView> TryGet(DType dtype, const Shape& shape);
  // TryGet for sizes already bounded; aborts with TryGet's message on failure.
  TensorView Get(DType dtype, const Shape& shape);
  size_t capacity() const { return capacity_; }

 private:
  Tensor storage_;
  size_t capacity_ = 0;
};

// Host-only: converts between floating-point dtypes (BF16, FP16, FP32) elementwise.
// src and dst must have the same shape and be contiguous.
absl::Status ConvertTensor(const TensorView& src, const TensorView& dst);

}  // namespace moeserve

#endif  // MOESERVE_CORE_TENSOR_H_
