// A large gRPC request's way to the GPU, without gRPC: its bytes as many separately allocated
// pieces (as gRPC's slices are), rewritten before every iteration (as recvmsg just wrote them),
// then
//   serial:   ParallelCopier::Gather into one page-locked buffer, then one cudaMemcpy to the
//             device (the server's path with --upload_min_bytes=0: the gather in the handler, the
//             copy in the engine's step); its two parts are timed too (gather, h2d_after_gather)
//   upload:   CudaUploadHostPiecesInChunks (--upload_min_bytes: one part per thread, each
//             part's gather of a chunk overlapping the copy of its chunk before) for several
//             chunk sizes
//   h2d_warm: the same cudaMemcpy again from the page-locked buffer (no fresh writes before it)
// for several gather thread counts. The floor: h2d_warm (bytes over the measured PCIe rate).
//
//   upload_bench [--iters N] [--threads 4,8] [--chunks_kib 256,512,1024,2048]
//                [--bytes 14745600,6291456] [--piece 16384]
//
// One line per point ("upload bytes=.. threads=.. case=.. p50_us=.. GB/s=.."); every upload is
// checked byte for byte against the source once. Skips (exit 0, "skipped") without a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "core/cuda/host_upload.h"
#include "core/parallel_copy.h"
#include "tests/benchmarks/transport/bench_flags.h"

namespace {

using ::moeserve::bench::ParseList;

double Micros(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

#define CHECK_CUDA(expr)                                                     \
  do {                                                                       \
    const cudaError_t e = (expr);                                            \
    if (e != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(e)); \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)

}  // namespace

int main(int argc, char** argv) {
  int iters = 30;
  std::vector<int64_t> threads = {4, 8}, chunks_kib = {256, 512, 1024, 2048},
                       sizes = {14745600 + 65536, 6291456 + 65536};
  int64_t piece = 16384;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--iters") {
      iters = std::max(1, std::atoi(argv[i + 1]));
    } else if (flag == "--threads") {
      threads = ParseList(argv[i + 1]);
    } else if (flag == "--chunks_kib") {
      chunks_kib = ParseList(argv[i + 1]);
    } else if (flag == "--bytes") {
      sizes = ParseList(argv[i + 1]);
    } else if (flag == "--piece") {
      piece = std::max<int64_t>(1, std::atoll(argv[i + 1]));
    } else {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::printf("upload_bench skipped: no CUDA device\n");
    return 0;
  }
  CHECK_CUDA(cudaSetDevice(0));
  for (int64_t bytes64 : sizes) {
    const size_t bytes = static_cast<size_t>(bytes64);
    std::vector<std::vector<uint8_t>> storage;
    moeserve::HostPieces pieces;
    for (size_t at = 0; at < bytes; at += static_cast<size_t>(piece)) {
      const size_t n = std::min(static_cast<size_t>(piece), bytes - at);
      storage.emplace_back(n + 3);
      pieces.emplace_back(storage.back().data() + 3, n);
    }
    uint8_t stamp = 1;
    // As recvmsg leaves them: just written (dirty in this core's caches or beyond them).
    auto rewrite = [&] {
      ++stamp;
      size_t at = 0;
      for (auto& p : pieces) {
        auto* d = const_cast<uint8_t*>(p.data());
        for (size_t i = 0; i < p.size(); i += 64) d[i] = static_cast<uint8_t>(stamp + at + i);
        std::memset(d + 1, stamp, std::min<size_t>(p.size() - 1, 63));
        at += p.size();
      }
    };
    auto* pinned = static_cast<uint8_t*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096));
    CHECK_CUDA(cudaHostRegister(pinned, (bytes + 4095) / 4096 * 4096, cudaHostRegisterPortable));
    void* device = nullptr;
    CHECK_CUDA(cudaMalloc(&device, bytes));
    std::vector<uint8_t> check(bytes);
    for (int64_t t : threads) {
      moeserve::ParallelCopier copier(static_cast<int>(t));
      const moeserve::ParallelForFn parallel_for =
          [&copier](int64_t n, const std::function<void(int64_t)>& task) {
            copier.ParallelFor(n, task);
          };
      std::vector<double> g_us, h_us, s_us, w_us;
      for (int i = 0; i <= iters; ++i) {
        rewrite();
        auto t0 = std::chrono::steady_clock::now();
        copier.Gather(pieces, bytes, pinned);
        const double g = Micros(t0);
        auto t1 = std::chrono::steady_clock::now();
        CHECK_CUDA(cudaMemcpy(device, pinned, bytes, cudaMemcpyHostToDevice));
        const double h = Micros(t1);
        auto t2 = std::chrono::steady_clock::now();
        CHECK_CUDA(cudaMemcpy(device, pinned, bytes, cudaMemcpyHostToDevice));
        const double w = Micros(t2);
        if (i == 0) continue;  // warm-up
        g_us.push_back(g);
        h_us.push_back(h);
        s_us.push_back(g + h);
        w_us.push_back(w);
      }
      auto line = [&](const char* what, double us) {
        std::printf("upload bytes=%zu piece=%lld threads=%lld case=%s p50_us=%.0f GB/s=%.1f\n",
                    bytes, static_cast<long long>(piece), static_cast<long long>(t), what, us,
                    bytes / us / 1e3);
      };
      line("gather", Median(g_us));
      line("h2d_after_gather", Median(h_us));
      line("serial", Median(s_us));
      line("h2d_warm", Median(w_us));
      for (int64_t kib : chunks_kib) {
        std::vector<double> u_us;
        bool checked = false;
        for (int i = 0; i <= iters; ++i) {
          rewrite();
          auto t0 = std::chrono::steady_clock::now();
          auto up = moeserve::CudaUploadHostPiecesInChunks(
              0, pieces, bytes, parallel_for, static_cast<int>(t), static_cast<size_t>(kib) << 10);
          const double u = Micros(t0);
          if (!up.ok()) {
            std::fprintf(stderr, "upload failed: %s\n", std::string(up.status().message()).c_str());
            return 1;
          }
          if (!checked) {
            CHECK_CUDA(cudaMemcpy(check.data(), (*up)->data(), bytes, cudaMemcpyDeviceToHost));
            size_t at = 0;
            for (auto& p : pieces) {
              if (std::memcmp(check.data() + at, p.data(), p.size()) != 0) {
                std::fprintf(stderr, "upload wrote wrong bytes at %zu\n", at);
                return 1;
              }
              at += p.size();
            }
            checked = true;
          }
          if (i > 0) u_us.push_back(u);
        }
        const std::string what = "upload_chunk_kib=" + std::to_string(kib);
        line(what.c_str(), Median(u_us));
      }
    }
    CHECK_CUDA(cudaFree(device));
    CHECK_CUDA(cudaHostUnregister(pinned));
    std::free(pinned);
  }
  return 0;
}
