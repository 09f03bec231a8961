#include "core/memory_region.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/background_release.h"
#include "core/provider_registry.h"
#include "core/status_macros.h"

namespace moeserve {

absl::string_view RegionKindName(RegionKind kind) {
  switch (kind) {
    case RegionKind::kSystem:
      return "system";
    case RegionKind::kCuda:
      return "cuda";
    case RegionKind::kRemote:
      return "remote";
  }
  return "unknown";
}

absl::Status CheckRegionRange(int64_t region_bytes, int64_t offset, int64_t bytes,
                              absl::string_view what) {
  if (offset < 0 || bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": offset ", offset, " and byte_size ", bytes, " must be >= 0"));
  }
  // offset + bytes <= region_bytes without forming the sum.
  if (offset > region_bytes || bytes > region_bytes - offset) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": bytes [", offset, ", ", offset, " + ",
                                                   bytes, ") lie outside the region's registered ",
                                                   region_bytes, " bytes"));
  }
  return absl::OkStatus();
}

namespace {

absl::Status CheckContiguous(const TensorView& t, absl::string_view what) {
  if (!t.is_contiguous()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": needs a contiguous tensor, got ", t.DebugString()));
  }
  return absl::OkStatus();
}

// A POSIX shared-memory object's range, mapped into this process.
class SystemSharedMemoryRegion final : public MemoryRegion {
 public:
  SystemSharedMemoryRegion(std::string key, std::string backing, int fd, int64_t offset,
                           int64_t byte_size, void* map, size_t map_bytes, size_t lead,
                           bool writable, HostMemoryPinner* pinner)
      : fd_(fd),
        key_(std::move(key)),
        backing_(std::move(backing)),
        offset_(offset),
        byte_size_(byte_size),
        map_(map),
        map_bytes_(map_bytes),
        data_(static_cast<std::byte*>(map) + lead),
        writable_(writable) {
    if (pinner != nullptr) {
      const absl::Status s = pinner->Pin(map_, map_bytes_);
      if (s.ok()) {
        pinner_ = pinner;
      } else {
        std::fprintf(stderr,
                     "moeserve: shared-memory key %s stays unpinned (copies are staged): %s\n",
                     key_.c_str(), std::string(s.message()).c_str());
      }
    }
  }
  ~SystemSharedMemoryRegion() override {
    if (pinner_ != nullptr) {
      // Unlocking waits for the whole device (cudaHostUnregister): on the background release
      // thread, not on the one that unregistered the region or answered its last call.
      ReleaseInBackground([pinner = pinner_, map = map_, bytes = map_bytes_, fd = fd_] {
        pinner->Unpin(map);
        munmap(map, bytes);
        close(fd);
      });
      return;
    }
    munmap(map_, map_bytes_);
    close(fd_);
  }

  absl::Status CheckIntact() const override {
    struct stat st;
    if (fstat(fd_, &st) != 0) {
      return absl::InternalError(absl::StrCat("fstat of ", key_, ": ", std::strerror(errno)));
    }
    if (static_cast<int64_t>(st.st_size) - offset_ < byte_size_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shared-memory object ", key_, " shrank to ", static_cast<int64_t>(st.st_size),
          " bytes, below the registered range [", offset_, ", ", offset_ + byte_size_,
          "); unregister the region and register it again"));
    }
    return absl::OkStatus();
  }

  RegionKind kind() const override { return RegionKind::kSystem; }
  int64_t byte_size() const override { return byte_size_; }
  Device device() const override {
    return pinner_ != nullptr ? Device::PinnedHost() : Device::Host();
  }
  void* mapped_data() const override { return data_; }
  bool writable() const override { return writable_; }
  std::string backing_id() const override { return backing_; }
  int64_t backing_offset() const override { return offset_; }

  absl::Status CopyIn(int64_t offset, const TensorView& dst) const override {
    MOESERVE_RETURN_IF_ERROR(CheckContiguous(dst, "CopyIn"));
    if (!dst.device().is_host()) {
      return absl::UnimplementedError("a system region copies to host memory only");
    }
    const int64_t n = static_cast<int64_t>(dst.nbytes());
    MOESERVE_RETURN_IF_ERROR(CheckRegionRange(byte_size_, offset, n, "CopyIn"));
    if (n > 0) std::memcpy(dst.raw_data(), data_ + offset, n);
    return absl::OkStatus();
  }
  absl::Status CopyOut(const TensorView& src, int64_t offset) const override {
    MOESERVE_RETURN_IF_ERROR(CheckContiguous(src, "CopyOut"));
    if (!src.device().is_host()) {
      return absl::UnimplementedError("a system region copies from host memory only");
    }
    if (!writable_) {
      return absl::FailedPreconditionError(
          absl::StrCat("shared-memory key ", key_, " is read-only to the server"));
    }
    const int64_t n = static_cast<int64_t>(src.nbytes());
    MOESERVE_RETURN_IF_ERROR(CheckRegionRange(byte_size_, offset, n, "CopyOut"));
    if (n > 0) std::memcpy(data_ + offset, src.raw_data(), n);
    return absl::OkStatus();
  }
  void Describe(RegionInfo* info) const override {
    info->key = key_;
    info->offset = offset_;
    info->pinned = pinner_ != nullptr;
  }

 private:
  const int fd_;  // the object, open: CheckIntact's fstat
  const std::string key_;
  const std::string backing_;  // the object's device and inode: the same object under any key
  const int64_t offset_;
  const int64_t byte_size_;
  void* const map_;
  const size_t map_bytes_;
  std::byte* const data_;
  const bool writable_;
  HostMemoryPinner* pinner_ = nullptr;  // set when pinned; lives as long as the process
};

