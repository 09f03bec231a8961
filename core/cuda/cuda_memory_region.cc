#include "core/cuda/cuda_memory_region.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/background_release.h"
#include "core/cuda/cuda_backend.h"
#include "core/cuda/device_scope.h"
#include "core/status_macros.h"

namespace moeserve {

static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes,
              "kCudaIpcHandleBytes must match cudaIpcMemHandle_t");

namespace {

// cudaFreeHost waits for the whole device: the landing area goes on the background release
// thread (its copies were waited for when they were made).
void FreeBounceInBackground(void* bounce) {
  if (bounce == nullptr) return;
  ReleaseInBackground([bounce] {
    cudaFreeHost(bounce);
    cudaGetLastError();
  });
}

// An opened IPC handle. CUDA opens a given handle once per process, so regions naming the same
// allocation share it (by the handle's bytes); closed when the last region goes.
struct OpenedHandle {
  std::string handle;
  int device = 0;
  void* ptr = nullptr;
  size_t allocation_bytes = 0;
  cudaStream_t stream = nullptr;  // for CopyIn / CopyOut
  // CopyInMany's page-locked landing area (grow-only), so that several device-to-host copies
  // are enqueued together and waited for once.
  std::mutex bounce_mu;
  void* bounce = nullptr;
  size_t bounce_bytes = 0;

  ~OpenedHandle() {
    DeviceScope scope(device);
    FreeBounceInBackground(bounce);
    if (stream != nullptr) cudaStreamDestroy(stream);
    if (ptr != nullptr) cudaIpcCloseMemHandle(ptr);
    cudaGetLastError();
  }
};

std::mutex& OpenedMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::map<std::string, std::weak_ptr<OpenedHandle>>& OpenedHandles() {
  static auto* map = new std::map<std::string, std::weak_ptr<OpenedHandle>>;
  return *map;
}

// The size of the allocation `ptr` starts, through the driver API (reached via the runtime, so
// nothing links libcuda). 0 if unknown.
size_t AllocationBytes(void* ptr) {
  using GetRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static GetRange get_range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<GetRange>(fn);
  }();
  if (get_range == nullptr) return 0;
  CUdeviceptr base = 0;
  size_t bytes = 0;
  if (get_range(&base, &bytes, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) return 0;
  // The opened pointer is the allocation's base; anything else leaves less room after it.
  const size_t lead = reinterpret_cast<CUdeviceptr>(ptr) - base;
  return bytes > lead ? bytes - lead : 0;
}

absl::StatusOr<std::shared_ptr<OpenedHandle>> OpenHandle(absl::string_view raw_handle,
                                                         int device_id) {
  std::lock_guard<std::mutex> lock(OpenedMutex());
  const std::string key(raw_handle);
  auto& opened = OpenedHandles();
  if (auto it = opened.find(key); it != opened.end()) {
    if (std::shared_ptr<OpenedHandle> h = it->second.lock()) return h;
    opened.erase(it);
  }
  DeviceScope scope(device_id);
  if (scope.status() != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat("device_id: cannot use CUDA device ", device_id,
                                                   ": ", cudaGetErrorString(scope.status())));
  }
  auto h = std::make_shared<OpenedHandle>();
  h->handle = key;
  h->device = device_id;
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, raw_handle.data(), sizeof(handle));
  if (const cudaError_t e = cudaIpcOpenMemHandle(&h->ptr, handle, cudaIpcMemLazyEnablePeerAccess);
      e != cudaSuccess) {
    cudaGetLastError();
    h->ptr = nullptr;
    return absl::InvalidArgumentError(absl::StrCat(
        "raw_handle: cudaIpcOpenMemHandle on device ", device_id,
        " failed: ", cudaGetErrorString(e),
        " (expected the cudaIpcGetMemHandle of a live allocation made by another process on "
        "this host)"));
  }
  cudaPointerAttributes attributes;
  if (cudaPointerGetAttributes(&attributes, h->ptr) == cudaSuccess &&
      attributes.type == cudaMemoryTypeDevice) {
    h->device = attributes.device;
  }
  cudaGetLastError();
  h->allocation_bytes = AllocationBytes(h->ptr);
  if (const cudaError_t e = cudaStreamCreateWithFlags(&h->stream, cudaStreamNonBlocking);
      e != cudaSuccess) {
    cudaGetLastError();
    h->stream = nullptr;
    return absl::InternalError(
        absl::StrCat("cudaStreamCreate for a CUDA region: ", cudaGetErrorString(e)));
  }
  opened[key] = h;
  return h;
}

class CudaIpcRegion final : public MemoryRegion {
 public:
  CudaIpcRegion(std::shared_ptr<OpenedHandle> handle, int64_t byte_size)
      : handle_(std::move(handle)), byte_size_(byte_size) {}

  RegionKind kind() const override { return RegionKind::kCuda; }
  int64_t byte_size() const override { return byte_size_; }
  Device device() const override { return Device::Cuda(handle_->device); }
  void* mapped_data() const override { return handle_->ptr; }
  std::string backing_id() const override {
    return absl::StrCat("cuda:", absl::BytesToHexString(handle_->handle));
  }

