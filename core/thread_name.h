// Names the calling thread for top -H, /proc/PID/task/*/comm, gdb and perf, so that a server's CPU
// can be read by role (e.g. "ms-sched0", "ms-worker1") instead of as one "moeserve" per thread.
#ifndef MOESERVE_CORE_THREAD_NAME_H_
#define MOESERVE_CORE_THREAD_NAME_H_

#include <string>

namespace moeserve {

// Sets the calling thread's name to `name`, cut to the 15 bytes Linux keeps. Best effort: does
// nothing where threads cannot be named. Thread-safe (names only the caller).
void SetCurrentThreadName(const std::string& name);

}  // namespace moeserve

#endif  // MOESERVE_CORE_THREAD_NAME_H_
