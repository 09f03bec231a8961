// A spin-wait hint for threads that poll for work instead of sleeping.
#ifndef MOESERVE_CORE_CPU_RELAX_H_
#define MOESERVE_CORE_CPU_RELAX_H_

namespace moeserve {

// Lets the sibling hyperthread run and saves power while polling.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace moeserve

#endif  // MOESERVE_CORE_CPU_RELAX_H_
