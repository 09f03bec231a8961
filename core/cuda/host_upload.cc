#include "core/cuda/host_upload.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/background_release.h"
#include "core/cuda/cuda_backend.h"
#include "core/cuda/device_scope.h"
#include "core/status_macros.h"

namespace moeserve {
namespace {

// Device buffers are rounded up to this, so that calls of similar sizes share them.
constexpr size_t kBlockGranularity = size_t{2} << 20;
// Free device buffers kept for reuse, in bytes all together; beyond, a returned one is freed.
constexpr size_t kMaxFreeDeviceBytes = size_t{2} << 30;
// Idle stagers kept (each holds up to kMaxUploadParts x kUploadSlots page-locked chunks).
constexpr size_t kMaxIdleStagers = 4;

// One part's stream and page-locked chunks.
struct PartStage {
  cudaStream_t stream = nullptr;
  size_t chunk_bytes = 0;  // what each slot holds
  void* slots[kUploadSlots] = {};
  cudaEvent_t copied[kUploadSlots] = {};
};

// Streams and page-locked chunks on one device, used by one upload at a time; parts are set up
// when first needed and grown when a larger chunk is asked for.
struct Stager {
  int device = 0;
  PartStage parts[kMaxUploadParts];

  ~Stager() {
    DeviceScope scope(device);
    for (PartStage& p : parts) {
      if (p.stream != nullptr) cudaStreamSynchronize(p.stream);
      FreeSlots(p);
      for (cudaEvent_t& e : p.copied) {
        if (e != nullptr) cudaEventDestroy(e);
      }
      if (p.stream != nullptr) cudaStreamDestroy(p.stream);
    }
  }
  static void FreeSlots(PartStage& p) {
    for (void*& slot : p.slots) {
      if (slot != nullptr) cudaFreeHost(slot);
      slot = nullptr;
    }
    p.chunk_bytes = 0;
  }
  // Part i ready for chunks of `chunk_bytes`. The caller has made `device` current.
  absl::Status Ready(int i, size_t chunk_bytes) {
    PartStage& p = parts[i];
    if (p.stream == nullptr) {
      MOESERVE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&p.stream, cudaStreamNonBlocking));
      for (cudaEvent_t& e : p.copied) {
        MOESERVE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      }
    }
    if (p.chunk_bytes < chunk_bytes) {
      FreeSlots(p);
      for (void*& slot : p.slots) {
        MOESERVE_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&slot, chunk_bytes, cudaHostAllocPortable));
      }
      p.chunk_bytes = chunk_bytes;
    }
    return absl::OkStatus();
  }
};

// Process-wide free lists of stagers and device buffers. Leaked on purpose: buffers may come
// back from gRPC threads during shutdown, after static destructors would have run.
class UploadPool {
 public:
  absl::StatusOr<std::unique_ptr<Stager>> TakeStager(int device) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = stagers_.begin(); it != stagers_.end(); ++it) {
        if ((*it)->device == device) {
          std::unique_ptr<Stager> s = std::move(*it);
          stagers_.erase(it);
          return s;
        }
      }
    }
    auto s = std::make_unique<Stager>();
    s->device = device;
    return s;
  }

  void ReturnStager(std::unique_ptr<Stager> stager) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stagers_.size() < kMaxIdleStagers) {
        stagers_.push_back(std::move(stager));
        return;
      }
    }
    // More concurrent large uploads than kMaxIdleStagers: destroyed on the background release
    // thread (its page-locked chunks' cudaFreeHost waits for the whole device).
    ReleaseInBackground([s = stager.release()] { delete s; });
  }

  // A free buffer of at least `bytes` and at most twice that, else a new one. *capacity: its
  // size. The caller has made `device` current.
  absl::StatusOr<void*> TakeBlock(int device, size_t bytes, size_t* capacity) {
    const size_t want = (bytes + kBlockGranularity - 1) / kBlockGranularity * kBlockGranularity;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& free = blocks_[device];
      auto it = free.lower_bound(want);
      if (it != free.end() && it->first <= 2 * want) {
        *capacity = it->first;
        void* ptr = it->second;
        free.erase(it);
        free_bytes_ -= *capacity;
        return ptr;
      }
    }
    void* ptr = nullptr;
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr, want));
    *capacity = want;
    return ptr;
  }

  void ReturnBlock(int device, void* ptr, size_t capacity) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (free_bytes_ + capacity <= kMaxFreeDeviceBytes) {
        blocks_[device].emplace(capacity, ptr);
        free_bytes_ += capacity;
        return;
      }
    }
    // cudaFree waits for the whole device: on the background release thread.
    ReleaseInBackground([device, ptr] {
      DeviceScope scope(device);
      cudaFree(ptr);
      cudaGetLastError();
    });
  }

  size_t FreeBlocks() {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = 0;
    for (const auto& [device, free] : blocks_) n += free.size();
    return n;
  }
  size_t IdleStagers() {
    std::lock_guard<std::mutex> lock(mu_);
    return stagers_.size();
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<Stager>> stagers_;
  std::map<int, std::multimap<size_t, void*>> blocks_;  // device -> (capacity, pointer)
  size_t free_bytes_ = 0;
};