// Closes a file descriptor on scope exit.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) close(fd);
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<MemoryRegion>> OpenSystemSharedMemory(const std::string& key,
                                                                     int64_t offset,
                                                                     int64_t byte_size,
                                                                     HostMemoryPinner* pinner) {
  // shm_open's portable form: "/name", no further slash (glibc maps it to /dev/shm/name).
  if (key.size() < 2 || key[0] != '/' || key.find('/', 1) != std::string::npos ||
      key.size() > NAME_MAX || key.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("key: got '", key, "', expected a POSIX shared-memory name '/name' (one ",
                     "leading slash, no other, at most ", NAME_MAX, " characters)"));
  }
  if (offset < 0 || byte_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("offset ", offset, " and byte_size ", byte_size,
                                                   ": expected offset >= 0, byte_size > 0"));
  }
  bool writable = true;
  int fd = shm_open(key.c_str(), O_RDWR, 0);
  if (fd < 0 && (errno == EACCES || errno == EPERM)) {
    writable = false;
    fd = shm_open(key.c_str(), O_RDONLY, 0);
  }
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::NotFoundError(
          absl::StrCat("key: no shared-memory object ", key, " exists on the server's host"));
    }
    if (err == EACCES || err == EPERM) {
      return absl::PermissionDeniedError(
          absl::StrCat("key: the server may not open shared-memory object ", key));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("key: shm_open(", key, ") failed: ", std::strerror(err)));
  }
  FdCloser closer{fd};
  struct stat st;
  if (fstat(fd, &st) != 0) {
    return absl::InternalError(absl::StrCat("fstat of ", key, ": ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("key: ", key, " is not a regular object"));
  }
  const int64_t object_bytes = static_cast<int64_t>(st.st_size);
  if (offset > object_bytes || byte_size > object_bytes - offset) {
    return absl::InvalidArgumentError(absl::StrCat("offset ", offset, " + byte_size ", byte_size,
                                                   " exceeds the ", object_bytes,
                                                   " bytes of shared-memory object ", key));
  }
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t map_offset = offset / page * page;
  const size_t lead = static_cast<size_t>(offset - map_offset);
  const size_t map_bytes = lead + static_cast<size_t>(byte_size);
  void* map = mmap(nullptr, map_bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED,
                   fd, static_cast<off_t>(map_offset));
  if (map == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of ", byte_size, " bytes of ", key, ": ", std::strerror(errno)));
  }
  // The descriptor stays open: each call checks the object still covers the range.
  closer.fd = -1;
  return std::unique_ptr<MemoryRegion>(
      new SystemSharedMemoryRegion(key, absl::StrCat("system:", st.st_dev, ":", st.st_ino), fd,
                                   offset, byte_size, map, map_bytes, lead, writable, pinner));
}

// ---------------------------------------------------------------------------------------------
// Registry and leases.

struct RegionLease::Entry {
  std::string name;
  std::unique_ptr<MemoryRegion> region;
  std::atomic<int64_t> in_flight{0};
};

RegionLease::RegionLease(std::shared_ptr<Entry> entry) : entry_(std::move(entry)) {
  entry_->in_flight.fetch_add(1);
}

RegionLease& RegionLease::operator=(RegionLease&& other) noexcept {
  if (this != &other) {
    Release();
    entry_ = std::move(other.entry_);
  }
  return *this;
}

const MemoryRegion& RegionLease::region() const { return *entry_->region; }
const std::string& RegionLease::name() const { return entry_->name; }

void RegionLease::Release() {
  if (entry_ != nullptr) {
    entry_->in_flight.fetch_sub(1);
    entry_.reset();
  }
}

namespace {

// Adapts the CUDA backend's host-registration functions.
class ProviderPinner final : public HostMemoryPinner {
 public:
  explicit ProviderPinner(const BackendProvider* provider) : provider_(provider) {}
  absl::Status Pin(void* data, size_t bytes) override {
    return provider_->register_host_memory(data, bytes);
  }
  void Unpin(void* data) override { provider_->unregister_host_memory(data); }

 private:
  const BackendProvider* provider_;
};

constexpr size_t kMaxNameBytes = 256;

}  // namespace

HostMemoryPinner* CudaHostPinner() {
  // Providers live as long as the process, and so does this (regions may outlive their users).
  static HostMemoryPinner* const pinner = []() -> HostMemoryPinner* {
    const BackendProvider* cuda = ProviderRegistry::Global().FindBackend(Backend::kCuda);
    if (cuda == nullptr || !cuda->register_host_memory || !cuda->unregister_host_memory) {
      return nullptr;
    }
    return new ProviderPinner(cuda);
  }();
  return pinner;
}

RegionRegistry::RegionRegistry(RegionRegistryOptions options) : options_(options) {
  if (options_.backend == Backend::kCuda) {
    pinner_ = CudaHostPinner();
  }
}

// Leases still out keep their region mapped until they are released.
RegionRegistry::~RegionRegistry() {
  std::lock_guard<std::mutex> lock(mu_);
  regions_.clear();
}

absl::Status RegionRegistry::CheckNewName(const std::string& name) const {
  if (name.empty() || name.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("name: got ", name.size(),
                                                   " bytes, expected a region name of 1 to ",
                                                   kMaxNameBytes, " bytes"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (regions_.count(name) > 0) {
    return absl::AlreadyExistsError(absl::StrCat("name: a shared-memory region named '", name,
                                                 "' is already registered; unregister it "
                                                 "first or choose another name"));
  }
  if (static_cast<int>(regions_.size()) >= options_.max_regions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot register '", name, "': ", regions_.size(), " regions are registered, the maximum"));
  }
  return absl::OkStatus();
}

absl::Status RegionRegistry::RegisterSystem(const std::string& name, const std::string& key,
                                            int64_t offset, int64_t byte_size) {
  MOESERVE_RETURN_IF_ERROR(CheckNewName(name));
  MOESERVE_ASSIGN_OR_RETURN(std::unique_ptr<MemoryRegion> region,
                            OpenSystemSharedMemory(key, offset, byte_size, pinner_));
  return Register(name, std::move(region));
}

absl::Status RegionRegistry::RegisterCuda(const std::string& name, absl::string_view raw_handle,
                                          int device_id, int64_t byte_size) {
  MOESERVE_RETURN_IF_ERROR(CheckNewName(name));
  if (raw_handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("raw_handle: got ", raw_handle.size(),
                                                   " bytes, expected a ", kCudaIpcHandleBytes,
                                                   "-byte cudaIpcMemHandle_t"));
  }
  if (device_id < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device_id: got ", device_id, ", expected a CUDA device ordinal >= 0"));
  }
  if (byte_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("byte_size: got ", byte_size, ", expected > 0"));
  }
  const BackendProvider* cuda = ProviderRegistry::Global().FindBackend(Backend::kCuda);
  if (cuda == nullptr || !cuda->open_ipc_region) {
    return absl::FailedPreconditionError(
        "CUDA shared-memory regions need a server built with CUDA; this build has none");
  }
  if (options_.backend != Backend::kCuda) {
    return absl::FailedPreconditionError(absl::StrCat(
        "CUDA shared-memory regions need the cuda backend; this server runs backend ",
        BackendName(options_.backend), " (register a system shared-memory region instead)"));
  }
  MOESERVE_ASSIGN_OR_RETURN(std::unique_ptr<MemoryRegion> region,
                            cuda->open_ipc_region(raw_handle, device_id, byte_size));
  return Register(name, std::move(region));
}

absl::Status RegionRegistry::Register(const std::string& name,
                                      std::unique_ptr<MemoryRegion> region) {
  MOESERVE_RETURN_IF_ERROR(CheckNewName(name));
  if (region == nullptr) return absl::InvalidArgumentError("Register: no region");
  auto entry = std::make_shared<RegionLease::Entry>();
  entry->name = name;
  entry->region = std::move(region);
  std::lock_guard<std::mutex> lock(mu_);
  // Checked again: another caller may have taken the name while the region was opened.
  if (regions_.count(name) > 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("name: a shared-memory region named '", name, "' is already registered"));
  }
  if (static_cast<int>(regions_.size()) >= options_.max_regions) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot register '", name,
                                                     "': ", options_.max_regions,
                                                     " regions are registered, the maximum"));
  }
  regions_.emplace(name, std::move(entry));
  return absl::OkStatus();
}