  absl::Status CopyIn(int64_t offset, const TensorView& dst) const override {
    return Copy(dst.raw_data(), static_cast<std::byte*>(handle_->ptr) + offset, offset, dst,
                "CopyIn");
  }
  absl::Status CopyOut(const TensorView& src, int64_t offset) const override {
    return Copy(static_cast<std::byte*>(handle_->ptr) + offset, src.raw_data(), offset, src,
                "CopyOut");
  }
  void Describe(RegionInfo* info) const override { info->device_id = handle_->device; }

  absl::Status CopyInMany(absl::Span<const CopyInRange> copies) const override {
    size_t total = 0;
    for (const auto& [offset, dst] : copies) {
      if (!dst.is_contiguous()) {
        return absl::InvalidArgumentError(
            absl::StrCat("CopyIn: needs a contiguous tensor, got ", dst.DebugString()));
      }
      MOESERVE_RETURN_IF_ERROR(
          CheckRegionRange(byte_size_, offset, static_cast<int64_t>(dst.nbytes()), "CopyIn"));
      total += (dst.nbytes() + 255) / 256 * 256;
    }
    if (total == 0) return absl::OkStatus();
    DeviceScope scope(handle_->device);
    MOESERVE_CUDA_RETURN_IF_ERROR(scope.status());
    std::lock_guard<std::mutex> lock(handle_->bounce_mu);
    if (handle_->bounce_bytes < total) {
      FreeBounceInBackground(handle_->bounce);
      handle_->bounce = nullptr;
      handle_->bounce_bytes = 0;
      const size_t bytes = std::max<size_t>(total, size_t{64} << 10);
      MOESERVE_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&handle_->bounce, bytes, cudaHostAllocDefault));
      handle_->bounce_bytes = bytes;
    }
    auto* bounce = static_cast<std::byte*>(handle_->bounce);
    size_t at = 0;
    for (const auto& [offset, dst] : copies) {
      MOESERVE_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(bounce + at, static_cast<const std::byte*>(handle_->ptr) + offset,
                          dst.nbytes(), cudaMemcpyDefault, handle_->stream));
      at += (dst.nbytes() + 255) / 256 * 256;
    }
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(handle_->stream));
    at = 0;
    for (const auto& [offset, dst] : copies) {
      std::memcpy(dst.raw_data(), bounce + at, dst.nbytes());
      at += (dst.nbytes() + 255) / 256 * 256;
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Copy(void* dst, const void* src, int64_t offset, const TensorView& t,
                    absl::string_view what) const {
    if (!t.is_contiguous()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": needs a contiguous tensor, got ", t.DebugString()));
    }
    const int64_t n = static_cast<int64_t>(t.nbytes());
    MOESERVE_RETURN_IF_ERROR(CheckRegionRange(byte_size_, offset, n, what));
    if (n == 0) return absl::OkStatus();
    DeviceScope scope(handle_->device);
    MOESERVE_CUDA_RETURN_IF_ERROR(scope.status());
    // Default: UVA tells host from device on either side (pageable host memory included).
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src, static_cast<size_t>(n), cudaMemcpyDefault, handle_->stream));
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(handle_->stream));
    return absl::OkStatus();
  }

  const std::shared_ptr<OpenedHandle> handle_;
  const int64_t byte_size_;
};

}  // namespace

absl::Status CudaRegisterHostMemory(void* data, size_t bytes) {
  if (const cudaError_t e = cudaHostRegister(data, bytes, cudaHostRegisterPortable);
      e != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(
        absl::StrCat("cudaHostRegister of ", bytes, " bytes: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

void CudaUnregisterHostMemory(void* data) {
  if (cudaHostUnregister(data) != cudaSuccess) cudaGetLastError();
}

absl::StatusOr<std::unique_ptr<MemoryRegion>> OpenCudaIpcRegion(absl::string_view raw_handle,
                                                                int device_id, int64_t byte_size) {
  if (raw_handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("raw_handle: got ", raw_handle.size(),
                                                   " bytes, expected a ", kCudaIpcHandleBytes,
                                                   "-byte cudaIpcMemHandle_t"));
  }
  const int count = CudaDeviceCount();
  if (device_id < 0 || device_id >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device_id: got ", device_id, ", the server sees ", count, " CUDA device(s)"));
  }
  if (byte_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("byte_size: got ", byte_size, ", expected > 0"));
  }
  MOESERVE_ASSIGN_OR_RETURN(std::shared_ptr<OpenedHandle> handle,
                            OpenHandle(raw_handle, device_id));
  if (handle->allocation_bytes == 0) {
    return absl::FailedPreconditionError(
        "cannot tell the size of the CUDA allocation the handle names (cuMemGetAddressRange), "
        "so its bounds cannot be checked");
  }
  if (static_cast<uint64_t>(byte_size) > handle->allocation_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("byte_size: ", byte_size, " exceeds the ", handle->allocation_bytes,
                     " bytes of the CUDA allocation the handle names"));
  }
  return std::unique_ptr<MemoryRegion>(new CudaIpcRegion(std::move(handle), byte_size));
}

}  // namespace moeserve