UploadPool& Pool() {
  static UploadPool* pool = new UploadPool;
  return *pool;
}

class CudaDeviceBytes final : public DeviceBytes {
 public:
  CudaDeviceBytes(int device, void* ptr, size_t size, size_t capacity)
      : device_(device), ptr_(ptr), size_(size), capacity_(capacity) {}
  ~CudaDeviceBytes() override { Pool().ReturnBlock(device_, ptr_, capacity_); }
  void* data() override { return ptr_; }
  size_t size() const override { return size_; }
  Device device() const override { return Device::Cuda(device_); }

 private:
  int device_;
  void* ptr_;
  size_t size_;
  size_t capacity_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceBytes>> CudaUploadHostPieces(int device,
                                                                  const HostPieces& pieces,
                                                                  size_t size,
                                                                  const ParallelForFn& parallel_for,
                                                                  int parts) {
  return CudaUploadHostPiecesInChunks(device, pieces, size, parallel_for, parts, kUploadChunkBytes);
}

absl::StatusOr<std::unique_ptr<DeviceBytes>> CudaUploadHostPiecesInChunks(
    int device, const HostPieces& pieces, size_t size, const ParallelForFn& parallel_for, int parts,
    size_t chunk_bytes) {
  if (size == 0) return absl::InvalidArgumentError("upload: nothing to upload (0 bytes)");
  if (parts < 1 || parts > kMaxUploadParts) {
    return absl::InvalidArgumentError(
        absl::StrCat("upload: parts ", parts, ", expected 1 to ", kMaxUploadParts));
  }
  if (chunk_bytes < 4096 || chunk_bytes > kUploadMaxChunkBytes || chunk_bytes % 4096 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("upload: chunk_bytes ", chunk_bytes,
                                                   ", expected a multiple of 4096 up to ",
                                                   kUploadMaxChunkBytes));
  }
  const int count = CudaDeviceCount();
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("upload: device ", device, " is not visible (", count, " devices)"));
  }
  DeviceScope scope(device);
  MOESERVE_CUDA_RETURN_IF_ERROR(scope.status());
  size_t capacity = 0;
  MOESERVE_ASSIGN_OR_RETURN(void* block, Pool().TakeBlock(device, size, &capacity));
  // From here the buffer goes back to the pool on every return.
  auto bytes = std::make_unique<CudaDeviceBytes>(device, block, size, capacity);
  MOESERVE_ASSIGN_OR_RETURN(std::unique_ptr<Stager> stager, Pool().TakeStager(device));
  // Equal parts, whole chunks each (the last part takes the rest), so that no part is tiny.
  const size_t chunks = (size + chunk_bytes - 1) / chunk_bytes;
  const int used = static_cast<int>(std::min<size_t>(static_cast<size_t>(parts), chunks));
  const size_t chunks_per_part = (chunks + used - 1) / used;
  for (int i = 0; i < used; ++i) MOESERVE_RETURN_IF_ERROR(stager->Ready(i, chunk_bytes));
  auto* dst = static_cast<uint8_t*>(block);
  std::mutex error_mu;
  absl::Status error;
  parallel_for(used, [&](int64_t i) {
    const absl::Status s = [&]() -> absl::Status {
      // The pool thread may not have this device current.
      MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
      PartStage& p = stager->parts[i];
      const size_t begin = std::min(size, static_cast<size_t>(i) * chunks_per_part * chunk_bytes);
      const size_t end = std::min(size, begin + chunks_per_part * chunk_bytes);
      const HostPieces mine = SubPieces(pieces, begin, end - begin);
      int k = 0;
      for (size_t offset = begin; offset < end; offset += chunk_bytes, ++k) {
        const size_t n = std::min(chunk_bytes, end - offset);
        const int slot = k % kUploadSlots;
        // The slot's previous chunk must be on the device before it is overwritten.
        if (k >= kUploadSlots) MOESERVE_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(p.copied[slot]));
        auto* staged = static_cast<uint8_t*>(p.slots[slot]);
        size_t done = 0;
        for (const absl::Span<const uint8_t> piece : SubPieces(mine, offset - begin, n)) {
          std::memcpy(staged + done, piece.data(), piece.size());
          done += piece.size();
        }
        MOESERVE_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(dst + offset, staged, n, cudaMemcpyHostToDevice, p.stream));
        MOESERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(p.copied[slot], p.stream));
      }
      MOESERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(p.stream));
      return absl::OkStatus();
    }();
    if (!s.ok()) {
      std::lock_guard<std::mutex> lock(error_mu);
      if (error.ok()) error = s;
    }
  });
  if (!error.ok()) return error;  // the stager is dropped: a stream may hold an error
  Pool().ReturnStager(std::move(stager));
  return std::unique_ptr<DeviceBytes>(std::move(bytes));
}

size_t UploadFreeBlocksForTesting() { return Pool().FreeBlocks(); }
size_t UploadIdleStagersForTesting() { return Pool().IdleStagers(); }

}  // namespace moeserve
