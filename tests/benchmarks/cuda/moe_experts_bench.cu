// Times moeserve's CUDA expert MLP for one rank, device work only, with CUDA events: 5 warm-ups,
// then the median of 40 runs, rotating 4 input sets (the weights, 1-3 GB, are far larger than the
// 60 MB L2 anyway). Weights are random values written straight into the packed layout.
//   path decode:  align + W13 GEMM with fused SiLU-and-mul + W2 GEMM with the fused unpermute
//                 (the top-k reduce, in Finalize, is not timed)
//   path grouped: align + row gather + grouped W13 GEMM + SiLU-and-mul + grouped W2 GEMM +
//                 unpermute with the top-k weighting and reduction (sm_90a;
//                 kernels/cuda/moe_grouped_sm90.cuh), everything up to the reduced FP32 output;
//                 MXFP8 weights through their BF16 copy (dequantized once, before timing)
//   path w8a8:    MXFP8 only: the grouped path on FP8 tensor cores (W8A8: the gathered rows and
//                 the SiLU-and-mul output quantized to E4M3 per row per 128 K by their kernels;
//                 weights in their plain FP8 copy, made once before timing)
// Prints CSV lines:
//   layer,format,tokens,routing,median_us,weight_bytes,routes,path
// Environment (optional): MOESERVE_BENCH_TOKENS=16,64,... (default 16,32,64,128,256,1024),
// MOESERVE_BENCH_FORMATS=bf16,mxfp8, MOESERVE_BENCH_PATHS=decode,grouped,w8a8,
// MOESERVE_BENCH_ROUTING=balanced,hot (e.g. to point Nsight Compute at one routing's launches;
// also "random": every token's top-k experts drawn uniformly without repeats, so that counts
// vary around the average as real routing does; balanced gives every expert the same count),
// MOESERVE_BENCH_SPLIT_K=0 (the decode GEMMs without their split-K workspace),
// MOESERVE_BENCH_ALIGN_SCRATCH=0 (the one-block align), MOESERVE_BENCH_LAYERS=seed,dsv3,qwen3,
// trivial, MOESERVE_BENCH_EXPERTS=32 and MOESERVE_BENCH_TOPK=8 (the rank's experts and routes),
// MOESERVE_BENCH_WGMMA_FROM=N (warpgroup-MMA tiles from N routes per expert on),
// MOESERVE_BENCH_GROUPED_TILE=64 or 128 (the grouped GEMMs' tile rows, whatever the row count would
// pick).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/moe_gemm.cuh"
#include "kernels/cuda/moe_grouped_sm90.cuh"
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

