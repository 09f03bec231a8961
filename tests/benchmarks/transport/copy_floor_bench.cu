// The pinned-copy floor of issue 11's transport benchmark: for each size pair, the median time
// of a pinned host-to-device copy of the request bytes and of a device-to-host copy of the
// answer bytes (cudaEvent around each copy on one stream), and of the two back to back.
//
//   copy_floor_bench [--iters N] H2D_BYTES[:D2H_BYTES] ...
// One line per pair: "copy h2d_bytes=.. d2h_bytes=.. h2d_us=.. d2h_us=.. h2d_d2h_us=.. (p50)".
// Without a CUDA device it prints "copy skipped: ..." and exits 0 (CI machines have none).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

#define CHECK_CUDA(x)                                                     \
  do {                                                                    \
    cudaError_t e = (x);                                                  \
    if (e != cudaSuccess) {                                               \
      std::fprintf(stderr, "error: %s: %s\n", #x, cudaGetErrorString(e)); \
      std::exit(1);                                                       \
    }                                                                     \
  } while (0)

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Median microseconds of `iters` runs of `op` (enqueued on `stream`), after 3 untimed ones.
template <typename Op>
double TimeMedianUs(cudaStream_t stream, int iters, Op op) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<double> us;
  for (int i = 0; i < iters + 3; ++i) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    op();
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (i >= 3) us.push_back(ms * 1e3);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  return Median(us);
}

bool ParseSize(const std::string& s, int64_t* out) {
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || v <= 0) return false;
  *out = v;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 100;
  std::vector<std::pair<int64_t, int64_t>> sizes;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--iters" && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
      continue;
    }
    const size_t colon = arg.find(':');
    int64_t h2d = 0, d2h = 0;
    if (!ParseSize(arg.substr(0, colon), &h2d) ||
        (colon != std::string::npos && !ParseSize(arg.substr(colon + 1), &d2h))) {
      std::fprintf(stderr, "error: '%s' is not H2D_BYTES[:D2H_BYTES] (positive integers)\n",
                   arg.c_str());
      return 2;
    }
    sizes.emplace_back(h2d, colon == std::string::npos ? h2d : d2h);
  }
  if (sizes.empty() || iters <= 0) {
    std::fprintf(stderr, "usage: copy_floor_bench [--iters N>0] H2D_BYTES[:D2H_BYTES] ...\n");
    return 2;
  }
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("copy skipped: no CUDA device (%s)\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return 0;
  }
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const auto& size : sizes) {
    // Plain copies, not structured bindings: lambdas capture those only from C++20 on.
    const int64_t h2d = size.first, d2h = size.second;
    const int64_t n = std::max(h2d, d2h);
    void *host_in = nullptr, *host_out = nullptr, *dev = nullptr;
    CHECK_CUDA(cudaHostAlloc(&host_in, n, cudaHostAllocDefault));
    CHECK_CUDA(cudaHostAlloc(&host_out, n, cudaHostAllocDefault));
    CHECK_CUDA(cudaMalloc(&dev, n));
    std::memset(host_in, 0x3c, n);
    const double h2d_us = TimeMedianUs(stream, iters, [&] {
      CHECK_CUDA(cudaMemcpyAsync(dev, host_in, h2d, cudaMemcpyHostToDevice, stream));
    });
    const double d2h_us = TimeMedianUs(stream, iters, [&] {
      CHECK_CUDA(cudaMemcpyAsync(host_out, dev, d2h, cudaMemcpyDeviceToHost, stream));
    });
    const double both_us = TimeMedianUs(stream, iters, [&] {
      CHECK_CUDA(cudaMemcpyAsync(dev, host_in, h2d, cudaMemcpyHostToDevice, stream));
      CHECK_CUDA(cudaMemcpyAsync(host_out, dev, d2h, cudaMemcpyDeviceToHost, stream));
    });
    std::printf("copy h2d_bytes=%lld d2h_bytes=%lld h2d_us=%.1f d2h_us=%.1f h2d_d2h_us=%.1f\n",
                static_cast<long long>(h2d), static_cast<long long>(d2h), h2d_us, d2h_us, both_us);
    std::fflush(stdout);
    CHECK_CUDA(cudaFreeHost(host_in));
    CHECK_CUDA(cudaFreeHost(host_out));
    CHECK_CUDA(cudaFree(dev));
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}
