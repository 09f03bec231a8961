// Which CUDA allocation calls wait for unrelated device work? A kernel spins on a flag in mapped
// page-locked memory (on its own non-blocking stream), or a host function blocks that stream,
// while another thread makes one call; the call either returns while the stream is held, or is
// still blocked after 2 s (then the flag is set, the stream moves on and the call returns).
// Prints one line per call and blocker.
// Build: nvcc -O2 -arch=sm_90a -o alloc_wait_probe scripts/gpu/alloc_wait_probe.cu
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>

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

}  // namespace

int main() {
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
  for (int round = 0; round < 2; ++round) {
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
  }
  std::printf("done\n");
  return 0;
}
