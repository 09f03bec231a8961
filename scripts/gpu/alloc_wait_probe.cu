// Which CUDA allocation calls wait for unrelated device work? A kernel spins on a flag in mapped
// page-locked memory (on its own non-blocking stream), or a host function blocks that stream,
// while another thread makes one call; the call either returns while the stream is held, or is
// still blocked after 2 s (then the flag is set, the stream moves on and the call returns).
// Prints one line per call and blocker. Also cudaHostRegister / cudaHostUnregister of malloc'd
// memory (the server's buffer pool and system shared-memory regions). Then, while one thread is
// blocked in such a call, whether other threads' calls of a serving step (a launch and sync, a
// small copy, an allocation, a registration, on another stream) return or wait too: that decides
// whether handing the release to a background thread keeps serving threads going. Last, the
// worst launch + sync on another thread while a long call that does not wait runs
// (cudaHostRegister of 1 GiB, cudaMallocHost of 1 GiB).
// Build: nvcc -O2 -arch=sm_90a -o alloc_wait_probe scripts/gpu/alloc_wait_probe.cu
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

namespace {

__global__ void Spin(volatile int* flag) {
  while (*flag == 0) __nanosleep(1000);
}

using Clock = std::chrono::steady_clock;

bool g_host_func = false;

void CUDART_CB HoldStream(void* flag) {
  while (*static_cast<volatile int*>(flag) == 0) std::this_thread::yield();
}

void Probe(const char* what, volatile int* flag, int* d_flag, cudaStream_t s,
           const std::function<cudaError_t()>& call) {
  *flag = 0;
  if (g_host_func) {
    cudaLaunchHostFunc(s, HoldStream, const_cast<int*>(flag));
  } else {
    Spin<<<1, 1, 0, s>>>(d_flag);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the stream is held
  std::atomic<bool> done{false};
  cudaError_t err = cudaSuccess;
  double call_us = 0;
  std::thread t([&] {
    cudaSetDevice(0);
    const auto t0 = Clock::now();
    err = call();
    call_us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    done = true;
  });
  const auto start = Clock::now();
  while (!done && Clock::now() - start < std::chrono::seconds(2)) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  const bool blocked = !done;
  *flag = 1;
  t.join();
  cudaStreamSynchronize(s);
  std::printf("%-12s %-44s %s (%.0f us, %s)\n", g_host_func ? "host func" : "spin kernel", what,
              blocked ? "WAITED for the held stream" : "returned", call_us,
              cudaGetErrorString(err));
}

__global__ void Empty() {}

// Runs `call` on its own thread; true if it returned within `limit`.
bool ReturnsWithin(const std::function<cudaError_t()>& call, std::chrono::milliseconds limit,
                   std::thread* t, std::atomic<bool>* done, double* us) {
  *t = std::thread([call, done, us] {
    cudaSetDevice(0);
    const auto t0 = Clock::now();
    call();
    *us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    done->store(true);
  });
  const auto start = Clock::now();
  while (!done->load() && Clock::now() - start < limit) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return done->load();
}

// While one thread is blocked in `blocker` (a call that waits for the held stream `s`), do
// other threads' calls of a serving step (on another stream) go through, or wait too?
void WhileBlocked(const char* blocker_name, volatile int* flag, int* d_flag, cudaStream_t s,
                  cudaStream_t other, void* pinned, void* dev,
                  const std::function<cudaError_t()>& blocker) {
  struct Other {
    const char* name;
    std::function<cudaError_t()> call;
  };
  const Other others[] = {
      {"launch + sync (other stream)",
       [other] {
         Empty<<<1, 32, 0, other>>>();
         return cudaStreamSynchronize(other);
       }},
      {"14 KB H2D + sync (other stream)",
       [other, pinned, dev] {
         cudaMemcpyAsync(dev, pinned, 14336, cudaMemcpyHostToDevice, other);
         return cudaStreamSynchronize(other);
       }},
      {"cudaMalloc 1 MiB",
       [] {
         void* q = nullptr;
         return cudaMalloc(&q, size_t{1} << 20);  // (leaked: the free would wait)
       }},
      {"cudaHostRegister 16 KiB",
       [] {
         void* q = std::aligned_alloc(4096, 16384);
         return cudaHostRegister(q, 16384, cudaHostRegisterPortable);  // (kept)
       }},
  };
  for (const Other& o : others) {
    *flag = 0;
    Spin<<<1, 1, 0, s>>>(d_flag);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::thread tb, to;
    std::atomic<bool> b_done{false}, o_done{false};
    double b_us = 0, o_us = 0;
    const bool b_returned =
        ReturnsWithin(blocker, std::chrono::milliseconds(100), &tb, &b_done, &b_us);
    const bool o_returned =
        ReturnsWithin(o.call, std::chrono::milliseconds(1000), &to, &o_done, &o_us);
    *flag = 1;
    tb.join();
    to.join();
    cudaStreamSynchronize(s);
    cudaGetLastError();
    std::printf("while %-28s %s: %-34s %s (%.0f us)\n", blocker_name,
                b_returned ? "(did not block)" : "blocks", o.name,
                o_returned ? "returned" : "WAITED too", o_us);
  }
}

}  // namespace

int main(int argc, char** argv) {
  cudaSetDevice(0);
  int* flag = nullptr;
  cudaHostAlloc(&flag, sizeof(int), cudaHostAllocMapped);
  int* d_flag = nullptr;
  cudaHostGetDevicePointer(&d_flag, flag, 0);
  cudaStream_t s, other;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking);
  void *a = nullptr, *h = nullptr, *p = nullptr;
  cudaFree(nullptr);
  const size_t kBytes = size_t{64} << 20;
  void* plain = std::aligned_alloc(4096, kBytes);
  std::memset(plain, 0, kBytes);
  // --concurrent_only: only the second part (the first was recorded 2026-12-05).
  const bool concurrent_only = argc > 1 && std::strcmp(argv[1], "--concurrent_only") == 0;
  for (int round = 0; round < (concurrent_only ? 0 : 2); ++round) {
    g_host_func = round == 1;
    Probe("cudaMalloc 64 MiB", flag, d_flag, s, [&] { return cudaMalloc(&a, kBytes); });
    Probe("cudaFree of it", flag, d_flag, s, [&] { return cudaFree(a); });
    Probe("cudaMalloc 2 GiB", flag, d_flag, s, [&] { return cudaMalloc(&a, size_t{2} << 30); });
    Probe("cudaFree of it", flag, d_flag, s, [&] { return cudaFree(a); });
    Probe("cudaMallocHost 64 MiB", flag, d_flag, s, [&] { return cudaMallocHost(&h, kBytes); });
    Probe("cudaFreeHost of it", flag, d_flag, s, [&] { return cudaFreeHost(h); });
    Probe("cudaMallocAsync 64 MiB (other stream)", flag, d_flag, s,
          [&] { return cudaMallocAsync(&p, kBytes, other); });
    Probe("cudaFreeAsync of it (other stream)", flag, d_flag, s,
          [&] { return cudaFreeAsync(p, other); });
    Probe("cudaStreamSynchronize(other)", flag, d_flag, s,
          [&] { return cudaStreamSynchronize(other); });
    // What the server's buffer pool and system regions do with memory it did not allocate.
    Probe("cudaHostRegister 64 MiB (malloc'd)", flag, d_flag, s,
          [&] { return cudaHostRegister(plain, kBytes, cudaHostRegisterPortable); });
    Probe("cudaHostUnregister of it", flag, d_flag, s, [&] { return cudaHostUnregister(plain); });
    Probe("cudaHostRegister 16 KiB", flag, d_flag, s,
          [&] { return cudaHostRegister(plain, 16384, cudaHostRegisterPortable); });
    Probe("cudaHostUnregister of it", flag, d_flag, s, [&] { return cudaHostUnregister(plain); });
  }
  // Does a thread blocked in a waiting release hold up the others' calls?
  void *pinned = nullptr, *dev = nullptr;
  cudaMallocHost(&pinned, 14336);
  cudaMalloc(&dev, 14336);
  g_host_func = false;
  std::vector<void*> frees;
  WhileBlocked("cudaFree 64 MiB", flag, d_flag, s, other, pinned, dev, [&] {
    void* q = nullptr;
    cudaMalloc(&q, kBytes);
    return cudaFree(q);
  });
  WhileBlocked("cudaFreeHost 1 MiB", flag, d_flag, s, other, pinned, dev, [&] {
    void* q = nullptr;
    cudaMallocHost(&q, size_t{1} << 20);
    return cudaFreeHost(q);
  });
  WhileBlocked("cudaHostUnregister 16 KiB", flag, d_flag, s, other, pinned, dev, [&] {
    cudaHostRegister(plain, 16384, cudaHostRegisterPortable);
    return cudaHostUnregister(plain);
  });
  // Long calls that do not wait for the device (registering a large region, a large page-locked
  // allocation): do they hold up another thread's steps while they run? The worst launch + sync
  // on another stream during the call, against the same loop alone.
  const size_t kLarge = size_t{1} << 30;
  void* large = std::aligned_alloc(4096, kLarge);
  std::memset(large, 0, kLarge);
  const auto worst_step_us = [&](const std::function<void()>& during) {
    std::atomic<bool> running{true};
    double worst = 0;
    std::thread stepper([&] {
      cudaSetDevice(0);
      while (running) {
        const auto t0 = Clock::now();
        Empty<<<1, 32, 0, other>>>();
        cudaStreamSynchronize(other);
        worst =
            std::max(worst, std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      }
    });
    const auto t0 = Clock::now();
    during();
    const double call_us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    running = false;
    stepper.join();
    return std::make_pair(call_us, worst);
  };
  const auto report = [](const char* what, std::pair<double, double> r) {
    std::printf("during %-34s (%.0f us): worst launch + sync elsewhere %.0f us\n", what, r.first,
                r.second);
  };
  report("nothing (20 ms)",
         worst_step_us([] { std::this_thread::sleep_for(std::chrono::milliseconds(20)); }));
  report("cudaHostRegister 1 GiB",
         worst_step_us([&] { cudaHostRegister(large, kLarge, cudaHostRegisterPortable); }));
  report("cudaHostUnregister of it (device idle)",
         worst_step_us([&] { cudaHostUnregister(large); }));
  report("cudaMallocHost 1 GiB", worst_step_us([&] {
           void* q = nullptr;
           cudaMallocHost(&q, kLarge);
           h = q;
         }));
  std::free(large);
  std::printf("done\n");
  return 0;
}
