// TopKWeightAndReduce implementations: NoOp, Contiguous, NaiveBatched, Delegate.
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/modular_kernel.h"
#include "kernels/cpu/moe_ref.h"

namespace moeserve {
namespace {

absl::Status CheckOutput(const TensorView& output, const TensorView& topk_weights,
                         const TensorView& topk_ids) {
  if (output.rank() != 2 || output.dtype() != DType::kFP32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TopKWeightAndReduce: output must be FP32 [M, K], got ", output.DebugString()));
  }
  if (topk_weights.rank() != 2 || topk_weights.dim(0) != output.dim(0) ||
      topk_ids.shape() != topk_weights.shape()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TopKWeightAndReduce: topk_weights/topk_ids must be [M, topk] with M=", output.dim(0),
        ", got ", topk_weights.DebugString(), " and ", topk_ids.DebugString()));
  }
  return absl::OkStatus();
}

class NoOp final : public TopKWeightAndReduce {
 public:
  Kind kind() const override { return Kind::kNoOp; }
  absl::Status Apply(const TensorView& output, const TensorView& in, const TensorView&,
                     const TensorView&) const override {
    if (in.shape() != output.shape()) {
      return absl::InvalidArgumentError(absl::StrCat("TopKWeightAndReduceNoOp: input ",
                                                     in.DebugString(), " must match output ",
                                                     output.DebugString()));
    }
    if (in.raw_data() != output.raw_data() && output.nbytes() > 0) {
      std::memcpy(output.raw_data(), in.raw_data(), output.nbytes());
    }
    return absl::OkStatus();
  }
};

class Contiguous final : public TopKWeightAndReduce {
 public:
  Kind kind() const override { return Kind::kContiguous; }
  absl::Status Apply(const TensorView& output, const TensorView& in, const TensorView& topk_weights,
                     const TensorView& topk_ids) const override {
    if (auto s = CheckOutput(output, topk_weights, topk_ids); !s.ok()) return s;
    const int64_t m = output.dim(0), k = output.dim(1), topk = topk_weights.dim(1);
    if (in.rank() != 3 || in.dim(0) != m || in.dim(1) != topk || in.dim(2) != k) {
      return absl::InvalidArgumentError(
          absl::StrCat("TopKWeightAndReduceContiguous: input must be [", m, ", ", topk, ", ", k,
                       "], got ", in.DebugString()));
    }
    kernels::TopKWeightAndReduceContiguousRef(in.data<float>(), topk_weights.data<float>(),
                                              topk_ids.data<int32_t>(), m, topk, k,
                                              output.data<float>());
    return absl::OkStatus();
  }
};

class NaiveBatched final : public TopKWeightAndReduce {
 public:
  Kind kind() const override { return Kind::kNaiveBatched; }
  absl::Status Apply(const TensorView& output, const TensorView& in, const TensorView& topk_weights,
                     const TensorView& topk_ids) const override {
    if (auto s = CheckOutput(output, topk_weights, topk_ids); !s.ok()) return s;
    const int64_t m = output.dim(0), k = output.dim(1), topk = topk_weights.dim(1);
    if (in.rank() != 3 || in.dim(2) != k) {
      return absl::InvalidArgumentError(
          absl::StrCat("TopKWeightAndReduceNaiveBatched: input must be [E, max_tokens, ", k,
                       "], got ", in.DebugString()));
    }
    const int64_t num_experts = in.dim(0), max_tokens = in.dim(1);
    std::vector<int64_t> next_row(num_experts, 0);
    float* out = output.data<float>();
    if (output.nbytes() > 0) std::memset(out, 0, output.nbytes());
    const int32_t* ids = topk_ids.data<int32_t>();
    const float* w = topk_weights.data<float>();
    for (int64_t t = 0; t < m; ++t) {
      for (int64_t j = 0; j < topk; ++j) {
        const int32_t e = ids[t * topk + j];
        if (e < 0) continue;
        if (e >= num_experts || next_row[e] >= max_tokens) {
          return absl::InternalError(absl::StrCat("TopKWeightAndReduceNaiveBatched: route (", t,
                                                  ", ", j, ") to expert ", e, " has no row in a [",
                                                  num_experts, ", ", max_tokens, "] batch"));
        }
        const float* row = in.data<float>() + (e * max_tokens + next_row[e]++) * k;
        const float wt = w[t * topk + j];
        for (int64_t h = 0; h < k; ++h) out[t * k + h] += wt * row[h];
      }
    }
    return absl::OkStatus();
  }
};

class Delegate final : public TopKWeightAndReduce {
 public:
  Kind kind() const override { return Kind::kDelegate; }
  absl::Status Apply(const TensorView&, const TensorView&, const TensorView&,
                     const TensorView&) const override {
    return absl::FailedPreconditionError(
        "TopKWeightAndReduceDelegate must be resolved by the PrepareAndFinalize");
  }
};

}  // namespace

absl::string_view TopKWeightAndReduce::name() const {
  switch (kind()) {
    case Kind::kNoOp:
      return "TopKWeightAndReduceNoOp";
    case Kind::kContiguous:
      return "TopKWeightAndReduceContiguous";
    case Kind::kNaiveBatched:
      return "TopKWeightAndReduceNaiveBatched";
    case Kind::kDelegate:
      return "TopKWeightAndReduceDelegate";
  }
  return "?";
}

std::unique_ptr<TopKWeightAndReduce> MakeTopKWeightAndReduce(TopKWeightAndReduce::Kind kind) {
  switch (kind) {
    case TopKWeightAndReduce::Kind::kNoOp:
      return std::make_unique<NoOp>();
    case TopKWeightAndReduce::Kind::kContiguous:
      return std::make_unique<Contiguous>();
    case TopKWeightAndReduce::Kind::kNaiveBatched:
      return std::make_unique<NaiveBatched>();
    case TopKWeightAndReduce::Kind::kDelegate:
      return std::make_unique<Delegate>();
  }
  return nullptr;
}

}  // namespace moeserve
