// A POSIX shared-memory object for tests, as a frontend would make one: created under a unique
// key, mapped read-write here, unlinked and unmapped on destruction.
#ifndef MOESERVE_TESTS_TESTING_SHM_UTIL_H_
#define MOESERVE_TESTS_TESTING_SHM_UTIL_H_

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace moeserve::testing {

class ShmObject {
 public:
  // `bytes` > 0. On failure ok() is false (the test should fail, not crash).
  explicit ShmObject(size_t bytes, mode_t mode = 0600) : bytes_(bytes) {
    static std::atomic<int> counter{0};
    key_ = "/moeserve_test_" + std::to_string(getpid()) + "_" + std::to_string(counter++);
    const int fd = shm_open(key_.c_str(), O_CREAT | O_EXCL | O_RDWR, mode);
    if (fd < 0) return;
    if (ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) data_ = static_cast<std::byte*>(p);
    }
    close(fd);
  }
  ~ShmObject() {
    if (data_ != nullptr) munmap(data_, bytes_);
    shm_unlink(key_.c_str());
  }
  ShmObject(const ShmObject&) = delete;
  ShmObject& operator=(const ShmObject&) = delete;

  bool ok() const { return data_ != nullptr; }
  const std::string& key() const { return key_; }
  size_t size() const { return bytes_; }
  std::byte* data() const { return data_; }
  template <typename T>
  T* at(size_t offset) const {
    return reinterpret_cast<T*>(data_ + offset);
  }
  void Write(size_t offset, const void* src, size_t n) const {
    std::memcpy(data_ + offset, src, n);
  }
  // Resizes the object, as a misbehaving client might while it is registered (this mapping
  // keeps its size: touch nothing past the new end).
  bool Truncate(size_t bytes) const {
    const int fd = shm_open(key_.c_str(), O_RDWR, 0);
    if (fd < 0) return false;
    const bool ok = ftruncate(fd, static_cast<off_t>(bytes)) == 0;
    close(fd);
    return ok;
  }

 private:
  std::string key_;
  size_t bytes_ = 0;
  std::byte* data_ = nullptr;
};

}  // namespace moeserve::testing

#endif  // MOESERVE_TESTS_TESTING_SHM_UTIL_H_
