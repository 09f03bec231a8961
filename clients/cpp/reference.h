// Independent plain-loop reference for checking a server's Forward answers from the client side.
//
// Written separately from core/ and kernels/ (which clients may not use) so that it is a second
// implementation of the oracle, built only from the wire API: the experts' BF16 weights come from
// GetExpertWeights, and
//   out[t] = sum_k topk_weights[t, k] * w2_e @ (silu(gate_e @ x_t) * (up_e @ x_t)),  e = ids[t, k]
// with gate_e = w13_e rows [0, I), up_e = w13_e rows [I, 2I). Values are FP32; dot products
// accumulate in double so that the reference is at least as accurate as any FP32 server.
#ifndef MOESERVE_CLIENTS_CPP_REFERENCE_H_
#define MOESERVE_CLIENTS_CPP_REFERENCE_H_

#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/statusor.h"
#include "moeserve/v1/moeserve.pb.h"

namespace moeserve::client {

// One expert's weights in FP32 (decoded exactly from BF16).
struct ExpertWeightsF32 {
  int64_t hidden = 0;
  int64_t intermediate = 0;
  std::vector<float> w13;  // [2 * intermediate, hidden]: gate rows, then up rows
  std::vector<float> w2;   // [hidden, intermediate]
};

// Decodes and checks a GetExpertWeights reply: w13 [2I, H] and w2 [H, I] with matching H, I.
absl::StatusOr<ExpertWeightsF32> ExpertWeightsFromProto(const v1::GetExpertWeightsResponse& reply);

// out [num_tokens, hidden] = the MoE layer on hidden_states [num_tokens, hidden] with
// topk_ids / topk_weights [num_tokens, topk]. `experts` maps global expert id -> weights and must
// hold every id that appears in topk_ids (negative ids are skipped, as unrouted slots).
absl::Status ReferenceMoeForward(const float* hidden_states, int64_t num_tokens, int64_t hidden,
                                 const int32_t* topk_ids, const float* topk_weights, int64_t topk,
                                 const std::map<int, ExpertWeightsF32>& experts, float* out);

// ||actual - expected||_2 / ||expected||_2 (NaN if either has a NaN; 0 when both are all zero).
double RelativeL2Error(const float* actual, const float* expected, int64_t n);

}  // namespace moeserve::client

#endif  // MOESERVE_CLIENTS_CPP_REFERENCE_H_
