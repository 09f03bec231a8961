// A grow-only device or pinned-host allocation, reused across forwards. No CUDA types here, so
// the header compiles without CUDA; not thread-safe (one forward at a time per owner).
#ifndef MOESERVE_CORE_CUDA_GROW_ONLY_BUFFER_H_
#define MOESERVE_CORE_CUDA_GROW_ONLY_BUFFER_H_

#include <cstddef>

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
  // allocation fails.
  absl::StatusOr<void*> Get(size_t bytes);

 private:
  void Free();

  const Memory memory_;
  const size_t min_bytes_;
  const bool quarter_slack_;
  void* ptr_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_CUDA_GROW_ONLY_BUFFER_H_
