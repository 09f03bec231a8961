// libFuzzer target: a .safetensors file's bytes through SafetensorsFile::Open (the header
// parser and every check on it). Besides no crash and no sanitizer report: an accepted file's
// tensors lie inside the file, in order, and their sizes are shape x item size.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/checkpoint/safetensors.h"

namespace {

void Check(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "fuzz_safetensors: violated: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using moeserve::checkpoint::SafetensorsFile;
  // The parser maps a path: an in-memory file, reached through /proc.
  const int fd = memfd_create("fuzz.safetensors", MFD_CLOEXEC);
  if (fd < 0) return 0;
  size_t written = 0;
  while (written < size) {
    const ssize_t n = write(fd, data + written, size - written);
    if (n <= 0) break;
    written += static_cast<size_t>(n);
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  auto file = SafetensorsFile::Open(path);
  if (file.ok()) {
    int64_t total = 0;
    const uint8_t* prev_end = nullptr;
    for (const std::string& name : (*file)->TensorNames()) {
      auto t = (*file)->Get(name);
      Check(t.ok(), "a listed tensor is not found");
      Check(t->nbytes >= 0 && t->numel() >= 0, "negative size");
      Check(t->numel() * static_cast<int64_t>(moeserve::checkpoint::StDTypeSize(t->dtype)) ==
                t->nbytes,
            "nbytes != numel x itemsize");
      Check(prev_end == nullptr || t->data == prev_end, "tensors not contiguous and in order");
      prev_end = t->data + t->nbytes;
      total += t->nbytes;
      // Touch the first and last bytes (ASan would flag a view outside the mapping).
      if (t->nbytes > 0) {
        volatile uint8_t sink = t->data[0] ^ t->data[t->nbytes - 1];
        (void)sink;
      }
    }
    Check(total <= static_cast<int64_t>(size), "tensors larger than the file");
  } else {
    Check(!file.status().message().empty(), "a refusal without a message");
  }
  close(fd);
  return 0;
}
