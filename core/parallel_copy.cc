#include "core/parallel_copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/thread_pool.h"

namespace moeserve {

ParallelCopier::ParallelCopier(int num_threads) : num_threads_(std::max(1, num_threads)) {}
ParallelCopier::~ParallelCopier() = default;

void ParallelCopier::Copy(void* dst, const void* src, size_t bytes) {
  if (num_threads_ == 1 || bytes < kMinParallelBytes) {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return;
  }
  if (pool_ == nullptr) pool_ = std::make_unique<ThreadPool>(num_threads_);
  // Equal shares rounded to 4 KiB so that no two threads write the same page.
  const size_t parts = static_cast<size_t>(num_threads_);
  const size_t share = ((bytes + parts - 1) / parts + 4095) / 4096 * 4096;
  pool_->ParallelFor(static_cast<int64_t>(parts), [&](int64_t i, int) {
    const size_t begin = std::min(bytes, static_cast<size_t>(i) * share);
    const size_t end = std::min(bytes, begin + share);
    if (end > begin) {
      std::memcpy(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin,
                  end - begin);
    }
  });
}

}  // namespace moeserve