absl::Status RegionRegistry::Unregister(const std::string& name, std::optional<RegionKind> kind) {
  std::vector<std::shared_ptr<RegionLease::Entry>> removed;  // unmapped outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto selected = [&kind](const RegionLease::Entry& e) {
      return !kind.has_value() || e.region->kind() == *kind;
    };
    std::vector<std::string> busy;
    auto check = [&busy](const RegionLease::Entry& e) {
      const int64_t n = e.in_flight.load();
      if (n > 0) busy.push_back(absl::StrCat("'", e.name, "' (", n, " calls in flight)"));
    };
    if (name.empty()) {
      for (const auto& [n, e] : regions_) {
        if (selected(*e)) check(*e);
      }
    } else {
      auto it = regions_.find(name);
      if (it == regions_.end()) {
        return absl::NotFoundError(
            absl::StrCat("name: no shared-memory region named '", name, "' is registered"));
      }
      if (!selected(*it->second)) {
        return absl::NotFoundError(absl::StrCat(
            "name: '", name, "' is a ", RegionKindName(it->second->region->kind()),
            " region, not a ", RegionKindName(*kind), " one; unregister it as its kind"));
      }
      check(*it->second);
    }
    if (!busy.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot unregister while calls use the region: ", absl::StrJoin(busy, ", "),
                       "; nothing was unregistered, retry when the calls have finished"));
    }
    if (name.empty()) {
      for (auto it = regions_.begin(); it != regions_.end();) {
        if (selected(*it->second)) {
          removed.push_back(std::move(it->second));
          it = regions_.erase(it);
        } else {
          ++it;
        }
      }
    } else {
      auto it = regions_.find(name);
      removed.push_back(std::move(it->second));
      regions_.erase(it);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<RegionInfo>> RegionRegistry::Status(const std::string& name) const {
  std::vector<RegionInfo> out;
  std::lock_guard<std::mutex> lock(mu_);
  auto describe = [&out](const RegionLease::Entry& e) {
    RegionInfo info;
    info.name = e.name;
    info.kind = e.region->kind();
    info.byte_size = e.region->byte_size();
    if (e.region->kind() == RegionKind::kCuda) info.device_id = e.region->device().index;
    e.region->Describe(&info);
    info.calls_in_flight = e.in_flight.load();
    out.push_back(std::move(info));
  };
  if (name.empty()) {
    for (const auto& [n, e] : regions_) describe(*e);
    return out;
  }
  auto it = regions_.find(name);
  if (it == regions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("name: no shared-memory region named '", name, "' is registered"));
  }
  describe(*it->second);
  return out;
}

