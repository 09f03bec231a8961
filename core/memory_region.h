// Memory regions a client registers so that a call's tensors travel by reference instead of by
// value (after Triton's shared-memory extension): POSIX shared memory on this host, CUDA IPC
// allocations of the client's GPU, and later remote memory (RDMA through UCX or NIXL; a seam,
// not built).
//
// A MemoryRegion is a byte range [0, byte_size()). Every region copies bytes in and out
// (CopyIn / CopyOut) -- that is all a remote kind would offer. A region this process can address
// also exposes its base pointer and the Device the bytes live on (mapped_data(), device()), so a
// tensor in it is read or written in place through a TensorView: a TensorView on a system
// region's mapping for the CPU engine, the same mapping page-locked (cudaHostRegister) for the
// CUDA engine's DMA, a device pointer for a CUDA region.
//
// RegionRegistry keeps the registered regions by name. A call takes a RegionLease on each region
// it names; while leases are out the region counts calls_in_flight and Unregister refuses it
// with FAILED_PRECONDITION (nothing is unregistered). So once Unregister returns OK the server
// never touches the memory again and the client may free or reuse it.
//
// No CUDA here: the CUDA backend provides page-locking and CUDA IPC regions through its
// BackendProvider (core/provider_registry.h); without it CUDA regions are refused.
#ifndef MOESERVE_CORE_MEMORY_REGION_H_
#define MOESERVE_CORE_MEMORY_REGION_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/engine_plan.h"
#include "core/tensor.h"

namespace moeserve {

enum class RegionKind : uint8_t {
  kSystem,  // POSIX shared memory (shm_open + mmap), this host
  kCuda,    // a CUDA IPC allocation (cudaIpcOpenMemHandle), a GPU of this host
  kRemote,  // memory on another host (RDMA); not built
};
// "system", "cuda", "remote".
absl::string_view RegionKindName(RegionKind kind);

// Bytes of a cudaIpcMemHandle_t (CUDA_IPC_HANDLE_SIZE; checked in core/cuda).
inline constexpr size_t kCudaIpcHandleBytes = 64;

// A region as SharedMemoryStatus reports it.
struct RegionInfo {
  std::string name;
  RegionKind kind = RegionKind::kSystem;
  std::string key;     // system: the shm key
  int64_t offset = 0;  // system: start of the registered range in the shm object
  int64_t byte_size = 0;
  int device_id = -1;   // cuda: the device ordinal
  bool pinned = false;  // system: page-locked for the GPU (cudaHostRegister)
  int64_t calls_in_flight = 0;
};

// One registered byte range. Thread-safety: every method may be called from several threads at
// once; concurrent CopyOut calls must target disjoint ranges (as concurrent calls' outputs do).
class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;

  virtual RegionKind kind() const = 0;
  virtual int64_t byte_size() const = 0;
  // Where the bytes live: Host or PinnedHost (system), Cuda(n) (cuda). Meaningful for mapped
  // regions only.
  virtual Device device() const = 0;
  // The address of byte 0 in this process (host or device pointer), or null when the bytes are
  // not addressable here (a remote kind): then only CopyIn / CopyOut reach them.
  virtual void* mapped_data() const { return nullptr; }
  bool is_mapped() const { return mapped_data() != nullptr; }
  // Whether the server may write the region (output regions).
  virtual bool writable() const { return true; }
  // Identifies the memory behind the region: two regions with the same backing_id share bytes,
  // byte i of this region being byte backing_offset() + i of that memory. Used to refuse an
  // output that overlaps an input.
  virtual std::string backing_id() const = 0;
  virtual int64_t backing_offset() const { return 0; }

  // Copies region bytes [offset, offset + dst.nbytes()) into `dst` (contiguous, host or device
  // memory as dst.device() says). Synchronous. INVALID_ARGUMENT if the range is outside.
  virtual absl::Status CopyIn(int64_t offset, const TensorView& dst) const = 0;
  // Copies `src` (contiguous, host or device) to region bytes [offset, offset + src.nbytes()).
  // Synchronous.
  virtual absl::Status CopyOut(const TensorView& src, int64_t offset) const = 0;
  // CopyIn of several (offset, dst) ranges, waiting once: a device region enqueues every copy
  // and synchronizes after the last (a call's routing tensors cost one wait, not two). Default:
  // CopyIn each.
  using CopyInRange = std::pair<int64_t, TensorView>;
  virtual absl::Status CopyInMany(absl::Span<const CopyInRange> copies) const;

  // Fills the kind-specific fields of `info` (key, offset, device_id, pinned).
  virtual void Describe(RegionInfo* info) const = 0;