// Comma-separated list from the environment, or `fallback`.
std::vector<std::string> EnvList(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  std::string s = v != nullptr && *v != 0 ? v : fallback;
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t end = s.find(',', start);
    out.push_back(s.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}
bool Has(const std::vector<std::string>& list, const std::string& x) {
  return std::find(list.begin(), list.end(), x) != list.end();
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
  // qwen3: Qwen3-30B-A3B's expert shape (with this bench's 32 local experts, top-8), whose
  // decode units are too few to fill the GPU without split-K.
  // trivial: the serving benchmark's one-token layer (I = 64; with MOESERVE_BENCH_EXPERTS=16
  // MOESERVE_BENCH_TOPK=4 as that server has), whose time is the kernels' fixed costs.
  const Shape all_shapes[] = {
      {"seed", 3072, 5120}, {"dsv3", 7168, 2048}, {"qwen3", 2048, 768}, {"trivial", 7168, 64}};
  const std::vector<std::string> layers = EnvList("MOESERVE_BENCH_LAYERS", "seed,dsv3");
  std::vector<Shape> shapes;
  for (const Shape& s : all_shapes) {
    if (Has(layers, s.name)) shapes.push_back(s);
  }
  const char* experts_env = std::getenv("MOESERVE_BENCH_EXPERTS");
  const char* topk_env = std::getenv("MOESERVE_BENCH_TOPK");
  const int E = experts_env != nullptr ? std::atoi(experts_env) : 32;
  const int topk = topk_env != nullptr ? std::atoi(topk_env) : 8;
  const int kSets = 4, kWarm = 5, kIters = 40;
  if (E < 1 || topk < 1 || topk > E) {
    std::fprintf(stderr,
                 "MOESERVE_BENCH_EXPERTS / MOESERVE_BENCH_TOPK: need 1 <= topk <= experts\n");
    return 2;
  }
  std::vector<int> token_list;
  for (const std::string& t : EnvList("MOESERVE_BENCH_TOKENS", "16,32,64,128,256,1024")) {
    token_list.push_back(std::atoi(t.c_str()));
  }
  const std::vector<std::string> formats = EnvList("MOESERVE_BENCH_FORMATS", "bf16,mxfp8");
  std::vector<std::string> paths = EnvList("MOESERVE_BENCH_PATHS", "decode,grouped");
  const std::vector<std::string> routings = EnvList("MOESERVE_BENCH_ROUTING", "balanced,hot");
  int device = 0;
  CK(cudaGetDevice(&device));
  for (const char* p : {"grouped", "w8a8"}) {
    if (Has(paths, p) && MoeGroupedSm90Unsupported(device) != nullptr) {
      std::fprintf(stderr, "%s path skipped: %s\n", p, MoeGroupedSm90Unsupported(device));
      paths.erase(std::find(paths.begin(), paths.end(), p));
    }
  }
  // The decode GEMMs' split-K workspace, as the server's Experts pass it (MOESERVE_BENCH_SPLIT_K=0:
  // none, the launches before split-K).
  void* split_ws = nullptr;
  const char* split_env = std::getenv("MOESERVE_BENCH_SPLIT_K");
  if (split_env == nullptr || std::string(split_env) != "0") {
    CK(cudaMalloc(&split_ws, kMoeGemmSplitWorkspaceBytes));
    CK(cudaMemset(split_ws, 0, sizeof(int32_t) * kMoeGemmSplitCounters));
  }
  // MOESERVE_BENCH_WGMMA_FROM=N: warpgroup-MMA tiles from N routes per expert on
  // (MoeGemmParams::wgmma_min_routes; unset: the kernels' default).
  const char* wgmma_env = std::getenv("MOESERVE_BENCH_WGMMA_FROM");
  const int wgmma_from = wgmma_env != nullptr ? std::atoi(wgmma_env) : 0;
  std::printf("layer,format,tokens,routing,median_us,weight_bytes,routes,path\n");
  for (const Shape& s : shapes) {
    const MoePackedLayout l = MakeMoePackedLayout(s.h, s.i);
    for (int fp8 = 0; fp8 < 2; ++fp8) {
      if (!Has(formats, fp8 ? "mxfp8" : "bf16")) continue;
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
      // The grouped path's plain copy, made from the packed weights as CudaGroupedExperts does.
      const bool grouped = Has(paths, "grouped");
      void *p13 = nullptr, *p2 = nullptr, *gws = nullptr;
      const size_t gws_bytes = grouped ? MoeGroupedSm90WorkspaceBytes(E, num_sms) : 0;
      if (grouped) {
        CK(cudaMalloc(&p13, E * PlainW13ElemsPerExpert(l) * 2));
        CK(cudaMalloc(&p2, E * PlainW2ElemsPerExpert(l) * 2));
        CK(cudaMalloc(&gws, gws_bytes));
        CK(LaunchUnpackMoeWeightsPlain(w13, s13, w2, s2, E, l, es, p13, p2, stream));
      }
      // The W8A8 path's plain FP8 copy and scales (MXFP8 only).
      const bool w8a8 = fp8 && Has(paths, "w8a8");
      const int64_t k1 = Fp8PaddedK(l.hidden_padded), k2 = Fp8PaddedK(l.intermediate_padded);
      uint8_t *f13 = nullptr, *f2 = nullptr;
      float *f13s = nullptr, *f2s = nullptr;
      void* fws = nullptr;
      const size_t fws_bytes = w8a8 ? MoeGroupedSm90Fp8WorkspaceBytes(E, num_sms) : 0;
      if (w8a8) {
        const int64_t e13 = E * PlainFp8W13ElemsPerExpert(l), e2 = E * PlainFp8W2ElemsPerExpert(l);
        CK(cudaMalloc(&f13, e13));
        CK(cudaMalloc(&f2, e2));
        CK(cudaMalloc(&f13s, e13 / kMoeFp8ScaleK * 4));
        CK(cudaMalloc(&f2s, e2 / kMoeFp8ScaleK * 4));
        CK(cudaMalloc(&fws, fws_bytes));
        CK(LaunchUnpackMoeWeightsPlainFp8(static_cast<const uint8_t*>(w13), s13,
                                          static_cast<const uint8_t*>(w2), s2, E, l, f13, f13s, f2,
                                          f2s, stream));
      }
      for (int tokens : token_list) {
        // mode 0 balanced, 1 hot (expert 0 in every token), 2 random; the seed as before.
        for (int mode = 0; mode < 3; ++mode) {
          static const char* const kRoutingNames[] = {"balanced", "hot", "random"};
          const char* routing_name = kRoutingNames[mode];
          if (!Has(routings, routing_name)) continue;
          const int64_t R = int64_t{tokens} * topk;
          std::mt19937 rng(tokens * 7 + mode);
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
                if (mode == 0) {
                  v = ((t * 8 + j) * 73 + 19 + k) % E;
                } else if (mode == 2) {
                  do {
                    v = static_cast<int>(rng() % E);
                  } while (std::count(used.begin(), used.end(), v));
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
          // The align's scratch follows, as in the CUDA Experts' workspace
          // (MOESERVE_BENCH_ALIGN_SCRATCH=0: none, the one-block align).
          const char* scratch_env = std::getenv("MOESERVE_BENCH_ALIGN_SCRATCH");
          const bool align_scratch = scratch_env == nullptr || std::string(scratch_env) != "0";
          const int64_t scratch_ints = align_scratch ? MoeAlignScratchInts(R, E) : 0;
          CK(cudaMalloc(&ws, (2 * E + 2 + 2 * R + scratch_ints) * 4));
          int32_t *counts = ws, *offsets = ws + E, *sorted = offsets + E + 1, *slot = sorted + R;
          int32_t* scratch = scratch_ints > 0 ? slot + R : nullptr;
          uint16_t* inter;
          float* out;
          CK(cudaMalloc(&inter, R * l.intermediate_padded * 2));
          CK(cudaMalloc(&out, R * s.h * 4));
          MoeGemmParams g1;
          g1.mxfp8 = fp8;
          g1.mxfp8_max_scale_code = 121;  // FillKernel's scale codes are 117-121
          g1.num_experts = E;
          g1.layout = l;
          g1.expert_counts = counts;
          g1.expert_offsets = offsets;
          g1.max_rows_hint = g1.total_rows_hint = R;
          g1.split_workspace = split_ws;  // as the server's Experts launch them
          g1.wgmma_min_routes = wgmma_from;
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
          g2.weights_before_wait = true;  // as the engine launches them (MOESERVE_W2_EARLY=0,
          g1.weights_before_wait = true;  // MOESERVE_W13_EARLY=0: off)
          g1.num_routes = R;
          // Grouped path buffers: [R, H] gathered rows / W2 output, [R, 2 Ip], [R, Ip], the
          // reduced FP32 [tokens, H] and router weights.
          uint16_t *xr = nullptr, *d1 = nullptr, *a2 = nullptr;
          float *reduced = nullptr, *tw = nullptr;
          uint8_t *a1q = nullptr, *a2q = nullptr;
          float *a1s = nullptr, *a2s = nullptr;
          if (w8a8) {
            CK(cudaMalloc(&a1q, R * k1));
            CK(cudaMalloc(&a2q, R * k2));
            CK(cudaMalloc(&a1s, R * (k1 / kMoeFp8ScaleK) * 4));
            CK(cudaMalloc(&a2s, R * (k2 / kMoeFp8ScaleK) * 4));
          }
          if (grouped || w8a8) {
            CK(cudaMalloc(&xr, R * s.h * 2));
            CK(cudaMalloc(&d1, R * 2 * l.intermediate_padded * 2));
            CK(cudaMalloc(&a2, R * l.intermediate_padded * 2));
            CK(cudaMalloc(&reduced, int64_t{tokens} * s.h * 4));
            std::vector<float> w(R, 1.0f / topk);
            CK(cudaMalloc(&tw, R * 4));
            CK(cudaMemcpy(tw, w.data(), R * 4, cudaMemcpyHostToDevice));
          }
          MoeGroupedSm90Gemm q1;
          q1.num_experts = E;
          q1.expert_counts = counts;
          q1.expert_offsets = offsets;
          q1.n = 2 * l.intermediate_padded;
          q1.k = s.h;
          q1.a = xr;
          q1.lda = s.h;
          q1.b = static_cast<const uint16_t*>(p13);
          q1.ldb = l.hidden_padded;
          q1.b_expert_stride = PlainW13ElemsPerExpert(l);
          q1.d = d1;
          q1.ldd = 2 * l.intermediate_padded;
          q1.total_rows_hint = R;
          if (const char* tile = std::getenv("MOESERVE_BENCH_GROUPED_TILE")) {
            q1.total_rows_hint = std::atoi(tile) == 64 ? int64_t{64} * E : int64_t{256} * E;
          }
          MoeGroupedSm90Gemm q2 = q1;
          q2.n = s.h;
          q2.k = l.intermediate_padded;
          q2.a = a2;
          q2.lda = l.intermediate_padded;
          q2.b = static_cast<const uint16_t*>(p2);
          q2.ldb = l.intermediate_padded;
          q2.b_expert_stride = PlainW2ElemsPerExpert(l);
          q2.d = xr;
          q2.ldd = s.h;
          MoeGroupedSm90Fp8Gemm f1;
          f1.num_experts = E;
          f1.expert_counts = counts;
          f1.expert_offsets = offsets;
          f1.n = 2 * l.intermediate_padded;
          f1.k = k1;
          f1.a = a1q;
          f1.a_scale = a1s;
          f1.b = f13;
          f1.b_scale = f13s;
          f1.b_expert_stride = PlainFp8W13ElemsPerExpert(l);
          f1.d = d1;
          f1.ldd = 2 * l.intermediate_padded;
          f1.total_rows_hint = q1.total_rows_hint;
          MoeGroupedSm90Fp8Gemm f2g = f1;
          f2g.n = s.h;
          f2g.k = k2;
          f2g.a = a2q;
          f2g.a_scale = a2s;
          f2g.b = f2;
          f2g.b_scale = f2s;
          f2g.b_expert_stride = PlainFp8W2ElemsPerExpert(l);
          f2g.d = xr;
          f2g.ldd = s.h;
          cudaEvent_t e0, e1;
          CK(cudaEventCreate(&e0));
          CK(cudaEventCreate(&e1));
          for (const std::string& path : paths) {
            if (path == "grouped" && !grouped) continue;
            if (path == "w8a8" && !w8a8) continue;
            std::vector<float> times;
            for (int it = 0; it < kWarm + kIters; ++it) {
              const int k = it % kSets;
              g1.act = xs[k];
              g1.route_ids = idss[k];
              CK(cudaEventRecord(e0, stream));
              CK(LaunchMoeAlign(idss[k], R, E, counts, offsets, sorted, slot, stream, scratch));
              if (path == "decode") {
                CK(LaunchMoeGroupedGemm(g1, num_sms, stream));
                CK(LaunchMoeGroupedGemm(g2, num_sms, stream));
              } else if (path == "w8a8") {
                CK(LaunchMoeGatherQuantizeRows(xs[k], sorted, counts, offsets, E, R, topk, s.h, a1q,
                                               a1s, stream));
                CK(LaunchMoeGroupedSm90Fp8Gemm(f1, fws, fws_bytes, device, num_sms, stream));
                CK(LaunchMoeSiluMulQuantize(d1, counts, offsets, E, R, l.intermediate_padded, a2q,
                                            a2s, stream));
                CK(LaunchMoeGroupedSm90Fp8Gemm(f2g, fws, fws_bytes, device, num_sms, stream));
                CK(LaunchMoeUnpermuteReduce(xr, idss[k], tw, offsets, slot, tokens, topk, s.h, E,
                                            reduced, stream));
              } else {
                CK(LaunchMoeGatherRows(xs[k], sorted, offsets + E, R, topk, s.h, xr, stream));
                CK(LaunchMoeGroupedSm90Gemm(q1, gws, gws_bytes, device, num_sms, stream));
                CK(LaunchMoeSiluMul(d1, offsets + E, R, l.intermediate_padded, a2, stream));
                CK(LaunchMoeGroupedSm90Gemm(q2, gws, gws_bytes, device, num_sms, stream));
                CK(LaunchMoeUnpermuteReduce(xr, idss[k], tw, offsets, slot, tokens, topk, s.h, E,
                                            reduced, stream));
              }
              CK(cudaEventRecord(e1, stream));
              CK(cudaEventSynchronize(e1));
              float ms;
              CK(cudaEventElapsedTime(&ms, e0, e1));
              if (it >= kWarm) times.push_back(ms * 1000.f);
            }
            std::sort(times.begin(), times.end());
            std::printf("%s,%s,%d,%s,%.2f,%lld,%lld,%s\n", s.name, fp8 ? "mxfp8" : "bf16", tokens,
                        routing_name, times[times.size() / 2], (long long)bytes, (long long)R,
                        path.c_str());
            std::fflush(stdout);
          }
          CK(cudaEventDestroy(e0));
          CK(cudaEventDestroy(e1));
          for (void* p :
               {static_cast<void*>(xr), static_cast<void*>(d1), static_cast<void*>(a2),
                static_cast<void*>(reduced), static_cast<void*>(tw), static_cast<void*>(a1q),
                static_cast<void*>(a2q), static_cast<void*>(a1s), static_cast<void*>(a2s)}) {
            if (p != nullptr) CK(cudaFree(p));
          }
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
      for (void* p : {p13, p2, gws, static_cast<void*>(f13), static_cast<void*>(f2),
                      static_cast<void*>(f13s), static_cast<void*>(f2s), fws}) {
        if (p != nullptr) CK(cudaFree(p));
      }
      if (fp8) {
        CK(cudaFree(s13));
        CK(cudaFree(s2));
      }
    }
  }
  return 0;
}
