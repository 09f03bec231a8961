// Polling for work instead of sleeping: a thread that polls finds new work within a load, where
// a sleeping one's wake-up costs tens of us on the H200 hosts.
#ifndef MOESERVE_CORE_SPIN_WAIT_H_
#define MOESERVE_CORE_SPIN_WAIT_H_

#include <chrono>

#include "absl/time/time.h"

namespace moeserve {

// A spin-wait hint: lets the sibling hyperthread run and saves power while polling.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Polls until `found()` (true is returned) or `stop()` holds or `spin` has passed (false). Both
// should be an atomic load each: the clock is read once per 64 looks (tens of ns each).
template <typename Found, typename Stop>
bool PollFor(absl::Duration spin, Found found, Stop stop) {
  const auto until = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(spin);
  while (true) {
    for (int i = 0; i < 64; ++i) {
      if (found()) return true;
      if (stop()) return false;
      CpuRelax();
    }
    if (std::chrono::steady_clock::now() >= until) return false;
  }
}

}  // namespace moeserve

#endif  // MOESERVE_CORE_SPIN_WAIT_H_
