// A grow-only device or pinned-host allocation, reused across forwards. No CUDA types here, so
// the header compiles without CUDA; not thread-safe (one owner, one step at a time).
#ifndef MOESERVE_CORE_CUDA_GROW_ONLY_BUFFER_H_
#define MOESERVE_CORE_CUDA_GROW_ONLY_BUFFER_H_

#include <cstddef>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace moeserve {

class GrowOnlyBuffer {
 public:
  enum class Memory { kDevice, kPinnedHost };
  // Allocations are at least `min_bytes`; with `quarter_slack` a growth allocates 1.25x what
  // was asked, so slowly rising sizes do not reallocate every time.
  GrowOnlyBuffer(Memory memory, size_t min_bytes, bool quarter_slack)
      : memory_(memory), min_bytes_(min_bytes), quarter_slack_(quarter_slack) {}
  GrowOnlyBuffer(const GrowOnlyBuffer&) = delete;
  GrowOnlyBuffer& operator=(const GrowOnlyBuffer&) = delete;
  ~GrowOnlyBuffer();

  // At least `bytes` bytes (contents unspecified after a growth); RESOURCE_EXHAUSTED if the
  // allocation fails. A growth does not wait for the device: the allocation it replaces may
  // still be in use by work queued earlier, and cudaFree / cudaFreeHost wait for every stream
  // of the device (a collective waiting on a peer that failed included, which then never ends).
  // So the replaced allocation is kept until ReleaseSuperseded(). Only when the new one does not
  // fit beside it are the replaced ones freed first (waiting for the device, as before).
  absl::StatusOr<void*> Get(size_t bytes);

  // Frees the allocations that growths replaced; waits for the whole device. Owners call it
  // where their earlier work has completed and none of theirs is queued, e.g. at the start of
  // their next step.
  void ReleaseSuperseded();
  // Bytes of replaced allocations not yet released.
  size_t superseded_bytes() const { return superseded_bytes_; }

 private:
  void FreeOne(void* ptr) const;

  const Memory memory_;
  const size_t min_bytes_;
  const bool quarter_slack_;
  void* ptr_ = nullptr;
  size_t capacity_ = 0;
  std::vector<std::pair<void*, size_t>> superseded_;
  size_t superseded_bytes_ = 0;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_CUDA_GROW_ONLY_BUFFER_H_
