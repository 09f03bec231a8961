// CUDA Experts with the prefill-sized grouped GEMM path (kernels/cuda/moe_grouped_sm90.cuh:
// CUTLASS's sm90 ptr-array grouped GEMM, Hopper only) next to the decode kernels
// (kernels/cuda/moe_gemm.cuh), Standard activation format.
//
// Both paths apply the top-k weights and reduce inside Apply: the output is FP32 [M, K], already
// reduced over this rank's routes (FinalizeWeightAndReduceImpl() is NoOp), so one Experts can
// switch path per call without changing what Finalize does.
//   grouped: gather rows by expert -> W13 GEMM -> SiLU-and-mul -> W2 GEMM -> unpermute + top-k
//            weighting + reduction (one kernel)
//   decode:  the decode kernels' W13 (fused SiLU-and-mul) and W2 (fused unpermute) GEMMs ->
//            the Contiguous weight-and-reduce, on the device
// Path choice: Path::kGrouped always takes the grouped GEMM; Path::kCrossover takes it when the
// average routes per local expert of the call, M * topk / E, reaches
// CudaGroupedCrossoverRoutes(hidden, intermediate, format) (measured on an H200,
// tests/benchmarks/cuda/RESULTS.md), else the decode kernels.
//
// The grouped GEMM reads plain row-major BF16 weights (kernels::PlainW13ElemsPerExpert...), a
// second copy of each layer made on the device at the first Create over a DeviceWeightStore
// from its packed layout, and shared by every Experts over that store (an engine's lanes);
// MXFP8 layers are dequantized into it once, exactly (the same BF16 values the decode kernels
// dequantize in registers). Device memory: BF16 weights take twice their size, MXFP8 weights
// three times. Kind kCrossover makes the copy only when it takes at most 3/4 of the device's
// free memory (else every call takes the decode path); kind kGrouped fails Create with
// RESOURCE_EXHAUSTED when it does not fit.
//
// W8A8 (options.fp8_activations, opt-in): MXFP8 layers take the grouped path on FP8 tensor cores
// instead (kernels/cuda/moe_grouped_sm90.cuh, "W8A8"): their copy is plain E4M3 with one FP32
// scale per row per 128 K (about 1.03x the MXFP8 bytes, not a BF16 copy), and the gathered rows
// and the SiLU-and-mul output are quantized to E4M3 per row per 128 K on the way in. Not exact
// against the BF16 path (E4M3 activations: a few percent relative L2, measured in
// tests/benchmarks/cuda/RESULTS.md); BF16 layers are unaffected.
//
// Thread-safety: as every Experts, one caller at a time.
#ifndef MOESERVE_CORE_CUDA_CUDA_GROUPED_EXPERTS_H_
#define MOESERVE_CORE_CUDA_CUDA_GROUPED_EXPERTS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/cuda/cuda_backend.h"
#include "core/modular_kernel.h"
#include "core/weights.h"

namespace moeserve {

// OK when the grouped GEMM can run on CUDA device `device` (this build has it and the device is
// compute capability 9.0); else FAILED_PRECONDITION saying why.
absl::Status CudaGroupedSm90Supported(int device);

// Average routes per local expert from which the grouped path is faster than the decode kernels
// for this expert shape and weight format (a measured table; shapes not in it take the nearest
// measured one). fp8_activations: the W8A8 grouped path's crossover (MXFP8 only).
int64_t CudaGroupedCrossoverRoutes(int64_t hidden, int64_t intermediate, WeightFormat format,
                                   bool fp8_activations = false);

struct CudaGroupedExpertsOptions {
  enum class Path { kGrouped, kCrossover };
  Path path = Path::kCrossover;
  bool fp8_activations = false;                 // W8A8 for MXFP8 layers (above)
  std::string name = "CudaGroupedSm90Experts";  // Experts::name()
};

// INVALID_ARGUMENT without a context or weights; FAILED_PRECONDITION (kGrouped) where
// CudaGroupedSm90Supported fails; RESOURCE_EXHAUSTED (kGrouped) when the BF16 copy does not fit.
absl::StatusOr<std::unique_ptr<Experts>> CreateCudaGroupedExperts(
    std::shared_ptr<CudaContext> ctx, std::shared_ptr<const DeviceWeightStore> weights,
    const CudaGroupedExpertsOptions& options);

}  // namespace moeserve

#endif  // MOESERVE_CORE_CUDA_CUDA_GROUPED_EXPERTS_H_
