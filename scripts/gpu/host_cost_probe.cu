// What the host's own primitives cost on the GPU machine, for the one-token call's host stages
// (issues 11/12: queue, input, host launch, collect): a clock read, a hand-off to another thread
// (spinning and sleeping on a futex), and the CUDA runtime calls of a graphed step (pointer
// attributes, event record / query, a launch, a graph launch, an empty stream's sync, a 14 KB
// page-locked copy). p50 / p90 over --iters (default 20000; CUDA rows 5000) after a warm-up.
// Prints "probe NAME p50_us=.. p90_us=..", a line per row.
// Build: nvcc -O2 -std=c++17 -arch=sm_90a -o host_cost_probe scripts/gpu/host_cost_probe.cu
#include <cuda_runtime.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

__global__ void Empty() {}

void Report(const char* name, std::vector<double>& us) {
  std::sort(us.begin(), us.end());
  std::printf("probe %-34s p50_us=%.2f p90_us=%.2f\n", name, us[us.size() / 2],
              us[us.size() * 9 / 10]);
}

// Times `fn` `iters` times (after iters / 10 untimed).
void Time(const char* name, int iters, const std::function<void()>& fn) {
  for (int i = 0; i < iters / 10; ++i) fn();
  std::vector<double> us(iters);
  for (int i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    fn();
    us[i] = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  }
  Report(name, us);
}

long Futex(std::atomic<uint32_t>* word, int op, uint32_t value) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, nullptr, nullptr, 0);
}

// A round trip to a second thread and back: the main thread publishes a ticket, the peer
// answers it. `sleep`: each side sleeps on a futex when the other is not there yet (a woken
// thread, as a gRPC or scheduling thread that was idle); else both spin.
void HandOff(const char* name, int iters, bool sleep) {
  std::atomic<uint32_t> ping{0}, pong{0};
  std::atomic<bool> stop{false};
  std::thread peer([&] {
    uint32_t seen = 0;
    while (!stop.load(std::memory_order_relaxed)) {
      uint32_t v = ping.load(std::memory_order_acquire);
      if (v == seen) {
        if (sleep) Futex(&ping, FUTEX_WAIT_PRIVATE, seen);
        continue;
      }
      seen = v;
      pong.store(v, std::memory_order_release);
      if (sleep) Futex(&pong, FUTEX_WAKE_PRIVATE, 1);
    }
  });
  uint32_t ticket = 0;
  Time(name, iters, [&] {
    ++ticket;
    ping.store(ticket, std::memory_order_release);
    if (sleep) Futex(&ping, FUTEX_WAKE_PRIVATE, 1);
    while (pong.load(std::memory_order_acquire) != ticket) {
      if (sleep) Futex(&pong, FUTEX_WAIT_PRIVATE, ticket - 1);
    }
  });
  stop.store(true);
  ping.store(ticket + 1, std::memory_order_release);
  Futex(&ping, FUTEX_WAKE_PRIVATE, 1);
  peer.join();
}

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

}  // namespace

int main(int argc, char** argv) {
  int iters = 20000;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--iters") == 0) iters = std::atoi(argv[i + 1]);
  }
  const int cuda_iters = std::max(100, iters / 4);
  Time("steady_clock::now", iters, [] { (void)Clock::now(); });
  HandOff("hand-off, both spinning", iters, false);
  HandOff("hand-off, futex sleep/wake", iters / 4, true);

  CHECK(cudaSetDevice(0));
  CHECK(cudaFree(nullptr));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::vector<char> pageable(14336, 1);
  void *pinned = nullptr, *dev = nullptr;
  CHECK(cudaMallocHost(&pinned, 14336));
  CHECK(cudaMalloc(&dev, 14336));
  cudaEvent_t ev;
  CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  Time("cudaPointerGetAttributes(pageable)", cuda_iters, [&] {
    cudaPointerAttributes a;
    CHECK(cudaPointerGetAttributes(&a, pageable.data()));
  });
  Time("cudaEventRecord", cuda_iters, [&] { CHECK(cudaEventRecord(ev, s)); });
  CHECK(cudaStreamSynchronize(s));
  Time("cudaEventQuery (done)", cuda_iters, [&] { CHECK(cudaEventQuery(ev)); });
  Time("cudaStreamSynchronize (idle)", cuda_iters, [&] { CHECK(cudaStreamSynchronize(s)); });
  Time("launch (host side)", cuda_iters, [&] { Empty<<<1, 32, 0, s>>>(); });
  CHECK(cudaStreamSynchronize(s));
  Time("launch + sync", cuda_iters, [&] {
    Empty<<<1, 32, 0, s>>>();
    CHECK(cudaStreamSynchronize(s));
  });
  Time("launch + event spin", cuda_iters, [&] {
    Empty<<<1, 32, 0, s>>>();
    CHECK(cudaEventRecord(ev, s));
    while (cudaEventQuery(ev) == cudaErrorNotReady) {
    }
  });
  // A graph of six dependent empty kernels (a graphed step's count at M=1).
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < 6; ++i) Empty<<<1, 32, 0, s>>>();
  CHECK(cudaStreamEndCapture(s, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  Time("graph of 6 launch (host side)", cuda_iters, [&] { CHECK(cudaGraphLaunch(exec, s)); });
  CHECK(cudaStreamSynchronize(s));
  Time("graph of 6 launch + sync", cuda_iters, [&] {
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaStreamSynchronize(s));
  });
  Time("6 launches + sync", cuda_iters, [&] {
    for (int i = 0; i < 6; ++i) Empty<<<1, 32, 0, s>>>();
    CHECK(cudaStreamSynchronize(s));
  });
  Time("14 KB pinned H2D + sync", cuda_iters, [&] {
    CHECK(cudaMemcpyAsync(dev, pinned, 14336, cudaMemcpyHostToDevice, s));
    CHECK(cudaStreamSynchronize(s));
  });
  Time("14 KB pageable H2D (sync copy)", cuda_iters,
       [&] { CHECK(cudaMemcpy(dev, pageable.data(), 14336, cudaMemcpyHostToDevice)); });
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaEventDestroy(ev));
  CHECK(cudaFreeHost(pinned));
  CHECK(cudaFree(dev));
  CHECK(cudaStreamDestroy(s));
  return 0;
}