  // FAILED_PRECONDITION when the memory behind the region no longer covers it: a system
  // object its owner shrank after registration (touching the mapping past its end would
  // fault the server: SIGBUS). Checked as each call resolves the region; a shrink during the
  // call is not caught (the objects are the server user's own: see README "Shared memory").
  virtual absl::Status CheckIntact() const { return absl::OkStatus(); }
};

// OK when [offset, offset + bytes) lies inside [0, region_bytes) (overflow-free); otherwise
// INVALID_ARGUMENT starting with `what`.
absl::Status CheckRegionRange(int64_t region_bytes, int64_t offset, int64_t bytes,
                              absl::string_view what);

// Page-locks host memory so a device copies it by DMA; the CUDA backend provides one
// (cudaHostRegister). Thread-safe.
// Page-locks host memory for DMA (the CUDA backend's cudaHostRegister). Unpin may wait for the
// whole device, so it is called on the background release thread (core/background_release.h):
// both must be thread-safe, and a pinner lives as long as the process.
class HostMemoryPinner {
 public:
  virtual ~HostMemoryPinner() = default;
  virtual absl::Status Pin(void* data, size_t bytes) = 0;
  virtual void Unpin(void* data) = 0;
};

// The CUDA backend's pinner (cudaHostRegister), living as long as the process; null where no
// CUDA backend is linked.
HostMemoryPinner* CudaHostPinner();

// A POSIX shared-memory object's range [offset, offset + byte_size), mapped read-write (read-only
// if the object is not writable to this process: then not usable as an output). Refusals:
// INVALID_ARGUMENT for a malformed key ("/name", no other '/') or a negative offset / non-positive
// size; NOT_FOUND for a key that does not exist; PERMISSION_DENIED when it cannot be opened;
// INVALID_ARGUMENT when the range exceeds the object's size (fstat). With `pinner` the mapping is
// page-locked (device() PinnedHost); if pinning fails the region stays usable, unpinned.
absl::StatusOr<std::unique_ptr<MemoryRegion>> OpenSystemSharedMemory(const std::string& key,
                                                                     int64_t offset,
                                                                     int64_t byte_size,
                                                                     HostMemoryPinner* pinner);

struct RegionRegistryOptions {
  // The engine's backend. kCuda: system regions are page-locked and CUDA regions accepted, both
  // through the CUDA BackendProvider; other backends refuse CUDA regions.
  Backend backend = Backend::kCpu;
  // Most regions registered at once (each holds a mapping); beyond, RESOURCE_EXHAUSTED.
  int max_regions = 256;
};

class RegionRegistry;

// A registered region held by one call (counted in calls_in_flight). Movable; releases on
// destruction or Release(). Keeps the region alive even if the registry goes first.
class RegionLease {
 public:
  RegionLease() = default;
  RegionLease(RegionLease&& other) noexcept = default;
  RegionLease& operator=(RegionLease&& other) noexcept;
  ~RegionLease() { Release(); }

  explicit operator bool() const { return entry_ != nullptr; }
  const MemoryRegion& region() const;
  const std::string& name() const;
  void Release();

 private:
  friend class RegionRegistry;
  struct Entry;
  explicit RegionLease(std::shared_ptr<Entry> entry);
  std::shared_ptr<Entry> entry_;
};

// Registered regions by name. Thread-safety: every method from any thread. Opening a region
// (mmap, cudaHostRegister, cudaIpcOpenMemHandle) happens outside the registry's lock.
class RegionRegistry {
 public:
  explicit RegionRegistry(RegionRegistryOptions options = {});
  ~RegionRegistry();
  RegionRegistry(const RegionRegistry&) = delete;
  RegionRegistry& operator=(const RegionRegistry&) = delete;

  // The engine's backend the registry was made for (kCuda: CUDA regions are accepted).
  Backend backend() const { return options_.backend; }

  // OpenSystemSharedMemory under `name`. Besides its refusals: INVALID_ARGUMENT for an empty or
  // overlong name, ALREADY_EXISTS for a name in use, RESOURCE_EXHAUSTED beyond max_regions.
  absl::Status RegisterSystem(const std::string& name, const std::string& key, int64_t offset,
                              int64_t byte_size);
  // A CUDA IPC handle (kCudaIpcHandleBytes, of the base of the client's allocation) opened on
  // device `device_id`; byte_size may not exceed the allocation. INVALID_ARGUMENT for a handle of
  // another length, a bad device or size; FAILED_PRECONDITION when the engine's backend is not
  // cuda or the build has no CUDA.
  absl::Status RegisterCuda(const std::string& name, absl::string_view raw_handle, int device_id,
                            int64_t byte_size);
  // Any region (e.g. a remote kind, or a test's). `key`/`offset` are reported by Status.
  absl::Status Register(const std::string& name, std::unique_ptr<MemoryRegion> region);

