// A stream held by a host function until Release() (at most 30 s): to cudaFree, cudaFreeHost and
// cudaHostUnregister, which wait for every stream of the device, it looks like a step in flight or
// a collective waiting for its peer. GPU tests only.
#ifndef MOESERVE_TESTS_CUDA_HELD_STREAM_H_
#define MOESERVE_TESTS_CUDA_HELD_STREAM_H_

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <utility>

namespace moeserve::testing {

class HeldStream {
 public:
  HeldStream() {
    cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    cudaLaunchHostFunc(stream_, &Hold, this);
  }
  ~HeldStream() {
    Release();
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  HeldStream(const HeldStream&) = delete;
  HeldStream& operator=(const HeldStream&) = delete;
  void Release() { released_ = true; }

 private:
  static void CUDART_CB Hold(void* self) {
    auto* held = static_cast<HeldStream*>(self);
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!held->released_ && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::yield();
    }
  }
  cudaStream_t stream_ = nullptr;
  std::atomic<bool> released_{false};
};

// Runs `fn` on its own thread (device 0); true if it returned within 5 s. `held` is released
// either way, so that a call that waited for it finishes.
template <typename Fn>
bool ReturnsWhileHeld(HeldStream& held, Fn&& fn) {
  std::atomic<bool> done{false};
  std::thread t([&] {
    cudaSetDevice(0);
    std::forward<Fn>(fn)();
    done = true;
  });
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!done && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const bool returned = done;
  held.Release();
  t.join();
  return returned;
}

}  // namespace moeserve::testing

#endif  // MOESERVE_TESTS_CUDA_HELD_STREAM_H_