absl::StatusOr<RegionLease> RegionRegistry::Acquire(absl::string_view name,
                                                    absl::string_view field) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(std::string(name));
  if (it == regions_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": no shared-memory region named '", name,
                     "' is registered (SharedMemoryStatus lists the registered regions)"));
  }
  return RegionLease(it->second);
}

// ---------------------------------------------------------------------------------------------
// Resolving a call's tensor.

absl::StatusOr<std::shared_ptr<RegionLease>> CallLeases::Get(const RegionRegistry& registry,
                                                             absl::string_view name,
                                                             absl::string_view field) {
  for (const std::shared_ptr<RegionLease>& lease : leases_) {
    if (lease->name() == name) return lease;
  }
  MOESERVE_ASSIGN_OR_RETURN(RegionLease lease, registry.Acquire(name, field));
  leases_.push_back(std::make_shared<RegionLease>(std::move(lease)));
  return leases_.back();
}

absl::StatusOr<RegionTensor> RegionTensor::Resolve(const RegionRegistry& registry,
                                                   const RegionRef& ref, DType dtype,
                                                   const Shape& shape, RegionAccess access,
                                                   bool device_ok, absl::string_view field,
                                                   CallLeases* leases, bool defer_copy) {
  RegionTensor t;
  if (leases != nullptr) {
    MOESERVE_ASSIGN_OR_RETURN(t.lease_, leases->Get(registry, ref.name, field));
  } else {
    MOESERVE_ASSIGN_OR_RETURN(RegionLease own, registry.Acquire(ref.name, field));
    t.lease_ = std::make_shared<RegionLease>(std::move(own));
  }
  t.ref_ = ref;
  t.field_ = std::string(field);
  t.access_ = access;
  const MemoryRegion& region = t.lease_->region();
  MOESERVE_RETURN_IF_ERROR(region.CheckIntact());
  const int64_t numel = NumElements(shape);
  const int64_t itemsize = static_cast<int64_t>(DTypeSize(dtype));
  int64_t expected = 0;
  if (numel < 0 || __builtin_mul_overflow(numel, itemsize, &expected)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": shape ", ShapeToString(shape), " has no valid byte size"));
  }
  if (ref.byte_size != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": byte_size ", ref.byte_size, " does not match the tensor: shape ",
        ShapeToString(shape), " x ", itemsize, " bytes of ", DTypeName(dtype), " = ", expected));
  }
  MOESERVE_RETURN_IF_ERROR(CheckRegionRange(region.byte_size(), ref.offset, ref.byte_size,
                                            absl::StrCat(field, " in region '", ref.name, "'")));
  if (access == RegionAccess::kWrite && !region.writable()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": region '", ref.name,
                                                   "' is read-only to the server; an output "
                                                   "needs a region it may write"));
  }
  if (region.is_mapped() && access != RegionAccess::kSnapshot) {
    auto* p = static_cast<std::byte*>(region.mapped_data()) + ref.offset;
    const Device device = region.device();
    const bool aligned = reinterpret_cast<uintptr_t>(p) % itemsize == 0;
    if (aligned && (device.is_host() || device_ok)) {
      t.view_ = TensorView(static_cast<void*>(p), dtype, shape, device);
      return t;
    }
  }
  // Staged: a host copy the engine can read, or write for Flush to copy back.
  t.staging_ = Tensor::Empty(dtype, shape);
  t.view_ = t.staging_.view();
  t.staged_ = true;
  if (access != RegionAccess::kWrite) {
    if (defer_copy) {
      t.pending_copy_ = true;
    } else {
      MOESERVE_RETURN_IF_ERROR(region.CopyIn(ref.offset, t.view_));
    }
  }
  return t;
}

