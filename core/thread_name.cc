#include "core/thread_name.h"

#include <pthread.h>

namespace moeserve {

void SetCurrentThreadName(const std::string& name) {
#if defined(__linux__)
  // Linux keeps 16 bytes with the terminating NUL; a longer name makes the call fail (ERANGE).
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
#else
  (void)name;
#endif
}

}  // namespace moeserve
