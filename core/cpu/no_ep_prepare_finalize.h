// PrepareAndFinalize for a single rank: no dispatch, identity combine.
#ifndef MOESERVE_CORE_CPU_NO_EP_PREPARE_FINALIZE_H_
#define MOESERVE_CORE_CPU_NO_EP_PREPARE_FINALIZE_H_

#include "core/modular_kernel.h"

namespace moeserve {

// Standard format. Prepare converts hidden states to quant_config.activation_dtype (the
// quantization hook; FP32 today, so BF16/FP16 input is upcast exactly) and maps expert ids
// through the expert map; Finalize applies the weight-and-reduce (Delegate -> Contiguous).
// Host memory, synchronous, not thread-safe.
class NoEpPrepareAndFinalize final : public PrepareAndFinalize {
 public:
  static constexpr absl::string_view kName = "NoEpPrepareAndFinalize";
  explicit NoEpPrepareAndFinalize(int64_t max_num_tokens, QuantConfig quant = {})
      : max_num_tokens_(max_num_tokens), quant_(quant) {}

  absl::string_view name() const override { return kName; }
  ActivationFormat activation_format() const override { return ActivationFormat::kStandard; }
  int64_t max_num_tokens_per_rank() const override { return max_num_tokens_; }
  int num_dispatchers() const override { return 1; }
  const QuantConfig& quant_config() const override { return quant_; }

  absl::Status Prepare(const PrepareArgs& args, PreparedActivations* out) override;
  absl::Status Finalize(const TensorView& output, const TensorView& fused_expert_output,
                        const PreparedActivations& prepared,
                        const TopKWeightAndReduce& weight_and_reduce) override;

 private:
  int64_t max_num_tokens_;
  QuantConfig quant_;
  HostBuffer a1q_, local_ids_;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_CPU_NO_EP_PREPARE_FINALIZE_H_
