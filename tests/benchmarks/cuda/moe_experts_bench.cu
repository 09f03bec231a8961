// Times moeserve's CUDA expert MLP for one rank (align + W13 GEMM with fused SiLU-and-mul + W2
// GEMM), device work only, with CUDA events: 5 warm-ups, then the median of 40 runs, rotating 4
// input sets (the weights, 1-3 GB, are far larger than the 60 MB L2 anyway). Weights are random
// values written straight into the packed layout. Prints CSV lines:
//   layer,format,tokens,routing,median_us,weight_bytes,routes
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/moe_gemm.cuh"
#include "kernels/cuda/moe_routing.cuh"

using namespace moeserve::kernels;

#define CK(x)                                                                               \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #x, cudaGetErrorString(e_), __FILE__, \
                   __LINE__);                                                               \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

__device__ uint32_t Hash(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return static_cast<uint32_t>(x ^ (x >> 33));
}
// BF16 values of magnitude ~2^-6, or E4M3 codes without NaN, or E8M0 scales in [117, 121].
__global__ void FillKernel(void* p, int64_t n, int kind, uint64_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const uint32_t h = Hash(seed * 0x9e3779b97f4a7c15ull + i);
    if (kind == 0) {
      static_cast<uint16_t*>(p)[i] =
          static_cast<uint16_t>((h & 0x8000) | ((118 + (h >> 16) % 4) << 7) | (h & 0x7f));
    } else if (kind == 1) {
      uint8_t b = static_cast<uint8_t>(h);
      if ((b & 0x7f) == 0x7f) b = 0x7e;
      static_cast<uint8_t*>(p)[i] = b;
    } else {
      static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(117 + h % 5);
    }
  }
}
void Fill(void* p, int64_t n, int kind, uint64_t seed) {
  FillKernel<<<4096, 256>>>(p, n, kind, seed);
  CK(cudaGetLastError());
}

int main(int argc, char** argv) {
  int num_sms = 0;
  CK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct Shape {
    const char* name;
    int64_t h, i;
  };
  const Shape shapes[] = {{"seed", 3072, 5120}, {"dsv3", 7168, 2048}};
  const int E = 32, topk = 8, kSets = 4, kWarm = 5, kIters = 40;
  const int token_list[] = {16, 32, 64, 256, 1024};
  std::printf("layer,format,tokens,routing,median_us,weight_bytes,routes\n");
  for (const Shape& s : shapes) {
    const MoePackedLayout l = MakeMoePackedLayout(s.h, s.i);
    for (int fp8 = 0; fp8 < 2; ++fp8) {
      const int es = fp8 ? 1 : 2;
      void *w13, *w2;
      uint8_t *s13 = nullptr, *s2 = nullptr;
      const int64_t n13 = E * l.w13_elems_per_expert(), n2 = E * l.w2_elems_per_expert();
      CK(cudaMalloc(&w13, n13 * es));
      CK(cudaMalloc(&w2, n2 * es));
      Fill(w13, n13, fp8, 1);
      Fill(w2, n2, fp8, 2);
      int64_t bytes = (n13 + n2) * es;
      if (fp8) {
        CK(cudaMalloc(&s13, n13 / 32));
        CK(cudaMalloc(&s2, n2 / 32));
        Fill(s13, n13 / 32, 2, 3);
        Fill(s2, n2 / 32, 2, 4);
        bytes += (n13 + n2) / 32;
      }
      for (int tokens : token_list) {
        for (int hot = 0; hot < 2; ++hot) {
          const int64_t R = int64_t{tokens} * topk;
          std::mt19937 rng(tokens * 7 + hot);
          // Inputs: kSets rotations of x [tokens, H] and ids [tokens, topk].
          std::vector<uint16_t*> xs(kSets);
          std::vector<int32_t*> idss(kSets);
          for (int k = 0; k < kSets; ++k) {
            CK(cudaMalloc(&xs[k], tokens * s.h * 2));
            Fill(xs[k], tokens * s.h, 0, 100 + k);
            std::vector<int32_t> ids(R);
            for (int t = 0; t < tokens; ++t) {
              std::vector<int> used;
              for (int j = 0; j < topk; ++j) {
                int v;
                if (!hot) {
                  v = ((t * 8 + j) * 73 + 19 + k) % E;
                } else if (j == 0) {
                  v = 0;
                } else {
                  do {
                    v = 1 + rng() % (E - 1);
                  } while (std::count(used.begin(), used.end(), v));
                }
                used.push_back(v);
                ids[t * topk + j] = v;
              }
            }
            CK(cudaMalloc(&idss[k], R * 4));
            CK(cudaMemcpy(idss[k], ids.data(), R * 4, cudaMemcpyHostToDevice));
          }
          int32_t* ws;
          CK(cudaMalloc(&ws, (2 * E + 2 + 2 * R) * 4));
          int32_t *counts = ws, *offsets = ws + E, *sorted = offsets + E + 1, *slot = sorted + R;
          uint16_t* inter;
          float* out;
          CK(cudaMalloc(&inter, R * l.intermediate_padded * 2));
          CK(cudaMalloc(&out, R * s.h * 4));
          MoeGemmParams g1;
          g1.mxfp8 = fp8;
          g1.num_experts = E;
          g1.layout = l;
          g1.expert_counts = counts;
          g1.expert_offsets = offsets;
          g1.max_rows_hint = g1.total_rows_hint = R;
          MoeGemmParams g2 = g1;
          g1.kind = MoeGemmKind::kGateUpSilu;
          g1.weights = w13;
          g1.scales = s13;
          g1.gather = sorted;
          g1.gather_div = topk;
          g1.act_stride = s.h;
          g1.out = inter;
          g1.out_stride = l.intermediate_padded;
          g2.kind = MoeGemmKind::kDown;
          g2.weights = w2;
          g2.scales = s2;
          g2.act = inter;
          g2.act_stride = l.intermediate_padded;
          g2.scatter = sorted;
          g2.out = out;
          g2.out_stride = s.h;
          std::vector<float> times;
          cudaEvent_t e0, e1;
          CK(cudaEventCreate(&e0));
          CK(cudaEventCreate(&e1));
          for (int it = 0; it < kWarm + kIters; ++it) {
            const int k = it % kSets;
            g1.act = xs[k];
            CK(cudaEventRecord(e0, stream));
            CK(LaunchMoeAlign(idss[k], R, E, counts, offsets, sorted, slot, stream));
            CK(LaunchMoeGroupedGemm(g1, num_sms, stream));
            CK(LaunchMoeGroupedGemm(g2, num_sms, stream));
            CK(cudaEventRecord(e1, stream));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (it >= kWarm) times.push_back(ms * 1000.f);
          }
          std::sort(times.begin(), times.end());
          std::printf("%s,%s,%d,%s,%.2f,%lld,%lld\n", s.name, fp8 ? "mxfp8" : "bf16", tokens,
                      hot ? "hot" : "balanced", times[times.size() / 2], (long long)bytes,
                      (long long)R);
          std::fflush(stdout);
          CK(cudaEventDestroy(e0));
          CK(cudaEventDestroy(e1));
          for (int k = 0; k < kSets; ++k) {
            CK(cudaFree(xs[k]));
            CK(cudaFree(idss[k]));
          }
          CK(cudaFree(ws));
          CK(cudaFree(inter));
          CK(cudaFree(out));
        }
      }
      CK(cudaFree(w13));
      CK(cudaFree(w2));
      if (fp8) {
        CK(cudaFree(s13));
        CK(cudaFree(s2));
      }
    }
  }
  return 0;
}