  // Unregisters `name`, or every region if `name` is empty (with `kind`: only regions of that
  // kind, and a named region of another kind is NOT_FOUND). NOT_FOUND for an unknown name;
  // FAILED_PRECONDITION (naming the regions and their calls in flight) if a region is in use by
  // a call -- then nothing is unregistered.
  absl::Status Unregister(const std::string& name, std::optional<RegionKind> kind = std::nullopt);
  // `name`'s state, or every region's (sorted by name) if empty. NOT_FOUND for an unknown name.
  absl::StatusOr<std::vector<RegionInfo>> Status(const std::string& name) const;
  // Holds `name` for a call. INVALID_ARGUMENT "<field>: no shared-memory region named ..." if
  // it is not registered.
  absl::StatusOr<RegionLease> Acquire(absl::string_view name, absl::string_view field) const;

  const RegionRegistryOptions& options() const { return options_; }

 private:
  absl::Status CheckNewName(const std::string& name) const;

  const RegionRegistryOptions options_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<RegionLease::Entry>> regions_;
  HostMemoryPinner* pinner_ = nullptr;  // backend cuda only; process-lifetime
};

// A tensor's bytes named by a call: the wire's RegionRef.
struct RegionRef {
  std::string name;
  int64_t offset = 0;
  int64_t byte_size = 0;
};

// The leases of one call, by region name: a call counts once in a region's calls_in_flight
// however many of its tensors live there. Not thread-safe (one call is resolved on one thread).
class CallLeases {
 public:
  // The call's lease on `name`, acquired on first use (RegionRegistry::Acquire's refusals).
  absl::StatusOr<std::shared_ptr<RegionLease>> Get(const RegionRegistry& registry,
                                                   absl::string_view name, absl::string_view field);
  // Drops this object's references (the regions go once the call's RegionTensors released theirs).
  void Clear() { leases_.clear(); }

 private:
  std::vector<std::shared_ptr<RegionLease>> leases_;  // a handful: searched linearly
};

enum class RegionAccess : uint8_t {
  kRead,      // read in place where possible
  kSnapshot,  // read into a private copy: values validated once (expert ids) cannot change after
  kWrite,
};

// One tensor of a call that lives in a region, resolved for the engine: viewed in place where the
// engine can address it, else staged in a host copy (filled from the region for reads; written
// back by Flush for writes). Holds the region's lease. Movable.
class RegionTensor {
 public:
  // `ref` must name a registered region and a range inside it of exactly
  // product(shape) * itemsize(dtype) bytes (INVALID_ARGUMENT naming `field`, the region and what
  // was expected otherwise); kWrite needs a writable region. A region on a CUDA device is viewed
  // in place only if `device_ok` (the engine reads that tensor on a device), else staged; so is a
  // range not aligned to the dtype's size, and any region that is not mapped here. The lease
  // comes from `leases` (shared by the call's tensors) or, if null, is the tensor's own.
  // With `defer_copy` a staged read is not filled yet (pending_copy()): FillPending fills a
  // call's tensors together, one wait per region.
  static absl::StatusOr<RegionTensor> Resolve(const RegionRegistry& registry, const RegionRef& ref,
                                              DType dtype, const Shape& shape, RegionAccess access,
                                              bool device_ok, absl::string_view field,
                                              CallLeases* leases = nullptr,
                                              bool defer_copy = false);
  // Fills every pending staged copy among `tensors`, grouped by region (CopyInMany).
  static absl::Status FillPending(absl::Span<RegionTensor> tensors);
  RegionTensor() = default;
  RegionTensor(RegionTensor&&) = default;
  RegionTensor& operator=(RegionTensor&&) = default;

  // What the engine reads (kRead, kSnapshot) or writes (kWrite).
  const TensorView& view() const { return view_; }
  // Whether view() is a staged host copy rather than the region's own bytes.
  bool staged() const { return staged_; }
  // Staged, and not yet filled (Resolve's defer_copy).
  bool pending_copy() const { return pending_copy_; }
  // kWrite: copies a staged view() into the region (nothing when written in place).
  absl::Status Flush() const;
  // Lets the region go (Unregister may succeed afterwards); view() must not be used after.
  void Release() { lease_.reset(); }

  const RegionRef& ref() const { return ref_; }
  const std::string& field() const { return field_; }
  const MemoryRegion& region() const { return lease_->region(); }

  // Whether this tensor's bytes and `other`'s share memory (same backing, intersecting ranges).
  bool Overlaps(const RegionTensor& other) const;

 private:
  std::shared_ptr<RegionLease> lease_;
  RegionRef ref_;
  std::string field_;
  RegionAccess access_ = RegionAccess::kRead;
  TensorView view_;
  Tensor staging_;
  bool staged_ = false;
  bool pending_copy_ = false;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_MEMORY_REGION_H_