absl::Status RegionTensor::FillPending(absl::Span<RegionTensor> tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].pending_copy_) continue;
    // Every pending tensor of this one's region, in one CopyInMany.
    const MemoryRegion* region = &tensors[i].region();
    std::vector<MemoryRegion::CopyInRange> copies;
    for (size_t j = i; j < tensors.size(); ++j) {
      RegionTensor& t = tensors[j];
      if (!t.pending_copy_ || &t.region() != region) continue;
      copies.emplace_back(t.ref_.offset, t.view_);
      t.pending_copy_ = false;
    }
    MOESERVE_RETURN_IF_ERROR(region->CopyInMany(copies));
  }
  return absl::OkStatus();
}

absl::Status MemoryRegion::CopyInMany(absl::Span<const CopyInRange> copies) const {
  for (const CopyInRange& c : copies) MOESERVE_RETURN_IF_ERROR(CopyIn(c.first, c.second));
  return absl::OkStatus();
}

absl::Status RegionTensor::Flush() const {
  if (!staged_ || access_ != RegionAccess::kWrite) return absl::OkStatus();
  return lease_->region().CopyOut(view_, ref_.offset);
}

bool RegionTensor::Overlaps(const RegionTensor& other) const {
  if (lease_ == nullptr || other.lease_ == nullptr) return false;
  const MemoryRegion& a = region();
  const MemoryRegion& b = other.region();
  if (a.backing_id() != b.backing_id()) return false;
  if (ref_.byte_size == 0 || other.ref_.byte_size == 0) return false;
  const int64_t a0 = a.backing_offset() + ref_.offset, a1 = a0 + ref_.byte_size;
  const int64_t b0 = b.backing_offset() + other.ref_.offset, b1 = b0 + other.ref_.byte_size;
  return a0 < b1 && b0 < a1;
}

}  // namespace moeserve
